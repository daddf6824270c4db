"""Worker bodies for the multi-process tests (importable by spawned processes).

Each worker returns plain data; the test in the parent compares trainer-side expected
digests with what every rollout rank received, bitwise.
"""

from __future__ import annotations

import asyncio
import os
import time

import torch
from torch import nn

from weightbus import (
    CheckpointEngineRegistry,
    Manifest,
    ModuleSink,
    ModuleSource,
    TensorMeta,
    WeightSyncError,
)
from weightbus.runtime.local import Rendezvous, connect
from weightbus.tools.demo import digest


class Mixed(nn.Module):
    """Parameters and buffers of many dtypes and odd shapes; trained by real steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(3000, 48)  # 576 KB fp32: several buckets when small
        self.proj = nn.Linear(48, 37)  # 37: odd sizes everywhere
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim
        self.h16 = nn.Parameter(torch.randn(5, 3).half())
        self.bf = nn.Parameter(torch.randn(11).bfloat16())
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(13, dtype=torch.bool))
        self.register_buffer("empty", torch.zeros(0, 4))

    def step(self, k: int) -> None:
        g = torch.Generator().manual_seed(k)
        x = torch.randint(0, 3000, (8,), generator=g)
        loss = (self.proj(self.emb(x)) * self.scale).square().mean() + self.h16.float().sum() \
            + self.bf.float().sum()
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            self.steps += 1
            self.mask ^= torch.rand(13, generator=g) > 0.5


def trainer_stream(model: Mixed) -> dict[str, torch.Tensor]:
    sd = dict(model.state_dict())
    sd["emb_t"] = model.emb.weight.detach().t()  # non-contiguous
    return sd


def new_engine(backend: str, rollout: bool, **kwargs):
    """``backend``; ``mooncake:k`` for mooncake with replicas of k rollout ranks; ``nixl:kind``
    for a nixl topology (``rates``: auto, with trainer links twice as fast as rollouts')."""
    name, _, k = backend.partition(":")
    if name == "mooncake" and k and rollout:
        kwargs["replica_size"] = int(k)
    if name == "nixl" and k:
        kwargs["topology"] = "auto" if k == "rates" else k
        if k == "rates":
            kwargs["link_gbps"] = 1.0 if rollout else 2.0
    return CheckpointEngineRegistry.new(name, role="rollout" if rollout else "trainer", **kwargs)


def _receive(engine, expected: Manifest | None = None, stop_after: int | None = None,
             batches: bool = False):
    async def go():
        got = {}
        stream = engine.receive_weights(expected=expected)
        if batches:  # a bucket at a time (what ModuleSink reads); stop_after: batches
            async for batch in stream.batches():
                got.update((name, digest(t)) for name, t in batch)
                if stop_after is not None:
                    break  # closes the stream: the update must fail on every rank
            return got
        if stop_after is None:  # a consumer that keeps every tensor, as dict(stream) does
            held = {name: t async for name, t in stream}
            return {name: digest(t) for name, t in held.items()}
        async for name, t in stream:
            got[name] = digest(t)
            if len(got) >= stop_after:
                await stream.aclose()
                break
        return got
    return asyncio.run(go())


def _send(engine, weights, version=None):
    return asyncio.run(engine.send_weights(weights, version=version))


def _outcome(fn):
    try:
        return {"ok": fn()}
    except WeightSyncError as e:
        return {"error": str(e)}


class _Lying:
    """A source whose manifest says bf16 but whose stream gives integers."""

    manifest = Manifest([TensorMeta("x", torch.bfloat16, (3,))])

    def __iter__(self):
        yield "x", torch.arange(3)


class _Raising:
    """A weight source whose iterator raises at one tensor (a trainer-side bug)."""

    def __init__(self, source: ModuleSource, at: str):
        self.manifest, self._source, self._at = source.manifest, source, at

    def __iter__(self):
        for name, t in self._source:
            if name == self._at:
                raise RuntimeError(f"boom while producing {name}")
            yield name, t


def lifecycle(rank: int, backend: str, T: int, R: int, port: int, bucket: int):
    """Good updates with changing weights, a trainer-side failure, a consumer that stops
    early, a dtype-policy change (new manifest), then good again: the same group."""
    torch.set_num_threads(1)
    is_trainer = rank < T
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    engine = new_engine(backend, not is_trainer, bucket_size=bucket, timeout=30)
    connect(engine, rdv, T, R)
    model = Mixed()
    log = []
    plan = [("good", None)] * 3 + [("trainer_raises", None), ("consumer_stops", None),
                                   ("good", torch.bfloat16), ("good", torch.bfloat16),
                                   ("batch_stops", torch.bfloat16), ("good", None)]
    for k, (kind, dtype) in enumerate(plan, start=1):
        model.step(k)
        source = ModuleSource(trainer_stream(model), dtype=dtype)
        rdv.all_gather(None)
        if is_trainer:
            weights = _Raising(source, "proj.bias") if kind == "trainer_raises" and rank == T - 1 else source
            out = _outcome(lambda w=weights, v=k: _send(engine, w, version=v).version)
            if "ok" in out:
                out["expected"] = {n: digest(t.to(source.wire_dtype(t))) for n, t in source}
        else:
            stop = 3 if kind in ("consumer_stops", "batch_stops") and rank == T else None
            # even updates are read a bucket at a time, odd ones a tensor at a time
            out = _outcome(lambda s=stop, b=(k % 2 == 0 or kind == "batch_stops"):
                           _receive(engine, stop_after=s, batches=b))
            if "ok" in out:
                out["version"] = engine.version
        out["kind"] = kind
        log.append(out)
    engine.finalize(destroy_group=True)
    return log


def bad_inputs(rank: int, T: int, R: int, port: int):
    """Each bad input fails on every rank with a message naming the problem; the group
    stays usable and a good update follows each."""
    torch.set_num_threads(1)
    is_trainer = rank < T
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", bucket_size=1 << 16, timeout=30,
                                          role="trainer" if is_trainer else "rollout")
    connect(engine, rdv, T, R)
    model = Mixed()
    good = ModuleSource(model)
    log = {}

    def step(name, trainer_weights, expected=None, sink=False):
        rdv.all_gather(None)
        if is_trainer:
            log[name] = _outcome(lambda: _send(engine, trainer_weights(rank)).version)
        elif sink:
            other = Mixed()
            del other.proj  # the rollout model lacks proj.weight / proj.bias
            try:
                asyncio.run(ModuleSink(other).load(engine.receive_weights()))
                log[name] = {"ok": True}
            except Exception as e:  # noqa: BLE001
                log[name] = {"error": f"{type(e).__name__}: {e}"}
        else:
            t0 = time.monotonic()
            log[name] = _outcome(lambda: _receive(engine, expected=expected))
            log[name]["seconds"] = time.monotonic() - t0

    step("duplicate", lambda r: [("a", torch.ones(3)), ("a", torch.ones(3))])
    step("good1", lambda r: good)
    bad = dict(model.state_dict())
    bad["proj.weight"] = torch.zeros(36, 48)
    step("trainers_disagree", lambda r: ModuleSource(bad) if r == T - 1 else good)
    step("good2", lambda r: good)
    wrong = Manifest([m if m.name != "proj.bias" else type(m)(m.name, m.dtype, (99,))
                      for m in good.manifest])
    step("receiver_expects_other", lambda r: good, expected=wrong)
    step("good3", lambda r: good)
    step("sink_missing", lambda r: good, sink=True)
    step("good4", lambda r: good)
    step("bad_cast", lambda r: _Lying())
    step("good5", lambda r: good)
    # a plain dict (not a source, not pairs): every rank hears it at once, with the fix
    step("plain_dict", lambda r: dict(model.state_dict()))
    step("good6", lambda r: good)
    # a version past what the header's 64-bit word holds: refused on the trainers, and the
    # rollouts hear why in the header (not a broken header at their deadline)
    rdv.all_gather(None)
    t0 = time.monotonic()
    if is_trainer:
        try:
            _send(engine, good, version=1 << 63)
            log["overflow"] = {"ok": True}
        except Exception as e:  # noqa: BLE001
            log["overflow"] = {"error": f"{type(e).__name__}: {e}"}
    else:
        log["overflow"] = _outcome(lambda: _receive(engine))
    log["overflow"]["seconds"] = time.monotonic() - t0
    step("good7", lambda r: good)
    return log


