"""Warm-up planning (operator/warmup.py): which pods are new, which peer they copy, what they are sent, which are
told to serve at once (nothing to copy); the pool spec's warmupPrefixes and warmupGraceSeconds; and the operator's
timer warming pods that start serving before they are Ready (kopf against kmock's emulator, as
tests/test_operator.py; the engines' warm and open calls are replaced by recorders, since no engine runs behind
the pods' metrics servers: tests/test_kv_warm.py and tests/test_warmup_gate.py run the real calls on real
engines)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvmesh.engine.protocol import HOT_CHAINS_DEFAULT, VllmMetric
from kvmesh.operator.crd import SpecError, parse_pool
from kvmesh.operator.desired import warmup_grace_seconds
from kvmesh.operator.forecast import PodMetrics, parse_pod
from kvmesh.operator.memory import PoolMemory
from kvmesh.operator.warmup import (
    PodPlace,
    ServingPod,
    Warmup,
    WarmupPlan,
    WarmupSettings,
    WarmupUnanswered,
    carry_out,
    left_closed,
    plan_tick_warmups,
    plan_warmups,
    warm_body,
    warmup_outcome,
)
from kvmesh.processes import free_port

from .test_operator import NS, POOLS, MetricsServer, eventually, operator, pod_body, pool_body, run


def pod(name: str, role: str = "both", hit_rate: float = 0.0, ready: bool = True, kv_format: str = "auto"
        ) -> ServingPod:
    return ServingPod(name, role, f"http://{name}:8000", hit_rate, ready, kv_format)


def test_a_new_pod_copies_only_from_an_old_pod_storing_kv_alike() -> None:
    """A rolling change of kvCacheDtype: the new int8 pods copy from the int8 pod, however warm the others are;
    with none of their format, they have nothing to copy (opened at once with the gate on)."""
    old = [pod("a", hit_rate=50.0), pod("b", hit_rate=1.0, kv_format="int8")]
    new = [pod("c", kv_format="int8"), pod("d", kv_format="int8")]
    plan = plan_warmups(frozenset({"a", "b"}), old + new, 16, gated=True)
    assert plan == WarmupPlan((Warmup("both", old[1], tuple(new)),))
    plan = plan_warmups(frozenset({"a"}), [old[0], *new], 16, gated=True)
    assert plan == WarmupPlan(open_now=tuple(new))


def test_pods_that_start_serving_copy_the_warmest_old_pod_of_their_role() -> None:
    old = [pod("a", hit_rate=5.0), pod("b", hit_rate=50.0), pod("p1", "prefill", 1.0)]
    new = [pod("c"), pod("d"), pod("p2", "prefill")]
    plan = plan_warmups(frozenset({"a", "b", "p1"}), old + new, 16, gated=True)
    assert plan == WarmupPlan((Warmup("both", old[1], (new[0], new[1])), Warmup("prefill", old[2], (new[2],))))


def test_nothing_is_warmed_without_a_new_pod_an_old_peer_or_a_limit() -> None:
    serving = [pod("a"), pod("b")]
    assert plan_warmups(None, serving, 16) == WarmupPlan(), "a restarted operator re-warms no Ready pod"
    assert plan_warmups(frozenset({"a", "b"}), serving, 16) == WarmupPlan(), "no new pod"
    assert plan_warmups(frozenset({"gone"}), serving, 16) == WarmupPlan(), "no old pod serves: nothing to copy"
    assert plan_warmups(frozenset({"a"}), serving, 0) == WarmupPlan(), "warmupPrefixes 0 turns warm-up off"
    assert plan_warmups(frozenset({"a"}), serving, 16) == WarmupPlan((Warmup("both", serving[0], (serving[1],)),))


def test_with_the_gate_on_new_pods_with_nothing_to_copy_are_opened_at_once() -> None:
    first = [pod("a", ready=False), pod("b", ready=False)]
    assert plan_warmups(frozenset(), first, 16, gated=True) == WarmupPlan(open_now=tuple(first)), \
        "a pool's first pods: no peer of their role to copy"
    mixed = [pod("a"), pod("b"), pod("p", "prefill")]
    assert plan_warmups(frozenset({"a"}), mixed, 16, gated=True) == WarmupPlan(
        (Warmup("both", mixed[0], (mixed[1],)),), (mixed[2],)), "a role's first pod is opened, the other warmed"
    assert plan_warmups(frozenset({"a"}), mixed, 0, gated=True) == WarmupPlan(open_now=(mixed[1], mixed[2])), \
        "warm-up limit 0 with the gate on: nothing is copied, so nothing is held"


def test_a_restarted_operator_warms_the_pods_not_ready_yet_from_the_ready_ones() -> None:
    serving = [pod("a", hit_rate=3.0), pod("b", ready=False), pod("p", "prefill", ready=False)]
    assert plan_warmups(None, serving, 16, gated=True) == WarmupPlan(
        (Warmup("both", serving[0], (serving[1],)),), (serving[2],))


def test_equally_warm_peers_are_chosen_by_name() -> None:
    serving = [pod("z"), pod("m"), pod("new")]
    (plan,) = plan_warmups(frozenset({"z", "m"}), serving, 4).warmups
    assert plan.source.name == "m"


def test_targets_a_warm_up_did_not_reach_are_left_closed() -> None:
    plan = Warmup("both", pod("a"), (pod("b"), pod("c"), pod("d"), pod("e"), pod("f")))
    answers = {"b": {"blocks_pulled": 3, "failed": 0}, "c": {"blocks_pulled": 0, "failed": 2}, "d": None,
               "e": ConnectionError("peer unreachable"), "f": WarmupUnanswered("still copying")}
    assert [t.name for t in left_closed(plan, answers)] == ["d", "e"], \
        "an engine opens its own gate when a warm request ends, even a failed one, or one still copying"


def test_the_warm_body_sends_the_hottest_chains_up_to_the_limit() -> None:
    hot = {"chains": [{"hashes": [1, 2, 3], "hits": 9}, {"hashes": [1, 4], "hits": 3}, {"hashes": [7], "hits": 1}]}
    assert warm_body("http://peer:8000", hot, 2) == {"source": "http://peer:8000", "chains": [[1, 2, 3], [1, 4]]}
    assert warm_body("http://peer:8000", {"chains": []}, 2) is None, "a cold peer: nothing to send"


@pytest.mark.parametrize("hot", [{}, {"chains": "x"}, {"chains": [{"hashes": []}]}, {"chains": [{"hashes": ["1"]}]},
                                 {"chains": [[1, 2]]}])
def test_a_malformed_hot_listing_is_refused(hot: dict) -> None:
    with pytest.raises(ValueError, match="hot listing"):
        warm_body("http://peer:8000", hot, 4)


def body(**scaling: object) -> dict:
    return {"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "chat", "namespace": "ns", "uid": "u"},
            "spec": {"model": {"source": "bundled"}, "scaling": scaling}}


def test_warmup_prefixes_defaults_on_and_is_bounded() -> None:
    assert parse_pool(body()).spec["scaling"]["warmupPrefixes"] == HOT_CHAINS_DEFAULT
    assert parse_pool(body(warmupPrefixes=0)).spec["scaling"]["warmupPrefixes"] == 0
    with pytest.raises(SpecError, match="warmupPrefixes"):
        parse_pool(body(warmupPrefixes=-1))


def scraped(name: str, kv_format: str = "auto") -> PodMetrics:
    return parse_pod(name, "both", f'{VllmMetric.CACHE_CONFIG}{{block_size="16",num_gpu_blocks="100",'
                                   f'cache_dtype="{kv_format}"}} 1\n')


def test_a_tick_plans_from_what_was_scraped_and_remembers_it_for_the_next() -> None:
    """The one planning step the operator's timer and `kvmesh up -f` share: scraped pods with a place (URL and
    readiness), their hit rates and KV formats; a first tick warms only pods not Ready; the next, those new since."""
    memory = PoolMemory()
    settings = WarmupSettings.of(parse_pool(body()))
    assert settings == WarmupSettings(HOT_CHAINS_DEFAULT, True)
    assert WarmupSettings.of(parse_pool(body(warmupPrefixes=0))) == WarmupSettings(0, False)
    places = {"a": PodPlace("http://a", True), "b": PodPlace("http://b", False)}
    first = plan_tick_warmups(memory, [scraped("a"), scraped("b"), scraped("no-address")], places, {}, settings)
    assert [(w.source.url, [t.name for t in w.targets]) for w in first.warmups] == [("http://a", ["b"])]
    assert memory.serving == {"a", "b"}
    places |= {"b": PodPlace("http://b", True), "c": PodPlace("http://c", False), "d": PodPlace("http://d", False)}
    second = plan_tick_warmups(memory, [scraped("a"), scraped("b"), scraped("c"), scraped("d", "fp8")], places,
                               {"a": 1.0, "b": 5.0}, settings)
    assert [(w.source.name, [t.name for t in w.targets]) for w in second.warmups] == [("b", ["c"])]
    assert [p.name for p in second.open_now] == ["d"]  # the only pod of its KV format: nothing to copy
    assert memory.serving == {"a", "b", "c", "d"}


def test_the_warm_up_gate_defaults_to_a_minute_only_while_warm_up_is_on() -> None:
    assert parse_pool(body()).spec["scaling"]["warmupGraceSeconds"] == 60
    assert warmup_grace_seconds(parse_pool(body())) == 60
    assert warmup_grace_seconds(parse_pool(body(warmupGraceSeconds=5))) == 5
    assert warmup_grace_seconds(parse_pool(body(warmupPrefixes=0))) == 0, "nothing warms the pods: no gate"
    assert warmup_grace_seconds(parse_pool(body(warmupGraceSeconds=0))) == 0
    for bad in (-1, 601):
        with pytest.raises(SpecError, match="warmupGraceSeconds"):
            parse_pool(body(warmupGraceSeconds=bad))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_timer_warms_pods_that_start_serving_and_reports_each_outcome(tmp_path: Path) -> None:
    port = free_port()
    servers = {ip: MetricsServer(ip, port) for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.4")}
    calls: list[tuple[Warmup, int]] = []
    opened: list[str] = []

    def warm(plan: Warmup, limit: int) -> dict[str, Any]:
        calls.append((plan, limit))
        return {t.name: ConnectionError("peer unreachable") if t.url.startswith("http://127.0.0.4") else
                {"blocks_pulled": 7, "blocks_present": 1, "failed": 0, "errors": []} for t in plan.targets}

    def open_gates(pods: Sequence[ServingPod]) -> dict[str, Exception | None]:
        opened.extend(p.name for p in pods)
        return dict.fromkeys((p.name for p in pods), None)

    async def main() -> None:
        async with operator(tmp_path, warm=warm, open_gates=open_gates) as env:
            spec = {"engine": {"port": port}, "replicas": {"both": {"min": 1, "max": 6}},
                    "scaling": {"intervalSeconds": 1, "warmupPrefixes": 5}}
            await env.k8s.post(POOLS, json=pool_body(**spec))
            await eventually(lambda: env.get("apps/v1/deployments", "chat-both"))
            await env.k8s.post(f"/api/v1/namespaces/{NS}/pods", json=pod_body("chat-both-0", "127.0.0.2"))

            async def clock() -> None:
                while True:
                    await asyncio.sleep(0.05)
                    env.clock[0] += 0.5

            ticking = asyncio.create_task(clock())
            await eventually(lambda: env.pool()["status"]["kvUsage"]["observed"] > 0)  # a tick saw pod 0 serve
            assert calls == [], "the pool's first pod has no peer to copy"
            assert opened == ["chat-both-0"], "so its warm-up gate is opened at once"
            for name, ip in (("chat-both-1", "127.0.0.3"), ("chat-both-2", "127.0.0.4")):
                await env.k8s.post(f"/api/v1/namespaces/{NS}/pods", json=pod_body(name, ip))
            await eventually(lambda: env.events("WarmedUp") and env.events("WarmupFailed"))
            seen = servers["127.0.0.3"].scrapes
            await eventually(lambda: servers["127.0.0.3"].scrapes >= seen + 2)  # two more ticks: no re-warming
            ticking.cancel()
            warmed = sorted(t.name for plan, _ in calls for t in plan.targets)
            assert warmed == ["chat-both-1", "chat-both-2"]
            assert all(limit == 5 and plan.source.name == "chat-both-0" for plan, limit in calls)
            assert calls[0][0].source.url == f"http://127.0.0.2:{port}"
            (ok,), (failed,) = env.events("WarmedUp"), env.events("WarmupFailed")
            assert "chat-both-1" in ok["message"] and "7 blocks pulled" in ok["message"]
            assert failed["type"] == "Warning" and "chat-both-2" in failed["message"]
            assert "peer unreachable" in failed["message"]
            # the new pods were not Ready (no Ready condition): warmed all the same; the one whose warm-up never
            # reached it is opened by the operator, the warmed one opened its own gate
            await eventually(lambda: opened == ["chat-both-0", "chat-both-2"])

    try:
        run(main)
    finally:
        for server in servers.values():
            server.close()


def test_a_warm_up_still_copying_is_reported_as_such_not_as_failed() -> None:
    outcome = warmup_outcome("a", "b", WarmupUnanswered("no answer from b within 60 s"))
    assert outcome.ok is None and "gate opens when the copy ends" in outcome.message
    assert warmup_outcome("a", "b", ConnectionError("refused")).ok is False
    assert warmup_outcome("a", "b", {"blocks_pulled": 4, "blocks_present": 1}).message.startswith("warmed b from a")


@pytest.mark.parametrize("gated", [True, False])
def test_carrying_out_a_plan_warms_then_opens_what_nothing_reached(gated: bool) -> None:
    """The HTTP calls are injected (this is the orchestration both the operator and `kvmesh up` run): a first pod
    is opened at once; of a warm-up's targets, the warmed one and the one still copying are left to open their
    own gates, the one the warm-up never reached is opened, when the engines have a gate at all."""
    plan = WarmupPlan((Warmup("both", pod("a"), (pod("b"), pod("c"), pod("d"))),), (pod("first"),))
    answers = {"b": {"blocks_pulled": 2, "blocks_present": 0}, "c": WarmupUnanswered("slow"),
               "d": ConnectionError("refused")}
    asked: list[list[str]] = []

    def open_gates(pods):
        asked.append([p.name for p in pods])
        return {p.name: None for p in pods}

    results = carry_out(plan, 4, gated, lambda warmup, limit: answers, open_gates)
    assert [(target, o.ok) for _, target, o in results.warmed] == [("b", True), ("c", None), ("d", False)]
    assert asked == [["first", "d"] if gated else ["first"]]
    assert [name for name, o in results.opened] == asked[0] and all(o.ok is None for _, o in results.opened)
