"""Update time into a real vLLM engine (CPU build) on the native ``weightbus`` backend:
trainer rank 0 (transformers, bf16, here, next to the offline LLM) -> gloo -> vLLM's
``load_weights`` inside its layerwise reload, the whole pause -> update -> resume step.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/vllm_update.py --size tiny --size 3b

``--tp 2`` runs vLLM with tensor parallelism (one core per worker here); ``--sharded on``
/ ``off`` forces sharded receive (each worker receives only the regions its loaders keep,
written in place; the default at TP > 1) or whole tensors. The table shows the bytes each
worker's engine received and how many tensors fell back to vLLM's loader.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time

import torch

from weightbus.comm import free_port

SIZES = {  # Qwen2 shapes; 0.5b/1.5b/3b are Qwen2.5's configs (tied embeddings)
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, head_dim=64),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, head_dim=128),
    "3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, head_dim=128),
    # Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top-8), 2 layers: 6.4k tensors
    "moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[]),
}


def _reload_floor(worker, metas: list) -> float:
    """Runs in the vLLM worker: vLLM's own layerwise reload of in-memory tensors shaped like
    the update (a tensor of its own per name, as the update delivers: one per distinct
    shape would read the same few MB from the cache again and again), made before the
    clock starts, with the processing vLLM's reload skips and an update must not (see
    .processing): what any transport into vLLM's load_weights costs at least. Leaves the
    weights garbage."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    from weightbus.integrations.vllm.processing import RebuildHooks, cpu_kernels, refresh_shared_cpu_kernels
    runner = worker.model_runner
    tensors = [(n, torch.empty(shape, dtype=getattr(torch, dtype)).normal_()) for n, shape, dtype in metas]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        kernels = cpu_kernels(runner.model)
        initialize_layerwise_reload(runner.model)
        hooks = RebuildHooks(runner.model)  # what vLLM's reload skips and must not (the CPU's
        hooks.install()                     # MoE experts, a tied head): see .processing
        runner.model.load_weights(iter(tensors))
        finalize_layerwise_reload(runner.model, runner.model_config)
        hooks.remove()
        refresh_shared_cpu_kernels(runner.model, kernels)
        best = min(best, time.perf_counter() - t0)
    return best


def _profile(worker, on: bool, top: int = 0) -> str:
    """Runs in the vLLM worker: cProfile its weight-transfer engine's updates (on), or stop
    and return the top functions by cumulative time (off)."""
    import cProfile
    import io
    import pstats
    engine = worker.weight_transfer_engine
    if on:
        engine._wb_profile = cProfile.Profile()
        receive = type(engine).receive_weights

        def profiled(update_info):
            engine._wb_profile.enable()
            try:
                return receive(engine, update_info)
            finally:
                engine._wb_profile.disable()
        engine.receive_weights = profiled
        return ""
    out = io.StringIO()
    pstats.Stats(engine._wb_profile, stream=out).sort_stats("tottime").print_stats(top)
    del engine.receive_weights
    return out.getvalue()


def _memory(worker, start: bool) -> int:
    """Runs in the vLLM worker: at the start of an update, reset the process's resident
    high-water mark; at its end, how far it rose above where it started (bytes): the
    update's peak extra memory."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    if start:
        import ctypes
        # free memory the allocator keeps (the floor's reload and the updates before left
        # some) goes back first: the update must not look free because it reuses it (the
        # timed updates run without this, as a serving worker would)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # (resets VmHWM to the current RSS)
        worker._wb_rss = status("VmRSS")
        return 0
    return status("VmHWM") - worker._wb_rss


def _timing(worker) -> dict:
    """Runs in the vLLM worker: its loader's timing of the last update (see VLLMModelLoader)."""
    loaders = worker.weight_transfer_engine._engine and worker.weight_transfer_engine._loaders
    return dict(next(iter(loaders.values())).timing) if loaders else {}


def _received(worker) -> tuple[int, int]:
    stats = worker.weight_transfer_engine._engine.last_stats
    return stats.bytes, stats.fallbacks or 0


