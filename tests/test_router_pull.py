"""The pull-or-recompute decision as a pure function."""

from __future__ import annotations

from kvmesh.router.index import PrefixMatch
from kvmesh.router.picker import PickerConfig, PodState, RequestInfo
from kvmesh.router.pull import PullPolicy, plan_pull

BLOCK_BYTES = 737_280  # SmolLM2, fp32


def match(blocks: int, provisional: int = 0) -> PrefixMatch:
    return PrefixMatch(blocks, {"device": blocks, "host": 0, "disk": 0}, provisional)


def pods(speed: float = 500.0) -> list[PodState]:
    return [PodState(name=n, url=f"http://{n}", prefill_tokens_per_second=speed) for n in ("a", "b", "c")]


def test_a_slow_prefill_pulls_the_longest_prefix_from_a_peer() -> None:
    a, b, c = pods()
    request = RequestInfo("m", 1000, tuple(range(62)))
    plan = plan_pull(a, request, [a, b, c], {"a": match(4), "b": match(40), "c": match(20)}, BLOCK_BYTES,
                     PickerConfig())
    assert plan is not None and plan.source.name == "b" and plan.tokens == 640 and plan.seconds_saved > 0


def test_fast_prefill_or_a_slow_link_recomputes() -> None:
    a, b, _ = pods(speed=1e7)
    request = RequestInfo("m", 1000, tuple(range(62)))
    assert plan_pull(a, request, [a, b], {"b": match(40)}, BLOCK_BYTES, PickerConfig()) is None
    a, b, _ = pods(speed=500.0)
    slow_link = PullPolicy(bytes_per_second=1e3)
    assert plan_pull(a, request, [a, b], {"b": match(40)}, BLOCK_BYTES, PickerConfig(), slow_link) is None


def test_nothing_to_gain_and_unusable_peers() -> None:
    a, b, _ = pods()
    request = RequestInfo("m", 1000, tuple(range(62)))
    assert plan_pull(a, request, [a, b], {"a": match(40), "b": match(41)}, BLOCK_BYTES, PickerConfig()) is None
    sick = PodState(name="b", url="http://b", healthy=False)
    assert plan_pull(a, request, [a, sick], {"b": match(40)}, BLOCK_BYTES, PickerConfig()) is None
    # blocks the peer holds only provisionally (not yet computed there) cannot be fetched
    assert plan_pull(a, request, [a, b], {"b": match(40, provisional=40)}, BLOCK_BYTES, PickerConfig()) is None


def test_the_last_block_stays_to_compute() -> None:
    a, b, _ = pods()
    request = RequestInfo("m", 64, tuple(range(4)))  # 4 full blocks; the engine computes the 64th token
    plan = plan_pull(a, request, [a, b], {"b": match(4)}, BLOCK_BYTES, PickerConfig(), PullPolicy(setup_seconds=0))
    assert plan is not None and plan.tokens == 48
