"""Layer 4, rollout side: load a received stream into a model.

A sink consumes the *whole* stream even when something does not fit, so the engine's
update completes on every rank, then reports everything that was missing, unexpected or
mis-shaped in one :class:`SinkError`.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from weightbus.errors import SinkError

_NBYTES = operator.attrgetter("nbytes")
#: in a sink's ``seen``: a batch of exactly the model's tensors, each once, arrived (so none is
#: missing), said without putting its thousands of names into the set at every update
_EVERY = object()
#: id(batch) -> (batch, its names, its tensors, their bytes), for batches of tensors some
#: model holds (written in place): engines hand the same list objects at every update, so
#: this is worked out once per process, whichever sink loads them (a sink is often made per
#: update). Only such batches are kept: their tensors live on anyway.
_SPLIT: dict[int, tuple[list, list[str], list[torch.Tensor], int]] = {}


def _split(batch: list[tuple[str, torch.Tensor]]) -> tuple[list[str], list[torch.Tensor], int, bool]:
    """(names, tensors, their bytes, whether it was split before)."""
    known = _SPLIT.get(id(batch))
    if known is not None and known[0] is batch:
        return known[1], known[2], known[3], True
    names, tensors = (list(x) for x in zip(*batch, strict=True)) if batch else ([], [])
    return names, tensors, sum(map(_NBYTES, tensors)), False


def _keep_split(batch: list[tuple[str, torch.Tensor]], names: list[str], tensors: list[torch.Tensor],
                nbytes: int) -> None:
    if len(_SPLIT) >= 65536:  # fresh lists every update: start over
        _SPLIT.clear()
    _SPLIT[id(batch)] = (batch, names, tensors, nbytes)  # (keeps the list alive: its id stays its own)


@dataclass
class LoadReport:
    loaded: int = 0
    bytes: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    #: some tensor arrived in another dtype than the model holds (see ``allow_cast``)
    dtype_mismatch: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A plain dict, for a framework's metrics or logs."""
        return {**asdict(self), "ok": self.ok}

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        parts = []
        for what, names in (("missing", self.missing), ("unexpected", self.unexpected),
                            ("mismatched", self.mismatched)):
            if names:
                shown = ", ".join(names[:10]) + (f", ... ({len(names)} in all)" if len(names) > 10 else "")
                parts.append(f"{what}: {shown}")
        return "; ".join(parts)


