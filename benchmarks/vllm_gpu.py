"""Update round trips into a real vLLM on GPUs: weightbus against vLLM's own weight-transfer
engines and against vLLM reloading the same weights from memory, each with its ratio to one
bulk copy of the bytes. Random weights of a real config (Qwen3-8B, Qwen3-30B-A3B), as many
layers as ``--layers`` says; vLLM starts with dummy weights.

    python benchmarks/vllm_gpu.py --preset 8b --layers 24 --mode colocated --json rows.jsonl
    python benchmarks/vllm_gpu.py --table rows.jsonl            # the markdown table

``--mode colocated``: trainer and vLLM on one GPU (GPU 0). Rows: weightbus ``colocated``
(CUDA IPC), vLLM's ``ipc`` engine (unpacked and packed), vLLM's layerwise reload of the
same tensors from GPU memory inside its worker, one bulk copy of the bytes.
``--mode nccl``: trainer on GPU 0, vLLM on GPU 1. Rows: weightbus ``nccl``, vLLM's ``nccl``
engine (packed), the bulk copy. A round trip is the trainer's whole update call (vLLM's
start, update and finish included), median of ``--updates`` after one warm-up. vLLM's own
engines are driven through their trainer API (0.27-0.32), or on 0.26 through the static
``trainer_send_weights`` of its engines with the same start/update/finish calls (0.24-0.25 and
0.33: those rows are left out, saying so); to spare an engine start per backend, the vLLM worker's engine is
swapped to vLLM's own backend by its own factory (``_use_backend``). Each weightbus row
carries vLLM's worker-side split of one update (the loader's timing) and the top of a
cProfile of the trainer and of the worker: where the time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from engine_timing import bulk_copy_s, median_s

PRESETS = {"8b": "qwen3-8b", "30b-a3b": "qwen3-30b-a3b", "0.6b": "qwen3-0.6b"}


def _hf_config(preset: str, layers: int):
    import transformers as tf

    from weightbus.planning.presets import QWEN3
    c = dict(QWEN3[PRESETS[preset]])
    c["num_hidden_layers"] = layers
    if "num_experts" in c:
        return tf.Qwen3MoeConfig(**c, intermediate_size=6144, num_experts_per_tok=8, decoder_sparse_step=1,
                                 mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=4096)
    return tf.Qwen3Config(**c, max_position_embeddings=4096)


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------ inside vLLM's worker


def _use_backend(worker, backend: str) -> str:
    """Swap the worker's weight-transfer engine for vLLM's own ``backend``, built by vLLM's
    own factory as the worker builds it (vLLM 0.26+)."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    worker = getattr(worker, "worker", worker)  # (the callable gets vLLM's wrapper of the worker)
    old = worker.weight_transfer_engine
    if old is not None:
        old.shutdown()
    worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=backend), worker.vllm_config, worker.device,
        worker.model_runner.get_model())
    return type(worker.weight_transfer_engine).__name__


def _reload_from_memory(worker, metas: list, n: int) -> list[float]:
    """vLLM's own layerwise reload of tensors shaped like the update, already in GPU memory
    (made before the clock starts): what a transport into vLLM's ``load_weights`` costs at
    least. Leaves the weights garbage."""
    import torch
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    model = worker.model_runner.model
    tensors = [(name, torch.empty(shape, dtype=getattr(torch, dtype), device=worker.device).normal_())
               for name, shape, dtype in metas]
    runs = []
    for _ in range(n + 1):
        _sync()
        t0 = time.perf_counter()
        with torch.device(worker.device):
            initialize_layerwise_reload(model)
            model.load_weights(iter(tensors))
            finalize_layerwise_reload(model, worker.model_config)
        _sync()
        runs.append(time.perf_counter() - t0)
    tensors.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return runs[1:]


def _loader_timing(worker) -> dict:
    engine = worker.weight_transfer_engine
    loaders = getattr(engine, "_loaders", None)
    return {k: round(v, 5) for k, v in next(iter(loaders.values())).timing.items()} if loaders else {}


def _profile(worker, on: bool, top: int = 25) -> str:
    """cProfile the worker engine's next updates (on), or stop and return the top functions."""
    import cProfile
    import io
    import pstats
    engine = worker.weight_transfer_engine
    if on:
        engine._wb_profile = cProfile.Profile()
        receive = type(engine).receive_weights

        def profiled(*args, **kwargs):
            engine._wb_profile.enable()
            try:
                return receive(engine, *args, **kwargs)
            finally:
                engine._wb_profile.disable()
        engine.receive_weights = profiled
        return ""
    out = io.StringIO()
    pstats.Stats(engine._wb_profile, stream=out).sort_stats("cumulative").print_stats(top)
    del engine.receive_weights
    return out.getvalue()


# ------------------------------------------------------------------ the runs


