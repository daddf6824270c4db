"""weightbus's backends inside verl's own checkpoint-engine manager (issue 36).

verl 0.9.1's ``CheckpointEngineManager`` drives them as a verl user's config names them
(``custom_backend_module: weightbus.integrations.verl``, ``backend: weightbus.<name>``):
verl's ``TrainingWorker`` with its FSDP2 engine (gloo, CPU) as the trainers, verl's
``CheckpointEngineWorker`` as the rollout ranks (a Hugging Face model as the server
adapter), Ray actors placed by verl's resource pools. Each test runs several updates with
weights that change between them and compares what every rollout rank holds with what the
trainer exports, bitwise; elastic scaling goes through the manager's own
``add_replicas`` / ``remove_replicas``.

Runs in the verl venv (``make test-verl``); skipped where verl is not installed.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import pytest
import torch

# verl 0.9.1 has no CPU platform: the tests' own, through verl's plugin hook, in this
# process and in every Ray worker (see verl_cpu_platform.py)
# (and the FSDP engine, which verl registers for cuda and npu only, picked by its override)
CPU_PLATFORM = {"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "verl_cpu_platform",
                "VERL_ENGINE_DEVICE": "cuda"}
os.environ.update(CPU_PLATFORM)
sys.path.insert(0, os.path.dirname(__file__))
pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed (make test-verl)")
ray = pytest.importorskip("ray")

from verl.checkpoint_engine import CheckpointEngineManager  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from verl.single_controller.ray.base import split_resource_pool  # noqa: E402
from verl.workers.config import (  # noqa: E402
    CheckpointEngineConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    RolloutConfig,
)
from verl.workers.engine_workers import TrainingWorkerConfig  # noqa: E402

pytestmark = pytest.mark.timeout(600)

PLUGIN = "weightbus.integrations.verl"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One Ray cluster and one Hugging Face model for the module."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    path = tmp_path_factory.mktemp("verl-model")
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    env = {"env_vars": {**CPU_PLATFORM, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                        "RAY_DEDUP_LOGS": "0", "PYTHONPATH": os.pathsep.join(
                            [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}}
    ray.init(num_cpus=16, include_dashboard=False, runtime_env=env, log_to_driver=True)
    yield str(path)
    ray.shutdown()


def _configs(path: str, backend: str, engine_kwargs: dict | None = None):
    ce = CheckpointEngineConfig(backend=backend, update_weights_bucket_megabytes=1,
                                engine_kwargs={backend: engine_kwargs or {}},
                                custom_backend_module=PLUGIN)
    model = HFModelConfig(path=path, load_tokenizer=False, override_config={"attn_implementation": "sdpa"})
    rollout = RolloutConfig(name="vllm", tensor_model_parallel_size=1, checkpoint_engine=ce)
    return ce, model, rollout


class Cluster:
    """The worker groups and placement groups a test made (removed at its end: the next
    test needs the CPUs back)."""

    def __init__(self) -> None:
        self.groups: list = []
        self.pools: list = []
        self.paths: list[str] = []

    def pools_of(self, *sizes: int) -> list:
        pool = RayResourcePool(process_on_nodes=[sum(sizes)], use_gpu=False, max_colocate_count=1)
        self.pools.append(pool)
        return split_resource_pool(pool, list(sizes)) if len(sizes) > 1 else [pool]

    def trainers(self, pool, model_config, ce_config):
        import verl_workers
        engine = FSDPEngineConfig(forward_only=False, fsdp_size=pool.world_size, strategy="fsdp2")
        optim = FSDPOptimizerConfig(lr=1e-4, total_training_steps=10)
        config = TrainingWorkerConfig(model_type="language_model", model_config=model_config,
                                      engine_config=engine, optimizer_config=optim)
        for attempt in (1, 2):
            wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
                cls=ray.remote(verl_workers.Trainer), config=config, checkpoint_engine_config=ce_config),
                device_name="cpu")
            self.groups.append(wg)
            try:
                wg.reset()
                return wg
            except ray.exceptions.ActorDiedError as e:
                # verl picks its trainers' master port free, and their rank 0 binds it later:
                # another job on a loaded CI host took it in between once (EADDRINUSE); the
                # set-up is made once more with a new port, anything else fails the test
                if attempt == 2 or "EADDRINUSE" not in str(e):
                    raise
                for w in wg.workers:
                    ray.kill(w)
        raise AssertionError("unreachable")

    def rollouts(self, pool, model_config, rollout_config, first_replica: int = 0, cls=None):
        import verl_workers
        wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(cls or verl_workers.Rollout), rollout_config=rollout_config,
            model_config=model_config), device_name="cpu")
        self.groups.append(wg)
        return wg, replicas_of(wg, model_config, rollout_config, first_replica)

    def close(self) -> None:
        for wg in self.groups:
            for w in wg.workers:
                ray.kill(w)
        for pool in self.pools:
            for pg in pool.pgs or []:
                ray.util.remove_placement_group(pg)
        for path in self.paths:
            shutil.rmtree(path, ignore_errors=True)


def replicas_of(wg, model_config, rollout_config, first_replica: int = 0) -> list:
    """verl's replicas over the rollout ranks of ``wg``, in order, of the config's TP size."""
    import verl_workers
    per = rollout_config.tensor_model_parallel_size
    replicas = []
    for i in range(wg.world_size // per):
        replica = verl_workers.Replica(replica_rank=first_replica + i, config=rollout_config,
                                       model_config=model_config)
        replica.workers = wg.workers[per * i: per * (i + 1)]
        replicas.append(replica)
    return replicas


@pytest.fixture
def verl(cluster):
    made = Cluster()
    yield made
    made.close()


@pytest.fixture(scope="module")
def kept(cluster):
    """2 FSDP2 trainers and 2 rollout ranks kept for the module: their start was most of a
    test's time (~40 s of this 2-core host's CPU), and each test builds the checkpoint engines
    it needs on them, as verl builds them (:func:`on_kept`)."""
    made = Cluster()
    ce, model, rollout = _configs(cluster, "weightbus.gloo")
    trainer_pool, rollout_pool = made.pools_of(2, 2)
    made.actor_wg = made.trainers(trainer_pool, model, ce)
    made.rollout_wg, _ = made.rollouts(rollout_pool, model, rollout)
    yield made
    made.close()


def on_kept(kept, path: str, backend: str, options: dict | None = None):
    """The kept workers with fresh checkpoint engines for ``backend``: (verl's checkpoint
    engine config, the trainers, the rollout ranks, a replica per rollout rank), the rollout
    ranks having received nothing yet."""
    ce, model, rollout = _configs(path, backend, options)
    kept.actor_wg.use_engine(ce)
    kept.rollout_wg.use_engine(rollout)
    return ce, kept.actor_wg, kept.rollout_wg, replicas_of(kept.rollout_wg, model, rollout)


def _tokens(actor_wg, *rollout_wgs, ranks: list[int] | None = None) -> str | None:
    """The group every rank holds (the rollout groups' ``ranks``, all by default): one token
    for all, or an AssertionError."""
    held = {*actor_wg.group_token(), *(t for wg in rollout_wgs for r, t in enumerate(wg.group_token())
                                       if ranks is None or r in ranks)}
    assert len(held) == 1, f"the ranks hold different groups: {held}"
    return held.pop()


def _check(actor_wg, rollout_wgs, ranks: list[int] | None = None) -> None:
    """The rollout groups' ``ranks`` (all by default) hold the trainers' weights, bitwise."""
    want = actor_wg.digests()[0]
    for wg in rollout_wgs:
        for rank, got in enumerate(wg.digests()):
            if ranks is not None and rank not in ranks:
                continue
            bad = [n for n in want if got.get(n) != want[n]]
            assert not bad and set(got) == set(want), f"rollout rank {rank}: {bad[:3]} differ"


# (bf16 on the wire from the fp32 FSDP trainers: the nixl case here, gloo in
# test_verl_own_rollout_check, where verl's own harness checks what arrived)
@pytest.mark.parametrize("backend, options, trainers, rollouts", [
    ("weightbus.gloo", {}, 2, 2),
    ("weightbus.colocated", {}, 2, 2),
    ("weightbus.shm", {"cache_name": f"verl-test-{os.getpid()}"}, 1, 2),
    ("weightbus.nixl", {"wire_dtype": "bfloat16"}, 2, 2),
], ids=["gloo", "colocated", "shm", "nixl"])
def test_verl_manager_updates_bitwise(cluster, verl, request, backend, options, trainers, rollouts):
    """verl's manager, verl's FSDP2 trainers and verl's rollout workers over a weightbus
    backend: three steps that each move every weight, bitwise on every rollout rank, the
    step reaching the rollout as the update's version, and verl's metrics dict back."""
    if backend == "weightbus.nixl":
        pytest.importorskip("nixl._api", reason="nixl is not installed (make test-verl installs it)")
    if (trainers, rollouts) == (2, 2):  # (the workers kept for the module, engines of their own)
        kept = request.getfixturevalue("kept")
        ce, actor_wg, rollout_wg, replicas = on_kept(kept, cluster, backend, options)
    else:
        if "cache_name" in options:  # (the cache's directory goes with the test's workers)
            verl.paths.append(f"/dev/shm/wbcache_{options['cache_name']}")
        ce, model, rollout = _configs(cluster, backend, options)
        trainer_pool, rollout_pool = verl.pools_of(trainers, rollouts)
        actor_wg = verl.trainers(trainer_pool, model, ce)
        rollout_wg, replicas = verl.rollouts(rollout_pool, model, rollout)
    manager = CheckpointEngineManager(config=ce, actor_wg=actor_wg, replicas=replicas)
    sizes, tokens = [], []
    for step in range(3):
        actor_wg.step(step)
        metrics = manager.update_weights(global_steps=step + 1)
        _check(actor_wg, [rollout_wg])
        assert metrics["weightbus/version"] == step + 1, metrics
        sizes.append(metrics["weightbus/bytes"])
        tokens.append(_tokens(actor_wg, rollout_wg))
    if backend in ("weightbus.gloo", "weightbus.nccl"):
        # (verl's manager forms the group before every update: the collective engines keep
        # the one they formed first, every rank in the same one)
        assert tokens[0] is not None and tokens == [tokens[0]] * 3, tokens
    assert rollout_wg.steps_received() == [[1, 2, 3]] * rollouts
    assert rollout_wg.engine_version() == [3] * rollouts
    params = actor_wg.numel()[0]
    per = 2 if options.get("wire_dtype") == "bfloat16" else 4  # (the FSDP trainer holds fp32)
    assert sizes == [params * per] * 3


def test_verl_elastic_replicas_join_and_leave(cluster, kept):
    """Replicas added and removed through verl's own manager (add_replicas /
    remove_replicas): the next update forms the group anew, and whoever is in it then
    holds the trainer's weights bitwise; a removed replica keeps its last version. (The
    kept rollout ranks are two replicas of one rank each: rank 0 serves from the start,
    rank 1 joins at the second update, rank 0 leaves before the third.)"""
    ce, actor_wg, rollout_wg, (first, second) = on_kept(kept, cluster, "weightbus.gloo")
    manager = CheckpointEngineManager(config=ce, actor_wg=actor_wg, replicas=[first])
    actor_wg.step(0)
    manager.update_weights(global_steps=1)
    _check(actor_wg, [rollout_wg], ranks=[0])
    formed = [_tokens(actor_wg, rollout_wg, ranks=[0])]

    manager.add_replicas([second])
    actor_wg.step(1)
    manager.update_weights(global_steps=2)
    _check(actor_wg, [rollout_wg])
    formed.append(_tokens(actor_wg, rollout_wg))

    manager.remove_replicas([first])
    actor_wg.step(2)
    manager.update_weights(global_steps=3)
    _check(actor_wg, [rollout_wg], ranks=[1])
    formed.append(_tokens(actor_wg, rollout_wg, ranks=[1]))
    # (each membership formed its own group: nobody kept one the others had left)
    assert len(set(formed)) == 3, formed
    assert rollout_wg.engine_version() == [2, 3]
    assert rollout_wg.steps_received() == [[1, 2], [2, 3]]


def test_verl_refused_update_fails_everywhere_then_the_next_one_lands(cluster, kept):
    """A rollout that gives up half way through an update (its server adapter raises):
    the update fails on every rank at once (not at the engine's deadline), verl's manager
    raises an error that says which rollout gave up, and the next update through the same
    manager and workers lands bitwise.

    Which error verl's manager raises is a race it decides (one ``ray.get`` over the
    trainers' and the rollouts' calls raises the first error to arrive): the rollout's
    own, or the trainers' failed update, which names the rank whose adapter stopped."""
    ce, actor_wg, rollout_wg, replicas = on_kept(kept, cluster, "weightbus.gloo", {"timeout": 30})
    manager = CheckpointEngineManager(config=ce, actor_wg=actor_wg, replicas=replicas)
    manager.update_weights(global_steps=1)
    ray.get(replicas[1].workers[0].refuse.remote(2))
    actor_wg.step(1)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="refuses step 2|rollout rank 3: the rollout's server adapter "
                                        "stopped reading the update before its end"):
        manager.update_weights(global_steps=2)
    assert time.monotonic() - t0 < 15  # (the deadline is 30 s)
    manager.update_weights(global_steps=3)
    _check(actor_wg, [rollout_wg])
    # (the update failed on every rank: no replica took step 2 as complete)
    assert rollout_wg.steps_received() == [[1, 3], [1, 3]]
    assert rollout_wg.engine_version() == [3, 3]