def dies_mid_update(rank: int, backend: str, port: int, mode: str):
    """1 trainer, 2 rollouts. Rollout 2 dies (or hangs) during update 2; the trainer and
    rollout 1 must fail within the deadline (3 s), then re-form without it and succeed."""
    torch.set_num_threads(1)
    T, R = 1, 2
    timeout = 3.0
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    engine = CheckpointEngineRegistry.new(backend, bucket_size=1 << 16, timeout=timeout,
                                          role="trainer" if rank == 0 else "rollout")
    connect(engine, rdv, T, R)
    model = Mixed()
    out = {}
    for k in (1, 2):
        model.step(k)
        rdv.all_gather(None)
        t0 = time.monotonic()
        if rank == 0:
            res = _outcome(lambda: _send(engine, ModuleSource(model)).version)
        elif rank == 2 and k == 2:
            async def die():
                async for _ in engine.receive_weights():
                    if mode == "die":
                        os._exit(3)
                    time.sleep(4 * timeout)  # hang: alive, but stops taking part
                    os._exit(0)
            asyncio.run(die())
            return None
        else:
            res = _outcome(lambda: _receive(engine))
        res["seconds"] = time.monotonic() - t0
        out[k] = res
    # survivors re-form: new rendezvous among ranks 0 and 1 only
    rdv2 = Rendezvous("127.0.0.1", port, rank, 2, timeout=60, prefix="again")
    connect(engine, rdv2, 1, 1)
    model.step(3)
    if rank == 0:
        source = ModuleSource(model)
        res = _outcome(lambda: _send(engine, source).version)
        res["expected"] = {n: digest(t) for n, t in source}
    else:
        res = _outcome(lambda: _receive(engine))
    out[3] = res
    engine.finalize(destroy_group=True)
    return out


