"""Delta mode, receiver side: apply each record in place, each checked by its digest,
and verify the whole destinations every ``verify_every`` updates (see the package's
docstring)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from weightbus.engines.delta import cpu as kernels
from weightbus.engines.delta import gpu
from weightbus.engines.delta.encoding import (
    _HEADER,
    _MASK,
    _WORDS,
    BITMAP,
    DENSE,
    DIGEST,
    FULL,
    SPARSE,
    _bits,
    _pad,
    _unpack_bits,
    _weighted,
    _weighted_range,
)
from weightbus.engines.delta.protocol import Engine, _agree, _plan, _PlanView
from weightbus.packing import buffers
from weightbus.plan import Bucket, Manifest


class Chain:
    """A receiver's record of what it holds: the version, a digest of every patch applied
    since its last full update (equal on receivers that applied the same ones), and the
    running digest each destination tensor should have (see the module's step 5)."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.digest = 0
        self.sums: torch.Tensor | None = None  # int64 per tensor, on the host (None: not known)
        self.unchecked = 0  # delta updates applied since the destinations were last checked
        self.plan: int | None = None  # sharded receive: the plan its pieces were numbered by


def receive(engine: Engine, version: int, manifest: Manifest,
            error: str | None) -> tuple[str | None, int, int]:
    """The receiver side of one delta-mode update (after the header): applies every record
    into the destinations. Returns (error, bytes, buckets)."""
    chain: Chain = engine._chain  # type: ignore[attr-defined]
    dest = engine._dest
    held = chain.version if dest is not None and engine.version == chain.version else None
    full = engine.last_full = not _agree(engine, held, chain.digest)
    targets: list[torch.Tensor | None] = []
    if error is None:
        if dest is None:
            error = (f"{engine.where()}: delta mode writes in place: call set_destinations() (the "
                     f"manager's workers do it from their sink) before receiving")
        else:
            targets, error = _targets(engine, manifest, dest)
    chain.version, applied = None, 0
    check = WholeCheck(engine, chain, targets if error is None else [], full)
    moved = torch.zeros(len(manifest.metas), dtype=torch.int64) if check.on and not full else None
    every: list[Bucket] = []  # every round's buckets
    later: list[Any] = []  # the checks of patches still being written (a GPU's), with their buckets

    def failed(e: Exception, index: int) -> str:
        return f"{engine.where()}: {e}" if isinstance(e, _Drift) else \
            f"{engine.where()}: applying bucket {index}: {e}"

    def settled() -> None:  # (before a slot takes another bucket, and at the end)
        nonlocal error
        while later:
            index, checked = later.pop(0)
            try:
                checked()
            except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
                error = error or failed(e, index)

    go_on = True
    while go_on:
        plan, go_on = _plan(engine, [], every)  # (joined while the last round's patches are written)
        settled()
        for b in plan[: engine.num_buffers]:
            engine._post_recv(b)
        for i, b in enumerate(plan):
            slot = engine._wait_recv(b)
            status, msg = buffers.check_trailer(slot, b, version, engine.where())
            if status != buffers.STATUS_OK and error is None:
                error = msg or f"{engine.where()}: bucket {b.index} arrived with status {status}"
            if error is None:
                engine.version = None  # from the first byte written on, the old version is gone
                check.before_writes()
                checks: list[Any] = []
                try:
                    with torch.no_grad():  # destinations may be parameters
                        applied += _apply(slot, b.used, targets, manifest, full, moved, checks)
                except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
                    error = failed(e, b.index)
                later += [(b.index, c) for c in checks]
            engine._release(b)
            if i + engine.num_buffers < len(plan):
                settled()
                engine._post_recv(plan[i + engine.num_buffers])
        every += plan
    settled()
    engine._flush_recv(_PlanView(every))
    error = check.finish(targets, manifest, version, moved, error)
    if error is None:
        chain.digest = ((version * 7919 + 1) if full else
                        (chain.digest * 1000003 + applied + version)) & _MASK
        engine._delta_pending = (version, full)  # type: ignore[attr-defined]
    return error, sum(b.wire_bytes for b in every), len(every)


class _Drift(Exception):
    pass


class WholeCheck:
    """Step 5 for one update (see the package's docstring): the running digest of every
    destination tensor, moved by what the update applied, and, every ``verify_every`` delta
    updates, compared with a fresh read of the tensors.

    The fresh read is of the tensors as they are *before* this update writes, against the
    running digests the last update left: the receiver's device is idle then (the
    trainers diff, the first bucket moves), where a read after the last write was the
    update's last step (~20 ms of an 8b model's ~50 over NVLink). It covers every change
    since the last check, made by anything but an applied patch (a patch is checked on its
    own as it is applied): a copy that drifted between updates fails the first delta
    update after it, as before, and one that drifted during an update (this update's own
    writes included) the next one. Started where the update knows its destinations and
    whether it is a delta; :meth:`before_writes` is called before its first write (a GPU's
    read goes on a side stream, which the writes wait for; a host's in a thread, joined);
    :meth:`finish` at its end, whatever happened."""

    _streams: dict[torch.device, Any] = {}

    def __init__(self, engine: Engine, chain: Chain, targets: Any, full: bool) -> None:
        self.engine, self.chain, self.targets = engine, chain, targets
        self.on = engine.verify_every > 0
        self.due = self.on and not full and chain.sums is not None \
            and chain.unchecked + 1 >= engine.verify_every
        self._fresh: Any = None  # the read in flight: (stream, event, sums) on a GPU, a thread on a host
        self._got: list[Any] = []
        self._waited = False
        if self.due and targets:
            if not isinstance(targets, _Targets):
                self.targets = targets = _Targets(targets)
            if targets.device is not None and targets.device.type == "cuda" and gpu.usable(targets[0]):
                stream = self._streams.get(targets.device)
                if stream is None:
                    stream = self._streams[targets.device] = torch.cuda.Stream(targets.device)
                stream.wait_stream(torch.cuda.current_stream(targets.device))  # (what came before)
                with torch.cuda.stream(stream):
                    sums = gpu.digests(targets.addr, targets.size, targets.esize, targets.device)
                    done = torch.cuda.Event()
                    done.record(stream)
                self._fresh = (stream, done, sums)
            else:
                worker = threading.Thread(target=self._read, args=(targets,), name="weightbus-delta-check",
                                          daemon=True)
                worker.start()
                self._fresh = worker

    def _read(self, targets: Any) -> None:
        """A host's read, on its thread: the digests, or what it raised (an error of the update)."""
        try:
            self._got.append(digests(targets))
        except Exception as e:  # noqa: BLE001 - reported by finish()
            self._got.append(e)

    def before_writes(self) -> None:
        """This update's first write follows (the fresh read has taken what it reads)."""
        if self._waited:
            return
        self._waited = True
        if isinstance(self._fresh, tuple):
            torch.cuda.current_stream(self.targets.device).wait_event(self._fresh[1])
        elif self._fresh is not None:
            self._fresh.join()

    def _sums(self) -> torch.Tensor | Exception | None:
        if isinstance(self._fresh, tuple):
            stream, _, sums = self._fresh
            with torch.cuda.stream(stream):
                return sums.cpu()
        if self._fresh is not None:
            self._fresh.join()
        return self._got[0] if self._got else None

    def finish(self, targets: Any, manifest: Manifest, version: int, moved: torch.Tensor | None,
               error: str | None) -> str | None:
        """The update's end: its error, else the check's (None: all well). Moves the running
        digests by ``moved`` (None: a full update, which sets them from the tensors)."""
        chain = self.chain
        fresh = self._sums() if self.due else None  # (read to its end, whatever happened)
        if isinstance(fresh, Exception) and error is None:
            error = (f"{self.engine.where()}: delta mode: reading this rank's destinations for the "
                     f"whole-destination check: {fresh}; the next update is sent whole")
        if error is not None or not self.on:
            chain.sums = None
            return error
        if moved is None or chain.sums is None:  # (a full update; or a joiner's first delta: from here)
            chain.sums, chain.unchecked = digests(targets), 0
            return None
        bad: list[int] = []
        if fresh is not None:
            bad = (fresh != chain.sums).nonzero().squeeze(1).tolist()
            chain.unchecked = 0
        else:
            chain.unchecked += 1
        chain.sums += moved
        if not bad:
            return None
        chain.sums = None
        names = ", ".join(repr(manifest.metas[i].name) for i in bad[:3]) + (
            f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        return (f"{self.engine.where()}: delta mode: this rank's copy of {names} no longer holds what "
                f"the trainer sent: it changed at elements no patch touched since it was last checked (a "
                f"bit flip, or something other than weightbus wrote it). Version {version} is not held; "
                f"the next update is sent whole (a dense resync)")


def digests(targets: list[torch.Tensor]) -> torch.Tensor:
    """Every flat tensor's whole digest, ``sum(w(i) * x[i])`` over its elements' bit
    patterns (int64 on the host): one read of each, by the kernels of their device (a
    row per tensor, in one call) or, without them, by torch ops."""
    if not isinstance(targets, _Targets):
        targets = _Targets(targets)
    if not len(targets):
        return torch.zeros(0, dtype=torch.int64)
    size = targets.size
    if targets.device is not None:
        if (lib := kernels.usable(targets[0])) is not None:  # (a row each, written nowhere)
            zero = torch.zeros_like(size)
            rows = torch.stack([torch.full_like(size, DIGEST), targets.addr, size, targets.esize, zero, zero,
                                zero, size], 1)
            return kernels.apply_many(lib, rows)[:, 0].clone()
        if gpu.usable(targets[0]) is not None:
            return gpu.digests(targets.addr, size, targets.esize, targets.device).cpu()
    return torch.stack([_weighted_range(0, _bits(t).long()).cpu() for t in targets])


def _apply_torch(kind: int, raw: torch.Tensor, vals: torch.Tensor, sub: torch.Tensor, n: int, k: int,
                 start: int, name: str, r: int, bounds: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """A SPARSE or BITMAP record written by torch ops (a GPU, or no C kernels); returns our
    digest (a 0-d tensor, read back with the bucket's others)."""
    if kind == SPARSE:
        pos = raw.view(torch.int32).long()
        bounds.append((r, ((pos < 0) | (pos >= n)).any()))
        pos = pos.clamp(0, max(n - 1, 0))  # an out-of-range position fails the check, not here
    else:
        pos = _unpack_bits(raw, n).nonzero().squeeze(1)
        if pos.numel() != k:
            raise _Drift(f"tensor {name!r}: a patch of elements [{start}, {start + n}) says "
                         f"{k} changes but its bitmap has {pos.numel()}")
    old = torch.index_select(_bits(sub), 0, pos)  # (index_select, index_copy_: ~2x fancy indexing)
    sub.index_copy_(0, pos, vals)
    return _weighted(pos + start, _bits(vals).long() - old.long())


class _Targets(list):  # type: ignore[type-arg]
    """The flat destination of every tensor and, read once per update (not per record),
    their addresses, sizes and element sizes as (host) tensors, and the device all are on
    (None: more than one; then a bucket is laid out by tensor ops and written by the
    kernels of that device)."""

    def __init__(self, flat: list[torch.Tensor]):
        super().__init__(flat)
        at = [(t.data_ptr(), t.numel(), t.element_size()) for t in flat]
        self.addr, self.size, self.esize = (torch.tensor([w[i] for w in at], dtype=torch.int64)
                                            for i in range(3))
        devices = {t.device for t in flat}
        self.device = devices.pop() if len(devices) == 1 else None


def _targets(engine: Engine, manifest: Manifest, dest: dict[str, torch.Tensor]
             ) -> tuple[list[torch.Tensor | None], str | None]:
    """Every tensor's destination, flat and checked; kept for the next update while the
    destinations are the same tensors at the same addresses (a check per tensor that costs
    a fraction of making them: models with many small tensors)."""
    held = getattr(engine, "_delta_targets", None)  # (dest, fingerprint, size, tensors, targets)
    fp = manifest.tensors_fingerprint
    if held is not None and held[0] is dest and held[1] == fp and held[2] == len(dest) \
            and [t.data_ptr() for t in held[3]] == held[4].addr.tolist():
        return held[4], None
    out: list[torch.Tensor | None] = []
    originals = []
    for m in manifest.metas:
        t = dest.get(m.name)
        if t is None or t.dtype != m.dtype or tuple(t.shape) != tuple(m.shape) or not t.is_contiguous():
            have = "none" if t is None else f"{t.dtype}{list(t.shape)}"
            return [], (f"{engine.where()}: delta mode writes every tensor in place, but the destination "
                        f"of {m.describe()} is {have} (a contiguous tensor of the wire dtype and shape "
                        f"is needed)")
        originals.append(t)
        out.append(t.view(-1))
    targets = _Targets(out)
    engine._delta_targets = (dest, fp, len(dest), originals, targets)  # type: ignore[attr-defined]
    return targets, None


def _apply(slot: torch.Tensor, used: int, targets: list[Any], manifest: Manifest, full: bool,
           moved: torch.Tensor | None = None, later: list[Any] | None = None) -> int:
    """Write every record of a bucket into its target; returns the sum of their digests,
    and adds each into its tensor's entry of ``moved`` (where given).
    Reads the directory once and checks every digest (and position) at once at the end:
    host tensors by the C kernels, a call per thread for the whole bucket; others by
    torch ops. ``later``: where a GPU's checks wait for its writes, they are appended
    here instead, to be called (each raises ``_Drift`` as ``_apply`` would) before the
    bucket's slot is used again and before the update ends."""
    if used < 8:
        return 0
    count = int(slot[:8].view(torch.int64).item())
    if not 0 <= count <= (used - 8) // _HEADER:
        raise _Drift(f"a delta bucket is malformed (it says {count} records in {used} bytes)")
    if not isinstance(targets, _Targets):
        targets = _Targets(targets)
    if count and targets.device is not None and targets.device != slot.device:
        # (a host bucket for GPU tensors, as gloo moves: the records are few bytes, one copy
        # of them to the tensors' device, then its kernels)
        slot = slot[:used].to(targets.device)
    if count and targets.device == slot.device:
        if (lib := kernels.usable(slot)) is not None:
            return _apply_listed(lambda rows: kernels.apply_many(lib, rows), slot, used, count, targets,
                                 manifest, moved)
        if gpu.usable(slot) is not None:
            return _apply_listed(lambda rows: gpu.apply_many(rows, slot.device, wait=False), slot, used,
                                 count, targets, manifest, moved, later)
    heads = slot[8:8 + count * _HEADER].view(torch.int64).view(count, _WORDS).tolist() if count else []
    offset, total = 8 + count * _HEADER, 0
    checks: list[tuple[int, Any, int]] = []  # (record, our digest, theirs)
    bounds: list[tuple[int, torch.Tensor]] = []  # (record, whether a position was out of range)
    for r, (index, kind, start, n, k, digest) in enumerate(heads):
        if not 0 <= index < len(targets) or kind not in (FULL, SPARSE, BITMAP, DENSE):
            raise _Drift(f"a delta record is malformed (tensor {index}, kind {kind})")
        dst = targets[index]
        size, e = dst.numel(), dst.element_size()
        if start < 0 or n < 0 or not 0 <= k <= n or start + n > size:
            raise _Drift(f"tensor {manifest.metas[index].name!r}: a record for elements [{start}, "
                         f"{start + n}) lies outside its {size}")
        where = offset  # positions or bitmap (none for dense values)
        if kind in (SPARSE, BITMAP):
            offset += _pad(4 * k) if kind == SPARSE else _pad((n + 7) // 8)
        values = offset
        offset += _pad((n if kind in (FULL, DENSE) else k) * e)
        if offset > used:
            raise _Drift(f"tensor {manifest.metas[index].name!r}: a delta record runs past its bucket")
        total += digest if kind != FULL else 0
        meta = manifest.metas[index]
        sub = dst[start:start + n]
        if kind == FULL:
            sub.copy_(slot[values:values + n * e].view(meta.dtype))
        elif kind == DENSE:
            vals = slot[values:values + n * e].view(meta.dtype).to(sub.device)  # (targets on many devices)
            checks.append((r, _weighted_range(start, _bits(vals).long() - _bits(sub).long()), digest))
            sub.copy_(vals)
        else:
            raw = slot[where:where + (4 * k if kind == SPARSE else (n + 7) // 8)].to(sub.device)
            vals = slot[values:values + k * e].view(meta.dtype).to(sub.device)
            checks.append((r, _apply_torch(kind, raw, vals, sub, n, k, start, meta.name, r, bounds), digest))
    bad = set()
    if bounds:
        flags = torch.stack([f for _, f in bounds]).tolist()
        bad |= {r for (r, _), f in zip(bounds, flags, strict=True) if f}
    if checks:
        ours = torch.stack([torch.as_tensor(d, dtype=torch.int64, device=slot.device) for _, d, _ in checks])
        theirs = torch.tensor([d for _, _, d in checks], dtype=torch.int64, device=slot.device)
        bad |= {checks[i][0] for i in (ours != theirs).nonzero().squeeze(1).tolist()}
    if bad:
        raise _mismatch(heads[min(bad)], manifest)
    if moved is not None and heads:
        at = torch.tensor(heads, dtype=torch.int64)
        patch = at[:, 1] != FULL
        moved.index_add_(0, at[patch, 0], at[patch, 5])
    return total


def _mismatch(head: list[int], manifest: Manifest) -> _Drift:
    index, _, start, n, _, digest = head
    return _Drift(f"tensor {manifest.metas[index].name!r}: elements [{start}, {start + n}) do not match "
                  f"the trainer's after the patch (its digest {digest:#x}): the patch, or this rank's "
                  f"copy of the previous version, is corrupt")


def _apply_listed(apply_rows: Any, slot: torch.Tensor, used: int, count: int, targets: _Targets,
                  manifest: Manifest, moved: torch.Tensor | None, later: list[Any] | None = None) -> int:
    """``_apply`` by the kernels (C on a host, Triton on a GPU): the directory read once,
    checked and laid out by tensor ops (no Python per record: models have tens of thousands
    of tensors), every record written by ``apply_rows`` (a row per record, see
    ``cpu.apply_many``; or a function that returns those, the writes in flight), then every
    check at once (or, the writes in flight and ``later`` given, appended to it)."""
    heads = slot[8:8 + count * _HEADER].view(torch.int64).view(count, _WORDS).cpu()
    index, kind, start, n, k, digest = heads.unbind(1)

    def first(bad: torch.Tensor) -> list[int] | None:
        return heads[int(bad.nonzero()[0, 0])].tolist() if bool(bad.any()) else None

    if (h := first((index < 0) | (index >= len(targets)) | (kind < FULL) | (kind > DENSE))) is not None:
        raise _Drift(f"a delta record is malformed (tensor {h[0]}, kind {h[1]})")
    size, e = targets.size[index], targets.esize[index]
    # (each bound apart first: no sum of two huge numbers can wrap around)
    if (h := first((start < 0) | (n < 0) | (k < 0) | (k > n) | (start > size) | (n > size)
                   | (start + n > size))) is not None:
        raise _Drift(f"tensor {manifest.metas[h[0]].name!r}: a record for elements [{h[2]}, {h[2] + h[3]}) "
                     f"lies outside its {targets[h[0]].numel()}")
    sparse, bitmap = kind == SPARSE, kind == BITMAP
    where = torch.where(sparse, (4 * k + 7) // 8 * 8, torch.where(bitmap, ((n + 7) // 8 + 7) // 8 * 8, 0))
    values = (torch.where(sparse | bitmap, k, n) * e + 7) // 8 * 8
    end = torch.cumsum(where + values, 0) + (8 + count * _HEADER)
    if (h := first(end > used)) is not None:
        raise _Drift(f"tensor {manifest.metas[h[0]].name!r}: a delta record runs past its bucket")
    at = slot.data_ptr() + end - values - where  # each record's first byte
    rows = torch.stack([kind, targets.addr[index] + start * e, n, e, start, at, at + where, k], 1)
    got = apply_rows(rows)

    def check() -> None:
        ours, status = (got() if callable(got) else got).unbind(1)
        miscounted = bitmap & (status != k)
        if (h := first(miscounted)) is not None:
            seen = int(status[int(miscounted.nonzero()[0, 0])])
            raise _Drift(f"tensor {manifest.metas[h[0]].name!r}: a patch of elements [{h[2]}, {h[2] + h[3]}) "
                         f"says {h[4]} changes but its bitmap has {'bits past its end' if seen < 0 else seen}"
                         )
        if (h := first((sparse & (status >= 0)) | ((kind != FULL) & (ours != digest)))) is not None:
            raise _mismatch(h, manifest)

    if callable(got) and later is not None:
        later.append(check)
    else:
        check()
    patch = kind != FULL
    if moved is not None:
        moved.index_add_(0, index[patch], digest[patch])
    return sum(digest[patch].tolist())
