"""Scaling in the cluster simulator: start-up delay, replica-seconds, draining, the HPA rule, the operator's own
decision wired to simulated engines' forecasts, and scale to zero (the router's hold, cold starts, failures)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from kvmesh.bench.autoscale import (
    BLOCK_SIZE,
    ROLE,
    PredictivePolicy,
    ReactivePolicy,
    Row,
    StaticPolicy,
    compare,
    versus,
)
from kvmesh.bench.autoscale_zero import ZeroSetup, deal, replay_pool, wakes
from kvmesh.bench.policies import RoundRobinPolicy, RouterPolicy
from kvmesh.bench.routing import picker_from_flags
from kvmesh.bench.sim import (
    Cluster,
    ClusterSpec,
    Counters,
    InstanceObservation,
    LatencyModel,
    Observation,
    build_requests,
)
from kvmesh.bench.traces import TraceRequest
from kvmesh.operator import scaling

FAST = LatencyModel(prefill_tokens_per_second=10_000.0, decode_step_seconds=0.01,
                    decode_step_per_sequence_seconds=0.0)


def requests(times: list[float], prompt: int = 1000, output: int = 10) -> list:  # type: ignore[type-arg]
    return build_requests([TraceRequest(t, prompt, output) for t in times], block_size=16)


@dataclass
class Script:
    """A scaling policy that answers from a list (one answer per period), then holds."""

    answers: list[int]
    name: str = "script"
    period_seconds: float = 15.0
    forecast_horizon_seconds: float | None = None

    def desired(self, observation: Observation) -> int:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_an_added_instance_serves_after_its_start_up_delay_and_is_paid_for_from_the_start() -> None:
    spec = ClusterSpec({"both": 1}, cache_tokens=100_000, block_size=16, latency=FAST, startup_seconds=60.0)
    cluster = Cluster(spec, RoundRobinPolicy(), Script([2]))
    result = cluster.run(requests([float(t) for t in range(0, 120, 2)]))
    served = {r.prefill_instance for r in result.requests if r.arrival < 75.0}
    assert served == {"both-0"}  # asked for at t=15, ready at t=75
    assert "both-1" in {r.prefill_instance for r in result.requests if r.arrival >= 76.0}
    end = result.requests[-1].finished_at
    assert result.replica_seconds == pytest.approx(15.0 + 2 * (end - 15.0))


def test_a_drained_instance_finishes_its_work_then_leaves_the_index() -> None:
    spec = ClusterSpec({"both": 2}, cache_tokens=100_000, block_size=16, latency=FAST)
    cluster = Cluster(spec, RouterPolicy(), Script([2, 1]))
    result = cluster.run(requests([float(t) for t in range(0, 60)]))
    assert len(cluster.instances) == 1 and len(result.requests) == 60
    gone = ({"both-0", "both-1"} - set(cluster.instances)).pop()
    assert gone not in cluster.index.pods()
    assert all(r.finished_at > r.arrival for r in result.requests)


def observation(usages: list[float], now: float = 0.0, arrivals: int = 0, counters: Counters | None = None
                ) -> Observation:
    pods = tuple(InstanceObservation(f"p{i}", "both", True, 1000, u, 0, 1, 0, 1e4, 0.02) for i, u in enumerate(usages))
    return Observation(now, 15.0, pods, arrivals, 0, counters or Counters())


def test_the_hpa_rule_with_its_tolerance_and_scale_down_window() -> None:
    hpa = ReactivePolicy()
    assert hpa.desired(observation([0.9] * 4, now=0.0)) == 5  # ceil(4 x 0.9 / 0.8)
    assert hpa.desired(observation([0.84] * 4, now=15.0)) == 4  # within 10 % of the target: no change
    assert hpa.desired(observation([0.2] * 5, now=30.0)) == 5  # 2 wanted, but 5 was asked for inside 5 minutes
    assert hpa.desired(observation([0.2] * 5, now=301.0)) == 4  # the 5 has left the window; the 4 (t=15) not yet
    assert hpa.desired(observation([0.2] * 5, now=316.0)) == 2
    fresh = ReactivePolicy()
    assert fresh.desired(observation([0.1] * 8, now=0.0)) == 8  # no scale-down before a whole window was seen
    assert StaticPolicy(3).desired(observation([1.0] * 3)) == 3


def test_the_predictive_policy_is_the_operators_decision_on_the_pools_traffic() -> None:
    ours = PredictivePolicy(scaling.ScalingPolicy({"both": 1}, {"both": 64}), exact_arrivals=True)
    quiet = ours.pool_observation(observation([0.1, 0.1], arrivals=30))
    assert quiet.arrival_rate == pytest.approx(2.0) and quiet.replicas == {"both": 2}
    # 20 requests/s, each holding ceil(1,200 / 128) = 10 blocks for 10 s (from the counters): 2,000 blocks more
    finished = Counters(finished=10, finished_seconds=100.0, prompt_tokens=10_000, output_tokens=2_000)
    busy = PredictivePolicy(scaling.ScalingPolicy({"both": 1}, {"both": 64}), exact_arrivals=True)
    seen = busy.pool_observation(observation([0.5, 0.5], arrivals=300, counters=finished))
    assert (seen.blocks_per_request, seen.request_seconds, seen.output_tokens) == (10, 10.0, 200.0)
    busy = PredictivePolicy(scaling.ScalingPolicy({"both": 1}, {"both": 64}), exact_arrivals=True)
    assert busy.desired(observation([0.5, 0.5], arrivals=300, counters=finished)) > 2


def test_the_operators_first_decision_reads_the_rate_since_the_pool_started() -> None:
    """Through the operator's estimator, not the simulator's count: its timer runs from the pool's start, whose
    scrape read every counter at 0, so the first decision has the rate since then (it had none, held the pool a
    period longer than the oracle and cost 23 SLO violations on the 16x Azure replay)."""
    ours = PredictivePolicy(scaling.ScalingPolicy({"both": 1}, {"both": 64}))
    pods = tuple(InstanceObservation(f"p{i}", "both", True, 1000, 0.1, 0, 1, 0, 1e4, 0.02, finished=14)
                 for i in range(2))
    first = ours.pool_observation(Observation(15.0, 15.0, pods, 30, 0, Counters()))
    assert first.arrival_rate == pytest.approx(2.0)  # 2 x (14 finished + 1 running) over 15 s


def test_the_simulated_operator_reads_the_rate_trend_as_the_operator_does() -> None:
    """The same trend as operator/forecast.py: a steady ramp keeps its slope, a burst that turned (30, 45, then
    38 requests/s) projects none (a plain least-squares fit would read +0.27 requests/s per second)."""
    def slope(rates: list[int]) -> float:
        ours = PredictivePolicy(scaling.ScalingPolicy({"both": 1}, {"both": 64}), exact_arrivals=True)
        seen = [ours.pool_observation(observation([0.1], now=15.0 * i, arrivals=15 * r)) for i, r in enumerate(rates)]
        return seen[-1].arrival_rate_slope

    assert slope([30, 33, 36]) == pytest.approx(0.2)
    assert slope([30, 45, 38]) == 0.0


def test_the_simulated_engines_forecast_reaches_the_operator() -> None:
    spec = ClusterSpec({"both": 1}, cache_tokens=20_000, block_size=16, latency=FAST)
    seen: list[Observation] = []

    @dataclass
    class Watch(Script):
        forecast_horizon_seconds: float | None = 30.0

        def desired(self, observation: Observation) -> int:
            seen.append(observation)
            return 1

    Cluster(spec, RouterPolicy(), Watch([1])).run(requests([t * 0.05 for t in range(400)], output=400))
    forecasts = [i.forecast for o in seen for i in o.instances if i.forecast is not None]
    assert forecasts and max(f.usage_quantiles["p90"] for f in forecasts) > 0.3
    assert sum(o.arrivals for o in seen) <= 400 and seen[0].arrivals == 300  # 15 s at 20 per second


def test_the_simulated_engines_fit_their_step_cost_and_the_operator_sizes_for_the_itl_objective() -> None:
    """Simulated steps cost 10 ms plus 0.5 ms a further sequence: each instance's fit (the engine's own,
    engine/step_cost.py) finds that line, and the operator's policy turns it into pods for an ITL objective."""
    latency = LatencyModel(prefill_tokens_per_second=50_000.0, decode_step_seconds=0.01,
                           decode_step_per_sequence_seconds=0.0005)
    spec = ClusterSpec({"both": 1}, cache_tokens=200_000, block_size=16, latency=latency)
    seen: list[Observation] = []

    @dataclass
    class Watch(Script):
        def desired(self, observation: Observation) -> int:
            seen.append(observation)
            return 1

    outputs = [20 + (t * 37) % 200 for t in range(300)]  # staggered ends: the batch varies
    Cluster(spec, RouterPolicy(), Watch([1])).run(
        build_requests([TraceRequest(t * 0.1, 200, out) for t, out in enumerate(outputs)], block_size=16))
    cost = seen[-1].instances[0].decode_step_cost
    assert cost is not None
    for batch in (1, 10, 40):
        assert cost.seconds(batch, batch * 300) == pytest.approx(latency.step_seconds(batch), rel=0.01)
    ours = PredictivePolicy(scaling.ScalingPolicy({"both": 1}, {"both": 64}, itl_seconds=0.03), exact_arrivals=True)
    obs = ours.pool_observation(seen[-1])
    assert obs.pods[0].decode_step_cost == cost and obs.decode_context_tokens > 200
    # within 30 ms a pod batches 41 sequences (10 ms + 40 x 0.5 ms): 41 / 0.03 tokens/s
    assert scaling.decode_speed(obs.pods, obs, 0.03) == pytest.approx(41 / 0.03, rel=0.02)


