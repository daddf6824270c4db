"""Update round trips into a real SGLang engine on GPUs: weightbus against SGLang's own
``update_weights_from_tensor`` (CUDA IPC) and ``update_weights_from_distributed`` (NCCL),
each with its ratio to one bulk copy of the bytes. Random weights of a real config
(Qwen3-1.7B, Qwen3-8B), as many layers as ``--layers`` says; SGLang starts with dummy
weights (``load_format="dummy"``) on GPU 0.

    python benchmarks/sglang_gpu.py --preset 8b --layers 36 --json rows.jsonl
    python benchmarks/sglang_gpu.py --table rows.jsonl            # the markdown table

Rows (one engine, medians of ``--updates`` after one warm-up):
- ``bulk copy``: one copy of the update's bytes on GPU 0 (the floor);
- ``weightbus colocated``: a trainer process on GPU 0 (beside SGLang), the manager's whole
  update (pause, CUDA IPC buckets loaded through SGLang's loaders, flush, version, resume);
- ``SGLang update_weights_from_tensor``: the same tensors (checkpoint names) on GPU 0 in this
  process, handed over in one call (CUDA IPC handles, SGLang's own load), and in verl's
  2 GiB buckets;
- ``weightbus nccl``: a trainer process on GPU 1, the manager's whole update over NCCL;
- ``SGLang update_weights_from_distributed``: the same tensors on GPU 1 in this process,
  broadcast one by one into SGLang's group (its own NCCL path).

Every update row ends with the engine generating one token (what the RL loop does next):
neither SGLang's own calls nor a CUDA IPC or NCCL receive wait for the GPU to finish, so a
row that stopped at the call's return would time the launches, not the update (an earlier
version of this script did, and reported SGLang's NCCL path at 513 GB/s, past the link).
The ``generate 1 token`` row is that step alone, to subtract.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import torch
from engine_timing import bulk_copy_s, median_s

from weightbus.worker import WeightbusWorker

#: Qwen3 configs (Hugging Face's config.json of each model)
CONFIGS = {
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
BUCKET = 2 << 30  # verl's update_weights_bucket_megabytes default


def _config(preset: str, layers: int):
    import transformers as tf
    cfg = tf.Qwen3Config(**{**CONFIGS[preset], "num_hidden_layers": layers}, max_position_embeddings=4096,
                         torch_dtype="bfloat16")
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def _named(model) -> dict[str, torch.Tensor]:
    """What a trainer sends: the checkpoint's tensors (a tied output projection once)."""
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


class RandomTrainer(WeightbusWorker):
    """Random weights of the config on ``device`` (bf16), sent under checkpoint names."""

    def __init__(self, rank, world, path, device):
        import transformers as tf
        torch.cuda.set_device(device)
        cfg = tf.AutoConfig.from_pretrained(path)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(device):
            self.model = tf.Qwen3ForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)

    def weights_source(self):
        from weightbus.sources import ModuleSource
        return ModuleSource(_named(self.model))


