"""SGLang as verl and AReaL run it, on real GPUs: one case per process (an engine per case;
`tests/test_sglang_gpu.py` runs each in its own process group and ends it by its id).

    python tests/sglang_gpu_cases.py hybrid|nccl|tp2

- ``hybrid``: a Qwen3-MoE trainer and SGLang on one GPU; SGLang's memory released
  (``release_memory_occupation``: weights, KV cache, CUDA graphs) while the trainer takes
  real AdamW steps, its weights (and graphs) taken back before the update and the KV cache
  after it; the update written over CUDA IPC (weightbus ``colocated``) into SGLang's own
  parameters through its loaders; the GPU memory the update adds reported;
- ``nccl``: trainer on GPU 1, SGLang on GPU 0 over weightbus's ``nccl`` engine, CUDA graphs
  on; a renamed tensor and a wrong shape refused, the served weights and version kept,
  the next update landing;
- ``tp2``: SGLang at TP=2 on GPUs 0-1, trainer on the CPU over ``gloo``: each TP worker
  loads its own slices through SGLang's loaders.

After every update: SGLang's weight version is the step; every parameter of every TP worker
equals bitwise what SGLang's own load of the trainer's checkpoint makes
(``update_weights_from_disk`` of a ``save_pretrained`` of the same weights, digests read
through weightbus's hook); SGLang's greedy tokens are the same after both loads, and are
compared with a transformers model holding the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from weightbus.worker import WeightbusWorker

#: the GPUs each case sees (SGLang takes the first ones; the trainer the last, or the CPU)
GPUS = {"hybrid": "0", "nccl": "0,1", "tp2": "0,1"}
PROMPTS = [[1, 2, 3, 4], [100, 7, 42], [5]]
T = 300  # seconds, every wait


def _config(kind: str):
    import transformers as tf
    common = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                  tie_word_embeddings=False)
    if kind == "moe":  # Qwen3-30B-A3B's layout (every layer sparse, top-k of many experts)
        return tf.Qwen3MoeConfig(**{**common, "hidden_size": 1024, "num_hidden_layers": 4},
                                 intermediate_size=2048, moe_intermediate_size=512, num_experts=16,
                                 num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                 norm_topk_prob=True)
    return tf.Qwen3Config(**common, intermediate_size=512)


class GPUTrainer(WeightbusWorker):
    """A transformers model taking real AdamW steps (bf16 weights: what SGLang serves)."""

    def __init__(self, rank, world, kind, path, device):
        import transformers as tf
        torch.manual_seed(0)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        cfg = _config(kind)
        cls = tf.Qwen3MoeForCausalLM if kind == "moe" else tf.Qwen3ForCausalLM
        cfg.architectures = [cls.__name__]
        self.model = cls(cfg).to(device=self.device, dtype=torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.extra = {}
        self.save(path)

    def save(self, path):
        self.model.save_pretrained(path)
        return path

    def train_step(self, step):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, self.model.config.vocab_size, (2, 32), generator=g).to(self.device)
        for _ in range(3):
            loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
        return float(loss)

    def greedy(self, prompts, n):
        out = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p], device=self.device)
                for _ in range(n):
                    nxt = self.model(input_ids=ids).logits[0, -1].argmax()
                    ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
                out.append(ids[0, len(p):].tolist())
        return out

    def set_extra(self, extra):
        self.extra = {k: torch.ones(shape, dtype=torch.bfloat16, device=self.device)
                      for k, shape in extra.items()}

    def weights_source(self):
        from weightbus.integrations.hf import HFCheckpointSource
        from weightbus.sources import ModuleSource
        if not self.extra:
            return HFCheckpointSource(self.model)
        return ModuleSource({**dict(HFCheckpointSource(self.model)), **self.extra})


class Case:
    def __init__(self, name: str, kind: str, backend: str, tp: int, trainer_device: str, hybrid: bool):
        import sglang as sgl

        from weightbus.integrations.sglang import SGLangReplica, engine_args
        from weightbus.manager import CheckpointEngineManager
        from weightbus.runtime.group import LocalWorkerGroup, call
        self.call = call
        self.name, self.hybrid = name, hybrid
        self.dir = tempfile.mkdtemp(prefix=f"wb-sgl-{name}-")
        self.path = os.path.join(self.dir, "model")
        self.rows: dict = {"case": name, "kind": kind, "backend": backend, "tp": tp, "checked": []}
        self.trainer = LocalWorkerGroup(GPUTrainer, 1, kind, self.path, trainer_device, name="trainer",
                                        start_timeout=T)
        t0 = time.perf_counter()
        self.engine = sgl.Engine(**engine_args(
            model_path=self.path, dtype="bfloat16", tp_size=tp, mem_fraction_static=0.3,
            enable_memory_saver=hybrid, disable_piecewise_cuda_graph=True, cuda_graph_max_bs=4,
            skip_tokenizer_init=True, random_seed=0, log_level="error"))
        self.rows["engine_start_s"] = round(time.perf_counter() - t0, 1)
        self.replica = SGLangReplica(self.engine, name="sglang0")
        self.mgr = CheckpointEngineManager(backend, self.trainer, [self.replica], timeout=T,
                                           pause_mode="abort", hybrid=hybrid)

    def generate(self) -> list[list[int]]:
        outs = self.engine.generate(input_ids=PROMPTS, sampling_params={
            "temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        return [o["output_ids"] for o in outs]

    def update(self, step: int) -> None:
        t0 = time.perf_counter()
        report = self.mgr.update_weights(version=step)
        peak = max(st.get("peak_added_bytes", 0) for st in self.replica.last_stats)
        self.rows.setdefault("updates", []).append(
            {"step": step, "s": round(time.perf_counter() - t0, 4), "bytes": report.bytes,
             "worker_peak_added_mb": round(peak / 1e6, 2),
             "phases": {k: round(v, 4) for k, v in report.phases.items()}})

    def check(self, step: int) -> None:
        assert self.replica.weight_version() == step, (self.replica.weight_version(), step)
        got = self.replica.digests()
        tokens = self.generate()
        ckpt = self.call(self.trainer, "save", os.path.join(self.dir, f"step{step}"), timeout=T)[0]
        ok, msg = self.engine.update_weights_from_disk(ckpt)[:2]
        assert ok, msg
        ref = self.replica.digests()
        for r, (a, b) in enumerate(zip(got, ref, strict=True)):
            bad = [n for n in b if a.get(n) != b[n]]
            assert not bad and set(a) == set(b), f"TP rank {r}: {len(bad)} parameters differ from SGLang's " \
                                                 f"own load of the same checkpoint: {bad[:5]}"
        again = self.generate()
        assert tokens == again, (tokens, again)
        hf = self.call(self.trainer, "greedy", PROMPTS, 8, timeout=T)[0]
        self.rows["checked"].append(step)
        self.rows.setdefault("tokens", []).append({"step": step, "sglang": tokens, "transformers": hf,
                                                   "equal": tokens == hf})

    def refusals(self, step: int) -> None:
        """A renamed tensor, then a wrong shape: refused, weights and version kept."""
        from weightbus.manager import UpdateFailed
        held = self.replica.digests()
        for extra, says in (({"model.layers.0.self_attn.q_prj.weight": (4, 4)}, "takes no parameter"),
                            ({"model.norm.weight": (7,)}, "model.norm.weight")):
            self.call(self.trainer, "set_extra", extra, timeout=T)
            try:
                self.mgr.update_weights(version=step)
                raise AssertionError(f"an update with {extra} was not refused")
            except UpdateFailed as e:
                assert says in str(e) and "SGLang kept its previous weights" in str(e), str(e)[:500]
            assert self.replica.weight_version() == step - 1
            assert self.replica.digests() == held
            self.rows.setdefault("refused", []).append(str(extra))
        self.call(self.trainer, "set_extra", {}, timeout=T)

    def close(self) -> None:
        for f in (self.mgr.shutdown, self.trainer.shutdown, self.replica.shutdown, self.engine.shutdown):
            try:
                f()
            except Exception as e:  # noqa: BLE001 - what is left is ended with the process group
                print(f"(closing: {e})", file=sys.stderr)


def hybrid(c: Case) -> None:
    for step in (1, 2, 3):
        c.mgr.sleep_replicas()
        c.rows.setdefault("trainer_loss", []).append(c.call(c.trainer, "train_step", step, timeout=T)[0])
        c.update(step)
        c.check(step)


def nccl(c: Case) -> None:
    for step in (1, 2):
        c.call(c.trainer, "train_step", step, timeout=T)
        c.update(step)
        c.check(step)
    c.call(c.trainer, "train_step", 3, timeout=T)
    c.refusals(3)
    c.update(3)
    c.check(3)


def tp2(c: Case) -> None:
    for step in (1, 2, 3):
        c.call(c.trainer, "train_step", step, timeout=T)
        c.update(step)
        c.check(step)


#: case: (steps, model kind, weightbus backend, SGLang TP size, trainer device, hybrid)
CASES = {"hybrid": (hybrid, "moe", "colocated", 1, "cuda:0", True),
         "nccl": (nccl, "dense", "nccl", 1, "cuda:1", False),
         "tp2": (tp2, "dense", "gloo", 2, "cpu", False)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=list(CASES))
    a = p.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = GPUS[a.case]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # (SGLang's processes run with 0: NCCL peers must agree)
    steps, *args = CASES[a.case]
    c = None
    row: dict = {"case": a.case, "ok": False}
    try:
        c = Case(a.case, *args)
        row = c.rows
        steps(c)
        row["ok"] = True
    except BaseException as e:  # noqa: BLE001 - the row says why
        import traceback
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["trace"] = traceback.format_exc()[-3000:]
    finally:
        if c is not None:
            c.close()
    print("RESULT " + json.dumps(row), flush=True)
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
