"""Layer 2: rendezvous and standalone process groups, built only from torch primitives.

Groups are built from a :class:`torch.distributed.TCPStore` among exactly the ranks that
take part, never from (or into) the user's default process group, so a trainer that
already runs FSDP over its own world and a rollout engine with its own TP group can both
join a weightbus group.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from weightbus.errors import WeightSyncError, as_timedelta


class Pause:
    """The sleeps of one polling wait (a one-sided transfer's state, a mailbox): ``first``
    seconds while the wait is young (a bucket's transfer is milliseconds: it is seen within
    tens of microseconds), then a tenth of the time waited so far, at most ``most``: a long
    wait (a peer that has not started, a hang its deadline will name) leaves the CPU to the
    other processes of the host, adding at most a tenth to the wait. (A poll every 50 us
    kept a core busy for as long as a wait lasted.)"""

    __slots__ = ("_t0", "first", "most")

    def __init__(self, first: float = 50e-6, most: float = 2e-3):
        self._t0 = time.monotonic()
        self.first, self.most = first, most

    def __call__(self) -> None:
        time.sleep(min(self.most, max(self.first, 0.1 * (time.monotonic() - self._t0))))


def local_address() -> str:
    """An address of this host that peers on other hosts can reach (best effort)."""
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    try:  # the interface that would route outward; no packet is sent
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now, for a server started later (not held: where the
    server can bind port 0 itself, prefer that, as :func:`serve_store` does)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_store(timeout: float) -> dist.TCPStore:
    """A store server on a free port of this host (the port is held, so no race)."""
    return dist.TCPStore("0.0.0.0", 0, None, True, timeout=as_timedelta(timeout),
                         wait_for_workers=False)


def connect_store(addr: str, port: int, timeout: float, where: str) -> dist.TCPStore:
    """A client of the store at ``addr:port``, within ``timeout`` seconds.

    First a plain TCP connect, retried until the deadline (the owner may start later).
    Then the store's own handshake, which TCPStore's timeout does not cover: a program that
    accepts connections and never answers (another server on that port) would block the
    constructor forever, so it runs on a daemon thread that this call stops waiting for at
    the deadline (left behind, blocked in a read)."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, deadline - time.monotonic())):
                break
        except OSError as e:
            if time.monotonic() + delay >= deadline:
                raise WeightSyncError(f"{where}: cannot reach the rendezvous store at {addr}:{port} within "
                                      f"{timeout:.0f}s ({e}); is its owner running, and the address "
                                      f"right?") from None
            time.sleep(delay)
            delay = min(1.0, delay * 2)
    # The store's handshake is retried until the deadline: on a loaded host one attempt may
    # time out although the server is up (seen once in CI: a plain connect had just worked).
    # Each attempt gets half the time left: TCPStore may retry a connect that times out up to
    # about twice its timeout, and it must give up before this call does (a thread that
    # comes back out of C++ after the interpreter has begun to exit aborts the process).
    while True:
        box: list[Any] = []
        budget = max(0.5, (deadline - time.monotonic()) / 2)

        def build(box: list[Any] = box, budget: float = budget) -> None:
            try:
                box.append(dist.TCPStore(addr, port, None, False, timeout=as_timedelta(budget)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append(e)

        t = threading.Thread(target=build, name=f"wb-store-{addr}:{port}", daemon=True)
        t.start()
        t.join(max(1.0, deadline - time.monotonic()) + 1.0)
        if not box:
            raise WeightSyncError(f"{where}: the rendezvous store at {addr}:{port} did not answer within "
                                  f"{timeout:.0f}s: something accepts connections there but does not "
                                  f"speak the store protocol (another program on that port?)")
        if not isinstance(box[0], BaseException):
            return box[0]
        err = box[0]
        if deadline - time.monotonic() < 1.0 or not isinstance(err, dist.DistError):
            first = str(err).splitlines()[0] if str(err) else ""
            raise WeightSyncError(f"{where}: cannot reach the rendezvous store at {addr}:{port} within "
                                  f"{timeout:.0f}s ({type(err).__name__}: {first})") from None
        time.sleep(0.1)


def new_group(backend: str, store: dist.Store, prefix: str, rank: int, size: int,
              timeout: float, device: torch.device | None, where: str) -> Any:
    """A standalone process-group backend (``gloo``, ``nccl`` or ``hccl``) of ``size``
    ranks. Blocks until every member has joined, at most ``timeout`` seconds."""
    store = dist.PrefixStore(prefix, store)
    try:
        if backend == "gloo":
            return _bounded(lambda: dist.ProcessGroupGloo(store, rank, size, as_timedelta(timeout)),
                            timeout * 1.5 + 1.0, f"{where}: forming gloo group {prefix!r} (rank {rank} of "
                            f"{size}) did not finish within {timeout * 1.5 + 1.0:.0f}s: the rendezvous store "
                            f"stopped answering (its owner stopped or hung?)")
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = as_timedelta(timeout)
            # weight copies (pack, unpack, casts) run beside the transfers; NCCL's kernels
            # keep the link busy only if they win the SMs
            opts.is_high_priority_stream = True
            pg = dist.ProcessGroupNCCL(store, rank, size, opts)
            if device is not None:
                # eager init binds the communicator to our device now, so the first
                # broadcast is not where a missing peer is discovered
                pg.eager_connect_single_device(device)
            return pg
        if backend == "hccl":
            try:
                import torch_npu  # noqa: F401  (registers ProcessGroupHCCL)
            except ImportError as e:
                raise WeightSyncError(f"{where}: backend 'hccl' needs torch_npu") from e
            return torch.distributed.ProcessGroupHCCL(store, rank, size,  # type: ignore[attr-defined]
                                                      as_timedelta(timeout))
    except WeightSyncError:
        raise
    except Exception as e:  # noqa: BLE001
        raise WeightSyncError(f"{where}: forming {backend} group {prefix!r} "
                              f"(rank {rank} of {size}) failed within {timeout:.0f}s: {e}") from e
    raise WeightSyncError(f"{where}: unknown process-group backend {backend!r}")


def _bounded(make: Any, seconds: float, late: str) -> Any:
    """``make()`` on a daemon thread, waited for at most ``seconds``: gloo's rendezvous
    bounds its store waits by its timeout, but not a store read whose server stopped
    answering mid-reply (a stopped or hung owner), which would block this rank forever.
    Past the bound, ``late`` is raised (the thread is left behind, blocked in that read)."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(make())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append(e)

    t = threading.Thread(target=run, name="wb-form-group", daemon=True)
    t.start()
    t.join(seconds)
    if not box:
        raise WeightSyncError(late)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def broadcast(pg: Any, tensor: torch.Tensor, root: int) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    return pg.broadcast([tensor], opts)


def allreduce_max(pg: Any, tensor: torch.Tensor) -> Any:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    return pg.allreduce([tensor], opts)


#: ``all_gather_into_tensor`` under its current name: torch 2.13 renamed it
#: ``all_gather_single`` and warns on the old one (older torches only have the old one).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