def into_destinations(rank: int, port: int):
    """Rollout ranks receive straight into their own tensors (set_destinations): split
    tensors land in place, the sink sees the same storage, every update bitwise."""
    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", bucket_size=1 << 14, timeout=30,
                                          role="trainer" if rank == 0 else "rollout")
    model = Mixed()
    if rank == 1:
        ptrs = {n: t.data_ptr() for n, t in model.state_dict().items()}
        engine.set_destinations(model.state_dict())
    connect(engine, rdv, 1, 1)
    out = []
    for k in (1, 2):
        if rank == 0:
            model.step(k)
            _send(engine, ModuleSource(model), version=k)
            out.append({n: digest(t) for n, t in model.state_dict().items()})
        else:
            async def go():
                return [t.data_ptr() == ptrs[name] async for name, t in engine.receive_weights()]
            same = asyncio.run(go())
            assert all(same) and len(same) == len(ptrs)
            assert all(t.data_ptr() == ptrs[n] for n, t in model.state_dict().items())
            out.append({n: digest(t) for n, t in model.state_dict().items()})
    engine.finalize(destroy_group=True)
    return out


def _counting(fn, calls: dict, key: str):
    def call(*a, **kw):
        calls[key] += 1
        return fn(*a, **kw)
    return call


def sharded_source(rank: int, port: int):
    """FSDP2 (gloo) parameters through ModuleSource: gathered to one owner, to all ranks,
    and straight into given targets, even and uneven shards alike; every result equals
    full_tensor() cast to the wire dtype, bitwise."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    # 7 rows: uneven; the rest even, gathered as one flat all-gather (the small ones) or
    # one gather each (WEIGHTBUS_FLAT_GATHERS=0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 7), nn.LayerNorm(7),
                          *[nn.Linear(8, 6) for _ in range(5)], nn.Linear(6, 1))  # (1 row: rank 1 holds none)
    from torch.distributed.device_mesh import init_device_mesh
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))  # CPU shards even where CUDA exists
    source = ModuleSource(model, dtype=torch.bfloat16)
    expected = {n: t.to(torch.bfloat16) for n, t in source}  # full_tensor() on every rank
    n = len(source.manifest)
    to_owner = dict(source.iter_for(lambda i: frozenset({i % 2}), rank))
    to_all = dict(source.iter_for(lambda i: frozenset({0, 1}), rank))
    targets = {m.name: torch.zeros(m.shape, dtype=m.dtype) for m in source.manifest}
    names = [m.name for m in source.manifest]
    into = list(source.iter_for(lambda i: frozenset({0, 1}), rank, into=lambda i: targets[names[i]]))
    assert len(into) == n
    first = expected
    for flat in ("1", "0", "1"):  # the weights change; the flat gather's views are reused
        os.environ["WEIGHTBUS_FLAT_GATHERS"] = flat
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().mul_(-1.5).add_(0.25)
        expected = {n: t.to(torch.bfloat16) for n, t in source}
        into = list(source.iter_for(lambda i: frozenset({0, 1}), rank, into=lambda i: targets[names[i]]))
        for name, t in into:
            assert torch.equal(t, expected[name]), (flat, name)
        # each tensor wanted whole on one rank: one all-to-all per run of them (or a gather
        # each with WEIGHTBUS_FLAT_GATHERS=0), whatever the mix of owners
        for owner in (lambda i: i % 2, lambda i: 1, lambda i: int(i in (1, 2, 5))):
            calls = {"gather": 0, "all_to_all_single": 0}
            real = {k: getattr(dist, k) for k in calls}

            for k in calls:
                setattr(dist, k, _counting(real[k], calls, k))
            try:
                got = list(source.iter_for(lambda i, o=owner: frozenset({o(i)}), rank))
            finally:
                for k in calls:
                    setattr(dist, k, real[k])
            # per update, collectives per run of tensors, not per tensor
            assert calls == ({"gather": 0, "all_to_all_single": 1} if flat == "1"
                             else {"gather": n, "all_to_all_single": 0}), (flat, calls)
            assert [g[0] for g in got] == names, flat
            for i, (name, t) in enumerate(got):
                assert (t is None) == (owner(i) != rank), (flat, name)
                assert t is None or (t.dtype == torch.bfloat16 and torch.equal(t, expected[name])), \
                    (flat, name)
    dist.destroy_process_group()
    for i, (name, t) in enumerate(into):
        assert torch.equal(t, expected[name]), name
        even = expected[name].shape[0] % 2 == 0
        assert (t is targets[name]) == even, name  # uneven shards fall back, still exact
        assert torch.equal(to_all[name], first[name]), name
        got = to_owner[name]
        assert (got is None) == (i % 2 != rank) and (got is None or torch.equal(got, first[name])), name
    return True


def progress_reported(rank: int, port: int):
    """Both sides report every bucket through ``engine.progress``; a callback that raises
    does not break the update."""
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", bucket_size=1 << 14, timeout=30,
                                          role="trainer" if rank == 0 else "rollout")
    connect(engine, rdv, 1, 1)
    seen = []
    engine.progress = lambda done, total: seen.append((done, total))
    model = Mixed()
    if rank == 0:
        _send(engine, ModuleSource(model), version=1)
    else:
        _receive(engine)
    engine.progress = lambda done, total: 1 / 0
    ok = _outcome(lambda: _send(engine, ModuleSource(model), version=2).version) if rank == 0 \
        else _outcome(lambda: len(_receive(engine)))
    engine.finalize(destroy_group=True)
    return seen, ok


def group_misuse(rank: int, port: int):
    """2 trainers, 1 rollout (gloo): misuse of a formed group, each case a clear error or
    correct handling, the group usable after each."""
    torch.set_num_threads(1)
    T, R = 2, 1
    is_trainer = rank < T
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", bucket_size=1 << 16, timeout=20,
                                          role="trainer" if is_trainer else "rollout")
    model = Mixed()
    log: dict[str, str] = {}

    def good(label: str, weights=None) -> None:
        """One update that must arrive bitwise; log 'ok' or what went wrong."""
        w = weights if weights is not None else trainer_stream(model)
        rdv.all_gather(None)
        if is_trainer:
            out = _outcome(lambda: _send(engine, ModuleSource(w)).version)
        else:
            out = _outcome(lambda: _receive(engine))
        want = {n: digest(t) for n, t in w.items()}
        log[label] = "ok" if "ok" in out and (is_trainer or out["ok"] == want) else str(out)[:300]

    # init twice: the second formation replaces the first
    connect(engine, rdv, T, R)
    connect(engine, rdv, T, R)
    model.step(1)
    good("init-twice")
    # one tiny tensor: one bucket, so trainer rank 1 has nothing to send
    good("more-trainers-than-buckets", {"only": torch.arange(5.0)})
    # finalize (buckets freed) twice, then the engine is used again
    engine.finalize()
    engine.finalize()
    model.step(2)
    good("finalize-twice-then-reuse")

    # two updates at once on one engine: the second is refused, the first completes
    rdv.all_gather(None)
    if rank == 0:
        async def both():
            src = ModuleSource(trainer_stream(model))
            return await asyncio.gather(engine.send_weights(src), engine.send_weights(src),
                                        return_exceptions=True)
        first, second = asyncio.run(both())
        log["two-updates-at-once"] = str(second) if isinstance(second, Exception) else "not refused"
        assert not isinstance(first, Exception), first
    elif rank == 1:
        _send(engine, ModuleSource(trainer_stream(model)))
        log["two-updates-at-once"] = "n/a"
    else:
        a = engine.receive_weights_sync()
        next(a)
        try:
            next(engine.receive_weights_sync())
            log["two-updates-at-once"] = "not refused"
        except WeightSyncError as e:
            log["two-updates-at-once"] = str(e)
        for _ in a:
            pass

    # the trainer's model changes shape between updates: the sink names the tensor
    rdv.all_gather(None)
    if is_trainer:
        wider = dict(trainer_stream(model))
        wider["proj.weight"] = torch.zeros(38, 48)
        _outcome(lambda: _send(engine, ModuleSource(wider)))
        log["manifest-changes-shape"] = "sent"
    else:
        try:
            asyncio.run(ModuleSink(trainer_stream(Mixed())).load(engine.receive_weights()))
            log["manifest-changes-shape"] = "loaded"
        except Exception as e:  # noqa: BLE001
            log["manifest-changes-shape"] = f"{type(e).__name__}: {e}"
    model.step(3)
    good("after")
    engine.finalize(destroy_group=True)
    return log


def save_sharded(model: nn.Module, path: str) -> None:
    """The model as transformers writes a sharded checkpoint: shards plus an index."""
    import json

    from safetensors.torch import save_file
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    names = list(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    os.makedirs(path, exist_ok=True)
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, os.path.join(path, file), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: file for file, ks in shards.items() for k in ks}}, f)


def safetensors_stream(rank: int, port: int, path: str):
    """1 trainer streams a sharded checkpoint (rewritten between updates, weights changed
    by real steps) to 2 rollouts; each rollout's model equals the checkpoint bitwise."""
    from weightbus.integrations.safetensors import SafetensorsSource

    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, rank, 3, timeout=60)
    engine = new_engine("gloo", rank > 0, bucket_size=1 << 16, timeout=30)
    connect(engine, rdv, 1, 2)
    model = Mixed()
    out = []
    for k in (1, 2, 3):
        if rank == 0:
            model.step(k)
            save_sharded(model, path)
        rdv.all_gather(None)  # the checkpoint is on disk
        if rank == 0:
            _send(engine, SafetensorsSource(path), version=k)
            out.append({n: digest(t) for n, t in model.state_dict().items()})
        else:
            asyncio.run(ModuleSink(model).load(engine.receive_weights()))
            out.append({n: digest(t) for n, t in model.state_dict().items()})
        rdv.all_gather(None)  # read before the next rewrite
    engine.finalize(destroy_group=True)
    return out


