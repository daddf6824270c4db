"""verl's SGLang rollout fed by weightbus, on GPUs (issue 51): verl 0.9.1's own pieces as a
verl user's config builds them, with ``checkpoint_engine.backend=weightbus.nccl`` and
``custom_backend_module=weightbus.integrations.verl``.

- the trainer: verl's ``TrainingWorker`` (FSDP2, NCCL) on one GPU, a Ray actor placed by
  verl's resource pool (``tests/verl_workers.Trainer``, the class the CPU suite runs);
- the rollout: verl's ``SGLangReplica`` in standalone mode on another GPU, which launches
  verl's ``SGLangHttpServer`` (SGLang's HTTP server, memory saver on, dummy weights at
  start) and verl's ``CheckpointEngineWorker`` with verl's SGLang ``ServerAdapter``;
- verl's ``CheckpointEngineManager.update_weights(global_steps=...)`` moves each step.

After each of ``--steps`` updates (weights changed by the trainer between them), SGLang's
own per-parameter checksums (``/weights_checker``) of what it serves must equal those after
SGLang reloads the trainer's weights from disk itself (``/update_weights_from_disk`` of a
bf16 ``save_pretrained``), greedy tokens must be the same under both, and a generate call
must report the step as its ``global_steps``. Then, for speed, the same manager's whole
update (median of ``--runs``) with weightbus.nccl and with verl's own ``nccl`` engine swapped
into the same workers.

    python benchmarks/verl_sglang_gpu.py --json rows.jsonl     # 2 GPUs, verl + SGLang installed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

PLUGIN = "weightbus.integrations.verl"
#: Qwen3-1.7B's shape (config.json), fewer layers
SHAPE = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
             head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)


def _post(addr: str, route: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(f"http://{addr}/{route}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # (SGLang answers a refused request with 400 and a body)
        raise RuntimeError(f"SGLang {route}: HTTP {e.code}: {e.read()[:400]!r}") from e


def checksums(addr: str) -> dict[str, str]:
    """SGLang's own hash of every parameter it serves, per TP rank."""
    out = _post(addr, "weights_checker", {"action": "checksum"})
    if not out.get("success"):
        raise RuntimeError(f"SGLang weights_checker: {out.get('message')}")
    return {f"{r['parallelism_info']['tp_rank']}/{n}": h
            for r in out["ranks"] for n, h in r["checksums"].items()}


