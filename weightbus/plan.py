"""Layer 1: what moves where. Pure functions of the manifest; no I/O, no devices.

A :class:`Manifest` is the ordered list of tensors of one update (name, wire dtype, shape)
with a fingerprint. A :class:`BucketPlan` maps it onto fixed-size byte buckets: every
rank computes the same plan from the same manifest, so per-bucket metadata never has to
travel; only the manifest does, once per change of fingerprint.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from weightbus.errors import ManifestMismatch, PlanError

#: Byte alignment of every tensor start inside a bucket (covers every dtype and the
#: 128/256-byte sweet spots of GPU copies).
ALIGNMENT = 256
#: Bytes at the end of every sent bucket: magic, version, bucket index, status, ...
TRAILER_BYTES = 64


_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def unsendable(name: Any, t: Any) -> str | None:
    """Why ``(name, t)`` cannot travel as raw bytes (None if it can): weights travel as
    dense, strided tensors of a plain dtype, under a non-empty string name."""
    if not isinstance(name, str) or not name:
        return f"tensor names must be non-empty strings, got {name!r} ({type(name).__name__})"
    if not isinstance(t, torch.Tensor):
        return f"{name!r} is a {type(t).__name__}, not a tensor"
    if t.layout != torch.strided:
        return f"{name!r} is a {t.layout} tensor; send it dense (t.to_dense()), or its parts as tensors"
    if t.dtype in _QUANTIZED:
        return (f"{name!r} is a quantized {t.dtype} tensor; send its integer values (t.int_repr()) "
                f"and its scales and zero points as tensors of their own")
    return None


def _align(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorMeta:
    """One tensor as it travels: its (rollout-side) name, wire dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    # cached: a plan asks each of them many times, for every tensor
    @cached_property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @cached_property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        return f"{self.name!r} {str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


