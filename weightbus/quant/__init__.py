"""Serving precision on the wire: a trainer's bf16/fp32 weights quantized, on the trainer,
into the fp8 format the rollout engine serves, so half the bytes travel and the rollout
holds exactly what its own quantizer would have made of the same weights.

A :class:`Fp8Format` is one of the layouts vLLM serves fp8 weights in:

- ``block``: e4m3 with one float32 scale per 128x128 block (Qwen3-FP8, DeepSeek-V3
  checkpoints), the scale under ``<prefix>weight_scale_inv``;
- ``tensor``: one scale for the whole weight, under ``<prefix>weight_scale``;
- ``channel``: one scale per output row, shape ``[rows, 1]``, under ``<prefix>weight_scale``.

The values are bitwise those of vLLM's own quantizers (``per_block_cast_to_fp8`` for
blocks, ``QuantFP8``'s native path for tensors and rows): the same float32 operations in
the same order, run a slab of rows at a time so the float32 temporaries stay small. The
tests call vLLM's functions as the reference.

The rollout declares its formats (:func:`module_formats` reads them off a model that holds
fp8 weights and their scales); the trainer wraps its source in :class:`QuantizedSource`,
which yields each declared weight as its fp8 payload followed by its scale, under the
rollout's names. Tensors without a declared format travel as before.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from weightbus.errors import PlanError
from weightbus.plan import Manifest, TensorMeta

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
#: vLLM's floor for a dynamic scale (``input_quant_fp8._FP8_MIN_SCALING_FACTOR``)
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
#: float32 bytes a quantizer works on at once (a slab of rows)
_SLAB = 64 << 20

Kind = Literal["block", "tensor", "channel"]
_SHAPE = operator.attrgetter("shape")


@dataclass(frozen=True)
class Fp8Format:
    """How one weight is served in fp8: ``kind`` and, for blocks, the block shape."""

    kind: Kind = "block"
    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if self.kind not in ("block", "tensor", "channel"):
            raise ValueError(f"Fp8Format.kind must be 'block', 'tensor' or 'channel', got {self.kind!r}")
        if len(self.block) != 2 or min(self.block) < 1:
            raise ValueError(f"Fp8Format.block must be two positive sizes, got {self.block!r}")

    def scale_name(self, name: str) -> str:
        """The scale's name for weight ``name`` (``...weight`` -> ``...weight_scale_inv`` for
        blocks, ``...weight_scale`` otherwise), as fp8 checkpoints name them."""
        return name + ("_scale_inv" if self.kind == "block" else "_scale")

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        rows, cols = _matrix(shape)
        if self.kind == "block":
            return (-(-rows // self.block[0]), -(-cols // self.block[1]))
        return () if self.kind == "tensor" else (rows, 1)

    def check(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Raises :class:`PlanError` unless a ``dtype`` tensor of ``shape`` can take this
        format (a floating-point matrix)."""
        if not dtype.is_floating_point or dtype.itemsize == 1:
            raise PlanError(f"{name!r} is {dtype}: only a bf16/fp16/fp32 weight quantizes to fp8")
        if len(shape) != 2:
            raise PlanError(f"{name!r} has shape {tuple(shape)}: fp8 {self.kind} weights are 2-D matrices")

    def quantize(self, t: torch.Tensor, out: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp8 payload, float32 scale)`` of ``t``, bitwise as vLLM's quantizer for this
        kind; written into ``out``/``scale`` where given."""
        self.check("tensor", tuple(t.shape), t.dtype)
        out = torch.empty(t.shape, dtype=FP8, device=t.device) if out is None else out
        scale = torch.empty(self.scale_shape(tuple(t.shape)), dtype=torch.float32, device=t.device) \
            if scale is None else scale
        if self.kind == "block":
            _quantize_blocks(t, self.block, out, scale)
        elif self.kind == "channel":
            _quantize_rows(t, out, scale)
        else:
            _quantize_tensor(t, out, scale)
        return out, scale

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """float32 values of a payload (for checks and tests)."""
        x = q.float()
        if self.kind == "block":
            bm, bn = self.block
            s = scale.repeat_interleave(bm, 0)[: x.shape[0]].repeat_interleave(bn, 1)[:, : x.shape[1]]
            return x * s
        return x * scale


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2:
        raise PlanError(f"fp8 weights are 2-D matrices, got shape {tuple(shape)}")
    return shape[0], shape[1]


def _slab_rows(cols: int, multiple: int = 1) -> int:
    rows = max(1, _SLAB // (4 * max(cols, 1)))
    return max(multiple, rows // multiple * multiple)


def _quantize_blocks(x: torch.Tensor, block: tuple[int, int], out: torch.Tensor,
                     scale: torch.Tensor) -> None:
    # vLLM's per_block_cast_to_fp8 (utils/deep_gemm.py): zero-padded to whole blocks,
    # amax in float32 clamped at 1e-4, sf = amax / 448, values * (1.0 / sf) cast to e4m3.
    # Slabs of whole block rows give the same bits; only a ragged edge is padded.
    m, n = x.shape
    bm, bn = block
    nb = -(-n // bn)
    step = _slab_rows(nb * bn, bm)
    for r0 in range(0, m, step):
        rows = x[r0:r0 + step]
        r = rows.shape[0]
        rp = -(-r // bm) * bm
        if rp != r or nb * bn != n:
            padded = torch.zeros((rp, nb * bn), dtype=x.dtype, device=x.device)
            padded[:r, :n] = rows
        else:
            padded = rows
        view = padded.view(rp // bm, bm, nb, bn)
        amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
        sf = amax / FP8_MAX
        q = (view * (1.0 / sf)).to(FP8)
        scale[r0 // bm:r0 // bm + rp // bm].copy_(sf.view(rp // bm, nb))
        out[r0:r0 + r].copy_(q.view(rp, nb * bn)[:r, :n])


def _quantize_rows(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> None:
    # vLLM's QuantFP8 (dynamic, per token/row), native path: amax of each row to float32,
    # scale = (amax / 448) clamped below, values * scale.reciprocal() clamped to +-448.
    step = _slab_rows(x.shape[1])
    for r0 in range(0, x.shape[0], step):
        rows = x[r0:r0 + step]
        s = (rows.abs().amax(dim=-1).unsqueeze(-1).to(torch.float32) / FP8_MAX).clamp(min=MIN_SCALE)
        scale[r0:r0 + rows.shape[0]].copy_(s)
        out[r0:r0 + rows.shape[0]].copy_((rows.to(torch.float32) * s.reciprocal()).clamp(-FP8_MAX, FP8_MAX))


def _quantize_tensor(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> None:
    # vLLM's QuantFP8 (dynamic, per tensor), native path: one amax for the whole weight.
    s = (x.abs().max().unsqueeze(-1).to(torch.float32) / FP8_MAX).clamp(min=MIN_SCALE)
    scale.copy_(s.view(scale.shape))
    inv = s.reciprocal()
    step = _slab_rows(x.shape[1])
    for r0 in range(0, x.shape[0], step):
        rows = x[r0:r0 + step]
        out[r0:r0 + rows.shape[0]].copy_((rows.to(torch.float32) * inv).clamp(-FP8_MAX, FP8_MAX))


def _kernel_fits(fmt: Fp8Format, t: torch.Tensor) -> bool:
    return fmt.kind == "block" and t.is_cuda and t.is_contiguous() and \
        t.dtype in (torch.bfloat16, torch.float16, torch.float32)


def quantize_many(items: list[tuple[Fp8Format, torch.Tensor]], cache: dict | None = None
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:meth:`Fp8Format.quantize` of each ``(format, tensor)``, the same bits. Block-format
    CUDA tensors go through one Triton kernel launch per block size and dtype and per
    ``_CHUNK`` bytes, the rest through the plain path a tensor at a time. With ``cache`` (a
    dict the caller keeps), a list of the same tensors as a previous call reuses that
    call's set-up and output buffers (so the last call's outputs are overwritten)."""
    looked = None
    if cache is not None and items:  # (every item a replay's: nothing looked at per tensor)
        looked = _looked_up(items, cache)
        if looked[4] is not None:
            return looked[4].run(cache)[0]
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(items)
    fitting = [k for k, (fmt, t) in enumerate(items) if _kernel_fits(fmt, t)]
    if len(fitting) < len(items):
        looked = None  # (it was of all the items: the kernel's are fewer)
    for k, got in zip(fitting, _quantize_fitting([items[k] for k in fitting], cache, looked)[0], strict=True):
        out[k] = got
    for k, (fmt, t) in enumerate(items):
        if out[k] is None:
            out[k] = fmt.quantize(t)
    return out  # type: ignore[return-value]


