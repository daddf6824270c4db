"""Sharded receive across real processes (spawned by tests/test_sharded.py): T trainer
ranks send a toy transformer block's weights; R rollout ranks hold it tensor-parallel
(column and row splits, uneven splits, q/k/v fused into one parameter, experts split by
rank, a replicated norm, a tensor their layout leaves whole, one a rank does not keep)."""

import asyncio

import torch

from weightbus import CheckpointEngineRegistry, ModuleSource
from weightbus.packing.shards import Box, chunk_box, tp_placements
from weightbus.runtime.local import Rendezvous, connect
from weightbus.worker import WeightbusWorker

H = 8
SHAPES = {
    "embed.weight": (11, H),  # vocab-parallel, 11 rows: uneven
    "q.weight": (H, H), "k.weight": (4, H), "v.weight": (4, H),  # fused into qkv on the rollout
    "o.weight": (H, H),  # row-parallel: split along dim 1
    "up.weight": (7, H),  # column-parallel, uneven
    "down.weight": (H, 7),  # row-parallel, uneven
    "norm.weight": (H,),  # replicated
    "experts.w": (4, 6, H),  # expert-parallel: experts split by rank
    "rotary.inv_freq": (5,),  # the layout does not name it: arrives whole (a fallback)
    "only_rank0.weight": (3, 3),  # rollout rank 1 keeps none of it
}
SPLIT = {"embed.weight": 0, "up.weight": 0, "down.weight": 1, "o.weight": 1, "experts.w": 0}


