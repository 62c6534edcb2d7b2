"""`kvmesh bench engine` at small sizes, so the command keeps working: rounds against transformers, the median
ratio, and the prefix cache's TTFT."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from kvmesh.cli import main

pytestmark = pytest.mark.slow


def test_the_engine_benchmark_takes_turns_with_transformers_and_reports_the_median_ratio(tmp_path: Path,
                                                                                          capsys) -> None:
    out = tmp_path / "engine.json"
    assert main(["bench", "engine", "--concurrency", "1,3", "--prompt-tokens", "8", "--output-tokens", "4",
                 "--prefix-tokens", "96", "--rounds", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [p["concurrency"] for p in result["throughput"]] == [1, 3]
    assert [p["output_tokens"] for p in result["throughput"]] == [4, 12]
    rounds = result["rounds"]
    assert len(rounds) == 3 and all(r["engine"]["output_tokens"] == 12 for r in rounds)
    assert all(r["transformers_tokens_per_second"] > 0 for r in rounds)
    assert [r["first"] for r in rounds] == ["engine", "transformers", "engine"]  # a drift favours neither
    assert result["ratio_median"] == statistics.median(r["ratio"] for r in rounds)
    ttft = result["prefix_ttft"]
    assert ttft["cached_tokens"] == 80 and ttft["warm_computed_tokens"] == 16  # only the last block computed
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if line.startswith("rounds"))
    assert f"**{result['ratio_median']:.2f}x**" in printed and len(line.split("; ")) == 3
