"""Cache engines (``shm``, ``disk``): the trainer publishes and goes on; replicas pull the
newest complete version when they are ready. Real processes, weights changed by real
steps, every pull compared bitwise with what was published."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time

import pytest
import workers_cache
from workers import Mixed

from weightbus import CheckpointEngineRegistry, ModuleSink, ModuleSource, WeightbusError


def _shm_caches(port: int) -> set[str]:
    """The shm caches of a test (their names carry its port: other tests' caches, coming
    and going beside it, are not compared)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("wbcache_") and n.endswith(str(port))}
    except FileNotFoundError:
        return set()


def _where(backend: str, tmp_path, port: int) -> str:
    return str(tmp_path / "cache") if backend == "disk" else f"test{port}"


@pytest.mark.parametrize("backend", ["shm", "disk"])
def test_readers_at_their_own_pace_get_whole_versions(backend, tmp_path, port):
    """10 versions published while 3 replicas pull at different paces: every pull is one
    complete version equal to what was published; the slow one skips versions; the
    publisher never waits for them."""
    before = _shm_caches(port)
    where = _where(backend, tmp_path, port)
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=workers_cache.publisher, args=(backend, where, 10, 0.05, done, out))]
    procs += [ctx.Process(target=workers_cache.reader, args=(backend, where, pace, 10, i, out))
              for i, pace in enumerate((0.0, 0.07, 0.4))]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(4):
            name, a, b = out.get(timeout=120)
            got[name] = (a, b)
            if len(got) == 4:
                done.set()
    finally:
        done.set()
        for p in procs:
            p.join(30)
    published, blocked = got["publisher"]
    published = {int(k): v for k, v in published.items()}
    for r in ("reader0", "reader1", "reader2"):
        seen = got[r][0]
        assert seen and seen[-1][0] == 10
        assert [v for v, _ in seen] == sorted({v for v, _ in seen})  # only newer versions
        for v, d in seen:
            assert d == published[v], (r, v)  # a whole version, bitwise, never a mix
    assert len(got["reader2"][0]) < 10  # the slow replica skipped versions
    assert max(blocked) < 5  # publishing never waited for a reader
    assert all(p.exitcode == 0 for p in procs)
    if backend == "shm":
        assert _shm_caches(port) == before  # the owner removed its cache


@pytest.mark.serial  # (any owner on the host sweeps a dead one's cache: none may start meanwhile)
@pytest.mark.parametrize("backend", ["shm", "disk"])
def test_publisher_dies_mid_publish(backend, tmp_path, port):
    """The previous version stays readable and the partial one invisible; the next owner
    removes the dead one's leftovers; nothing stays in /dev/shm."""
    before = _shm_caches(port)
    where = _where(backend, tmp_path, port)
    ctx = mp.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=workers_cache.interrupted_publisher, args=(backend, where, "die", ready, go, out))
    p.start()
    first = out.get(timeout=60)
    go.set()
    p.join(60)
    assert p.exitcode == -9
    reader = workers_cache.cache("rollout", backend, where)
    stream = reader.get_weights()
    assert stream.version == 1
    model = Mixed()
    asyncio.run(ModuleSink(model).load(stream))
    assert workers_cache.digests(model) == first
    root = reader.root
    assert any(n.startswith(".v-tmp-") for n in os.listdir(root))  # the partial write, invisible
    owner = workers_cache.cache("trainer", backend, where)
    model.step(3)
    asyncio.run(owner.send_weights(ModuleSource(model), version=3))
    assert not any(n.startswith(".v-tmp-") for n in os.listdir(root))  # swept by the next owner
    assert reader.get_weights(newer_than=1).version == 3
    owner.finalize(destroy_group=True)
    if backend == "shm":
        assert _shm_caches(port) == before


def test_reader_during_a_write_gets_the_previous_version(tmp_path, port):
    where = _where("disk", tmp_path, port)
    ctx = mp.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=workers_cache.interrupted_publisher, args=("disk", where, "pause", ready, go, out))
    p.start()
    first = out.get(timeout=60)
    go.set()
    assert ready.wait(60)  # version 2 is being written now
    reader = workers_cache.cache("rollout", "disk", where)
    model = Mixed()
    stream = reader.get_weights()
    assert stream.version == 1
    asyncio.run(ModuleSink(model).load(stream))
    assert workers_cache.digests(model) == first
    second = out.get(timeout=60)
    p.join(60)
    stream = reader.get_weights(newer_than=1)
    assert stream.version == 2
    asyncio.run(ModuleSink(model).load(stream))
    assert workers_cache.digests(model) == second