def weights(step: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``step`` (every element changes between steps)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def rollout_params(r: int, R: int) -> dict[str, torch.Tensor]:
    """Rollout rank ``r``'s parameters, as a TP engine would hold them (poisoned: NaN)."""
    p = {n: torch.full(chunk_box(SHAPES[n], d, r, R).size, float("nan")) for n, d in SPLIT.items()}
    p["norm.weight"] = torch.full((H,), float("nan"))
    rows = [chunk_box(SHAPES[n], 0, r, R).size[0] for n in ("q.weight", "k.weight", "v.weight")]
    p["qkv.weight"] = torch.full((sum(rows), H), float("nan"))
    if r == 0:
        p["only_rank0.weight"] = torch.full((3, 3), float("nan"))
    return p


def placements(params: dict[str, torch.Tensor], r: int, R: int):
    out = tp_placements({n: t for n, t in params.items() if n != "qkv.weight"}, r, R,
                        split={n: (d, SHAPES[n]) for n, d in SPLIT.items()})
    at = 0
    for n in ("q.weight", "k.weight", "v.weight"):  # vLLM's fused qkv: this rank's rows of each
        box = chunk_box(SHAPES[n], 0, r, R)
        out[n] = [(box, params["qkv.weight"][at:at + box.size[0]])]
        at += box.size[0]
    if r != 0:
        out["only_rank0.weight"] = []
    return out


def expected(step: int, r: int, R: int) -> dict[str, torch.Tensor]:
    w = weights(step)
    want = {n: chunk_box(SHAPES[n], d, r, R).of(w[n]) for n, d in SPLIT.items()}
    want["norm.weight"] = w["norm.weight"]
    want["qkv.weight"] = torch.cat([chunk_box(SHAPES[n], 0, r, R).of(w[n]) for n in ("q.weight", "k.weight",
                                                                                      "v.weight")])
    if r == 0:
        want["only_rank0.weight"] = w["only_rank0.weight"]
    return want


_GATHERS = ("gather", "all_gather", "all_gather_into_tensor", "all_to_all_single", "broadcast")


def _fsdp_source(rank: int, T: int, fsdp_port: int, mixed: bool) -> tuple[ModuleSource, dict]:
    """The trainer ranks' own gloo group, and step 0's weights as FSDP2 holds them:
    DTensors sharded along dim 0 over the T ranks (torch.chunk's rows: uneven, some ranks
    holding none of the small ones), in one source followed across updates. ``mixed``:
    the norm is replicated (a DTensor held otherwise: gathered to its sender) and the
    rotary table a plain tensor (a buffer every rank holds)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{fsdp_port}", rank=rank, world_size=T)
    mesh = init_device_mesh("cpu", (T,))
    held = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in weights(0).items()}
    if mixed:
        held["norm.weight"] = distribute_tensor(weights(0)["norm.weight"], mesh, [Replicate()])
        held["rotary.inv_freq"] = weights(0)["rotary.inv_freq"]
    return ModuleSource(held), held


def _write_step(held: dict, step: int) -> None:
    """``step``'s weights written into the trainer's shards in place (an optimizer step)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    for n, t in weights(step).items():
        h = held[n]
        if isinstance(h, DTensor):
            h.to_local().copy_(distribute_tensor(t, h.device_mesh, h.placements).to_local())
        else:
            h.copy_(t)


def _counted(calls: dict):
    """Every collective a sharded source could gather with (torch.distributed's and a
    DTensor's own), counted into ``calls`` while the context is open."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    @contextlib.contextmanager
    def ctx():
        real = {k: getattr(dist, k) for k in _GATHERS} | {"full_tensor": DTensor.full_tensor,
                                                         "redistribute": DTensor.redistribute}

        def counting(key):
            def call(*a, **kw):
                calls[key] = calls.get(key, 0) + 1
                return real[key](*a, **kw)
            return call
        for k in _GATHERS:
            setattr(dist, k, counting(k))
        DTensor.full_tensor, DTensor.redistribute = counting("full_tensor"), counting("redistribute")
        try:
            yield
        finally:
            for k in _GATHERS:
                setattr(dist, k, real[k])
            DTensor.full_tensor, DTensor.redistribute = real["full_tensor"], real["redistribute"]
    return ctx()


def run(rank: int, T: int, R: int, port: int, steps: int, bucket: int, move: bool = False,
        replicas: int = 1, relay: int = 0, backend: str = "gloo", fsdp_port: int | None = None,
        mixed: bool = False) -> dict:
    """``R`` TP ranks in each of ``replicas`` replicas (rollout rank q is TP rank q % R of
    replica q // R), every engine made with ``relay``. ``move``: after each update, the
    rollout moves some destinations' memory under the same tensor objects (``set_``, as
    ``param.data = ...`` or a reallocating module does). ``backend`` "nccl": every rank's
    weights on its own GPU (cuda:rank). ``fsdp_port``: the trainers hold the weights as
    FSDP2 does (:func:`_fsdp_source`, ``mixed`` or not), each update written into their
    shards in place, and count the collectives each update made (``out["collectives"]``)."""
    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, rank, T + R * replicas, timeout=60)
    trainer = rank < T
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    engine = CheckpointEngineRegistry.new(backend, role="trainer" if trainer else "rollout",
                                          bucket_size=bucket, timeout=30, relay=relay,
                                          **({"device": dev} if backend == "nccl" else {}))
    r = (rank - T) % R
    if not trainer:
        params = {n: t.to(dev) for n, t in rollout_params(r, R).items()}
        engine.set_shard_destinations(placements(params, r, R))
    connect(engine, rdv, T, R * replicas)
    out: dict = {"stats": [], "wrong": [], "collectives": []}
    if trainer and fsdp_port is not None:
        source, held = _fsdp_source(rank, T, fsdp_port, mixed)
    for step in range(1, steps + 1):
        if trainer and fsdp_port is not None:
            _write_step(held, step)
            calls: dict = {}
            with _counted(calls):
                stats = asyncio.run(engine.send_weights(source, version=step))
            out["collectives"].append(calls)
        elif trainer:
            mine = {n: t.to(dev) for n, t in weights(step).items()}
            stats = asyncio.run(engine.send_weights(ModuleSource(mine), version=step))
        else:
            async def take():
                return {n: t.clone() async for n, t in engine.receive_weights()}
            whole = asyncio.run(take())
            stats = engine.last_stats
            want = expected(step, r, R)
            out["wrong"] += [f"{step}:{n}" for n, t in params.items() if not torch.equal(t.cpu(), want[n])]
            out["whole"] = sorted(whole)
            if not torch.equal(whole["rotary.inv_freq"].cpu(), weights(step)["rotary.inv_freq"]):
                out["wrong"].append(f"{step}:rotary.inv_freq")
            if move:
                for n in ("norm.weight", "up.weight", "experts.w"):
                    params[n].set_(torch.full_like(params[n], float("nan")))
        out["stats"].append(stats.to_dict())
    engine.finalize(destroy_group=True)
    if trainer and fsdp_port is not None:
        import torch.distributed as dist
        dist.destroy_process_group()
    return out


def drifting(step: int, fraction: float, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``step`` when each step changes ``fraction`` of the elements
    of every tensor (at least one; bf16, as a wire carries them, or cast to ``dtype``, an fp8
    serving precision): what delta updates carry."""
    w = {n: t.to(torch.bfloat16) for n, t in weights(0).items()}
    for s in range(1, step + 1):
        g = torch.Generator().manual_seed(7000 + s)
        for t in w.values():
            flat = t.view(-1)
            k = max(1, round(flat.numel() * fraction))
            idx = torch.randperm(flat.numel(), generator=g)[:k]
            flat[idx] = torch.randn(k, generator=g).to(torch.bfloat16)
    return {n: t.to(dtype) for n, t in w.items()}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (fp8 tensors have no ``==`` on every build)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_delta(rank: int, T: int, R: int, port: int, steps: int, bucket: int, replicas: int = 1,
              relay: int = 0, fsdp_port: int | None = None, fraction: float = 0.02,
              flip: int | None = None, verify_every: int = 1, dtype: str = "bfloat16",
              device: str = "cpu", rounds: int | tuple[int, ...] | None = None) -> dict:
    """Delta mode on sharded receive: ``R`` TP ranks in each of ``replicas`` replicas keep
    their regions (the layouts of :func:`run`: uneven splits, fused qkv, experts, a
    replicated norm whose destination is a strided view) and the tensor their layout does
    not name in a destination of their own (``set_destinations``); the trainers (FSDP2
    shards with ``fsdp_port``) change ``fraction`` of every tensor per step (bf16). Each
    rollout rank reports every update's outcome, its regions bitwise, and the stats.
    ``flip``: before that update, rollout rank 1 flips one bit of its up.weight shard (a
    copy that drifted): that update must fail naming it, and the next one land whole.
    ``dtype``: the weights in that precision end to end (``float8_e4m3fn``: fp8 serving).
    ``device`` "cuda": every rank's tensors on GPU 0 (gloo moves host buckets; the diff and
    the patches run as the GPU kernels). ``rounds``: a delta update in that many rounds
    (``WEIGHTBUS_DELTA_ROUNDS``; a tuple: each rank's own setting, which may differ)."""
    from weightbus.errors import WeightSyncError
    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    if rounds is not None:
        import os
        os.environ["WEIGHTBUS_DELTA_ROUNDS"] = str(rounds[rank] if isinstance(rounds, tuple) else rounds)
    rdv = Rendezvous("127.0.0.1", port, rank, T + R * replicas, timeout=60)
    trainer = rank < T
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if trainer else "rollout",
                                          bucket_size=bucket, timeout=30, relay=relay, delta=True,
                                          verify_every=verify_every)
    r = (rank - T) % R
    if not trainer:
        params = {n: t.to(dt).to(dev) for n, t in rollout_params(r, R).items()}
        store = torch.full((H, 2), float("nan")).to(dt).to(dev)  # (a strided destination)
        params["norm.weight"] = store[:, 1]
        engine.set_shard_destinations(placements(params, r, R))
        rotary = torch.full((5,), float("nan")).to(dt).to(dev)
        engine.set_destinations({"rotary.inv_freq": rotary})
    connect(engine, rdv, T, R * replicas)
    out: dict = {"stats": [], "wrong": [], "errors": []}
    if trainer and fsdp_port is not None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{fsdp_port}", rank=rank, world_size=T)
        mesh = init_device_mesh("cpu", (T,))
        held = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in drifting(0, fraction, dt).items()}
        source = ModuleSource(held)
    for step in range(1, steps + 1):
        w = drifting(step, fraction, dt)
        try:
            if trainer and fsdp_port is not None:
                for n, t in w.items():  # (an optimizer step, in place)
                    held[n].to_local().copy_(distribute_tensor(t, mesh, [Shard(0)]).to_local())
                stats = asyncio.run(engine.send_weights(source, version=step))
            elif trainer:
                stats = asyncio.run(engine.send_weights(ModuleSource({n: t.to(dev) for n, t in w.items()}),
                                                        version=step))
            else:
                if flip == step and r == 1:
                    params["up.weight"].view(-1)[:1].view(torch.uint8).bitwise_xor_(1)

                async def take():
                    return [n async for n, _ in engine.receive_weights()]
                assert asyncio.run(take()) == []  # (every tensor is written in place)
                stats = engine.last_stats
            out["errors"].append(None)
        except WeightSyncError as e:
            out["errors"].append(str(e))
            stats = None
        if not trainer and stats is not None:
            want = _expected_from(w, r, R)
            out["wrong"] += [f"{step}:{n}" for n, t in params.items() if not _bits_equal(t.cpu(), want[n])]
            if not _bits_equal(rotary.cpu(), w["rotary.inv_freq"]):
                out["wrong"].append(f"{step}:rotary.inv_freq")
        out["stats"].append(stats.to_dict() if stats is not None else None)
    engine.finalize(destroy_group=True)
    if trainer and fsdp_port is not None:
        dist.destroy_process_group()
    return out


