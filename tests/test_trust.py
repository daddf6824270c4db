"""Trust, round four: never serve stale or misplaced weights when the user moves memory.

A source built once follows the tensors the user's model holds *now* (a parameter given
new memory, new ``nn.Parameter`` objects, a module cast to another dtype under a wire
dtype policy), or refuses the update before a byte moves, naming the tensor; the next
correct update lands. Real processes (gloo), weights that change every update, bitwise."""

import pytest
import workers_trust

from weightbus.runtime.local import spawn


def _run(port, moves, dtype=None, many=0):
    trainer, rollout = spawn(workers_trust.source_follows, 2, (port, moves, dtype, many), timeout=180)
    return trainer, rollout


# many: 1,500 tensors more, so the pointer pass is the C++ one (packing/pointers.cpp)
@pytest.mark.parametrize("many", [0, 1500])
def test_a_source_built_once_follows_every_way_of_moving_memory(port, many):
    moves = ["step", "data", "step", "assign", "setattr", "step", "data"]
    trainer, rollout = _run(port, moves, many=many)
    previous = None
    for k, (sent, got) in enumerate(zip(trainer, rollout, strict=True), start=1):
        assert "ok" in sent and "ok" in got, (moves[k - 1], sent, got)
        assert got["ok"] == sent["ok"], f"update {k} ({moves[k - 1]}): the rollout holds other bytes"
        assert got["version"] == k
        assert got["ok"] != previous, f"update {k} ({moves[k - 1]}): the weights did not change"
        previous = got["ok"]


def test_a_new_dtype_under_a_wire_dtype_policy_is_followed(port):
    # model.to(float64) re-allocates every float parameter; the wire stays bf16
    trainer, rollout = _run(port, ["step", "dtype", "step"], dtype="bfloat16")
    for sent, got in zip(trainer, rollout, strict=True):
        assert got["ok"] == sent["ok"]


@pytest.mark.parametrize("move,named", [
    ("dtype", "was replaced by a float64"),  # no dtype policy: the wire dtype would change
    ("shape", "'proj.bias' was replaced by a float32[38]"),
    ("remove", "'proj.bias' is gone from the module"),
])
def test_a_tensor_that_no_longer_fits_fails_the_update_everywhere_before_a_byte(port, move, named):
    trainer, rollout = _run(port, ["step", move])
    assert "ok" in trainer[0] and rollout[0]["ok"] == trainer[0]["ok"]
    for side in (trainer[1], rollout[1]):
        assert "error" in side and named in side["error"] and "build a new source" in side["error"], side


@pytest.mark.parametrize("change,named", [
    ("dtype", "'up.weight'[4, 0]+[3, 8] is float64, the update sends float32"),
    ("larger", "'up.weight'[4, 0]+[3, 8] now has shape [5, 8]"),
    ("smaller", "'up.weight'[4, 0]+[3, 8] now has shape [2, 8]"),
    ("unknown", "a placement names tensor 'bogus.weight', which the update does not have"),
])
def test_sharded_destinations_are_checked_before_any_byte_on_every_rank(port, change, named):
    logs = spawn(workers_trust.sharded_destinations_checked, 3, (port, change), timeout=180)
    trainer, r0, r1 = logs
    bad = {1, 2, 3} if change == "unknown" else {2}  # (a name no update has fails every one)
    for k, entries in enumerate(zip(trainer, r0, r1, strict=True), start=1):
        if k not in bad:
            assert all("ok" in e for e in entries), (k, entries)
            assert entries[1]["wrong"] == [] and entries[2]["wrong"] == [], (k, entries)
        else:
            for e in entries:
                # (named by its rank in the group: trainer 0, rollouts 1 and 2)
                assert "error" in e and named in e["error"] and "gloo rollout rank 2" in e["error"], (k, e)
                assert "nothing was written" in e["error"]
            assert entries[1]["written"] == [] and entries[2]["written"] == [], "bytes landed first"


def test_a_destination_moved_to_new_memory_of_its_shape_is_followed(port):
    logs = spawn(workers_trust.sharded_destinations_checked, 3, (port, "moved"), timeout=180)
    for k, entries in enumerate(zip(*logs, strict=True), start=1):
        assert all("ok" in e for e in entries), (k, entries)
        assert entries[1]["wrong"] == [] and entries[2]["wrong"] == [], (k, entries)


def test_an_older_version_is_refused_unless_meant(port):
    trainer, rollout = spawn(workers_trust.rollback, 2, (port,), timeout=180)
    assert trainer[0] == {"ok": 5} and rollout[0]["ok"] == 5
    assert "version 3 is lower than version 5" in trainer[1]["error"]
    assert "rollback=True" in trainer[1]["error"]
    assert "version 3 is lower than version 5" in rollout[1]["error"] and rollout[1]["version"] == 5
    assert trainer[2] == {"ok": 3} and rollout[2]["ok"] == 3 and rollout[2]["digest"] != rollout[0]["digest"]
    # a restarted trainer sends version 2 to a rollout that serves 3: refused, nothing written
    for side in (trainer[3], rollout[3]):
        assert "serves version 3; the update carries version 2" in side["error"], side
    assert rollout[3]["version"] is None or rollout[3]["version"] == 3
    assert trainer[4] == {"ok": 4} and rollout[4]["ok"] == 4
