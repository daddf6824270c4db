"""A safetensors checkpoint as a trainer-side source: the cold start of a replica, or the
"save a checkpoint each step, then sync from it" mode.

The checkpoint is read through the ``safetensors`` library, memory-mapped, one tensor at a
time, as the engine packs it: the sender holds its buckets and the tensor being packed,
never the model (the page cache holds what was read, and the kernel drops it under
pressure). A directory is read the way ``transformers`` writes it: the shards named by
``model.safetensors.index.json`` (its ``weight_map``), or every ``*.safetensors`` file in it.
Everything that can be wrong with the files (a missing shard, a truncated or unreadable
file, an index naming a tensor that no shard holds) is found when the source is made and
named in one error, so a trainer's ``weights_source()`` that builds it fails the update on
every rank at its header. A shard that changes size after that (truncated or rewritten
before it is streamed) is found as the stream opens it: the error names the shard, the
tensor it was to give and the sizes then and now.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from weightbus.errors import PlanError
from weightbus.plan import Manifest, TensorMeta

INDEX = "model.safetensors.index.json"

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise PlanError("SafetensorsSource needs safetensors: pip install safetensors") from None
    return safe_open


class SafetensorsSource:
    """Stream a safetensors checkpoint (a file, or a directory of shards) into any engine.

    Args:
        path: a ``.safetensors`` file, or a directory holding ``model.safetensors.index.json``
            and its shards (or plain ``*.safetensors`` files).
        dtype: wire dtype for floating-point tensors (e.g. ``torch.bfloat16``); 8-bit
            floats, integers and bools keep theirs. ``None`` keeps every dtype.
        name_map: checkpoint name -> rollout name; ``None`` drops the tensor.
    """

    def __init__(self, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                 name_map: Callable[[str], str | None] | None = None):
        self.path = os.fspath(path)
        self.dtype = dtype
        safe_open = _safe_open()
        files = self._files()
        # (file, checkpoint name, rollout name, its dtype and shape in the file)
        self._items: list[tuple[str, str, str, str]] = []
        self._sizes: dict[str, int] = {}  # each shard's size when its header was read
        metas: list[TensorMeta] = []
        for file, wanted in files:
            try:
                self._sizes[file] = os.stat(file).st_size
                with safe_open(file, framework="pt") as f:
                    names = list(f.keys())
                    info = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape())) for n in names}
            except Exception as e:  # noqa: BLE001 - the library says what is wrong (a truncated
                # file: "incomplete metadata, file not fully covered"); we say where
                raise PlanError(f"SafetensorsSource: cannot read {file}: {e}") from None
            if wanted is not None:
                absent = sorted(set(wanted) - set(names))
                if absent:
                    raise PlanError(f"SafetensorsSource: {INDEX} names tensor {absent[0]!r} in {file}, which "
                                    f"does not hold it ({len(absent)} such tensor(s))")
                names = [n for n in names if n in wanted]
            for n in names:
                kind, shape = info[n]
                if kind not in _DTYPES:
                    raise PlanError(f"SafetensorsSource: tensor {n!r} in {file} has dtype {kind}, "
                                    f"which weightbus does not move")
                out = name_map(n) if name_map is not None else n
                if out is None:
                    continue
                self._items.append((file, n, out, f"{kind} {list(shape)}"))
                metas.append(TensorMeta(out, self._wire(_DTYPES[kind]), shape))
        if not metas:
            raise PlanError(f"SafetensorsSource: {self.path} holds no tensor to send")
        self.manifest = Manifest(metas)

    def _files(self) -> list[tuple[str, set[str] | None]]:
        """(shard path, the names the index puts in it, or None: all of them)."""
        p = self.path
        if os.path.isfile(p):
            return [(p, None)]
        if not os.path.isdir(p):
            raise PlanError(f"SafetensorsSource: {p} is neither a file nor a directory")
        index = os.path.join(p, INDEX)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except Exception as e:  # noqa: BLE001
                raise PlanError(f"SafetensorsSource: {index} is not a safetensors index: {e}") from None
            shards: dict[str, set[str]] = {}
            for name, shard in weight_map.items():
                shards.setdefault(shard, set()).add(name)
            out = []
            for shard in sorted(shards):
                file = os.path.join(p, shard)
                if not os.path.isfile(file):
                    raise PlanError(f"SafetensorsSource: shard {file} is missing (the index puts "
                                    f"{len(shards[shard])} tensors in it, e.g. {min(shards[shard])!r})")
                out.append((file, shards[shard]))
            return out
        files = sorted(f for f in os.listdir(p) if f.endswith(".safetensors"))
        if not files:
            raise PlanError(f"SafetensorsSource: {p} has no {INDEX} and no .safetensors file")
        return [(os.path.join(p, f), None) for f in files]

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        if self.dtype is not None and dtype.is_floating_point and dtype.itemsize > 1:
            return self.dtype
        return dtype

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(rollout name, tensor)`` in manifest order, a tensor at a time, from the mapped
        files (the engine casts to the wire dtype inside its copy into the bucket)."""
        safe_open = _safe_open()
        handle, opened = None, None
        try:
            for file, name, out, held in self._items:
                if file != opened:
                    if handle is not None:
                        handle.__exit__(None, None, None)
                        handle = None
                    handle, opened = self._open(safe_open, file, name, held), file
                try:
                    t = handle.get_tensor(name)
                except Exception as e:  # noqa: BLE001 - e.g. the file changed under us
                    raise PlanError(f"SafetensorsSource: reading {name!r} ({held} when the source was "
                                    f"made) from {file}: {e}") from None
                yield out, t
        finally:
            if handle is not None:
                handle.__exit__(None, None, None)

    def _open(self, safe_open: Any, file: str, name: str, held: str) -> Any:
        """A shard, opened to read ``name`` (its first tensor in the stream), once it is
        checked to be the size it had when the source read its header: a shard truncated
        since then fails here, named, instead of as the library's bare error."""
        then = self._sizes[file]
        try:
            now: int | str = os.stat(file).st_size
        except OSError as e:
            now = f"unreadable ({e.strerror})"
        where = (f"SafetensorsSource: shard {file}, to read tensor {name!r} ({held}) "
                 f"from it: it had {then} bytes when the source read its header")
        if now != then:
            cut = " (truncated)" if isinstance(now, int) and now < then else ""
            raise PlanError(f"{where}, it has {now} now{cut}: it changed after the source was made; "
                            f"make the source again once the checkpoint is written")
        try:
            return safe_open(file, framework="pt").__enter__()
        except Exception as e:  # noqa: BLE001 - the library says what is wrong; we say where
            raise PlanError(f"{where} and has as many now, but cannot be read: {e}") from None
