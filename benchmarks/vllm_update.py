"""Update time into a real vLLM engine (CPU build), through the manager: a transformers
trainer (fp32, real optimizer steps) -> gloo -> vLLM's load_weights (bf16).

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/vllm_update.py --size tiny --size 0.5b
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from weightbus import ModuleSource
from weightbus.manager import CheckpointEngineManager
from weightbus.runtime.group import LocalWorkerGroup, call
from weightbus.worker import WeightbusWorker

SIZES = {  # Qwen2 shapes; 0.5b is Qwen2.5-0.5B's config (494M parameters, tied embeddings)
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
}


class Trainer(WeightbusWorker):
    def __init__(self, rank: int, world: int, path: str):
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def step(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.neg_()

    def weights_source(self) -> ModuleSource:
        sd = dict(self.model.state_dict())
        if self.model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return ModuleSource(sd, dtype=torch.bfloat16)


def run(size: str, updates: int) -> dict:
    import vllm
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from weightbus.integrations.vllm import VLLMReplica
    path = tempfile.mkdtemp(prefix=f"qwen2-{size}-")
    cfg = Qwen2Config(**SIZES[size], head_dim=64, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    t0 = time.perf_counter()
    llm = vllm.LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                   max_model_len=256, max_num_seqs=4,
                   worker_extension_cls="weightbus.integrations.vllm.WeightbusWorkerExtension")
    start = time.perf_counter() - t0
    trainer = LocalWorkerGroup(Trainer, 1, path, name="trainer")
    mgr = CheckpointEngineManager("gloo", trainer, [VLLMReplica(llm)], timeout=600)
    try:
        first = mgr.update_weights(version=0)
        totals, transfers = [], []
        for v in range(1, updates + 1):
            call(trainer, "step", timeout=600)
            r = mgr.update_weights(version=v)
            totals.append(r.seconds)
            transfers.append(r.phases["transfer"])
        return {"size": size, "params": sum(p.numel() for p in Qwen2ForCausalLM(cfg).parameters()),
                "bytes": r.bytes, "engine_start_s": start, "first_update_s": first.seconds,
                "update_s": statistics.median(totals), "transfer_s": statistics.median(transfers)}
    finally:
        mgr.shutdown()
        trainer.shutdown()
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    p = argparse.ArgumentParser()
    p.add_argument("--size", action="append", choices=list(SIZES))
    p.add_argument("--updates", type=int, default=3)
    a = p.parse_args()
    rows = [run(s, a.updates) for s in a.size or ["tiny"]]
    print(f"{'size':<6} {'params':>12} {'MB bf16':>8} {'vLLM start s':>12} {'1st update s':>12} "
          f"{'update s':>9} {'transfer s':>10} {'GB/s':>6}")
    for r in rows:
        print(f"{r['size']:<6} {r['params']:>12,} {r['bytes'] / 1e6:>8.1f} {r['engine_start_s']:>12.1f} "
              f"{r['first_update_s']:>12.2f} {r['update_s']:>9.3f} {r['transfer_s']:>10.3f} "
              f"{r['bytes'] / r['transfer_s'] / 1e9:>6.2f}")
