"""Layer 4, rollout side: load a received stream into a model.

A sink consumes the *whole* stream even when something does not fit, so the engine's
update completes on every rank, then reports everything that was missing, unexpected or
mis-shaped in one :class:`SinkError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from weightbus.errors import SinkError


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
        self._nbytes = {k: t.nbytes for k, t in self.targets.items()}
        # tied weights (an lm_head that is the embedding): one name of a group arriving
        # fills them all, so the others are not missing
        first: dict[tuple, str] = {}
        self._tied: dict[str, str] = {}
        for k, t in self.targets.items():
            if t.numel():
                key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                self._tied[k] = first.setdefault(key, k)
        self._in_place_batches: dict[int, tuple[list, list[str]]] = {}

    def _load_one(self, name: str, t: torch.Tensor, report: LoadReport, seen: set[str]) -> None:
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

    def _close(self, report: LoadReport, seen: set[str], in_place: list[str]) -> LoadReport:
        report.loaded += len(in_place)
        report.bytes += sum(map(self._nbytes.__getitem__, in_place))
        got = {self._tied.get(k, k) for k in seen}
        report.missing = [k for k in self.targets if k not in seen and self._tied.get(k, k) not in got]
        if report.mismatched or (self.strict and not report.ok):
            hint = (" (the update's dtype differs from the model's: send the model's dtype, e.g. "
                    "ModuleSource(model, dtype=...), or pass ModuleSink(..., allow_cast=True) to "
                    "cast on load)") if report.dtype_mismatch else ""
            raise SinkError(f"loading into {type(self.module).__name__} failed: {report.describe()}{hint}")
        return report

    def _load_batch(self, batch: list[tuple[str, torch.Tensor]], report: LoadReport, seen: set[str],
                    in_place: list[str]) -> None:
        """A bucket's worth. A list the engine hands again (same object: its tensors were
        written in place, e.g. destinations or direct mode) costs a few C calls, not a
        Python step per tensor."""
        done = self._in_place_batches.get(id(batch))
        if done is not None and done[0] is batch:
            seen.update(done[1])
            in_place.extend(done[1])
            return
        targets = self.targets if self.name_map is None else {}
        names = []
        for name, t in batch:
            if targets.get(name) is t:
                names.append(name)
            else:
                self._load_one(name, t, report, seen)
        seen.update(names)
        in_place.extend(names)
        if len(names) == len(batch):  # keeps the list alive, so its id stays its own
            if len(self._in_place_batches) >= 65536:  # fresh lists every update: start over
                self._in_place_batches.clear()
            self._in_place_batches[id(batch)] = (batch, names)

    async def load(self, stream: AsyncIterable[tuple[str, torch.Tensor]]) -> LoadReport:
        """Consume an engine's ``receive_weights()`` to the end (a bucket at a time where
        the stream offers it: :meth:`weightbus.WeightStream.batches`)."""
        report, seen, in_place = LoadReport(), set(), []
        batches = getattr(stream, "batches", None)
        if batches is not None:
            async for batch in batches():
                self._load_batch(batch, report, seen, in_place)
            return self._close(report, seen, in_place)
        targets = self.targets if self.name_map is None else {}
        async with contextlib.aclosing(stream) as s:  # type: ignore[type-var]
            async for name, t in s:
                # the engine wrote it in place (destinations, direct mode): the common case
                # costs a lookup, for streams of 100k small tensors
                if targets.get(name) is t:
                    seen.add(name)
                    in_place.append(name)
                else:
                    self._load_one(name, t, report, seen)
        return self._close(report, seen, in_place)

    def load_iter(self, stream: Iterable[tuple[str, torch.Tensor]]) -> LoadReport:
        """The same for a plain iterable."""
        report, seen, in_place = LoadReport(), set(), []
        targets = self.targets if self.name_map is None else {}
        for name, t in stream:
            if targets.get(name) is t:  # as in load()
                seen.add(name)
                in_place.append(name)
            else:
                self._load_one(name, t, report, seen)
        return self._close(report, seen, in_place)
