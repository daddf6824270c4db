"""Delta updates into a real vLLM engine (CPU build), next to dense ones of the same run:
a trainer process holding a Qwen2 in bf16 changes a fraction of every tensor's elements by
one bf16 step before each update; the manager updates vLLM (worker extension, gloo) first
dense, then in delta mode (patches into each worker's shadow copy, then vLLM's
``load_weights``). Every update is checked: vLLM's weights, read back, equal the trainer's.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/vllm_delta.py --size 0.5b
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from weightbus import ModuleSource
from weightbus.worker import WeightbusWorker

SIZES = {  # Qwen2 shapes (0.5b: Qwen2.5-0.5B's, tied embeddings)
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, head_dim=64),
}


class Trainer(WeightbusWorker):
    """A bf16 transformers model whose steps change ``fraction`` of every tensor's elements."""

    def __init__(self, rank: int, world: int, path: str):
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)

    def step(self, seed: int, fraction: float) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                flat = p.view(-1).view(torch.int16)
                idx = torch.randint(0, flat.numel(), (max(1, round(flat.numel() * fraction)),), generator=g)
                flat[idx] += 1  # one bf16 step

    def checksum(self) -> list[float]:
        return _probe(self.model.state_dict())

    def weights_source(self) -> ModuleSource:
        sd = dict(self.model.state_dict())
        if self.model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return ModuleSource(sd)


PROBED = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight"]


def _probe(sd: dict) -> list[str]:
    """Hashes of a few weights' bytes (ones vLLM keeps in the checkpoint's layout)."""
    import hashlib
    return [hashlib.sha256(sd[n].detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for n in PROBED]


def _vllm_probe(worker) -> list[str]:
    return _probe(dict(worker.model_runner.model.named_parameters()))


def run(size: str, updates: int, fraction: float) -> dict:
    import vllm
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from weightbus.integrations.vllm import VLLMReplica
    from weightbus.manager import CheckpointEngineManager
    from weightbus.runtime.group import LocalWorkerGroup, call

    path = tempfile.mkdtemp(prefix=f"vllm-delta-{size}-")
    cfg = Qwen2Config(**SIZES[size], max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    torch.set_default_dtype(torch.float32)
    llm = vllm.LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                   max_model_len=256, max_num_seqs=4,
                   worker_extension_cls="weightbus.integrations.vllm.WeightbusWorkerExtension")
    trainer = LocalWorkerGroup(Trainer, 1, path, name="trainer")
    replica = VLLMReplica(llm, name="vllm0")
    row: dict = {"size": size, "fraction": fraction}
    seed = 0
    try:
        for mode in ("dense", "delta"):
            mgr = CheckpointEngineManager("gloo", trainer, [replica], timeout=600, delta=mode == "delta")
            times, wire = [], []
            try:
                for u in range(updates + 1):  # the first one warms up (and goes whole in delta mode)
                    seed += 1
                    call(trainer, "step", seed, fraction, timeout=600)
                    t0 = time.perf_counter()
                    report = mgr.update_weights(version=seed)
                    took = time.perf_counter() - t0
                    want = call(trainer, "checksum", timeout=600)[0]
                    got = llm.collective_rpc(_vllm_probe)[0]
                    assert got == want, f"{mode} update {seed}: vLLM {got} != trainer {want}"
                    if u:
                        times.append(took)
                        wire.append(report.wire_bytes)
                        if mode == "delta":
                            assert report.delta, report
            finally:
                mgr.shutdown()
            row[f"{mode}_s"] = statistics.median(times)
            row[f"{mode}_wire"] = statistics.median(wire)
        return row
    finally:
        trainer.shutdown()
        replica.shutdown()
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(_vllm_probe)
    p = argparse.ArgumentParser()
    p.add_argument("--size", action="append", choices=list(SIZES))
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--fraction", type=float, default=0.02)
    a = p.parse_args()
    rows = [run(s, a.updates, a.fraction) for s in a.size or ["tiny"]]
    print(f"{'size':<6} {'changed':>8} {'dense s':>8} {'delta s':>8} {'delta/dense':>11} "
          f"{'wire of dense':>13}")
    for r in rows:
        print(f"{r['size']:<6} {r['fraction']:>8.1%} {r['dense_s']:>8.3f} {r['delta_s']:>8.3f} "
              f"{r['delta_s'] / r['dense_s']:>10.2f}x {r['delta_wire'] / r['dense_wire']:>12.1%}")
