"""What the scaler reads and how it reads it: arrivals through a scale-up, aborted requests, a disaggregated pool,
pods whose scrape failed, requests held by the routers, the compound spread of the arrivals' sizes, the order of
scale-in, a Deployment scaled by hand, and the operator's clock. Pure functions; no timing assertions."""

from __future__ import annotations

import math
import time
from statistics import NormalDist
from typing import Any

import kopf
import pytest

from kvmesh.engine.protocol import FINISH_REASONS, Metric, VllmMetric
from kvmesh.operator import handlers
from kvmesh.operator.crd import API_VERSION, KIND, parse_pool
from kvmesh.operator.forecast import Counters, PodMetrics, TrafficEstimator, parse_pod
from kvmesh.operator.handlers import OperatorConfig, deployed_replicas, unanswered
from kvmesh.operator.scale_in import Candidate, deletion_costs, removal_order
from kvmesh.operator.scaling import Arrivals, PodObservation, PoolObservation, ScalingPolicy, decide


def steady(pods: dict[str, float], est: TrafficEstimator, now: float, per_pod: dict[str, float]) -> float:
    """Feed one scrape where each pod has finished `pods[name]` requests (10 in flight each); the rate read."""
    return est.update(now, [(n, Counters(finished=f, prompt_tokens=f * 100, in_flight=10)) for n, f in pods.items()],
                      16).arrival_rate


def test_the_rate_follows_arrivals_through_a_scale_up() -> None:
    """10 requests/s on one pod, then 30 spread over three pods as two join: each scrape reads the rate of its
    interval. The estimator used to skip every interval whose set of answering pods changed (every scale-up adds
    one), and the rate stood at 10 until the set stopped changing."""
    est = TrafficEstimator()
    finished = {"a": 0.0}
    assert steady(finished, est, 0.0, {}) == 0.0  # a first scrape says nothing of a rate
    finished["a"] += 150
    assert steady(finished, est, 15.0, {}) == pytest.approx(10.0)
    finished["a"] += 150
    finished["b"] = 150.0  # a new pod: all it counted arrived since it started (and 10 are in flight on it)
    assert steady(finished, est, 30.0, {}) == pytest.approx((150 + 150 + 10) / 15)
    for name in ("a", "b"):
        finished[name] += 150
    finished["c"] = 150.0
    assert steady(finished, est, 45.0, {}) == pytest.approx((450 + 10) / 15)
    # a pod that left is dropped; the others' deltas still count
    del finished["a"]
    for name in ("b", "c"):
        finished[name] += 225
    assert steady(finished, est, 60.0, {}) == pytest.approx(30.0)
    # a pod that restarted (its counters fell) counts what it counted since, not a negative interval
    finished["b"] = 15.0
    finished["c"] += 225
    assert steady(finished, est, 75.0, {}) == pytest.approx((225 + 15 + 10) / 15)


def test_a_pod_that_missed_a_scrape_is_read_against_its_last_counters() -> None:
    est = TrafficEstimator()
    est.update(0.0, [("a", Counters()), ("b", Counters())], 16)
    est.update(15.0, [("a", Counters(finished=150))], 16)  # b did not answer
    rate = est.update(30.0, [("a", Counters(finished=300)), ("b", Counters(finished=300))], 16).arrival_rate
    assert rate == pytest.approx((150 + 300) / 15)  # b's 300 over 30 s land here, not 300 + all it ever counted


def metrics_text(reasons: dict[str, float], timed: float, timed_seconds: float, prompt: float, output: float,
                 running: int = 0) -> str:
    lines = [f'{Metric.REQUESTS}_total{{finish_reason="{r}"}} {v}' for r, v in reasons.items()]
    lines += [f"{VllmMetric.E2E}_count {timed}", f"{VllmMetric.E2E}_sum {timed_seconds}",
              f"{VllmMetric.PROMPT_TOKENS}_total {prompt}", f"{VllmMetric.GENERATION_TOKENS}_total {output}",
              f"{VllmMetric.RUNNING} {running}"]
    return "\n".join(lines) + "\n"


