"""vLLM as the RL frameworks run it, on real GPUs: one case per process (an engine per
case; `tests/test_vllm_gpu.py` runs each in its own process group and ends it by its id).

    python tests/vllm_gpu_cases.py hybrid|nccl|tp2|fp8 [--cpu]

- ``hybrid``: a Qwen3-MoE trainer and vLLM on one GPU, vLLM asleep while the trainer takes
  real AdamW steps (sleep level 1, then level 2, where vLLM frees its weights and
  allocates them anew), weights woken before the KV cache, the update written over CUDA
  IPC (``colocated``) into vLLM's own parameters; the GPU memory the update adds reported;
- ``nccl``: trainer on GPU 0, vLLM on GPU 1 over weightbus's ``nccl`` engine, CUDA graphs on;
- ``tp2``: trainer on GPU 0, vLLM at TP=2 on GPUs 1 and 2, each worker receiving only its
  shards (sharded receive over ``nccl``);
- ``fp8``: a block-fp8 Qwen3 served by vLLM, fed from a bf16 trainer through
  ``QuantizedSource``.

After every update: vLLM's weight version is the step; every parameter vLLM holds equals
bitwise what vLLM's own loader makes of the trainer's checkpoint (``reload_weights`` from
a ``save_pretrained`` of the same weights; for fp8, of the same weights quantized); and
(bf16/fp32 cases) vLLM's greedy tokens equal a transformers model's holding the same
weights. ``--cpu`` runs the same logic on vLLM's CPU build (gloo for nccl, shared memory
for CUDA IPC, no sleep), which is how the script itself is checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

#: the GPUs each case needs, as CUDA_VISIBLE_DEVICES (vLLM takes the first; the trainer the last)
GPUS = {"hybrid": "0", "nccl": "1,0", "tp2": "1,2,0", "fp8": "0"}
PROMPTS = [[1, 2, 3, 4], [100, 7, 42], [5]]


def _config(kind: str, dtype: str):
    import transformers as tf
    common = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                  tie_word_embeddings=False)
    if kind == "moe":  # Qwen3-30B-A3B's layout (every layer sparse, top-k of many experts),
        # large enough (0.4 GB fp32) that the memory an update adds is measured, not noise
        return tf.Qwen3MoeConfig(**{**common, "hidden_size": 1024, "num_hidden_layers": 4},
                                 intermediate_size=2048, moe_intermediate_size=512, num_experts=16,
                                 num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                 norm_topk_prob=True)
    return tf.Qwen3Config(**common, intermediate_size=512)


class Case:
    """One engine and one trainer, checked after every update."""

    def __init__(self, name: str, cpu: bool, kind: str = "dense", dtype: str = "float32"):
        import torch
        self.name, self.cpu, self.kind, self.dtype = name, cpu, kind, dtype
        self.dir = tempfile.mkdtemp(prefix=f"wb-{name}-")
        self.path = os.path.join(self.dir, "model")
        self.device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.device_count() - 1)
        if not cpu:
            torch.cuda.set_device(self.device)
        self.rows: dict = {"case": name}

    # the trainer -----------------------------------------------------------------
    def make_trainer(self, seed: int = 0):
        import torch
        import transformers as tf
        cfg = _config(self.kind, self.dtype)
        torch.manual_seed(seed)
        cls = tf.Qwen3MoeForCausalLM if self.kind == "moe" else tf.Qwen3ForCausalLM
        model = cls(cfg).to(getattr(torch, self.dtype))
        model.save_pretrained(self.path)
        self.model = model.to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2)

    def train_step(self, step: int) -> float:
        from weightbus.integrations.vllm.demo import lm_train_step
        return lm_train_step(self.model, self.opt, seed=step, seq_len=24)

    # the engine ------------------------------------------------------------------
    def make_llm(self, **kw):
        import vllm
        args = dict(model=self.path, dtype=self.dtype, skip_tokenizer_init=True, max_model_len=128,
                    max_num_seqs=4, seed=0, weight_transfer_config={"backend": "weightbus"})
        if not self.cpu:
            args["gpu_memory_utilization"] = kw.pop("gpu_memory_utilization", 0.3)
        else:
            kw.pop("gpu_memory_utilization", None)
            kw.pop("enable_sleep_mode", None)
        args.update(kw)
        args.setdefault("enforce_eager", True)
        t0 = time.perf_counter()
        self.llm = vllm.LLM(**args)
        self.rows["engine_start_s"] = round(time.perf_counter() - t0, 1)
        self.rows["vllm"] = vllm.__version__
        from weightbus.integrations.vllm import OfflineLLMRollout, RolloutClient
        self.rollout = OfflineLLMRollout(self.llm)
        self.client = RolloutClient([self.rollout], timeout=300)
        return self.llm

    def connect(self, transport: str, source=None, **info):
        from weightbus.comm import free_port
        from weightbus.integrations.hf import HFCheckpointSource
        from weightbus.integrations.vllm import WeightbusTrainerInitInfo, trainer_init
        if self.cpu and transport == "nccl":
            transport = "gloo"
        self.transport = transport
        self.info = WeightbusTrainerInitInfo(rank=0, world_size=1, master_address="127.0.0.1",
                                             rollout_world_size=self.client.rollout_world_size,
                                             master_port=free_port(), transport=transport, timeout=300,
                                             **info)
        self.engine = trainer_init(self.info, client=self.client,
                                   source=source if source is not None else HFCheckpointSource(self.model))

    # checks ----------------------------------------------------------------------
    def digests(self) -> dict:
        return self.llm.collective_rpc(_digests)

    def fresh_digests(self, path: str) -> dict:
        """What vLLM's own loader makes of the checkpoint at ``path`` (the update's weights,
        saved), read back the same way."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        return self.digests()

    def greedy(self) -> list:
        import vllm
        sp = vllm.SamplingParams(max_tokens=8, temperature=0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def hf_disagrees(self, tokens: list, tol: float = 1e-3) -> str | None:
        """Where transformers, fed vLLM's own tokens, would have chosen another one: a token
        that is not transformers' argmax, unless within ``tol`` of it (a tie that another
        kernel's rounding breaks the other way). None where it agrees throughout."""
        import torch
        self.model.eval()
        try:
            with torch.no_grad():
                for p, toks in zip(PROMPTS, tokens, strict=True):
                    logits = self.model(input_ids=torch.tensor([p + toks], device=self.device)).logits[0]
                    for i, t in enumerate(toks):
                        row = logits[len(p) - 1 + i].float()
                        gap = float(row.max() - row[t])
                        if gap > tol:
                            return f"prompt {p}, token {i}: vLLM {t}, transformers {int(row.argmax())} " \
                                   f"(logit gap {gap:.3g})"
        finally:
            self.model.train()
        return None

    def check(self, step: int, served_path: str | None = None, greedy: bool = True) -> None:
        """vLLM serves version ``step``, holds what its own loader makes of the trainer's
        weights (bitwise, every parameter), and generates what transformers does."""
        assert self.rollout.weight_version() == str(step), (self.rollout.weight_version(), step)
        got = self.digests()
        tokens = self.greedy()
        self.rows["tokens"] = tokens
        if greedy:
            why = self.hf_disagrees(tokens)
            assert why is None, f"version {step}: vLLM's greedy tokens are not transformers': {why}"
        if self.cpu and self.kind == "moe":
            # vLLM's CPU reload skips its MoE experts' repacking (see weightbus's
            # integrations/vllm/processing.py): no reference there; the tokens are
            self.rows.setdefault("checked", []).append(step)
            return
        if served_path is None:
            served_path = os.path.join(self.dir, f"step{step}")
            self.model.save_pretrained(served_path)
        want = self.fresh_digests(served_path)
        for rank, (g, w) in enumerate(zip(got, want, strict=True)):
            bad = [n for n in w if g.get(n) != w[n]]
            assert g.keys() == w.keys() and not bad, f"worker {rank}, version {step}: {bad[:5]} differ"
        assert self.greedy() == tokens, "the fresh load generates otherwise"
        self.rows.setdefault("checked", []).append(step)

    def close(self) -> None:
        import shutil
        for what in ("engine",):
            if hasattr(self, what):
                try:
                    getattr(self, what).shutdown()
                except Exception as e:  # noqa: BLE001 - the result is already decided
                    print(f"(closing {what}: {e})")
        if hasattr(self, "llm"):
            self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.dir, ignore_errors=True)


