"""Small C kernels, built on first use with the system's C compiler and loaded with ctypes.

Why by hand: the host-side jobs they do (copy a list of thousands of small tensors in one
call; delta mode's diff and apply) have no bulk primitive in torch or numpy: torch's CPU
copies cost ~1 us per tensor (a TensorIterator each), numpy assignments ~0.5 us, and a
model of 100k small tensors then spends more on the calls than on its bytes.

A library is compiled once per source, compiler and machine (``$CC``, else ``cc``) into
``$XDG_CACHE_HOME/weightbus`` (``~/.cache/weightbus``), built under a temporary name and
renamed, so processes that build at once do not collide. ctypes lets go of the GIL during
a call. Where no compiler works, :func:`load` returns None and every caller has a slower
torch path that gives the same bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from weightbus import config

log = logging.getLogger("weightbus")

_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL | None] = {}
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu11"]


def _build(source: Path) -> ctypes.CDLL:
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(source.read_bytes() + " ".join([cc, *_FLAGS, platform.machine()]).encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "weightbus"
    lib = cache / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run([cc, *_FLAGS, "-o", tmp, str(source)], check=True, capture_output=True,
                           timeout=120)
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(lib))


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