def test_verl_own_rollout_check(cluster, verl):
    """verl's own test harness on the rollout side (tests/checkpoint_engine/test_utils.py
    from verl's wheel: CheckpointEngineWorkerTest and its MockServerAdapter, which checks
    what it received against the Hugging Face checkpoint), fed by a weightbus backend."""
    test_utils = pytest.importorskip("tests.checkpoint_engine.test_utils",
                                     reason="verl's wheel ships its tests as the `tests` package")
    ce, model, rollout = _configs(cluster, "weightbus.gloo", {"wire_dtype": "bfloat16"})
    trainer_pool, rollout_pool = verl.pools_of(2, 2)
    actor_wg = verl.trainers(trainer_pool, model, ce)  # (weights as loaded: the checkpoint's)
    rollout_wg, replicas = verl.rollouts(rollout_pool, model, rollout,
                                         cls=test_utils.CheckpointEngineWorkerTest)
    manager = CheckpointEngineManager(config=ce, actor_wg=actor_wg, replicas=replicas)
    for step in range(2):
        manager.update_weights(global_steps=step)
        rollout_wg.check_weights()


def test_verl_bad_options_fail_where_verl_builds_the_engine():
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import weightbus.integrations.verl  # noqa: F401
    from weightbus.errors import ConfigError
    with pytest.raises(ConfigError, match="takes no option 'bucket_sise'; did you mean 'bucket_size'"):
        CheckpointEngineRegistry.new("weightbus.gloo", bucket_size=1 << 20, is_master=True, bucket_sise=1)
    with pytest.raises(ConfigError, match="wire_dtype='int8' is not a floating-point torch dtype"):
        CheckpointEngineRegistry.new("weightbus.gloo", bucket_size=1 << 20, wire_dtype="int8")
    with pytest.raises(ConfigError, match="delta=True writes each change in place"):
        CheckpointEngineRegistry.new("weightbus.gloo", bucket_size=1 << 20, delta=True)
    with pytest.raises(ValueError, match=r"weightbus\.gloo"):  # (verl's own message lists ours)
        CheckpointEngineRegistry.new("weightbus.glo", bucket_size=1 << 20)
