"""Megatron-core trainers (TP, PP, EP) -> a Hugging Face model, through MegatronSource,
bitwise against mbridge's own export. Runs where megatron-core and mbridge are installed
(CI: `make test-megatron`, in a venv of its own)."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

import megatron_workers  # noqa: E402

from weightbus.comm import free_port  # noqa: E402
from weightbus.runtime.local import spawn  # noqa: E402


@pytest.mark.parametrize("arch,T,tp,pp,ep,etp,tied,vpp", [
    ("qwen3", 2, 2, 1, 1, None, False, None),
    ("qwen2", 2, 1, 2, 1, None, False, None),
    ("qwen3", 2, 1, 2, 1, None, True, None),  # embeddings tied across the two stages
    ("qwen2", 2, 1, 2, 1, None, False, 2),  # virtual pipelining: 2 chunks a stage
    ("qwen3_moe", 2, 1, 1, 2, None, False, None),
    ("qwen3_moe", 4, 2, 1, 2, 1, False, None),
])
def test_megatron_to_hf_bitwise(port, arch, T, tp, pp, ep, etp, tied, vpp):
    out = spawn(megatron_workers.trainer_to_hf, T + 1,
                (T, free_port(), port, arch, tp, pp, ep, etp, tied, vpp), timeout=300)
    # every bucket is packed where its tensors are held (homes): no tensor took a hop to
    # its packer, and the buckets are spread (each stage its layers, each EP rank its
    # experts, TP ranks a stage's buckets between them)
    assert [[u["hops"] for u in out[r]] for r in range(T)] == [[0, 0]] * T
    assert all(sum(out[r][k]["wire"] > 0 for r in range(T)) >= 2 for k in range(2))
    _check_bitwise(out[0], out[T])


def _check_bitwise(trainer0, rollout):
    """Both updates: every tensor of mbridge's export held bitwise by the rollout, and the
    weights changed between them."""
    for k in range(2):
        want = trainer0[k]["expected"]
        got = rollout[k]
        assert set(want) <= set(got), sorted(set(want) - set(got))
        for n, t in want.items():
            assert got[n] == t, n  # bitwise
    assert trainer0[0]["expected"]["model.embed_tokens.weight"] != \
        trainer0[1]["expected"]["model.embed_tokens.weight"]  # the weights changed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch,tied", [("qwen3_moe", False), ("qwen3", True)])
def test_megatron_colocated_gpu_bitwise(port, arch, tied):
    """The hybrid case on one GPU: a Megatron trainer and an HF rollout share it, and the
    weights pass through CUDA IPC (colocated)."""
    out = spawn(megatron_workers.trainer_to_hf, 2,
                (1, free_port(), port, arch, 1, 1, 1, None, tied, None, "colocated", "cuda"), timeout=300)
    _check_bitwise(out[0], out[1])
