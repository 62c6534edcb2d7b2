"""`kvmesh bench router`'s decision-latency part with small counts: the structure of its result, and that it times
real work (an index filled from event batches that matches what each pod was given, and a picker that chooses
the pod holding the longest prefix). No engine process, no timing assertions."""

from __future__ import annotations

import argparse
import time

import pytest

from kvmesh.bench.router import (
    add_parser,
    build_scene,
    decision_latency,
    prompt_text,
    summary_ms,
)
from kvmesh.bench.stats import percentile
from kvmesh.engine.model.loader import resolve_model_dir
from kvmesh.engine.model.tokenizer import Tokenizer
from kvmesh.engine.protocol import block_hashes

PARTS = ("tokenize", "hash", "match", "pick", "match_pick", "total", "hash_sha256_cbor", "tokenize_chat",
         "tokenize_cold")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model_dir(None, progress=False))


def test_the_prompt_has_the_requested_length(tokenizer: Tokenizer) -> None:
    text = prompt_text(tokenizer, 1000, seed=3)
    assert abs(len(tokenizer.encode(text)) - 1000) <= 2
    assert prompt_text(tokenizer, 1000, seed=3) == text


def test_the_index_holds_what_each_pod_was_given(tokenizer: Tokenizer) -> None:
    text = prompt_text(tokenizer, 2000)
    scene = build_scene(tokenizer, text, pods=64, other_blocks=1000, seed=1)
    assert scene.hashes == block_hashes(tokenizer.encode(text))
    assert len(scene.states) == 64 and len(scene.plans) == 64
    matches = scene.index.match(scene.hashes, scene.names, time.monotonic())
    held = {name: m.blocks for name, m in matches.items()}
    assert held == {name: plan.expected_match for name, plan in scene.plans.items()}
    for name, plan in scene.plans.items():  # the offloaded tail of a prefix is matched on the host tier
        assert matches[name].by_tier["host"] == plan.prefix_blocks - plan.host_from
        assert matches[name].provisional == plan.provisional_blocks
    assert any(plan.host_from < plan.prefix_blocks for plan in scene.plans.values())
    assert any(plan.provisional_blocks for plan in scene.plans.values())
    assert max(held.values()) == held[scene.longest] and list(held.values()).count(held[scene.longest]) == 1
    assert scene.index.size() > 64 * 600  # the pods' other prompts are indexed too
    # Without a clock the provisional continuation does not count: the index reads confirmed blocks only.
    confirmed = {name: m.blocks for name, m in scene.index.match(scene.hashes, scene.names).items()}
    assert confirmed == {name: plan.prefix_blocks for name, plan in scene.plans.items()}


def test_decision_latency_reports_each_part_and_picks_the_longest_prefix() -> None:
    result = decision_latency(pods=64, prompt_tokens=2000, decisions=20, other_blocks=1000, seed=2, warmup=2)
    assert result.pods == 64
    assert abs(result.prompt_tokens - 2000) <= 2 and result.prompt_blocks == result.prompt_tokens // 16
    assert set(result.parts) == set(PARTS)
    for name in PARTS:
        part = result.parts[name]
        assert part["count"] == 20, name
        assert 0 < part["p50_ms"] <= part["p99_ms"] <= part["max_ms"], name
    assert result.chosen_pod == result.longest_prefix_pod
    assert result.chosen_reason == "prefix"
    assert result.predicted_cached_tokens == result.longest_prefix_blocks * 16
    assert result.pods_matching == 64  # every pod holds the shared system prompt
    assert result.index_blocks > 64 * 600


def test_statistics_and_the_parser() -> None:
    assert percentile([1, 2, 3, 4, 5], 0.5) == 3
    assert percentile([0, 10], 0.99) == pytest.approx(9.9)
    s = summary_ms([1_000_000, 2_000_000, 3_000_000])
    assert s["p50_ms"] == 2.0 and s["max_ms"] == 3.0 and s["count"] == 3
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["router", "--no-proxy", "--json", "out.json"])
    assert (args.pods, args.prompt_tokens, args.decisions, args.requests) == (64, 8000, 500, 200)
    assert args.no_proxy and args.json == "out.json"
