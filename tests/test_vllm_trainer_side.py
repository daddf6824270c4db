"""The vLLM integration where vLLM is absent (the main suite has none): the trainer side
imports no vLLM, the plugin entry point never raises, arguments are checked where given,
and version strings are read as the compatibility module says. The paths through a real
vLLM are tests/test_vllm_*.py (CPU builds 0.27.1 and 0.32.0) and test_vllm_gpu.py."""

import logging
import subprocess
import sys

import pytest

from weightbus.errors import WeightbusError
from weightbus.integrations.vllm import WeightbusTrainerInitInfo, compat
from weightbus.integrations.vllm.trainer import _finisher


def test_the_trainer_side_imports_no_vllm():
    code = ("import sys; from weightbus.integrations.vllm import trainer_init, WeightbusTrainerInitInfo, "
            "RolloutClient; import weightbus.integrations.vllm.trainer; "
            "assert 'vllm' not in sys.modules, 'vllm was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif("vllm" in sys.modules or compat.installed_version() is not None,
                    reason="checks the entry point where vLLM is absent")
def test_the_entry_point_never_raises_without_vllm(caplog):
    from weightbus.integrations.vllm import register
    compat._said.discard("register")
    with caplog.at_level(logging.WARNING, logger="vllm.weightbus"):
        register()
        register()  # (said once)
    lines = [r.getMessage() for r in caplog.records if "weightbus" in r.getMessage()]
    assert len(lines) == 1 and "not available" in lines[0], lines


@pytest.mark.parametrize("text,want", [("0.24.0", (0, 24)), ("0.32.0+cpu", (0, 32)),
                                       ("0.33.0rc1.dev3", (0, 33)), ("1.2", (1, 2)), ("", (0, 0)),
                                       (None, (0, 0)), ("dev", (0, 0))])
def test_versions_are_read(text, want):
    assert compat.parse_version(text) == want


def test_support_notes_name_the_way_that_works():
    assert compat.support_note("0.24.0") is None and compat.support_note("0.33.1") is None
    assert "WeightbusWorkerExtension" in compat.support_note("0.23.1")
    assert "newer" in compat.support_note("0.34.0")
    assert compat.support_note(None) is None


GOOD = dict(rank=0, world_size=2, rollout_world_size=1, master_address="127.0.0.1", master_port=29500)


@pytest.mark.parametrize("change,named", [
    ({"rank": 2}, "rank must be in [0, 2)"),
    ({"rank": -1}, "rank must be in"),
    ({"world_size": 0}, "world_size must be a positive int"),
    ({"rollout_world_size": 0}, "rollout_world_size must be a positive int"),
    ({"master_port": 70000}, "master_port must be a port number"),
    ({"master_address": ""}, "master_address"),
    ({"transport": "glo"}, "glo"),
    ({"timeout": 0}, "timeout must be positive"),
])
def test_trainer_init_info_is_checked_where_given(change, named):
    import re
    with pytest.raises(WeightbusError, match=re.escape(named)):
        WeightbusTrainerInitInfo(**{**GOOD, **change})


def test_trainer_init_info_is_the_factory_key_and_rank_is_keyword_only():
    info = WeightbusTrainerInitInfo(**GOOD)
    assert WeightbusTrainerInitInfo.backend == "weightbus" and info.is_sender
    with pytest.raises(TypeError):
        WeightbusTrainerInitInfo("127.0.0.1", 29500, 2, 1, "gloo", None, None, 60.0, False, -1, 0, None,
                                 None, 0)


class _Since027:
    def __init__(self):
        self.got = []

    def finish_weight_update(self, weight_version=None):
        self.got.append(weight_version)


class _Before027:
    def __init__(self):
        self.got = []

    def finish_weight_update(self):
        self.got.append("called")


def test_finish_is_called_the_way_each_client_takes_it():
    new, old = _Since027(), _Before027()
    _finisher(new)("7")
    _finisher(old)("7")
    assert new.got == ["7"] and old.got == ["called"]


def test_a_vllm_weight_source_of_either_form_is_read():
    import torch

    class Meta:
        def __init__(self, name, t):
            self.name, self.dtype, self.shape = name, t.dtype, tuple(t.shape)

    named = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}

    class UpTo032:  # metadata() and iteration
        def metadata(self):
            return [Meta(n, t) for n, t in named.items()]

        def __iter__(self):
            return iter(named.items())

    class From033:  # a metadata property and iter_full()
        @property
        def metadata(self):
            return [Meta(n, t) for n, t in named.items()]

        def implements_iter_full(self):
            return True

        def iter_full(self):
            return iter(named.items())

    for src in (UpTo032(), From033()):
        s = compat.VLLMWeightSource(src)
        assert [m.name for m in s.manifest] == ["a", "b"] and s.manifest.nbytes == 6 * 4 + 4 * 2
        assert [(n, torch.equal(t, named[n])) for n, t in s] == [("a", True), ("b", True)]
