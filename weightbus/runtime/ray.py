"""Ray actors as a ``WorkerGroup`` (``pip install weightbus[ray]``), for jobs that span
machines. Rank r is an actor running ``cls(r, size, *args, **kwargs)``.

Replicas may also register themselves: each rank of a rollout replica, wherever and by
whomever it was started, calls :func:`register_self` (e.g. in its constructor); a manager
made with ``registry=`` takes every complete replica in at its next update, drops those
that :func:`unregister_self` or die, and never needs to be handed a replica list."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from weightbus.runtime.group import Pending, WorkerError, default_name

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("weightbus.runtime.ray needs Ray: pip install 'weightbus[ray]'") from e


def ensure_ray(**init_kwargs: Any) -> None:
    """Start (or join) Ray. A local cluster inherits this process's import path, so
    actors can import the same worker classes."""
    if ray.is_initialized():
        return
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    init_kwargs.setdefault("runtime_env", {"env_vars": env})
    init_kwargs.setdefault("include_dashboard", False)
    init_kwargs.setdefault("log_to_driver", False)
    ray.init(**init_kwargs)


class _RayPending:
    def __init__(self, group: RayWorkerGroup, method: str, refs: list[Any]):
        self.group, self.method, self.refs = group, method, refs

    def result(self, timeout: float) -> list[Any]:
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout)
        ready_set = set(ready)
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        kinds: dict[int, str] = {}
        for r, ref in enumerate(self.refs):
            if ref not in ready_set:
                failures[r], kinds[r] = f"no answer within {timeout:.0f}s", "timed out"
                continue
            try:
                results[r] = ray.get(ref, timeout=1.0)
            except RayActorError as e:
                failures[r], kinds[r] = f"actor died: {str(e).splitlines()[0]}", "died"
            except RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                failures[r], kinds[r] = f"{type(cause).__name__}: {cause}", "raised"
            except GetTimeoutError:
                failures[r], kinds[r] = f"no answer within {timeout:.0f}s", "timed out"
        if failures:
            raise WorkerError(self.group.name, self.method, failures, kinds)
        return [results[r] for r in range(len(self.refs))]


class RayWorkerGroup:
    """``size`` Ray actors of ``cls``. ``actor_options`` go to ``.options()`` (e.g.
    ``num_gpus=1``, a placement group, ``scheduling_strategy``). Each actor runs one
    call at a time (``max_concurrency=1``) unless ``actor_options`` says otherwise."""

    def __init__(self, cls: type, size: int, *args: Any, name: str | None = None,
                 actor_options: dict[str, Any] | None = None, start_timeout: float = 120.0,
                 **kwargs: Any):
        ensure_ray()
        self.name = name or default_name(cls, size)
        opts = {"num_cpus": 0, "max_concurrency": 1, **(actor_options or {})}
        remote_cls = ray.remote(cls)
        self.actors = [remote_cls.options(**opts).remote(r, size, *args, **kwargs) for r in range(size)]
        # an actor's first call fails if its constructor did: this waits for all of them
        self.submit("__weightbus_ping__").result(start_timeout)

    @property
    def size(self) -> int:
        return len(self.actors)

    def submit(self, method: str, args: Sequence[tuple] | None = None,
               kwargs: Sequence[dict] | None = None) -> Pending:
        refs = []
        for r, actor in enumerate(self.actors):
            a = tuple(args[r]) if args else ()
            k = dict(kwargs[r]) if kwargs else {}
            if method == "__weightbus_ping__":
                refs.append(actor.__ray_call__.remote(lambda self: None))
            else:
                refs.append(getattr(actor, method).remote(*a, **k))
        return _RayPending(self, method, refs)

    @classmethod
    def from_actors(cls, actors: Sequence[Any], name: str) -> RayWorkerGroup:
        """A group over actors started elsewhere (rank r = ``actors[r]``)."""
        group = cls.__new__(cls)
        group.name, group.actors = name, list(actors)
        return group

    def kill(self, rank: int) -> None:
        ray.kill(self.actors[rank], no_restart=True)

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


# ------------------------------------------------------------------ self-registration

#: Ray namespace of the registries, so replicas started by another driver find them
NAMESPACE = "weightbus"


class _Registry:
    """Replicas that registered themselves, rank by rank: name -> (size, {rank: actor})."""

    def __init__(self) -> None:
        self._replicas: dict[str, tuple[int, dict[int, Any]]] = {}

    def register(self, name: str, rank: int, size: int, actor: Any) -> None:
        known = self._replicas.setdefault(name, (size, {}))
        if known[0] != size:
            raise ValueError(f"replica {name!r} registered with {known[0]} ranks; rank {rank} says {size}")
        if not 0 <= rank < size:
            raise ValueError(f"replica {name!r}: rank {rank} is outside 0..{size - 1}")
        known[1][rank] = actor

    def unregister(self, name: str) -> None:
        self._replicas.pop(name, None)

    def complete(self) -> dict[str, list[Any]]:
        return {n: [ranks[r] for r in range(size)] for n, (size, ranks) in self._replicas.items()
                if len(ranks) == size}


def _registry(name: str) -> Any:
    """The registry actor ``name`` (made by whoever asks first; it lives until
    :func:`drop_registry`, so it outlives the processes that registered)."""
    ensure_ray()
    return ray.remote(_Registry).options(name=name, namespace=NAMESPACE, get_if_exists=True,
                                         lifetime="detached", num_cpus=0).remote()


def register_self(replica: str, rank: int, size: int, registry: str = "weightbus",
                  timeout: float = 60.0) -> None:
    """Called by each rank of a rollout replica (an actor) to join the managers that watch
    ``registry``: once all ``size`` ranks have registered, the next update includes it."""
    me = ray.get_runtime_context().current_actor
    ray.get(_registry(registry).register.remote(replica, rank, size, me), timeout=timeout)


def unregister_self(replica: str, registry: str = "weightbus", timeout: float = 60.0) -> None:
    """The replica leaves: the next update does not include it (any rank may call it)."""
    ray.get(_registry(registry).unregister.remote(replica), timeout=timeout)


def registered(registry: str, timeout: float = 60.0) -> dict[str, list[Any]]:
    """Every complete replica registered in ``registry``: name -> its actors by rank."""
    return ray.get(_registry(registry).complete.remote(), timeout=timeout)


def drop_registry(registry: str) -> None:
    try:
        ray.kill(ray.get_actor(registry, namespace=NAMESPACE), no_restart=True)
    except ValueError:  # there is none
        pass
