"""Backends ``shm`` and ``disk``: the newest weights kept where rollouts pull them when they
are ready (fully-async), instead of a synchronized transfer that waits for the slowest.

A cache is a directory: ``/dev/shm/wbcache_<cache_name>`` for ``shm`` (host shared memory, one
copy per host however many replicas read it), any directory for ``disk`` (local or a
shared file system). Each version is one safetensors file, ``v<version>.safetensors``::

    publisher (trainer rank 0, or a CacheRelay fed by any engine):
        write .v<N>.tmp-<pid>-<rand>  (header, then every tensor, through a memory map)
        rename it to v<N>.safetensors (atomic: a reader sees all of N or nothing of it)
        unlink versions older than the newest ``keep`` (default 2)
    reader (get_weights):
        the newest v<N> newer than what it holds: open it, map it, yield views of it

A reader that has opened a version holds its memory until it closes it, whatever the
publisher unlinks meanwhile (a mapping keeps its file's pages, and the kernel drops them
when the last mapping goes, also when the reader is SIGKILLed mid-read): publishing N+1
never disturbs a reader of N, and reclaiming never waits for a reader. A publisher killed
mid-write leaves only its temporary file, which readers never look at and the next
publisher removes; a cache directory whose owner is gone is removed by the next owner on
the host (``sweep_stale_caches``), and an owner that finalizes removes its own.

A full file system (or /dev/shm) is an error of the publish, never a signal: a new file's
blocks are reserved (``posix_fallocate``) before it is mapped, so a write into the map can
never meet a page the file system cannot back (SIGBUS); the error names the file, the bytes
needed and the bytes free, the temporary file is removed and the newest version stays
published. A version file that is not what the publisher wrote (garbage or truncated
header, a dtype or offsets that do not fit) is an error of the reader that names the file,
the version and what is wrong; the reader moves it out of sight (``.v-broken-*``, removed
at the next publish) or, where it cannot, skips it from then on, so the next pull gets the
newest intact version.

A cache outlives its jobs' processes, so a version there may be an earlier job's. Every
version is stamped with its publisher's job (``job=``, or a token of the publisher's own),
and so is the directory's owner mark. A reader that knows its job (given ``job=``, or told
its trainer's through ``build_topology``, as the manager and verl's workers do) reads only
that job's versions: a fresh job's replicas never take a dead job's newest version, which
also would have left them waiting for a version above it. Trainer rank 0 takes the cache
when it connects: the shm directories of dead owners go at once, and a disk cache left by a
dead publisher of another job is emptied of its versions (a publisher restarted under the
same ``job=`` keeps them readable). A reader without a job reads any version.

The files are plain safetensors (any tool reads them; the metadata carries the version
and the order the publisher sent the tensors in). We lay out the format ourselves: the
``safetensors`` library writes only from tensors in memory, and reads by copying, where a
cache wants an engine to write into the mapped file and a reader to take views of it.
Tensors are laid out by element size, largest first, so every one is aligned for a typed
view, with no gap (the format forbids gaps).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import mmap
import os
import re
import resource
import secrets
import shutil
import socket
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from weightbus import config
from weightbus.engines.api import (
    CheckpointEngineRegistry,
    CheckpointEngineWithCache,
    UpdateStats,
    Weights,
    WeightStream,
    check_sides,
)
from weightbus.engines.streams import StreamBroken, fetch, resolve_stream
from weightbus.errors import PlanError, WeightSyncError
from weightbus.packing import buffers
from weightbus.plan import Manifest, TensorMeta

#: torch dtype <-> safetensors dtype name
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_FROM_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_PREFIX = "wbcache_"
_OWNER = "owner.pid"
_TMP = ".v-tmp-"
_BROKEN = ".v-broken-"
_VERSION = re.compile(r"v\d{20}\.safetensors")  # a version file's name (see _final)
_log = logging.getLogger("weightbus")


def _final(root: str, version: int) -> str:
    return os.path.join(root, f"v{version:020d}.safetensors")


def _versions(root: str) -> list[int]:
    """Complete versions in the cache, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if n.startswith("v") and n.endswith(".safetensors"):
            try:
                out.append(int(n[1:-len(".safetensors")]))
            except ValueError:
                continue
    return sorted(out)


