"""`kvmesh bench transfer` with the tiny random model: two real engine processes, one short prompt, one frame
size. It checks what was moved and computed, not how fast."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvmesh.bench.transfer import add_parser, near_best, pulled_blocks, random_prompt, run

# the tiny model of conftest.py: 2 layers x (K, V) x 16 tokens x 2 KV heads x head_dim 16 x 4 bytes (fp32)
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * (64 // 4) * 4


def test_prompts_blocks_and_where_the_curve_flattens() -> None:
    a = random_prompt(300, 49152, seed=0, tag="prompt")
    assert len(a) == 300 and min(a) >= 100 and max(a) < 49152
    assert a == random_prompt(300, 49152, seed=0, tag="prompt")
    assert a != random_prompt(300, 49152, seed=1, tag="prompt")
    assert a[:100] != random_prompt(100, 49152, seed=0, tag="prompt")  # fresh per length: no shared prefix
    assert pulled_blocks(512) == 31 and pulled_blocks(513) == 32 and pulled_blocks(100) == 6
    assert near_best({1: 100.0, 8: 400.0, 32: 950.0, 128: 1000.0}) == [128, 32]
    assert near_best({1: 950.0, 8: 1000.0, 32: 800.0}) == [8, 1]
    assert near_best({1: 0.0}) == []


@pytest.mark.slow
def test_a_pull_moves_the_prompt_blocks_and_saves_their_compute(tiny_dir: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="bench"))
    out = tmp_path / "transfer.json"
    args = parser.parse_args(["transfer", "--model", str(tiny_dir), "--lengths", "200", "--frames", "4",
                              "--kv-cache-memory-mib", "16", "--repeats", "2", "--raw-repeats", "2",
                              "--startup-timeout", "120", "--request-timeout", "60", "--json", str(out)])
    assert run(args) == 0
    result = json.loads(out.read_text())
    assert result["block_bytes"] == TINY_BLOCK_BYTES
    (point,) = result["points"]
    blocks = (200 - 1) // 16
    assert point["prompt_tokens"] == 200 and point["frame_blocks"] == 4 and point["blocks"] == blocks == 12
    assert point["pull_ok"] and point["pulls"] == 2 and len(point["ttft_cold_all"]) == 2
    assert len(point["raw_seconds_all"]) == 4
    assert point["bytes_moved"] == blocks * TINY_BLOCK_BYTES
    assert point["peer_tokens"] == blocks * 16
    # the puller computed only the tail the pull left; cold, the whole prompt
    assert point["computed_tokens_cold"] == 200
    assert point["computed_tokens_pull"] == 200 - blocks * 16 < point["computed_tokens_cold"]
    # the raw fetch got the same blocks, in frames of 4, with a JSON header in front of each frame
    assert point["raw_blocks"] == blocks and point["frames"] == 3
    assert point["raw_bytes"] > blocks * TINY_BLOCK_BYTES
    assert point["transfer_seconds"] > 0 and point["raw_seconds"] > 0 and point["ttft_cold_seconds"] > 0
    assert result["near_best"]["pull"] == {"200": [4]}
    table = capsys.readouterr().out
    assert "| 200 | 4 | 12 (3) | 98,304 |" in table and "failed" not in table
