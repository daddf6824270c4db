"""A safetensors checkpoint as a source: sharded as transformers writes it, streamed into
real rollout processes bitwise; broken checkpoints are one clear error naming the file."""

import json
import os

import pytest
import workers

from weightbus import WeightbusError
from weightbus.runtime.local import spawn

pytest.importorskip("safetensors")
from weightbus.integrations.safetensors import SafetensorsSource  # noqa: E402


def test_sharded_checkpoint_streams_bitwise(port, tmp_path):
    logs = spawn(workers.safetensors_stream, 3, (port, str(tmp_path / "ckpt")), timeout=180)
    trainer, rollouts = logs[0], logs[1:]
    for k in range(3):
        for r in rollouts:
            assert r[k] == trainer[k], f"update {k + 1}"
        assert k == 0 or trainer[k] != trainer[k - 1]  # the weights really changed


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    workers.save_sharded(workers.Mixed(), str(path))
    return path


def test_source_reads_index_order_and_dtype_policy(ckpt):
    import torch
    src = SafetensorsSource(ckpt, dtype=torch.bfloat16)
    model = workers.Mixed()
    assert {m.name for m in src.manifest} == set(model.state_dict())
    wire = {m.name: m.dtype for m in src.manifest}
    assert wire["proj.weight"] == torch.bfloat16 and wire["steps"] == torch.int64
    assert wire["mask"] == torch.bool
    got = dict(src)
    for name, t in model.state_dict().items():
        assert torch.equal(got[name], t), name
    single = SafetensorsSource(ckpt / "model-00001-of-00002.safetensors")
    assert len(single) == len(src.manifest) - len(src.manifest) // 2


def test_missing_shard(ckpt):
    os.remove(ckpt / "model-00002-of-00002.safetensors")
    with pytest.raises(WeightbusError, match=r"shard .*model-00002-of-00002.safetensors is missing "
                                             r"\(the index puts \d+ tensors in it, e\.g\. '"):
        SafetensorsSource(ckpt)


def test_truncated_file(ckpt):
    f = ckpt / "model-00001-of-00002.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-64])
    with pytest.raises(WeightbusError, match=r"cannot read .*model-00001-of-00002.safetensors: .*incomplete"):
        SafetensorsSource(ckpt)


def test_index_names_a_tensor_no_shard_holds(ckpt):
    index = ckpt / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(WeightbusError, match=r"names tensor 'lm_head.weight' in .*model-00002-of-00002"
                                             r".safetensors, which does not hold it"):
        SafetensorsSource(ckpt)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(WeightbusError, match="neither a file nor a directory"):
        SafetensorsSource(tmp_path / "nope")
    with pytest.raises(WeightbusError, match="no model.safetensors.index.json and no .safetensors file"):
        SafetensorsSource(tmp_path)