def _expected_from(w: dict[str, torch.Tensor], r: int, R: int) -> dict[str, torch.Tensor]:
    want = {n: chunk_box(SHAPES[n], d, r, R).of(w[n]) for n, d in SPLIT.items()}
    want["norm.weight"] = w["norm.weight"]
    want["qkv.weight"] = torch.cat([chunk_box(SHAPES[n], 0, r, R).of(w[n]).view(torch.uint8)  # (any dtype)
                                    for n in ("q.weight", "k.weight", "v.weight")]).view(w["q.weight"].dtype)
    if r == 0:
        want["only_rank0.weight"] = w["only_rank0.weight"]
    return want


def bad_layout(rank: int, T: int, R: int, port: int) -> dict:
    """Rollout rank 1 states a region no source holds (past the end of a tensor): every
    rank fails the update before a byte moves, naming the rank and the tensor; rank 1's
    parameters keep their previous values, and the group stays usable."""
    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if rank < T else "rollout", timeout=30)
    dst = torch.zeros(6, H)
    if rank >= T:
        box = Box.rows(SHAPES["q.weight"], 4, 10) if rank - T == 1 else Box.rows(SHAPES["q.weight"], 0, 6)
        engine.set_shard_destinations({"q.weight": [(box, dst)]})
    connect(engine, rdv, T, R)
    try:
        if rank < T:
            asyncio.run(engine.send_weights(ModuleSource(weights(1)), version=1))
        else:
            async def take():
                return {n: t async for n, t in engine.receive_weights()}
            asyncio.run(take())
        err = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        err = str(e)
    return {"error": err, "untouched": bool((dst == 0).all()), "version": engine.version}


