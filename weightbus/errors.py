"""Errors and deadlines shared by every layer.

Every error names where it happened: the role and rank, the peer, the phase of the
update and, where one is involved, the tensor.
"""

from __future__ import annotations

import datetime


class WeightbusError(RuntimeError):
    """Base class of every error weightbus raises on purpose."""


class PlanError(WeightbusError, ValueError):
    """Bad input to the bucket plan: duplicate names, bucket too small, bad tensors."""


class ConfigError(WeightbusError, ValueError):
    """A bad option or environment variable, named with its value and what is allowed."""


class ManifestMismatch(WeightbusError):
    """Two sides disagree on the ordered list of tensors (name, dtype, shape)."""


class WeightSyncError(WeightbusError):
    """An update failed; raised on every rank of the update with the same reason."""


class TransferFailed(WeightSyncError):
    """A failure on an engine's data path (a peer that stopped answering or reading) that
    left its control group intact: the rank still agrees the update's outcome over it, so
    every rank learns why at once, and the group serves the next update as it is."""


class ReplicasFailed(WeightSyncError):
    """An elastic engine's send reached some replicas but not all: :attr:`failed` maps
    each replica that did not get it to why; :attr:`stats` is the send's own record.
    The others hold the new version; the failed ones are linked again before they
    receive another update."""

    def __init__(self, message: str, failed: dict[str, str], stats: object):
        super().__init__(message)
        self.failed = failed
        self.stats = stats


class UpdateFailed(WeightSyncError):
    """A manager's update failed. Every replica still alive was resumed on the weights it
    holds; :attr:`versions` says which version each replica holds (None: none, or torn)."""

    def __init__(self, message: str, versions: dict[str, int | None], resumed: list[str]):
        super().__init__(message)
        self.versions = versions
        self.resumed = resumed


class SinkError(WeightbusError):
    """Received weights do not fit the receiving model (missing, unexpected, mis-shaped)."""


def as_timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))