def test_killed_reader_does_not_hold_reclaiming(port):
    """A reader SIGKILLed while it holds a version: publishing goes on, old versions leave
    the directory (at most ``keep``), and its memory goes back when it dies."""
    before = _shm_caches(port)
    name = f"test{port}"
    owner = workers_cache.cache("trainer", "shm", name)
    model = Mixed()
    model.step(1)
    asyncio.run(owner.send_weights(ModuleSource(model), version=1))
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=workers_cache.holding_reader, args=("shm", name, ready))
    p.start()
    assert ready.wait(60)
    p.kill()
    p.join(30)
    for v in (2, 3, 4):
        model.step(v)
        t0 = time.monotonic()
        asyncio.run(owner.send_weights(ModuleSource(model), version=v))
        assert time.monotonic() - t0 < 5
    files = [n for n in os.listdir(owner.root) if n.endswith(".safetensors")]
    assert sorted(files) == ["v00000000000000000003.safetensors", "v00000000000000000004.safetensors"]
    owner.finalize(destroy_group=True)
    assert _shm_caches(port) == before


@pytest.mark.serial  # (any owner on the host sweeps a dead one's cache: none may start meanwhile)
def test_dead_owner_cache_is_swept(port):
    """A cache whose owner was killed is removed by the next owner on the host."""
    before = _shm_caches(port)
    ctx = mp.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=workers_cache.interrupted_publisher,
                    args=("shm", f"dead{port}", "die", ready, go, out))
    p.start()
    out.get(timeout=60)
    go.set()
    p.join(60)
    assert f"wbcache_dead{port}" in _shm_caches(port)
    owner = workers_cache.cache("trainer", "shm", f"alive{port}")
    asyncio.run(owner.send_weights(ModuleSource(Mixed()), version=1))
    assert f"wbcache_dead{port}" not in _shm_caches(port)
    owner.finalize(destroy_group=True)
    assert _shm_caches(port) == before


def test_relay_fills_a_host_cache_from_any_engine(port, tmp_path):
    """Trainer -> (gloo) -> one relay per host -> its cache -> any number of local readers."""

    from weightbus.runtime.local import spawn
    logs = spawn(workers_cache.relay_worker, 2, (port, str(tmp_path / "relay")), timeout=120)
    assert logs[1] == logs[0]


def test_cache_options_checked_where_given(tmp_path):
    with pytest.raises(WeightbusError, match="backend 'disk' needs path="):
        CheckpointEngineRegistry.new("disk").prepare()
    with pytest.raises(WeightbusError, match="keep"):
        CheckpointEngineRegistry.new("shm", keep=0)
    with pytest.raises(WeightbusError, match="cache_name must be"):
        CheckpointEngineRegistry.new("shm", cache_name="a/b")
    reader = CheckpointEngineRegistry.new("disk", path=str(tmp_path)).connect("rollout")
    assert reader.get_weights().version is None  # nothing published: returns at once
    with pytest.raises(WeightbusError, match="only a trainer rank may publish"):
        asyncio.run(reader.send_weights(ModuleSource(Mixed())))


def test_publishing_never_disturbs_a_reader(port):
    """A reader that holds version 1 while 2, 3 and 4 are published (files recycled where
    no reader holds them) still reads version 1 whole; later pulls get the newest."""
    name = f"keep{port}"
    owner = workers_cache.cache("trainer", "shm", name)
    reader = workers_cache.cache("rollout", "shm", name)
    model = Mixed()
    published = {}
    for v in range(1, 5):
        model.step(v)
        asyncio.run(owner.send_weights(ModuleSource(model), version=v))
        published[v] = workers_cache.digests(model)
        if v == 1:
            held = reader.get_weights()  # opened, not read yet
    inodes = set()
    for v in range(5, 9):  # steady state: the file of the version leaving the cache is reused
        model.step(v)
        asyncio.run(owner.send_weights(ModuleSource(model), version=v))
        published[v] = workers_cache.digests(model)
        inodes.add(os.stat(os.path.join(owner.root, f"v{v:020d}.safetensors")).st_ino)
    assert len(inodes) <= 3
    target = Mixed()
    asyncio.run(ModuleSink(target).load(held))
    assert held.version == 1 and workers_cache.digests(target) == published[1]
    newest = reader.get_weights(newer_than=1)
    asyncio.run(ModuleSink(target).load(newest))
    assert newest.version == 8 and workers_cache.digests(target) == published[8]
    owner.finalize(destroy_group=True)


def _dead_publisher(backend: str, where: str, job: str | None = None) -> dict:
    """A publisher that published version 1 and was killed publishing version 2 (an earlier
    job, or this job's trainer before it restarts); returns version 1's digests."""
    ctx = mp.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=workers_cache.interrupted_publisher,
                    args=(backend, where, "die", ready, go, out, job))
    p.start()
    first = out.get(timeout=60)
    go.set()
    p.join(60)
    assert p.exitcode == -9
    return first