def _digests(worker) -> dict:
    """Runs in a vLLM worker: a bitwise digest of every parameter it holds."""
    from weightbus.tools.demo import digest
    return {n: digest(p) for n, p in worker.model_runner.model.named_parameters()}


def _memory(worker, start: bool) -> int:
    """Runs in a vLLM worker: reset the peak of the GPU memory torch allocated; at the end,
    how far it rose above where it began (bytes)."""
    import torch
    if not torch.cuda.is_available():
        return 0
    if start:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        worker._wb_mem0 = torch.cuda.memory_allocated()
        return 0
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - worker._wb_mem0


# ------------------------------------------------------------------ the cases


def hybrid(c: Case) -> None:
    import torch
    c.make_trainer()
    c.make_llm(enable_sleep_mode=True)
    c.connect("colocated", self_check_every=0)  # (the self-check holds copies of layers: not here)
    nbytes = c.engine.source.manifest.nbytes
    c.rows.update(model_bytes=nbytes, updates=[])
    for step, level in ((1, 1), (2, 1), (3, 2)):
        if not c.cpu:
            c.rollout.sleep(level)  # vLLM's weights offloaded (1) or discarded (2), its KV cache freed
        c.rows.setdefault("losses", []).append(round(c.train_step(step), 4))
        if not c.cpu:
            c.rollout.wake_up(["weights"])  # the weights first: never beside a KV cache
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        c.llm.collective_rpc(_memory, args=(True,))
        t0 = time.perf_counter()
        stats = c.engine.send_weights(step)
        took = time.perf_counter() - t0
        worker_peak = max(c.llm.collective_rpc(_memory, args=(False,)))
        trainer_peak = 0 if c.cpu else torch.cuda.max_memory_allocated() - base
        if not c.cpu:
            c.rollout.wake_up(["kv_cache"])
        c.rows["updates"].append({"step": step, "sleep_level": level, "s": round(took, 4),
                                  "bytes": stats.bytes, "worker_peak_mb": round(worker_peak / 1e6, 1),
                                  "trainer_peak_mb": round(trainer_peak / 1e6, 1)})
        # no second copy of the model on either side: the trainer's ring and vLLM's
        # layer-at-a-time processing only
        assert worker_peak < 0.5 * nbytes and trainer_peak < 0.5 * nbytes, c.rows["updates"][-1]
        c.check(step)