def test_aborted_requests_count_as_arrivals_and_the_time_held_only_from_the_timed() -> None:
    """10 requests/s, 60 % aborted (a client that gave up under overload): vllm's end-to-end histogram counts
    only those that stopped, so the rate read from it was 4 requests/s and each request 2.5 times its prompt.
    kvmesh_requests_total counts every finish reason."""
    assert set(FINISH_REASONS) >= {"stop", "abort"}
    est = TrafficEstimator()
    for k in range(3):
        n = 150.0 * k
        text = metrics_text({"stop": 0.4 * n, "length": 0.0, "abort": 0.6 * n, "error": 0.0}, timed=0.4 * n,
                            timed_seconds=0.4 * n * 20, prompt=n * 1000, output=0.4 * n * 200)
        pod = parse_pod("p0", "both", text)
        traffic = est.update(15.0 * k, [("p0", pod.counters)], 16)
    assert pod.counters.finished == pytest.approx(300) and pod.counters.timed == pytest.approx(120)
    assert traffic.arrival_rate == pytest.approx(10.0)
    assert traffic.uncached_prompt_tokens == pytest.approx(1000)
    assert traffic.request_seconds == pytest.approx(20.0)  # the stopped ones' time, over the stopped ones


def test_an_engine_without_the_finish_reason_counter_is_read_from_its_latency_histogram() -> None:
    text = metrics_text({}, timed=7, timed_seconds=14, prompt=700, output=70)
    assert parse_pod("p0", "both", text).counters.finished == 7


def test_a_disaggregated_pool_counts_each_request_once() -> None:
    """5 requests/s pass a prefill pod (max_tokens 1, ends as a request too) and a decode pod: counted on both,
    the rate read 10. Arrivals, output, time held come from the decode pods, the uncached prompt from the
    prefill pods (the decode pod pulls the whole prompt: all cached there)."""
    est = TrafficEstimator()
    roles = {"prefill-0": "prefill", "decode-0": "decode"}
    for k in range(4):
        n = 75.0 * k
        pre = Counters(finished=n, finished_seconds=n * 0.5, prompt_tokens=n * 2000, output_tokens=n,
                       cached_tokens=0, in_flight=3)
        dec = Counters(finished=n, finished_seconds=n * 15, prompt_tokens=n * 2000, output_tokens=n * 299,
                       cached_tokens=n * 2000, in_flight=75)
        traffic = est.update(15.0 * k, [("prefill-0", pre), ("decode-0", dec)], 16, roles)
    assert traffic.arrival_rate == pytest.approx(5.0)
    assert traffic.uncached_prompt_tokens == pytest.approx(2000)
    assert traffic.output_tokens == pytest.approx(299) and traffic.request_seconds == pytest.approx(15.0)
    assert traffic.blocks_per_request == math.ceil((2000 + 299) / 16)
    assert traffic.decode_context_tokens == pytest.approx(2000 + 299 / 2)


def pods_at(usage: float, n: int) -> list[PodObservation]:
    return [PodObservation(f"p{i}", "both", 1000, usage=usage, forecast={"p50": 0.05, "p90": 0.06, "p99": 0.08},
                           running=20) for i in range(n)]


def test_pods_that_did_not_answer_forbid_a_scale_down_and_say_so() -> None:
    """Four busy pods, three of which time out their scrape: the one that answers looks like a pool at a quarter
    of its size, and the role shrank to 2 once the window passed. The HPA's rule: no scale-down while a Ready
    pod has no metrics."""
    policy = ScalingPolicy({"both": 1}, {"both": 16}, horizon_seconds=90, startup_seconds=60)
    common = {"replicas": {"both": 4}, "blocks_per_request": 40, "request_seconds": 20, "blocks_per_request_cv2": 0.0}

    def run(named: bool) -> list[Any]:
        history: tuple[Any, ...] = ()
        decisions = []
        for t in range(0, 601, 15):
            missing = {} if t < 120 or not named else {"both": 3}
            obs = PoolObservation(now=float(t), pods=pods_at(0.6, 4 if t < 120 else 1),
                                  arrival_rate=2.0 if t <= 120 else 0.5, unobserved=missing,
                                  **common)  # type: ignore[arg-type]
            decisions.append(decide(obs, policy, history))
            history = decisions[-1].history
        return decisions

    held = run(named=True)
    assert all(d.replicas == {"both": 4} for d in held)
    assert held[-1].roles["both"].reason == "HoldMissingMetrics"
    assert run(named=False)[-1].replicas == {"both": 2}  # unnamed, the one answering pod shrank the pool


