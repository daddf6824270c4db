"""Layer 2: byte buckets and the packing of tensors into them. One implementation for
every backend.

A bucket is a flat ``uint8`` tensor (CPU, shared memory or CUDA). Senders *pack* chunks
of tensors into it (casting to the wire dtype inside the copy, so the cast happens once,
straight into the bucket); receivers *unpack* views of it. Every sent bucket ends with a
64-byte trailer (magic, version, bucket index, status) so a receiver can tell a good
bucket from a stale one or from an abort notice that carries the sender's error text.
"""

from __future__ import annotations

import mmap
import operator
import os
import secrets
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from weightbus.errors import PlanError
from weightbus.packing import native
from weightbus.plan import TRAILER_BYTES, Bucket, BucketPlan, Chunk, TensorMeta

MAGIC = 0x57425553_0001  # "WBUS", format 1
STATUS_OK = 0
STATUS_ABORT = 1

MiB = 1 << 20


def default_bucket_size(device: torch.device) -> int:
    """Bucket size when the user gives none: big enough to run at link speed, small
    enough that two buckets on each side stay a small share of free memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(max(64 * MiB, min(1024 * MiB, free // 16)) // MiB * MiB)
    return 16 * MiB  # host memory: the per-bucket cost is small, and smaller buckets pipeline


# ---------------------------------------------------------------------------- allocation


_SHM_PREFIX = "wbus_"
def sweep_stale_segments() -> list[str]:
    """Unlink the segments of weightbus processes that are gone; returns their names.

    A segment's name is unlinked as soon as its peers have mapped it, so only an owner
    killed before that (during group formation) leaves one behind; every owner sweeps when
    it creates segments, and an operator may call this. A segment whose owner pid is alive
    is never touched."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    swept = []
    for name in names:
        if not name.startswith(_SHM_PREFIX):
            continue
        try:
            pid = int(name.split("_")[1])
        except (ValueError, IndexError):
            continue
        if not _alive(pid):
            try:
                os.unlink(f"/dev/shm/{name}")
                swept.append(name)
            except OSError:
                pass
    return swept


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def shm_room() -> int | None:
    """Bytes /dev/shm can still hold (None where there is no /dev/shm)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class SharedBuffer:
    """A named POSIX shared-memory segment viewed as a ``uint8`` tensor.

    The creator owns it; other processes on the host attach by name. Once every peer has
    mapped it, the owner unlinks the name (:meth:`unlink`): the memory lives on while
    mapped and goes away with the last process that maps it, however each one dies, so
    nothing is left in /dev/shm. Before that point a crashed owner's segment is swept by
    the next weightbus process on the host (names carry the owner's pid). Attachers map
    ``/dev/shm/<name>`` directly, because Python's resource tracker is shared with spawned
    children and would otherwise unlink or double-count the creator's segment.
    """

    def __init__(self, nbytes: int, name: str | None = None):
        self.owner = name is None
        self._shm: shared_memory.SharedMemory | None = None
        self._map: mmap.mmap | None = None
        self.linked = True
        if self.owner:
            sweep_stale_segments()
            room = shm_room()
            if room is not None and nbytes > room:
                raise PlanError(f"a {nbytes / MiB:.0f} MiB shared-memory bucket does not fit: /dev/shm has "
                                f"{room / MiB:.0f} MiB free; use a smaller bucket_size (or num_buffers), "
                                f"or give the host (container) a larger /dev/shm")
            name = f"{_SHM_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, nbytes))
            buf = self._shm.buf
        else:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, max(1, nbytes))
            finally:
                os.close(fd)
            buf = self._map
        self.name: str = name  # type: ignore[assignment]
        self.nbytes = nbytes
        self.tensor = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)

    def unlink(self) -> None:
        """Owner: remove the name (every peer has mapped the segment); the memory stays."""
        if self.owner and self._shm is not None and self.linked:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
            self.linked = False

    def close(self) -> None:
        if self._shm is None and self._map is None:
            return
        del self.tensor
        try:
            if self._shm is not None:
                self._shm.close()
            if self._map is not None:
                self._map.close()
        except BufferError:  # a view is still alive somewhere; the unlink below still frees it
            pass
        self.unlink()
        self._shm, self._map = None, None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def expandable_segments() -> bool:
    """Whether PyTorch's CUDA caching allocator uses expandable segments."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


class CupyIpcBuffer:
    """A device buffer from a plain cudaMalloc (through CuPy), exportable as a CUDA IPC
    handle even when PyTorch's allocator uses expandable segments."""

    def __init__(self, nbytes: int, device: torch.device):
        import cupy

        with cupy.cuda.Device(device.index):
            self._mem = cupy.cuda.Memory(nbytes)
            self.handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._mem.ptr))
        self.nbytes, self.device = nbytes, device
        self.tensor = _wrap_device_pointer(self._mem.ptr, nbytes, device, owner=self._mem)

    @staticmethod
    def open(handle: bytes, nbytes: int, device_index: int) -> torch.Tensor:
        import cupy

        with cupy.cuda.Device(device_index):
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner=None, device_id=device_index)
        return _wrap_device_pointer(ptr, nbytes, torch.device("cuda", device_index), owner=mem)


