"""Scaling by predicted KV utilization (operator/scaling.py): the pure decision on synthetic pool states, and a
scripted arrival ramp on a simulated clock, in which replicas must rise early enough that the new pods are
ready before any pod's usage reaches 95 %."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvmesh.engine.protocol import DEFAULT_MAX_NUM_SEQS, DecodeStepCost
from kvmesh.operator.crd import load_pool_file, parse_pool
from kvmesh.operator.forecast import Counters, TrafficEstimator, rate_trend, scaling_policy
from kvmesh.operator.scaling import (
    PodObservation,
    PoolObservation,
    Recommendation,
    RoleDecision,
    ScalingPolicy,
    arrivals,
    decide,
    decode_speed,
    fewest_pods,
    holding,
    little_calibrated,
    scale_in_order,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
POLICY = ScalingPolicy(min_replicas={"both": 1}, max_replicas={"both": 8}, horizon_seconds=60,
                       scale_down_stabilization_seconds=300)


def pod(name: str, usage: float, p50: float, p90: float, p99: float, overload: float = 0.0, role: str = "both",
        blocks: int = 1000, **extra: float) -> PodObservation:
    return PodObservation(name, role, blocks, usage=usage, forecast={"p50": p50, "p90": p90, "p99": p99},
                          overload_probability=overload, **extra)


def quiet(n: int, role: str = "both") -> list[PodObservation]:
    return [pod(f"{role}-{i}", 0.2, 0.2, 0.25, 0.3, role=role) for i in range(n)]


def test_quantiles_interpolate_between_the_forecast_levels_and_extend_past_p99() -> None:
    p = pod("a", usage=0.1, p50=0.3, p90=0.5, p99=0.68)
    assert p.quantile(0.5) == pytest.approx(0.3)
    assert p.quantile(0.7) == pytest.approx(0.4)
    assert p.quantile(0.25) == pytest.approx(0.2)  # between "now" (level 0) and p50
    assert p.quantile(0.995) == pytest.approx(0.69)  # the p90..p99 slope continues
    assert PodObservation("b", "both", 100, usage=0.4).quantile(0.9) == 0.4  # no forecast yet: usage now


def test_a_quiet_pool_holds_and_a_predicted_overload_scales_up_before_usage_is_high() -> None:
    calm = decide(PoolObservation(0, quiet(1), {"both": 1}), POLICY)
    assert calm.replicas == {"both": 1} and calm.roles["both"].reason == "HoldWithinTarget"
    # Usage is only 50 % now, but both pods forecast a climb past 95 % with 20 % probability.
    rising = [pod(f"p{i}", 0.5, 0.7, 0.97, 1.1, overload=0.2) for i in range(2)]
    up = decide(PoolObservation(0, rising, {"both": 2}), POLICY)
    assert up.roles["both"].reason == "ScaleUpPredictedOverload"
    assert up.roles["both"].overload_probability >= 0.1
    # Sized so the p90 demand (2 x 970 blocks) fits at the 80 % target: ceil(1940 / 800) = 3.
    assert up.replicas == {"both": 3}


def test_the_threshold_is_the_policy_s() -> None:
    rising = [pod("a", 0.5, 0.7, 0.9, 0.97, overload=0.05)]  # crosses 95 % somewhere between p90 and p99
    # Sized for 95 %, so only the overload probability can ask for more.
    strict = ScalingPolicy(min_replicas={"both": 1}, max_replicas={"both": 4}, target_utilization=0.95)
    lenient = ScalingPolicy(min_replicas={"both": 1}, max_replicas={"both": 4}, target_utilization=0.95,
                            overload_threshold=0.02)
    assert decide(PoolObservation(0, rising, {"both": 1}), strict).roles["both"].reason == "HoldWithinTarget"
    assert decide(PoolObservation(0, rising, {"both": 1}), lenient).roles["both"].reason == "ScaleUpPredictedOverload"


def test_a_predicted_peak_above_target_scales_up_before_any_overload_is_likely() -> None:
    """At 85 % now with a 90 % p90 forecast, P(> 95 %) is under the threshold, but 2 pods of 1,000 blocks at
    900 blocks each need 3 at the 80 % target: the pool is resized now, a start-up delay before it would be
    overloaded, rather than once it is (the HPA rule, on the predicted peak instead of the current usage)."""
    warm = [pod(f"p{i}", 0.85, 0.87, 0.9, 0.93, overload=0.01) for i in range(2)]
    d = decide(PoolObservation(0, warm, {"both": 2}), POLICY)
    assert d.roles["both"].overload_probability < POLICY.overload_threshold
    assert d.replicas == {"both": 3} and d.roles["both"].reason == "ScaleUpPredictedAboveTarget"


def test_queued_requests_count_as_demand_now() -> None:
    """Pods at 70 % whose forecasts see their requests end within the horizon still need room for the 20
    requests (of 30 blocks) waiting at each: 2 x (700 + 600) blocks over an 800-block target is 4 pods."""
    queued = [pod(f"p{i}", 0.7, 0.1, 0.1, 0.1, waiting=20) for i in range(2)]
    assert decide(PoolObservation(0, queued, {"both": 2}), POLICY).replicas == {"both": 2}  # no size per request
    d = decide(PoolObservation(0, queued, {"both": 2}, blocks_per_request=30), POLICY)
    assert d.replicas == {"both": 4} and d.roles["both"].predicted_usage == pytest.approx(1.3)


def test_arrivals_are_sized_by_what_requests_hold_now() -> None:
    """The log says 2 requests/s of 40 blocks for 20 s (1,600 blocks in flight), but the pods hold 1,000: a
    request holds 25 blocks on average over its time (its output grows, it holds nothing while queued). The
    arrivals at the horizon are sized from that (Little's law), not from the peak: 1,000 blocks at p50, not
    1,600, so 2 pods of 1,000 blocks at the 80 % target suffice where the peak figure would ask for 3."""
    pods = [pod(f"p{i}", 0.5, 0.0, 0.0, 0.0) for i in range(2)]
    obs = PoolObservation(0, pods, {"both": 2}, arrival_rate=2.0, blocks_per_request=40, request_seconds=20)
    assert little_calibrated(obs, 1000).blocks_per_request == pytest.approx(25)
    assert arrivals(little_calibrated(obs, 1000), 60).blocks(0.5) == pytest.approx(1000)
    d = decide(obs, POLICY)
    assert d.replicas == {"both": 2} and d.roles["both"].reason == "HoldWithinTarget"


def test_the_pool_s_arrivals_are_added_to_what_the_pods_forecast() -> None:
    """The pods see only their own requests (just admitted: nothing held yet, 30 % at the horizon's p99); the
    operator knows 2 requests/s of 40 blocks each, lasting 20 s, are coming: about 1,600 more blocks at the
    horizon, so 2 pods of 1,000 blocks are not enough. (Pods that hold nothing give Little's law nothing to
    read, so the log's figure is used.)"""
    pods = [pod(f"both-{i}", 0.0, 0.2, 0.25, 0.3) for i in range(2)]
    alone = decide(PoolObservation(0, pods, {"both": 2}), POLICY)
    busy = PoolObservation(0, pods, {"both": 2}, arrival_rate=2.0, blocks_per_request=40, request_seconds=20)
    assert arrivals(busy, 60).blocks(0.5) == pytest.approx(2.0 * 20 * 40)
    assert arrivals(busy, 60).blocks(0.9) > arrivals(busy, 60).blocks(0.5)  # Poisson spread at higher levels
    with_arrivals = decide(busy, POLICY)
    assert alone.replicas == {"both": 2}
    assert with_arrivals.roles["both"].reason == "ScaleUpPredictedOverload" and with_arrivals.replicas["both"] >= 3
    # A rising trend projects more arrivals at the horizon than the current rate.
    ramp = PoolObservation(0, pods, {"both": 2}, arrival_rate=2.0, arrival_rate_slope=0.05, blocks_per_request=40,
                           request_seconds=20)
    assert arrivals(ramp, 60).blocks(0.5) == pytest.approx(20 * (2.0 + 0.05 * 50) * 40)


def trend_of(rates: list[float], period: float = 15.0) -> float:
    """The operator's trend estimate after one rate per period (counted from the pods' finished requests)."""
    est, finished = TrafficEstimator(), 0.0
    traffic = est.update(0.0, [("a", Counters())], 16)
    for i, rate in enumerate(rates, start=1):
        finished += rate * period
        traffic = est.update(i * period, [("a", Counters(finished=finished))], 16)
    assert traffic.arrival_rate == pytest.approx(rates[-1])
    return traffic.arrival_rate_slope


def test_a_rate_trend_is_kept_as_far_as_the_rates_support_it() -> None:
    """A steady ramp keeps its slope; a noisy but clear one nearly all of it; a burst that rose and has turned
    back (30, 45, then 38 requests/s) none, rising or falling: its least-squares slope (0.28 requests/s per
    second) is mostly the jump, and projected a minute ahead it would add 16 requests/s that the rates do not
    show."""
    assert trend_of([30, 33, 36, 39]) == pytest.approx(0.2)
    noisy = [30, 34, 35, 40, 41, 46]
    least_squares = np.polyfit(np.arange(1, 7) * 15.0, noisy, 1)[0]
    assert 0.9 * least_squares < trend_of(noisy) < least_squares
    assert trend_of([30, 45, 38]) == 0.0
    assert trend_of([45, 30, 37]) == 0.0
    assert trend_of([30, 45]) == 0.0  # two rates are no trend
    assert rate_trend([(0.0, 5.0), (0.0, 7.0), (0.0, 6.0)]) == 0.0  # no time between the rates


def test_after_a_burst_turns_the_pool_is_sized_for_the_rate_seen_not_the_burst_continued() -> None:
    """8 pods of 1,000 blocks at 70 %, requests held 8 s; the rate went 30, 45, then 38 requests/s. Following
    the plain least-squares slope (0.27 per second) for 56 s asks for 11 pods (8,500 blocks at p90); the rates
    do not support that slope, so the pool is sized for the rate seen: about 6,000 blocks, which its 8 pods
    hold at the 80 % target."""
    pods = [pod(f"p{i}", 0.7, 0.0, 0.0, 0.0) for i in range(8)]
    policy = ScalingPolicy(min_replicas={"both": 1}, max_replicas={"both": 16}, horizon_seconds=60)

    def decision(trend: float) -> RoleDecision:
        obs = PoolObservation(0, pods, {"both": 8}, arrival_rate=38.0, arrival_rate_slope=trend, blocks_per_request=20,
                              request_seconds=8)
        return decide(obs, policy).roles["both"]

    held = decision(trend_of([30, 45, 38]))
    assert (held.replicas, held.reason) == (8, "HoldWithinTarget")
    assert decision((38 - 30) / 30).replicas == 11  # what the old trend (plain least squares) asked for


def test_the_trend_is_followed_until_the_pods_asked_for_now_serve() -> None:
    """10 requests/s rising by 0.1 per second, each holding 40 blocks for 10 s, on empty pods of 1,000 blocks:
    with a 90 s horizon the arrivals held at its end come at 10 + 0.1 x 85 = 18.5 requests/s if the trend is
    followed all the way (8,100 blocks at p90: 11 pods at 80 %); pods asked for now serve in 60 s, so the
    trend is followed 60 s and the rest of the horizon is covered at the 16 requests/s reached (7,050 blocks:
    9 pods)."""
    pods = [pod(f"p{i}", 0.0, 0.0, 0.0, 0.0) for i in range(4)]
    obs = PoolObservation(0, pods, {"both": 4}, arrival_rate=10.0, arrival_rate_slope=0.1, blocks_per_request=40,
                          request_seconds=10, blocks_per_request_cv2=0.0)  # requests of one size: a plain Poisson
    bounds = {"min_replicas": {"both": 1}, "max_replicas": {"both": 16}, "horizon_seconds": 90}
    ready_in_60 = ScalingPolicy(**bounds, startup_seconds=60)  # type: ignore[arg-type]
    assert arrivals(obs, 90, ready_in_60.trend_seconds).rate == pytest.approx(16.0)
    assert arrivals(obs, 90).rate == pytest.approx(18.5)
    assert decide(obs, ready_in_60).replicas == {"both": 9}
    assert decide(obs, ScalingPolicy(**bounds)).replicas == {"both": 11}  # type: ignore[arg-type]
    # The pool's spec says how long its pods take: the CRD's defaults, 90 s ahead and 60 s to start.
    from_spec = scaling_policy(load_pool_file(str(EXAMPLES / "aggregated.yaml")))
    assert (from_spec.horizon_seconds, from_spec.trend_seconds) == (90, 60)
    with pytest.raises(ValueError, match="startup_seconds"):
        ScalingPolicy(**bounds, startup_seconds=120)  # type: ignore[arg-type]


def test_a_tighter_itl_objective_asks_for_more_decode_pods_and_a_longer_context_too() -> None:
    """Pods that do both, each step 10 ms plus 1 ms a sequence plus 0.5 us a KV token. 20 requests/s of 400 output
    tokens (8,000 tokens/s). At 1,000 tokens of context a sequence costs 1.5 ms: within 100 ms a pod batches 60
    (600 tokens/s, 14 busy pods, 17 at 80 %); within 40 ms, 20 (500 tokens/s: 20 pods); at 3,000 tokens of
    context and 40 ms, 12 (300 tokens/s: 34 pods). The pods that fitted no cost yet count for nothing."""
    step = DecodeStepCost(base=0.01, per_sequence=0.001, per_kv_token=5e-7)
    pods = [replace(p, decode_step_cost=step) for p in quiet(4)] + quiet(2)
    obs = PoolObservation(0, pods, {"both": 6}, arrival_rate=20.0, output_tokens=400, decode_context_tokens=1000)
    bounds = {"min_replicas": {"both": 1}, "max_replicas": {"both": 64}}

    def sized(itl: float, o: PoolObservation = obs) -> RoleDecision:
        return decide(o, ScalingPolicy(**bounds, itl_seconds=itl)).roles["both"]  # type: ignore[arg-type]

    assert decode_speed(pods, obs, 0.1) == pytest.approx(60 / 0.1)
    assert (sized(0.1).replicas, sized(0.1).reason) == (math.ceil(8000 / 600 / 0.8), "ScaleUpInterTokenLatency")
    assert sized(0.04).replicas == math.ceil(8000 / 500 / 0.8)
    longer = replace(obs, decode_context_tokens=3000)
    assert decode_speed(pods, longer, 0.04) == pytest.approx(12 / 0.04)
    assert sized(0.04, longer).replicas == math.ceil(8000 / 300 / 0.8)
    assert decode_speed(quiet(2), obs, 0.04) == 0  # no pod fitted one: KV sizing alone
    # 1,000 uncached prompt tokens each at 20,000 tokens/s: one pod's worth of prompts. At n pods each spends 1 / n
    # of its time on them and its step may take 100 ms x (1 - 1 / n): at 19 pods, 94.7 ms, 56 sequences (595.7
    # tokens/s), 5.3 % + 70.7 % of its time; at 18, 5.6 % + 74.6 % is past the target
    stalled = replace(obs, uncached_prompt_tokens=1000, prefill_tokens_per_second=20_000)
    assert (sized(0.1, stalled).replicas, sized(0.1, stalled).reason) == (19, "ScaleUpInterTokenLatency")
    assert sized(0.0105, obs).replicas == 6  # one sequence's step (11.5 ms) is over the objective: out of reach
    with pytest.raises(ValueError, match="itl_seconds"):
        ScalingPolicy(**bounds, itl_seconds=0)  # type: ignore[arg-type]
    # an engine batches at most max_num_seqs: capped at 30 sequences (10 ms + 30 x 1.5 ms = 55 ms a step), a pod
    # makes 545 tokens/s within 100 ms where 60 would make 600: 8,000 tokens/s needs 19 pods, not 17
    capped = ScalingPolicy(**bounds, itl_seconds=0.1, max_batch=30)  # type: ignore[arg-type]
    assert decode_speed(pods, obs, 0.1, max_batch=30) == pytest.approx(30 / 0.055)
    assert decide(obs, capped).replicas["both"] == math.ceil(8000 / (30 / 0.055) / 0.8)
    # the pool's spec.scaling.slo.itlSeconds is the objective, the engines' max_num_seqs the cap
    from_spec = scaling_policy(load_pool_file(str(EXAMPLES / "aggregated.yaml")))
    assert (from_spec.itl_seconds, from_spec.max_batch) == (0.1, DEFAULT_MAX_NUM_SEQS)
    body = yaml.safe_load((EXAMPLES / "aggregated.yaml").read_text())
    body["spec"].setdefault("engine", {})["maxNumSeqs"] = 24
    assert scaling_policy(parse_pool(body)).max_batch == 24
    body["spec"]["engine"]["settings"] = {"max_num_seqs": 12}  # the engines' file, as the operator writes it
    assert scaling_policy(parse_pool(body)).max_batch == 12


def test_a_request_is_held_longer_where_a_pod_spends_more_of_its_time_on_prefills() -> None:
    """4 pods take 40 requests/s of 1,000 uncached tokens at 20,000 tokens/s: each spends half its time
    prefilling, so its decodes run half the time. 8 pods spend a quarter: a request is held 0.5 / 0.75 as long;
    2 pods could not keep up (capped at 95 % busy); 60 requests/s on the same 4 pods hold each twice as long."""
    pods = [pod(f"p{i}", 0.5, 0.5, 0.5, 0.5, prefill_tokens_per_second=20_000) for i in range(4)]
    obs = PoolObservation(0, pods, {"both": 4}, arrival_rate=40.0, uncached_prompt_tokens=1000)
    measured = holding(pods, obs)
    assert measured.factor(4, 40.0) == pytest.approx(1.0)
    assert measured.factor(8, 40.0) == pytest.approx(0.5 / 0.75)
    assert measured.factor(2, 40.0) == pytest.approx(0.5 / 0.05)
    assert measured.factor(4, 60.0) == pytest.approx(2.0)
    unmeasured = PoolObservation(0, quiet(4), {"both": 4}, arrival_rate=40.0, uncached_prompt_tokens=1000)
    assert holding(quiet(4), unmeasured).factor(8, 40.0) == 1.0  # no prefill speed known: no correction


def test_fewest_pods_fits_a_demand_that_falls_with_the_pool_size() -> None:
    assert fewest_pods(lambda n: 3000.0, 800) == 4  # ceil(3000 / 800)
    assert fewest_pods(lambda n: 0.0, 800) == 0
    assert fewest_pods(lambda n: 6000 / math.sqrt(n), 1000) == 4  # 3 pods: 3,464 > 3,000; 4 pods: 3,000 <= 4,000
    assert fewest_pods(lambda n: 1e6, 1000) == 1000
    with pytest.raises(ValueError, match="finite"):  # a NaN gauge must not spin the search forever
        fewest_pods(lambda n: math.nan, 1000)


def test_a_saturated_pool_is_sized_for_how_long_the_bigger_pool_holds_requests() -> None:
    """8 pods at 95 % take 60 requests/s of 1,000 uncached tokens at 20,000 tokens/s: 37.5 % of each pod's time
    goes to prefills. Sized with the holding time measured now, 7,600 blocks need 10 pods at the 80 % target;
    but in 9 pods a third of the time goes to prefills, requests are held 0.625 / 0.667 as long, and 7,125
    blocks fit in 9 pods' 7,200."""
    def saturated(**extra: float) -> list[PodObservation]:
        return [pod(f"p{i}", 0.95, 0.0, 0.0, 0.0, **extra) for i in range(8)]

    policy = ScalingPolicy(min_replicas={"both": 1}, max_replicas={"both": 16})
    as_measured = PoolObservation(0, saturated(), {"both": 8}, arrival_rate=60.0, uncached_prompt_tokens=1000)
    assert decide(as_measured, policy).replicas == {"both": 10}
    modelled = PoolObservation(0, saturated(prefill_tokens_per_second=20_000), {"both": 8}, arrival_rate=60.0,
                               uncached_prompt_tokens=1000)
    d = decide(modelled, policy)
    assert d.replicas == {"both": 9} and d.roles["both"].reason == "ScaleUpPredictedAboveTarget"
    assert d.roles["both"].predicted_usage == pytest.approx(0.95)


def test_a_forecast_peak_holds_pods_for_its_horizon_and_a_seen_one_for_the_whole_window() -> None:
    """A forecast of a climb past 95 % adds pods at once. If the climb does not come, the pods go once the
    horizon (60 s) of that forecast has passed, not after the 5-minute window: a forecast that did not come
    true is no evidence, and a later climb is forecast again a horizon ahead. What the pods did hold (95 %
    now) keeps its pods for the whole window, as the HPA keeps its recommendations."""
    def run(peak: list[PodObservation]) -> list[tuple[int, str]]:
        history = decide(PoolObservation(0, quiet(4), {"both": 4}), POLICY).history  # the window's first need
        seen, replicas = [], 4
        for t, pods in ((300, peak), (330, quiet(4)), (361, quiet(4)), (599, quiet(4)), (601, quiet(4))):
            d = decide(PoolObservation(t, pods, {"both": replicas}), POLICY, history)
            history, replicas = d.history, d.replicas["both"]
            seen.append((replicas, d.roles["both"].reason))
        return seen

    forecast = run([pod(f"p{i}", 0.2, 0.8, 1.2, 1.5, overload=0.5) for i in range(4)])
    assert forecast[0] == (6, "ScaleUpPredictedOverload")  # 4 x 1,200 blocks at p90 over 800 per pod
    assert forecast[1] == (6, "HoldStabilizing")  # 30 s later the forecast's horizon has not passed
    assert forecast[2] == (2, "ScaleDownUnderTarget")  # 61 s later it has, and nothing was seen to need more
    held = run([pod(f"p{i}", 0.95, 0.95, 0.95, 0.95) for i in range(4)])
    assert held[0] == (5, "ScaleUpPredictedAboveTarget")  # 3,800 blocks held now over 800 per pod
    assert [n for n, _ in held[1:]] == [5, 5, 5, 2]  # held until the window (300 s) no longer holds t=300


def test_scale_down_waits_for_the_whole_stabilization_window() -> None:
    history: tuple[Recommendation, ...] = ()
    busy = [pod(f"p{i}", 0.7, 0.75, 0.78, 0.8) for i in range(4)]
    history = decide(PoolObservation(0, busy, {"both": 4}), POLICY, history).history
    idle = quiet(4)
    for t in (60, 200, 299):
        d = decide(PoolObservation(t, idle, {"both": 4}), POLICY, history)
        history = d.history
        assert d.replicas == {"both": 4} and d.roles["both"].reason == "HoldStabilizing"
        assert d.roles["both"].recommended == 2  # 4 x 250 blocks at p90 over an 800-block target: 2 pods
    later = decide(PoolObservation(301, idle, {"both": 4}), POLICY, history)
    assert later.replicas == {"both": 2} and later.roles["both"].reason == "ScaleDownUnderTarget"
    # A fresh history (a restarted operator) waits a whole window before scaling down.
    assert decide(PoolObservation(400, idle, {"both": 4}), POLICY).roles["both"].reason == "HoldStabilizing"


def test_scale_up_is_immediate_but_bounded_and_min_holds() -> None:
    hot = [pod(f"p{i}", 0.9, 1.5, 2.0, 2.4, overload=0.9) for i in range(4)]
    d = decide(PoolObservation(0, hot, {"both": 4}), POLICY)
    assert d.replicas == {"both": 8} and d.roles["both"].reason == "BoundedByMax" and d.roles["both"].recommended > 8
    floor = ScalingPolicy(min_replicas={"both": 3}, max_replicas={"both": 8}, scale_down_stabilization_seconds=0)
    d = decide(PoolObservation(0, quiet(3), {"both": 3}), floor, (Recommendation(-1, "both", 3, 3),))
    assert d.replicas == {"both": 3} and d.roles["both"].reason == "BoundedByMin"
    none = decide(PoolObservation(0, [], {"both": 2}), POLICY)
    assert none.replicas == {"both": 2} and none.roles["both"].reason == "HoldNoMetrics"


def test_prefill_and_decode_are_sized_by_rate_matching() -> None:
    """4 requests/s of 2,000 uncached prompt tokens on prefill pods that compute 5,000 tokens/s: 8,000 tokens/s
    needs 1.6 pods, 2 at the 80 % target; generation of 4 x 250 tokens/s on decode pods whose step costs 10 ms plus
    2 ms a sequence (each attending to 2,000 tokens, 1 us a token): within a 50 ms ITL objective a pod batches
    (50 - 10) / 2 = 20 sequences, 20 tokens per 50 ms step = 400 tokens/s; 2.5 busy pods, 4 at 80 %."""
    policy = ScalingPolicy(min_replicas={"prefill": 1, "decode": 1}, max_replicas={"prefill": 10, "decode": 10},
                           itl_seconds=0.05)
    step = DecodeStepCost(base=0.01, per_sequence=0.0, per_kv_token=1e-6)
    pods = [*quiet(1, "prefill"), *(replace(p, decode_step_cost=step) for p in quiet(2, "decode"))]
    obs = PoolObservation(0, pods, {"prefill": 1, "decode": 2}, arrival_rate=4.0, uncached_prompt_tokens=2000,
                          output_tokens=250, prefill_tokens_per_second=5000, decode_context_tokens=2000)
    assert decode_speed(obs.role_pods("decode"), obs, 0.05) == pytest.approx(400)
    d = decide(obs, policy)
    assert d.replicas == {"prefill": math.ceil(8000 / 5000 / 0.8), "decode": math.ceil(1000 / 400 / 0.8)}
    assert d.roles["prefill"].reason == "ScaleUpPrefillRate"
    assert d.roles["decode"].reason == "ScaleUpInterTokenLatency"
    # Without an objective the decode pods are sized for their KV alone (2 quiet pods hold theirs).
    assert decide(obs, replace(policy, itl_seconds=None)).replicas["decode"] == 2
    # Without a pool-level figure the pods' own measured prefill speed is used.
    measured = [pod("pf", 0.2, 0.2, 0.2, 0.2, role="prefill", prefill_tokens_per_second=2500), *quiet(2, "decode")]
    obs = PoolObservation(0, measured, {"prefill": 1, "decode": 2}, arrival_rate=4.0, uncached_prompt_tokens=2000)
    assert decide(obs, policy).replicas["prefill"] == math.ceil(8000 / 2500 / 0.8)


def test_a_policy_with_bounds_the_wrong_way_round_is_refused() -> None:
    with pytest.raises(ValueError, match="min <= max"):
        ScalingPolicy(min_replicas={"both": 5}, max_replicas={"both": 2})
    with pytest.raises(ValueError, match="overload_threshold"):
        ScalingPolicy(min_replicas={}, max_replicas={}, overload_threshold=1.5)


# ---- a scripted ramp on a simulated clock ------------------------------------------------------------------------


@dataclass
class SimPod:
    """A pod of the ramp simulation: `ready_at` is when it starts taking requests, `held` its requests' (end time,
    blocks)."""

    name: str
    ready_at: float
    capacity: int
    held: list[tuple[float, int]] = field(default_factory=list)

    def usage(self, now: float) -> float:
        return sum(b for end, b in self.held if end > now) / self.capacity

    def observe(self, now: float, horizon: float) -> PodObservation:
        """The engine's forecast, exact here: its requests' durations are known."""
        at_horizon = sum(b for end, b in self.held if end > now + horizon) / self.capacity
        usage = self.usage(now)
        return PodObservation(self.name, "both", self.capacity, usage=usage,
                              forecast={"p50": at_horizon, "p90": at_horizon, "p99": at_horizon},
                              overload_probability=1.0 if usage >= 0.95 else 0.0)


def run_ramp(policy: ScalingPolicy | None, startup: float, seconds: int = 900) -> dict[str, object]:
    """Poisson arrivals ramping from 0.2 to 5 requests/s over `seconds`, each holding 40 blocks for 20 s, routed
    to the least-used ready pod of 1,000 blocks; the scaler (if any) looks every 10 s at the rate measured over
    the last minute and its trend. New pods take `startup` seconds to become ready."""
    rng = random.Random(7)
    pods = [SimPod("pod-0", 0.0, 1000)]
    history: tuple[Recommendation, ...] = ()
    arrivals: list[float] = []
    first_scale_up: float | None = None
    first_95: float | None = None
    peak = 0.0
    for t in range(seconds):
        rate = 0.2 + 4.8 * t / seconds
        for _ in range(_poisson(rng, rate)):
            ready = [p for p in pods if p.ready_at <= t]
            target = min(ready, key=lambda p: p.usage(t))
            target.held.append((t + 20.0, 40))
            arrivals.append(float(t))
        for p in pods:
            if p.ready_at <= t:
                u = p.usage(t)
                peak = max(peak, u)
                if u >= 0.95 and first_95 is None:
                    first_95 = float(t)
        if policy is None or t % 10:
            continue
        recent = [a for a in arrivals if a > t - 60]
        older = [a for a in recent if a <= t - 30]
        rate_now, rate_before = (len(recent) - len(older)) / 30, len(older) / 30
        obs = PoolObservation(
            now=float(t), pods=[p.observe(t, policy.horizon_seconds) for p in pods if p.ready_at <= t],
            replicas={"both": len(pods)}, arrival_rate=rate_now, arrival_rate_slope=(rate_now - rate_before) / 30,
            blocks_per_request=40, request_seconds=20)
        decision = decide(obs, policy, history)
        history = decision.history
        want = decision.replicas["both"]
        if want > len(pods) and first_scale_up is None:
            first_scale_up = float(t)
        while len(pods) < want:
            pods.append(SimPod(f"pod-{len(pods)}", t + startup, 1000))
    return {"first_scale_up": first_scale_up, "first_95": first_95, "peak": peak, "pods": len(pods)}


def _poisson(rng: random.Random, mean: float) -> int:
    count, threshold, product = 0, math.exp(-mean), rng.random()
    while product > threshold:
        count += 1
        product *= rng.random()
    return count


@pytest.mark.parametrize("trend_seconds", [None, 60.0], ids=["trend-over-the-horizon", "trend-until-pods-serve"])
def test_a_ramp_scales_up_a_start_up_delay_before_the_cache_would_fill(trend_seconds: float | None) -> None:
    """Following the trend only for the start-up delay (not the whole 90 s horizon) still scales up in time."""
    startup = 60.0
    policy = ScalingPolicy(min_replicas={"both": 1}, max_replicas={"both": 16}, horizon_seconds=90,
                           startup_seconds=trend_seconds)
    static = run_ramp(None, startup)
    scaled = run_ramp(policy, startup)
    assert static["first_95"] is not None  # without scaling, the one pod fills up
    assert scaled["first_scale_up"] is not None
    lead = static["first_95"] - scaled["first_scale_up"]  # type: ignore[operator]
    assert lead >= startup, f"scaled up only {lead:.0f} s before the cache filled; pods take {startup:.0f} s"
    assert scaled["first_95"] is None, f"a pod reached 95 % (peak {scaled['peak']:.2f}) despite scaling"
    assert scaled["pods"] >= 4  # the end of the ramp needs 5 req/s x 20 s x 40 blocks = 4,000 blocks


def test_a_horizon_shorter_than_the_start_up_delay_reacts_too_late() -> None:
    """The same ramp with a 5 s horizon: the scale-up comes, but the new pods are not ready in time."""
    short = ScalingPolicy(min_replicas={"both": 1}, max_replicas={"both": 16}, horizon_seconds=5)
    late = run_ramp(short, startup=60.0)
    assert late["first_95"] is not None


def test_a_scale_up_window_takes_the_lowest_recommendation_in_it() -> None:
    """With a scale-up stabilization window a brief spike does not add pods: the lowest recommendation of the
    window wins (never below the current size)."""
    policy = ScalingPolicy(min_replicas={"both": 1}, max_replicas={"both": 8}, scale_up_stabilization_seconds=60)
    spike = [pod(f"p{i}", 0.9, 1.5, 2.0, 2.4, overload=0.9) for i in range(2)]
    calm = decide(PoolObservation(0, quiet(2), {"both": 2}), policy)
    d = decide(PoolObservation(30, spike, {"both": 2}), policy, calm.history)
    assert d.roles["both"].recommended > 2 and d.replicas == {"both": 2}
    later = decide(PoolObservation(100, spike, {"both": 2}), policy, d.history)
    assert later.replicas["both"] == later.roles["both"].recommended > 2  # the spike held for a whole window


def test_scale_in_removes_the_coldest_cache_first() -> None:
    costs = scale_in_order({"hot": (900.0, 0), "cold": (5.0, 3), "idle": (5.0, 0)})
    assert sorted(costs, key=costs.__getitem__) == ["idle", "cold", "hot"]  # ties: fewer streams to drain first


ZERO_POLICY = ScalingPolicy(min_replicas={"prefill": 0, "decode": 2}, max_replicas={"prefill": 4, "decode": 6},
                            horizon_seconds=60, scale_down_stabilization_seconds=300,
                            scale_to_zero_idle_seconds=120)
# (replicas now, pods answering, held by routers, idle seconds) -> (replicas decided, reason of every role)
ZERO_TABLE = [
    ({"prefill": 0, "decode": 0}, False, 3, 0.0, {"prefill": 1, "decode": 2}, "ScaleFromZero"),
    ({"prefill": 0, "decode": 0}, False, 1, 1e6, {"prefill": 1, "decode": 2}, "ScaleFromZero"),  # held beats idle
    ({"prefill": 0, "decode": 0}, False, 0, 1e6, {"prefill": 0, "decode": 0}, "HoldAtZero"),
    ({"prefill": 0, "decode": 0}, False, 0, 0.0, {"prefill": 0, "decode": 0}, "HoldAtZero"),
    ({"prefill": 1, "decode": 2}, True, 0, 120.0, {"prefill": 0, "decode": 0}, "ScaleToZero"),
    ({"prefill": 1, "decode": 2}, False, 0, 600.0, {"prefill": 0, "decode": 0}, "ScaleToZero"),
    ({"prefill": 1, "decode": 2}, True, 2, 600.0, {"prefill": 1, "decode": 2}, None),  # held: not idle
    ({"prefill": 1, "decode": 2}, True, 0, 119.0, {"prefill": 1, "decode": 2}, None),  # not idle long enough
    ({"prefill": 1, "decode": 2}, False, 4, 0.0, {"prefill": 1, "decode": 2}, None),  # starting: wait for them
]


@pytest.mark.parametrize(("replicas", "answering", "held", "idle", "decided", "reason"), ZERO_TABLE)
def test_scale_to_zero_decision_table(replicas: dict[str, int], answering: bool, held: int, idle: float,
                                      decided: dict[str, int], reason: str | None) -> None:
    """From zero a held request starts every role at max(min, 1) at once; an idle pool with nothing held goes to
    zero; a pool at zero with nothing held stays there; otherwise no role goes under max(min, 1)."""
    pods = [*quiet(replicas["prefill"], "prefill"), *quiet(replicas["decode"], "decode")] if answering else []
    history = [Recommendation(t, role, 0, 0) for t in (-600.0, -300.0) for role in ("prefill", "decode")]
    decision = decide(PoolObservation(0, pods, replicas, held_requests=held, idle_seconds=idle), ZERO_POLICY,
                      history)
    assert decision.replicas == decided
    if reason is not None:
        assert {d.reason for d in decision.roles.values()} == {reason}


def test_a_wake_from_zero_starts_pods_enough_to_batch_every_held_request() -> None:
    """The router releases every held request when the first pod is ready: one pod a role for a burst of hundreds
    would batch a few and shed the rest after they waited a cold start."""
    policy = replace(ZERO_POLICY, max_batch=8)
    history = [Recommendation(t, role, 0, 0) for t in (-600.0, -300.0) for role in ("prefill", "decode")]
    zero = {"prefill": 0, "decode": 0}
    for held, wanted in ((1, {"prefill": 1, "decode": 2}), (20, {"prefill": 3, "decode": 3}),
                         (1000, {"prefill": 4, "decode": 6})):
        decision = decide(PoolObservation(0, [], zero, held_requests=held, idle_seconds=0), policy, history)
        assert decision.replicas == wanted and {d.reason for d in decision.roles.values()} == {"ScaleFromZero"}


def test_with_scale_to_zero_a_serving_pool_keeps_a_pod_of_every_role_even_at_min_zero() -> None:
    """min 0 is only for an idle pool: a role left at 0 while the pool serves (a decode pod busy, the prefill
    role at 0) comes back to one pod, where a plain min 0 would leave it at 0 (no pod of it to measure)."""
    policy = replace(ZERO_POLICY, min_replicas={"prefill": 0, "decode": 0})
    busy = [pod("decode-0", 0.5, 0.5, 0.55, 0.6, role="decode", running=3)]
    kept = decide(PoolObservation(0, busy, {"prefill": 0, "decode": 1}, idle_seconds=0), policy)
    assert kept.replicas == {"prefill": 1, "decode": 1}
    assert kept.roles["prefill"].reason == "BoundedByMin"
    without = replace(policy, scale_to_zero_idle_seconds=None)
    assert decide(PoolObservation(0, busy, {"prefill": 0, "decode": 1}), without).replicas == {
        "prefill": 0, "decode": 1}


def test_a_near_zero_rate_does_not_size_the_queued_requests() -> None:
    """Three small requests in flight (one running, two queued) while the logged rate has fallen to 0 with a
    slight downward trend: the rate "half a request ago" is a few thousandths per second, so Little's law reads
    each arriving request as thousands of blocks. No request arrives at that rate, so that figure sizes nothing;
    the two queued requests are counted at the log's 11 blocks each (they sized 9 of 64 pods when the queue was
    counted at the calibrated figure, as the cluster simulator showed). One lightly used pod stays one."""
    pods = [pod("both-0", 0.033, 0.0, 0.0, 0.0, running=1, waiting=2)]
    obs = PoolObservation(0, pods, {"both": 1}, arrival_rate=0.0, arrival_rate_slope=-0.00085,
                          blocks_per_request=11, request_seconds=6.24)
    assert little_calibrated(obs, 55).blocks_per_request > 1000  # the quotient itself
    d = decide(obs, replace(POLICY, max_replicas={"both": 64}))
    assert d.replicas == {"both": 1} and d.roles["both"].predicted_usage == pytest.approx((33 + 2 * 11) / 1000)
