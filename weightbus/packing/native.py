"""Small C kernels, built on first use with the system's C compiler and loaded with ctypes,
and one C++ extension, :func:`data_ptrs`.

Why by hand: the host-side jobs they do (copy a list of thousands of small tensors in one
call; delta mode's diff and apply; read the data pointers of thousands of tensors) have no
bulk primitive in torch or numpy: torch's CPU copies cost ~1 us per tensor (a
TensorIterator each), numpy assignments ~0.5 us, ``Tensor.data_ptr`` ~150 ns, and a model
of 100k small tensors then spends more on the calls than on its bytes.

A library is compiled once per source, compiler, flags and machine (``$CC``, else ``cc``;
the extension with ``$CXX``, else ``c++``, against the running torch) into
``$XDG_CACHE_HOME/weightbus`` (``~/.cache/weightbus``), under a file lock and a temporary
name then renamed, so processes that start at once build it once. ctypes lets go of the
GIL during a call. Where no compiler works, :func:`load` returns None and every caller has
a slower torch path that gives the same bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import logging
import operator
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from weightbus import config

log = logging.getLogger("weightbus")

_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL | None] = {}
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu11"]


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "weightbus"


@contextlib.contextmanager
def _build_lock(cache: Path, name: str) -> Iterator[None]:
    # (a process that finds another building waits for it rather than compiling the same
    # file beside it: the C++ extension takes ~8 s of a core)
    with open(cache / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(source: Path, cmd: list[str], libs: tuple[str, ...] = (), key_extra: str = "") -> Path:
    """The shared object built from ``source`` by ``cmd`` (compiler and flags) and linked
    with ``libs`` (after the source: linkers drop a library no earlier input needs), cached
    by everything that goes into it."""
    key = hashlib.sha256(source.read_bytes()
                         + " ".join([*cmd, *libs, platform.machine(), key_extra]).encode())
    cache = _cache_dir()
    lib = cache / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with _build_lock(cache, source.stem):
        if not lib.exists():
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            try:
                subprocess.run([*cmd, "-o", tmp, str(source), *libs], check=True, capture_output=True,
                               timeout=300)
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    return lib


def _build(source: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(_compile(source, [os.environ.get("CC", "cc"), *_FLAGS])))


def load(source: Path, declare: Callable[[ctypes.CDLL], None], what: str) -> ctypes.CDLL | None:
    """The library built from ``source`` (``declare`` sets its functions' argument types),
    or None, with one warning naming ``what`` falls back, where it cannot be built."""
    if source in _loaded:
        return _loaded[source]
    with _lock:
        if source not in _loaded:
            lib = None
            try:
                lib = _build(source)
                declare(lib)
            except (OSError, subprocess.SubprocessError, AttributeError) as e:
                err = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[-500:]
                log.warning("weightbus: %s did not build (%s%s); using the slower torch path", what, e,
                            f": {err}" if err else "")
                lib = None
            _loaded[source] = lib
    return _loaded[source]


_i64, _p = ctypes.c_int64, ctypes.c_void_p
_COPY = Path(__file__).with_name("copy_list.c")


def _declare_copy(lib: ctypes.CDLL) -> None:
    lib.wb_copy_list.argtypes = [_i64, _p, _p, _p]
    lib.wb_copy_list.restype = None


def copy_library() -> ctypes.CDLL | None:
    """``wb_copy_list(n, dst addresses, src addresses, byte counts)``: n memcpys in one call
    (None with ``WEIGHTBUS_NATIVE_COPY=0``, or where it cannot be built)."""
    if not config.flag("WEIGHTBUS_NATIVE_COPY", True):
        return None
    return load(_COPY, _declare_copy, "the host copy-list kernel")


# ---------------------------------------------------------------------------- pointers

_POINTERS = Path(__file__).with_name("pointers.cpp")
_data_ptr = torch.Tensor.data_ptr

#: Lists shorter than this take Python's pass (under ~0.15 ms): the extension is built only
#: for a process that follows this many tensors.
NATIVE_POINTERS_MIN = 1024
_BUILD_WAIT = 660.0  # seconds ``pointer_library(wait=True)`` waits at most (then: None)


class _Extension:
    """The pointer extension, built in a background thread on first demand (so no update
    waits ~8 s for the compiler: until it is loaded, callers take the Python pass)."""

    def __init__(self) -> None:
        self.module: ModuleType | None = None
        self.thread: threading.Thread | None = None
        self.pid = 0

    def get(self, wait: bool = False) -> ModuleType | None:
        if self.module is not None:
            return self.module
        with _lock:
            if self.thread is None or self.pid != os.getpid():  # (a forked child builds its own)
                self.pid = os.getpid()
                self.thread = threading.Thread(target=self._load, name="weightbus-build", daemon=True)
                self.thread.start()
            thread = self.thread
        if wait:
            thread.join(_BUILD_WAIT)  # (the compiler's own limit is 300 s, a peer's lock as long)
        return self.module

    def _load(self) -> None:
        try:
            cmd, libs = _extension_cmd()
            lib = _compile(_POINTERS, cmd, libs, f"{torch.__version__} {torch.__file__} {sys.version}")
            spec = importlib.util.spec_from_file_location("_wb_pointers", lib)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            self.module = module
        except Exception as e:  # noqa: BLE001 - a missing compiler or header: the Python pass
            err = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[-500:]
            log.warning("weightbus: the pointer extension did not build (%s%s); using Python's pass",
                        e, f": {err}" if err else "")


def _extension_cmd() -> tuple[list[str], tuple[str, ...]]:
    root = Path(torch.__file__).parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    python = sysconfig.get_paths()["include"]
    cmd = [os.environ.get("CXX", "c++"), "-O2", "-shared", "-fPIC", "-std=c++17", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}", f"-I{python}"]
    return cmd, (f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-ltorch_python", "-lc10")


_extension = _Extension()


def pointer_library(wait: bool = False) -> Any:
    """The loaded pointer extension, or None while it builds (``wait``: until it is built,
    at most ``_BUILD_WAIT`` seconds), where it cannot be built, or with
    ``WEIGHTBUS_NATIVE_POINTERS=0``."""
    if not config.flag("WEIGHTBUS_NATIVE_POINTERS", True):
        return None
    return _extension.get(wait)


_OFF = ("0", "false", "no", "off")  # (config.flag's words, read here in one line: a hot path)


def data_ptrs(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """The address of each tensor's bytes as an int64 array: ``t.data_ptr()``, or for a
    DTensor (a wrapper with no bytes of its own) its local shard's; in one C++ call for long
    lists (~30 ns a tensor against ~150). A TypeError for an item that is not a tensor."""
    n = len(tensors)
    # (while it builds, in this process: Python's pass, without asking again)
    if n >= NATIVE_POINTERS_MIN and (lib := _extension.module or (
            None if _extension.pid == os.getpid() else pointer_library())) is not None \
            and os.environ.get("WEIGHTBUS_NATIVE_POINTERS", "1").strip().lower() not in _OFF:
        out = np.empty(n, np.int64)
        lib.data_ptrs(tensors, out.ctypes.data)
        return out
    try:
        out = np.fromiter(map(_data_ptr, tensors), np.int64, n)
    except RuntimeError:  # (a torch whose wrappers refuse data_ptr: one at a time)
        return np.fromiter(map(_pointer_of, tensors), np.int64, n)
    for k in np.flatnonzero(out == 0).tolist():  # (empty tensors, and wrappers: rare but for DTensors)
        out[k] = _pointer_of(tensors[k])
    return out


def layouts(tensors: Sequence[torch.Tensor]) -> np.ndarray | None:
    """Each tensor's address and a hash of its sizes, strides, dtype and device, an int64
    ``[n, 2]`` array, in one C++ call; None for short lists or where the extension is not
    loaded (the caller then compares those attributes itself)."""
    n = len(tensors)
    lib = _extension.module
    if n < NATIVE_POINTERS_MIN or lib is None or not hasattr(lib, "layouts") \
            or os.environ.get("WEIGHTBUS_NATIVE_POINTERS", "1").strip().lower() in _OFF:
        return None
    out = np.empty((n, 2), np.int64)
    lib.layouts(tensors, out.ctypes.data)
    return out


def layout_keys(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """:func:`layouts`, or where it answers None the same from Python: each tensor's address
    (:func:`data_ptrs`) and a hash of its sizes, strides, dtype and device. Two looks at the
    same tensors compare with ``np.array_equal`` (the two hashes differ: a look taken before
    the extension loaded and one after compare unequal once)."""
    got = layouts(tensors)
    if got is not None:
        return got
    out = np.empty((len(tensors), 2), np.int64)
    out[:, 0] = data_ptrs(tensors)
    out[:, 1] = [hash((tuple(t.shape), t.stride(), t.dtype, t.device)) for t in tensors]
    return out


def same_items(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether ``a`` and ``b`` hold the very same objects in the same order (a C-level
    pass over long lists where the extension is loaded)."""
    if len(a) >= NATIVE_POINTERS_MIN and (lib := _extension.module) is not None \
            and hasattr(lib, "same_items"):
        return bool(lib.same_items(a, b))
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _pointer_of(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local.data_ptr()
    try:
        return t.data_ptr()
    except RuntimeError:
        return 0