class ModuleSink:
    """Copies received tensors into a module's parameters and buffers *in place*: every
    tensor keeps its storage (and address), so CUDA graphs and views stay valid.

    Args:
        module: the rollout model, or a mapping of name to the tensors to update.
        strict: raise :class:`SinkError` if any expected tensor did not arrive, or an
            unknown one did. Shape mismatches always raise.
        allow_cast: accept a received dtype that differs from the parameter's (cast on
            copy). Off by default: a silent cast hides a dtype-policy bug.
        name_map: received name -> module name (``None`` drops the tensor).
    """

    def __init__(self, module: nn.Module | Mapping[str, torch.Tensor], *, strict: bool = True,
                 allow_cast: bool = False, name_map: Callable[[str], str | None] | None = None):
        self.module = module
        self.strict = strict
        self.allow_cast = allow_cast
        self.name_map = name_map
        self.targets: dict[str, torch.Tensor] = (
            dict(module.state_dict(keep_vars=True)) if isinstance(module, nn.Module) else dict(module))
        # nothing per tensor here: a sink is often made per update (``ModuleSink(model).load(
        # engine.receive_weights())``), and a model of thousands of tensors would pay for it
        # every time; what needs a look at every tensor is worked out when first needed
        self._in_place_batches: dict[int, tuple[list, bool]] = {}  # id -> (batch, names all targets?)

    @cached_property
    def _tied(self) -> dict[str, str]:
        """Tied weights (an lm_head that is the embedding): name -> the first name of its
        group; one name of a group arriving fills them all, so the others are not missing.
        Only asked for when a name is missing."""
        first: dict[tuple, str] = {}
        tied: dict[str, str] = {}
        for k, t in self.targets.items():
            if t.numel():
                key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                tied[k] = first.setdefault(key, k)
        return tied

    def _load_one(self, name: str, t: torch.Tensor, report: LoadReport, seen: set[Any]) -> None:
        key = self.name_map(name) if self.name_map is not None else name
        if key is None:
            return
        target = self.targets.get(key)
        if target is None:
            report.unexpected.append(name)
            return
        if tuple(target.shape) != tuple(t.shape):
            seen.add(key)  # arrived, but does not fit: mismatched, not missing
            report.mismatched.append(f"{key} (got {list(t.shape)}, model has {list(target.shape)})")
            return
        if target.dtype != t.dtype and not self.allow_cast:
            seen.add(key)
            report.mismatched.append(f"{key} (got {t.dtype}, model has {target.dtype})")
            report.dtype_mismatch = True
            return
        if not (target.data_ptr() == t.data_ptr() and target.stride() == t.stride()):
            with torch.no_grad():  # (an engine in direct mode already wrote it in place)
                target.detach().copy_(t, non_blocking=True)
        seen.add(key)
        report.loaded += 1
        report.bytes += t.numel() * t.element_size()

    def _close(self, report: LoadReport, seen: set[Any], in_place_bytes: int) -> LoadReport:
        report.bytes += in_place_bytes
        # ``seen`` holds only names of the model: as many as it has means none is missing
        if _EVERY not in seen and len(seen) < len(self.targets):
            tied = self._tied
            got = {tied.get(k, k) for k in seen}
            report.missing = [k for k in self.targets if k not in seen and tied.get(k, k) not in got]
        if report.mismatched or (self.strict and not report.ok):
            hint = (" (the update's dtype differs from the model's: send the model's dtype, e.g. "
                    "ModuleSource(model, dtype=...), or pass ModuleSink(..., allow_cast=True) to "
                    "cast on load)") if report.dtype_mismatch else ""
            raise SinkError(f"loading into {type(self.module).__name__} failed: {report.describe()}{hint}")
        return report

    def _load_batch(self, batch: list[tuple[str, torch.Tensor]], report: LoadReport,
                    seen: set[Any]) -> int:
        """A bucket's worth; returns the bytes of its tensors the engine wrote in place (the
        model's own tensors, as with destinations or direct mode: nothing to copy). The
        check that they are is two C-level passes over the batch, not a Python step per
        tensor; a list the engine hands again (the same object: see
        :meth:`weightbus.WeightStream.batches`) is split into names and tensors once per
        process, and checked once per sink."""
        names, tensors, nbytes, known = _split(batch)
        if self.name_map is None:
            done = self._in_place_batches.get(id(batch))
            if (done is not None and done[0] is batch) or \
                    all(map(operator.is_, map(self.targets.get, names), tensors)):
                if not known:
                    _keep_split(batch, names, tensors, nbytes)
                if done is None:
                    if len(self._in_place_batches) >= 65536:  # fresh lists every update: start over
                        self._in_place_batches.clear()
                    every = len(names) == len(self.targets) and set(names) == self.targets.keys()
                    done = self._in_place_batches[id(batch)] = (batch, every)  # (keeps the list, and its id)
                if done[1]:
                    seen.add(_EVERY)
                else:
                    seen.update(names)
                report.loaded += len(names)
                return nbytes
        in_place = 0
        for name, t in batch:
            if self.name_map is None and self.targets.get(name) is t:
                seen.add(name)
                report.loaded += 1
                in_place += t.nbytes
            else:
                self._load_one(name, t, report, seen)
        return in_place

    async def load(self, stream: AsyncIterable[tuple[str, torch.Tensor]]) -> LoadReport:
        """Consume an engine's ``receive_weights()`` to the end (a bucket at a time where
        the stream offers it: :meth:`weightbus.WeightStream.batches`)."""
        report, seen, in_place = LoadReport(), set(), 0
        batches = getattr(stream, "batches", None)
        if batches is not None:
            async for batch in batches():
                in_place += self._load_batch(batch, report, seen)
            return self._close(report, seen, in_place)
        targets = self.targets if self.name_map is None else {}
        async with contextlib.aclosing(stream) as s:  # type: ignore[type-var]
            async for name, t in s:
                # the engine wrote it in place (destinations, direct mode): the common case
                # costs a lookup, for streams of 100k small tensors
                if targets.get(name) is t:
                    seen.add(name)
                    report.loaded += 1
                    in_place += t.nbytes
                else:
                    self._load_one(name, t, report, seen)
        return self._close(report, seen, in_place)

    def load_iter(self, stream: Iterable[tuple[str, torch.Tensor]]) -> LoadReport:
        """The same for a plain iterable."""
        report, seen, in_place = LoadReport(), set(), 0
        targets = self.targets if self.name_map is None else {}
        for name, t in stream:
            if targets.get(name) is t:  # as in load()
                seen.add(name)
                report.loaded += 1
                in_place += t.nbytes
            else:
                self._load_one(name, t, report, seen)
        return self._close(report, seen, in_place)