@pytest.mark.parametrize("backend", ["shm", "disk"])
def test_an_earlier_jobs_versions_are_never_read(backend, tmp_path, port):
    """A job that died left version 1 in the cache under the same name. A fresh job's
    reader, told its trainer's job through build_topology, does not take it even before the
    new trainer connects (it would read the wrong policy, then wait for a version above
    it); once the trainer connects the cache is the new job's, and its version 1 is read
    bitwise."""
    where = _where(backend, tmp_path, port)
    old = _dead_publisher(backend, where)
    opts = {"path": where} if backend == "disk" else {"cache_name": where}
    trainer = CheckpointEngineRegistry.new(backend, role="trainer", timeout=30, **opts)
    reader = CheckpointEngineRegistry.new(backend, role="rollout", timeout=30, **opts)
    anyone = workers_cache.cache("rollout", backend, where)  # (no job: reads any version)
    metadata = [trainer.prepare(), reader.prepare()]
    ranks, readers = type(trainer).build_topology(1, 1, metadata)
    reader.init_process_group(**{k: v[0] for k, v in readers.items()})
    assert reader.job == metadata[0]["job"]
    assert reader.get_weights().version is None  # the dead job's version 1 is not this job's
    assert anyone.get_weights().version == 1
    trainer.init_process_group(**{k: v[0] for k, v in ranks.items()})  # takes the cache
    model = Mixed()
    model.step(7)
    asyncio.run(trainer.send_weights(ModuleSource(model), version=1))
    stream = reader.get_weights()
    assert stream.version == 1
    got = Mixed()
    asyncio.run(ModuleSink(got).load(stream))
    assert workers_cache.digests(got) == workers_cache.digests(model) != old
    trainer.finalize(destroy_group=True)


def test_a_restarted_publisher_of_the_same_job_keeps_its_versions_readable(tmp_path, port):
    """A trainer named by ``job=`` dies; its readers keep reading its last version, and
    when it comes back under the same job the version stays until it publishes the next."""
    where = str(tmp_path / "cache")
    first = _dead_publisher("disk", where, job="run-7")
    reader = workers_cache.cache("rollout", "disk", where, job="run-7")
    stranger = workers_cache.cache("rollout", "disk", where, job="run-8")
    assert stranger.get_weights().version is None
    back = workers_cache.cache("trainer", "disk", where, job="run-7")
    stream = reader.get_weights()
    assert stream.version == 1
    model = Mixed()
    asyncio.run(ModuleSink(model).load(stream))
    assert workers_cache.digests(model) == first
    model.step(2)
    asyncio.run(back.send_weights(ModuleSource(model), version=2))
    assert reader.get_weights(newer_than=1).version == 2
    for bad in ("", 7, "two\nlines"):
        with pytest.raises(WeightbusError, match="job must be a non-empty printable string"):
            workers_cache.cache("rollout", "disk", where, job=bad)
    back.finalize(destroy_group=True)


@pytest.mark.parametrize("backend", ["shm", "disk"])
@pytest.mark.parametrize("job", [None, "other-job"])
def test_a_cache_never_goes_from_a_version_to_none(tmp_path, port, backend, job):
    """A publisher dies holding version 1; a new one takes the cache (another job, or none
    said) and its first publish fails: readers still read version 1. Its next publish goes
    in, and only then do the dead publisher's versions go."""
    where = _where(backend, tmp_path, port)
    ctx = mp.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Event(), ctx.Event()
    p = ctx.Process(target=workers_cache.interrupted_publisher,
                    args=(backend, where, "die", ready, go, out), kwargs={"job": "old-job"})
    p.start()
    first = out.get(timeout=60)
    go.set()
    p.join(60)
    assert p.exitcode == -9
    owner = workers_cache.cache("trainer", backend, where, **({"job": job} if job else {}))
    model = Mixed()
    model.step(7)
    with pytest.raises(WeightbusError, match="failed midway"):
        asyncio.run(owner.send_weights(workers_cache._Raising(ModuleSource(model), 2), version=1))
    reader = workers_cache.cache("rollout", backend, where)
    stream = reader.get_weights()
    assert stream.version == 1, "the dead publisher's version went before a new one was in"
    held = Mixed()
    asyncio.run(ModuleSink(held).load(stream))
    assert workers_cache.digests(held) == first
    asyncio.run(owner.send_weights(ModuleSource(model), version=1))  # (its own version 1 now)
    stream = reader.get_weights()
    asyncio.run(ModuleSink(held).load(stream))
    assert workers_cache.digests(held) == workers_cache.digests(model)
    owner.finalize(destroy_group=True)
