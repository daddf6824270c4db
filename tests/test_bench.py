"""`weightbus bench` on the CPU: every scenario runs, measures its floor in the same run,
and verifies the rollout's tensors against the trainer's."""

import pytest

from weightbus.bench import BenchConfig, format_table, run_bench


@pytest.mark.parametrize("scenario", ["colocated", "disaggregated", "hybrid-fsdp"])
def test_bench_scenario_cpu(scenario):
    row = run_bench(BenchConfig(scenario=scenario, preset="tiny", iters=2, gpu=False, timeout=120))
    assert row["verified"]
    assert row["floor_s"] > 0 and row["weightbus_s"] > 0
    assert len(row["all_times"]["weightbus"]) == 2
    assert (row["naive_s"] is not None) == (scenario == "disaggregated")
    assert scenario in format_table([row])