def _wrap_device_pointer(ptr: int, nbytes: int, device: torch.device, owner: object) -> torch.Tensor:
    import cupy

    arr = cupy.ndarray((nbytes,), dtype=cupy.uint8,
                       memptr=cupy.cuda.MemoryPointer(owner, 0))  # type: ignore[arg-type]
    t = torch.as_tensor(arr, device=device)
    t._weightbus_owner = (owner, arr)  # type: ignore[attr-defined]  # keeps the memory mapped
    return t


def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """A plain bucket on ``device``; a bucket that does not fit is an error saying so."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise PlanError(f"cannot allocate a {nbytes / MiB:.0f} MiB bucket on {device} "
                        f"({str(e).splitlines()[0][:160]}); use a smaller bucket_size") from None


# ---------------------------------------------------------------------------- packing


def check_castable(meta: TensorMeta, t: torch.Tensor) -> None:
    """The stream may hand a tensor in a different floating dtype than it travels in
    (the source's dtype policy, e.g. fp32 master -> bf16); anything else is an error."""
    if t.shape != meta.shape:
        raise PlanError(f"tensor {meta.name!r}: the stream gives shape {list(t.shape)}, "
                        f"the manifest says {list(meta.shape)}")
    if t.dtype is not meta.dtype and not (t.is_floating_point() and meta.dtype.is_floating_point):
        raise PlanError(f"tensor {meta.name!r}: cannot cast {t.dtype} to the wire dtype "
                        f"{meta.dtype} (only floating-point tensors are cast)")


def chunk_view(slot: torch.Tensor, c: Chunk, meta: TensorMeta) -> torch.Tensor | None:
    """Chunk ``c``'s bytes in ``slot``, typed: shaped like the tensor when the chunk is the
    whole tensor, flat when it is a piece of a split one; None when it has no bytes."""
    if c.nbytes == 0:
        return None
    raw = slot[c.dst_offset:c.dst_offset + c.nbytes].view(meta.dtype)
    return raw.view(meta.shape) if c.nbytes == meta.nbytes else raw


def copy_group(dsts: list[torch.Tensor], srcs: list[torch.Tensor],
               names: Callable[[int], str] | None = None) -> None:
    """``dst.copy_(src)`` for every pair in one multi-tensor call (the cast included). Where
    that call refuses the lists (e.g. tensors on several devices), the pairs are copied one
    by one, and an error names the tensor (``names(i)``)."""
    if not dsts:
        return
    try:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
    except Exception:  # noqa: BLE001 - one by one: name the tensor at fault, or succeed
        for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):
            try:
                d.copy_(s, non_blocking=True)
            except Exception as e:
                raise PlanError(f"tensor {names(i) if names else i}: {e}") from e


#: Tensors at least this large are copied one native copy each: a multi-tensor kernel moves
#: them at a fraction of a plain copy's bandwidth, and the launch is negligible next to them.
LARGE_COPY = 16 << 20


_nbytes = operator.attrgetter("nbytes")


