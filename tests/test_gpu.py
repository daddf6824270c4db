"""GPU paths (skipped without CUDA): NCCL between two GPUs and CUDA IPC on one, several
updates with changing weights, odd shapes, a tensor larger than the bucket, with
PyTorch's expandable segments on and off. Run on the device machine."""

import asyncio
import os

import pytest
import torch

from weightbus import CheckpointEngineRegistry, ModuleSink, ModuleSource
from weightbus.runtime.local import Rendezvous, connect, spawn
from weightbus.tools.demo import digest

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_2gpu = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _weights(k: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(k)
    return {"big": torch.randn(3_000_001, device=device, generator=g),  # 6 MB bf16 > 1 MiB bucket
            "odd": torch.randn(37, 129, device=device, generator=g),
            "t": torch.randn(64, 48, device=device, generator=g).t(),  # non-contiguous
            "half": torch.randn(5, 7, device=device, generator=g).half(),
            "ids": torch.randint(0, 1000, (17,), device=device, generator=g),
            "mask": torch.rand(33, device=device, generator=g) > 0.5,
            "scalar": torch.randn((), device=device, generator=g),
            "empty": torch.empty(0, 8, device=device)}


def _targets(device: torch.device) -> dict[str, torch.Tensor]:
    """A rollout's tensors for ``_weights``: zeros, floating ones in bfloat16 (the wire)."""
    return {n: torch.zeros(t.shape, dtype=torch.bfloat16 if t.is_floating_point() else t.dtype,
                           device=device) for n, t in _weights(0, device).items()}


def _send(engine, k: int, device: torch.device) -> dict[str, str]:
    """The trainer's update ``k`` (``_weights(k)`` on the bfloat16 wire); what it sent, hashed."""
    src = ModuleSource(_weights(k, device), dtype=torch.bfloat16)
    asyncio.run(engine.send_weights(src, version=k))
    return {n: digest(t.to(src.wire_dtype(t)).cpu()) for n, t in src}


def gpu_worker(rank: int, backend: str, port: int, expandable: bool, direct: bool = False):
    if expandable:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    index = rank if backend == "nccl" else 0
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=120)
    engine = CheckpointEngineRegistry.new(backend, bucket_size=1 << 20, device=device, timeout=120,
                                          role="trainer" if rank == 0 else "rollout")
    target = None
    if rank == 1:
        target = _targets(device)
        ptrs = {n: t.data_ptr() for n, t in target.items()}
        if direct:
            engine.set_destinations(target)
    connect(engine, rdv, 1, 1)
    if direct and backend == "colocated":
        assert engine._direct
    out = []
    for k in range(1, 4):
        rdv.all_gather(None)
        if rank == 0:
            out.append(_send(engine, k, device))
        else:
            asyncio.run(ModuleSink(target).load(engine.receive_weights()))
            torch.cuda.synchronize()
            assert all(t.data_ptr() == ptrs[n] for n, t in target.items())  # updated in place
            out.append({n: digest(t.cpu()) for n, t in target.items()})
    if direct and backend == "colocated":  # a tensor the rollout lacks: every rank fails, naming it
        rdv.all_gather(None)
        try:
            if rank == 0:
                extra = {**_weights(9, device), "surplus": torch.ones(3, device=device)}
                asyncio.run(engine.send_weights(ModuleSource(extra, dtype=torch.bfloat16), version=9))
            else:
                asyncio.run(ModuleSink(target).load(engine.receive_weights()))
            out.append("no error")
        except Exception as e:  # noqa: BLE001
            out.append(str(e))
    engine.finalize(destroy_group=True)
    return out


def _check(port, backend, expandable, direct=False):
    trainer, rollout = spawn(gpu_worker, 2, (backend, port, expandable, direct), timeout=300)
    if direct and backend == "colocated":
        assert "surplus" in trainer[-1] and "surplus" in rollout[-1], (trainer[-1], rollout[-1])
        trainer, rollout = trainer[:-1], rollout[:-1]
    assert rollout == trainer
    assert trainer[0] != trainer[1] != trainer[2]  # weights changed between updates


@needs_2gpu
@pytest.mark.parametrize("expandable,into", [(False, False), (True, False), (False, True)])
def test_nccl_two_gpus_bitwise(port, expandable, into):
    _check(port, "nccl", expandable, direct=into)


@needs_gpu
@pytest.mark.parametrize("expandable", [False, True])
def test_colocated_cuda_ipc_bitwise(port, expandable):
    _check(port, "colocated", expandable)


@needs_gpu
def test_colocated_direct_into_rollout_tensors(port):
    _check(port, "colocated", False, direct=True)