def _delta_model(fsdp_port: int | None, rank: int, T: int):
    """The demo transformer with RL-like weights (std 0.02), FSDP2-sharded over the trainer
    ranks when there are several."""
    from weightbus.tools.demo import TinyTransformer
    torch.manual_seed(0)
    model = TinyTransformer(vocab=256, dim=64, layers=2)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if T > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{fsdp_port}", rank=rank, world_size=T)
        for blk in model.blocks:
            fully_shard(blk, mesh=init_device_mesh("cpu", (T,)))
        fully_shard(model, mesh=init_device_mesh("cpu", (T,)))
    return model


def _count_calls(owner: object, name: str, counter: list[int]) -> None:
    """Replace ``owner.name`` (a function, or a method of a class) with one that counts its
    calls in ``counter[0]`` (this worker process only)."""
    real = getattr(owner, name)

    def counting(*a, **k):
        counter[0] += 1
        return real(*a, **k)
    setattr(owner, name, counting)


def delta_updates(rank: int, T: int, R: int, port: int, fsdp_port: int, lr: float, updates: int,
                  backend: str = "gloo"):
    """``updates`` updates in delta mode, with a real AdamW step at ``lr`` before each:
    bitwise after every one; bytes on the wire next to the dense bytes. Then: a consumer
    that stops (the update fails: the next goes full), and a corrupted patch (caught,
    naming the tensor; the next goes full). (Late joiners: tests/test_manager.py.)"""
    from torch.distributed.tensor import Replicate

    from weightbus.engines.delta import encoding as drec
    from weightbus.engines.delta import receiver as dr
    from weightbus.engines.delta import sender as ds
    torch.set_num_threads(1)
    os.environ["WEIGHTBUS_DELTA_ROUNDS"] = "4"  # (the default where buckets are on a GPU)
    is_trainer = rank < T
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    engine = CheckpointEngineRegistry.new(backend, role="trainer" if is_trainer else "rollout", delta=True,
                                          bucket_size=1 << 16, timeout=30)
    rounds = [0]
    for side in (ds, dr):  # (a rank runs one side: its rounds are its calls to _plan)
        _count_calls(side, "_plan", rounds)
    connect(engine, rdv, T, R)
    log: list[dict] = []
    if is_trainer:
        model = _delta_model(fsdp_port, rank, T)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        gathers = [0]
        import weightbus.sources as src_mod
        _count_calls(src_mod, "_gather", gathers)
        if T > 1:  # and every whole-tensor gather a DTensor does (none may happen in delta mode)
            from torch.distributed.tensor import DTensor
            _count_calls(DTensor, "full_tensor", gathers)
    else:
        from weightbus.tools.demo import TinyTransformer
        model = TinyTransformer(vocab=256, dim=64, layers=2).to(torch.bfloat16)
        engine.set_destinations(dict(model.state_dict()))

    def step(k: int) -> None:
        g = torch.Generator().manual_seed(k)
        tokens = torch.randint(0, 256, (4, 16), generator=g)
        loss = model(tokens[:, :-1]).float().logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def expected() -> str:
        full = {n: (t.redistribute(placements=[Replicate()]).to_local() if hasattr(t, "full_tensor") else t)
                for n, t in model.state_dict().items()}
        return _state_digest({n: t.to(torch.bfloat16) if t.is_floating_point() else t
                              for n, t in full.items()})

    def one(kind: str, corrupt: bool = False) -> dict:
        if is_trainer:
            if kind != "drift":  # (a drift update changes nothing: no patch touches the drifted element)
                step(len(log) + 1)
            want = expected()
            before, rounds[0] = gathers[0], 0
            source = ModuleSource(model, dtype=torch.bfloat16)
            if corrupt and rank == 0:
                orig = ds._buckets

                def bad(recs, capacity):  # every bucket a trainer sends passes here
                    for bucket in orig(recs, capacity):
                        # (a block's records are views of its body: flipping one flips the block)
                        for r in (x for it in bucket for x in (it.records() if isinstance(it, ds.Block)
                                                              else [it])):
                            if not bad.done and r.head[1] in (drec.SPARSE, drec.BITMAP):
                                bad.done = True
                                # the values end the body: flip a bit of the first, after its digest
                                r.body[-1][r.body[-1].numel() - drec._pad(2 * r.head[4])] ^= 1
                        yield bucket
                bad.done = False
                ds._buckets = bad
            rdv.all_gather(None)
            table = engine._snapshots.tables.get("pieces")
            out = _outcome(lambda: _send(engine, source).wire_bytes)
            if corrupt and rank == 0:
                ds._buckets = orig
            now = engine._snapshots.tables.get("pieces")  # (the kernel calls replayed: the same table)
            out.update(kind=kind, digest=want, dense=source.manifest.nbytes, gathers=gathers[0] - before,
                       full=engine.last_full, rounds=rounds[0], went=getattr(engine.last_stats, "delta", "?"),
                       replayed=now is not None and now is table and bool(now.steps))
        else:
            rdv.all_gather(None)
            stop = 1 if kind == "consumer_stops" and rank == T else None
            if kind == "drift" and rank == T:  # this rank's copy changes where no patch goes
                flat = model.state_dict()["blocks.1.linear1.weight"].view(-1)
                flat.view(torch.int16)[77] ^= 1
            if stop:
                out = _outcome(lambda: _receive(engine, stop_after=1))
            else:
                out = _outcome(lambda: asyncio.run(ModuleSink(model).load(engine.receive_weights())).loaded)
            out.update(kind=kind, digest=_state_digest(model.state_dict()), version=engine.version,
                       full=engine.last_full, went=getattr(engine.last_stats, "delta", "?"))
        log.append(out)
        return out

    for _ in range(updates):
        one("delta")
    one("consumer_stops")
    one("after_failure")
    one("delta")
    one("corrupt", corrupt=True)
    one("after_corrupt")
    one("delta")
    if backend == "gloo":  # (one control group: every rank fails together; the check is the same code)
        one("drift")
        one("after_drift")
    engine.finalize(destroy_group=True)
    return log


