"""The local runtime's worker processes, started either way (``WEIGHTBUS_START_METHOD``):
each starts with the environment its parent has at that moment (a forkserver's own was
fixed when it started), ``env=`` on top, and a method that is not one is refused by name."""

import pytest
import workers

from weightbus.errors import ConfigError
from weightbus.runtime.group import LocalWorkerGroup, call
from weightbus.runtime.local import spawn


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_start_with_the_parents_environment_now(method, monkeypatch):
    monkeypatch.setenv("WEIGHTBUS_START_METHOD", method)
    monkeypatch.setenv("WB_GONE", "set")
    assert spawn(workers.env_of, 1, ("WB_GONE",), timeout=60) == [{"WB_GONE": "set"}]
    monkeypatch.delenv("WB_GONE")  # (a forkserver that started above still has it)
    for value in ("first", "second"):
        monkeypatch.setenv("WB_PROBE", value)
        group = LocalWorkerGroup(workers.EnvProbe, 2, env={"WB_EXTRA": value * 2})
        try:
            got = call(group, "read", "WB_PROBE", "WB_EXTRA", "WB_GONE", timeout=60)
        finally:
            group.shutdown()
        assert got == [{"WB_PROBE": value, "WB_EXTRA": value * 2, "WB_GONE": None}] * 2
        assert spawn(workers.env_of, 2, ("WB_PROBE", "WB_EXTRA", "WB_GONE"), timeout=60) == \
            [{"WB_PROBE": value, "WB_EXTRA": None, "WB_GONE": None}] * 2


def test_an_unknown_start_method_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("WEIGHTBUS_START_METHOD", "fork")
    with pytest.raises(ConfigError, match=r"WEIGHTBUS_START_METHOD='fork' is not one of spawn, forkserver"):
        spawn(workers.env_of, 1, ("X",), timeout=30)
    with pytest.raises(ConfigError, match="WEIGHTBUS_START_METHOD"):
        LocalWorkerGroup(workers.EnvProbe, 1)