def slow_consumer_worker(rank: int, port: int):
    """The CUDA IPC ring with a rollout whose copies out of each bucket queue behind a
    long GPU sleep: neither side synchronizes per bucket (the slots' events say when a copy
    ran), so a trainer that reused a slot before the rollout's copy out of it ran would
    tear the update. 1 MiB buckets, 2 slots, 3 updates that change every tensor."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=120)
    engine = CheckpointEngineRegistry.new("colocated", bucket_size=1 << 20, device=device, timeout=120,
                                          num_buffers=2, role="trainer" if rank == 0 else "rollout")
    target = _targets(device)
    connect(engine, rdv, 1, 1)
    assert len(engine._peer_events) == 1 and not engine._direct  # the ring, with events
    out = []
    for k in range(1, 4):
        rdv.all_gather(None)
        if rank == 0:
            out.append(_send(engine, k, device))
        else:
            for name, t in engine.receive_weights_sync():
                torch.cuda._sleep(20_000_000)  # (~10 ms of GPU time before this copy runs)
                target[name].copy_(t)
            out.append({n: digest(t.cpu()) for n, t in target.items()})
    engine.finalize(destroy_group=True)
    return out


@needs_gpu
def test_colocated_ring_waits_for_a_slow_consumer(port):
    trainer, rollout = spawn(slow_consumer_worker, 2, (port,), timeout=300)
    assert rollout == trainer
    assert trainer[0] != trainer[1] != trainer[2]


@needs_gpu
@pytest.mark.parametrize("who", ["trainer", "rollout"])
@pytest.mark.parametrize("phase", ["mid-update", "final-status"])
def test_colocated_ring_peer_lost_on_gpu(port, who, phase):
    """The CUDA IPC ring (its events) with the trainer or a rollout SIGKILLed in an update:
    every survivor raises within the deadline naming the phase, never hangs on the GPU."""
    from faults_common import check_peer_lost
    check_peer_lost(port, "colocated", phase, who, "kill", gpu=True)


def direct_moved_worker(rank: int, port: int):
    """Direct mode: the rollout re-allocates one of its exported tensors (as a sleep that
    frees weights does): the next update fails on both ranks before a byte is written,
    naming the rollout; formed again (prepare), the group updates bitwise."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    role = "trainer" if rank == 0 else "rollout"
    target = {n: torch.zeros(t.shape, dtype=torch.bfloat16 if t.is_floating_point() else t.dtype,
                             device=device) for n, t in _weights(0, device).items() if t.numel()}
    out = []

    def formed(prefix):
        engine = CheckpointEngineRegistry.new("colocated", bucket_size=1 << 20, device=device, timeout=60,
                                              role=role)
        if rank == 1:
            engine.set_destinations(target)
        connect(engine, Rendezvous("127.0.0.1", port, rank, 2, timeout=120, prefix=prefix), 1, 1)
        assert engine._direct
        return engine

    def update(engine, k):
        try:
            if rank == 0:
                w = {n: t for n, t in _weights(k, device).items() if t.numel()}
                asyncio.run(engine.send_weights(ModuleSource(w, dtype=torch.bfloat16), version=k))
                return {n: digest(t.to(torch.bfloat16 if t.is_floating_point() else t.dtype).cpu())
                        for n, t in w.items()}
            asyncio.run(ModuleSink(target).load(engine.receive_weights()))
            torch.cuda.synchronize()
            return {n: digest(t.cpu()) for n, t in target.items()}
        except Exception as e:  # noqa: BLE001
            return str(e)

    engine = formed("a")
    out.append(update(engine, 1))
    if rank == 1:
        target["odd"].data = torch.zeros_like(target["odd"])  # new memory under the same tensor
    out.append(update(engine, 2))
    engine.finalize(destroy_group=True)
    engine = formed("b")
    out.append(update(engine, 3))
    engine.finalize(destroy_group=True)
    return out


def _middle_update_failed(trainer: list, rollout: list, *words: str) -> None:
    """Of three updates, the first and last landed bitwise on both sides, the weights
    changing; the middle one failed on both, each saying ``words``."""
    assert trainer[0] == rollout[0] and trainer[2] == rollout[2] and trainer[0] != trainer[2]
    for side in (trainer[1], rollout[1]):
        assert isinstance(side, str) and all(w in side for w in words), side


@needs_gpu
def test_colocated_direct_refuses_destinations_that_moved(port):
    trainer, rollout = spawn(direct_moved_worker, 2, (port,), timeout=300)
    _middle_update_failed(trainer, rollout, "moved since", "nothing was written")


