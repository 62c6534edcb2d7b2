"""The cluster simulator: hand-checked hit ratios and latencies on small traces, pulls, hand-offs, determinism,
and proof that kvmesh's policy is the router's code (a picker weight in its configuration changes the result)."""

from __future__ import annotations

import random

import pytest

from kvmesh.bench.policies import RandomPolicy, RoundRobinPolicy, RouterPolicy
from kvmesh.bench.sim import ClusterSpec, LatencyModel, SimRequest, build_requests, simulate
from kvmesh.bench.traces import TraceRequest, ideal_hit_ratio, prompt_token_ids
from kvmesh.engine.protocol import block_hashes
from kvmesh.router.picker import PickerConfig

B = 512  # the Mooncake trace's block size
SLOW = LatencyModel(prefill_tokens_per_second=1024.0, decode_step_seconds=0.03, decode_step_per_sequence_seconds=0.0)


def trace(*rows: tuple[float, int, tuple[int, ...]], output: int = 1) -> list[SimRequest]:
    return build_requests([TraceRequest(t, n, output, ids) for t, n, ids in rows])


def hit_ratio(requests: list[SimRequest], spec: ClusterSpec, policy=None) -> float:  # type: ignore[no-untyped-def]
    return simulate(requests, spec, policy or RoundRobinPolicy()).hit_ratio


def test_block_hashes_are_the_engines_for_the_synthetic_prompt() -> None:
    request = TraceRequest(0.0, 1300, 1, (4, 9, 2))
    built = build_requests([request])[0]
    assert list(built.block_hashes) == block_hashes(prompt_token_ids(request), B)  # two full blocks
    assert len(built.block_hashes) == 2


def test_one_instance_hits_what_it_has_seen_of_a_prefix() -> None:
    requests = trace(
        (0.0, 1024, (0, 1)),  # cold
        (10.0, 1536, (0, 1, 2)),  # blocks 0 and 1 cached: 1024
        (20.0, 1024, (0, 1)),  # the last token is always computed: only block 0, 512
        (30.0, 700, (5, 6)),  # another prefix: 0
    )
    spec = ClusterSpec({"prefill": 1}, cache_tokens=100 * B, latency=SLOW)
    result = simulate(requests, spec, RoundRobinPolicy())
    assert [r.cached_tokens for r in result.requests] == [0, 1024, 512, 0]
    assert result.hit_ratio == pytest.approx(1536 / (1024 + 1536 + 1024 + 700))
    assert result.hit_ratio == pytest.approx(ideal_hit_ratio([TraceRequest(r.arrival, r.prompt_tokens, 1, r.hash_ids)
                                                              for r in requests]))


def test_a_small_cache_evicts_what_an_unbounded_one_keeps() -> None:
    requests = trace((0.0, 1536, (0, 1, 2)), (10.0, 1536, (3, 4, 5)), (20.0, 1536, (0, 1, 2)))
    assert hit_ratio(requests, ClusterSpec({"prefill": 1}, cache_tokens=3 * B, latency=SLOW)) == 0.0
    assert hit_ratio(requests, ClusterSpec({"prefill": 1}, cache_tokens=6 * B, latency=SLOW)) == pytest.approx(
        1024 / (3 * 1536))


def test_the_router_keeps_conversations_where_their_prefix_is_and_round_robin_does_not() -> None:
    requests = trace(
        (0.0, 1536, (0, 1, 2)),  # A, turn 1
        (0.1, 1536, (10, 11, 12)),  # B, turn 1
        (100.0, 2048, (10, 11, 12, 13)),  # B, turn 2 (round robin sends it to A's instance)
        (100.1, 2048, (0, 1, 2, 3)),  # A, turn 2
    )
    spec = ClusterSpec({"prefill": 2}, cache_tokens=100 * B, latency=SLOW)
    assert hit_ratio(requests, spec, RoundRobinPolicy()) == 0.0
    routed = simulate(requests, spec, RouterPolicy())
    assert [r.cached_tokens for r in routed.requests] == [0, 0, 1536, 1536]
    assert routed.requests[0].prefill_instance == routed.requests[3].prefill_instance


def test_a_prefix_pulled_from_a_busy_peer_counts_as_cached() -> None:
    conversation = tuple(range(10))
    requests = trace(
        (0.0, 5120, conversation),  # turn 1 on prefill-0 (both idle: the tie-break's choice for this request)
        # a long prompt keeps prefill-0 busy for 50 s (idle tie again; ids whose tie-break picks prefill-0)
        (6.0, 51200, tuple(range(200, 300))),
        (7.0, 5632, (*conversation, 10)),  # turn 2: prefill-1 answers sooner, and pulls the 10 blocks
    )
    spec = ClusterSpec({"prefill": 2}, cache_tokens=200 * B, latency=SLOW)
    result = simulate(requests, spec, RouterPolicy())
    turn2 = result.requests[2]
    assert [r.prefill_instance for r in result.requests] == ["prefill-0", "prefill-0", "prefill-1"]
    assert turn2.cached_tokens == turn2.pulled_tokens == 5120
    transfer = SLOW.transfer_seconds(5120)
    assert turn2.ttft == pytest.approx(transfer + 512 / 1024)
    without = simulate(requests, spec, RouterPolicy(pulls=False)).requests[2]
    assert without.cached_tokens == 0 and without.ttft == pytest.approx(5632 / 1024)


