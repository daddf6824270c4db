"""Cache engines (``shm``, ``disk``) and the safetensors source when files go wrong: a full
file system is an error of the publish (never a signal, nothing left behind, the previous
version still served); a broken version file is an error that names it, once, and the
cache serves the newest intact version after it; a shard cut after its source was made is
named. Real processes (forked: no second import of torch), real files, real full
file systems (a tmpfs in a mount namespace where the machine allows one, a file-size
limit everywhere)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import re
import shutil

import pytest
import torch
import workers
import workers_cache
from workers import Mixed

from weightbus import ModuleSink, ModuleSource, WeightbusError
from weightbus.engines.cache import read_version

_FORK = mp.get_context("fork")


def _forked(target, *args, timeout: float = 60):
    """Run ``target(*args, conn)`` in a forked process; what it sent on ``conn``."""
    mine, theirs = _FORK.Pipe()
    p = _FORK.Process(target=target, args=(*args, theirs))
    p.start()
    theirs.close()
    try:
        if not mine.poll(timeout):
            raise AssertionError(f"{target.__name__} sent nothing in {timeout} s")
        return mine.recv()
    finally:
        p.join(timeout)
        if p.is_alive():
            p.kill()


def _where(backend: str, tmp_path, port: int, tag: str) -> str:
    return str(tmp_path / tag) if backend == "disk" else f"{tag}{port}"


def _version_file(root: str, v: int) -> str:
    return os.path.join(root, f"v{v:020d}.safetensors")


def _publish(owner, versions) -> tuple[Mixed, dict[int, dict[str, str]]]:
    """A model stepped and published at each version; what each version holds."""
    model, published = Mixed(), {}
    for v in versions:
        model.step(v)
        asyncio.run(owner.send_weights(ModuleSource(model), version=v))
        published[v] = workers_cache.digests(model)
    return model, published


def _load(stream) -> tuple[int | None, dict[str, str]]:
    model = Mixed()
    asyncio.run(ModuleSink(model).load(stream))
    return stream.version, workers_cache.digests(model)


# --- 1. a full file system ---------------------------------------------------------------

@pytest.mark.parametrize("backend", ["disk", "shm"])
@pytest.mark.parametrize("mode", ["tmpfs", "fsize"])
def test_full_file_system_is_an_error_of_the_publish(backend, mode, tmp_path, port):
    """Version 2 does not fit (a 1 MiB tmpfs holding version 1, on the cache's directory
    or on /dev/shm; or a 64 KiB file-size limit): the publisher raises an error naming the
    file, the bytes needed and free (it does not die of SIGBUS or SIGXFSZ), leaves no
    temporary file, and readers still get version 1 bitwise; with room again, the same
    engine publishes."""
    where = _where(backend, tmp_path, port, "full")
    try:
        got = _forked(workers_cache.full_publish, backend, where, mode)
    finally:  # (the driver removes it; not if it died)
        shutil.rmtree(f"/dev/shm/wbcache_{where}", ignore_errors=True)
    if "skip" in got:
        pytest.skip(got["skip"])
    assert "error" not in got, got.get("error")
    assert got["exitcode"] == 0, f"the publisher died (exit code {got['exitcode']})"
    kind, message, files = got["outcome"]
    assert kind == "WeightSyncError", (kind, message)
    errname = "ENOSPC" if mode == "tmpfs" else "EFBIG"
    root = where if backend == "disk" else f"/dev/shm/wbcache_{where}"
    m = re.search(rf"cannot publish version 2: writing {re.escape(root)}/\.v-tmp-\S+ failed \({errname}: "
                  rf".*\); it needs (\d+) bytes, (\d+) bytes are free there; nothing was left behind "
                  rf"and the cache keeps version 1", message)
    assert m, message
    needed, free = int(m[1]), int(m[2])
    assert needed > 500_000 and (free < needed if mode == "tmpfs" else free > needed), message
    if mode == "fsize":
        assert "(RLIMIT_FSIZE)" in message
    for listing in (files, got["files"]):  # as the publisher saw it, and after it
        assert not [n for n in listing if n.startswith(".v-")], listing
        assert "v00000000000000000001.safetensors" in listing
    assert got["read"] == (1, got["v1"])
    if mode == "fsize":
        assert got["read2"] == (2, got["v2"])


def test_failed_commit_leaves_nothing_behind(tmp_path):
    """A publish that fails at its last step (msync's ENOSPC or EIO, as on a full network
    file system) removes its temporary file and raises the same named error."""
    owner = workers_cache.cache("trainer", "disk", str(tmp_path / "c"))
    model = Mixed()
    asyncio.run(owner.send_weights(ModuleSource(model), version=1))
    writer = owner.writer(ModuleSource(model).manifest)
    tmp = writer.tmp

    class _Map:  # the real map, whose flush fails as msync does on a full NFS export
        def __init__(self, m):
            self.m = m

        def flush(self):
            raise OSError(28, "No space left on device")

        def close(self):
            self.m.close()

    writer._map = _Map(writer._map)
    with pytest.raises(WeightbusError, match=r"cannot publish version 2: writing .*\.v-tmp-.* failed "
                                             r"\(ENOSPC: No space left on device\); it needs \d+ bytes"):
        owner.publish(writer, 2)
    assert not os.path.exists(tmp)
    assert [n for n in os.listdir(owner.root) if n.startswith("v")] == ["v00000000000000000001.safetensors"]


# --- 2. a broken version file --------------------------------------------------------------

def _corrupt(path: str, kind: str) -> str:
    """Break a version file in place; what the reader's error must say."""
    with open(path, "r+b") as f:
        data = f.read()
        n = int.from_bytes(data[:8], "little")
        header = data[8:8 + n]
        if kind == "garbage":
            f.seek(8)
            f.write(b"\xff\xfe" * 32)
            return r"its \d+-byte header is not a safetensors header \("
        if kind == "length":
            f.seek(0)
            f.write((1 << 40).to_bytes(8, "little"))
            return r"its header's length says 1099511627776 bytes, the file has \d+ after it \(truncated"
        if kind == "truncated":
            f.truncate(len(data) * 2 // 3)
            return r"tensor '[\w.]+': data_offsets \[\d+, \d+\] end past the file's \d+ bytes of data " \
                   r"\(truncated\)"
        if kind == "dtype":  # a dtype no cache holds (same length: the rest stays in place)
            assert b'"dtype":"BF16"' in header
            f.seek(8 + header.index(b'"dtype":"BF16"'))
            f.write(b'"dtype":"XF16"')
            return r"tensor 'bf': dtype 'XF16' is not one a cache holds"
        if kind == "mismatch":  # a known dtype that does not fit the tensor's bytes and shape
            f.seek(8 + header.index(b'"emb.weight":{"dtype":"F32"'))
            f.write(b'"emb.weight":{"dtype":"F16"')
            return (r"tensor 'emb.weight': dtype F16 and shape \[3000, 48\] need 288000 bytes, its "
                    r"data_offsets \[\d+, \d+\] hold 576000")
    raise AssertionError(kind)


@pytest.mark.parametrize("backend", ["disk", "shm"])
@pytest.mark.parametrize("kind", ["garbage", "length", "truncated", "dtype", "mismatch"])
def test_broken_version_is_named_once_then_the_cache_recovers(backend, kind, tmp_path, port):
    """The newest version's file is broken: the reader that finds it gets an error naming
    the file, the version and what is wrong; from then on every reader (another process
    too) gets the newest intact version, bitwise; the next publish is read cleanly and
    removes the broken file."""
    where = _where(backend, tmp_path, port, "broken")
    owner = workers_cache.cache("trainer", backend, where, keep=2)
    reader = workers_cache.cache("rollout", backend, where)
    try:
        model, published = _publish(owner, (1, 2))
        path = _version_file(owner.root, 2)
        what = _corrupt(path, kind)
        with pytest.raises(WeightbusError, match=what) as e:
            read_version(path)  # (a tool's read: the same words)
        assert f"version 2 in the cache ({path}) is broken" in str(e.value)
        with pytest.raises(WeightbusError, match=what) as e:
            reader.get_weights()
        message = str(e.value)
        assert message.startswith(f"{backend} rollout rank 0: version 2 in the cache ({path}) is broken: ")
        assert "the next pull gets the newest intact version" in message
        assert not os.path.exists(path)  # out of every reader's sight
        assert _forked(workers_cache.pull, backend, where, None) == (1, published[1])  # another reader
        assert _load(reader.get_weights()) == (1, published[1])
        model.step(3)
        asyncio.run(owner.send_weights(ModuleSource(model), version=3))
        assert not [n for n in os.listdir(owner.root) if n.startswith(".v-")]
        published[3] = workers_cache.digests(model)
        assert _load(reader.get_weights(newer_than=1)) == (3, published[3])
        assert _forked(workers_cache.pull, backend, where, 1) == (3, published[3])
    finally:
        owner.finalize(destroy_group=True)


def test_broken_version_in_a_read_only_cache_is_skipped(tmp_path, monkeypatch):
    """A reader that may not move the broken file aside skips it from then on (and says
    so); a receive waiting for a newer version names it too."""
    where = str(tmp_path / "ro")
    owner = workers_cache.cache("trainer", "disk", where, keep=2)
    model, published = _publish(owner, (1, 2))
    path = _version_file(owner.root, 2)
    what = _corrupt(path, "truncated")

    def read_only(src, dst):
        raise PermissionError(13, "Permission denied", src)

    reader = workers_cache.cache("rollout", "disk", where)
    monkeypatch.setattr(os, "rename", read_only)
    with pytest.raises(WeightbusError, match=what + r".*cannot move it aside \(Permission denied\): this "
                                                    r"reader skips it from now on"):
        reader.get_weights()
    assert os.path.exists(path)
    assert _load(reader.get_weights()) == (1, published[1])
    other = workers_cache.cache("rollout", "disk", where)
    with pytest.raises(WeightbusError, match=r"version 2 in the cache .* is broken"):
        _load(other.receive_weights())
    monkeypatch.undo()


# --- 3. the shm cache says what it publishes -------------------------------------------------

@pytest.mark.parametrize("backend", ["shm", "disk"])
def test_every_publish_logs_one_line(backend, tmp_path, port, caplog):
    where = _where(backend, tmp_path, port, "log")
    owner = workers_cache.cache("trainer", backend, where)
    try:
        with caplog.at_level(logging.INFO, logger="weightbus"):
            asyncio.run(owner.send_weights(ModuleSource(Mixed()), version=7))
        path = _version_file(owner.root, 7)
        lines = [r.getMessage() for r in caplog.records if r.name == "weightbus"]
        assert len(lines) == 1, lines
        tensors = len(Mixed().state_dict())
        assert re.fullmatch(rf"{backend} trainer rank 0: version 7 published: {tensors} tensors, "
                            rf"{os.path.getsize(path)} bytes in \d+\.\d{{3}} s \(\d+\.\d\d GB/s\) at "
                            rf"{re.escape(path)}", lines[0]), lines[0]
    finally:
        owner.finalize(destroy_group=True)


# --- 4. a safetensors shard cut after its source was made -------------------------------------

@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_shard_changed_after_the_source_was_made(how, tmp_path):
    """The error names the shard, the tensor the stream was to read from it, and the sizes
    then and now; streamed into a cache, nothing is published and nothing left behind."""
    pytest.importorskip("safetensors")
    from weightbus.integrations.safetensors import SafetensorsSource
    ckpt = tmp_path / "ckpt"
    workers.save_sharded(Mixed(), str(ckpt))
    shard = ckpt / "model-00002-of-00002.safetensors"
    src = SafetensorsSource(ckpt)
    size = shard.stat().st_size
    if how == "truncated":
        os.truncate(shard, size - 64)
        what = rf"it had {size} bytes when the source read its header, it has {size - 64} now \(truncated\)"
    else:
        shard.write_bytes(b"\x00" * 8 + b"x" * (size - 8))
        what = rf"it had {size} bytes when the source read its header and has as many now, but cannot be read"
    named = rf"shard {re.escape(str(shard))}, to read tensor '([\w.]+)' \((\w+) (\[[\d, ]*\])\) from it: "
    with pytest.raises(WeightbusError, match=named + what) as e:
        list(src)
    name, dtype, shape = re.search(named, str(e.value)).groups()
    held = Mixed().state_dict()[name]  # one of the shard's tensors (workers.save_sharded)
    assert name in list(Mixed().state_dict())[1::2] and shape == str(list(held.shape))
    assert dtype == {torch.float32: "F32", torch.bfloat16: "BF16", torch.bool: "BOOL"}[held.dtype]
    owner = workers_cache.cache("trainer", "disk", str(tmp_path / "c"))
    streamed = r"disk trainer rank 0: the weight stream raised at .*"
    with pytest.raises(WeightbusError, match=streamed + named + what):
        asyncio.run(owner.send_weights(src, version=1))
    assert os.listdir(owner.root) == ["owner.pid"]


# --- the cache's own files, and the arguments of a pull --------------------------------------

def test_finalize_removes_only_the_caches_own_files(tmp_path):
    """A ``path=`` of the user's (a run directory, /tmp) keeps what else it holds; a
    directory the publisher made is removed whole."""
    given = tmp_path / "run"
    given.mkdir()
    (given / "notes.txt").write_text("mine")
    for where, made in ((str(given), False), (str(tmp_path / "fresh"), True)):
        owner = workers_cache.cache("trainer", "disk", where)
        model = Mixed()
        asyncio.run(owner.send_weights(ModuleSource(model), version=1))
        assert any(n.endswith(".safetensors") for n in os.listdir(where))
        owner.finalize(destroy_group=True)
        if made:
            assert not os.path.exists(where)
        else:
            assert os.listdir(where) == ["notes.txt"]


@pytest.mark.parametrize("bad", ["1", 1.5, True, -1])
def test_pull_checks_newer_than(tmp_path, bad):
    reader = workers_cache.cache("rollout", "disk", str(tmp_path))
    with pytest.raises(WeightbusError, match="newer_than must be"):
        reader.get_weights(newer_than=bad)