def _direct_pair(rank: int, port: int, timeout: float):
    """A colocated pair on GPU 0 in direct mode (the rollout's tensors ``_targets``), with
    the trainer's "written" event shared: (device, rendezvous, engine, the rollout's tensors)."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=120)
    engine = CheckpointEngineRegistry.new("colocated", device=device, timeout=timeout,
                                          role="trainer" if rank == 0 else "rollout")
    target = _targets(device)
    if rank == 1:
        engine.set_destinations(target)
    connect(engine, rdv, 1, 1)
    assert engine._direct and engine._written_event is not None
    return device, rdv, engine, target


def direct_checked_worker(rank: int, port: int):
    """Direct mode, the outcome agreed while the trainer's writes run: a rollout whose
    ``on_complete`` checks what landed, and a trainer whose writes queue behind ~50 ms of GPU
    work. The rollout returns, and its check runs, only after the writes ran (it sees every
    tensor bitwise); a check that fails fails the update on both ranks, naming it; the next
    one lands."""
    device, rdv, engine, target = _direct_pair(rank, port, timeout=60)
    out = []
    for k in range(1, 4):
        rdv.all_gather(None)
        try:
            if rank == 0:
                torch.cuda._sleep(100_000_000)  # (~50 ms of GPU time ahead of the writes)
                out.append(_send(engine, k, device))
                continue
            seen: dict[str, str] = {}

            def check(k=k, seen=seen):
                seen.update({n: digest(t.cpu()) for n, t in target.items()})
                if k == 2:
                    raise RuntimeError("the rollout's own check refused it")
            for _ in engine.receive_weights_sync(on_complete=check):
                pass
            out.append(seen)
        except Exception as e:  # noqa: BLE001
            out.append(str(e))
    engine.finalize(destroy_group=True)
    return out


@needs_gpu
def test_colocated_direct_rollout_checks_what_landed(port):
    trainer, rollout = spawn(direct_checked_worker, 2, (port,), timeout=300)
    _middle_update_failed(trainer, rollout, "refused it", "rollout rank")


def direct_writer_lost_worker(rank: int, port: int):
    """Direct mode: the trainer is SIGKILLed while its writes wait behind ~20 s of GPU work,
    after the outcome was agreed: the rollout, waiting for those writes, raises within its
    deadline naming what it waited for, and claims no version."""
    import signal
    import threading
    import time
    device, rdv, engine, target = _direct_pair(rank, port, timeout=8)
    pids = rdv.all_gather(os.getpid())
    if rank == 0:
        _send(engine, 1, device)
        rdv.all_gather(None)
        torch.cuda._sleep(40_000_000_000)  # (~20 s of GPU time: killed long before)
        _send(engine, 2, device)
        return "not killed"
    asyncio.run(ModuleSink(target).load(engine.receive_weights()))
    rdv.all_gather(None)
    threading.Timer(2.0, os.kill, (pids[0], signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        asyncio.run(ModuleSink(target).load(engine.receive_weights()))
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        return {"error": str(e), "seconds": time.monotonic() - t0, "version": engine.version}


@needs_gpu
def test_colocated_direct_trainer_lost_while_writing(port):
    _, rollout = spawn(direct_writer_lost_worker, 2, (port,), timeout=120, allow_fail=frozenset({0}))
    assert rollout["error"] and "trainer's writes" in rollout["error"], rollout
    assert rollout["seconds"] < 8 * 2 + 5 and rollout["version"] is None, rollout


def _mutate_some(w: dict[str, torch.Tensor], fraction: float, seed: int) -> None:
    """Change ``fraction`` of every tensor's elements by one step of its bit pattern."""
    g = torch.Generator(device=next(iter(w.values())).device).manual_seed(seed)
    for t in w.values():
        flat = t.view(-1)
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randint(0, flat.numel(), (k,), device=t.device, generator=g)
        if t.dtype == torch.bool:
            flat[idx] = ~flat[idx]
        else:
            bits = flat.view({2: torch.int16, 8: torch.int64}[t.element_size()])
            bits[idx] += 1