def run(size: str, updates: int, self_check: int, check_layers: int, tp: int = 1,
        sharded: bool | None = None, place: bool | None = None, transport: str = "gloo",
        profile: int = 0, pin: bool = False, trainer_dtype: str = "bf16",
        num_buffers: int | None = None) -> dict:
    import vllm
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from weightbus.integrations.hf import HFCheckpointSource
    from weightbus.integrations.vllm import OfflineLLMRollout, RolloutClient, sync_weights
    from weightbus.integrations.vllm.native import WeightbusTrainerInitInfo

    path = tempfile.mkdtemp(prefix=f"bench-{size}-")
    moe = size == "moe"
    config, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen2Config, Qwen2ForCausalLM)
    cfg = config(**SIZES[size], max_position_embeddings=512, tie_word_embeddings=not moe)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # made and held in bf16: the largest shape fits
    model = model_cls(cfg)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(path)  # (vLLM serves bf16)
    params = sum(p.numel() for p in model.parameters())
    metas = [(m.name, m.shape, str(m.dtype).removeprefix("torch."))
             for m in HFCheckpointSource(model, dtype=torch.bfloat16).manifest]
    del model  # (the floor's tensors take the trainer's memory: the 3B shape fits only so)
    gc.collect()
    t0 = time.perf_counter()
    if pin:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i + 1) for i in range(tp))
    elif tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    llm = vllm.LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                   max_model_len=256, max_num_seqs=4, tensor_parallel_size=tp,
                   weight_transfer_config={"backend": "weightbus"})
    start = time.perf_counter() - t0
    floor = max(llm.collective_rpc(_reload_floor, args=(metas,)))  # before any update
    model = model_cls.from_pretrained(path, dtype=torch.bfloat16)
    if trainer_dtype == "fp32":  # an fp32 trainer: cast to bf16 on the way
        model = model.float()
    if pin:  # the trainer off the workers' cores (vLLM bound them to cores 1..tp)
        os.sched_setaffinity(0, {0})
        torch.set_num_threads(1)
    client = RolloutClient([OfflineLLMRollout(llm)])
    source = HFCheckpointSource(model, dtype=torch.bfloat16)  # checkpoint names and layouts, a tied head once
    info = WeightbusTrainerInitInfo(rank=0, world_size=1, rollout_world_size=tp, timeout=600,
                                    master_address="127.0.0.1", master_port=free_port(),
                                    self_check_every=self_check, self_check_layers=check_layers,
                                    sharded=sharded, place=place, transport=transport,
                                    num_buffers=num_buffers)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    try:
        t0 = time.perf_counter()
        stats = sync_weights(engine, client, 1)
        first = time.perf_counter() - t0
        preflight = max(t.get("preflight", 0.0) for t in llm.collective_rpc(_timing))
        totals, transfers, peaks = [], [], []
        if profile:
            llm.collective_rpc(_profile, args=(True,))
            import cProfile
            trainer_profile = cProfile.Profile()
        for v in range(2, updates + 3):  # (the last, untimed, measures the peak memory)
            with torch.no_grad():
                for p in model.parameters():
                    p.neg_()
            timed = v < updates + 2
            if not timed:
                llm.collective_rpc(_memory, args=(True,))
            t0 = time.perf_counter()
            if profile and timed:
                trainer_profile.enable()
            stats = sync_weights(engine, client, v)
            if profile and timed:
                trainer_profile.disable()
            if timed:
                totals.append(time.perf_counter() - t0)
                transfers.append(stats.seconds)
            else:
                peaks.append(max(llm.collective_rpc(_memory, args=(False,))))
        assert llm.get_weight_version() == str(updates + 2)
        if profile:
            import pstats
            print("---- the trainer (warm updates)")
            pstats.Stats(trainer_profile).sort_stats("tottime").print_stats(profile)
            print("---- vLLM worker 0 (warm updates)")
            print(llm.collective_rpc(_profile, args=(False, profile))[0])
        got = llm.collective_rpc(_received)
        return {"size": size, "tp": tp, "worker_mb": max(b for b, _ in got) / 1e6,
                "fallbacks": max(f for _, f in got), "tensors": len(source.manifest),
                "self_check": self_check,
                "params": params, "bytes": stats.bytes, "engine_start_s": start,
                "first_update_s": first, "preflight_s": preflight, "peak_mb": max(peaks) / 1e6,
                "bucket_mb": engine.engine.bucket_size / 1e6,
                "slots": engine.engine.num_buffers, "transport": transport,
                "trainer_dtype": trainer_dtype, "update_s": statistics.median(totals),
                "transfer_s": statistics.median(transfers), "floor_s": floor}
    finally:
        engine.shutdown()
        llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(_reload_floor)
    p = argparse.ArgumentParser()
    p.add_argument("--size", action="append", choices=list(SIZES))
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--self-check", type=int, default=0, metavar="N",
                   help="vLLM's self-check on every N-th update (default 0: off)")
    p.add_argument("--self-check-layers", type=int, default=4, metavar="L",
                   help="layers it samples each time (0: all; it holds a copy of each) (default 4)")
    p.add_argument("--tp", type=int, default=1, help="vLLM's tensor parallelism (default 1)")
    p.add_argument("--sharded", choices=["auto", "on", "off"], default="auto",
                   help="sharded receive (auto: where TP > 1)")
    p.add_argument("--transport", default="gloo",
                   help="the weightbus engine between trainer and vLLM (gloo; colocated: shared memory)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile the warm updates in the first vLLM worker; print its top N functions")
    p.add_argument("--trainer-dtype", choices=["bf16", "fp32"], default="bf16",
                   help="the trainer's weights (fp32: cast to vLLM's bf16 on the way)")
    p.add_argument("--num-buffers", type=int, default=None,
                   help="bucket slots on each side (default: the engine's)")
    p.add_argument("--pin", action="store_true",
                   help="the trainer on core 0, vLLM's workers on cores 1..TP (a trainer elsewhere)")
    p.add_argument("--place", choices=["auto", "on", "off"], default="auto",
                   help="write tensors where vLLM's loaders would, not through them (auto: where sharded)")
    a = p.parse_args()
    choice = {"auto": None, "on": True, "off": False}
    rows = [run(s, a.updates, a.self_check, a.self_check_layers, a.tp, choice[a.sharded], choice[a.place],
                a.transport, a.profile, a.pin, a.trainer_dtype, a.num_buffers)
            for s in a.size or ["tiny"]]
    # update s: pause -> send (vLLM receiving and loading concurrently) -> finish -> resume;
    # transfer s: weightbus's send on the trainer (vLLM's loading included: it is the consumer);
    # floor s: vLLM's own layerwise reload of the same shapes from memory, best of 3
    # worker MB: what the busiest vLLM worker's engine received; fallbacks: tensors it took
    # through vLLM's loader instead of placing them; 1st: the first update, preflight s its
    # dry run of vLLM's loaders (and the placement recording) in the slowest worker;
    # peak MB: the worker's resident memory at its highest during one more warm update
    # (untimed), above where it began once the allocator gave its free memory back
    print(f"{'size':<6} {'tp':>2} {'trainer':>7} {'transport':>9} {'tensors':>7} {'params':>14} "
          f"{'MB bf16':>8} "
          f"{'worker MB':>9} {'fallbacks':>9} {'1st s':>6} {'preflight s':>11} {'update s':>9} "
          f"{'transfer s':>10} {'floor s':>8} {'ratio':>6} {'peak MB':>8} {'bucket MB':>9} {'slots':>5}")
    for r in rows:
        print(f"{r['size']:<6} {r['tp']:>2} {r['trainer_dtype']:>7} {r['transport']:>9} {r['tensors']:>7} "
              f"{r['params']:>14,} "
              f"{r['bytes'] / 1e6:>8.1f} {r['worker_mb']:>9.1f} {r['fallbacks']:>9} "
              f"{r['first_update_s']:>6.2f} {r['preflight_s']:>11.3f} {r['update_s']:>9.3f} "
              f"{r['transfer_s']:>10.3f} {r['floor_s']:>8.3f} {r['update_s'] / r['floor_s']:>5.2f}x "
              f"{r['peak_mb']:>8.0f} {r['bucket_mb']:>9.0f} {r['slots']:>5}")
