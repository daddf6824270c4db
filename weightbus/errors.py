"""Errors and deadlines shared by every layer.

Every error names where it happened: the role and rank, the peer, the phase of the
update and, where one is involved, the tensor.
"""

from __future__ import annotations

import datetime
import os

#: Default deadline, in seconds, of every blocking wait (a collective, a handshake, a
#: rendezvous). Override per engine with ``timeout=`` or globally with
#: ``WEIGHTBUS_TIMEOUT``.
DEFAULT_TIMEOUT: float = float(os.environ.get("WEIGHTBUS_TIMEOUT", "120"))


class WeightbusError(RuntimeError):
    """Base class of every error weightbus raises on purpose."""


class PlanError(WeightbusError, ValueError):
    """Bad input to the bucket plan: duplicate names, bucket too small, bad tensors."""


class ManifestMismatch(WeightbusError):
    """Two sides disagree on the ordered list of tensors (name, dtype, shape)."""


class WeightSyncError(WeightbusError):
    """An update failed; raised on every rank of the update with the same reason."""


class SinkError(WeightbusError):
    """Received weights do not fit the receiving model (missing, unexpected, mis-shaped)."""


def as_timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))
