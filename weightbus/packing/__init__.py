"""The data path under every engine: buckets packed and unpacked (buffers), the pieces of
sharded tensors (shards), and the native copies (a C copy list on the host, a Triton one on a GPU)."""
