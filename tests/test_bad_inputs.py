"""Bad input, checked where it is given: each case is one clear error naming what is wrong
(or, where the input is legal, correct handling). The cases that need a formed group
(streams, membership, concurrency, lifecycle) run across real processes at the end.

Every case is a row of one table so the suite counts them: ``len(CASES)``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
import workers
from torch import nn

from weightbus import (
    CheckpointEngineRegistry,
    ModuleSink,
    ModuleSource,
    WeightbusError,
)
from weightbus.engines.base import agree_buffers
from weightbus.engines.collective import CollectiveEngine
from weightbus.engines.colocated import ColocatedEngine
from weightbus.manager import CheckpointEngineManager
from weightbus.packing.shards import Box, ShardLayout, ShardPlan, tp_placements
from weightbus.plan import BucketPlan, Manifest, TensorMeta
from weightbus.runtime.local import join, spawn


def _engine(**kw):
    return CheckpointEngineRegistry.new("gloo", **kw)


def _meta(bucket_size=None, num_buffers=2, alignment=256):
    return {"bucket_size": bucket_size, "bucket_fit": 1 << 20, "num_buffers": num_buffers,
            "alignment": alignment}


def _source(named):
    return ModuleSource(named)


def _sglang_engine(**server_args):
    """What SGLangReplica reads of an ``sglang.Engine`` when it is given: its server args."""
    from weightbus.integrations.sglang import engine_args
    sa = {"tp_size": 1, "pp_size": 1, "dp_size": 1, **engine_args()}
    return type("Engine", (), {"server_args": type("ServerArgs", (), {**sa, **server_args})})()


def _sglang_replica(engine, **kw):
    from weightbus.integrations.sglang import SGLangReplica
    return SGLangReplica(engine, name="s0", **kw)


def _sglang_engine_args(**kw):
    from weightbus.integrations.sglang import engine_args
    return engine_args(**kw)


def _sparse():
    return torch.eye(3).to_sparse()


def _quantized():
    return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)


def _fp8_writer(*dests):
    """``QuantizedSource.direct_writer`` (the rollout's own tensors as its destinations) given ``dests``
    for a bf16 weight served in block fp8 (payload, scale) and a bias served as it is."""
    from weightbus.quant import Fp8Format, QuantizedSource
    source = QuantizedSource(ModuleSource({"w": torch.randn(256, 130, dtype=torch.bfloat16),
                                           "b": torch.zeros(3, dtype=torch.bfloat16)}), {"w": Fp8Format()})
    return source.direct_writer(list(dests))


_F8 = torch.float8_e4m3fn


# (id, call, expected error type, regex the message must match)
class _Loaders:
    """Shard destinations that place each region themselves (as vLLM's loaders do)."""

    def layout(self, manifest):
        return None

    def place(self, name, box, data):
        pass


CASES = [
    # --- registry and engine options
    ("unknown-backend", lambda: CheckpointEngineRegistry.new("tcp"), WeightbusError, "unknown.*'tcp'.*gloo"),
    ("unknown-backend-manager", lambda: CheckpointEngineManager("nope", None), WeightbusError, "'nope'"),
    ("bucket-0", lambda: _engine(bucket_size=0), WeightbusError, "bucket_size must be >= 1, got 0"),
    ("bucket-negative", lambda: _engine(bucket_size=-4096), WeightbusError, "bucket_size must be >= 1"),
    ("bucket-str", lambda: _engine(bucket_size="64M"), WeightbusError, r"bucket_size must be an int, got '64M'.*64 << 20"),
    ("bucket-float", lambda: _engine(bucket_size=1.5e6), WeightbusError, "bucket_size must be an int, got 1500000.0"),
    ("bucket-bool", lambda: _engine(bucket_size=True), WeightbusError, "bucket_size must be an int, got True"),
    ("bucket-too-small", lambda: _engine(bucket_size=256), WeightbusError, "too small.*minimum 320"),
    ("bucket-unaligned", lambda: _engine(bucket_size=(1 << 20) + 1), WeightbusError, "not a multiple of the 256-byte alignment"),
    ("bucket-list", lambda: _engine(bucket_size=[1 << 20]), WeightbusError, "bucket_size must be an int"),
    ("num-buffers-0", lambda: _engine(num_buffers=0), WeightbusError, "num_buffers must be in"),
    ("num-buffers-negative", lambda: _engine(num_buffers=-1), WeightbusError, "num_buffers must be in"),
    ("num-buffers-str", lambda: _engine(num_buffers="2"), WeightbusError, "num_buffers must be an int"),
    ("num-buffers-float", lambda: _engine(num_buffers=2.0), WeightbusError, "num_buffers must be an int"),
    ("num-buffers-huge", lambda: _engine(num_buffers=10_000), WeightbusError, "num_buffers must be in"),
    ("timeout-0", lambda: _engine(timeout=0), WeightbusError, "timeout must be a finite number of seconds > 0, got 0"),
    ("timeout-negative", lambda: _engine(timeout=-1000), WeightbusError, "got -1000"),
    ("timeout-nan", lambda: _engine(timeout=math.nan), WeightbusError, "got nan"),
    ("timeout-inf", lambda: _engine(timeout=math.inf), WeightbusError, "got inf"),
    ("timeout-str", lambda: _engine(timeout="10"), WeightbusError, "timeout must be a number of seconds"),
    ("timeout-bool", lambda: _engine(timeout=True), WeightbusError, "timeout must be a number of seconds"),
    ("manager-timeout", lambda: CheckpointEngineManager("gloo", None, timeout=-1), WeightbusError, "timeout"),
    ("misspelled-option", lambda: _engine(bucket_sise=1 << 20), WeightbusError,
     "backend 'gloo' takes no option 'bucket_sise'; did you mean 'bucket_size'\\?"),
    ("manager-misspelled-option", lambda: CheckpointEngineManager("nixl", None, topolgy="tree"), WeightbusError,
     "backend 'nixl' takes no option 'topolgy'; did you mean 'topology'"),
    ("option-of-another-backend", lambda: CheckpointEngineRegistry.new("gloo", replica_size=2), WeightbusError,
     "backend 'gloo' takes no option 'replica_size'; its options: bucket_size"),
    ("role", lambda: _engine(role="server"), WeightbusError, "role must be 'trainer' or 'rollout'"),
    ("device", lambda: _engine(device="gpu0"), WeightbusError, "device='gpu0' is not a device"),
    ("nccl-on-cpu", lambda: CheckpointEngineRegistry.new("nccl", device="cpu"), WeightbusError, "needs a CUDA device"),
    ("bucket-larger-than-memory", lambda: CollectiveEngine(bucket_size=1 << 50)._allocate(), WeightbusError,
     "cannot allocate a .* MiB bucket on cpu"),
    # --- topology and agreement
    ("zero-rollouts", lambda: CollectiveEngine.build_topology(1, 0, [{}]), WeightbusError, "at least one trainer and one rollout"),
    ("zero-trainers", lambda: CollectiveEngine.build_topology(0, 1, [{}]), WeightbusError, "at least one trainer and one rollout"),
    ("metadata-count", lambda: CollectiveEngine.build_topology(1, 2, [{"port": 1}]), WeightbusError, "metadata has 1 entries"),
    ("metadata-out-of-order", lambda: CollectiveEngine.build_topology(1, 1, [{"addr": "x"}, {"port": 1, "addr": "y"}]),
     WeightbusError, "metadata\\[0\\] must come from trainer rank 0"),
    ("nccl-cumem-differs", lambda: CollectiveEngine.build_topology(1, 2, [
        {"port": 1, "addr": "x", "token": "t", "nccl_cumem": "1"}, {"addr": "y", "nccl_cumem": "0"},
        {"addr": "z", "nccl_cumem": "0"}]), WeightbusError, "'1' on rank 0; '0' on ranks 1, 2"),
    ("colocated-metadata-out-of-order", lambda: ColocatedEngine.build_topology(1, 1, [{"host": "h"}, {"slots": []}]),
     WeightbusError, "metadata\\[0\\] must come from trainer rank 0"),
    ("ranks-disagree-bucket", lambda: agree_buffers(1, [_meta(1 << 20), _meta(2 << 20)]), WeightbusError,
     "disagree on bucket_size: trainer rank 0 has 1048576, rollout rank 0 has 2097152"),
    ("ranks-disagree-buffers", lambda: agree_buffers(1, [_meta(num_buffers=2), _meta(num_buffers=3)]), WeightbusError,
     "disagree on num_buffers"),
    ("ranks-disagree-alignment", lambda: agree_buffers(1, [_meta(), _meta(alignment=128)]), WeightbusError,
     "alignment.*same weightbus version"),
    ("ranks-disagree-delta", lambda: agree_buffers(1, [_meta() | {"delta": True}, _meta() | {"delta": False}]),
     WeightbusError, "disagree on delta: trainer rank 0 has True, rollout rank 0 has False; give every rank the same"),
    ("colocated-disagree-buffers", lambda: ColocatedEngine.build_topology(
        1, 1, [{"slots": [], "host": "h", **_meta(num_buffers=2)}, {"host": "h", **_meta(num_buffers=3)}]),
     WeightbusError, "disagree on num_buffers: trainer rank 0 has 2, rollout rank 0 has 3"),
    ("verify-every-negative", lambda: _engine(delta=True, verify_every=-1), WeightbusError,
     "verify_every must be >= 0, got -1 \\(delta updates between checks; 0: never check\\)"),
    ("verify-every-float", lambda: _engine(delta=True, verify_every=0.5), WeightbusError,
     "verify_every must be an int, got 0.5"),
    # --- manifests, names and tensors
    ("empty-model", lambda: BucketPlan(Manifest([]), 1 << 20), WeightbusError, "empty weight stream"),
    ("empty-name", lambda: Manifest.from_tensors([("", torch.ones(1))]), WeightbusError, "non-empty strings, got ''"),
    ("non-string-name", lambda: Manifest.from_tensors([(7, torch.ones(1))]), WeightbusError, "non-empty strings, got 7"),
    ("none-name", lambda: Manifest.from_tensors([(None, torch.ones(1))]), WeightbusError, "non-empty strings, got None"),
    ("duplicate-name", lambda: Manifest.from_tensors([("a", torch.ones(1)), ("a", torch.ones(1))]), WeightbusError,
     "duplicate tensor name 'a'"),
    ("negative-dim", lambda: Manifest([TensorMeta("a", torch.float32, (-1, 2))]), WeightbusError, "negative dimension"),
    ("not-a-tensor", lambda: Manifest.from_tensors([("a", [1.0, 2.0])]), WeightbusError, "'a' is a list, not a tensor"),
    ("sparse-stream", lambda: Manifest.from_tensors([("a", _sparse())]), WeightbusError, "sparse_coo.*to_dense"),
    ("sparse-source", lambda: _source({"a": _sparse()}), WeightbusError, "sparse_coo"),
    ("sparse-csr", lambda: _source({"a": torch.eye(3).to_sparse_csr()}), WeightbusError, "sparse_csr"),
    ("quantized-stream", lambda: Manifest.from_tensors([("q", _quantized())]), WeightbusError, "quantized.*int_repr"),
    ("quantized-source", lambda: _source({"q": _quantized()}), WeightbusError, "quantized"),
    ("quantized-meta", lambda: Manifest([TensorMeta("q", torch.qint8, (2,))]), WeightbusError, "quantized dtype"),
    ("fp8-writer-count", lambda: _fp8_writer(torch.empty(256, 130, dtype=_F8)), WeightbusError,
     r"1 destinations for 3 tensors"),
    ("fp8-writer-payload-dtype", lambda: _fp8_writer(torch.empty(256, 130, dtype=torch.bfloat16),
                                                     torch.empty(2, 2), torch.empty(3)), WeightbusError,
     r"the destination of 'w' float8_e4m3fn\[256, 130\] is bfloat16\[256, 130\]"),
    ("fp8-writer-scale-shape", lambda: _fp8_writer(torch.empty(256, 130, dtype=_F8), torch.empty(2, 1),
                                                   torch.empty(3, dtype=torch.bfloat16)), WeightbusError,
     r"the destination of 'w_scale_inv' float32\[2, 2\] is float32\[2, 1\]"),
    ("fp8-writer-not-a-tensor", lambda: _fp8_writer(torch.empty(256, 130, dtype=_F8), torch.empty(2, 2), None),
     WeightbusError, r"the destination of 'b' bfloat16\[3\] is NoneType"),
    ("source-non-tensor", lambda: _source({"a": torch.ones(1), "step": 3}), WeightbusError, "'step' is of type int"),
    ("source-name-map-non-str", lambda: ModuleSource({"a": torch.ones(1)}, name_map=lambda n: 3), WeightbusError,
     "must return the rollout's name"),
    ("send-a-dict", lambda: asyncio.run(_local().send_weights({"a": torch.ones(1)})), WeightbusError,
     "ModuleSource"),
    ("send-a-tensor", lambda: asyncio.run(_local().send_weights(torch.ones(3))), WeightbusError,
     "must be a source"),
    ("send-bad-pairs", lambda: asyncio.run(_local().send_weights([("a", 1.0)])), WeightbusError,
     "must yield \\(name, tensor\\) pairs"),
    ("version-negative", lambda: asyncio.run(_engine_ready().send_weights([("a", torch.ones(1))], version=-1)),
     WeightbusError, "version must be in \\[0, 9223372036854775807\\], got -1"),
    ("version-2-63", lambda: asyncio.run(_engine_ready().send_weights([("a", torch.ones(1))], version=1 << 63)),
     WeightbusError, "version must be in"),
    ("version-str", lambda: asyncio.run(_engine_ready().send_weights([("a", torch.ones(1))], version="3")),
     WeightbusError, "version must be an int"),
    # --- lifecycle misuse (one process)
    ("send-before-init", lambda: asyncio.run(_engine(role="trainer").send_weights([("a", torch.ones(1))])),
     WeightbusError, "no group; call prepare\\(\\) and init_process_group\\(\\) first"),
    ("receive-before-init", lambda: _drain(_engine(role="rollout")), WeightbusError, "no group"),
    ("colocated-receive-before-init", lambda: _drain(ColocatedEngine(role="rollout", timeout=30)), WeightbusError,
     r"no group: call prepare\(\) and init_process_group\(\) first"),
    ("colocated-send-before-init", lambda: asyncio.run(ColocatedEngine(role="trainer", timeout=30).send_weights(
        [("a", torch.ones(1))])), WeightbusError, "no group: call prepare"),
    ("receive-on-trainer", lambda: _drain(_engine_ready()), WeightbusError, "only a rollout rank may call receive"),
    # --- sinks
    ("sink-shape", lambda: ModuleSink({"a": torch.zeros(2)}).load_iter([("a", torch.zeros(3))]), WeightbusError,
     "mismatched: a \\(got \\[3\\], model has \\[2\\]\\)"),
    ("sink-dtype", lambda: ModuleSink({"a": torch.zeros(2)}).load_iter([("a", torch.zeros(2, dtype=torch.bfloat16))]),
     WeightbusError, "allow_cast=True"),
    ("sink-missing", lambda: ModuleSink({"a": torch.zeros(2), "b": torch.zeros(1)}).load_iter([("a", torch.zeros(2))]),
     WeightbusError, "missing: b"),
    ("sink-unexpected", lambda: ModuleSink({"a": torch.zeros(2)}).load_iter([("a", torch.zeros(2)), ("z", torch.zeros(1))]),
     WeightbusError, "unexpected: z"),
    # --- sharded receive: placements checked where given (the rest when the plan is made)
    ("shard-dest-shape", lambda: _engine(role="rollout").set_shard_destinations({"w": [(Box.rows((8, 4), 0, 4), torch.zeros(3, 4))]}),
     WeightbusError, r"destination of 'w'\[0:4, 0:4\] has shape \(3, 4\), not the region's \(4, 4\)"),
    ("shard-dest-not-a-box", lambda: _engine(role="rollout").set_shard_destinations({"w": [((0, 4), torch.zeros(4))]}),
     WeightbusError, "placements of 'w' must be \\(Box, tensor\\) pairs"),
    ("shard-dest-on-trainer", lambda: _engine(role="trainer").set_shard_destinations({}),
     WeightbusError, "only a rollout rank states shard destinations"),
    ("shard-dest-with-delta", lambda: _engine(role="rollout", delta=True).set_shard_destinations(_Loaders()),
     WeightbusError, "delta=True writes each change in place: sharded receive then needs destinations that "
                     "are views .* _Loaders places each region itself"),
    ("shard-overlap", lambda: ShardPlan(Manifest([TensorMeta("w", torch.float32, (8, 4))]),
                                        [ShardLayout({"w": [Box.rows((8, 4), 0, 5), Box.rows((8, 4), 4, 8)]})], 1024, 1),
     WeightbusError, "rollout rank 0, tensor 'w': regions \\[0:5, 0:4\\] and \\[4:8, 0:4\\] overlap"),
    ("shard-outside", lambda: ShardPlan(Manifest([TensorMeta("w", torch.float32, (8, 4))]),
                                        [None, ShardLayout({"w": [Box((0, 2), (8, 4))]})], 1024, 1),
     WeightbusError, "rollout rank 1, tensor 'w': region \\[0:8, 2:6\\] does not fit a tensor of shape \\(8, 4\\)"),
    ("tp-placement-shape", lambda: tp_placements({"w": torch.zeros(5, 4)}, 1, 2, split={"w": (0, (8, 4))}),
     WeightbusError, r"'w' has shape \(5, 4\), but rank 1 of 2 keeps \[4:8, 0:4\]"),
    # --- relay of shards between replicas (collective engines only)
    ("relay-negative", lambda: _engine(relay=-1), WeightbusError, r"relay must be an int >= 0 .*got -1"),
    ("relay-float", lambda: _engine(relay=1.5), WeightbusError, "relay must be an int >= 0"),
    ("relay-bool", lambda: _engine(relay=True), WeightbusError, "relay must be an int >= 0"),
    ("relay-on-shm", lambda: CheckpointEngineRegistry.new("shm", relay=1), WeightbusError,
     "backend 'shm' takes no option 'relay'"),
    ("relay-plan-negative", lambda: ShardPlan(Manifest([TensorMeta("w", torch.float32, (8, 4))]), [None], 1024, 1,
                                              relay=-1), WeightbusError, "relay must be >= 0"),
    ("relay-disagreed", lambda: CollectiveEngine.build_topology(1, 1, [
        {"addr": "h", "port": 1, "token": "t", "bucket_size": 4096, "relay": 2},
        {"addr": "h", "bucket_size": 4096, "relay": 0}]), WeightbusError,
     r"different relay values \(relay=2 on rank\(s\) 0; relay=0 on rank\(s\) 1\)"),
    # --- the SGLang replica (checked where it is given: no SGLang needed)
    ("sglang-not-an-engine", lambda: _sglang_replica(None), WeightbusError, "expected an sglang.Engine.*NoneType"),
    ("sglang-no-hook", lambda: _sglang_replica(_sglang_engine(custom_weight_loader=[])), WeightbusError,
     "custom_weight_loader does not list.*engine_args"),
    ("sglang-pp2", lambda: _sglang_replica(_sglang_engine(pp_size=2)), WeightbusError,
     "pipeline or data parallelism.*pp_size 2"),
    ("sglang-dp2", lambda: _sglang_replica(_sglang_engine(dp_size=2)), WeightbusError, "dp_size 2.*one replica per"),
    ("sglang-pause-mode", lambda: _sglang_replica(_sglang_engine(), mode="stop"), WeightbusError,
     "pause mode must be one of.*'stop'"),
    ("sglang-sharded-str", lambda: _sglang_replica(_sglang_engine(), sharded="yes"), WeightbusError,
     "sharded must be True, False or None, got 'yes'"),
    ("sglang-loader-not-names", lambda: _sglang_engine_args(custom_weight_loader=[print]), WeightbusError,
     "custom_weight_loader must be a list of dotted function names"),
]


class _Ready(CollectiveEngine):
    """An engine that believes it has a group, for checks that fire before any message."""

    def __init__(self) -> None:
        super().__init__(role="trainer")
        self._ctl = object()


def _local() -> ColocatedEngine:
    """The in-process pass-through: the stream is read at once, in the caller."""
    engine = ColocatedEngine()
    engine.init_process_group()
    return engine


def _engine_ready() -> CollectiveEngine:
    return _Ready()


def _drain(engine):
    async def go():
        async for _ in engine.receive_weights():
            pass
    asyncio.run(go())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_error(case):
    _, call, err, pattern = case
    with pytest.raises(err, match=pattern):
        call()


def test_enough_bad_inputs():
    assert len(CASES) + len(STREAM_CASES) + len(LEGAL) >= 60


# --- legal inputs that look odd: handled correctly (round trip through real buckets)

def _round_trip(named, **source_kw):
    from weightbus.packing import buffers
    source = ModuleSource(named, **source_kw)
    plan = BucketPlan(source.manifest, 4096, 1)
    packer, slots = buffers.Packer(plan), [torch.zeros(4096, dtype=torch.uint8) for _ in range(2)]
    asm = buffers.Assembler(plan, torch.device("cpu"))
    held = source.plain_tensors()
    got = {}
    for b in plan.buckets:
        packer.pack_held(slots[b.index % 2], b, held)
        for n, t in asm.unpack(slots[b.index % 2], b):
            got[n] = t.clone()
    return source, got


def _same_bits(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


LEGAL = {
    "complex": {"c": torch.randn(5, 3, dtype=torch.complex64)},
    "fp8-keeps-its-dtype": {"f8": torch.randn(40, 7).to(torch.float8_e4m3fn), "w": torch.randn(3)},
    "storage-offset-view": {"v": torch.arange(100.0)[37:81], "row": torch.randn(9, 8)[3]},
    "non-contiguous": {"t": torch.randn(30, 20).t(), "s": torch.randn(10, 10)[:, ::3]},
    "zero-size-and-scalar": {"e": torch.empty(0, 5), "s": torch.tensor(3.5), "b": torch.rand(33) > 0.5},
    "larger-than-a-bucket": {"big": torch.randn(5000), "small": torch.ones(2)},
}


@pytest.mark.parametrize("name", list(LEGAL))
def test_odd_but_legal_inputs_round_trip(name):
    named = LEGAL[name]
    source, got = _round_trip(named, dtype=torch.bfloat16)
    assert list(got) == list(named)
    for n, t in named.items():
        want = t.to(source.wire_dtype(t))
        assert _same_bits(got[n], want), n
    if name == "fp8-keeps-its-dtype":
        assert got["f8"].dtype == torch.float8_e4m3fn and got["w"].dtype == torch.bfloat16


# --- the environment is read when an engine is made, not at import

def test_bad_env_timeout_fails_at_engine_not_import():
    code = ("import weightbus\n"
            "try:\n"
            "    weightbus.CheckpointEngineRegistry.new('gloo')\n"
            "except weightbus.WeightbusError as e:\n"
            "    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "WEIGHTBUS_TIMEOUT": "abc"})
    assert out.returncode == 0, out.stderr
    assert "ERR WEIGHTBUS_TIMEOUT='abc' is not a number" in out.stdout


def test_env_timeout_applies_when_given(monkeypatch):
    monkeypatch.setenv("WEIGHTBUS_TIMEOUT", "7.5")
    assert _engine().timeout == 7.5
    monkeypatch.setenv("WEIGHTBUS_TIMEOUT", "-3")
    with pytest.raises(WeightbusError, match="WEIGHTBUS_TIMEOUT='-3'"):
        _engine()


# --- cases that need a formed group: one run of real processes

STREAM_CASES = ["port-in-use", "silent-store", "init-twice", "finalize-twice-then-reuse",
                "two-updates-at-once", "more-trainers-than-buckets", "manifest-changes-shape",
                "shm-bucket-larger-than-dev-shm"]


def test_port_in_use_and_silent_store_fail_fast(port):
    import socket
    import time
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(8)  # accepts connections, never answers: not a store
    busy = blocker.getsockname()[1]
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightbusError, match="did not answer within 2s.*another program"):
            join(_engine(timeout=2), rank=1, trainer_world_size=1, rollout_world_size=1,
                 master_addr="127.0.0.1", master_port=busy)
        assert time.monotonic() - t0 < 2 + 3
        with pytest.raises(WeightbusError, match=f"cannot serve the rendezvous store on port {busy}.*in use"):
            join(_engine(timeout=2), rank=0, trainer_world_size=1, rollout_world_size=1,
                 master_addr="127.0.0.1", master_port=busy)
    finally:
        blocker.close()


def test_group_misuse_cases(port):
    logs = spawn(workers.group_misuse, 3, (port,), timeout=240)
    trainer, _, rollout = logs
    for log in logs:
        for case in ("init-twice", "more-trainers-than-buckets", "finalize-twice-then-reuse", "after"):
            assert log[case] == "ok", (case, log)
    assert "send_weights started while another send_weights is still under way" in trainer["two-updates-at-once"]
    assert "receive_weights started while another receive_weights" in rollout["two-updates-at-once"]
    # a manifest that changes shape between updates: the sink names the tensor
    assert "mismatched: proj.weight (got [38, 48], model has [37, 48])" in rollout["manifest-changes-shape"]


def test_shm_bucket_larger_than_dev_shm():
    from weightbus.packing import buffers
    room = buffers.shm_room()
    if room is None:
        pytest.skip("no /dev/shm")
    with pytest.raises(WeightbusError, match="does not fit: /dev/shm has"):
        buffers.SharedBuffer(room + (1 << 40))


def test_backend_without_its_extra_says_which_to_install(monkeypatch):
    for mod in ("nixl", "nixl._api", "nixl_cu12", "nixl_cu12._api", "nixl_cu13", "nixl_cu13._api"):
        monkeypatch.setitem(sys.modules, mod, None)  # as if not installed
    with pytest.raises(WeightbusError, match=r"backend 'nixl' needs NIXL: pip install 'weightbus\[nixl\]'"):
        CheckpointEngineRegistry.new("nixl")
    assert "nixl" in CheckpointEngineRegistry.names()  # registered all the same
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(WeightbusError, match=r"backend 'mooncake' needs the Mooncake transfer engine: "
                                             r"pip install 'weightbus\[mooncake\]'"):
        CheckpointEngineRegistry.new("mooncake")
    assert "mooncake" in CheckpointEngineRegistry.names()


def test_no_module_with_no_weights():
    with pytest.raises(WeightbusError, match="empty weight stream"):
        BucketPlan(ModuleSource(nn.Module()).manifest, 1 << 20)


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="mooncake not installed")
@pytest.mark.parametrize("kwargs,match", [
    ({"replica_size": 0}, "replica_size"),
    ({"replica_size": "2"}, "replica_size"),
    ({"protocol": "udp"}, "protocol must be 'tcp' or 'rdma'"),
    ({"device": "cuda:0"}, "moves host memory"),
])
def test_mooncake_options_checked_where_given(kwargs, match):
    with pytest.raises(WeightbusError, match=match):
        CheckpointEngineRegistry.new("mooncake", role="rollout", **kwargs)


def test_mooncake_replicas_must_split_the_rollout_ranks():
    from weightbus.engines.mooncake import MooncakeEngine

    def meta(k=1, trainer=False):
        m = {"addr": "127.0.0.1", "device": "cpu", "bucket_size": 1 << 20, "num_buffers": 2, "alignment": 256,
             "session": "127.0.0.1:1", "slots": [0, 0], "replica_size": k}
        return m | ({"port": 1, "token": "t"} if trainer else {})
    with pytest.raises(WeightbusError, match="3 rollout ranks do not split into replicas of 2"):
        MooncakeEngine.build_topology(1, 3, [meta(trainer=True), meta(2), meta(2), meta(2)])
    with pytest.raises(WeightbusError, match=r"disagree on replica_size: \[1, 2\]"):
        MooncakeEngine.build_topology(1, 2, [meta(trainer=True), meta(2), meta(1)])
    trainer, rollout = MooncakeEngine.build_topology(1, 4, [meta(trainer=True)] + [meta(2)] * 4)
    assert rollout["link"] == [("r0", 0, 2), ("r0", 1, 2), ("r1", 0, 2), ("r1", 1, 2)]  # rank 0 of each reads
    assert trainer["links"][0] == [("r0", 2), ("r1", 2)]


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl not installed")
@pytest.mark.parametrize("kwargs,match", [
    ({"topology": "ring"}, "topology must be one of"),
    ({"link_gbps": 0}, "link_gbps must be a finite number of GB/s > 0"),
    ({"link_gbps": "fast"}, "link_gbps must be a number of GB/s > 0"),
])
def test_nixl_options_checked_where_given(kwargs, match):
    with pytest.raises(WeightbusError, match=match):
        CheckpointEngineRegistry.new("nixl", role="rollout", **kwargs)


def test_nixl_topology_agreed_and_routed():
    """The ranks must agree on the topology; the routes follow the tree the rates pick."""
    from weightbus.engines.nixl import NixlEngine
    from weightbus.planning import topology

    def meta(rank, topology="auto", gbps=None):
        m = {"addr": "127.0.0.1", "device": "cpu", "bucket_size": 1 << 20, "num_buffers": 2, "alignment": 256,
             "agent": f"a{rank}", "nixl": b"", "slots": [], "topology": topology, "link_gbps": gbps}
        return m | ({"port": 1, "token": "t"} if rank == 0 else {})
    with pytest.raises(WeightbusError, match=r"disagree on topology: \['auto', 'tree'\]"):
        NixlEngine.build_topology(1, 2, [meta(0), meta(1, "tree"), meta(2)])
    trainer, rollout = NixlEngine.build_topology(1, 3, [meta(0)] + [meta(r) for r in range(1, 4)])
    assert trainer["links"][0] == [("r0", 1), ("r1", 1), ("r2", 1)] and rollout["link"][2] == ("r2", 0, 1)
    # a trainer link 4x a rollout's, 1 trainer, 6 rollouts: 4 heads, then chains
    fan = topology.choose(1, 6, sender_gbps=100, receiver_gbps=25)
    heads, routes = NixlEngine.routes(["t0"], [f"r{x}" for x in range(6)], fan)
    assert fan == topology.Fanout(4, 1) and heads == [["r0", "r1", "r2", "r3"]]
    assert routes[0] == {0: ("t0", ["r4"])} and routes[4] == {0: ("r0", [])}
    # two trainers, a ring: tree 1 starts at the second rollout; every rollout has one upstream
    heads, routes = NixlEngine.routes(["t0", "t1"], ["a", "b", "c"], topology.Fanout(1, 1))
    assert heads == [["a"], ["b"]]
    assert routes[2] == {0: ("b", []), 1: ("b", ["a"])} and routes[0] == {0: ("t0", ["b"]), 1: ("c", [])}


@pytest.mark.parametrize("backend,kwargs,match", [
    ("gloo", {"delta": "yes"}, "delta must be True or False"),
    ("colocated", {"delta": True}, "delta=True is not supported by backend ColocatedEngine"),
])
def test_delta_option_checked_where_given(backend, kwargs, match):
    with pytest.raises(WeightbusError, match=match):
        CheckpointEngineRegistry.new(backend, role="rollout", **kwargs)


def test_bench_delta_arguments_checked():
    from weightbus.tools.bench import BenchConfig
    with pytest.raises(ValueError, match=r"delta must be a fraction of elements in \(0, 1\]"):
        BenchConfig(delta=2.0, gpu=False)
    with pytest.raises(ValueError, match="delta= applies to the disaggregated scenario"):
        BenchConfig(scenario="colocated", delta=0.02, gpu=False)


@pytest.mark.parametrize("case,match", [
    ("num_buffers", "disagree on num_buffers: trainer rank 0 has 2, rollout rank 0 has 3"),
    ("delta", "disagree on delta: trainer rank 0 has True, rollout rank 0 has False"),
])
def test_misconfigured_peers_fail_as_the_group_forms(port, case, match):
    """Not at the deadline (30 s) of the first update: every rank, at once, naming both."""
    for out in spawn(workers.colocated_misconfigured, 2, (port, case), timeout=120):
        assert match in out["error"], out
        assert out["seconds"] < 10, out
