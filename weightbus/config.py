"""Layer 0: options and environment variables, read when an engine or manager is made
(never at import) and checked where they are given: a bad value is one error naming the
option or variable, the value, and what is allowed.

Environment variables:

- ``WEIGHTBUS_TIMEOUT``: default deadline, seconds, of every blocking wait (a positive
  number; default 120).
- ``WEIGHTBUS_FLAT_GATHERS``: ``1`` (default) or ``0``: small FSDP2 shards gathered into
  rollout tensors as one flat all-gather per run, or one gather per tensor
  (see :mod:`weightbus.sources`).
- ``WEIGHTBUS_COALESCE_GATHERS``: ``0`` or ``1`` (see :mod:`weightbus.sources`).
- ``WEIGHTBUS_VLLM_SELF_CHECK``: ``N`` or ``N:L`` (see the vLLM integration).
- ``WEIGHTBUS_START_METHOD``: how local worker processes start (``spawn``, the default:
  a fresh interpreter each; ``forkserver``: forked from one server that imported torch
  and weightbus once, ~1 s less per worker; see :mod:`weightbus.runtime.group`).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

from weightbus.errors import ConfigError

#: The deadline, seconds, of every blocking wait when neither ``timeout=`` nor
#: ``WEIGHTBUS_TIMEOUT`` says otherwise.
BUILTIN_TIMEOUT = 120.0


def _kind(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def positive_seconds(value: Any, what: str, unit: str = "seconds") -> float:
    """A deadline: a finite number of seconds > 0 (an int or a float, not a bool); or,
    with ``unit``, any such quantity (a rate in GB/s)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{what} must be a number of {unit} > 0, got {_kind(value)}")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{what} must be a finite number of {unit} > 0, got {value!r}")
    return number


def default_timeout() -> float:
    """``WEIGHTBUS_TIMEOUT`` if set (checked), else :data:`BUILTIN_TIMEOUT`."""
    raw = os.environ.get("WEIGHTBUS_TIMEOUT")
    if raw is None or raw.strip() == "":
        return BUILTIN_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"WEIGHTBUS_TIMEOUT={raw!r} is not a number; set it to a deadline in "
                          f"seconds > 0 (e.g. 120) or unset it") from None
    return positive_seconds(value, f"WEIGHTBUS_TIMEOUT={raw!r}")


def timeout(value: Any, what: str = "timeout") -> float:
    """``timeout=`` as given (checked), or the default when it is None."""
    return default_timeout() if value is None else positive_seconds(value, what)


def integer(value: Any, what: str, *, minimum: int, maximum: int | None = None, hint: str = "") -> int:
    """An int (numpy ints too; not a bool, a float or a string) within bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{what} must be an int, got {_kind(value)}{hint}")
    n = int(value)
    if n < minimum or (maximum is not None and n > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{what} must be {bound}, got {n}{hint}")
    return n


def bucket_size(value: Any, *, alignment: int, trailer: int) -> int | None:
    """``bucket_size=``: None (sized from free memory) or a byte count that holds at least
    one aligned slot and the trailer, and is a multiple of ``alignment`` (every rank's
    buckets then split tensors at the same places)."""
    if value is None:
        return None
    hint = " (bytes, e.g. 64 << 20 for 64 MiB; None sizes buckets from free memory)"
    n = integer(value, "bucket_size", minimum=1, hint=hint)
    if n < alignment + trailer:
        raise ConfigError(f"bucket_size={n} is too small: a bucket holds at least one {alignment}-byte "
                          f"aligned slot and the {trailer}-byte trailer (minimum {alignment + trailer})")
    if n % alignment:
        lo, hi = n // alignment * alignment, (n // alignment + 1) * alignment
        raise ConfigError(f"bucket_size={n} is not a multiple of the {alignment}-byte alignment; "
                          f"use {max(lo, alignment + trailer if lo < alignment + trailer else lo)} or {hi}")
    return n


def version(value: Any, what: str = "version") -> int:
    """An update's version: an int in [0, 2**63 - 1] (it travels as a signed 64-bit word)."""
    return integer(value, what, minimum=0, maximum=(1 << 63) - 1)


def env_integer(name: str, *, minimum: int, maximum: int | None = None) -> int | None:
    """An integer environment variable within bounds, or None where it is unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected an integer") from None
    return integer(value, name, minimum=minimum, maximum=maximum)


def flag(name: str, default: bool = False) -> bool:
    """A boolean environment variable: ``0``/``1`` (also ``false``/``true``, ``no``/``yes``)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected 0 or 1")


#: the ways :mod:`weightbus.runtime` may start a worker process
START_METHODS = ("spawn", "forkserver")


def start_method() -> str:
    """``WEIGHTBUS_START_METHOD`` if set (checked), else ``spawn``."""
    raw = os.environ.get("WEIGHTBUS_START_METHOD", "").strip()
    if not raw:
        return "spawn"
    if raw not in START_METHODS:
        raise ConfigError(f"WEIGHTBUS_START_METHOD={raw!r} is not one of {', '.join(START_METHODS)}; "
                          f"unset it to spawn each worker afresh")
    return raw