def nccl(c: Case) -> None:
    from weightbus.integrations.vllm import sync_weights
    c.make_trainer()
    c.make_llm(enforce_eager=c.cpu)  # CUDA graphs on (the weights are written in place)
    c.connect("nccl")
    before = c.greedy()
    for step in (1, 2, 3):
        c.rows.setdefault("losses", []).append(round(c.train_step(step), 4))
        stats = sync_weights(c.engine, c.client, version=step)
        c.rows.setdefault("updates", []).append({"step": step, "bytes": stats.bytes,
                                                 "s": round(stats.seconds, 4)})
        c.check(step)
        assert c.rows["tokens"] != before, "the weights did not change what vLLM generates"
        before = c.rows["tokens"]


def tp2(c: Case) -> None:
    from weightbus.integrations.vllm import sync_weights
    if c.cpu:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    c.make_trainer()
    c.make_llm(tensor_parallel_size=2)
    c.connect("nccl")  # sharded receive: the default where a replica has several workers
    for step in (1, 2, 3):
        c.train_step(step)
        stats = sync_weights(c.engine, c.client, version=step)
        got = [s["bytes"] for s in c.engine.rollout_stats]
        fallbacks = [s.get("fallbacks") for s in c.engine.rollout_stats]
        c.rows.setdefault("updates", []).append({"step": step, "sent": stats.bytes, "worker_bytes": got,
                                                 "fallbacks": fallbacks})
        assert all(b < 0.7 * stats.bytes for b in got), f"a worker received more than its shard: {got}"
        c.check(step)