class _Replay:
    """A whole call of :func:`_quantize_fitting` kept for the next call with the same
    formats and the very tensors at the very addresses (a model's parameters between
    updates). Per tensor, a first call's host work (~1 us: dtypes, devices, shapes, keys)
    is as long as the kernel's on a GPU, so it launches a chunk at a time, the host's work
    on one beside the kernel of the last; a replay looks at nothing per tensor but two
    C-level passes (identity, pointers), and its first run sets up one launch over all the
    tensors of each block size and dtype (a launch per chunk costs ~30 us of host a time:
    ~450 of them for a 30B MoE, as long as its kernel)."""

    def __init__(self, fmts: list[Fp8Format], ts: list[torch.Tensor], ptrs: Any,
                 chunks: list[tuple[Any, Any]]):
        self.fmts, self.ts, self.ptrs = fmts, ts, ptrs  # (the tensors held: not freed, not reused)
        self.chunks = chunks  # (cache key, launch) of the first call's chunks
        self.launches: list[Any] = []
        self.out: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.flats: list[torch.Tensor] = []

    def fits(self, fmts: list[Fp8Format], ts: list[torch.Tensor], ptrs: Any) -> bool:
        return len(ts) == len(self.ts) and all(map(operator.is_, ts, self.ts)) \
            and all(map(operator.is_, fmts, self.fmts)) and bool((ptrs == self.ptrs).all())

    def run(self, cache: dict) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
        if not self.launches:  # (the first replay: the chunks' set-ups and buffers go first)
            for key, _ in self.chunks:
                cache.pop(key, None)
            self.chunks = []
            items = list(zip(self.fmts, self.ts, strict=True))
            self.out = [None] * len(items)  # type: ignore[list-item]
            for (block, _, _), ks in _groups(items).items():
                launch = _launch([items[k] for k in ks], block, None)[1]
                self.launches.append(launch)
                self.flats.append(launch.scale_flat)
                for k, q, sc in zip(ks, launch.outs, launch.scales, strict=True):
                    self.out[k] = (q, sc)
        for launch in self.launches:
            launch.run()
        return list(self.out), list(self.flats)