class Halves:
    """Destinations that state their layout per update (as vLLM's, recorded from its
    loaders): rank r keeps rows r of 2 of ``q.weight`` at even updates, the other half at
    odd ones; rank 1 cannot make its layout at update 3."""

    def __init__(self, r: int):
        self.r, self.update = r, 0
        self.dst = torch.zeros(4, H)

    def layout(self, manifest):
        from weightbus.packing.shards import ShardLayout
        self.update += 1
        if self.update == 3 and self.r == 1:
            raise RuntimeError("the loaders changed under it")
        half = (self.r + self.update) % 2
        self.box = Box.rows(SHAPES["q.weight"], 4 * half, 4 * half + 4)
        return ShardLayout({"q.weight": [self.box], **{n: [] for n in SHAPES if n != "q.weight"}})

    def place(self, name, box, data):
        self.dst[box.start[0] - self.box.start[0]:][:box.size[0]].copy_(data)


def changing_layout(rank: int, T: int, R: int, port: int) -> dict:
    """Layouts that change between updates travel with them (each rank ends holding the
    half it stated, bitwise, and receives only it); one that cannot be made fails the
    update on every rank, naming the rank, and no rank writes a byte of it."""
    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if rank < T else "rollout", timeout=30)
    dests = Halves(rank - T) if rank >= T else None
    if dests is not None:
        engine.set_shard_destinations(dests)
    connect(engine, rdv, T, R)
    out: dict = {"held": [], "bytes": [], "error": None}
    for step in (1, 2, 3):
        try:
            if rank < T:
                asyncio.run(engine.send_weights(ModuleSource(weights(step)), version=step))
            else:
                async def take():
                    return [n async for n, _ in engine.receive_weights()]
                assert asyncio.run(take()) == []
                out["bytes"].append(engine.last_stats.bytes)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["error"] = str(e)
        if dests is not None:
            if step < 3:
                kept = dests.box  # (update 3's layout may differ: it must have written nothing)
            out["held"].append(torch.equal(dests.dst, kept.of(weights(min(step, 2))["q.weight"])))
    out["version"] = engine.version
    engine.finalize(destroy_group=True)
    return out