class _Client:
    """vLLM's four weight-sync calls on an offline LLM, for vLLM's own trainer engines."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info):
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self):
        self.llm.start_weight_update()

    def update_weights(self, update_info):
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self.llm.finish_weight_update()


def _own_round_026(llm, backend: str, packed: bool, named: dict, port: int):
    """One round trip through vLLM 0.26's own ``backend`` engine, as its examples drive it: the
    trainer's static ``trainer_send_weights`` between the LLM's start and finish calls (the
    worker runs the layerwise reload itself). Returns the round trip."""
    import dataclasses
    import threading

    import torch
    from vllm.distributed.weight_transfer import ipc_engine, nccl_engine
    metas = {"names": list(named), "dtype_names": [str(t.dtype).split(".")[-1] for t in named.values()],
             "shapes": [list(t.shape) for t in named.values()]}

    def beside(fn, *args):  # a call into the engine that meets the trainer's half of a collective
        box = {}
        th = threading.Thread(target=lambda: box.setdefault("r", fn(*args)), daemon=True)
        th.start()
        return th

    if backend == "ipc":
        args = ipc_engine.IPCTrainerSendWeightsArgs(
            send_mode=lambda info: llm.update_weights({"update_info": dataclasses.asdict(info)}),
            packed=packed)

        def round_trip():
            llm.start_weight_update()
            ipc_engine.IPCWeightTransferEngine.trainer_send_weights(iter(named.items()), args)
            llm.finish_weight_update()
        return round_trip
    th = beside(llm.init_weight_transfer_engine, {"init_info": {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}})
    group = nccl_engine.trainer_init({"master_address": "127.0.0.1", "master_port": port, "world_size": 2})
    th.join()
    args = nccl_engine.NCCLTrainerSendWeightsArgs(group=group, packed=packed)

    def round_trip():
        llm.start_weight_update()
        th = beside(llm.update_weights, {"update_info": {**metas, "packed": packed}})
        nccl_engine.NCCLWeightTransferEngine.trainer_send_weights(iter(named.items()), args)
        torch.cuda.synchronize()
        th.join()
        llm.finish_weight_update()
    return round_trip


def _vllm_source(named: dict):
    """The trainer's tensors (checkpoint names) as a vLLM ``WeightSource`` (0.27-0.32 form)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Source(WeightSource):
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in named.items()]

        def __iter__(self):
            return iter(named.items())
    return Source()