def test_picker_weights_from_flags_as_the_router_reads_them() -> None:
    assert picker_from_flags(["prefix_weight=2", "ttft_weight=0"]).prefix_weight == 2.0
    with pytest.raises(ValueError, match="NAME=VALUE"):
        picker_from_flags(["prefix_weight"])
    with pytest.raises(ValueError, match="unknown picker setting"):
        picker_from_flags(["nope=1"])


def test_kvmesh_is_compared_with_a_reactive_run_that_spent_at_least_as_much() -> None:
    def r(name: str, violations: int, cost: float) -> Row:
        return Row(name, violations, 0.0, 0.0, 0.0, cost, 0.0, 0)

    ours = r("kvmesh", 10, 100.0)
    against, fewer = compare(ours, [r("hpa 80%", 50, 90.0), r("hpa 70%", 40, 110.0), r("hpa 60%", 30, 130.0)])
    assert against is not None and against.policy == "hpa 60%" and fewer == pytest.approx(1 - 10 / 30)
    assert compare(ours, [r("hpa 80%", 50, 90.0)]) == (None, 0.0)
    # and against the HPA rule at the same target: 80 % fewer violations for 1.11x its replica-seconds
    assert versus(ours, r("hpa 80%", 50, 90.0)) == pytest.approx((0.8, 100 / 90))
    assert versus(ours, r("hpa 80%", 0, 90.0))[0] is None  # the rule had none: no reduction to claim