class TabledCopy:
    """A fixed list of destinations filled in one native call over a table of addresses
    (the host's :class:`_HostCopy`, a GPU's ``copy_triton.DeviceCopy``). The destinations
    are tabled once; the sources per call, in a C-level pass over their pointers, and
    checked against the destinations (:meth:`_fit`) only when they are not the very tensors
    at the very addresses tabled last. The last sources are held, so their memory cannot be
    freed and reused under an address seen again."""

    def __init__(self, dsts: list[torch.Tensor]):
        self._dsts = dsts
        self._dst = native.data_ptrs(dsts)
        self._srcs: list[torch.Tensor] | None = None
        self._src = self._dst[:0]

    def table(self, srcs: list[torch.Tensor]) -> bool:
        """Table the sources for :meth:`copy`; False (nothing tabled) unless every source
        fits its destination."""
        src = native.data_ptrs(srcs)
        last = self._srcs
        if last is None or not np.array_equal(src, self._src) or not native.same_items(srcs, last):
            self._srcs = None
            if not self._fit(srcs, src):
                return False
            self._srcs = list(srcs)
        self._src = src
        return True

    def _fit(self, srcs: list[torch.Tensor], src: np.ndarray) -> bool:
        """Whether ``srcs`` (at addresses ``src``) fit the destinations; work out what
        :meth:`copy` needs of them."""
        raise NotImplementedError

    def copy(self) -> None:
        """Copy from the sources last tabled."""
        raise NotImplementedError

    def run(self, srcs: list[torch.Tensor]) -> bool:
        """:meth:`table`, then :meth:`copy` where it succeeded."""
        if not self.table(srcs):
            return False
        self.copy()
        return True


class _HostCopy(TabledCopy):
    """Byte copies between host tensors of one dtype and shape, a whole list in one native
    call (:func:`weightbus.packing.native.copy_library`: a memcpy per pair), for lists of many small
    tensors. On the CPU, torch's multi-tensor copy is a loop of full copies (~1 us each: a
    TensorIterator per pair), so 100k tensors of 1 KiB cost ~100 ms where their bytes take
    ~10."""

    def __init__(self, lib: Any, dsts: list[torch.Tensor]):
        super().__init__(dsts)
        self._lib = lib
        self._sizes = np.fromiter(map(_nbytes, dsts), np.int64, len(dsts))

    @staticmethod
    def usable(dsts: list[torch.Tensor]) -> bool:
        return bool(dsts) and all(d.device.type == "cpu" and d.is_contiguous() for d in dsts)

    def _fit(self, srcs: list[torch.Tensor], src: np.ndarray) -> bool:
        return all(s.device.type == "cpu" and s.is_contiguous() and s.dtype == d.dtype
                   and s.shape == d.shape for s, d in zip(srcs, self._dsts, strict=True))

    def copy(self) -> None:
        """Copy from the sources last tabled."""
        self._lib.wb_copy_list(len(self._src), self._dst.ctypes.data, self._src.ctypes.data,
                               self._sizes.ctypes.data)


def _device_copy(dsts: list[torch.Tensor]) -> Any:
    """The GPU's counterpart of :class:`_HostCopy` for ``dsts``: one Triton launch over a
    chunk table (:mod:`weightbus.packing.copy_triton`), or None where it does not apply (not one
    GPU, no Triton, or ``WEIGHTBUS_DEVICE_COPY=0``, which keeps torch's multi-tensor copy)."""
    if not dsts or dsts[0].device.type != "cuda" or os.environ.get("WEIGHTBUS_DEVICE_COPY", "1") == "0":
        return None
    try:
        from weightbus.packing import copy_triton  # (Triton imported on first use: slow to import)
    except ImportError:
        return None
    return copy_triton.DeviceCopy(dsts) if copy_triton.DeviceCopy.usable(dsts) else None


def picker(index: list[int]) -> Callable[[list[Any]], list[Any]]:
    """A function that takes the items at ``index`` out of a list, in that order, in one C
    call (``operator.itemgetter``, which returns a bare item for one index and needs one)."""
    if not index:
        return lambda items: []
    if len(index) == 1:
        return lambda items, i=index[0]: [items[i]]
    return lambda items, get=operator.itemgetter(*index): list(get(items))


