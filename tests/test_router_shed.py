"""Load shedding as a pure function of a decision and a priority."""

from __future__ import annotations

from kvmesh.router.picker import Decision, PodState
from kvmesh.router.shed import ShedPolicy, overload, should_shed


def decision(ttft: float, overload_probability: float = 0.0) -> Decision:
    pod = PodState(name="a", url="http://a", overload_probability=overload_probability)
    return Decision(pod=pod, scores={"a": 1.0}, predicted_cached_tokens=0, estimated_ttft_seconds=ttft, reason="load")


def test_nothing_is_shed_within_the_slo() -> None:
    policy = ShedPolicy(ttft_slo_seconds=2.0)
    assert should_shed(decision(1.9), 0, policy) is None
    assert should_shed(decision(1.9), -1, policy) is not None  # low priority goes first, before the SLO breaks


def test_lowest_priority_is_shed_first_as_overload_grows() -> None:
    policy = ShedPolicy(ttft_slo_seconds=2.0, priority_headroom=0.5)
    shed_at = {}
    for priority in (-1, 0, 1, 2):
        shed_at[priority] = next(t / 10 for t in range(1, 200) if should_shed(decision(t / 10), priority, policy))
    assert shed_at[-1] < shed_at[0] < shed_at[1] < shed_at[2]
    assert shed_at[0] == 2.1


def test_the_kv_forecast_alone_can_shed() -> None:
    policy = ShedPolicy(ttft_slo_seconds=None, overload_probability=0.9)
    assert should_shed(decision(100.0, overload_probability=0.5), 0, policy) is None
    shed = should_shed(decision(0.1, overload_probability=0.99), 0, policy)
    assert shed is not None and shed.retry_after_seconds == 1 and "priority 0" in shed.message
    assert overload(decision(0.1, 0.45), policy) == 0.5


def test_an_idle_pool_sheds_no_priority() -> None:
    assert all(should_shed(decision(0.0), p, ShedPolicy(ttft_slo_seconds=2.0)) is None for p in range(-50, 50))


def test_retry_after_tracks_the_excess_wait() -> None:
    shed = should_shed(decision(9.2), 0, ShedPolicy(ttft_slo_seconds=2.0))
    assert shed is not None and shed.retry_after_seconds == 8