class Manifest:
    """The ordered tensors of one update, with a stable fingerprint.

    Names must be unique; a name that repeats is a :class:`PlanError` naming it.

    ``homes`` (optional, one entry per tensor) names the sender ranks that hold each tensor
    at hand, where a source's tensors live on some ranks only (Megatron's pipeline stages
    and experts): the plan then has every bucket packed by a rank that holds all of its
    tensors, so no tensor crosses the trainers' links to reach its packer. An entry of
    None means any rank. Sources whose every rank can produce every tensor (plain modules,
    FSDP2, checkpoints) leave it out, and buckets go round-robin.

    ``units`` (optional, with ``homes``: one id per tensor) marks tensors made together
    (the Hugging Face tensors split from one fused parameter share one id, consecutively):
    the plan keeps a unit with one packer where it can, so none is made twice.

    ``splits`` (optional, one entry per tensor) says where the sender ranks each hold one
    contiguous range of a tensor along one dimension (FSDP2's ``Shard(dim)``): ``(dim,
    bounds)``, sender rank s holding indices ``bounds[s]:bounds[s + 1]`` along ``dim``;
    None where a tensor is not split so. A sharded plan for as many senders as the bounds
    name then has each sender send the receivers' pieces of its own range, and no tensor
    is gathered; other plans ignore it.
    """

    def __init__(self, metas: Iterable[TensorMeta],
                 homes: Iterable[Iterable[int] | None] | None = None,
                 units: Iterable[int] | None = None,
                 splits: Iterable[tuple[int, Sequence[int]] | None] | None = None):
        self.metas: tuple[TensorMeta, ...] = tuple(metas)
        self.splits: tuple[tuple[int, tuple[int, ...]] | None, ...] | None = None
        if splits is not None:
            self.splits = tuple(None if x is None else (int(x[0]), tuple(map(int, x[1]))) for x in splits)
            if len(self.splits) != len(self.metas):
                raise PlanError(f"the manifest has {len(self.metas)} tensors but {len(self.splits)} splits")
            for m, x in zip(self.metas, self.splits, strict=True):
                if x is not None and not _valid_split(x, m.shape):
                    raise PlanError(f"tensor {m.describe()}: its split {x} is not (dim, bounds) with "
                                    f"bounds rising from 0 to the size of that dim")
            if all(x is None for x in self.splits):
                self.splits = None
        self.units: tuple[int, ...] | None = tuple(units) if units is not None else None
        if self.units is not None and len(self.units) != len(self.metas):
            raise PlanError(f"the manifest has {len(self.metas)} tensors but {len(self.units)} units")
        self.homes: tuple[frozenset[int] | None, ...] | None = None
        if homes is not None:
            self.homes = tuple(None if h is None else frozenset(h) for h in homes)
            if len(self.homes) != len(self.metas):
                raise PlanError(f"the manifest has {len(self.metas)} tensors but {len(self.homes)} homes")
            for m, h in zip(self.metas, self.homes, strict=True):
                if h is not None and (not h or min(h) < 0):
                    raise PlanError(f"tensor {m.name!r}: its homes {sorted(h)} must be sender ranks")
            if all(h is None for h in self.homes):
                self.homes = None
        if self.homes is None:
            self.units = None  # (they only steer where homes are)
        seen: set[str] = set()
        for m in self.metas:
            if not isinstance(m.name, str) or not m.name:
                raise PlanError(f"tensor names must be non-empty strings, got {m.name!r}")
            if m.dtype in _QUANTIZED:
                raise PlanError(f"tensor {m.name!r}: quantized dtype {m.dtype} cannot travel as bytes")
            if m.name in seen:
                raise PlanError(f"duplicate tensor name {m.name!r} in the weight stream")
            seen.add(m.name)
            if any(s < 0 for s in m.shape):
                raise PlanError(f"tensor {m.name!r} has a negative dimension {list(m.shape)}")

    @classmethod
    def from_tensors(cls, named: Iterable[tuple[str, torch.Tensor]]) -> Manifest:
        metas = []
        for n, t in named:
            why = unsendable(n, t)
            if why:
                raise PlanError(why)
            metas.append(TensorMeta(n, t.dtype, tuple(t.shape)))
        return cls(metas)

    def __len__(self) -> int:
        return len(self.metas)

    def __iter__(self) -> Iterator[TensorMeta]:
        return iter(self.metas)

    def __getitem__(self, i: int) -> TensorMeta:
        return self.metas[i]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Manifest) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return self.fingerprint

    @cached_property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)

    @cached_property
    def shapes(self) -> list[tuple[int, ...]]:
        """Every tensor's shape, in order (compared in bulk against a source's tensors)."""
        return [m.shape for m in self.metas]

    @cached_property
    def tensors_fingerprint(self) -> int:
        """A signed 63-bit digest of (name, dtype, shape) of every tensor, in order: what a
        receiver compares an expected manifest against."""
        h = hashlib.blake2b(digest_size=8)
        for m in self.metas:
            name = m.name.encode()  # length-prefixed: no name can run into the next field
            h.update(b"%d:%s\0%s\0%s\n" % (len(name), name, str(m.dtype).encode(),
                                             ",".join(map(str, m.shape)).encode()))
        return struct.unpack("<q", h.digest())[0] & 0x7FFF_FFFF_FFFF_FFFF

    @cached_property
    def fingerprint(self) -> int:
        """The tensors' fingerprint, and the homes and splits where there are any (they
        shape the plan, so every rank must hold the same): what the header announces."""
        if self.homes is None and self.splits is None:
            return self.tensors_fingerprint
        homes = None if self.homes is None else [None if x is None else sorted(x) for x in self.homes]
        h = hashlib.blake2b(repr((self.tensors_fingerprint, self.units, homes, self.splits)).encode(),
                            digest_size=8)
        return struct.unpack("<q", h.digest())[0] & 0x7FFF_FFFF_FFFF_FFFF

    def same_tensors(self, other: Manifest) -> bool:
        """The same tensors in the same order (whichever ranks hold them)."""
        return self.tensors_fingerprint == other.tensors_fingerprint

    def to_bytes(self) -> bytes:
        return pickle.dumps(
            ([(m.name, str(m.dtype).removeprefix("torch."), m.shape) for m in self.metas],
             None if self.homes is None else [None if h is None else sorted(h) for h in self.homes],
             self.units, self.splits),
            protocol=4,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        metas, homes, units, splits = pickle.loads(data)
        return cls((TensorMeta(n, getattr(torch, d), tuple(s)) for n, d, s in metas), homes, units, splits)

    def first_difference(self, other: Manifest) -> str:
        """A one-line description of where ``other`` (theirs) departs from ``self`` (ours)."""
        for i, (a, b) in enumerate(zip(self.metas, other.metas, strict=False)):
            if a != b:
                return f"at position {i}: ours {a.describe()}, theirs {b.describe()}"
        if len(self) != len(other):
            longer, which = (self, "ours") if len(self) > len(other) else (other, "theirs")
            extra = longer.metas[min(len(self), len(other))]
            return (f"{which} has more tensors ({len(self)} vs {len(other)}); first extra: "
                    f"{extra.describe()}")
        for i, (a, b) in enumerate(zip(self.homes or [None] * len(self), other.homes or [None] * len(self),
                                       strict=True)):
            if a != b:
                def held(h: frozenset[int] | None) -> str:
                    return "any rank" if h is None else str(sorted(h))
                return (f"in where {self.metas[i].describe()} is held (position {i}): ours "
                        f"{held(a)}, theirs {held(b)}")
        if self.units != other.units:
            return "in which tensors are made together (units)"
        for i, (a, b) in enumerate(zip(self.splits or [None] * len(self), other.splits or [None] * len(self),
                                       strict=True)):
            if a != b:
                return (f"in how the senders split {self.metas[i].describe()} (position {i}): ours {a}, "
                        f"theirs {b}")
        return "no difference"

    def check_same(self, other: Manifest, where: str) -> None:
        """Raise unless ``other`` has the same tensors (what a receiver expects)."""
        if not self.same_tensors(other):
            raise ManifestMismatch(f"{where}: manifests differ {self.first_difference(other)}")


def _valid_split(split: tuple[int, tuple[int, ...]], shape: tuple[int, ...]) -> bool:
    dim, bounds = split
    return (0 <= dim < len(shape) and len(bounds) >= 2 and bounds[0] == 0 and bounds[-1] == shape[dim]
            and all(a <= b for a, b in zip(bounds, bounds[1:], strict=False)))


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[src_offset, src_offset + nbytes)`` of tensor ``index`` at ``dst_offset``."""

    index: int
    src_offset: int
    nbytes: int
    dst_offset: int


class Framed:
    """A message of ``used`` payload bytes followed by its trailer (version, index, status)."""

    used: int

    @property
    def trailer_offset(self) -> int:
        return _align(self.used, 8)

    @property
    def wire_bytes(self) -> int:
        """Bytes that actually move: the used payload plus the trailer."""
        return self.trailer_offset + TRAILER_BYTES


@dataclass(frozen=True)
class Bucket(Framed):
    index: int
    owner: int
    chunks: tuple[Chunk, ...]
    used: int  # payload bytes, end of the last chunk
    turn: int  # its position among its owner's buckets (senders cycle their slots by it)


class BucketPlan:
    """Deterministic packing of a manifest into buckets of ``bucket_size`` bytes.

    Tensors start at :data:`ALIGNMENT`-aligned offsets. A tensor larger than the room in
    the bucket is split into chunks at element boundaries (so a cast can write a chunk
    straight into the bucket) and reassembled by the receiver. Bucket ``b`` is owned by
    sender ``b % n_senders``, unless the manifest says where its tensors are held
    (:attr:`Manifest.homes`): then a bucket closes early rather than take a tensor that its
    other tensors' holders lack, and goes to the least-loaded rank that holds all of them
    (a tensor split over several buckets, or a unit of tensors made together, stays with
    one owner where it can).
    """

    def __init__(self, manifest: Manifest, bucket_size: int, n_senders: int = 1):
        if n_senders < 1:
            raise PlanError(f"n_senders must be >= 1, got {n_senders}")
        if len(manifest) == 0:
            raise PlanError("empty weight stream: there is nothing to send")
        capacity = (bucket_size - TRAILER_BYTES) // 8 * 8  # the trailer starts 8-aligned after it
        if capacity < ALIGNMENT:
            raise PlanError(
                f"bucket_size={bucket_size} is too small: it must hold at least one "
                f"{ALIGNMENT}-byte aligned slot plus the {TRAILER_BYTES}-byte trailer "
                f"(minimum {ALIGNMENT + TRAILER_BYTES})")
        self.manifest = manifest
        self.bucket_size = bucket_size
        self.capacity = capacity
        self.n_senders = n_senders
        # one sender (colocated: every trainer packs everything for its own rollouts): no choice
        self.homes = homes = manifest.homes if n_senders > 1 else None
        if homes is not None and any(h is not None and max(h) >= n_senders for h in homes):
            i = next(i for i, h in enumerate(homes) if h is not None and max(h) >= n_senders)
            raise PlanError(f"tensor {manifest[i].name!r} is held on sender ranks {sorted(homes[i])}, "  # type: ignore[arg-type]
                            f"but there are {n_senders} senders")
        self._load = [0] * n_senders
        self._turns = [0] * n_senders
        self.buckets: tuple[Bucket, ...] = tuple(self._build())
        # first and last bucket of every tensor (receivers yield a tensor when its last
        # chunk has landed; sources gather a tensor only on the ranks that pack it)
        owners: list[set[int]] = [set() for _ in manifest.metas]
        for b in self.buckets:
            for c in b.chunks:
                owners[c.index].add(b.owner)
        self._owners = [frozenset(o) for o in owners]

    def _owner(self, index: int, can: frozenset[int] | None, last: int) -> int:
        """Who packs a bucket: round-robin, or where its tensors are held (``can``: the
        ranks holding every one of them), the least loaded; ``last``: the previous bucket's
        owner where this one goes on with its last tensor or unit (else -1), kept if it can."""
        n = self.n_senders
        if self.homes is None:
            return index % n
        if last in (can if can is not None else range(n)):
            return last
        pool = sorted(can) if can is not None else range(n)
        return min(pool, key=lambda r: (self._load[r], (r - index) % n))

    def _build(self) -> Iterator[Bucket]:
        chunks: list[Chunk] = []
        cursor = 0
        index = 0
        homes = self.homes
        units = self.manifest.units if homes is not None else None
        can: frozenset[int] | None = None  # ranks holding every tensor of the open bucket
        last = -1  # owner of the previous bucket if this one continues its last tensor (unit)

        def close(nxt: int = -1) -> Bucket:
            """Close the open bucket; ``nxt``: the tensor the next one starts with."""
            nonlocal chunks, cursor, index, can, last
            owner = self._owner(index, can, last)
            tail = chunks[-1].index if chunks else -1
            goes_on = nxt >= 0 and tail >= 0 and (
                nxt == tail or (units is not None and units[nxt] == units[tail]))
            b = Bucket(index, owner, tuple(chunks), cursor, self._turns[owner])
            self._turns[owner] += 1
            self._load[owner] += cursor
            chunks, cursor, index, can = [], 0, index + 1, None
            last = owner if goes_on else -1
            return b

        for i, m in enumerate(self.manifest.metas):
            size, item = m.nbytes, m.itemsize
            if size == 0:
                chunks.append(Chunk(i, 0, 0, cursor))
                continue
            here = homes[i] if homes is not None else None
            if here is not None:
                if can is not None and not can & here and chunks:
                    yield close(i)  # nobody holds all of them: this one starts a bucket
                can = here if can is None else can & here
            start = _align(cursor)
            if start + size <= self.capacity:
                chunks.append(Chunk(i, 0, size, start))
                cursor = start + size
                continue
            if size <= self.capacity and chunks:
                yield close(i)
                chunks.append(Chunk(i, 0, size, 0))
                cursor, can = size, here
                continue
            # larger than the room left: split at element boundaries
            done = 0
            while done < size:
                start = _align(cursor)
                room = (self.capacity - start) // item * item if start < self.capacity else 0
                if room <= 0:
                    yield close(i)
                    can = here
                    continue
                n = min(room, size - done)
                chunks.append(Chunk(i, done, n, start))
                cursor = start + n
                done += n
        if chunks:
            yield close()

    def __len__(self) -> int:
        return len(self.buckets)

    def owners_of(self, tensor_index: int) -> frozenset[int]:
        """Sender ranks that pack (some chunk of) tensor ``tensor_index``."""
        return self._owners[tensor_index]

    @property
    def wire_bytes(self) -> int:
        return sum(b.wire_bytes for b in self.buckets)

    def owned_by(self, rank: int) -> list[Bucket]:
        return [b for b in self.buckets if b.owner == rank]


def share_of(t: torch.Tensor, rank: int, world: int) -> tuple[int, torch.Tensor]:
    """Sender ``rank``'s even 1/``world`` of a tensor every sender holds whole (what it
    diffs and sends in delta mode): (its first element in the flattened tensor, the flat
    piece, a view)."""
    flat = t.reshape(-1)
    lo, hi = flat.numel() * rank // world, flat.numel() * (rank + 1) // world
    return lo, flat[lo:hi]