def k8s_pod(name: str, role: str, ready: bool, ip: str | None = "10.0.0.1", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"kvmesh.io/role": role}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [{"type": "Ready",
                                                                        "status": "True" if ready else "False"}]}}


def scraped(name: str, role: str = "both", usage: float = 0.0, running: int = 0) -> PodMetrics:
    return PodMetrics(PodObservation(name, role, 1000, usage=usage, running=running), Counters(), 16)


def test_the_ready_pods_that_did_not_answer_are_named_per_role() -> None:
    from kvmesh.engine.protocol import ROLE_LABEL

    assert ROLE_LABEL == "kvmesh.io/role"
    pods = [k8s_pod("d-0", "decode", True), k8s_pod("d-1", "decode", True), k8s_pod("d-2", "decode", False),
            k8s_pod("p-0", "prefill", True), k8s_pod("d-3", "decode", True, deleting=True)]
    assert unanswered(pods, [scraped("d-0", "decode"), scraped("p-0", "prefill")]) == {"decode": ["d-1"]}


def test_requests_held_by_the_routers_are_a_floor_whatever_the_metrics() -> None:
    """The only pod crashed (no pod answers) and the routers hold 400 requests: the role held at 1 (HoldNoMetrics)
    unless every role was at 0. Now it gets pods enough to batch them (400 / 64: 7), without scale to zero too."""
    for idle in (None, 600.0):
        policy = ScalingPolicy({"both": 1}, {"both": 8}, max_batch=64, scale_to_zero_idle_seconds=idle)
        d = decide(PoolObservation(now=1000.0, pods=[], replicas={"both": 1}, held_requests=400), policy)
        assert (d.replicas, d.roles["both"].reason) == ({"both": 7}, "ScaleUpHeldRequests")
    at_zero = ScalingPolicy({"both": 0}, {"both": 8}, max_batch=64, scale_to_zero_idle_seconds=600.0)
    d = decide(PoolObservation(now=1000.0, pods=[], replicas={"both": 0}, held_requests=400), at_zero)
    assert (d.replicas, d.roles["both"].reason) == ({"both": 7}, "ScaleFromZero")
    # a scale-up window does not delay them
    slow = ScalingPolicy({"both": 1}, {"both": 8}, max_batch=64, scale_up_stabilization_seconds=300)
    assert decide(PoolObservation(now=0.0, pods=pods_at(0.1, 1), replicas={"both": 1}, held_requests=130),
                  slow).replicas == {"both": 3}


def test_the_arrivals_spread_is_a_compound_poissons() -> None:
    """m arrivals of sizes with mean b and squared coefficient of variation c: the sum's variance is m b^2 (1 + c);
    the Poisson count times the mean size (c = 0) under-spreads it."""
    z = NormalDist().inv_cdf(0.9)
    one_size = Arrivals(rate=10.0, held_seconds=10.0, blocks_per_request=40.0, size_cv2=0.0)
    assert one_size.blocks(0.9) == pytest.approx((100 + z * 10) * 40)
    spread = Arrivals(rate=10.0, held_seconds=10.0, blocks_per_request=40.0, size_cv2=0.64)  # the Azure trace
    assert spread.blocks(0.9) == pytest.approx((100 + z * math.sqrt(100 * 1.64)) * 40)
    assert Arrivals(10.0, 10.0, 40.0).blocks(0.9) == pytest.approx((100 + z * math.sqrt(200)) * 40)  # default: cv 1
    assert PoolObservation(0, [], {}).blocks_per_request_cv2 == 1.0


def test_scale_in_weighs_work_in_flight_and_ranks_unscraped_pods_last() -> None:
    """An idle pod with a few hits goes before one holding 200 streams; a pod not scraped this tick (its load
    unknown: it may be the busiest, timing out) is costed above every scraped one, not at Kubernetes' 0 where it
    tied with the coldest; every pod of the role gets a cost, so no earlier one stays."""
    busy = scraped("mid-stream-200", usage=0.9, running=200)
    idle = scraped("idle-tiny-hits")
    costs = deletion_costs("both", [busy, idle, scraped("other-role", role="decode")],
                           {"idle-tiny-hits": 1.0}, ["mid-stream-200", "idle-tiny-hits", "busy-new"])
    assert costs == {"idle-tiny-hits": 0, "mid-stream-200": 1, "busy-new": 2}
    order = removal_order([Candidate("busy-new", True), Candidate("mid-stream-200", True),
                           Candidate("idle-tiny-hits", True)], costs)
    assert order[0] == "idle-tiny-hits"
    # kvmesh up's order with costs only for the scraped: the unscraped one is kept, not taken at 0
    assert removal_order([Candidate("busy-new", True), Candidate("cold", True)], {"cold": 0}) == ["cold", "busy-new"]
    assert removal_order([Candidate("ready", True), Candidate("starting", False)], {"ready": 0})[0] == "starting"