def _read_owner(root: str) -> dict[str, Any] | None:
    """The directory's owner mark: ``{"pid", "host", "job"}`` (a bare pid from before jobs
    were stamped reads as ``{"pid"}``); None when there is none or it is unreadable."""
    try:
        with open(os.path.join(root, _OWNER)) as f:
            text = f.read().strip()
    except OSError:
        return None
    try:
        mark = json.loads(text)
    except ValueError:
        return None
    if isinstance(mark, int):
        mark = {"pid": mark}
    return mark if isinstance(mark, dict) and isinstance(mark.get("pid"), int) else None


def _gone(mark: dict[str, Any]) -> bool:
    """Whether the owner a mark names is a process of this host that is gone (one on another
    host, sharing a file system, cannot be told: it is taken to live)."""
    pid = mark["pid"]
    return mark.get("host", socket.gethostname()) == socket.gethostname() and pid > 0 \
        and not buffers._alive(pid)


def sweep_stale_caches(base: str = "/dev/shm", keep: str | None = None) -> list[str]:
    """Remove cache directories under ``base`` whose owner process is gone; returns them.
    ``keep``: one not to remove (the one a new publisher takes over: its versions stay
    readable until the new publisher's first version is in)."""
    swept = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(_PREFIX)]
    except OSError:
        return swept
    for n in names:
        path = os.path.join(base, n)
        if keep is not None and os.path.abspath(path) == os.path.abspath(keep):
            continue
        mark = _read_owner(path)
        if mark is not None and _gone(mark):
            shutil.rmtree(path, ignore_errors=True)
            swept.append(path)
    return swept


class _Layout:
    """Where each tensor of a manifest goes in a version's file, and the file's size."""

    def __init__(self, manifest: Manifest, job: str):
        metas = list(manifest)
        layout = sorted(range(len(metas)), key=lambda i: -metas[i].itemsize)  # aligned, no gaps
        offsets: dict[int, tuple[int, int]] = {}
        pos = 0
        for i in layout:
            offsets[i] = (pos, pos + metas[i].nbytes)
            pos += metas[i].nbytes
        for m in metas:
            if m.dtype not in SAFETENSORS_DTYPES:
                raise PlanError(f"tensor {m.name!r}: dtype {m.dtype} has no safetensors name")
        header = {m.name: {"dtype": SAFETENSORS_DTYPES[m.dtype], "shape": list(m.shape),
                           "data_offsets": list(offsets[i])} for i, m in enumerate(metas)}
        header["__metadata__"] = {"format": "pt", "weightbus_order": json.dumps([m.name for m in metas]),
                                  "weightbus_job": job}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned
        self.metas, self.offsets, self.raw = metas, offsets, raw
        self.start = 8 + len(raw)
        self.size = self.start + pos


