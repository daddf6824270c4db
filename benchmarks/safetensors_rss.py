"""How much memory a sender holds while it streams a safetensors checkpoint (CPU).

    python benchmarks/safetensors_rss.py --preset 0.6b --shard-mb 500

Writes the preset's weights (bf16) as a sharded checkpoint (shards + index, the layout
``save_pretrained`` writes), then streams it with ``SafetensorsSource`` from one process to
another over gloo and checks every tensor bitwise. The sender samples its own memory every
10 ms: anonymous memory (what it allocated: buckets, the tensor being packed) and
file-backed resident pages (the mapped checkpoint, which the kernel may drop at will).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time

import torch

from weightbus import CheckpointEngineRegistry, ModuleSink
from weightbus.comm import serve_store
from weightbus.integrations.safetensors import SafetensorsSource
from weightbus.runtime.local import Rendezvous, connect, spawn
from weightbus.tools.bench import BenchConfig


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile", "VmHWM"):
                out[k] = int(v.split()[0]) << 10
    return out


def _weights(preset: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = BenchConfig(scenario="disaggregated", preset=preset, gpu=False).shapes()
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes}


def write_checkpoint(preset: str, path: str, shard_mb: int) -> int:
    from safetensors.torch import save_file
    weights = _weights(preset)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for n, t in weights.items():
        if size and size + t.nbytes > shard_mb << 20:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += t.nbytes
    index = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        index.update({n: name for n in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    return len(shards)


def _run(rank: int, port: int, path: str, preset: str, bucket_mb: int) -> dict[str, object]:
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=120)
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if rank == 0 else "rollout", timeout=300,
                                          bucket_size=bucket_mb << 20)
    connect(engine, rdv, 1, 1)
    if rank == 1:
        weights = {n: torch.zeros_like(t) for n, t in _weights(preset).items()}
        rdv.all_gather(None)
        asyncio.run(ModuleSink(weights).load(engine.receive_weights()))
        want = _weights(preset)
        ok = all(torch.equal(weights[n], t) for n, t in want.items())
        engine.finalize(destroy_group=True)
        return {"ok": ok}
    base = _status()
    peak = dict(base)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for k, v in _status().items():
                peak[k] = max(peak[k], v)
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    rdv.all_gather(None)
    sampler.start()
    t0 = time.perf_counter()
    stats = asyncio.run(engine.send_weights(SafetensorsSource(path)))
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    engine.finalize(destroy_group=True)
    return {"base": base, "peak": peak, "seconds": seconds, "bytes": stats.bytes,
            "buckets": engine.num_buffers * (bucket_mb << 20)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="0.6b")
    ap.add_argument("--shard-mb", type=int, default=500)
    ap.add_argument("--bucket-mb", type=int, default=16)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as path:
        shards = write_checkpoint(a.preset, path, a.shard_mb)
        store = serve_store(600)  # the rendezvous the two processes meet on
        sender, receiver = spawn(_run, 2, (store.port, path, a.preset, a.bucket_mb), timeout=900)
    mib = 1 << 20
    grew = {k: (sender["peak"][k] - sender["base"][k]) / mib for k in ("RssAnon", "RssFile")}
    print("| preset | shards | GB sent | seconds | sender anonymous memory growth MiB | its buckets MiB "
          "| file-backed pages resident at peak MiB | check |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {a.preset} | {shards} | {sender['bytes'] / 1e9:.2f} | {sender['seconds']:.2f} "
          f"| {grew['RssAnon']:.0f} | {sender['buckets'] / mib:.0f} | {sender['peak']['RssFile'] / mib:.0f} "
          f"| {'OK' if receiver['ok'] else 'MISMATCH'} |")