def test_a_deployment_scaled_by_hand_is_what_the_decision_starts_from() -> None:
    """The timer compared the decision with the replicas recorded in status, so a `kubectl scale` of the
    Deployment to 10 was never patched back (the decision equalled the record). It starts from the Deployment's
    spec.replicas now, within the bounds, and patches it when the decision differs."""
    deployments = {"both": {"spec": {"replicas": 10}}, "router": {"spec": {"replicas": 2}}}
    assert deployed_replicas({"both": 3}, deployments, {"both": (1, 8)}) == {"both": 8}
    assert deployed_replicas({"both": 3}, {}, {"both": (1, 8)}) == {"both": 3}  # none yet: the record
    assert deployed_replicas({"both": 3}, {"both": {"spec": {"replicas": 0}}}, {"both": (0, 8)}) == {"both": 0}


def test_the_router_deployment_is_scaled_back_only_by_a_tick_of_the_current_spec(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A router Deployment scaled by hand goes back to spec.router.replicas; a tick that read the spec before an edit
    (the timer runs beside the reconcile, which may have applied the new count already) must not undo the edit."""
    patched: list[dict[str, Any]] = []

    class Recorder:
        def patch(self, *args: Any) -> None:
            patched.append(args[-1])

    monkeypatch.setattr(handlers.kopf, "event", lambda *_, **__: None)
    pool = parse_pool({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "chat", "generation": 5},
                       "spec": {"model": {"source": "bundled"}, "router": {"replicas": 1}}})
    live = {"spec": {"replicas": 3}}
    handlers.scale_routers_back(Recorder(), pool, kopf.Body({"metadata": {"generation": 6}}), live, True)
    assert patched == []  # an edit to 3 that this tick's spec predates
    handlers.scale_routers_back(Recorder(), pool, kopf.Body({"metadata": {"generation": 5}}), live, False)
    assert patched == []  # this generation's reconcile has yet to apply the spec
    handlers.scale_routers_back(Recorder(), pool, kopf.Body({"metadata": {"generation": 5}}), live, True)
    assert patched == [{"spec": {"replicas": 1}}]  # scaled by hand: back to the spec


def test_the_operator_measures_its_intervals_on_the_monotonic_clock() -> None:
    """A wall clock stepped back stopped evaluations for as long as the step (615 s), and one stepped forward
    emptied the scale-down window at once. Nothing it measures is persisted: status stamps are wall-clock."""
    assert OperatorConfig().clock is time.monotonic


def test_the_pods_own_peak_within_the_horizon_is_a_floor_of_the_demand() -> None:
    """Four pods at 32 % whose requests grow to 109 % of their cache and end within the horizon: their usage at
    the horizon is 0, and the pool asked for 5; their peak (engine/forecast.py peak_quantiles) asks for what
    the peak needs at the target. The peak is not added to the arrivals (it is mostly now, before they come)."""
    level = {"p50": 1.06, "p90": 1.09, "p99": 1.09}
    pods = [PodObservation(f"p{i}", "both", 4000, usage=0.32, forecast=dict.fromkeys(level, 0.0), peak=level,
                           running=40) for i in range(4)]
    obs = PoolObservation(now=0.0, pods=pods, replicas={"both": 4}, arrival_rate=0.5, blocks_per_request=130,
                          request_seconds=40)
    policy = ScalingPolicy({"both": 1}, {"both": 64}, horizon_seconds=60)
    assert decide(obs, policy).replicas == {"both": math.ceil(4 * 1.09 / 0.8)}
    no_peak = PoolObservation(now=0.0, pods=[PodObservation(p.name, "both", 4000, usage=0.32,
                                                            forecast=dict.fromkeys(level, 0.0), running=40)
                                             for p in pods], replicas={"both": 4}, arrival_rate=0.5,
                              blocks_per_request=130, request_seconds=40)
    assert decide(no_peak, policy).replicas["both"] < math.ceil(4 * 1.09 / 0.8)