def run(preset: str, layers: int, updates: int, json_path: str | None) -> list[dict]:
    import sglang as sgl

    from weightbus.comm import free_port
    from weightbus.integrations.sglang import SGLangReplica, engine_args
    from weightbus.manager import CheckpointEngineManager
    from weightbus.runtime.group import LocalWorkerGroup

    path = tempfile.mkdtemp(prefix=f"wb-sgl-{preset}-")
    cfg = _config(preset, layers)
    cfg.save_pretrained(path)
    with torch.device("meta"):
        import transformers as tf
        meta = _named(tf.Qwen3ForCausalLM(cfg))
    nbytes = sum(t.numel() * 2 for t in meta.values())
    total = torch.cuda.get_device_properties(0).total_memory
    t0 = time.perf_counter()
    engine = sgl.Engine(**engine_args(
        model_path=path, load_format="dummy", dtype="bfloat16",
        mem_fraction_static=min(0.9, (nbytes + (4 << 30)) / total), disable_piecewise_cuda_graph=True,
        cuda_graph_max_bs=4, skip_tokenizer_init=True, log_level="error"))
    base = {"preset": preset, "layers": layers, "bytes": nbytes, "tensors": len(meta),
            "sglang": getattr(sgl, "__version__", "?"), "gpu": torch.cuda.get_device_name(0),
            "engine_start_s": round(time.perf_counter() - t0, 1)}
    rows: list[dict] = []
    copy_s = bulk_copy_s(nbytes, torch.device("cuda", 0))

    def row(name: str, med: float | None, runs: list[float], **extra) -> None:
        rows.append({**base, "row": name, "s": med, "runs": [round(r, 5) for r in runs], **extra,
                     "copy_ratio": round(med / copy_s, 2) if med else None})
        print(json.dumps(rows[-1]), flush=True)
        if json_path:
            with open(json_path, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")

    def settle() -> None:
        # (a forward pass after the update: the GPU has finished loading it when a token comes back)
        engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1, "temperature": 0.0})

    def guarded(name: str, fn) -> None:
        try:
            med, runs = median_s(lambda: (fn(), settle()), updates)
            row(name, med, runs)
        except Exception as e:  # noqa: BLE001 - a row that failed says why
            row(name, None, [], note=f"{type(e).__name__}: {str(e)[:300]}")

    row("bulk copy", copy_s, [copy_s])
    settle()
    med, runs = median_s(settle, updates)
    row("generate 1 token", med, runs)
    replica = SGLangReplica(engine, name="sglang0")
    version = [0]
    for mode, device in (("colocated", "cuda:0"), ("nccl", "cuda:1")):
        if mode == "nccl" and torch.cuda.device_count() < 2:
            break
        trainer = LocalWorkerGroup(RandomTrainer, 1, path, device, name=f"trainer-{mode}", start_timeout=600)
        mgr = CheckpointEngineManager(mode, trainer, [replica], timeout=600, pause_mode="abort")

        def wb_update(mgr=mgr):
            version[0] += 1
            mgr.update_weights(version=version[0])
        guarded(f"weightbus {mode}", wb_update)
        mgr.shutdown()
        trainer.shutdown()

        # SGLang's own path, from tensors of the same names and shapes in this process
        named = {n: torch.empty(t.shape, dtype=torch.bfloat16, device=device).normal_()
                 for n, t in meta.items()}
        if mode == "colocated":
            one_call, bucketed = _tensor_paths(engine, named)
            guarded("SGLang update_weights_from_tensor (one call)", one_call)
            guarded("SGLang update_weights_from_tensor (2 GiB buckets, as verl)", bucketed)
        else:
            guarded("SGLang update_weights_from_distributed", _distributed(engine, named, free_port()))
        del named
        torch.cuda.empty_cache()
    replica.shutdown()
    engine.shutdown()
    return rows


def _tensor_paths(engine, named: dict[str, torch.Tensor]):
    """SGLang's own CUDA IPC path: every tensor in one call, and in verl's 2 GiB buckets."""
    items = list(named.items())
    buckets: list[list] = [[]]
    size = 0
    for item in items:
        if buckets[-1] and size + item[1].numel() * 2 > BUCKET:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += item[1].numel() * 2

    def one_call():
        engine.update_weights_from_tensor(items, flush_cache=True)

    def bucketed():
        for i, b in enumerate(buckets):
            engine.update_weights_from_tensor(b, flush_cache=i == len(buckets) - 1)
    return one_call, bucketed


def _distributed(engine, named: dict[str, torch.Tensor], port: int):
    """SGLang's own NCCL path: this process is rank 0 of SGLang's weight-update group."""
    from sglang.srt.utils import init_custom_process_group
    group = "wb_bench"
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("r", engine.init_weights_update_group(
        "127.0.0.1", port, 1, 2, group, backend="nccl")), daemon=True)
    th.start()
    pg = init_custom_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                   rank=0, group_name=group)
    th.join()
    names = list(named)
    dtypes = ["bfloat16"] * len(names)
    shapes = [list(t.shape) for t in named.values()]

    def update():
        out: dict = {}
        th = threading.Thread(target=lambda: out.setdefault("r", engine.update_weights_from_distributed(
            names, dtypes, shapes, group, flush_cache=True)), daemon=True)
        th.start()
        for t in named.values():
            torch.distributed.broadcast(t, src=0, group=pg)
        torch.cuda.synchronize(next(iter(named.values())).device)
        th.join()
        ok = out.get("r", (False, "no answer"))
        if not ok[0]:
            raise RuntimeError(f"update_weights_from_distributed: {ok[1]}")
    return update


def table(paths: list[str]) -> str:
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    out = ["| SGLang | GPU | model | row | median ms | runs ms | x bulk copy |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        model = f"{r['preset']}/{r['layers']}L {r['bytes'] / 1e9:.2f} GB, {r['tensors']} tensors"
        med = f"{r['s'] * 1e3:.1f}" if r.get("s") else "-"
        runs = " ".join(f"{x * 1e3:.1f}" for x in r.get("runs", [])) or r.get("note", "")
        gpu = r["gpu"].removeprefix("NVIDIA ")
        ratio = r.get("copy_ratio") or "-"
        out.append(f"| {r['sglang']} | {gpu} | {model} | {r['row']} | {med} | {runs} | {ratio} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", choices=list(CONFIGS), default="1.7b")
    p.add_argument("--layers", type=int, default=None, help="default: the model's own count")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--table", nargs="*", default=None)
    a = p.parse_args()
    if a.table is not None:
        print(table(a.table))
        return 0
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # (SGLang's processes run with 0: NCCL peers must agree)
    run(a.preset, a.layers or CONFIGS[a.preset]["num_hidden_layers"], a.updates, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