def _tp_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def torch_tp(rank: int, T: int, R: int, port: int, tp_port: int, steps: int) -> dict:
    """The rollout is a module under torch's own tensor parallelism (``parallelize_module``:
    column- then row-parallel), its parameters DTensors; its
    placements come from them (``dtensor_placements``). After each update every rank's
    shards equal the trainer's slices, the whole parameters (``full_tensor``) equal the
    trainer's bitwise, and the TP forward pass matches the trainer's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from weightbus.packing.shards import dtensor_placements

    torch.set_num_threads(1)
    trainer = rank < T
    model = _tp_model()
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if trainer else "rollout", timeout=30)
    if not trainer:  # the rollout's own TP group: its default group, apart from weightbus's
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=rank - T, world_size=R)
        mesh = init_device_mesh("cpu", (R,))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(float("nan"))  # nothing may stay from the start
        engine.set_shard_destinations(dtensor_placements(dict(model.named_parameters())))
    connect(engine, rdv, T, R)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    out: dict = {"wrong": [], "bytes": []}
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step)
        truth = _tp_model()
        with torch.no_grad():
            for p in truth.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        if trainer:
            asyncio.run(engine.send_weights(ModuleSource(truth), version=step))
            continue

        async def drain():
            async for _ in engine.receive_weights():
                pass
        asyncio.run(drain())
        want = dict(truth.named_parameters())
        with torch.no_grad():
            for n, p in model.named_parameters():
                if not torch.equal(p.full_tensor(), want[n]):
                    out["wrong"].append(f"{step}:{n}")
            if not torch.allclose(model(x), truth(x), rtol=1e-5, atol=1e-5):  # (a sum split over ranks)
                out["wrong"].append(f"{step}:forward")
        out["bytes"].append(engine.last_stats.bytes)
    out["model_bytes"] = sum(p.numel() * 4 for p in _tp_model().parameters())
    engine.finalize(destroy_group=True)
    if not trainer:
        dist.destroy_process_group()
    return out


class TPRollout(WeightbusWorker):
    """A manager's rollout worker holding a ``parallelize_module`` model (its TP group is
    its own default group): its placements come from the DTensors."""

    def __init__(self, rank: int, world: int, tp_port: int):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=rank, world_size=world)
        self.model = _tp_model()
        parallelize_module(self.model, init_device_mesh("cpu", (world,)),
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def weights_placements(self):
        from weightbus.packing.shards import dtensor_placements
        return dtensor_placements(dict(self.model.named_parameters()))

    def weights_sink(self):
        from weightbus import ModuleSink
        return ModuleSink(self.model)

    def received(self) -> int:
        """Bytes this worker received in the last update (the engine's own counter)."""
        return self._wb_engine.last_stats.bytes

    def full(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {n: p.full_tensor() for n, p in self.model.named_parameters()}


class PlainTrainer(WeightbusWorker):
    def __init__(self, rank: int, world: int):
        torch.set_num_threads(1)
        self.model = _tp_model()

    def step(self, step: int) -> None:
        g = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def weights_source(self):
        return ModuleSource(self.model)

    def state(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.model.state_dict().items()}


# ------------------------------------------------------------------ relay between replicas

class ToyTrainer(WeightbusWorker):
    """The toy block's weights, changed by every ``train_step``."""

    def __init__(self, rank: int, world: int):
        torch.set_num_threads(1)
        self.w = weights(0)

    def train_step(self, step: int) -> None:
        for n, t in weights(step).items():
            self.w[n].copy_(t)

    def weights_source(self):
        return ModuleSource(self.w)


class _DiesMidUpdate:
    """Placed destinations that end their process on the third region written at update
    ``at`` (written one by one: no ``region``, so nothing is tabled)."""

    def __init__(self, placed, worker, at: int):
        self.placed, self.worker, self.at, self.written = placed, worker, at, 0

    def layout(self, manifest):
        return self.placed.layout(manifest)

    def place(self, name, box, data):
        if self.worker.in_flight == self.at:
            self.written += 1
            if self.written == 3:
                import os
                os._exit(9)
        self.placed.place(name, box, data)


class ToyTPRollout(WeightbusWorker):
    """Rank ``rank`` of a replica holding the toy block tensor-parallel over ``world`` ranks
    (its shards placed; ``rotary.inv_freq`` taken whole by its sink). ``die_at``: the
    process ends mid-update at that version."""

    def __init__(self, rank: int, world: int, die_at: int | None = None):
        torch.set_num_threads(1)
        self.rank, self.world, self.die_at, self.in_flight = rank, world, die_at, None
        self.params = rollout_params(rank, world)
        self.rotary = {"rotary.inv_freq": torch.full((5,), float("nan"))}

    async def wb_receive(self, version):
        self.in_flight = version
        return await super().wb_receive(version)

    def weights_placements(self):
        placed = placements(self.params, self.rank, self.world)
        if self.die_at is None:
            return placed
        from weightbus.engines.sharded import Placed
        return _DiesMidUpdate(Placed(placed, f"rank {self.rank}"), self, self.die_at)

    def weights_sink(self):
        """Every local tensor (a joiner copies them from its peer's sink; an update's sink
        leaves the placed ones out: not strict, as the fused qkv is no update tensor's
        name), or, with a Destinations, the one taken whole."""
        from weightbus import ModuleSink
        if self.die_at is not None:
            return ModuleSink(self.rotary)
        return ModuleSink({**self.params, **self.rotary}, strict=False)

    def wrong(self, step: int) -> list[str]:
        """The tensors that are not the trainer's at ``step``, bitwise."""
        want = expected(step, self.rank, self.world)
        bad = [n for n, t in self.params.items() if not torch.equal(t, want[n])]
        if not torch.equal(self.rotary["rotary.inv_freq"], weights(step)["rotary.inv_freq"]):
            bad.append("rotary.inv_freq")
        return bad

    def received(self) -> int:
        return self._wb_engine.last_stats.bytes


def delta_dense_bucket(rank: int, port: int) -> dict:
    """Delta mode on sharded receive where a bucket's records would not fit it: one rollout
    rank keeps 4 tensors of 256 bytes and one of 192 whole, a bucket of 1280 bytes holds all
    five (1,216 of its 1,216 payload bytes), and an update that changes every element makes
    dense records of 1,464 bytes. That bucket goes dense (the others of its round as
    records), the next update, changing 2%, as records again; bitwise after each."""
    from weightbus.engines.delta import shards as ds
    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if rank == 0 else "rollout",
                                          bucket_size=1280, timeout=30, delta=True)
    shapes = {f"w{i}": (128,) for i in range(4)} | {"v": (96,)}
    g = torch.Generator().manual_seed(5)
    w = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    held = {n: torch.full(s, float("nan")).to(torch.bfloat16) for n, s in shapes.items()}
    if rank:
        engine.set_shard_destinations({n: [(Box.whole(s), held[n])] for n, s in shapes.items()})
    connect(engine, rdv, 1, 1)
    real, dense = ds._agree_sizes, []

    def agree(*a, **k):  # (what the ranks agreed, recorded: not changed)
        sized, went, more = real(*a, **k)
        dense.append(len(went))
        return sized, went, more
    ds._agree_sizes = agree
    out: dict = {"wrong": [], "delta": [], "dense": dense}
    for step, fraction in enumerate([None, 1.0, 0.02], 1):
        if fraction is not None:
            for t in w.values():
                k = max(1, round(t.numel() * fraction))
                t[torch.randperm(t.numel(), generator=g)[:k]] += 1
        if rank == 0:
            stats = asyncio.run(engine.send_weights(ModuleSource(w), version=step))
        else:
            async def take():
                return [n async for n, _ in engine.receive_weights()]
            assert asyncio.run(take()) == []
            stats = engine.last_stats
            out["wrong"] += [f"{step}:{n}" for n in shapes if not torch.equal(held[n], w[n])]
        rdv.all_gather(None)  # (the trainer's weights change only once both sides checked)
        out["delta"].append(stats.delta)
    engine.finalize(destroy_group=True)
    return out