def delta_replayed(rank: int, port: int, grad: bool = False):
    """One trainer, one rollout, delta mode over gloo, one ``ModuleSource(model)`` for every
    update (a bf16 model: its tensors are what the pieces are views of; ``grad``: its
    parameters require grad, as a trainer's do, and are changed under no_grad). The
    weights change in place before every update (2% of every tensor); before update 4 one
    weight is given new memory (``p.data = ...``), before update 6 a new ``nn.Parameter``
    replaces another. Each update: the rollout's digest, and on the trainer whether the
    kernel calls were replayed (the table of the last update used again)."""
    from weightbus.engines.delta.encoding import _bits
    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if rank == 0 else "rollout", delta=True,
                                          bucket_size=1 << 16, timeout=30)
    torch.manual_seed(rank)  # (the rollout starts from other weights)
    model = nn.Sequential(*[nn.Linear(40, 40) for _ in range(30)]).to(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(grad and rank == 0)
    if rank == 1:
        engine.set_destinations(dict(model.state_dict()))
    connect(engine, rdv, 1, 1)
    log = []
    if rank == 0:
        source = ModuleSource(model)
        g = torch.Generator().manual_seed(1)
        for k in range(1, 9):
            with torch.no_grad():  # (an optimizer's step: in place)
                for t in model.state_dict().values():  # (the live tensors: in place)
                    flat = _bits(t.view(-1))
                    idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
                    flat[idx] += 1
            if k == 4:
                model[3].weight.data = model[3].weight.data.clone()  # new memory, same object
                _bits(model[3].weight.data.view(-1))[:5] += 1
            if k == 6:
                model[7].bias = nn.Parameter(model[7].bias.detach() + 1, requires_grad=grad)
            before = engine._snapshots.tables.get("pieces")
            rdv.all_gather(None)
            stats = asyncio.run(engine.send_weights(source, version=k))
            after = engine._snapshots.tables.get("pieces")
            log.append({"digest": _state_digest(model.state_dict()), "delta": stats.delta,
                        "replayed": after is not None and after is before and bool(after.steps)})
    else:
        for _ in range(1, 9):
            rdv.all_gather(None)
            asyncio.run(ModuleSink(model).load(engine.receive_weights()))
            log.append({"digest": _state_digest(model.state_dict()), "version": engine.version})
    engine.finalize(destroy_group=True)
    return log


def _state_digest(sd: dict) -> str:
    import hashlib
    h = hashlib.sha256()
    for n, t in sd.items():
        h.update(f"{n}={digest(t)};".encode())
    return h.hexdigest()[:24]


def colocated_misconfigured(rank: int, port: int, case: str):
    """Two processes of one host whose colocated engines disagree (``num_buffers`` 2 and 3,
    or delta on one side of a gloo pair): every rank raises as the group forms, at once."""
    t0 = time.monotonic()
    trainer = rank == 0
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=60)
    if case == "num_buffers":
        engine = CheckpointEngineRegistry.new("colocated", role="trainer" if trainer else "rollout",
                                              num_buffers=2 if trainer else 3, bucket_size=1 << 16,
                                              timeout=30)
    else:
        engine = CheckpointEngineRegistry.new("gloo", role="trainer" if trainer else "rollout", delta=trainer,
                                              bucket_size=1 << 16, timeout=30)
    try:
        connect(engine, rdv, 1, 1)
        out = {"ok": True}
    except Exception as e:  # noqa: BLE001
        out = {"error": f"{type(e).__name__}: {e}"}
    out["seconds"] = time.monotonic() - t0
    engine.finalize(destroy_group=True)
    return out


def fails_or_waits(rank: int):
    """Rank 0 fails at once; the others wait on it, as at a rendezvous, for good."""
    if rank == 0:
        raise RuntimeError("rank 0 failed (injected)")
    time.sleep(3600)


class EnvProbe:
    """A worker group's rank that reports what its environment holds (tests/test_runtime.py)."""

    def __init__(self, rank: int, world: int):
        self.rank = rank

    def read(self, *names: str) -> dict[str, str | None]:
        return {n: os.environ.get(n) for n in names}


def env_of(rank: int, *names: str) -> dict[str, str | None]:
    return {n: os.environ.get(n) for n in names}