# ---- scale to zero: the router's hold, cold starts, and the operator's own decision ----------------------------

ZERO = ZeroSetup(idle_seconds=60.0, cold_start_seconds=30.0)


def sparse(times: list[float]) -> list:  # type: ignore[type-arg]
    return build_requests([TraceRequest(t, 300, 5) for t in times], block_size=BLOCK_SIZE)


def test_an_idle_pool_goes_to_zero_and_spends_fewer_replica_seconds_than_one_kept_at_one() -> None:
    trace = sparse([0.0, 1.0, 2.0, 600.0])
    kept = replay_pool(trace, ZERO, scale_to_zero=False, until=700.0)
    zero = replay_pool(trace, ZERO, scale_to_zero=True, until=700.0)
    assert min(n for _, n in kept.replicas_over_time) == 1
    assert 0 in [n for _, n in zero.replicas_over_time] and wakes(zero) == 1
    # at 0 from the first tick 60 s idle (about 75 s) until the request at 600 s wakes it
    assert zero.replica_seconds < kept.replica_seconds - 400
    assert len(zero.requests) == 4 and not zero.failed


def test_a_request_at_zero_is_held_through_the_cold_start_and_its_ttft_includes_it() -> None:
    zero = replay_pool(sparse([0.0, 600.0]), ZERO, scale_to_zero=True, until=700.0)
    late = zero.requests[-1]
    assert zero.held() == [late]
    # the operator sees it at its next tick (within 15 s), then the instance takes its 30 s to serve
    assert ZERO.cold_start_seconds <= late.held_seconds <= ZERO.cold_start_seconds + 15.0 + 1e-6
    assert late.ttft >= late.held_seconds and late.ttft < late.held_seconds + 1.0
    assert zero.requests[0].held_seconds == 0.0

    instant = replace(ZERO, cold_start_seconds=0.0)  # an instance ready as soon as it is asked for
    woken = replay_pool(sparse([0.0, 600.0]), instant, scale_to_zero=True, until=700.0)
    assert not woken.failed and woken.requests[-1].held_seconds <= 15.0 + 1e-6  # the next tick, not the hold


def test_past_the_held_cap_or_the_hold_a_request_fails_as_the_routers_503() -> None:
    burst = sparse([0.0, *(600.0 + i * 0.01 for i in range(5))])
    capped = replay_pool(burst, replace(ZERO, max_held=3), scale_to_zero=True, until=700.0)
    assert len(capped.failed) == 2 and len(capped.requests) == 4  # the first, and the three held
    assert all(r.held_seconds == 0.0 and r.failed_at == r.arrival for r in capped.failed)  # refused at once
    short = replay_pool(burst, replace(ZERO, hold_seconds=20.0), scale_to_zero=True, until=700.0)
    assert len(short.failed) == 5 and all(r.held_seconds == pytest.approx(20.0) for r in short.failed)


def test_a_wake_is_sized_by_the_held_requests_over_max_num_seqs_as_the_operator_does() -> None:
    setup = replace(ZERO, max_num_seqs=4)
    # the ten arrive between two ticks (every 15 s from the first arrival): the tick at 615 s sees them all held
    zero = replay_pool(sparse([0.0, *(601.0 + i * 0.01 for i in range(10))]), setup, scale_to_zero=True,
                       until=700.0)
    counts = [n for _, n in zero.replicas_over_time]
    woken = next(n for n in counts[counts.index(0):] if n)  # the first decision after the pool reached 0
    assert woken == scaling.wake_replicas(10, setup.policy(True), ROLE) == 3  # ceil(10 / 4)
    assert len(zero.requests) == 11 and not zero.failed


def test_pools_are_dealt_by_zipf_popularity_deterministically() -> None:
    trace = sparse([float(t) for t in range(2000)])
    pools = deal(trace, 8, 1.5)
    sizes = [len(p) for p in pools]
    assert sum(sizes) == 2000 and sizes[0] > 3 * sizes[-1] and pools == deal(trace, 8, 1.5)
    assert all(p == sorted(p, key=lambda r: r.arrival) for p in pools)
