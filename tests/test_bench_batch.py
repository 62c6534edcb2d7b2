"""`kvmesh bench batch`: the batch file it builds, the trace's conversations it picks, the ceiling it reports, and
one real comparison (simulated engines behind a real router with a database) on a workload where prefix order
must serve more from the cache than file order."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvmesh.bench.batch import (
    Comparison,
    OrderRun,
    PoolPlan,
    batch_file,
    compare,
    format_comparison,
    ideal_cached_tokens,
    trace_conversations,
)
from kvmesh.bench.serve import BenchRequest, shared_prefix_requests
from kvmesh.cli import main
from kvmesh.router.batches import COMPLETIONS_PATH, check_input, run_order


def test_the_batch_file_is_valid_input_in_the_requests_order() -> None:
    requests = shared_prefix_requests(3, 4, 32, 4, 2, seed=1)
    content = batch_file(requests)
    checked = check_input(content, COMPLETIONS_PATH, max_requests=100)
    assert not checked.problems
    assert [line.body["prompt"] for line in checked.lines] == [r.prompt for r in requests]
    assert all(line.body["max_tokens"] == 2 and not line.body.get("stream") for line in checked.lines)
    # the shuffled file scatters each group; the router's prefix order puts each group's requests together
    groups = {tuple(r.prompt[:32]): r.group for r in requests}
    sent = [groups[tuple(line.body["prompt"][:32])] for line in run_order(checked.lines)]
    assert sum(a != b for a, b in itertools.pairwise(sent)) == 2
    in_file = [r.group for r in requests]
    assert sum(a != b for a, b in itertools.pairwise(in_file)) > 2


def test_the_ceiling_counts_each_full_block_seen_before_short_of_the_last_token() -> None:
    system = list(range(100, 132))  # two blocks of 16
    prompts = [[*system, 1], [*system, 2], system[:16] + [3] * 20, system]
    # the second: both blocks; the third: the first block; the fourth: only its first block (its last token's
    # block is computed again, as the engine does)
    assert ideal_cached_tokens(prompts, 16) == 32 + 16 + 16
    assert ideal_cached_tokens(prompts[:1], 16) == 0


def test_repeated_runs_are_reported_each_and_as_medians() -> None:
    def run(order: str, seconds: float, cached: int, work: tuple[int, int]) -> OrderRun:
        return OrderRun(order, seconds, 10, 10, 0, 1000, cached, 20, work)

    result = Comparison((run("prefix", 9.0, 600, (500, 500)), run("prefix", 5.0, 500, (300, 700)),
                         run("prefix", 6.0, 700, (400, 400))),
                        (run("file", 10.0, 200, (600, 600)), run("file", 12.0, 100, (800, 800)),
                         run("file", 11.0, 300, (700, 700))), ideal_cached_tokens=800)
    assert (result.prefix.seconds, result.prefix.cached_tokens) == (6.0, 600)
    assert result.prefix.engine_computed_tokens == (400, 500)
    assert result.ratios()["seconds"] == pytest.approx(6 / 11) and result.ratios()["cached_tokens"] == 3.0
    table = format_comparison(result)
    assert table.count("(run ") == 6 and "| **prefix, median** | 6.0 |" in table
    assert "| prefix / file | 0.55x |" in table
    assert len(result.as_json()["runs"]) == 6


def _line(timestamp: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": timestamp, "input_length": 512 * len(ids), "output_length": 100,
                       "hash_ids": ids}) + "\n"


def test_only_conversations_with_enough_turns_are_kept_in_trace_order(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(_line(0, [0, 1]) + _line(1, [0, 5]) + _line(2, [0, 1, 2]) + _line(3, [0])
                     + _line(4, [0, 1, 2, 3]) + _line(5, [0, 5, 6]))
    picked = trace_conversations(str(trace), requests=5, scan=6, min_turns=2, length_scale=1 / 32,
                                 max_prompt_tokens=2048, output_tokens=2, vocab=5000)
    assert [len(r.prompt) for r in picked] == [32, 32, 48, 64, 48]  # every line but the one-block request
    assert [r.group for r in picked] == [1, 5, 1, 1, 5]
    assert all(r.max_tokens == 2 for r in picked)  # the trace's 100, scaled to 3, capped
    assert picked[2].prompt[:32] == picked[0].prompt  # turns of one conversation share their leading blocks
    with pytest.raises(ValueError, match="hold only 3 turns"):
        trace_conversations(str(trace), requests=4, scan=6, min_turns=3, length_scale=1 / 32,
                            max_prompt_tokens=2048, output_tokens=4, vocab=5000)


def test_bad_settings_stop_the_command_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "batch", "--length-scale", "2"]) == 2
    assert "--length-scale must be in (0, 1]" in capsys.readouterr().err
    assert main(["bench", "batch", "--workload", "synthetic", "--system-tokens", "256", "--kv-cache-blocks",
                 "8"]) == 2
    assert "raise --kv-cache-blocks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "batch", "--engines", "0"])


@pytest.mark.slow
def test_prefix_order_serves_every_shared_prefix_from_the_cache_and_file_order_does_not() -> None:
    """One engine whose cache holds one group's prompt, one request in flight: in prefix order every request
    after a group's first finds the group's system prompt cached (the ceiling); the shuffled file order switches
    groups, which evicts it."""
    requests: list[BenchRequest] = shared_prefix_requests(4, 4, 64, 8, 2, seed=3)
    plan = PoolPlan(engines=1, kv_cache_blocks=8, concurrency=1)
    result: Comparison = compare(plan, requests, timeout=300, progress=False)
    for run in (result.prefix, result.file):
        assert (run.requests, run.completed, run.failed) == (16, 16, 0)
        assert run.prompt_tokens == 16 * 72 and run.output_tokens == 16 * 2
    assert result.ideal_cached_tokens == 4 * 3 * 64
    assert result.prefix.cached_tokens == result.ideal_cached_tokens
    assert result.file.cached_tokens < result.prefix.cached_tokens
    # what the cache served, the engine did not compute
    (prefix_work,), (file_work,) = result.prefix.engine_computed_tokens, result.file.engine_computed_tokens
    assert file_work - prefix_work == result.prefix.cached_tokens - result.file.cached_tokens
    ratios = result.as_json()["ratios_prefix_over_file"]
    assert ratios["cached_tokens"] > 1 and ratios["hit_ratio"] > 1
    assert set(result.as_json()) == {"prefix", "file", "runs", "ideal_cached_tokens", "ratios_prefix_over_file"}