def _groups(items: list[tuple[Fp8Format, torch.Tensor]]) -> dict[tuple[Any, ...], list[int]]:
    groups: dict[tuple[Any, ...], list[int]] = {}  # (one launch each: a block size, a dtype, a GPU)
    for k, (fmt, t) in enumerate(items):
        groups.setdefault((fmt.block, t.dtype, t.get_device()), []).append(k)
    return groups


def _looked_up(items: list[tuple[Fp8Format, torch.Tensor]], cache: dict) -> tuple[Any, ...]:
    """(key, formats, tensors, pointers, the replay of the last call with these very tensors
    at these very addresses, or None)."""
    from weightbus.packing import native
    fmts, ts = list(map(_FIRST, items)), list(map(_SECOND, items))
    ptrs = native.data_ptrs(ts)
    key = ("replay", int(ptrs[0]), len(items))
    replay = cache.get(key)
    if isinstance(cache, LaunchCache):
        cache.used.add(key)
    fits = isinstance(replay, _Replay) and replay.fits(fmts, ts, ptrs)
    return key, fmts, ts, ptrs, replay if fits else None


def _quantize_fitting(items: list[tuple[Fp8Format, torch.Tensor]], cache: dict | None,
                      looked: tuple[Any, ...] | None = None
                      ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    # (items that all fit the kernel; ``looked``: their :func:`_looked_up`, where the caller
    # made it.) Returns the (payload, scale) of each, and the flat buffers holding every scale.
    if cache is None or not items:
        return _quantize_fresh(items, cache, [])
    key, fmts, ts, ptrs, replay = looked or _looked_up(items, cache)
    if replay is not None:
        return replay.run(cache)
    chunks: list[tuple[Any, Any]] = []
    out, flats = _quantize_fresh(items, cache, chunks)
    if not isinstance(cache, LaunchCache):  # (a plain dict: this call's earlier tensors go)
        for stale in [k for k, v in cache.items() if isinstance(v, _Replay) and k[2] == len(items)]:
            del cache[stale]
    cache[key] = _Replay(fmts, ts, ptrs, chunks)
    return out, flats


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _quantize_fresh(items: list[tuple[Fp8Format, torch.Tensor]], cache: dict | None, launched: list[Any]
                    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    # (launched a chunk at a time: the host's work on a chunk's 100-1,000 tensors, as long
    # as the kernel's, runs beside the last chunk's kernel; each (cache key, launch) is
    # added to ``launched``.)
    out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(items)  # type: ignore[list-item]
    flats: list[torch.Tensor] = []
    groups: dict[tuple[Any, ...], list[int]] = {}
    held = 0

    def launch_groups() -> None:
        for (block, _, _), ks in groups.items():
            key, launch = _launch([items[k] for k in ks], block, cache)
            launch.run()
            launched.append((key, launch))
            flats.append(launch.scale_flat)
            for k, q, sc in zip(ks, launch.outs, launch.scales, strict=True):
                out[k] = (q, sc)
        groups.clear()

    for k, (fmt, t) in enumerate(items):
        groups.setdefault((fmt.block, t.dtype, t.get_device()), []).append(k)
        held += t.nbytes
        if held >= _CHUNK:
            launch_groups()
            held = 0
    launch_groups()
    return out, flats


_CHUNK = 256 << 20


class LaunchCache(dict):
    """The kernel set-ups (and output buffers) of :func:`quantize_many` by their tensors;
    :meth:`prune` drops those not used since the last prune, so a source whose tensors
    move between updates (an FSDP gather into new buffers) holds one update's worth."""

    def __init__(self) -> None:
        super().__init__()
        self.used: set = set()

    def prune(self) -> None:
        for key in [k for k in self if k not in self.used]:
            del self[key]
        self.used = set()


def _launch(items: list[tuple[Fp8Format, torch.Tensor]], block: tuple[int, int], cache: dict | None
            ) -> tuple[Any, Any]:
    from weightbus.quant import kernels as quant_triton  # (Triton imported on first use: slow to import)
    srcs = [t for _, t in items]
    key = (block, tuple(map(torch.Tensor.data_ptr, srcs)), tuple(map(_SHAPE, srcs)))
    launch = cache.get(key) if cache is not None else None
    if isinstance(cache, LaunchCache):
        cache.used.add(key)
    if launch is None:
        launch = quant_triton.BlockLaunch(srcs, [f.scale_shape(tuple(t.shape)) for f, t in items],
                                          block, FP8_MAX)
        if cache is not None:
            if len(cache) >= 1024:  # (other tensors every time: start over)
                cache.clear()
            cache[key] = launch
    return key, launch


def module_formats(module: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, Fp8Format]:
    """The fp8 formats a rollout model serves, read off the model: every fp8 ``...weight``
    whose scale sits beside it (``weight_scale_inv`` of block shape: ``block``; a scalar
    ``weight_scale``: ``tensor``; a ``[rows, 1]`` one: ``channel``). A block's size is
    the one its scale's shape implies (128 where that fits: the usual size)."""
    named = dict(module.state_dict(keep_vars=True)) if isinstance(module, torch.nn.Module) else dict(module)
    formats: dict[str, Fp8Format] = {}
    for name, t in named.items():
        if t.dtype != FP8 or t.dim() != 2:
            continue
        rows, cols = t.shape
        inv, plain = named.get(name + "_scale_inv"), named.get(name + "_scale")
        if inv is not None and inv.dim() == 2:
            bm = _block_size(rows, inv.shape[0])
            bn = _block_size(cols, inv.shape[1])
            if bm is None or bn is None:
                raise PlanError(f"{name!r} ({rows}x{cols}) has a {tuple(inv.shape)} block scale: "
                                f"no block size fits it")
            formats[name] = Fp8Format("block", (bm, bn))
        elif plain is not None and plain.numel() == 1:
            formats[name] = Fp8Format("tensor")
        elif plain is not None and tuple(plain.shape) == (rows, 1):
            formats[name] = Fp8Format("channel")
    return formats


def _block_size(extent: int, blocks: int) -> int | None:
    # (the sizes in use are powers of two, 128 above all: those nearest 128 first)
    powers = sorted((1 << i for i in range(16)), key=lambda s: abs(s.bit_length() - 8))
    for size in (*powers, *range(1, extent + 1)):
        if -(-extent // size) == blocks:
            return size
    return None


class QuantizedSource:
    """A trainer's source with the weights the rollout serves in fp8 quantized on the way:
    each declared ``...weight`` becomes its fp8 payload and, right after it, its float32
    scale (see :class:`Fp8Format`); every other tensor passes as it is. A weight is taken
    in the wrapped source's wire dtype (its dtype policy: an fp32 trainer's weights are cast
    to bf16 first, as the rollout would have received them) and quantized on the
    tensor's own device: on a CPU one tensor at a time (the extra memory is one weight's
    payload and a slab of float32 rows).

    ``formats`` maps rollout-side weight names to formats, as :func:`module_formats` reads
    them off the rollout model; a name the source does not have is a :class:`PlanError`
    here, not at the first update.

    On a GPU, block-format weights are quantized ``group_bytes`` of them at a time, in one
    kernel launch (:func:`quantize_many`): the source's tensors are held until their
    group is full, so a source that reuses one buffer for several tensors needs
    ``group_bytes=0`` (a launch per tensor). The payloads are kept for the next update,
    whose launches reuse them where the source yields the same tensors (``launches``: the
    dict of an earlier wrapper's ``launches``, to keep them across wrappers)."""

    def __init__(self, source: Any, formats: Mapping[str, Fp8Format], *, group_bytes: int = 1 << 30,
                 launches: dict | None = None):
        metas = list(source.manifest)
        known = {m.name: m for m in metas}
        missing = sorted(set(formats) - set(known))
        if missing:
            raise PlanError(f"QuantizedSource: {len(missing)} declared fp8 weight(s) are not in the "
                            f"source, e.g. {missing[:3]}")
        for name, fmt in formats.items():
            if not isinstance(fmt, Fp8Format):
                raise PlanError(f"QuantizedSource: the format of {name!r} is a {type(fmt).__name__}, "
                                f"not an Fp8Format")
            fmt.check(name, known[name].shape, known[name].dtype)
        if group_bytes < 0:
            raise PlanError(f"QuantizedSource: group_bytes must be >= 0, got {group_bytes}")
        self.source, self.formats, self.group_bytes = source, dict(formats), group_bytes
        #: (CUDA) the kernel's set-up and outputs per group of tensors: a dict shared by
        #: the wrappers of one trainer's successive sources keeps them across updates
        self.launches: dict = LaunchCache() if launches is None else launches
        inner = source.manifest
        out: list[TensorMeta] = []
        self._outer: list[int] = []  # inner tensor i -> its position here (a scale follows it)
        for m in metas:
            self._outer.append(len(out))
            fmt = self.formats.get(m.name)
            if fmt is None:
                out.append(m)
                continue
            out.append(TensorMeta(m.name, FP8, m.shape))
            out.append(TensorMeta(fmt.scale_name(m.name), torch.float32, fmt.scale_shape(m.shape)))
        self._wire = {m.name: m.dtype for m in metas if m.name in self.formats}
        self._scale_names = {name: fmt.scale_name(name) for name, fmt in self.formats.items()}
        self._scaled = [m.name in self.formats for m in metas]
        twice = [1 + k for k in self._scaled]  # (a scale shares its weight's home)
        homes = None if inner.homes is None else \
            [h for h, k in zip(inner.homes, twice, strict=True) for _ in range(k)]
        units = None if inner.units is None else \
            [u for u, k in zip(inner.units, twice, strict=True) for _ in range(k)]
        self.manifest = Manifest(out, homes, units)
        self._fmts = [self.formats[m.name] for m in metas if m.name in self.formats]
        self._wires = [m.dtype for m in metas if m.name in self.formats]
        where = [i for i, k in enumerate(self._scaled) if k]
        self._take = operator.itemgetter(*where) if len(where) > 1 else \
            (lambda held: (held[where[0]],)) if where else (lambda held: ())
        self._last: tuple[Any, Any, list[torch.Tensor]] | None = None  # (held, outputs, the list)

    def plain_tensors(self) -> list[torch.Tensor] | None:
        """Every tensor this source sends, in its manifest's order, the declared weights
        quantized in bulk, where the wrapped source holds its tensors (its
        ``plain_tensors``) and each declared weight is a CUDA tensor of a block format in
        its wire dtype; None otherwise (or where a weight holds NaN or inf: the stream then
        names it), and the engine reads the source tensor by tensor. An unchanged model's
        weights are one replayed launch and the same list as the last update's (which the
        engine does not check again): no step per tensor."""
        inner = getattr(self.source, "plain_tensors", None)
        held = inner() if inner is not None else None
        if held is None or not self._fmts:
            return held
        items = list(zip(self._fmts, self._take(held), strict=True))
        looked = _looked_up(items, self.launches)
        replay = looked[4]
        if replay is not None:
            out, flats = replay.run(self.launches)
        elif all(t.dtype == w and _kernel_fits(f, t) for (f, t), w in zip(items, self._wires, strict=True)):
            out, flats = _quantize_fitting(items, self.launches, looked)
        else:
            return None
        if isinstance(self.launches, LaunchCache):
            self.launches.prune()
        if not _all_finite(flats):
            return None  # (the per-tensor path quantizes again and names the weight)
        last = self._last
        if last is not None and last[0] is held and replay is not None and last[1] is replay.out:
            return last[2]
        whole: list[torch.Tensor] = []
        pairs = iter(out)
        for t, scaled in zip(held, self._scaled, strict=True):
            whole.extend(next(pairs) if scaled else (t,))
        self._last = (held, replay.out if replay is not None else None, whole)
        return whole

    def direct_writer(self, dests: Sequence[torch.Tensor]) -> Callable[[], bool]:
        """A function that writes every tensor this source sends, in its manifest's order,
        straight into ``dests`` (one per manifest entry, of its dtype and shape: a
        colocated rollout's own fp8 weights, their scales and its other tensors), with no
        fp8 copy of the model between; called once per update. On a GPU the block-format
        weights go in one replayed kernel launch whose payloads land in ``dests``, then the
        scales and the other tensors in one tabled copy; elsewhere a weight at a time,
        into its destination. ``dests`` must stay where they are while it is used (the
        caller holds them, and drops the function with them); its set-up is kept while the
        wrapped source hands the same tensors.

        ``dests`` that do not fit the manifest raise :class:`PlanError` here, naming the
        tensor. The function returns False, having written nothing, where the wrapped
        source does not hold its tensors (no ``plain_tensors``), a weight is not in its
        wire dtype (an fp32 trainer's: the usual path casts it first) or a weight's
        destination is not a contiguous tensor on its device: the caller then reads the
        source as usual. A weight holding NaN or inf raises :class:`PlanError` naming it;
        what was written by then stays (on a GPU, every payload and no scale), so the
        caller fails the update."""
        metas = self.manifest.metas
        if len(dests) != len(metas):
            raise PlanError(f"QuantizedSource.direct_writer: {len(dests)} destinations for "
                            f"{len(metas)} tensors")
        for m, d in zip(metas, dests, strict=True):
            if not isinstance(d, torch.Tensor) or d.dtype != m.dtype or tuple(d.shape) != m.shape:
                got = f"{str(d.dtype).removeprefix('torch.')}{list(d.shape)}" \
                    if isinstance(d, torch.Tensor) else type(d).__name__
                raise PlanError(f"QuantizedSource.direct_writer: the destination of {m.describe()} is {got}")
        return _Writer(self, list(dests))

    def _quantized(self, named: Iterator[tuple[str, torch.Tensor | None]]
                   ) -> Iterator[tuple[str, torch.Tensor | None]]:
        # CUDA weights are quantized a group at a time (one launch for up to group_bytes
        # of them; the tensors between them wait with them, in order); host weights one
        # at a time, as they come. (Per tensor, only what must be: 9,312 tensors of a
        # 30B MoE make every microsecond here 10 ms an update.)
        formats, wire, group_bytes = self.formats, self._wire, self.group_bytes
        pending: list[tuple[str, torch.Tensor | None, Fp8Format | None, bool]] = []
        todo: list[tuple[Fp8Format, torch.Tensor]] = []
        held = 0
        for name, t in named:
            fmt = formats.get(name)
            kernel = False
            if fmt is not None and t is not None:
                if t.dtype != wire[name]:
                    # (the source's dtype policy first: a rollout quantizes what it would
                    # have received, an fp32 trainer's weights cast to bf16)
                    t = t.detach().to(wire[name])
                kernel = _kernel_fits(fmt, t)
                if kernel:
                    todo.append((fmt, t))
                    held += t.nbytes
            pending.append((name, t, fmt, kernel))
            if not todo or held >= group_bytes:
                yield from self._flush(pending, todo)
                pending, todo, held = [], [], 0
        yield from self._flush(pending, todo)
        if isinstance(self.launches, LaunchCache):  # (a whole update went: keep what it used)
            self.launches.prune()

    def _flush(self, pending: list[tuple[str, torch.Tensor | None, Fp8Format | None, bool]],
               todo: list[tuple[Fp8Format, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | None]]:
        grouped, flats = _quantize_fitting(todo, self.launches) if todo else ([], [])
        # a NaN or inf anywhere shows in its block's scale: a group's scales are checked at
        # once (one sync), and tensor by tensor only to name the culprit
        suspect = bool(flats) and not _all_finite(flats)
        done = iter(grouped)
        scale_names = self._scale_names
        for name, t, fmt, kernel in pending:
            if fmt is None:
                yield name, t
            elif t is None:  # (a rank that does not pack it)
                yield name, None
                yield scale_names[name], None
            else:
                q, scale = next(done) if kernel else fmt.quantize(t.detach())
                if (suspect or not kernel) and not bool(torch.isfinite(scale).all()):
                    _non_finite(name, fmt, scale)
                yield name, q
                yield scale_names[name], scale

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._quantized(iter(self.source))  # type: ignore[return-value]

    def iter_for(self, owners: Any, rank: int, into: Any = None
                 ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """As the wrapped source's ``iter_for`` (a rank that packs none of a tensor may
        skip making it); the engine copies what is yielded (no direct mode)."""
        inner = getattr(self.source, "iter_for", None)
        if inner is None:
            return iter(self)
        outer, scaled = self._outer, self._scaled

        def packers(i: int) -> frozenset[int]:  # (the weight's and its scale's buckets)
            return owners(outer[i]) | owners(outer[i] + 1) if scaled[i] else owners(outer[i])
        return self._quantized(inner(packers, rank))


class _Writer:
    """:meth:`QuantizedSource.direct_writer`'s function, for one list of destinations. Its set-up,
    made again only where the wrapped source's tensors moved: a kernel launch per block
    size and dtype whose payloads are the destinations (and whose scales go to a flat
    buffer of its own, looked at for NaN and inf at once before any is copied out), the
    plain quantizer a weight at a time for the rest, and one tabled copy of the scales and
    the tensors that pass as they are."""

    def __init__(self, source: QuantizedSource, dests: list[torch.Tensor]):
        self.source, self.dests = source, dests
        self.names = [m.name for m in source.manifest]
        self.held_at: Any = None  # (the addresses of the tensors it was set up for)
        self.ready = False
        self.launches: list[tuple[Any, list[str]]] = []
        self.plain: list[tuple[int, Fp8Format, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.copies: Any = None

    def __call__(self) -> bool:
        from weightbus.packing import native
        inner = getattr(self.source.source, "plain_tensors", None)
        held = inner() if inner is not None else None
        if held is None:
            return False
        # set up again only where a tensor moved (its address: a source may hand the same
        # list with a tensor in it replaced, or a new list of the same tensors)
        at = native.data_ptrs(held)
        if self.held_at is None or len(at) != len(self.held_at) or not bool((at == self.held_at).all()):
            self.ready = self._set_up(held)
            self.held_at = at
        if not self.ready:
            return False
        self._run()
        return True

    def _set_up(self, held: list[torch.Tensor]) -> bool:
        from weightbus.packing import buffers
        source, dests = self.source, self.dests
        fmts = source._fmts
        weights = list(source._take(held))
        at = [o for o, k in zip(source._outer, source._scaled, strict=True) if k]
        for t, w, o in zip(weights, source._wires, at, strict=True):
            d = dests[o]
            if t.dtype != w or d.device != t.device or not d.is_contiguous():
                return False
        kernel = [k for k, (f, t) in enumerate(zip(fmts, weights, strict=True)) if _kernel_fits(f, t)]
        if kernel:
            from weightbus.quant import kernels as quant_triton  # (Triton: imported where used)
        self.launches, scale_srcs, scale_dsts = [], [], []
        for (block, _, _), ks in _groups([(fmts[k], weights[k]) for k in kernel]).items():
            ks = [kernel[j] for j in ks]
            launch = quant_triton.BlockLaunch(
                [weights[k] for k in ks], [fmts[k].scale_shape(tuple(weights[k].shape)) for k in ks],
                block, FP8_MAX, outs=[dests[at[k]] for k in ks])
            self.launches.append((launch, [self.names[at[k]] for k in ks]))
            scale_srcs += launch.scales
            scale_dsts += [dests[at[k] + 1] for k in ks]
        fitting = set(kernel)
        self.plain = [(at[k], fmts[k], weights[k], dests[at[k]], dests[at[k] + 1])
                      for k in range(len(weights)) if k not in fitting]
        passing = [(dests[o], t) for o, t, scaled in zip(source._outer, held, source._scaled, strict=True)
                   if not scaled]
        self.copies = None if not scale_dsts and not passing else \
            buffers.CopyList(scale_dsts + [d for d, _ in passing], scale_srcs + [t for _, t in passing])
        return True

    def _run(self) -> None:
        for launch, _ in self.launches:
            launch.run()
        for o, fmt, t, q, scale in self.plain:
            fmt.quantize(t.detach(), q, scale)
            if not bool(torch.isfinite(scale).all()):
                _non_finite(self.names[o], fmt, scale)
        if self.launches and not _all_finite([launch.scale_flat for launch, _ in self.launches]):
            for launch, names in self.launches:  # (only to name the weight)
                for name, scale in zip(names, launch.scales, strict=True):
                    if not bool(torch.isfinite(scale).all()):
                        _non_finite(name, Fp8Format("block", launch.block), scale)
        if self.copies is not None:
            self.copies.run()


def _all_finite(flats: list[torch.Tensor]) -> bool:
    """Whether every scale in these flat buffers is finite: one look (one synchronization)
    for a whole group's scales; a NaN or inf weight shows in its block's scale."""
    return bool(torch.stack([torch.isfinite(f).all() for f in flats]).all())


def _non_finite(name: str, fmt: Fp8Format, scale: torch.Tensor) -> None:
    bad = (~torch.isfinite(scale)).nonzero()[0].tolist()
    raise PlanError(f"{name!r} holds NaN or inf (the {fmt.kind} scale at {bad} is "
                    f"{scale[tuple(bad)].item()}): not quantized to fp8")