def delta_gpu_worker(rank: int, backend: str, port: int):
    """Delta mode with CUDA tensors on both sides (the Triton kernels), sent in rounds that
    reuse the trainer's device arena: a full update, deltas at 2 %, one at 40 % (dense
    records), bitwise after each."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["WEIGHTBUS_DELTA_ROUNDS"] = "4"
    device = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.cuda.set_device(device)
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=120)
    engine = CheckpointEngineRegistry.new(backend, bucket_size=1 << 20, timeout=120, delta=True,
                                          role="trainer" if rank == 0 else "rollout",
                                          **({"device": device} if backend == "nccl" else {}))
    g = torch.Generator(device=device).manual_seed(0)
    w = {"big": torch.randn(3_000_001, device=device, generator=g).bfloat16(),  # 6 MB: many buckets
         "odd": torch.randn(37, 129, device=device, generator=g).bfloat16(),
         "half": torch.randn(5, 7, device=device, generator=g).half(),
         "ids": torch.randint(0, 1000, (4099,), device=device, generator=g),
         "mask": torch.rand(33, device=device, generator=g) > 0.5}
    target = {n: torch.zeros_like(t) for n, t in w.items()}
    if rank == 1:
        engine.set_destinations(target)
    connect(engine, rdv, 1, 1)
    out = []
    for k, fraction in enumerate([None, 0.02, 0.02, 0.4, 0.02]):
        if fraction is not None:
            _mutate_some(w, fraction, k)
        rdv.all_gather(None)
        if rank == 0:
            asyncio.run(engine.send_weights(ModuleSource(w), version=k + 1))
            torch.cuda.synchronize()
            out.append(({n: digest(t.cpu()) for n, t in w.items()}, engine.last_full))
        else:
            asyncio.run(ModuleSink(target).load(engine.receive_weights()))
            torch.cuda.synchronize()
            out.append(({n: digest(t.cpu()) for n, t in target.items()}, engine.last_full))
    engine.finalize(destroy_group=True)
    return out


def _check_delta(port, backend):
    trainer, rollout = spawn(delta_gpu_worker, 2, (backend, port), timeout=300)
    assert rollout == trainer
    assert [full for _, full in trainer] == [True, False, False, False, False]
    assert len({str(d) for d, _ in trainer}) == len(trainer)  # weights changed between updates


@needs_gpu
def test_delta_gloo_cuda_tensors_bitwise(port):
    _check_delta(port, "gloo")


@needs_2gpu
def test_delta_nccl_two_gpus_bitwise(port):
    _check_delta(port, "nccl")


@needs_gpu
def test_delta_on_sharded_receive_cuda_tensors_bitwise(port):
    """Delta mode on sharded receive with every rank's tensors on the GPU (gloo between
    them): the sender's pieces diffed by the Triton kernels against snapshots on the GPU,
    the two TP ranks' patches applied there (a strided region staged), in 4 rounds of small
    buckets; a full update, then deltas at 2 %, bitwise on both ranks after each."""
    import workers_shards as ws
    out = spawn(ws.run_delta, 3, (1, 2, port, 4, 512, 1, 0, None, 0.02, None, 1, "bfloat16", "cuda", 4),
                timeout=300)
    for got in out[1:]:
        assert got["errors"] == [None] * 4 and got["wrong"] == [], (got["errors"], got["wrong"])
        assert [s["delta"] for s in got["stats"]] == [False, True, True, True]


@needs_gpu
@pytest.mark.parametrize("every", [1, 2])
def test_delta_on_sharded_receive_cuda_catches_a_drifted_copy(port, every):
    """The whole-destination check on a GPU (read on a side stream before the update
    writes, which wait for it): a bit flipped in rank 1's up.weight before update 2 fails
    the first update that checks (2, or 3 with ``verify_every=2``) on every rank, naming
    it; the next goes whole and lands bitwise."""
    import workers_shards as ws
    out = spawn(ws.run_delta, 3, (1, 2, port, 5, 512, 1, 0, None, 0.02, 2, every, "bfloat16", "cuda", 4),
                timeout=300)
    fails = 1 if every == 1 else 2  # (the failing update's index)
    for got in out:
        errors = got["errors"]
        assert [e is None for e in errors] == [k != fails for k in range(5)], errors
        assert "up.weight[" in errors[fails] and "no longer holds what the trainer sent" in errors[fails]
        want = [False, True, True, True][:fails] + [None, False, True, True][:5 - fails]
        assert [s and s["delta"] for s in got["stats"]] == want
    assert out[2]["wrong"] == ([] if every == 1 else ["2:up.weight"]) and out[1]["wrong"] == []


@pytest.mark.parametrize("relay", [0, 1, 2])
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
def test_sharded_nccl_to_three_replicas_direct_chain_and_tree(port, relay):
    """One trainer GPU to 3 replicas of one GPU each over NCCL: each replica fed by the
    trainer (relay=0), or relayed from replica to replica (a chain, relay=1; a tree,
    relay=2); 3 updates with every element changing, bitwise on every rank, the relaying
    trainer sending one replica's bytes."""
    import workers_shards as ws
    steps = 3
    out = spawn(ws.run, 4, (1, 1, port, steps, 4096, False, 3, relay, "nccl"), timeout=240)
    for q in range(3):
        assert out[1 + q]["wrong"] == [], (q, out[1 + q]["wrong"])
    sent = out[0]["stats"][-1]["wire_bytes"]
    one = out[1]["stats"][-1]["wire_bytes"]
    assert sent == (one if relay else 3 * one), (sent, one)
