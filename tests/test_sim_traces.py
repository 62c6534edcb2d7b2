"""Trace loaders: the formats the simulator, the serving benchmark and the autoscaling study replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench.traces import (
    MOONCAKE_TRACE,
    TraceRequest,
    block_token_ids,
    ideal_hit_ratio,
    load_azure,
    load_mooncake,
    prompt_token_ids,
)


def write_mooncake(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_rows_become_requests_in_seconds_with_speedup(tmp_path: Path) -> None:
    trace = write_mooncake(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 3000, "input_length": 600, "output_length": 7, "hash_ids": [0, 2]},
    ])
    assert load_mooncake(trace, speedup=2.0) == [TraceRequest(0.0, 1000, 5, (0, 1)), TraceRequest(1.5, 600, 7, (0, 2))]
    assert len(load_mooncake(trace, limit=1)) == 1


def test_mooncake_ids_that_are_not_chained_are_refused(tmp_path: Path) -> None:
    trace = write_mooncake(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1, "input_length": 1000, "output_length": 5, "hash_ids": [2, 1]},
    ])
    with pytest.raises(ValueError, match="hash id 1 follows 2"):
        load_mooncake(trace)


def test_a_bad_line_names_the_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1"):
        load_mooncake(trace)
    with pytest.raises(ValueError, match="does not exist"):
        load_mooncake(tmp_path / "missing.jsonl")


def test_azure_rows_become_arrivals_from_the_first(tmp_path: Path) -> None:
    trace = tmp_path / "a.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
    requests = load_azure(trace, speedup=2.0)
    assert [(r.input_tokens, r.output_tokens) for r in requests] == [(374, 44), (396, 109)]
    assert requests[0].arrival == 0.0 and requests[1].arrival == pytest.approx(4.314579 / 2)


def test_same_id_same_tokens_and_prompts_cut_to_length() -> None:
    assert block_token_ids(7, 4) == [28, 29, 30, 31]
    assert block_token_ids(7, 4, vocab_size=100) == block_token_ids(7, 4, vocab_size=100)
    assert all(0 <= t < 100 for t in block_token_ids(7, 512, vocab_size=100))
    assert prompt_token_ids(TraceRequest(0.0, 6, 1, (0, 1)), block_tokens=4) == [0, 1, 2, 3, 4, 5]


def test_ideal_hit_ratio_counts_only_full_blocks_of_a_seen_prefix() -> None:
    requests = [
        TraceRequest(0.0, 1024, 1, (0, 1)),  # cold: 0 of 1024
        TraceRequest(1.0, 1200, 1, (0, 1, 2)),  # blocks 0 and 1 seen: 1024 of 1200
        TraceRequest(2.0, 1024, 1, (0, 1)),  # only block 0 usable (the last token is always computed): 512
        TraceRequest(3.0, 1024, 1, (3, 1)),  # another first block: 0
    ]
    assert ideal_hit_ratio(requests) == pytest.approx((1024 + 512) / (1024 + 1200 + 1024 + 1024))


@pytest.mark.skipif(not MOONCAKE_TRACE.is_file(), reason="the shared traces are not on this machine")
def test_the_mooncake_trace_matches_its_published_facts() -> None:
    requests = load_mooncake()
    assert len(requests) == 12031
    assert ideal_hit_ratio(requests) == pytest.approx(0.374, abs=0.002)
