"""The ``weightbus`` command at first use (issue: trust): every option is checked before
anything starts and a bad one ends in one line naming it, its value and the fix; the demo
runs on the cache backends and leaves nothing behind; no option is silently ignored, none
lacks help; the engines' logs stay out of the table; no floor is a silent 0.00.

The command runs as a user runs it (the venv's ``weightbus`` script, in a process of its
own), every run started at once by one fixture; the many bad values are also fed to
``main()`` in this process, where each must fail in well under a second with nothing
started."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from weightbus.tools import cli

WB = str(Path(sys.executable).parent / "weightbus")  # the console script of this venv
TINY = ["--steps", "1", "--dim", "64", "--layers", "1", "--trainers", "1", "--rollouts", "1"]
PREFIXES = ("wbcache_", "wbus_")  # weightbus's names in /dev/shm (cache directories, buckets)


def _shm() -> set[str]:
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if n.startswith(PREFIXES)}


def _owner_alive(name: str) -> bool:
    """Whether a weightbus entry of /dev/shm belongs to a live process (another test's)."""
    try:
        if name.startswith("wbcache_"):
            pid = int(Path("/dev/shm", name, "owner.pid").read_text().strip())
        else:
            pid = int(name.split("_")[1])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return False
    return True


@pytest.fixture(scope="module")
def runs():
    """Every command of this file, started at once (they share 2 cores: the slowest sets
    the time); each -> (exit code, stdout + stderr, seconds)."""
    if not os.path.exists(WB):
        pytest.skip(f"no console script at {WB}")
    disk_dir = tempfile.mkdtemp(prefix="wb-test-cache-dir-")
    jobs = {
        # the start-up a demo command pays (its options' choices import torch): the time to
        # compare with (`--version` alone imports nothing heavy)
        "version": ["demo", "--help"],
        "steps": ["demo", "--steps", "0"],
        "shm": ["demo", "--backend", "shm", *TINY],
        "disk": ["demo", "--backend", "disk", "--cache-dir", disk_dir, *TINY],
    }
    before = _shm()
    t0 = time.monotonic()
    procs = {k: subprocess.Popen([WB, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True) for k, argv in jobs.items()}
    out = {}
    for k, p in procs.items():
        try:
            text, _ = p.communicate(timeout=max(1.0, 150 - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the demo's own worker processes with it
            text = p.communicate()[0] + "\n<killed: still running after 150 s>"
        out[k] = (p.returncode, text, time.monotonic() - t0)
    leaked = {n for n in _shm() - before if not _owner_alive(n)}
    left_in_dir = os.listdir(disk_dir)
    os.rmdir(disk_dir) if not left_in_dir else None
    return out, leaked, left_in_dir


def _fast_one_line(out, key, *needles):
    """The run failed as argparse does (code 2), in one line naming what it must, with no
    traceback, about as fast as the bare start-up of the command."""
    rc, text, took = out[key]
    base = out["version"][2]
    assert rc == 2, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    for n in needles:
        assert n in text, text
    assert took < base + 5, f"{took:.1f} s, the bare start-up {base:.1f} s: {text}"


# ---------------------------------------------------------------- 1. the cache backends


def test_demo_runs_on_shm_and_leaves_nothing_in_dev_shm(runs):
    out, leaked, _ = runs
    rc, text, _ = out["shm"]
    assert rc == 0 and "bitwise OK" in text and "Traceback" not in text, text
    assert not leaked, f"left in /dev/shm: {sorted(leaked)}"


def test_demo_runs_on_disk_in_the_given_directory_and_cleans_it(runs):
    out, _, left_in_dir = runs
    rc, text, _ = out["disk"]
    assert rc == 0 and "bitwise OK" in text and "Traceback" not in text, text
    assert "over 'disk' (cache in " in text and not left_in_dir, (text, left_in_dir)


# ---------------------------------------------------------------- 2. every value checked first


@pytest.fixture
def nothing_starts(monkeypatch):
    """Anything past the checks fails the test at once (and records what it was given)."""
    import weightbus.integrations.vllm.demo as vllm_demo
    import weightbus.tools.bench
    import weightbus.tools.demo
    started = []

    def start(*args, **kwargs):
        started.append((args, kwargs))
        raise AssertionError(f"started with a bad value: {args} {kwargs}")
    for mod, name in ((weightbus.tools.demo, "run_demo"), (weightbus.tools.bench, "main_bench"),
                      (vllm_demo, "run_vllm_demo")):
        monkeypatch.setattr(mod, name, start)
    return started


def _refused(argv, capsys) -> str:
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    took = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, (argv, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, (argv, err)
    # (alone a refusal takes well under 0.1 s; the bound catches work done before the check,
    # such as importing vLLM or building a model, with room for a loaded CI host, where one
    # took 1.1 s once)
    assert took < 3.0, (argv, took)
    return err


BAD = [  # argv, then what the one line must name: the option, the value, the fix
    (["demo", "--steps", "0"], "--steps", "got 0", ">= 1"),
    (["demo", "--steps", "three"], "--steps", "'three'", ">= 1"),
    (["demo", "--bucket-mb", "0"], "--bucket-mb", "got 0", "[1, 65536]"),
    (["demo", "--bucket-mb", "-5"], "--bucket-mb", "got -5", "[1, 65536]"),
    (["demo", "--dim", "7"], "--dim", "got 7", "multiple of 4"),
    (["demo", "--trainers", "0"], "--trainers", "got 0", "[1, 64]"),
    (["demo", "--rollouts", "-1"], "--rollouts", "got -1", "[1, 64]"),
    (["demo", "--layers", "0"], "--layers", "got 0", "[1, 1024]"),
    (["demo", "--dim", "65536", "--layers", "1024"], "--dim 65536", "GiB of host memory", "lower --dim"),
    (["demo", "--json", "/nonexistent/wb/rows.json"], "--json", "/nonexistent/wb", "does not exist"),
    (["demo", "--backend", "disk", "--cache-dir", "/nonexistent/wb"], "--cache-dir", "'/nonexistent/wb'",
     "not an existing directory"),
    (["demo", "--backend", "disk", "--cache-dir", "/proc"], "--cache-dir", "'/proc'", "writable directory"),
    (["demo", "--backend", "glo"], "--backend", "'glo'", "did you mean 'gloo'?"),
    (["bench", "--scenario", "colocatd"], "--scenario", "'colocatd'", "did you mean 'colocated'?"),
    (["demo", "--backend", "shm", "--bucket-mb", "8"], "--bucket-mb", "--backend shm", "drop --bucket-mb"),
    (["demo", "--rollout", "vllm", "--steps", "0"], "--steps", "got 0", ">= 1"),
    (["demo", "--rollout", "vllm", "--dim", "64"], "--dim 64", "vllm", "multiple of 128"),
    (["demo", "--rollout", "vllm", "--rollouts", "2"], "--rollouts 2", "one vLLM engine", "--rollout torch"),
    (["demo", "--rollout", "vllm", "--backend", "shm"], "--backend shm", "vllm", "--backend gloo"),
    (["bench", "--iters", "0"], "--iters", "got 0", ">= 1"),
    (["bench", "--bucket-mb", "0"], "--bucket-mb", "got 0", "[1, 65536]"),
    (["bench", "--layers", "0"], "--layers", "got 0", ">= 1"),
    (["bench", "--tensors", "0"], "--tensors", "got 0", "[1, 10000000]"),
    (["bench", "--tensor-bytes", "3"], "--tensor-bytes", "got 3", "multiple of 2"),
    (["bench", "--receivers", "0"], "--receivers", "got 0", "[1, 64]"),
    (["bench", "--trainers", "0"], "--trainers", "got 0", "[1, 64]"),
    (["bench", "--delta", "0"], "--delta", "'0'", "(0, 1]"),
    (["bench", "--delta", "1.5"], "--delta", "'1.5'", "(0, 1]"),
    (["bench", "--delta", "nan"], "--delta", "'nan'", "(0, 1]"),
    (["bench", "--json", "/nonexistent/wb/rows.json"], "--json", "/nonexistent/wb", "does not exist"),
    (["bench", "--plot", "/nonexistent/wb/p.svg"], "--plot", "/nonexistent/wb", "does not exist"),
    (["bench", "--topology", "tree"], "--topology tree", "nixl", "--backend nixl"),
    (["bench", "--preset", "tiny", "--tensors", "10"], "--tensors", "--preset tiny", "drop"),
    (["plan", "--trainers", "0"], "--trainers", "got 0", "[1, 1000000]"),
    (["plan", "--rollout-gpus", "0"], "--rollout-gpus", "got 0", "[1, 1024]"),
    (["plan", "--sweep", "0,2"], "--sweep", "'0,2'", "replica counts >= 1"),
    (["plan", "--model", "nope"], "--model", "'nope'", "no config.json"),
    (["plan", "--cluster", "a100"], "--cluster", "'a100'", "h100"),
    (["plan", "--plot", "/tmp/wb-plan.svg"], "--plot", "draws the --sweep", "give --sweep"),
    (["plan", "--senders", "9", "--trainers", "8"], "--senders 9", "8 trainer GPUs", "at most 8"),
    (["plan", "--nodes", "1", "--trainers", "8", "--replicas", "1"], "--nodes 1", "needs 16 GPUs",
     "--nodes 2 or more"),
    (["plan", "--trainers", "12", "--tp", "8"], "--tp 8", "12 trainer GPUs", "multiple of 8"),
    (["plan", "--trainers", "8", "--tp", "2", "--senders", "4"], "--senders 4", "under Megatron",
     "drop --senders"),
]


@pytest.mark.parametrize(("argv", "option", "value", "fix"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_a_bad_value_fails_at_once_in_one_line(argv, option, value, fix, nothing_starts, capsys):
    err = _refused(argv, capsys)
    assert option in err and value in err and fix in err, err
    assert err.startswith(f"weightbus {argv[0]}: error: ")


def test_a_bad_value_from_the_shell_fails_as_fast_as_the_start_up(runs):
    _fast_one_line(runs[0], "steps", "--steps", "got 0", ">= 1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_backend_this_machine_cannot_run_is_refused_first(nothing_starts, capsys):
    for argv in (["demo", "--backend", "nccl"], ["bench", "--backend", "nccl"]):
        err = _refused(argv, capsys)
        assert "--backend nccl needs CUDA GPUs" in err and "--backend gloo" in err, err
    err = _refused(["bench", "--scenario", "colocated-direct"], capsys)
    assert "no GPU" in err and "--scenario colocated" in err, err


# ---------------------------------------------------------------- 3. nothing silently ignored


def test_delta_names_the_scenario_it_needs(nothing_starts, capsys):
    err = _refused(["bench", "--scenario", "colocated", "--delta", "0.1"], capsys)
    assert "--delta" in err and "--scenario disaggregated only, not --scenario colocated" in err, err
    with pytest.raises(AssertionError, match="started"):  # alone, it chooses that scenario
        cli.main(["bench", "--delta", "0.1"])
    (configs, *_), _ = nothing_starts[0]
    assert {c.scenario for c in configs} == {"disaggregated"} and {c.delta for c in configs} == {0.1}


def test_fp8_names_the_scenarios_it_needs(nothing_starts, capsys):
    err = _refused(["bench", "--scenario", "disaggregated", "--fp8"], capsys)
    assert "--fp8 applies to the colocated scenarios only, not --scenario disaggregated" in err, err
    err = _refused(["bench", "--fp8", "--delta", "0.1"], capsys)  # (--delta chooses disaggregated)
    assert "--fp8 applies to the colocated scenarios only" in err, err
    with pytest.raises(AssertionError, match="started"):  # alone, it chooses the colocated ones
        cli.main(["bench", "--fp8"])
    (configs, *_), _ = nothing_starts[0]
    assert {c.scenario for c in configs} == {"colocated"} and all(c.fp8 for c in configs)


def test_trainers_name_the_scenario_they_need(nothing_starts, capsys):
    err = _refused(["bench", "--scenario", "hybrid-fsdp", "--trainers", "2"], capsys)
    assert "--trainers" in err and "--scenario disaggregated only, not --scenario hybrid-fsdp" in err, err
    err = _refused(["bench", "--trainers", "2", "--backend", "nixl"], capsys)
    assert "trainers= applies to the disaggregated scenario over gloo or nccl" in err, err
    with pytest.raises(AssertionError, match="started"):  # alone, it chooses that scenario
        cli.main(["bench", "--trainers", "2", "--rollout-tp", "2"])
    (configs, *_), _ = nothing_starts[0]
    assert [(c.scenario, c.trainers, c.receivers) for c in configs] == [("disaggregated", 2, 2)]


def test_options_that_would_do_nothing_are_refused(nothing_starts, capsys, tmp_path):
    err = _refused(["demo", "--cache-dir", str(tmp_path)], capsys)
    assert "--cache-dir" in err and "--backend disk" in err and "--backend gloo" in err, err


# ---------------------------------------------------------------- 4. help for every option


def test_every_option_of_every_subcommand_has_help():
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict)).choices
    assert set(subs) == {"demo", "bench", "plan"}
    for name, sub in subs.items():
        bare = [a.option_strings for a in sub._actions if not (a.help or "").strip()]
        assert not bare, f"weightbus {name}: no help for {bare}"
    for sub in subs.values():  # and the help the user reads shows each one
        text = " ".join(sub.format_help().split())
        for a in sub._actions:
            assert " ".join(a.help.split())[:30] in text, (a.option_strings, text)
    assert "(default: 3)" in subs["demo"].format_help()


# ---------------------------------------------------------------- 5. engine logs out of the way


def test_engine_logs_go_to_a_file_named_in_one_line_unless_verbose(capfd):
    noisy = [sys.executable, "-c",
             "import sys; print('INFO engine noise'); print('WARNING scary', file=sys.stderr)"]
    with cli._logs_to_file(verbose=False):
        subprocess.run(noisy, check=True)  # a child process, as the engines' are
    out, err = capfd.readouterr()
    assert "noise" not in out + err and "scary" not in out + err, out + err
    (line,) = out.strip().splitlines()
    path = line.split(": ")[-1]
    assert "engine logs (2 lines, --verbose shows them here)" in line
    assert "WARNING scary" in Path(path).read_text()
    os.unlink(path)
    with cli._logs_to_file(verbose=True):
        subprocess.run(noisy, check=True)
    out, err = capfd.readouterr()
    assert "engine noise" in out and "scary" in err and "engine logs" not in out


def test_a_quiet_run_leaves_no_log_file(capfd, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (its own: demos in other workers log too)
    with cli._logs_to_file(verbose=False):
        assert any(n.startswith("weightbus-demo-") for n in os.listdir(tmp_path))  # (it did log there)
    assert capfd.readouterr().out == ""
    assert not os.listdir(tmp_path)


# ---------------------------------------------------------------- 6. the floor, or why not


def test_every_demo_backend_names_its_floor():
    from weightbus.tools.demo import floor_note
    for backend in ("gloo", "colocated", "naive", "nixl", "mooncake", "shm", "disk"):
        note = floor_note(backend)
        assert note.startswith("floor: ") and "n/a" not in note, (backend, note)


def test_the_cache_demos_print_their_measured_floor(runs):
    for key in ("shm", "disk"):
        rc, text, _ = runs[0][key]
        row = next(x for x in text.splitlines() if x.strip().startswith("1 "))
        floor, ratio = row.split()[6:8]
        assert float(floor) > 0 and ratio.endswith("x"), row
        assert "floor: the same bytes written once into a file in the cache's directory" in text


def test_a_backend_without_a_known_floor_prints_na_and_why(monkeypatch, nothing_starts, capsys):
    import weightbus.tools.demo
    # as for an engine the demo knows no raw transfer of
    monkeypatch.setattr(weightbus.tools.demo, "FLOORS", {})
    row = {"step": 1, "loss": 1.0, "bytes": 10**6, "seconds": 0.01, "gbps": 0.1, "gather_seconds": 0.0,
           "verified": True}
    monkeypatch.setattr(weightbus.tools.demo, "run_demo", lambda cfg, progress=None: [row])
    assert cli.main(["demo", *TINY]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("1 "))
    assert line.split()[6:8] == ["n/a", "-"], line
    assert "floor: n/a: the demo knows no raw transfer for CollectiveEngine ('gloo')" in out


def test_the_demos_memory_check_counts_its_model():
    from weightbus.tools.demo import DemoConfig, TinyTransformer
    for dim, layers in ((64, 1), (512, 3)):
        model = TinyTransformer(8192, dim, layers)
        assert DemoConfig(dim=dim, layers=layers).params() == sum(p.numel() for p in model.parameters())


def test_a_mistyped_option_gets_the_nearest_one(nothing_starts, capsys):
    err = _refused(["demo", "--backnd", "gloo"], capsys)
    assert err == ("weightbus: error: unrecognized arguments: --backnd gloo; "
                   "did you mean --backnd -> --backend?")


def test_a_mistyped_backend_in_the_api_gets_the_nearest_name():
    from weightbus import CheckpointEngineRegistry, WeightbusError
    with pytest.raises(WeightbusError, match="did you mean 'nccl'"):
        CheckpointEngineRegistry.new("ncl")
    with pytest.raises(WeightbusError, match="registered: colocated") as e:
        CheckpointEngineRegistry.new("qqqqqq")
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize(("argv", "after"), [
    (["demo", *TINY[:0], "--steps", "200"], 3.0),
    (["bench", "--preset", "tiny", "--iters", "200"], 3.0),
    # early: the bench's workers are still importing torch (a KeyboardInterrupt there was a
    # traceback of the child's own on a busy CI machine)
    (["bench", "--preset", "tiny", "--iters", "200"], 1.0)], ids=["demo", "bench", "bench-early"])
def test_ctrl_c_ends_every_process_at_once_in_one_line(argv, after, tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) mid-run: exit code 130 within
    seconds, one line, no traceback from any process, no log file left, nothing in /dev/shm."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    shm = _shm()
    env = {**os.environ, "TMPDIR": str(tmp), "WEIGHTBUS_START_METHOD": "spawn"}  # (as users start it)
    p = subprocess.Popen([WB, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    import select
    ready, _, _ = select.select([p.stdout], [], [], 120)  # its first line: the run has begun
    first = p.stdout.readline() if ready else ""
    assert first, "the command printed nothing in 120 s"
    time.sleep(after)  # (its worker processes are up and moving weights, or still starting)
    assert p.poll() is None, p.communicate()
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)
    try:
        out, err = p.communicate(timeout=20)
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    took = time.monotonic() - t0
    assert p.returncode == 130, (p.returncode, out, err)
    assert err.strip().splitlines() == ["weightbus: interrupted"], err
    assert "Traceback" not in first + out + err
    assert took < 5, took
    left = [f for f in tmp.iterdir() if f.name.startswith("weightbus")]  # (torch's caches may be there)
    assert left == [], left
    assert {n for n in _shm() - shm if not _owner_alive(n)} == set()