class CopyList:
    """A fixed list of destinations (views made once), filled from sources given per call,
    or from ``srcs`` given once (fixed sources: :meth:`run` with none): the small ones in
    one native call over a table of them (on the CPU, where the types match, a byte copy
    per pair in C; on a GPU, one Triton launch over a chunk table), else one multi-tensor
    call; the large ones a native copy each."""

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor] | None = None):
        self.dsts = dsts
        self.srcs = srcs
        self.large = [i for i, d in enumerate(dsts) if d.numel() * d.element_size() >= LARGE_COPY]
        self._pick: Callable[[list[Any]], list[Any]] = list  # the small ones' sources of a full list
        if self.large:
            large = set(self.large)
            self.small: list[int] | None = [i for i in range(len(dsts)) if i not in large]
            self.small_dsts = [dsts[i] for i in self.small]
            self._pick = picker(self.small)
        else:
            self.small, self.small_dsts = None, dsts
        lib = native.copy_library() if _HostCopy.usable(self.small_dsts) else None
        self._host: Any = _HostCopy(lib, self.small_dsts) if lib is not None \
            else _device_copy(self.small_dsts)
        self._fixed_small = self._small_srcs(srcs) if srcs is not None else None
        # fixed sources (a slot's views) are read and checked once, here
        self._fixed_host = self._host is not None and self._fixed_small is not None \
            and self._host.table(self._fixed_small)

    def _small_srcs(self, srcs: list[torch.Tensor]) -> list[torch.Tensor]:
        return srcs if self.small is None else self._pick(srcs)

    def run(self, srcs: list[torch.Tensor] | None = None, names: Callable[[int], str] | None = None) -> None:
        self.stage(srcs)(names)

    def stage(self, srcs: list[torch.Tensor] | None = None) -> Callable[[Callable[[int], str] | None], None]:
        """:meth:`run` in two steps: the look at the sources (their addresses, whether they fit
        the table) now, and the copies when the returned function is called. A caller that may
        look at its sources before it may write (before the receivers said they are ready)
        does the first while it waits. The sources must stay where they are in between."""
        small = self.small
        # (a list with fixed sources has them tabled for its host copies: no others)
        assert (srcs is None) == (self.srcs is not None), "fixed sources, or sources per call, not both"
        if srcs is None:  # the fixed sources
            srcs, small_srcs = self.srcs, self._fixed_small
            done = self._fixed_host
        else:
            small_srcs = self._small_srcs(srcs)
            done = self._host is not None and self._host.table(small_srcs)
        assert srcs is not None

        def launch(names: Callable[[int], str] | None = None) -> None:
            if done:
                self._host.copy()  # type: ignore[union-attr]
            else:
                copy_group(self.small_dsts, small_srcs,  # type: ignore[arg-type]
                           (lambda k: names(small[k])) if names is not None and small is not None else names)
            for i in self.large:
                try:
                    self.dsts[i].copy_(srcs[i], non_blocking=True)
                except Exception as e:
                    raise PlanError(f"tensor {names(i) if names else i}: {e}") from e
        return launch


