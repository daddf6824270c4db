"""``weightbus demo --rollout vllm``: FSDP2 trainer ranks -> a real vLLM engine.

Two trainer processes train a small Qwen2 (made here, never downloaded) with FSDP2 over
gloo; after every optimizer step :class:`~weightbus.manager.CheckpointEngineManager`
pauses vLLM (``keep``), moves the weights over a weightbus engine into vLLM's own
``load_weights`` (native ``weightbus`` backend), records the version and resumes. Each
update is checked: vLLM's greedy tokens for fixed prompts must equal those of the
trainers' transformers model, and differ from the previous version's. fp32 end to end,
so the two implementations agree token for token.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch

from weightbus.comm import free_port
from weightbus.sources import ModuleSource
from weightbus.worker import WeightbusWorker

PROMPTS = [[1, 2, 3, 4], [100, 7, 42], [5, 900, 17, 3, 64]]


def make_qwen2(path: str, *, hidden: int = 256, layers: int = 4, vocab: int = 4096) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def lm_train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int,
                  seq_len: int = 32) -> float:
    """One optimizer step of a transformers causal LM on random tokens (seeded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (4, seq_len), generator=g)
    ids = ids.to(next(model.parameters()).device)  # (the same tokens on any device)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def greedy_tokens(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    """What a transformers causal LM generates greedily (a collective for FSDP models:
    every rank runs it)."""
    model.eval()
    out = []
    with torch.no_grad():
        device = next(model.parameters()).device
        for p in prompts:
            ids = torch.tensor([p], device=device)
            for _ in range(n):
                nxt = model(input_ids=ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            out.append(ids[0, len(p):].tolist())
    model.train()
    return out


class FSDPTrainer(WeightbusWorker):
    """One trainer rank: a transformers Qwen2 sharded with FSDP2 over its own gloo world."""

    def __init__(self, rank: int, world: int, path: str, port: int):
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.rank = rank
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))  # CPU shards even where CUDA exists
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def train_step(self, step: int) -> float:
        return lm_train_step(self.model, self.opt, seed=100 * step + self.rank)

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        return greedy_tokens(self.model, prompts, n)

    def weights_source(self) -> ModuleSource:
        return ModuleSource(self.model)  # each shard is gathered only to the rank that packs it


def run_vllm_demo(trainers: int = 2, steps: int = 3, backend: str = "gloo", hidden: int = 256,
                  layers: int = 4, timeout: float = 120.0, bucket_mb: int | None = None,
                  ) -> list[dict[str, Any]]:
    """Runs the demo; returns one row per update (``verified``: vLLM == transformers).
    ``bucket_mb``: the engine's bucket size in MiB (None: its default)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import vllm

    from weightbus.integrations.vllm.rollouts import OfflineLLMRollout, VLLMEngineReplica
    from weightbus.manager import CheckpointEngineManager
    from weightbus.runtime.group import LocalWorkerGroup, call

    path = tempfile.mkdtemp(prefix="weightbus-demo-qwen2-")
    make_qwen2(path, hidden=hidden, layers=layers)
    llm = vllm.LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                   max_model_len=256, max_num_seqs=4, seed=0,
                   weight_transfer_config={"backend": "weightbus"})
    sp = vllm.SamplingParams(max_tokens=8, temperature=0, detokenize=False)

    def vllm_greedy() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    group = LocalWorkerGroup(FSDPTrainer, trainers, path, free_port(), name="trainer")
    replica = VLLMEngineReplica(OfflineLLMRollout(llm), name="vllm0")
    sizes = {} if bucket_mb is None else {"bucket_size": bucket_mb << 20}
    mgr = CheckpointEngineManager(backend, group, [replica], timeout=timeout, pause_mode="keep", **sizes)
    rows = []
    try:
        previous = vllm_greedy()
        for step in range(1, steps + 1):
            loss = call(group, "train_step", step, timeout=timeout)[0]
            report = mgr.update_weights(version=step)
            got = vllm_greedy()
            want = call(group, "greedy", PROMPTS, 8, timeout=timeout)[0]
            rows.append({"step": step, "loss": loss, "bytes": report.bytes, "seconds": report.seconds,
                         "transfer_seconds": report.phases["transfer"],
                         "version": llm.get_weight_version(),
                         "verified": got == want and got != previous
                         and llm.get_weight_version() == str(step)})
            previous = got
    finally:
        mgr.shutdown()
        group.shutdown()
        replica.shutdown()
        llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(path, ignore_errors=True)  # the model made for the demo: nothing left behind
    return rows
