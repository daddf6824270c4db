"""Every inference-engine worker's outcome of a call, gathered without leaving a reply behind.

Written for vLLM and used by every engine integration whose calls into its workers cannot
carry a worker's failure back (SGLang's weight loaders crash its scheduler if they raise).
vLLM's multiprocess executor answers a ``collective_rpc`` with the first worker failure it
reads and leaves the other workers' replies queued: the next call into the engine then reads
a stale reply (``Call to sleep method failed: Worker failed with error ...``), and so does
every call after it. One refused update would leave a tensor-parallel replica stuck.

So weightbus's worker side never raises out of a call vLLM forwards to its workers. Each
worker records what happened (:class:`Outcome`) and posts it to the group's rendezvous
store (a ``torch.distributed`` TCPStore that trainer rank 0 or the manager serves) under
``<prefix>/outcome/<call>/<version>/<rank>``; the side that drives vLLM reads every
worker's outcome once vLLM's call has returned (:func:`gather`) and raises one error that
names each failing worker (:func:`failure`). vLLM's channel stays clean: every worker
answered, and every answer was a success.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from weightbus.errors import as_timedelta

_log = logging.getLogger("weightbus")
#: The key of a worker's reply that reports a failure instead of raising it (the
#: ``collective_rpc`` path of :class:`~.extension.WeightbusWorkerExtension`)
FAILED = "weightbus_failed"


@dataclass(frozen=True)
class Outcome:
    """What one call did on one vLLM worker. ``kept``: after a failure, the worker's model
    holds the previous weights whole (False: some layers may hold new ones: torn)."""

    rank: int
    ok: bool = True
    error: str = ""
    kept: bool = True
    #: the worker engine's ``UpdateStats`` of a successful update, as a dict
    stats: dict[str, Any] | None = None


def key(prefix: str, call: str, version: int, rank: int) -> str:
    return f"{prefix}/outcome/{call}/{version}/{rank}"


def post(store: Any, prefix: str, call: str, version: int, outcome: Outcome) -> None:
    """Record ``outcome`` where the driver reads it (best effort: a store that is gone has
    no reader left either)."""
    try:
        store.set(key(prefix, call, version, outcome.rank), pickle.dumps(outcome))
    except Exception as e:  # noqa: BLE001 - the driver then names this worker as silent
        _log.warning("weightbus: rollout rank %d could not post its %s outcome: %s", outcome.rank, call, e)


@contextmanager
def recorded(rank: int, what: str, sink: list[Outcome], kept: Any = None) -> Iterator[None]:
    """Run a block as one call of a vLLM worker: an exception becomes a failed
    :class:`Outcome` appended to ``sink`` (and logged), never a raise out of the worker.
    ``kept()`` says after a failure whether the model still holds its previous weights."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - reported through the outcome, not vLLM's channel
        _log.error("weightbus: rollout rank %d: %s failed: %s", rank, what, e)
        sink.append(Outcome(rank, False, str(e), bool(kept()) if kept is not None else True))
    else:
        sink.append(Outcome(rank))


def gather(store: Any, prefix: str, call: str, version: int, ranks: Iterable[int],
           timeout: float) -> list[Outcome]:
    """Every rank's outcome of ``call`` for ``version``; a rank that posted none within
    ``timeout`` seconds is a failure that says so (its model is then of unknown state)."""
    ranks = list(ranks)
    keys = [key(prefix, call, version, r) for r in ranks]
    try:
        store.wait(keys, as_timedelta(max(0.1, timeout)))
    except Exception:  # noqa: BLE001 - who is missing is named below
        pass
    out = []
    for r, k in zip(ranks, keys, strict=True):
        try:
            got = store.check([k])
        except Exception:  # noqa: BLE001 - the store itself is gone
            got = False
        if got:
            out.append(pickle.loads(store.get(k)))
            try:
                store.delete_key(k)  # read once: the store does not grow with every update
            except Exception:  # noqa: BLE001 - a store without deletes keeps a few bytes more
                pass
        else:
            out.append(Outcome(r, False, f"rollout rank {r} reported no outcome of {call} within "
                                         f"{timeout:g}s (still running, or dead)", kept=False))
    return out


def failure_of(outcomes: Iterable[Outcome], what: str, engine: str = "vLLM") -> str | None:
    """One message naming every failed worker and its cause, and whether the model kept
    its previous weights; None if every worker succeeded."""
    failed = [o for o in outcomes if not o.ok]
    if not failed:
        return None
    KEPT = f"{engine} kept its previous weights"  # noqa: N806 - as the loaders end their errors
    kept = all(o.kept for o in failed)
    by_cause: dict[str, list[int]] = {}  # (ranks that failed for one reason, named once)
    for o in failed:
        by_cause.setdefault(o.error.replace(f" [{KEPT}]", ""), []).append(o.rank)
    causes = "; ".join(f"rollout rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {why}"
                       for why, r in by_cause.items())
    state = KEPT if kept else "some layers may hold the new weights: the model is torn until a " \
                              "complete update"
    return f"{what} failed on {len(failed)} {engine} worker(s): {causes} [{state}]"


def settle(store: Any, prefix: str, version: int, ranks: Iterable[int], timeout: float,
           failure: BaseException | None, what: str, finish: Callable[[str | None], None],
           mark_torn: Callable[[list[int]], None], seen: list[Outcome] | None = None,
           engine: str = "vLLM") -> str | None:
    """The driver's end of an update, once vLLM's call has returned (or failed with
    ``failure``): every worker's outcome read (appended to ``seen``), vLLM's update closed
    with ``finish`` (the version only if every worker succeeded), the torn ranks handed
    to ``mark_torn``. Returns None on success, else one message naming every failure."""
    got = gather(store, prefix, "update", version, ranks, timeout if failure is None else 1.0)
    if seen is not None:
        seen.extend(got)
    why = failure_of(got, what, engine)
    ok = why is None and failure is None
    if why is None:
        why = None if ok else f"{what} failed: {failure}"
    torn = [o.rank for o in got if not o.kept]
    try:
        if torn:  # (first: a replica that holds some new layers is never left under a version)
            mark_torn(torn)
        finish(str(version) if ok else None)
    except Exception as e:  # noqa: BLE001 - reported with the update's own failure
        if ok:
            raise
        why = f"{why}; then closing {engine}'s update failed too: {e}"
    return why