def test_decode_steps_stop_for_a_newcomer_after_the_step_in_flight() -> None:
    requests = trace((0.0, 1024, (0, 1)), output=3) + trace((1.04, 1024, (5, 6)), output=3)[:1]
    requests[1].rid = "r1"
    spec = ClusterSpec({"both": 1}, cache_tokens=100 * B, latency=SLOW)
    first, second = simulate(requests, spec, RoundRobinPolicy()).requests
    assert first.ttft == pytest.approx(1.0)  # 1024 tokens at 1024 tokens/s
    assert first.finished_at == pytest.approx(1.06) and first.mean_itl == pytest.approx(0.03)
    assert second.ttft == pytest.approx(1.06 + 1.0 - 1.04)  # waited for the step in flight (1.03 to 1.06)


def test_a_disaggregated_request_moves_its_kv_then_decodes() -> None:
    latency = LatencyModel(prefill_tokens_per_second=1024.0, decode_step_seconds=0.03,
                           decode_step_per_sequence_seconds=0.0, kv_bytes_per_token=1000,
                           transfer_bytes_per_second=1e6, transfer_setup_seconds=0.0)
    spec = ClusterSpec({"prefill": 1, "decode": 1}, cache_tokens=100 * B, latency=latency)
    result = simulate(trace((0.0, 1024, (0, 1)), output=3), spec, RouterPolicy())
    (request,) = result.requests
    assert (request.prefill_instance, request.decode_instance) == ("prefill-0", "decode-1")
    assert request.ttft == pytest.approx(1.0)
    assert request.finished_at == pytest.approx(1.0 + 1.024 + 0.06)  # prefill, 1,024 tokens' KV, two steps
    assert result.itl_quantile(0.0) == pytest.approx(0.03) and result.itl_quantile(1.0) == pytest.approx(1.054)


def conversations(n: int, seed: int) -> list[SimRequest]:
    """Chat sessions whose turns extend their previous prompt, arriving faster than 4 instances serve."""
    rng = random.Random(seed)
    rows = []
    next_id = 1
    sessions: list[tuple[int, ...]] = []
    for i in range(n):
        if sessions and rng.random() < 0.6:
            k = rng.randrange(len(sessions))
            ids = (*sessions[k], *range(next_id, next_id + rng.randint(1, 3)))
            sessions[k] = ids
        else:
            ids = (0, *range(next_id, next_id + rng.randint(2, 8)))
            sessions.append(ids)
        next_id += 10
        rows.append((i * 0.5, len(ids) * B - rng.randrange(B), ids))
    return trace(*rows)


SPEC4 = ClusterSpec({"prefill": 4}, cache_tokens=40 * B, latency=LatencyModel(prefill_tokens_per_second=5000.0))


def test_the_same_seed_gives_the_same_replay() -> None:
    requests = conversations(200, seed=1)
    for policy in (lambda: RandomPolicy(3), RouterPolicy):
        a, b = simulate(requests, SPEC4, policy()), simulate(requests, SPEC4, policy())
        assert [(r.prefill_instance, r.cached_tokens, r.ttft) for r in a.requests] == [
            (r.prefill_instance, r.cached_tokens, r.ttft) for r in b.requests]
    one, other = simulate(requests, SPEC4, RandomPolicy(3)), simulate(requests, SPEC4, RandomPolicy(4))
    assert [r.prefill_instance for r in one.requests] != [r.prefill_instance for r in other.requests]


def test_a_scorer_weight_in_the_configuration_changes_the_result() -> None:
    requests = conversations(200, seed=2)
    default = simulate(requests, SPEC4, RouterPolicy(PickerConfig()))
    blind = simulate(requests, SPEC4, RouterPolicy(PickerConfig(prefix_weight=0.0, ttft_weight=0.0), pulls=False))
    assert default.hit_ratio > blind.hit_ratio + 0.1
    assert default.mean_ttft < blind.mean_ttft
    assert [r.prefill_instance for r in default.requests] != [r.prefill_instance for r in blind.requests]


def test_equal_idle_pods_share_new_prefixes() -> None:
    """An idle pool ties on every new conversation: the picker's per-request tie-break spreads them over all
    pods instead of sending each to the first name."""
    requests = trace(*[(10.0 * i, 1024, (1000 + 2 * i, 1001 + 2 * i)) for i in range(40)])
    spec = ClusterSpec({"prefill": 4}, cache_tokens=100 * B, latency=SLOW)
    spread = simulate(requests, spec, RouterPolicy())
    assert len({r.prefill_instance for r in spread.requests}) == 4
    assert spread.imbalance < 2.0