def fp8(c: Case) -> None:
    """A block-fp8 checkpoint made from the trainer's bf16 weights is what vLLM serves; the
    update quantizes on the trainer and lands what vLLM's own load of that checkpoint does."""
    from weightbus.integrations.hf import HFCheckpointSource
    from weightbus.quant import QuantizedSource
    c.dtype = "bfloat16"
    c.make_trainer()
    formats = _fp8_formats(c.model)
    _save_fp8(c.model, formats, c.path)
    c.make_llm()
    c.connect("colocated", source=QuantizedSource(HFCheckpointSource(c.model), formats))
    for step in (1, 2):
        c.train_step(step)
        c.engine.source = QuantizedSource(HFCheckpointSource(c.model), formats)
        stats = c.engine.send_weights(step)
        served = os.path.join(c.dir, f"fp8-step{step}")
        _save_fp8(c.model, formats, served)
        c.rows.setdefault("updates", []).append({"step": step, "bytes": stats.bytes,
                                                 "bf16_bytes": HFCheckpointSource(c.model).manifest.nbytes})
        c.check(step, served_path=served, greedy=False)  # (fp8 generates otherwise than bf16)
    held = c.llm.collective_rpc(_dtypes)[0]
    assert any("float8" in d for d in held.values()), f"vLLM holds no fp8 weight: {held}"


def _fp8_formats(model) -> dict:
    from weightbus.integrations.hf import HFCheckpointSource
    from weightbus.quant import Fp8Format
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {m.name: Fp8Format("block") for m in HFCheckpointSource(model).manifest
            if m.name.endswith(".weight") and m.name.split(".")[-2] in linear}


def _save_fp8(model, formats: dict, path: str) -> None:
    """The trainer's weights as a block-fp8 checkpoint (the layout of Qwen3's FP8 models)."""
    import json as _json

    from safetensors.torch import save_file

    from weightbus.integrations.hf import checkpoint_state_dict
    os.makedirs(path, exist_ok=True)
    out = {}
    for name, t in checkpoint_state_dict(model).items():
        if name in formats:
            q, s = formats[name].quantize(t.detach())
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = q.cpu(), s.cpu()
        else:
            out[name] = t.detach().cpu().contiguous()
    save_file(out, os.path.join(path, "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [128, 128]}
    with open(os.path.join(path, "config.json"), "w") as f:
        _json.dump(cfg, f)


def _dtypes(worker) -> dict:
    return {n: str(p.dtype) for n, p in worker.model_runner.model.named_parameters()}


CASES = {"hybrid": (hybrid, "moe", "float32"), "nccl": (nccl, "dense", "float32"),
         "tp2": (tp2, "dense", "float32"), "fp8": (fp8, "dense", "bfloat16")}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=list(CASES))
    p.add_argument("--cpu", action="store_true", help="vLLM's CPU build: gloo and shared memory")
    a = p.parse_args()
    if not a.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = GPUS[a.case]
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(functions)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if not a.cpu:  # each update also re-checked against vLLM's first-load processing of 2 layers
        os.environ.setdefault("WEIGHTBUS_VLLM_SELF_CHECK", "1:2")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    fn, kind, dtype = CASES[a.case]
    c = Case(a.case, a.cpu, kind, dtype)
    ok = False
    try:
        fn(c)
        ok = True
    finally:
        c.rows["ok"] = ok
        print("RESULT " + json.dumps(c.rows), flush=True)
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
