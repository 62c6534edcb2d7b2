"""Adapters added to or removed from a pool reach running engines without a restart: the plan against what an
engine serves (pure), the pod template's hash that no longer rolls the engines for a changed list, and the
operator's apply step against real in-process engines over the tiny model (load, unload, a full 409 tried again,
new weights under a name as one load in place, done while the adapter is busy once a slot is spare, that finds none
of the old weights' cache, a 400 for an adapter the engine cannot load recorded once and not retried), and the kopf
timer against kmock's emulator with a Ready pod whose IP is a real engine's."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh.engine.internal_token import InternalToken
from kvmesh.engine.protocol import LORA_FINGERPRINT_FIELD, OperatorMetric
from kvmesh.operator import handlers
from kvmesh.operator.crd import Pool, parse_pool
from kvmesh.operator.desired import CONFIG_HASH_ANNOTATION, config_map, desired_objects, engine_adapters
from kvmesh.operator.lora import (
    LOAD,
    OK,
    REFUSED,
    RETRY,
    UNLOAD,
    AdapterAction,
    AdapterMemory,
    EnginePod,
    adapter_tick,
    http_act,
    http_served,
    outcome_of,
    plan_adapters,
    served_adapters,
    summarize,
    sync_pool,
)
from kvmesh.operator.metrics import OperatorMetrics
from kvmesh.processes import free_port

from .conftest import make_engine
from .engines import serve_engine
from .test_lora import ATTN_QV, write_adapter
from .test_operator import NS, POOLS, FakeEngine, conditions, eventually, operator, pod_body, pool_body, run

# ---- the plan --------------------------------------------------------------------------------------------------------


def test_missing_adapters_are_loaded_and_undeclared_ones_unloaded_unloads_first_by_name() -> None:
    plan = plan_adapters({"b": "/a/b", "a": "/a/a", "keep": "/a/keep"}, {"keep": "/a/keep", "z": "/a/z", "y": "/a/y"})
    assert plan.actions == (AdapterAction(UNLOAD, "y"), AdapterAction(UNLOAD, "z"),
                            AdapterAction(LOAD, "a", "/a/a"), AdapterAction(LOAD, "b", "/a/b"))
    assert plan.held == ()


def test_a_changed_path_is_one_load_in_place_never_an_unload() -> None:
    """The name stays served throughout: the engine swaps the weights (load_inplace), even while it is busy."""
    plan = plan_adapters({"sql": "/v2", "new": "/new"}, {"sql": "/v1"})
    assert plan.actions == (AdapterAction(LOAD, "new", "/new"), AdapterAction(LOAD, "sql", "/v2"))
    assert [a.inplace for a in plan.actions] == [False, True]
    assert plan.actions[1].describe() == "update LoRA adapter 'sql' in place from /v2"
    # a refusal is of the directory, whichever way it was loaded (the pool's status keeps no such flag)
    held = plan_adapters({"sql": "/v2"}, {"sql": "/v1"}, refused={AdapterAction(LOAD, "sql", "/v2")})
    assert (held.actions, held.held) == ((), (AdapterAction(LOAD, "sql", "/v2"),))


def test_nothing_to_do_when_the_engine_serves_what_is_declared() -> None:
    assert plan_adapters({"sql": "/v1"}, {"sql": "/v1"}).actions == ()
    assert plan_adapters({}, {}).actions == ()


def test_a_base_model_only_engine_serves_no_adapters_and_loads_the_declared_ones() -> None:
    models = {"object": "list", "data": [{"id": "smol", "object": "model", "root": "smol", "parent": None}]}
    assert served_adapters(models) == {}
    assert plan_adapters({"sql": "/v1"}, served_adapters(models)).actions == (AdapterAction(LOAD, "sql", "/v1"),)
    with_card = {"data": models["data"] + [{"id": "sql", "root": "/v1", "parent": "smol"}]}
    assert served_adapters(with_card) == {"sql": "/v1"}
    for wrong in ({"detail": "Not Found"}, [], {"data": [{"object": "model"}]}):
        with pytest.raises(ValueError, match="did not answer a list of models with ids"):
            served_adapters(wrong)
    with pytest.raises(ValueError, match="without its directory"):
        served_adapters({"data": [{"id": "sql", "parent": "smol"}]})


def test_another_spelling_of_the_same_directory_is_no_change() -> None:
    """The engine reports the path it opened, normalized: `/adapters/sql/` in the spec must not unload and load
    the adapter again at every tick."""
    assert plan_adapters({"sql": "/adapters/sql/"}, {"sql": "/adapters/sql"}).actions == ()
    assert plan_adapters({"sql": "/adapters/./sql"}, {"sql": "/adapters/sql"}).actions == ()


def test_only_names_the_spec_manages_are_unloaded() -> None:
    """An adapter loaded by hand under a name the spec never declared stays; one the spec declared and dropped
    goes."""
    plan = plan_adapters({"sql": "/a/sql"}, {"sql": "/a/sql", "by-hand": "/x", "dropped": "/a/d"},
                         managed={"sql", "dropped"})
    assert plan.actions == (AdapterAction(UNLOAD, "dropped"),)


def test_a_pool_that_never_declared_adapters_is_not_read_and_says_nothing() -> None:
    def unreachable(url: str, timeout: float) -> dict[str, str]:
        raise AssertionError(f"{url} was read")

    memory = AdapterMemory()
    assert sync_pool([EnginePod("p", "both", "http://p")], {}, memory, read=unreachable) == []
    assert summarize([], {}).ok
    pending = summarize([], {"sql": "/a/sql"})  # declared, but no ready engine yet
    assert (pending.ok, pending.reason) == (False, "Pending")


def test_one_tick_sets_the_adapters_condition_only_for_a_pool_that_declares_or_dropped_adapters() -> None:
    """The tick both operators run (the cluster's timer, `kvmesh up -f`): a pool that lists its adapters in engine
    settings is left alone, one that never declared any gets no AdaptersLoaded condition, and one that dropped
    its last adapter gets one until the engines no longer serve it. Fake engine calls: the rule is pure."""
    served: dict[str, str] = {}

    def read(url: str, timeout: float) -> dict[str, str]:
        assert url == "http://p"
        return dict(served)

    def act(url: str, action: AdapterAction, timeout: float) -> tuple[int | None, str]:
        if action.kind == LOAD:
            served[action.name] = str(action.path)
        else:
            del served[action.name]
        return 200, ""

    def unreachable(url: str, timeout: float) -> dict[str, str]:
        raise AssertionError(f"{url} was read")

    pod, memory = EnginePod("p", "both", "http://p"), AdapterMemory()
    listed = adapter_tick(None, [pod], memory, {pod.life}, read=unreachable, act=act)
    assert (listed.syncs, listed.summary, listed.status) == ((), None, None)
    assert adapter_tick({}, [pod], memory, {pod.life}, read=unreachable, act=act).status is None
    loaded = adapter_tick({"sql": "/a/sql"}, [pod], memory, {pod.life}, read=read, act=act)
    assert loaded.status is not None and (loaded.status.ok, loaded.status.reason) == (True, "Loaded")
    assert loaded.lines == ["p: load LoRA adapter 'sql' from /a/sql"]
    dropped = adapter_tick({}, [pod], memory, {pod.life}, read=read, act=act)
    assert dropped.status is not None and dropped.status.ok and dropped.lines == ["p: unload LoRA adapter 'sql'"]
    assert served == {} and adapter_tick({}, [pod], memory, {pod.life}, read=unreachable, act=act).status is None


def test_a_refusal_is_kept_while_the_engine_is_only_not_ready() -> None:
    memory = AdapterMemory(refused={("p", "uid-p", 0): {AdapterAction(LOAD, "sql", "/v2")}})
    sync_pool([], {"sql": "/v2"}, memory, alive={("p", "uid-p", 0)})
    assert memory.refused == {("p", "uid-p", 0): {AdapterAction(LOAD, "sql", "/v2")}}
    sync_pool([], {"sql": "/v2"}, memory, alive=set())  # deleted: forgotten
    assert memory.refused == {}


def test_an_action_the_engine_refused_is_held_until_the_spec_changes_it() -> None:
    refused = {AdapterAction(LOAD, "sql", "/v2")}
    plan = plan_adapters({"sql": "/v2"}, {}, refused)
    assert (plan.actions, plan.held) == ((), (AdapterAction(LOAD, "sql", "/v2"),))
    assert plan_adapters({"sql": "/v3"}, {}, refused).actions == (AdapterAction(LOAD, "sql", "/v3"),)


def test_answers_are_ok_retried_or_refused() -> None:
    load, unload = AdapterAction(LOAD, "a", "/a"), AdapterAction(UNLOAD, "a")
    assert outcome_of(load, 200, "").outcome == OK
    assert outcome_of(unload, 404, "no LoRA adapter named 'a'").outcome == OK  # gone already: done
    for status in (409, 503, None):
        assert outcome_of(load, status, "busy").outcome == RETRY
    refused = outcome_of(load, 400, "rank 16; this engine takes ranks 1 to 8")
    assert refused.outcome == REFUSED and "ranks 1 to 8" in refused.message
    assert "not retried until spec.model.loraAdapters changes it" in refused.message
    assert outcome_of(load, 404, "x").outcome == REFUSED


# ---- the pod template's hash -----------------------------------------------------------------------------------------


def pool_with(adapters: list[dict[str, Any]], **engine: Any) -> Pool:
    spec = {"model": {"source": "bundled", "loraAdapters": adapters}, "engine": {"maxLoras": 4, **engine},
            "replicas": {"both": {"min": 1, "max": 4}}}
    return parse_pool({"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "chat"},
                       "spec": copy.deepcopy(spec)})


def engine_template_hash(pool: Pool) -> str:
    (engine,) = [o for o in desired_objects(pool) if o["kind"] == "Deployment" and o["metadata"]["name"] == "chat-both"]
    return engine["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]


def test_changing_only_the_adapter_list_does_not_roll_the_engines_but_the_configmap_has_it() -> None:
    before = pool_with([{"name": "sql", "path": "/models/sql"}])
    after = pool_with([{"name": "chat", "path": "/models/chat"}])
    none = pool_with([])
    assert engine_template_hash(before) == engine_template_hash(after) == engine_template_hash(none)
    assert config_map(before)["data"] != config_map(after)["data"]  # a new pod reads the current list at start
    assert "/models/chat" in config_map(after)["data"]["engine.yaml"]
    assert engine_adapters(after) == {"chat": "/models/chat"}


def test_adapters_given_as_a_list_in_engine_settings_roll_the_engines() -> None:
    """That form is not kept in step in running engines, so a change to it must roll them (or nothing happens)."""
    def listed(modules: list[str]) -> Pool:
        return pool_with([], settings={"lora_modules": modules})

    assert engine_adapters(listed(["sql=/a/sql"])) is None
    assert engine_template_hash(listed(["sql=/a/sql"])) != engine_template_hash(listed(["sql=/a/sql2"]))


def test_changing_anything_else_still_rolls_the_engines() -> None:
    adapters = [{"name": "sql", "path": "/models/sql"}]
    assert engine_template_hash(pool_with(adapters)) != engine_template_hash(pool_with(adapters, maxNumSeqs=7))
    # an adapter on its own claim is a volume of the pod: adding one needs new pods
    claimed = [*adapters, {"name": "poet", "path": "/adapters/poet", "volumeClaim": "poet"}]
    (old, new) = (next(o for o in desired_objects(p) if o["metadata"]["name"] == "chat-both")
                  for p in (pool_with(adapters), pool_with(claimed)))
    assert old["spec"]["template"] != new["spec"]["template"]


def test_pods_that_mount_an_adapter_under_its_old_name_are_not_sent_its_new_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter renamed on its own claim (support-v1 -> support-v2, claim `support`) rolls the engines; meanwhile
    the old pods mount the claim at /adapters/support-v1. They counted as synced (their claim names matched), were
    sent a load of /adapters/support-v2, a path they lack, and the pool said AdapterRefused for a correct spec. The
    engine's answers are stubbed: its pod's volume mounts exist only in a cluster."""
    sent: list[Any] = []
    events: list[str] = []
    monkeypatch.setattr(handlers, "http_served", lambda *_, **__: {"support-v1": "/adapters/support-v1"})

    def act(url: str, action: Any, *_: Any, **__: Any) -> tuple[int, str]:  # what a pod lacking the path answers
        sent.append(action)
        return 400, f"{action.path}: no such directory"

    monkeypatch.setattr(handlers, "http_act", act)
    monkeypatch.setattr(handlers.kopf, "event", lambda body, **kw: events.append(kw["reason"]))

    def renamed(name: str) -> Pool:
        return pool_with([{"name": name, "path": f"/adapters/{name}", "volumeClaim": "support"}])

    def pod_of(pool: Pool) -> dict[str, Any]:
        (engine,) = [o for o in desired_objects(pool)
                     if o["kind"] == "Deployment" and o["metadata"]["name"] == "chat-both"]
        return {"metadata": {"name": "chat-both-x", "uid": "u", "labels": {"kvmesh.io/role": "both"}},
                "spec": engine["spec"]["template"]["spec"],
                "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}

    new = renamed("support-v2")
    handlers.sync_adapters(new, None, [pod_of(renamed("support-v1"))], AdapterMemory(), OperatorMetrics())
    assert sent == [] and events == []
    handlers.sync_adapters(new, None, [pod_of(new)], AdapterMemory(), OperatorMetrics())  # a pod of the new template
    assert [a.name for a in sent if a.kind == LOAD] == ["support-v2"]


# ---- applying it to real engines -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pool-loras")
    return {name: str(write_adapter(root / name, seed=seed, rank=4, targets=ATTN_QV, layers=1))
            for name, seed in (("a", 11), ("b", 12), ("c", 13), ("b-v2", 14))} | {
        "big": str(write_adapter(root / "big", seed=15, rank=16, targets=ATTN_QV, layers=1))}  # above max rank 8


@pytest.fixture
def engine_url(tiny_dir: Path, weights: dict[str, str]) -> Iterator[str]:
    engine = make_engine(tiny_dir, kv_cache_blocks=64, max_loras=2, max_lora_rank=8, lora_modules={"a": weights["a"]})
    with serve_engine(engine) as url:
        yield url


def outcomes(syncs: list) -> list[tuple[str, str, str]]:
    return [(r.action.kind, r.action.name, r.outcome) for s in syncs for r in s.results]


@pytest.mark.slow
def test_the_apply_step_loads_unloads_retries_a_full_engine_and_records_a_refusal_once(
        engine_url: str, weights: dict[str, str]) -> None:
    pod = EnginePod("chat-both-0", "both", engine_url)
    memory = AdapterMemory()
    served = {"a": weights["a"]}

    # a new adapter reaches the running engine
    declared = {"a": weights["a"], "b": weights["b"]}
    syncs = sync_pool([pod], declared, memory)
    assert outcomes(syncs) == [(LOAD, "b", OK)]
    assert sync_pool([pod], declared, memory)[0].results == ()  # nothing left to do
    served = {"a": weights["a"], "b": weights["b"]}

    # a third adapter does not fit (max_loras 2): 409, retried at every tick, never recorded as refused
    declared = {**served, "c": weights["c"]}
    for _ in range(2):
        syncs = sync_pool([pod], declared, memory)
        assert outcomes(syncs) == [(LOAD, "c", RETRY)]
    assert memory.refused == {} and summarize(syncs, declared).reason == "Pending"

    # a removed adapter is unloaded, which frees the slot
    declared = {"b": weights["b"], "c": weights["c"]}
    assert outcomes(sync_pool([pod], declared, memory)) == [(UNLOAD, "a", OK), (LOAD, "c", OK)]
    syncs = sync_pool([pod], declared, memory)
    assert syncs[0].results == () and summarize(syncs, declared).ok

    # new weights under the name (an in-place update) while a request of it runs: with every slot taken the update
    # waits (409, retried), the old weights serving the name meanwhile; once a slot is spare (c removed in the same
    # tick: unloads go first) it is done at once, the request running on; the name never answers 404, and the new
    # weights find none of the old weights' cache
    body = {"model": "b", "prompt": list(range(300, 340)), "max_tokens": 1}

    def cached() -> int:
        reply = httpx.post(engine_url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert (cached(), cached()) == (0, 32)
    before = card_of(engine_url, "b")
    running = {"model": "b", "prompt": [7, 8, 9], "max_tokens": 300, "ignore_eos": True, "stream": True}  # ~1 s
    with httpx.stream("POST", engine_url + "/v1/completions", json=running, timeout=120) as stream:
        lines = (line for line in stream.iter_lines() if line.startswith("data: "))
        next(lines)  # it runs
        declared = {"b": weights["b-v2"], "c": weights["c"]}
        syncs = sync_pool([pod], declared, memory)
        assert outcomes(syncs) == [(LOAD, "b", RETRY)] and "free slot" in syncs[0].results[0].message
        assert card_of(engine_url, "b") == before and cached() == 32  # the old weights serve on
        declared = {"b": weights["b-v2"]}
        syncs = sync_pool([pod], declared, memory)
        assert outcomes(syncs) == [(UNLOAD, "c", OK), (LOAD, "b", OK)] and summarize(syncs, declared).ok
        after = card_of(engine_url, "b")
        assert after["root"] == weights["b-v2"] and after[LORA_FINGERPRINT_FIELD] != before[LORA_FINGERPRINT_FIELD]
        assert (cached(), cached()) == (0, 32)  # none of the old weights' blocks; then the new weights' own
        rest = [line for line in lines if line != "data: [DONE]"]
    assert json.loads(rest[-1][len("data: "):])["choices"][0]["finish_reason"] == "length"  # ran on to its end

    # an adapter the engine cannot load (a rank above its max): refused and recorded, the name keeps its weights
    declared = {"b": weights["big"], "c": weights["c"]}
    syncs = sync_pool([pod], declared, memory)
    assert outcomes(syncs) == [(LOAD, "b", REFUSED), (LOAD, "c", OK)]
    assert "ranks 1 to 8" in syncs[0].results[0].message and card_of(engine_url, "b") == after
    metrics = OperatorMetrics()
    pool = pool_with([{"name": "b", "path": weights["big"]}, {"name": "c", "path": weights["c"]}])
    metrics.record_adapters(pool, syncs)
    for _ in range(3):  # no retry storm: held, not tried again, while the spec asks for the same thing
        later = sync_pool([pod], declared, memory)
        assert later[0].results == () and later[0].held == (AdapterAction(LOAD, "b", weights["big"]),)
        metrics.record_adapters(pool, later)
    status = summarize(later, declared)
    assert (status.ok, status.reason) == (False, "Refused") and "chat-both-0" in status.message

    # a restarted engine (the pod's restart count moved) is a new life: the load is tried once more
    restarted = EnginePod("chat-both-0", "both", engine_url, restarts=1)
    assert outcomes(sync_pool([restarted], declared, memory)) == [(LOAD, "b", REFUSED)]  # (this one did not restart)
    assert list(memory.refused) == [restarted.life]

    # the fix: weights it can load, under the same name (in place, idle now)
    declared = {"b": weights["b"], "c": weights["c"]}
    assert outcomes(sync_pool([restarted], declared, memory)) == [(LOAD, "b", OK)]

    def count(action: str, outcome: str) -> float | None:
        return metrics.registry.get_sample_value(f"{OperatorMetric.LORA_ACTIONS}_total", {
            "pool_namespace": "default", "pool": "chat", "role": "both", "action": action, "outcome": outcome})

    assert (count("load", "refused"), count("load", "ok"), count("load", "retry")) == (1, 1, 0)  # 0: pre-created
    metrics.forget("default", "chat")
    assert count("load", "refused") is None


@pytest.mark.slow
def test_an_engine_that_does_not_answer_is_pending_and_others_are_still_synced(engine_url: str,
                                                                               weights: dict[str, str]) -> None:
    pods = [EnginePod("gone", "both", f"http://127.0.0.1:{free_port()}"), EnginePod("up", "both", engine_url)]
    memory = AdapterMemory()
    memory.refused[("old-pod", "", 0)] = {AdapterAction(LOAD, "x", "/x")}
    syncs = sync_pool(pods, {"a": weights["a"], "c": weights["c"]}, memory)
    assert syncs[0].error and syncs[0].results == ()
    assert outcomes(syncs) == [(LOAD, "c", OK)]
    assert summarize(syncs, {}).reason == "Pending"
    assert ("old-pod", "", 0) not in memory.refused  # a pod that is gone is forgotten


# ---- the kopf timer, against the emulator --------------------------------------------------------------------------


def served_by(url: str) -> dict[str, str]:
    return served_adapters(httpx.get(url + "/v1/models", timeout=5).json())


def card_of(url: str, adapter: str) -> dict[str, Any]:
    (card,) = [c for c in httpx.get(url + "/v1/models", timeout=5).json()["data"] if c["id"] == adapter]
    return card


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_operators_timer_syncs_a_changed_list_into_a_ready_pod_without_rolling_it(
        engine_url: str, weights: dict[str, str], tmp_path: Path) -> None:
    """kopf against kmock's emulator, the pod's IP pointing at a real in-process engine: the scaling timer loads a
    listed adapter, unloads a removed one, updates one in place (a new path under its name: one load with
    load_inplace), posts one AdapterRefused Event for an adapter the engine cannot load, and the engine Deployment's
    pod template keeps its hash through the changes."""
    port = int(engine_url.rsplit(":", 1)[1])
    ready_pod = pod_body("chat-both-0", "127.0.0.1")
    ready_pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]

    def spec(adapters: dict[str, str]) -> dict[str, Any]:
        return {"engine": {"port": port, "maxLoras": 2, "maxLoraRank": 8}, "replicas": {"both": {"min": 1, "max": 1}},
                "scaling": {"intervalSeconds": 1},
                "model": {"source": "bundled", "loraAdapters": [{"name": n, "path": p} for n, p in adapters.items()]}}

    def template_hash(env: Any) -> str:
        return env.get("apps/v1/deployments", "chat-both")["spec"]["template"]["metadata"]["annotations"][
            CONFIG_HASH_ANNOTATION]

    async def main() -> None:
        async with operator(tmp_path) as env:
            await env.k8s.post(POOLS, json=pool_body(**spec({"a": weights["a"], "b": weights["b"]})))
            await eventually(lambda: env.get("apps/v1/deployments", "chat-both"))
            first_hash = template_hash(env)
            await env.k8s.post(f"/api/v1/namespaces/{NS}/pods", json=ready_pod)

            async def clock() -> None:
                while True:
                    await asyncio.sleep(0.05)
                    env.clock[0] += 0.5

            ticking = asyncio.create_task(clock())
            await eventually(lambda: served_by(engine_url) == {"a": weights["a"], "b": weights["b"]})
            loaded = await eventually(lambda: (conditions(env).get("AdaptersLoaded") or {}).get("reason") == "Loaded"
                                      and conditions(env)["AdaptersLoaded"])
            assert loaded["status"] == "True" and "2 adapters on 1 ready engines" in loaded["message"]

            await env.k8s.patch(f"{POOLS}/chat", json={"spec": spec({"b": weights["b-v2"], "c": weights["big"]})})
            await eventually(lambda: env.events("AdapterRefused"))
            # a unloaded (removed), b updated in place from its new path (changed), c's load refused
            await eventually(lambda: served_by(engine_url) == {"b": weights["b-v2"]})
            await eventually(lambda: "b-v2" in (env.get("v1/configmaps", "chat-config") or {})["data"]["engine.yaml"])
            assert template_hash(env) == first_hash  # the list changed, the engines did not roll
            begun = env.ticks()
            await eventually(lambda: env.ticks() >= begun + 5)  # five more whole ticks: no retry storm, no 2nd Event
            (event,) = env.events("AdapterRefused")
            assert "'c'" in event["message"] and "ranks 1 to 8" in event["message"]
            refused = await eventually(lambda: conditions(env)["AdaptersLoaded"]["reason"] == "Refused"
                                       and conditions(env)["AdaptersLoaded"])
            assert refused["status"] == "False" and "chat-both-0" in refused["message"]
            assert env.sample(f"{OperatorMetric.LORA_ACTIONS}_total", role="both", action="load",
                              outcome="refused") == 1
            ticking.cancel()

    run(main)


def test_the_adapter_calls_send_the_pools_token_and_a_401_is_retried_not_refused() -> None:
    """/v1/models and the load and unload calls carry the token given as `auth`. A 401 (the pool's token not yet the
    same everywhere: a rotation under way) is tried again at the next tick, never remembered as the spec's refusal."""
    engine = FakeEngine("127.0.0.1", free_port())
    try:
        url = f"http://127.0.0.1:{engine.server.server_address[1]}"
        token = InternalToken.fixed("k" * 43)
        assert http_served(url, auth=token) == {}
        assert http_act(url, AdapterAction(LOAD, "sql", "/a/sql"), auth=token)[0] == 200
        assert http_act(url, AdapterAction(UNLOAD, "sql"), auth=token)[0] == 200
        assert engine.calls() == [("GET", "/v1/models", "k" * 43), ("POST", "/v1/load_lora_adapter", "k" * 43),
                                  ("POST", "/v1/unload_lora_adapter", "k" * 43)]
    finally:
        engine.close()
    assert outcome_of(AdapterAction(LOAD, "sql", "/a/sql"), 401, "no token").outcome == RETRY
    assert outcome_of(AdapterAction(LOAD, "sql", "/a/sql"), 403, "forbidden").outcome == REFUSED
