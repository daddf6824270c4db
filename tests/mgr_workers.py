"""Rollout variants that fail on purpose, for the manager's failure tests."""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from rl_workers import Rollout  # noqa: E402

from weightbus import ModuleSink  # noqa: E402


class _Trap(ModuleSink):
    def __init__(self, module, action):
        super().__init__(module)
        self.action = action

    def _load_one(self, name, t, report, seen):
        self.action()
        super()._load_one(name, t, report, seen)


class FailingRollout(Rollout):
    """Dies (``die``) or hangs (``hang``) on the first tensor of update ``at``."""

    def __init__(self, rank, world, mode, at):
        super().__init__(rank, world)
        self.mode, self.at, self.version_in_flight = mode, at, None

    async def wb_receive(self, version):
        self.version_in_flight = version
        return await super().wb_receive(version)

    def weights_sink(self):
        def act():
            if self.version_in_flight == self.at:
                if self.mode == "die":
                    os._exit(9)
                time.sleep(3600)
        return _Trap(self.model, act)