def run(preset: str, layers: int, mode: str, updates: int, profile: int, json_path: str | None = None
        ) -> list[dict]:
    import torch
    import transformers as tf
    import vllm

    from weightbus.comm import free_port
    from weightbus.integrations.hf import HFCheckpointSource, checkpoint_state_dict
    from weightbus.integrations.vllm import (
        OfflineLLMRollout,
        RolloutClient,
        WeightbusTrainerInitInfo,
        compat,
        trainer_init,
    )

    cfg = _hf_config(preset, layers)
    cls = tf.Qwen3MoeForCausalLM if isinstance(cfg, tf.Qwen3MoeConfig) else tf.Qwen3ForCausalLM
    cfg.architectures = [cls.__name__]
    path = tempfile.mkdtemp(prefix=f"wb-{preset}-")
    cfg.save_pretrained(path)
    v = compat.parse_version(vllm.__version__)
    gpu = torch.cuda.is_available()  # (without one: vLLM's CPU build, to check this script)
    kw = {}
    if gpu:
        trainer_dev = torch.device("cuda", torch.cuda.device_count() - 1)
        torch.cuda.set_device(trainer_dev)
        # weights (vLLM's and the trainer's) + headroom for vLLM's activations and KV cache
        with torch.device("meta"):
            nbytes = sum(p.numel() * 2 for p in cls(cfg).parameters())
        total = torch.cuda.get_device_properties(0).total_memory
        kw["gpu_memory_utilization"] = min(0.9, (nbytes + (6 << 30)) / total)
    else:
        trainer_dev, mode = torch.device("cpu"), "colocated"
    t0 = time.perf_counter()
    llm = vllm.LLM(model=path, load_format="dummy", dtype="bfloat16", enforce_eager=True,
                   skip_tokenizer_init=True, max_model_len=256, max_num_seqs=4,
                   weight_transfer_config={"backend": "weightbus"}, **kw)
    start_s = time.perf_counter() - t0
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(trainer_dev):
        model = cls(cfg)
    torch.set_default_dtype(torch.float32)
    source = HFCheckpointSource(model)
    manifest = source.manifest
    base = {"preset": preset, "layers": layers, "mode": mode, "bytes": manifest.nbytes,
            "tensors": len(manifest), "vllm": vllm.__version__,
            "gpu": torch.cuda.get_device_name(0) if gpu else "CPU",
            "engine_start_s": round(start_s, 1)}
    rows: list[dict] = []

    def row(name: str, med: float | None, runs: list[float], **extra) -> None:
        rows.append({**base, "row": name, "s": med, "runs": [round(r, 5) for r in runs], **extra})
        rows[-1]["copy_ratio"] = round(med / copy_s, 2) if med else None
        print(json.dumps(rows[-1]), flush=True)
        if json_path:  # (as it comes: a later row that fails loses nothing)
            with open(json_path, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")

    copy_s = bulk_copy_s(manifest.nbytes, trainer_dev)
    row("bulk copy", copy_s, [copy_s])

    # weightbus
    client = RolloutClient([OfflineLLMRollout(llm)], timeout=600)
    transport = "colocated" if mode == "colocated" else "nccl"
    info = WeightbusTrainerInitInfo(rank=0, world_size=1, rollout_world_size=1, master_address="127.0.0.1",
                                    master_port=free_port(), transport=transport, timeout=600)
    engine = trainer_init(info, client=client, source=source)
    version = [0]

    def wb_update():
        version[0] += 1
        engine.send_weights(version[0])
    med, runs = median_s(wb_update, updates)
    timing = llm.collective_rpc(_loader_timing)[0]
    prof = {}
    if profile:
        import cProfile
        import io
        import pstats
        llm.collective_rpc(_profile, args=(True,))
        pr = cProfile.Profile()
        pr.enable()
        wb_update()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(profile)
        prof = {"trainer_profile": out.getvalue(),
                "worker_profile": llm.collective_rpc(_profile, args=(False, profile))[0]}
    row(f"weightbus {transport}", med, runs, worker_split=timing, **prof)
    engine.shutdown()

    # vLLM reloading the same tensors from memory (colocated mode: the GPU has room)
    if mode == "colocated":
        metas = [(m.name, tuple(m.shape), str(m.dtype).removeprefix("torch.")) for m in manifest]
        runs = llm.collective_rpc(_reload_from_memory, args=(metas, updates))[0]
        row("vLLM reload from memory", statistics.median(runs), runs)

    # vLLM's own engines
    if not gpu:
        pass
    elif v < (0, 26) or v >= (0, 33):
        row("vLLM's own engines", None, [], note="driven through vLLM 0.26-0.32's trainer API; "
            f"vLLM {vllm.__version__} left out")
    else:
        named = checkpoint_state_dict(model)  # checkpoint names, as vLLM loads them
        backends = [("ipc", {"packed": False}), ("ipc", {"packed": True})] if mode == "colocated" \
            else [("nccl", {"packed": True})]
        for backend, kw in backends:
            label = f"vLLM {backend}" + (" packed" if kw.get("packed") else "")
            own = None
            try:
                name = llm.collective_rpc(_use_backend, args=(backend,))[0]
                factory = __import__("vllm.distributed.weight_transfer.factory", fromlist=["x"])
                mod = __import__(f"vllm.distributed.weight_transfer.{backend}_engine", fromlist=["x"])
                if v < (0, 27):
                    send = _own_round_026(llm, backend, kw.get("packed", False), named, free_port())
                    med, runs = median_s(send, updates)
                    row(label, med, runs, engine=name)
                    continue
                if backend == "ipc":
                    tinfo = mod.IPCTrainerInitInfo(rank=0, **kw)
                else:
                    tinfo = mod.NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1",
                                                    master_port=free_port(), world_size=2, **kw)
                own = factory.WeightTransferTrainerFactory.trainer_init(tinfo, client=_Client(llm),
                                                                        source=_vllm_source(named))
                med, runs = median_s(own.send_weights, updates)
                row(label, med, runs, engine=name)
            except Exception as e:  # noqa: BLE001 - a row that failed says why
                row(label, None, [], note=f"{type(e).__name__}: {str(e)[:300]}")
            finally:
                if own is not None:
                    own.shutdown()
    llm.llm_engine.engine_core.shutdown()
    return rows


def table(paths: list[str]) -> str:
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    out = ["| vLLM | GPU | model | mode | row | median ms | runs ms | x bulk copy |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "row" not in r:
            continue
        ms = f"{r['s'] * 1e3:.1f}" if r.get("s") else "-"
        runs = " ".join(f"{x * 1e3:.1f}" for x in r.get("runs", [])) if r.get("s") else r.get("note", "")
        model = f"{r['preset']}/{r['layers']}L {r['bytes'] / 1e9:.2f} GB, {r['tensors']} tensors"
        gpu = r["gpu"].replace("NVIDIA ", "")
        out.append(f"| {r['vllm']} | {gpu} | {model} | {r['mode']} | {r['row']} | {ms} | {runs} | "
                   f"{r.get('copy_ratio') or '-'} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--mode", choices=["colocated", "nccl"], default="colocated")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--profile", type=int, default=25, help="top N functions of one profiled update (0: off)")
    p.add_argument("--json", help="append the rows here (JSON lines)")
    p.add_argument("--table", nargs="*", help="print the markdown table of these JSON-lines files")
    p.add_argument("--cpu", action="store_true", help="vLLM's CPU build (checks the script only)")
    a = p.parse_args()
    if a.table is not None:
        print(table(a.table))
        return 0
    if not a.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0" if a.mode == "colocated" else "1,0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    run(a.preset, a.layers, a.mode, a.updates, a.profile, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