def _reserve(fd: int, size: int) -> None:
    """Give a new file ``size`` bytes of real blocks now: on a full file system (or past a
    file-size limit) this fails with ENOSPC (EFBIG) here, where a sparse file would let the
    mmap writes meet a page nothing backs, and the publisher die of SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)  # a file system that cannot reserve at all: as before


class _Writer:
    """One version being written: a temporary file of its final size, mapped, with a typed
    view per tensor (manifest order)."""

    def __init__(self, root: str, layout: _Layout, recycle: int | None = None):
        """``recycle``: an open, exclusively locked descriptor of an old version's file of
        ``layout.size`` bytes that no reader holds: its pages are reused (a fresh tmpfs file
        pays a page allocation per 4 KiB, ~0.5 s per GB here), and being the same size it
        needs no new block. Raises OSError with nothing left behind."""
        self.t0 = time.perf_counter()
        self.start, self.size, self.tensors = layout.start, layout.size, len(layout.metas)
        self.tmp = os.path.join(root, f"{_TMP}{os.getpid()}-{secrets.token_hex(4)}")
        self.views: list[torch.Tensor] = []
        self._map: mmap.mmap | None = None
        self._fd = recycle  # held (locked) until the version is published
        try:
            if recycle is None:
                fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    _reserve(fd, self.size)
                    self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
                finally:
                    os.close(fd)
            else:
                os.rename(_path_of(recycle), self.tmp)  # out of sight before it is overwritten
                # its pages exist: map them all at once instead of a fault per page
                populate = getattr(mmap, "MAP_POPULATE", 0)
                self._map = mmap.mmap(recycle, self.size, flags=mmap.MAP_SHARED | populate)
        except BaseException as e:
            self.abandon()
            if isinstance(e, OSError) and e.filename is None:
                e.filename = self.tmp  # (posix_fallocate's and mmap's errors name no file)
            raise
        raw = layout.raw
        self._map[:8] = len(raw).to_bytes(8, "little")
        self._map[8:self.start] = raw
        whole = torch.frombuffer(self._map, dtype=torch.uint8, count=self.size)
        offsets = layout.offsets
        self.views = [whole[self.start + offsets[i][0]:self.start + offsets[i][1]].view(m.dtype).view(m.shape)
                      for i, m in enumerate(layout.metas)]

    def commit(self, root: str, version: int) -> str:
        """Make it ``v<version>``; raises OSError (msync's, rename's) with the file still
        temporary: the caller abandons it."""
        assert self._map is not None
        self.views = []
        self._map.flush()
        try:
            self._map.close()
        except BufferError:  # a view escaped: the file is complete all the same
            pass
        final = _final(root, version)
        self._unlock()  # before it is visible: a reader must never find the newest one locked
        os.replace(self.tmp, final)
        return final

    def _unlock(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # (closing drops the lock)
            self._fd = None

    def abandon(self) -> None:
        self.views = []
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
        try:
            os.unlink(self.tmp)
        except OSError:
            pass
        self._unlock()


class _Pin:
    """A reader's hold on a version's file (its locked descriptor), released once."""

    def __init__(self, fd: int):
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _lock(path: str, exclusive: bool) -> int | None:
    """An open descriptor of ``path`` holding a shared (reader) or exclusive (recycler)
    lock, if it can be had at once and ``path`` still names that file; else None. The
    kernel drops the lock with the descriptor, also when its process is SIGKILLed."""
    try:
        fd = os.open(path, os.O_RDWR if exclusive else os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        if os.stat(path).st_ino != os.fstat(fd).st_ino:  # renamed away (recycled) meanwhile
            raise FileNotFoundError(path)
    except OSError:
        os.close(fd)
        return None
    return fd


class CorruptVersion(WeightSyncError):
    """A version file in a cache that is not a version the publisher wrote (garbage or
    truncated header, a dtype or offsets that do not fit); names the file, the version and
    what is wrong."""

    def __init__(self, path: str, what: str, where: str = ""):
        name = os.path.basename(path)
        version = (name[1:-len(".safetensors")].lstrip("0") or "0") if name.startswith("v") else "?"
        super().__init__(f"{where}{': ' if where else ''}version {version} in the cache ({path}) is "
                         f"broken: {what}")
        self.path, self.what = path, what


def read_version(path: str, fd: int | None = None, *, metadata: dict[str, str] | None = None
                 ) -> list[tuple[str, torch.Tensor]]:
    """A complete version file, mapped: ``[(name, view)]`` in the publisher's order (from
    ``fd`` where the caller holds it open, locked). A file that is not a whole version
    raises :class:`CorruptVersion`; the checks are per file, and per tensor only what the
    views cost anyway (a bad entry is explained once it failed). ``metadata``, if given, is
    filled with the file's ``__metadata__`` (``weightbus_job``: the job that published it)."""
    own = fd is None
    if fd is None:
        fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise CorruptVersion(path, f"it has {size} bytes, fewer than the 8 of its header's length "
                                       f"(truncated)")
        m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # private: reading copies nothing
    finally:
        if own:
            os.close(fd)
    n = int.from_bytes(m[:8], "little")
    if n > size - 8:
        raise CorruptVersion(path, f"its header's length says {n} bytes, the file has {size - 8} after it "
                                   f"(truncated, or not a safetensors file)")
    try:
        header = json.loads(bytes(m[8:8 + n]))
        meta = header.pop("__metadata__", {})
        order = json.loads(meta.get("weightbus_order", "null")) or list(header)
        if metadata is not None:
            metadata.update(meta)
        ok = len(order) == len(header) and set(order) == header.keys()
    except (ValueError, TypeError, AttributeError) as e:  # (UnicodeDecodeError is a ValueError)
        raise CorruptVersion(path, f"its {n}-byte header is not a safetensors header ({e})") from None
    if not ok:
        raise CorruptVersion(path, f"its tensor order (weightbus_order, {len(order)} names) does not name "
                                   f"the header's {len(header)} tensors once each")
    whole = torch.frombuffer(m, dtype=torch.uint8, count=size)
    start = 8 + n
    data = size - start
    out = []
    name = None
    try:
        for name in order:
            h = header[name]
            lo, hi = h["data_offsets"]
            if not 0 <= lo <= hi <= data:  # a slice past the end would be short, not an error
                raise IndexError
            out.append((name, whole[start + lo:start + hi].view(_FROM_NAME[h["dtype"]]).view(h["shape"])))
    except Exception as e:  # noqa: BLE001 - said in words below, for the entry that failed
        raise CorruptVersion(path, f"tensor {name!r}: {_bad_entry(header[name], data, e)}") from None
    return out