class _PackProgram:
    """What packing one bucket into one slot takes, worked out once: the views of its
    whole tensors (and which chunk, and which tensor of the manifest, each takes), and the
    pieces of split ones."""

    def __init__(self, plan: BucketPlan, slot: torch.Tensor, b: Bucket):
        metas = plan.manifest.metas
        self.whole_pos: list[int] = []
        whole_dsts: list[torch.Tensor] = []
        self.pieces: list[tuple[int, torch.Tensor, int, int]] = []  # (position, view, first, count)
        for pos, c in enumerate(b.chunks):
            m = metas[c.index]
            view = chunk_view(slot, c, m)
            if view is None:
                continue
            if c.nbytes == m.nbytes:
                self.whole_pos.append(pos)
                whole_dsts.append(view)
            else:
                self.pieces.append((pos, view, c.src_offset // m.itemsize, c.nbytes // m.itemsize))
        self.whole = CopyList(whole_dsts)
        # the whole tensors' sources out of a manifest-ordered list
        self.take = picker([b.chunks[p].index for p in self.whole_pos])


class Packer:
    """Copies the chunks of one bucket into its slot, casting inside the copy: one
    multi-tensor call per bucket, over views worked out once per plan and slot."""

    def __init__(self, plan: BucketPlan):
        self.plan = plan
        self._programs: dict[tuple[int, int], _PackProgram] = {}
        self._flat: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # split source

    def _program(self, slot: torch.Tensor, b: Bucket) -> _PackProgram:
        key = (slot.data_ptr(), b.index)
        prog = self._programs.get(key)
        if prog is None:
            prog = self._programs[key] = _PackProgram(self.plan, slot, b)
        return prog

    def pack_bucket(self, slot: torch.Tensor, b: Bucket, tensors: list[torch.Tensor | None]) -> None:
        """``tensors[i]`` is the stream's tensor for chunk ``i`` of ``b`` (None only for a
        chunk with no bytes: the engine refuses a missing tensor before packing)."""
        prog = self._program(slot, b)
        self._pack(prog, b, [tensors[p] for p in prog.whole_pos],  # type: ignore[misc]
                   lambda pos: tensors[pos])  # type: ignore[return-value]

    def pack_held(self, slot: torch.Tensor, b: Bucket, held: list[torch.Tensor]) -> None:
        """The same from every tensor of the manifest, in order (a source that holds them)."""
        prog = self._program(slot, b)
        self._pack(prog, b, prog.take(held), lambda pos: held[b.chunks[pos].index])

    def _pack(self, prog: _PackProgram, b: Bucket, whole: list[torch.Tensor],
              piece_source: Callable[[int], torch.Tensor]) -> None:
        metas = self.plan.manifest.metas
        prog.whole.run(whole, lambda k: metas[b.chunks[prog.whole_pos[k]].index].describe())
        for pos, view, first, count in prog.pieces:  # pieces of split tensors: large, one copy each
            t = piece_source(pos)
            if self._flat[0] is not t:  # a split tensor spans buckets: flatten it once
                self._flat = (t, t.reshape(-1))
            copy_group([view], [self._flat[1][first:first + count]],  # type: ignore[index]
                       lambda k, pos=pos: metas[b.chunks[pos].index].describe())

    def done_with(self, index: int) -> None:
        """The stream moved past tensor ``index``: drop a flattened copy of it."""
        self._flat = (None, None)


class Lent(list):  # type: ignore[type-arg]
    """A batch of ``(name, tensor)`` some of whose tensors are views of a bucket slot, which
    the engine fills again once the next batch is asked for (``WeightStream`` copies out
    those its consumer still holds then)."""


class _UnpackProgram:
    """What unpacking one bucket from one slot takes, worked out once: the copies into
    destinations (fixed pairs of views), and what to yield, in chunk order: a view or a
    destination (fixed), or a piece of a split tensor to reassemble (``None``, with its
    chunk)."""

    def __init__(self, plan: BucketPlan, slot: torch.Tensor, b: Bucket,
                 into: dict[int, torch.Tensor], flat: dict[int, torch.Tensor], device: torch.device):
        metas = plan.manifest.metas
        dsts: list[torch.Tensor] = []
        self.srcs: list[torch.Tensor] = []
        self.items: list[tuple[str, torch.Tensor] | None] = []
        self.pieces: list[tuple[Chunk, torch.Tensor]] = []
        lends = False
        for c in b.chunks:
            m = metas[c.index]
            view = chunk_view(slot, c, m)
            last = c.src_offset + c.nbytes == m.nbytes
            if c.index in into:
                if view is not None:  # typed copies: a multi-tensor copy of bytes is slow
                    d = into[c.index]
                    if c.nbytes != m.nbytes:
                        lo = c.src_offset // m.itemsize
                        d = flat[c.index][lo:lo + c.nbytes // m.itemsize]
                    dsts.append(d)
                    self.srcs.append(view)
                if last:
                    self.items.append((m.name, into[c.index]))
            elif view is None:  # no bytes
                self.items.append((m.name, torch.empty(m.shape, dtype=m.dtype, device=device)))
            elif c.nbytes == m.nbytes:
                self.items.append((m.name, view))
                lends = True
            else:
                self.pieces.append((c, view))
                if last:
                    self.items.append(None)
        self.copies = CopyList(dsts, self.srcs)  # (the slot's views: fixed)
        self.static = not self.pieces
        if lends:  # (a batch of these items holds views of the slot)
            self.items = Lent(self.items)


class Assembler:
    """Turns received buckets back into ``(name, tensor)``.

    A tensor that lies whole in one bucket is yielded as a view of the bucket (valid
    until the bucket is reused); a split tensor is reassembled into a fresh tensor. With
    destinations, every chunk is copied straight into its tensor, one multi-tensor copy
    per bucket, and the destination itself is yielded. What a bucket takes is worked out
    once per plan and slot.
    """

    def __init__(self, plan: BucketPlan, device: torch.device,
                 destinations: dict[str, torch.Tensor] | None = None):
        self.plan = plan
        self.device = device
        self._pending: dict[int, torch.Tensor] = {}
        self._programs: dict[tuple[int, int], _UnpackProgram] = {}
        # tensors to write straight into: same dtype and shape, contiguous, this device
        self._into: dict[int, torch.Tensor] = {}
        self._into_flat: dict[int, torch.Tensor] = {}
        for i, m in enumerate(plan.manifest):
            d = (destinations or {}).get(m.name)
            if d is not None and d.dtype == m.dtype and tuple(d.shape) == m.shape \
                    and d.is_contiguous() and d.device == device:
                self._into[i] = d
                self._into_flat[i] = d.detach().view(-1)

    def _program(self, bucket: torch.Tensor, b: Bucket) -> _UnpackProgram:
        key = (bucket.data_ptr(), b.index)
        prog = self._programs.get(key)
        if prog is None:
            prog = self._programs[key] = _UnpackProgram(self.plan, bucket, b, self._into,
                                                        self._into_flat, self.device)
        return prog

    def unpack_batch(self, bucket: torch.Tensor, b: Bucket) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors as one list. Where nothing is reassembled the list is the
        same object at every update (a consumer may key work it did once on it)."""
        prog = self._program(bucket, b)
        if prog.static:
            prog.copies.run()
            return prog.items  # type: ignore[return-value]
        return type(prog.items)(self.unpack(bucket, b))  # (a Lent where views are among them)

    def unpack(self, bucket: torch.Tensor, b: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
        prog = self._program(bucket, b)
        prog.copies.run()
        if prog.static:
            yield from prog.items  # type: ignore[misc]
            return
        metas = self.plan.manifest.metas
        done = []
        for c, piece in prog.pieces:  # a split tensor with no destination: reassembled here
            m = metas[c.index]
            dst = self._pending.get(c.index)
            if dst is None:
                dst = self._pending[c.index] = torch.empty(m.shape, dtype=m.dtype, device=self.device)
            lo = c.src_offset // m.itemsize
            dst.view(-1)[lo:lo + c.nbytes // m.itemsize].copy_(piece, non_blocking=True)
            if c.src_offset + c.nbytes == m.nbytes:
                done.append((m.name, self._pending.pop(c.index)))
        finished = iter(done)
        for item in prog.items:
            yield item if item is not None else next(finished)

    def reset(self) -> None:
        self._pending.clear()


# ---------------------------------------------------------------------------- trailer


def write_trailer(bucket: torch.Tensor, b: Bucket, version: int, status: int = STATUS_OK,
                  message: str = "") -> None:
    """Stamp bucket ``b``; with ``STATUS_ABORT`` the payload carries ``message``."""
    msg = message.encode()[: max(0, b.trailer_offset)]
    if msg:
        bucket[: len(msg)].copy_(torch.frombuffer(bytearray(msg), dtype=torch.uint8))
    words = torch.tensor([MAGIC, version, b.index, status, len(msg), 0, 0, 0], dtype=torch.int64)
    bucket[b.trailer_offset:b.trailer_offset + TRAILER_BYTES].copy_(
        words.view(torch.uint8), non_blocking=bucket.device.type != "cpu")


class Stamper:
    """Writes trailers into device buckets through small pinned staging buffers (one per
    bucket slot), so the sender never issues a pageable host-to-device copy, which would
    make the host wait for the whole stream."""

    def __init__(self) -> None:
        self._staging: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def stamp(self, bucket: torch.Tensor, b: Bucket, version: int, status: int = STATUS_OK,
              message: str = "") -> None:
        if bucket.device.type != "cuda" or message:
            write_trailer(bucket, b, version, status, message)
            return
        key = bucket.data_ptr()
        if key not in self._staging:
            self._staging[key] = (torch.empty(8, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
        staging, done = self._staging[key]
        done.synchronize()  # the copy that last read this staging buffer has run
        staging.copy_(torch.tensor([MAGIC, version, b.index, status, 0, 0, 0, 0], dtype=torch.int64))
        bucket[b.trailer_offset:b.trailer_offset + TRAILER_BYTES].copy_(
            staging.view(torch.uint8), non_blocking=True)
        done.record()


def read_trailer(bucket: torch.Tensor, b: Bucket) -> tuple[int, int, int, int, str]:
    """Returns (magic, version, index, status, message)."""
    raw = bucket[b.trailer_offset:b.trailer_offset + TRAILER_BYTES].cpu()
    magic, version, index, status, msg_len = raw.view(torch.int64)[:5].tolist()
    msg = ""
    if status != STATUS_OK and 0 < msg_len <= b.trailer_offset:
        msg = bytes(bucket[:msg_len].cpu().numpy()).decode(errors="replace")
    return magic, version, index, status, msg


def check_trailer(bucket: torch.Tensor, b: Bucket, version: int, where: str) -> tuple[int, str]:
    """Validates a received bucket; returns (status, message). A bucket that is not the one
    expected (wrong magic, version or index) is a protocol fault, reported as an abort."""
    magic, got_version, index, status, msg = read_trailer(bucket, b)
    if magic != MAGIC or got_version != version or index != b.index:
        return STATUS_ABORT, (f"{where}: bucket {b.index} is torn or stale (magic {magic:#x}, "
                              f"version {got_version}, index {index}; expected version {version})")
    return status, msg