def make_trainer_class():
    import ray
    import verl_workers
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.utils.import_utils import import_external_libs

    class GpuTrainer(verl_workers.Trainer):
        """The CPU suite's verl trainer on a GPU: the world group verl asks for (gloo for
        CPU tensors, NCCL for CUDA ones), a bf16 save for SGLang's own reload, and a way to
        swap the checkpoint engine (the speed rows use one trainer for both backends)."""

        def __init__(self, config, checkpoint_engine_config):
            if not torch.distributed.is_initialized():
                torch.distributed.init_process_group("cpu:gloo,cuda:nccl", rank=int(os.environ["RANK"]),
                                                     world_size=int(os.environ["WORLD_SIZE"]))
            super().__init__(config, checkpoint_engine_config)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def save(self, path: str, config_from: str) -> None:
            from safetensors.torch import save_file
            weights, _ = self.engine.get_per_tensor_param()
            named = {n: t.detach().to(torch.bfloat16).contiguous().cpu() for n, t in weights}
            if torch.distributed.get_rank() == 0:
                os.makedirs(path, exist_ok=True)
                save_file(named, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
                shutil.copy(os.path.join(config_from, "config.json"), path)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def use_backend(self, ce) -> None:
            import_external_libs(ce.custom_backend_module or None)
            self.checkpoint_engine = CheckpointEngineRegistry.new(
                ce.backend, is_master=torch.distributed.get_rank() == 0,
                bucket_size=ce.update_weights_bucket_megabytes << 20, **ce.engine_kwargs.get(ce.backend, {}))

    return ray.remote(GpuTrainer)


def _within(seconds: float, fn, *args, **kwargs):
    """``fn(...)`` with a deadline (a hung collective must not eat the device run)."""
    import threading
    box: dict = {}

    def go():
        try:
            box["r"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - raised in the caller
            box["e"] = e
    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not return in {seconds} s")
    if "e" in box:
        raise box["e"]
    return box.get("r")


def _swap_rollout_engine(worker, ce):
    """verl's CheckpointEngineWorker builds its engine from the rollout config at start; the
    speed rows swap it in place (same SGLang server, same trainer)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    import_external_libs(ce.custom_backend_module or None)
    worker.checkpoint_engine = CheckpointEngineRegistry.new(
        ce.backend, bucket_size=ce.update_weights_bucket_megabytes << 20,
        **ce.engine_kwargs.get(ce.backend, {}))
    return ce.backend


def run(layers: int, steps: int, runs: int, json_path: str | None) -> list[dict]:
    import ray
    import transformers as tf
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.config import (
        CheckpointEngineConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        RolloutConfig,
    )
    from verl.workers.engine_workers import TrainingWorkerConfig
    from verl.workers.rollout.replica import get_rollout_replica_class

    rows: list[dict] = []

    def row(**r) -> None:
        rows.append(r)
        print(json.dumps(r), flush=True)
        if json_path:
            with open(json_path, "a") as f:
                f.write(json.dumps(r) + "\n")

    work = tempfile.mkdtemp(prefix="wb-verl-sgl-")
    path = os.path.join(work, "model")
    cfg = tf.Qwen3Config(**SHAPE, num_hidden_layers=layers, torch_dtype="bfloat16")
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = tf.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()
                 if t.data_ptr() != model.lm_head.weight.data_ptr()) + model.lm_head.weight.numel() * 2
    del model
    torch.cuda.empty_cache()

    env = {k: os.environ[k] for k in ("PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "CUDA_HOME")
           if k in os.environ}
    env.update(NCCL_CUMEM_ENABLE="0", NCCL_NVLS_ENABLE="0", TOKENIZERS_PARALLELISM="false",
               RAY_DEDUP_LOGS="0")
    ray.init(num_gpus=2, num_cpus=16, include_dashboard=False, runtime_env={"env_vars": env})

    wb = CheckpointEngineConfig(backend="weightbus.nccl", custom_backend_module=PLUGIN,
                                update_weights_bucket_megabytes=512,
                                engine_kwargs={"weightbus.nccl": {"wire_dtype": "bfloat16", "timeout": 300}})
    model_config = HFModelConfig(path=path, load_tokenizer=False,
                                 override_config={"attn_implementation": "sdpa"})
    rollout = RolloutConfig(
        name="sglang", tensor_model_parallel_size=1, n_gpus_per_node=1, nnodes=1, gpu_memory_utilization=0.3,
        prompt_length=64, response_length=32, max_model_len=512, max_num_seqs=16, checkpoint_engine=wb,
        engine_kwargs={"sglang": {"attention_backend": "fa3", "disable_piecewise_cuda_graph": True,
                                  "cuda_graph_max_bs": 4}})
    base = {"layers": layers, "bytes": nbytes, "gpu": torch.cuda.get_device_name(0)}

    t0 = time.perf_counter()
    trainer_pool = RayResourcePool(process_on_nodes=[1], use_gpu=True, max_colocate_count=1)
    engine = FSDPEngineConfig(forward_only=False, fsdp_size=1, strategy="fsdp2")
    optim = FSDPOptimizerConfig(lr=1e-4, total_training_steps=10)
    tconfig = TrainingWorkerConfig(model_type="language_model", model_config=model_config,
                                   engine_config=engine, optimizer_config=optim)
    actor_wg = RayWorkerGroup(resource_pool=trainer_pool, ray_cls_with_init=RayClassWithInitArgs(
        cls=make_trainer_class(), config=tconfig, checkpoint_engine_config=wb), device_name="cuda")
    actor_wg.reset()
    replica = get_rollout_replica_class("sglang")(replica_rank=0, config=rollout, model_config=model_config,
                                                  gpus_per_node=1)
    asyncio.run(replica.init_standalone())
    addr = replica.server_address
    row(**base, row="set-up", s=round(time.perf_counter() - t0, 1), server=addr)
    manager = CheckpointEngineManager(config=wb, actor_wg=actor_wg, replicas=[replica])

    gen = torch.Generator().manual_seed(1)
    prompt = [int(x) for x in torch.randint(0, SHAPE["vocab_size"], (16,), generator=gen)]

    def greedy(tag: str) -> tuple[list[int], object]:
        out = ray.get(replica.server_handle.generate.remote(
            prompt_ids=prompt, sampling_params={"temperature": 0.0, "max_new_tokens": 8}, request_id=tag))
        return list(out.token_ids), out.extra_fields.get("global_steps")

    for step in range(1, steps + 1):
        actor_wg.step(step)
        t = time.perf_counter()
        metrics = _within(300, manager.update_weights, global_steps=step)
        took = time.perf_counter() - t
        got, tokens_wb, steps_seen = checksums(addr), *greedy(f"wb-{step}")
        ref_dir = os.path.join(work, f"ref{step}")
        actor_wg.save(ref_dir, path)
        out = _post(addr, "update_weights_from_disk",
                    {"model_path": ref_dir, "load_format": "auto", "flush_cache": True})
        if not out.get("success"):
            raise RuntimeError(f"SGLang update_weights_from_disk: {out}")
        ref, (tokens_ref, _) = checksums(addr), greedy(f"ref-{step}")
        bad = sorted(n for n in ref if got.get(n) != ref[n])
        row(**base, row="check", step=step, update_s=round(took, 4), params=len(ref), differ=bad[:5],
            bitwise=not bad and set(got) == set(ref), tokens_equal=tokens_wb == tokens_ref, tokens=tokens_wb,
            global_steps_reported=steps_seen, metrics={k: v for k, v in (metrics or {}).items()
                                                        if isinstance(v, int | float)})
        shutil.rmtree(ref_dir, ignore_errors=True)
        assert not bad and set(got) == set(ref), f"step {step}: {len(bad)} parameters differ, e.g. {bad[:3]}"
        assert steps_seen == step, f"step {step}: generate reports global_steps={steps_seen}"

    # speed: the same manager's whole update, weightbus.nccl against verl's own nccl engine
    verl_nccl = CheckpointEngineConfig(backend="nccl", update_weights_bucket_megabytes=512)
    hung = False
    for name, ce in (("weightbus.nccl", wb), ("verl nccl", verl_nccl)):
        try:
            actor_wg.use_backend(ce)
            ray.get([w.__ray_call__.remote(_swap_rollout_engine, ce) for w in replica.workers])
            mgr = CheckpointEngineManager(config=ce, actor_wg=actor_wg, replicas=[replica])
            times = []
            for k in range(runs + 1):
                actor_wg.step(100 + k)
                t = time.perf_counter()
                _within(120, mgr.update_weights, global_steps=100 + k)
                times.append(time.perf_counter() - t)
            times = times[1:]
            row(**base, row=f"speed {name}", s=round(statistics.median(times), 4),
                runs=[round(x, 4) for x in times], gbps=round(nbytes / statistics.median(times) / 1e9, 1))
        except Exception as e:  # noqa: BLE001 - a row that failed says why
            row(**base, row=f"speed {name}", s=None, note=f"{type(e).__name__}: {str(e)[:400]}")
            hung = isinstance(e, TimeoutError)
            break
    if hung:  # (a collective left waiting: the caller ends the process group)
        os._exit(3)
    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    run(a.layers, a.steps, a.runs, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