def _bad_entry(h: Any, data: int, e: Exception) -> str:
    """What is wrong with a header entry that did not make a view (the error path only)."""
    try:
        lo, hi = h["data_offsets"]
        dtype = _FROM_NAME.get(h["dtype"])
        if dtype is None:
            return f"dtype {h['dtype']!r} is not one a cache holds ({', '.join(_FROM_NAME)})"
        if not 0 <= lo <= hi:
            return f"data_offsets [{lo}, {hi}] are not a range"
        if hi > data:
            return (f"data_offsets [{lo}, {hi}] end past the file's {data} bytes of data "
                    f"(truncated)")
        need = dtype.itemsize * math.prod(h["shape"])
        return (f"dtype {h['dtype']} and shape {h['shape']} need {need} bytes, its data_offsets "
                f"[{lo}, {hi}] hold {hi - lo}")
    except Exception:  # noqa: BLE001 - an entry too malformed to take apart
        return f"malformed header entry {h!r:.200} ({type(e).__name__}: {e})"


@CheckpointEngineRegistry.register("shm")
@CheckpointEngineRegistry.register("disk")
class CacheEngine(CheckpointEngineWithCache):
    """Publish versions into a cache directory; pull the newest one when ready.

    Args (besides ``timeout``; ``bucket_size``/``num_buffers`` are accepted and unused):
        path: the cache directory (``disk``: required; ``shm``: default
            ``/dev/shm/wbcache_<cache_name>``).
        cache_name: the cache's name on the host (``shm``).
        keep: how many complete versions stay visible (the newest ones; at least 1).
        job: the job's name. A publisher stamps its versions with it (without one, with a
            token of its own); a reader reads only that job's versions (without one, the
            job ``build_topology`` tells it, else any version). Give it to a publisher that
            may restart, so its readers keep reading its last version meanwhile.

    The trainer side's ``send_weights`` publishes (trainer rank 0 writes; every trainer
    rank iterates the source, so sharded sources gather to rank 0) and returns: it never
    waits for a reader. The rollout side's :meth:`get_weights` returns at once, with the
    newest version newer than asked for (or nothing); ``receive_weights`` waits for one
    newer than this engine holds, up to the deadline.
    """

    def __init__(self, bucket_size: int | None = None, *, path: str | os.PathLike | None = None,
                 cache_name: str = "default", keep: int = 2, job: str | None = None, **kwargs: Any):
        kwargs.setdefault("device", "cpu")  # host memory or disk, also on a GPU machine
        super().__init__(bucket_size, **kwargs)
        if self.device.type != "cpu":
            raise PlanError(f"the cache lives in host memory or on disk: device={self.device} is not "
                            f"supported (the sink copies from it to the GPU)")
        self.keep = config.integer(keep, "keep", minimum=1, maximum=1 << 20)
        if not isinstance(cache_name, str) or not cache_name or "/" in cache_name:
            raise PlanError(f"cache_name must be a non-empty string without '/', got {cache_name!r}")
        self.cache_name = cache_name
        if job is not None and (not isinstance(job, str) or not job or not job.isprintable()):
            raise PlanError(f"job must be a non-empty printable string, got {job!r}")
        self.job = job  # (a reader: the job whose versions it reads; None: any, or as told)
        self._stamp = job or f"token-{secrets.token_hex(8)}"  # what this publisher stamps
        self._skipped: set[tuple[int, int, int, int]] = set()  # other jobs' files, said once
        self._path = None if path is None else os.fspath(path)
        self.rank = 0
        self._ready = False
        self._owner = False
        self._made_root = False  # the publisher made the cache directory (finalize removes it)
        #: a dead publisher's versions (of another job), removed once this one publishes
        self._superseded: list[int] = []
        self._broken: set[tuple[int, int, int, int]] = set()  # files found broken (when not moved)

    @property
    def root(self) -> str:
        if self._path is not None:
            return self._path
        if self.backend == "disk":
            raise PlanError("backend 'disk' needs path= (the cache directory)")
        return os.path.join("/dev/shm", _PREFIX + self.cache_name)

    # --- lifecycle (no group: publisher and readers meet in the directory) ------------------
    def prepare(self) -> dict[str, Any]:
        _ = self.root  # a missing path fails here
        return {"cache": self.root, "job": self._stamp}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list], dict[str, list]]:
        """Ranks only (publisher and readers meet in the directory); every reader is told
        the job trainer rank 0 (the publisher) stamps its versions with."""
        check_sides(trainer_world_size, rollout_world_size, metadata)
        R = rollout_world_size
        return ({"rank": list(range(trainer_world_size))},
                {"rank": list(range(trainer_world_size, trainer_world_size + R)),
                 "job": [metadata[0].get("job")] * R})

    def init_process_group(self, *, rank: int = 0, job: str | None = None, **_: Any) -> None:
        """``job``: the publisher's (from ``build_topology``), taken by a reader not given one."""
        self.rank = rank
        if self.job is None and job is not None and self.role != "trainer":
            self.job = job
        self._ready = True
        if self.role == "trainer" and rank == 0:
            self._own()  # the cache is this job's from now on, before any reader looks

    def connect(self, role: str, rank: int = 0) -> CacheEngine:
        """Without a group: this process publishes (``trainer``) or reads (``rollout``)."""
        self.role = role  # type: ignore[assignment]
        self.init_process_group(rank=rank)
        return self

    def finalize(self, destroy_group: bool = False) -> None:
        """With ``destroy_group``, an owner removes the cache's own files (versions, temporary
        and set-aside ones, its owner mark; readers that hold a version keep reading it), and
        the directory if it made it and nothing else is in it: a ``path=`` of the user's
        (``/tmp``, a run directory) keeps everything else it holds."""
        if destroy_group and self._owner:
            root = self.root
            with contextlib.suppress(OSError):
                for n in os.listdir(root):
                    if n == _OWNER or n.startswith((_TMP, _BROKEN)) or _VERSION.fullmatch(n):
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(root, n))
            if self._made_root:
                with contextlib.suppress(OSError):
                    os.rmdir(root)  # (only if empty)
            self._owner = False
        self._ready = self._ready and not destroy_group

    def _own(self) -> None:
        """Become the directory's owner (publisher): sweep what dead owners left on the host,
        make the directory, and remove temporary files of publishers that are gone."""
        if self._owner:
            return
        root = self.root
        if self.backend == "shm":
            sweep_stale_caches(os.path.dirname(root), keep=root)
        before = _read_owner(root)
        dead = before is not None and before["pid"] != os.getpid() and _gone(before)
        if dead:
            self._made_root = True  # (the directory is this owner's to remove now, as a made one)
        if dead and before.get("job") != self._stamp:  # type: ignore[union-attr]
            # (a dead publisher of another job: its versions are no version of this job. They
            # go once this publisher's first version has committed, not before: until then
            # they are what readers that take any job's newest can still read)
            self._superseded = _versions(root)
            _log.info("%s: took %s from a publisher that is gone (pid %s, job %r): its versions %s go "
                      "once this one's first version is in", self.where(), root, before["pid"],
                      before.get("job"), self._superseded)
        try:
            self._made_root = self._made_root or not os.path.isdir(root)
            os.makedirs(root, exist_ok=True)
            with open(os.path.join(root, _OWNER), "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "job": self._stamp}, f)
        except OSError as e:
            raise self._cannot_write("take the cache", os.path.join(root, _OWNER), 16, e) from e
        for n in os.listdir(root):
            if n.startswith(_TMP):
                try:
                    pid = int(n.split("-")[2])
                except (IndexError, ValueError):
                    continue
                if not buffers._alive(pid):
                    try:
                        os.unlink(os.path.join(root, n))
                    except OSError:
                        pass
        self._owner = True

    def _cannot_write(self, doing: str, path: str, needed: int, e: OSError) -> WeightSyncError:
        """A failed write as one error that says where, how many bytes it needed and how
        many are free (a full file system or /dev/shm, a file-size limit, a quota)."""
        try:
            st = os.statvfs(os.path.dirname(path))
            free = f"{st.f_bavail * st.f_frsize} bytes are free there"
        except OSError:
            free = "the free space is unknown"
        why = f"{errno.errorcode.get(e.errno or 0, 'error')}: {e.strerror or e}"
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if e.errno == errno.EFBIG and limit != resource.RLIM_INFINITY:
            why += f"; this process may write files of at most {limit} bytes (RLIMIT_FSIZE)"
        newest = _versions(self.root)
        kept = f"the cache keeps version {newest[-1]}" if newest else "the cache holds no version"
        return WeightSyncError(f"{self.where()}: cannot {doing}: writing {path} failed ({why}); it needs "
                               f"{needed} bytes, {free}; nothing was left behind and {kept}")

    def _check(self, role: str) -> None:
        if not self._ready:
            raise WeightSyncError(f"{self.where()}: not connected; call init_process_group() (or connect())")
        if self.role != role:
            raise WeightSyncError(f"{self.where()}: this rank is a {self.role}; only a {role} rank may "
                                  f"{'publish' if role == 'trainer' else 'read'}")

    # --- publish ----------------------------------------------------------------------------
    async def send_weights(self, weights: Weights, *, version: int | None = None,
                           rollback: bool = False) -> UpdateStats:
        self._check("trainer")
        version = self._next_version(version, rollback)  # (readers take the newest the cache holds)
        start = time.perf_counter()
        with self._exclusive("send_weights"):
            stream = resolve_stream(weights, None)
            writer = self.writer(stream.manifest, version) if self.rank == 0 else None
            try:
                held = stream.checked_tensors()
                if held is not None:
                    if writer is not None:
                        buffers.CopyList(writer.views).run(held, lambda k: stream.manifest[k].describe())
                else:
                    it = stream.open(None, lambda i: frozenset({0}), self.rank)
                    for i, meta in enumerate(stream.manifest):
                        try:
                            t = fetch(it, meta, i, stream.strict_dtype)
                        except StreamBroken as e:  # the source's own error, said where it arose
                            raise WeightSyncError(f"{self.where()}: the weight stream raised at "
                                                  f"{meta.describe()}: {e.__cause__}") from e.__cause__
                        if writer is not None and t is not None:
                            writer.views[i].copy_(t)
                    extra = next(it, None)
                    if extra is not None:
                        raise PlanError(f"the weight stream has more tensors than its manifest, first "
                                        f"extra {extra[0]!r}")
            except BaseException:
                if writer is not None:
                    writer.abandon()
                raise
            if writer is not None:
                self.publish(writer, version)
        self.version = version
        manifest = stream.manifest
        wrote = manifest.nbytes if self.rank == 0 else 0
        self.last_stats = UpdateStats(version, len(manifest), manifest.nbytes, wrote,
                                      time.perf_counter() - start, 0)
        return self.last_stats

    def writer(self, manifest: Manifest, version: int | None = None) -> _Writer:
        """A new version's file, to fill (``writer.views``, manifest order), then
        :meth:`publish` (a :class:`CacheRelay` fills it from any engine). The file of a
        version that is about to leave the cache, that no reader holds and that has the
        size the new one needs is reused. A file that cannot be had (a full file system)
        raises :class:`WeightSyncError` naming it, with nothing left behind."""
        self._own()
        layout = _Layout(manifest, self._stamp)
        for old in _versions(self.root)[:-max(1, self.keep - 1)]:  # never the newest one
            fd = _lock(_final(self.root, old), exclusive=True)
            if fd is None:
                continue
            if os.fstat(fd).st_size == layout.size:  # never resized: a shrunk file would
                break                                # SIGBUS a stray reader's pages past its end
            os.close(fd)
        else:
            fd = None
        try:
            return _Writer(self.root, layout, recycle=fd)
        except OSError as e:
            what = "publish" if version is None else f"publish version {version}"
            raise self._cannot_write(what, e.filename or self.root, layout.size, e) from e

    def publish(self, writer: _Writer, version: int) -> str:
        """Make the written version visible at once, whole; drop the old ones."""
        try:
            version = config.version(version)
            if version in _versions(self.root) and version not in self._superseded:
                # (a dead publisher's version of the same number is replaced, atomically)
                raise PlanError(f"{self.where()}: version {version} is in the cache already")
            path = writer.commit(self.root, version)
        except OSError as e:
            writer.abandon()
            raise self._cannot_write(f"publish version {version}", writer.tmp, writer.size, e) from e
        except BaseException:
            writer.abandon()
            raise
        for old in self._superseded:  # (a dead publisher's, of another job: a version is in now)
            if old != version:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_final(self.root, old))
        self._superseded = []
        for old in _versions(self.root)[:-self.keep]:
            try:
                os.unlink(_final(self.root, old))
            except FileNotFoundError:
                pass
        for n in os.listdir(self.root):  # files readers found broken and moved out of sight
            if n.startswith(_BROKEN):
                try:
                    os.unlink(os.path.join(self.root, n))
                except FileNotFoundError:
                    pass
        took = time.perf_counter() - writer.t0
        _log.info("%s: version %d published: %d tensors, %d bytes in %.3f s (%.2f GB/s) at %s", self.where(),
                  version, writer.tensors, writer.size, took, writer.size / 1e9 / max(took, 1e-9), path)
        return path

    # --- pull -------------------------------------------------------------------------------
    def get_weights(self, newer_than: int | None = None) -> WeightStream:
        """The newest complete version newer than ``newer_than``, at once: a stream (one
        batch of views of the mapped file) whose ``.version`` says which; an empty one with
        ``.version = None`` when nothing newer is there. Reading it to the end makes it this
        engine's ``version``."""
        if newer_than is not None:  # ('1', 1.5 or True would compare wrongly, or deep inside)
            newer_than = config.version(newer_than, "newer_than")
        self._check("rollout")
        got = self._open_newest(newer_than)
        if got is None:
            stream = WeightStream(iter(()))
            stream.version = None  # type: ignore[attr-defined]
            return stream
        version, fd, items = got
        pin = _Pin(fd)
        stream = WeightStream(self._yield(version, pin, items))
        weakref.finalize(stream, pin.release)  # also when the stream is dropped unread
        stream.version = version  # type: ignore[attr-defined]
        return stream

    def _open_newest(self, newer_than: int | None) -> tuple[int, int, list[tuple[str, torch.Tensor]]] | None:
        """(version, locked descriptor, views) of the newest version newer than asked for.
        The shared lock keeps the publisher from recycling the file while it is read. A
        broken file raises :class:`CorruptVersion` once: it is moved out of sight (or, where
        this reader may not, remembered), so the next pull gets the newest intact one."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:  # the newest may go between listing and locking it
            vs = [v for v in _versions(self.root) if newer_than is None or v > newer_than]
            for v in reversed(vs):
                path = _final(self.root, v)
                fd = _lock(path, exclusive=False)
                if fd is None:
                    break  # gone meanwhile: list again
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                if key in self._broken or key in self._skipped:
                    os.close(fd)
                    continue
                try:
                    meta: dict[str, str] = {}
                    items = read_version(path, fd, metadata=meta)
                    if self.job is not None and meta.get("weightbus_job") != self.job:
                        os.close(fd)
                        self._skipped.add(key)
                        _log.warning("%s: %s is another job's (%r; this reader reads job %r's): not read",
                                     self.where(), path, meta.get("weightbus_job"), self.job)
                        continue
                    return v, fd, items
                except CorruptVersion as e:
                    os.close(fd)
                    raise self._set_aside(path, v, st, e) from None
                except BaseException:
                    os.close(fd)
                    raise
            else:
                return None
            time.sleep(0.001)
        raise WeightSyncError(f"{self.where()}: the cache at {self.root} changes faster than it can "
                              f"be opened")

    def _set_aside(self, path: str, version: int, st: os.stat_result, e: CorruptVersion) -> CorruptVersion:
        """Move a broken version out of every reader's sight (the next publish removes it)
        or, where this reader may not, remember to skip it; the error to raise, once."""
        self._broken.add((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        aside = os.path.join(self.root, f"{_BROKEN}{version}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.rename(path, aside)
            done = f"moved it to {aside}"
        except FileNotFoundError:
            done = "it was moved aside already"
        except OSError as why:
            done = f"cannot move it aside ({why.strerror}): this reader skips it from now on"
        return CorruptVersion(path, f"{e.what}; {done}, and the next pull gets the newest intact version",
                              where=self.where())

    def _yield(self, version: int, pin: _Pin, items: list[tuple[str, torch.Tensor]]) -> Iterator[list]:
        try:
            with self._exclusive("receive_weights"):
                self.version = None  # the consumer writes from here on: torn until the end
                yield items
                self.version = version
        finally:
            pin.release()  # read: the publisher may recycle the file
            self.last_stats = UpdateStats(version, len(items), sum(t.nbytes for _, t in items), 0, 0.0, 1)

    def _wait_newer(self) -> tuple[int, int, list[tuple[str, torch.Tensor]]]:
        deadline = time.monotonic() + self.timeout
        while True:
            got = self._open_newest(self.version)
            if got is not None:
                return got
            if time.monotonic() > deadline:
                raise WeightSyncError(f"{self.where()}: no version newer than {self.version} appeared in "
                                      f"{self.root} within {self.timeout:.0f}s")
            time.sleep(0.01)

    def receive_weights(self, *, expected: Manifest | None = None) -> WeightStream:
        """A version newer than this engine holds, waiting for one up to the deadline."""
        self._check("rollout")
        return WeightStream(self._receive_iter(expected, None, None, batched=True))

    def receive_weights_sync(self, *, expected: Manifest | None = None, validate: Any = None,
                             on_release: Any = None, on_complete: Any = None,
                             ) -> Iterator[tuple[str, torch.Tensor]]:
        """The same as a plain iterator, with the hooks of the bucket engines (a vLLM worker
        reads a cache like any engine): ``validate(manifest)`` before any tensor,
        ``on_complete()`` after the last one. The views stay valid while they are held
        (``on_release`` is never needed: nothing is reused under a reader)."""
        self._check("rollout")
        return self._receive_iter(expected, validate, on_complete, batched=False)

    def _receive_iter(self, expected: Manifest | None, validate: Any, on_complete: Any,
                      batched: bool) -> Iterator[Any]:
        version, fd, items = self._wait_newer()
        pin = _Pin(fd)
        try:
            with self._exclusive("receive_weights"):
                manifest = Manifest(TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in items)
                if expected is not None and not expected.same_tensors(manifest):
                    raise WeightSyncError(f"{self.where()}: version {version} in the cache "
                                          f"({_final(self.root, version)}) differs from the expected "
                                          f"manifest {expected.first_difference(manifest)}")
                if validate is not None:
                    try:
                        validate(manifest)
                    except Exception as e:  # noqa: BLE001 - rejected before any tensor is read
                        raise WeightSyncError(f"{self.where()}: rejected version {version} before "
                                              f"loading: {e}") from e
                self.version = None  # the consumer writes from here on: torn until the end
                if batched:
                    yield items
                else:
                    yield from items
                if on_complete is not None:
                    try:
                        on_complete()
                    except Exception as e:  # noqa: BLE001
                        raise WeightSyncError(f"{self.where()}: version {version} failed its check "
                                              f"after loading: {e}") from e
                self.version = version
        finally:
            pin.release()


class CacheRelay:
    """Fills a host's cache from any weightbus engine: one transfer per host, whatever the
    number of replicas reading the cache there. ``engine`` is a rollout-side engine of the
    trainer's group (gloo, nccl, nixl, mooncake...); ``cache`` a trainer-side cache engine.

    ``step()`` receives one update into a new version file (written as it arrives) and
    publishes it under the version the trainer sent."""

    def __init__(self, engine: Any, cache: CacheEngine):
        if cache.role != "trainer":
            raise PlanError("CacheRelay: the cache engine must be the publishing side (role='trainer')")
        self.engine, self.cache = engine, cache

    def step(self) -> int:
        writer: list[_Writer] = []
        index: dict[str, int] = {}

        def open_version(manifest: Manifest) -> None:
            writer.append(self.cache.writer(manifest))
            index.update((m.name, i) for i, m in enumerate(manifest))

        try:
            for name, t in self.engine.receive_weights_sync(validate=open_version):
                writer[0].views[index[name]].copy_(t)
        except BaseException:
            if writer:
                writer[0].abandon()
            raise
        version = self.engine.version
        self.cache.publish(writer[0], version)
        self.cache.version = version
        return version

