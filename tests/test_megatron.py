"""Megatron-core trainers (TP, PP, EP) -> a Hugging Face model, through MegatronSource,
bitwise against mbridge's own export. Runs where megatron-core and mbridge are installed
(CI: `make test-megatron`, in a venv of its own)."""

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

import megatron_workers  # noqa: E402

from weightbus.comm import free_port  # noqa: E402
from weightbus.runtime.local import spawn  # noqa: E402


@pytest.mark.parametrize("arch,T,tp,pp,ep,etp", [
    ("qwen3", 2, 2, 1, 1, None),
    ("qwen2", 2, 1, 2, 1, None),
    ("qwen3_moe", 2, 1, 1, 2, None),
    ("qwen3_moe", 4, 2, 1, 2, 1),
])
def test_megatron_to_hf_bitwise(port, arch, T, tp, pp, ep, etp):
    out = spawn(megatron_workers.trainer_to_hf, T + 1, (T, free_port(), port, arch, tp, pp, ep, etp),
                timeout=300)
    trainer0, rollout = out[0], out[T]
    for k in range(2):
        want = trainer0[k]["expected"]
        got = rollout[k]
        assert set(want) <= set(got), sorted(set(want) - set(got))
        for n, t in want.items():
            assert got[n] == t, n  # bitwise
    assert trainer0[0]["expected"]["model.embed_tokens.weight"] != \
        trainer0[1]["expected"]["model.embed_tokens.weight"]  # the weights changed
