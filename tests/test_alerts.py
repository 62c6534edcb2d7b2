"""The chart's alerts: a valid rule file, shipped unchanged in the PrometheusRule, and each alert firing above its
threshold and silent below it, as `promtool test rules` evaluates them over synthetic series."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from helm_python import _native

from kvmesh.engine.protocol import Metric, OperatorMetric, RouterMetric

from .promql import CHART, RULES, promtool

POOL = 'namespace="ml", pool="chat"'
WHERE = {"namespace": "ml", "pool": "chat"}
OPERATOR = 'pool_namespace="ml", pool="chat", namespace="kvmesh-system", pod="kvmesh-operator-0"'
OPERATOR_TARGET = 'namespace="kvmesh-system", pod="kvmesh-operator-0"'  # its own target's labels (and its series')
RESTARTED = OPERATOR.replace("kvmesh-operator-0", "kvmesh-operator-1")  # a new pod: new series
# The operator's heartbeat (time() is 0 at the first sample): evaluated every minute, its stamp equal to the time
LAST, INTERVAL = OperatorMetric.LAST_EVALUATION, OperatorMetric.EVALUATION_INTERVAL
EVALUATIONS = OperatorMetric.EVALUATIONS + "_total"
DESIRED = OperatorMetric.DESIRED_REPLICAS
POOL_PODS = (f'up{{pod="r0", role="router", {POOL}}}', "1x40")  # the pool exists: its router is a target
ROUTER = f'pod="r0", role="router", {POOL}'
SHED, REQUESTS = RouterMetric.SHED + "_total", RouterMetric.REQUESTS + "_total"
DATABASE_ERRORS = RouterMetric.DATABASE_ERRORS + "_total"


def database_errors(**values: str) -> list[tuple[str, str]]:
    """The routers' database error counters, one per component (each at 0 from the router's start: `0x40` unless
    given)."""
    return [(f'{DATABASE_ERRORS}{{component="{c}", {ROUTER}}}', values.get(c, "0x40"))
            for c in ("request_log", "batch_runner", "batch_api", "limit_sync")]


def database_failing(component: str, count: int) -> dict[str, Any]:
    return alert("KvmeshDatabaseFailing", {"severity": "warning", "component": component, **WHERE},
                 f"Pool ml/chat: the routers' {component} cannot use the pool's database",
                 f"The routers' {component} has been failing operations on the pool's database (spec.store) for 5 "
                 f"minutes, {count} in the last 2: request log rows are dropped, the Files and Batches API answers "
                 "503, running batches pause, stored responses and the tenant limits' split wait; requests still "
                 "flow. Check that a router pod reaches the database and that its disk has room, and the routers' "
                 "logs (the driver's error once a minute per component).")
SHEDDING = {"alertname": "KvmeshRouterShedding", "labels": {"severity": "warning", **WHERE},
            "summary": "Pool ml/chat: over 5 % of clients' requests refused with 429",
            "description": "The routers shed 10% of clients' requests (batches' deferred requests not counted): the "
                           "pool is too small for its load."}
LOADING = Metric.ENGINE_LOADING
DOWN = ("Engine ml/e0 (decode) of pool chat is down",
        "Prometheus cannot scrape it: it crashed, failed to load its model or cannot be reached (an engine still "
        "loading answers). The routers send its requests to the other pods.")
NO_DECODE = ("Pool ml/chat has no decode engine up", "No decode engine answers: the pool cannot serve requests.")
E0 = {"severity": "warning", "pod": "e0", "role": "decode", **WHERE}
STALLED = ("Pool ml/chat: the operator stopped evaluating it",
           "The operator last evaluated the pool 5m 0s ago, over three of its scaling periods: nothing scales it, "
           "warms its new engines or syncs its adapters. Check that the operator's pod runs (not crash-looping), "
           "its log for a stuck timer, and that it may still watch InferencePools.")


def alert(name: str, labels: dict[str, str], summary: str, description: str) -> dict[str, Any]:
    return {"alertname": name, "labels": labels, "summary": summary, "description": description}


HEARTBEAT = [(f"{LAST}{{{OPERATOR}}}", "0+60x40"), (f"{INTERVAL}{{{OPERATOR}}}", "60x40")]  # evaluated every minute
NO_ROUTERS = alert("KvmeshPoolHasNoRouters", {"severity": "critical", **WHERE}, "Pool ml/chat has no router up",
                   "No router of the pool answers: no request reaches its engines (clients get connection errors, a "
                   "Gateway with FailClose refuses them). `kubectl -n ml get pods -l "
                   "kvmesh.io/pool=chat,kvmesh.io/role=router` and their logs and Events say why (crashing, Pending, "
                   "a NetworkPolicy).")


def forecast_above(role: str, usage: str) -> dict[str, Any]:
    return alert("KvmeshKVForecastAbove95Percent", {"severity": "warning", "role": role, **WHERE},
                 f"Pool ml/chat: {role} engines' KV usage forecast above 95 %",
                 f"The {role} engines forecast a p90 KV usage of {usage}: add replicas or KV memory.")


def router_down(pod: str) -> dict[str, Any]:
    return alert("KvmeshRouterDown", {"severity": "warning", "pod": pod, "role": "router", **WHERE},
                 f"Router ml/{pod} of pool chat is down",
                 "Prometheus cannot scrape it: it crashed, cannot start or cannot be reached (a NetworkPolicy, the "
                 "node). The pool's other routers, if any is up, take its requests.")


def engines_unavailable(role: str, wanted: int) -> dict[str, Any]:
    return alert("KvmeshPoolEnginesUnavailable", {"severity": "critical", "role": role, **WHERE},
                 f"Pool ml/chat: no {role} engine has run for 10 minutes",
                 f"The operator wants at least {wanted} {role} engine(s) and none answers /metrics: the pool cannot "
                 "serve requests. Pods that are not scrape targets are Pending: `kubectl -n ml describe pods -l "
                 f"kvmesh.io/pool=chat,kvmesh.io/role={role}` says why (no node with the requested GPUs or memory, "
                 "taints, a quota). No target for any pool means Prometheus does not scrape the pools (the "
                 "PodMonitor's labels, monitoring.labels).")


# Each case: input series (1 minute apart), when to look, and what must be firing then (nothing: silent).
CASES: dict[str, tuple[list[tuple[str, str]], str, list[dict[str, Any]]]] = {
    "forecast above 95 %": (
        [(f'kvmesh_kv_forecast_usage_ratio{{level="p90", pod="e0", role="both", {POOL}}}', "0.97x10"),
         (f'kvmesh_kv_forecast_usage_ratio{{level="p90", pod="e1", role="both", {POOL}}}', "0.96x10"),
         (f'kvmesh_kv_forecast_usage_ratio{{level="p50", pod="e0", role="both", {POOL}}}', "0.5x10")],
        "5m", [forecast_above("both", "96.5%")]),
    "forecast below 95 % on average": (
        [(f'kvmesh_kv_forecast_usage_ratio{{level="p90", pod="e0", role="both", {POOL}}}', "0.99x10"),
         (f'kvmesh_kv_forecast_usage_ratio{{level="p90", pod="e1", role="both", {POOL}}}', "0.85x10")],
        "5m", []),
    "decode forecast above 95 % beside idle prefill engines": (
        # a disaggregated pool: the prefill engines' low usage must not hide decode engines about to fill
        [(f'kvmesh_kv_forecast_usage_ratio{{level="p90", pod="d0", role="decode", {POOL}}}', "1.2x10"),
         (f'kvmesh_kv_forecast_usage_ratio{{level="p90", pod="d1", role="decode", {POOL}}}', "1.2x10"),
         (f'kvmesh_kv_forecast_usage_ratio{{level="p90", pod="p0", role="prefill", {POOL}}}', "0.05x10")],
        "5m", [forecast_above("decode", "120%")]),
    "hit ratio halved": (
        # 1,000 prompt tokens a minute; 80 % hit for 80 minutes, then 20 %
        [(f'kvmesh_prefix_cache_query_tokens_total{{pod="e0", {POOL}}}', "0+1000x120"),
         (f'kvmesh_prefix_cache_hit_tokens_total{{tier="device", pod="e0", {POOL}}}', "0+800x80 64200+200x39")],
        "110m",
        [alert("KvmeshPrefixHitRatioDropped", {"severity": "warning", **WHERE},
               "Pool ml/chat: prefix cache hit ratio fell by more than half",
               "The token hit ratio of the last 10 minutes is 20%, under half of the hour before.")]),
    "hit ratio lower but not halved": (
        [(f'kvmesh_prefix_cache_query_tokens_total{{pod="e0", {POOL}}}', "0+1000x120"),
         (f'kvmesh_prefix_cache_hit_tokens_total{{tier="device", pod="e0", {POOL}}}', "0+800x80 64600+600x39")],
        "110m", []),
    "hit ratio halved on too few lookups": (
        [(f'kvmesh_prefix_cache_query_tokens_total{{pod="e0", {POOL}}}', "0+100x120"),
         (f'kvmesh_prefix_cache_hit_tokens_total{{tier="device", pod="e0", {POOL}}}', "0+80x80 6420+20x39")],
        "110m", []),
    "10 % of clients' requests shed": (
        [(f'{SHED}{{priority="normal", source="client", {ROUTER}}}', "0+10x15"),
         (f'{REQUESTS}{{outcome="ok", route="aggregated", source="client", {ROUTER}}}', "0+90x15"),
         (f'{REQUESTS}{{outcome="shed", route="aggregated", source="client", {ROUTER}}}', "0+10x15")],
        "12m", [SHEDDING]),
    "10 % of clients' requests shed beside a batch served whole": (
        # 1,000 batch requests a minute, all answered: they neither dilute the clients' 429s nor count as theirs
        [(f'{SHED}{{priority="normal", source="client", {ROUTER}}}', "0+10x15"),
         (f'{REQUESTS}{{outcome="ok", route="aggregated", source="client", {ROUTER}}}', "0+90x15"),
         (f'{REQUESTS}{{outcome="shed", route="aggregated", source="client", {ROUTER}}}', "0+10x15"),
         (f'{REQUESTS}{{outcome="ok", route="aggregated", source="batch", {ROUTER}}}', "0+1000x15")],
        "12m", [SHEDDING]),
    "1 % of clients' requests shed": (
        [(f'{SHED}{{priority="low", source="client", {ROUTER}}}', "0+1x15"),
         (f'{REQUESTS}{{outcome="ok", route="aggregated", source="client", {ROUTER}}}', "0+99x15"),
         (f'{REQUESTS}{{outcome="shed", route="aggregated", source="client", {ROUTER}}}', "0+1x15")],
        "12m", []),
    "only a batch's requests shed": (
        # a big batch job deferred at priority low (half its attempts refused and retried) while every client's
        # request is served: the pool does what it should, no alert
        [(f'{SHED}{{priority="low", source="batch", {ROUTER}}}', "0+50x15"),
         (f'{REQUESTS}{{outcome="shed", route="aggregated", source="batch", {ROUTER}}}', "0+50x15"),
         (f'{REQUESTS}{{outcome="ok", route="aggregated", source="batch", {ROUTER}}}', "0+50x15"),
         (f'{SHED}{{priority="normal", source="client", {ROUTER}}}', "0x15"),
         (f'{REQUESTS}{{outcome="ok", route="aggregated", source="client", {ROUTER}}}', "0+100x15")],
        "12m", []),
    "event lag of 500 batches": (
        [(f'kvmesh_router_kv_event_lag_batches{{engine="e0", pod="r0", role="router", {POOL}}}', "500x10"),
         (f'kvmesh_router_kv_event_lag_batches{{engine="e1", pod="r0", role="router", {POOL}}}', "0x10")],
        "5m",
        [alert("KvmeshKVEventLag", {"severity": "warning", **WHERE},
               "Pool ml/chat: a router lags an engine's KV events",
               "A router has 500 KV event batches of an engine still to apply: it routes on a stale index.")]),
    "event lag of 5 batches": (
        [(f'kvmesh_router_kv_event_lag_batches{{engine="e0", pod="r0", role="router", {POOL}}}', "5x10")],
        "5m", []),
    "a new engine's grace ran out": (
        [(f'kvmesh_warmup_gate_opened_total{{reason="grace_expired", pod="e2", role="decode", {POOL}}}',
          "0x5 1x10"),
         (f'kvmesh_warmup_gate_opened_total{{reason="warmed", pod="e1", role="decode", {POOL}}}', "0x5 1x10")],
        "10m",
        [alert("KvmeshWarmupNotReached", {"severity": "warning", **WHERE},
               "Pool ml/chat: a new engine went live unwarmed",
               "1 new engine(s) waited out their warm-up grace in the last 30 minutes: check that the operator runs "
               "and reaches the engine pods, and that the pool's scaling.warmupGraceSeconds exceeds its "
               "scaling.intervalSeconds (the operator warms a new pod at its first tick after the pod loads).")]),
    "new engines warmed": (
        [(f'kvmesh_warmup_gate_opened_total{{reason="warmed", pod="e1", role="decode", {POOL}}}', "0x5 1x10"),
         (f'kvmesh_warmup_gate_opened_total{{reason="grace_expired", pod="e1", role="decode", {POOL}}}', "0x15")],
        "10m", []),
    "a batch held with no request sent": (
        [(f'kvmesh_router_batches_running{{pod="r0", role="router", {POOL}}}', "1x60"),
         (f'kvmesh_router_batch_requests_total{{outcome="ok", pod="r0", role="router", {POOL}}}', "0+1x10 10x50")],
        "50m",
        [alert("KvmeshBatchStalled", {"severity": "warning", **WHERE},
               "Pool ml/chat: a batch runs but sends nothing",
               "A router has held a batch for at least 15 minutes without sending any of its requests, not even one "
               "refused and retried. Check the routers' logs (batch runner) and the pool's database; restarting the "
               "router hands the batch to another replica, which goes on where it stopped.")]),
    "a batch waiting out an overload": (
        # every request refused and retried: the batch waits, as meant; no alert
        [(f'kvmesh_router_batches_running{{pod="r0", role="router", {POOL}}}', "1x60"),
         (f'kvmesh_router_batch_requests_total{{outcome="ok", pod="r0", role="router", {POOL}}}', "0+1x10 10x50"),
         (f'kvmesh_router_batch_requests_total{{outcome="retried", pod="r0", role="router", {POOL}}}', "0+5x60")],
        "50m", []),
    "no batch held": (
        [(f'kvmesh_router_batches_running{{pod="r0", role="router", {POOL}}}', "0x60"),
         (f'kvmesh_router_batch_requests_total{{outcome="ok", pod="r0", role="router", {POOL}}}', "5x60")],
        "50m", []),
    "the response store failing": (
        # 3 failed reads a minute from 5m on, in every 2-minute window
        [(f'kvmesh_router_response_store_errors_total{{operation="read", pod="r0", role="router", {POOL}}}',
          "0x5 0+3x20"),
         (f'kvmesh_router_response_store_errors_total{{operation="write", pod="r0", role="router", {POOL}}}',
          "0x25")],
        "15m",
        [alert("KvmeshResponseStoreFailing", {"severity": "warning", **WHERE},
               "Pool ml/chat: the routers cannot read or write stored responses",
               "Routers failed 6 read(s) or write(s) of stored responses in the last 2 minutes: continuations "
               "(previous_response_id) get 503 and new answers are not kept. Check the pool's database (spec.store) "
               "and the routers' logs.")]),
    "the response store failed a few times, once": (  # a failover of seconds: out of the window in 2 minutes
        [(f'kvmesh_router_response_store_errors_total{{operation="read", pod="r0", role="router", {POOL}}}',
          "0x5 3x20")],
        "12m", []),  # over a 10-minute window it fired at 11m
    "the response store failed once, long ago": (
        [(f'kvmesh_router_response_store_errors_total{{operation="write", pod="r0", role="router", {POOL}}}',
          "0x5 1x40")],
        "40m", []),
    # The pool's database away from 5m on an idle pool (no request to log, no Files API call): the batch runner
    # fails its poll every second and the limit sync every 2 s, in both routers, for 10 minutes
    "the pool's database away": (
        [*database_errors(batch_runner="0x5 0+60x35", limit_sync="0x5 0+30x35"),
         *[(s.replace('pod="r0"', 'pod="r1"'), v) for s, v in database_errors(batch_runner="0x5 0+60x35",
                                                                                limit_sync="0x5 0+30x35")]],
        "15m",
        [database_failing("batch_runner", 240), database_failing("limit_sync", 120)]),
    # A PostgreSQL failover: the database refused for a few seconds before 11m (3 polls, 1 sync failed). Its errors
    # leave the 2-minute window after 2 minutes, short of the 5, so it never fires; at 16m a 10-minute window,
    # still holding them, would have fired
    "a database failover of a few seconds": (
        database_errors(batch_runner="0x10 3x30", limit_sync="0x10 1x30"), "16m", []),
    "a healthy pool's database": (
        database_errors(), "30m", []),
    "a key rotation refused": (
        [(f'kvmesh_router_api_keys_reloads_total{{outcome="refused", pod="r0", role="router", {POOL}}}',
          "0x20 1x30"),
         (f'kvmesh_router_api_keys_reloads_total{{outcome="loaded", pod="r0", role="router", {POOL}}}', "0x50")],
        "40m",
        [alert("KvmeshApiKeysRotationRefused", {"severity": "warning", **WHERE},
               "Pool ml/chat: a router refused a new API keys file",
               "Routers refused 1 new version(s) of the API keys file in the last hour (no keys, a plain key or "
               "broken YAML): the keys in force stay, revoked ones included. The router's log says why; fix the "
               "Secret.")]),
    "key rotations taken": (
        [(f'kvmesh_router_api_keys_reloads_total{{outcome="loaded", pod="r0", role="router", {POOL}}}',
          "0x20 1x30"),
         (f'kvmesh_router_api_keys_reloads_total{{outcome="refused", pod="r0", role="router", {POOL}}}', "0x50")],
        "40m", []),
    "an adapter refused": (
        # the operator's series: the pool's namespace as pool_namespace, its own pod's as the target's namespace
        [(f'kvmesh_operator_lora_actions_total{{action="load", outcome="refused", role="decode", {OPERATOR}}}',
          "0x20 1x30"),
         (f'kvmesh_operator_lora_actions_total{{action="load", outcome="ok", role="decode", {OPERATOR}}}',
          "0x20 2x30")],
        "40m",
        [alert("KvmeshLoraAdapterRefused", {"severity": "warning", **WHERE},
               "Pool ml/chat: an engine refused a LoRA adapter",
               "Engines refused 1 adapter load(s) or unload(s) in the last hour, not retried: the pool's "
               "AdaptersLoaded condition and its AdapterRefused Events say which engine and why. Fix the adapter "
               "in spec.model.loraAdapters; a new path under its name loads new weights in place.")]),
    "an adapter refused over an hour ago": (
        [(f'kvmesh_operator_lora_actions_total{{action="load", outcome="refused", role="decode", {OPERATOR}}}',
          "0x20 1x90")],
        "100m", []),
    "adapters loaded and retried": (
        [(f'kvmesh_operator_lora_actions_total{{action="load", outcome="retry", role="decode", {OPERATOR}}}',
          "0+1x30"),
         (f'kvmesh_operator_lora_actions_total{{action="unload", outcome="ok", role="decode", {OPERATOR}}}',
          "0+1x30"),
         (f'kvmesh_operator_lora_actions_total{{action="load", outcome="refused", role="decode", {OPERATOR}}}',
          "0x30")],
        "25m", []),
    "the operator stopped evaluating a pool": (
        # every minute until 5m, then no more: at 10m the last stamp is 5 minutes old, over 3 x 15 s and 3 minutes
        [(f"{LAST}{{{OPERATOR}}}", "0+60x5 300x15"), (f"{INTERVAL}{{{OPERATOR}}}", "15x20"), POOL_PODS],
        "10m",
        [alert("KvmeshOperatorStalled", {"severity": "warning", **WHERE}, *STALLED)]),
    "the operator is gone": (
        # its series end at 5m (a crash loop, a deleted Deployment): its last stamp still counts
        [(f"{LAST}{{{OPERATOR}}}", "0+60x5"), (f"{INTERVAL}{{{OPERATOR}}}", "15x5"), POOL_PODS],
        "10m",
        [alert("KvmeshOperatorStalled", {"severity": "warning", **WHERE}, *STALLED)]),
    "the operator gone for four hours": (
        # its series ended at 5m and nobody acted: the pool still has no operator
        [(f"{LAST}{{{OPERATOR}}}", "0+60x5"), (f"{INTERVAL}{{{OPERATOR}}}", "15x5"),
         (f'up{{pod="r0", role="router", {POOL}}}', "1x300")],
        "245m",
        [alert("KvmeshOperatorStalled", {"severity": "warning", **WHERE}, STALLED[0],
               STALLED[1].replace("5m 0s", "4h 0m 0s"))]),
    "the operator's pod crash-looping": (
        [(f'up{{component="operator", {OPERATOR_TARGET}}}', "1x5 0x20"), POOL_PODS],
        "15m",
        [alert("KvmeshOperatorDown", {"severity": "warning", "component": "operator", "namespace": "kvmesh-system",
                                      "pod": "kvmesh-operator-0"},
               "The kvmesh operator kvmesh-system/kvmesh-operator-0 is down",
               "Prometheus cannot scrape the operator pod: the pools still serve, but while no operator runs nothing "
               "scales them, warms their new engines, syncs their adapters or applies their edits. Check the pod "
               "(`kubectl -n kvmesh-system get pods -l app.kubernetes.io/component=operator`: restarts, Pending) and "
               "its log.")]),
    "the operator's pod restarting": (
        # down for 3 minutes (a new pod pulling its image): shorter than the 5 minutes the alert waits
        [(f'up{{component="operator", {OPERATOR_TARGET}}}', "1x5 0x3 1x20"), POOL_PODS],
        "9m", []),
    "the operator evaluates every period": (
        [(f"{LAST}{{{OPERATOR}}}", "0+60x40"), (f"{INTERVAL}{{{OPERATOR}}}", "60x40"), POOL_PODS],
        "30m", []),
    "a long period not yet over thrice": (
        # evaluated once, at 0, every hour: 30 minutes later it is not late
        [(f"{LAST}{{{OPERATOR}}}", "0x40"), (f"{INTERVAL}{{{OPERATOR}}}", "3600x40"), POOL_PODS],
        "30m", []),
    "the operator restarted as a new pod": (
        # the old pod's stamp stops at 5m, the new one's go on from 7m: the newest counts
        [(f"{LAST}{{{OPERATOR}}}", "0+60x5"), (f"{INTERVAL}{{{OPERATOR}}}", "15x5"),
         (f"{LAST}{{{RESTARTED}}}", "_x6 420+60x30"), (f"{INTERVAL}{{{RESTARTED}}}", "_x6 15x30"), POOL_PODS],
        "20m", []),
    "a deleted pool": (
        # its series were dropped at 5m and its pods went with it
        [(f"{LAST}{{{OPERATOR}}}", "0+60x5"), (f"{INTERVAL}{{{OPERATOR}}}", "15x5"),
         (f'up{{pod="r0", role="router", {POOL}}}', "1x5")],
        "15m", []),
    "every evaluation fails": (
        # four evaluations a minute (every 15 s), all errors from 5m (lost permission to list the pods)
        [(f'{EVALUATIONS}{{outcome="error", {OPERATOR}}}', "0x5 0+4x30"),
         (f'{EVALUATIONS}{{outcome="ok", {OPERATOR}}}', "0+4x5 20x30")],
        "30m",
        [alert("KvmeshOperatorEvaluationsFailing", {"severity": "warning", **WHERE},
               "Pool ml/chat: the operator's evaluations fail",
               "100% of the operator's evaluations of the pool in the last 15 minutes failed: it is not scaled. "
               "The operator's log says why (the scaling timer's exception); check its RBAC against "
               "operator/rbac.py and the pool's Degraded condition.")]),
    "a few evaluations failed": (
        [(f'{EVALUATIONS}{{outcome="error", {OPERATOR}}}', "0x10 3x30"),
         (f'{EVALUATIONS}{{outcome="ok", {OPERATOR}}}', "0+4x40")],
        "30m", []),
    "evaluations failed for 8 minutes": (
        # an API server away for 8 minutes, then all ok again: over half failed for less than 10 minutes
        [(f'{EVALUATIONS}{{outcome="error", {OPERATOR}}}', "0x10 0+4x8 32x20"),
         (f'{EVALUATIONS}{{outcome="ok", {OPERATOR}}}', "0+4x10 40x8 40+4x20")],
        "25m", []),
    "one engine down": (
        [(f'up{{pod="e0", role="decode", {POOL}}}', "0x10"),
         (f'up{{pod="e1", role="decode", {POOL}}}', "1x10"),
         (f'up{{pod="r0", role="router", {POOL}}}', "0x10")],  # a router is no engine: the router alerts only
        "5m",
        [alert("KvmeshEngineDown", E0, *DOWN), router_down("r0"), NO_ROUTERS]),
    "every engine up": (
        [(f'up{{pod="e0", role="decode", {POOL}}}', "1x10"), (f'up{{pod="e1", role="prefill", {POOL}}}', "1x10")],
        "5m", []),
    "no decode engine up": (
        [(f'up{{pod="e0", role="decode", {POOL}}}', "0x10"), (f'up{{pod="e1", role="prefill", {POOL}}}', "1x10")],
        "5m",
        [alert("KvmeshPoolHasNoEngines", {"severity": "critical", "role": "decode", **WHERE}, *NO_DECODE),
         alert("KvmeshEngineDown", E0, *DOWN)]),
    # The role's only engine loads a big model for 12 minutes: its target answers (kvmesh_engine_loading 1) from
    # the first scrape, so it is starting, neither down nor the role without engines, and 12 minutes is not yet
    # too long for a load or for a role to serve nothing
    "a slow model load": (
        [(f'up{{pod="e0", role="decode", {POOL}}}', "1x20"),
         (f'{LOADING}{{pod="e0", role="decode", {POOL}}}', "1x12 0x8")],
        "12m", []),
    # ... but every engine of the role still loading after 15 minutes is an outage: up, yet nothing serves
    "every engine of a role loading for 16 minutes": (
        [(f'up{{pod="e0", role="decode", {POOL}}}', "1x20"),
         (f'{LOADING}{{pod="e0", role="decode", {POOL}}}', "1x20"),
         (f'up{{pod="e1", role="decode", {POOL}}}', "1x20"),
         (f'{LOADING}{{pod="e1", role="decode", {POOL}}}', "1x20"),
         (f'up{{pod="e2", role="prefill", {POOL}}}', "1x20"),
         (f'{LOADING}{{pod="e2", role="prefill", {POOL}}}', "0x20")],
        "16m",
        [alert("KvmeshPoolNotServing", {"severity": "critical", "role": "decode", **WHERE},
               "Pool ml/chat: every decode engine has been loading its model for 15 minutes",
               "No decode engine has loaded, so none is Ready: the pool cannot serve requests (its routers hold or "
               "refuse them). The engines' logs say where their loads are; check the model's volume or download "
               "and the nodes' memory.")]),
    # ... one still loading after 20 minutes is stuck: a warning, its target still up
    "a load stuck for 25 minutes": (
        [(f'up{{pod="e0", role="decode", {POOL}}}', "1x30"),
         (f'{LOADING}{{pod="e0", role="decode", {POOL}}}', "1x30"),
         (f'up{{pod="e1", role="decode", {POOL}}}', "1x30"),
         (f'{LOADING}{{pod="e1", role="decode", {POOL}}}', "0x30")],
        "25m",
        [alert("KvmeshEngineLoadingTooLong", E0,
               "Engine ml/e0 (decode) of pool chat has been loading its model for 20 minutes",
               "It answers /metrics but not /health, so it is not Ready and takes no requests. Its "
               "kvmesh_engine_load_progress_ratio (the share of its weights read) shows whether the load still "
               "moves, its log where it is; check the model's volume or download and the node's memory.")]),
    # ... and one that loaded, then died (its target down, its gauge gone with it) is down
    "an engine that loaded and then died": (
        [(f'up{{pod="e0", role="decode", {POOL}}}', "1x10 0x10"),
         (f'{LOADING}{{pod="e0", role="decode", {POOL}}}', "1x5 0x4"),
         (f'up{{pod="e1", role="decode", {POOL}}}', "1x20")],
        "15m",
        [alert("KvmeshEngineDown", E0, *DOWN)]),
    # scaling.scaleToZero: the operator wanted no decode pod until minute 5; the new pod's target is down until its
    # engine listens at minute 12 (its image pulled on a new node), then it loads its model. A cold start, not an
    # outage: silent for 15 minutes after the zero ...
    "a pool starting from zero": (
        [(f'{DESIRED}{{role="decode", {OPERATOR}}}', "0x5 1x20"),
         (f'up{{pod="e0", role="decode", {POOL}}}', "_x5 0x7 1x13"),
         (f'{LOADING}{{pod="e0", role="decode", {POOL}}}', "_x12 1x13")],
        "12m", []),
    # ... and an outage once the role has been wanted for 15 minutes with still no engine answering
    "a pool that started from zero and never served": (
        [(f'{DESIRED}{{role="decode", {OPERATOR}}}', "0x5 1x30"),
         (f'up{{pod="e0", role="decode", {POOL}}}', "_x5 0x30")],
        "24m",
        [alert("KvmeshPoolHasNoEngines", {"severity": "critical", "role": "decode", **WHERE}, *NO_DECODE),
         alert("KvmeshEngineDown", E0, *DOWN)]),
    # Routers: the pool's only door. Both replicas down for 30 minutes while the engines and the operator are fine
    "every router down": (
        [(f'up{{pod="r0", role="router", {POOL}}}', "0x40"), (f'up{{pod="r1", role="router", {POOL}}}', "0x40"),
         (f'up{{pod="e0", role="both", {POOL}}}', "1x40"), (f'{LOADING}{{pod="e0", role="both", {POOL}}}', "0x40"),
         (f'{DESIRED}{{role="both", {OPERATOR}}}', "1x40"), *HEARTBEAT],
        "30m",
        [NO_ROUTERS, router_down("r0"), router_down("r1")]),
    "one router of two down": (
        [(f'up{{pod="r0", role="router", {POOL}}}', "0x40"), (f'up{{pod="r1", role="router", {POOL}}}', "1x40"),
         (f'up{{pod="e0", role="both", {POOL}}}', "1x40"), *HEARTBEAT],
        "30m",
        [router_down("r0")]),
    "the only router restarting": (
        # down at 6m and 7m (a restart), up again from 8m: shorter than the 2 minutes either alert waits
        [(f'up{{pod="r0", role="router", {POOL}}}', "1x5 0x1 1x30"), (f'up{{pod="e0", role="both", {POOL}}}', "1x40"),
         *HEARTBEAT],
        "8m", []),
    "routers that cannot be scheduled": (
        # the router's pod, evicted at 15m, is Pending since: no address, so no target and no `up` at all; the
        # operator evaluates the pool (its heartbeat), whose engine is up
        [(f'up{{pod="r0", role="router", {POOL}}}', "1x15"), (f'up{{pod="e0", role="both", {POOL}}}', "1x40"),
         (f'{DESIRED}{{role="both", {OPERATOR}}}', "1x40"), *HEARTBEAT],
        "25m",
        [NO_ROUTERS]),
    # A new pool (its first heartbeat at 0) whose router pod is a down target while its image is pulled: left
    # alone for 15 minutes, as the engines of a pool starting from zero are ...
    "a new pool's router starting for 12 minutes": (
        [(f'up{{pod="r0", role="router", {POOL}}}', "0x40"), (f'up{{pod="e0", role="both", {POOL}}}', "1x40"),
         *HEARTBEAT],
        "12m",
        [router_down("r0")]),
    # ... and an outage after that
    "a new pool's router down for 20 minutes": (
        [(f'up{{pod="r0", role="router", {POOL}}}', "0x40"), (f'up{{pod="e0", role="both", {POOL}}}', "1x40"),
         *HEARTBEAT],
        "20m",
        [NO_ROUTERS, router_down("r0")]),
    # Engines the operator wants whose pods cannot be scheduled (no GPU node, a quota): no target, no `up` to sum,
    # so KvmeshPoolHasNoEngines cannot see them. Silent for 10 minutes (a node being added) ...
    "engines Pending for 9 minutes": (
        [(f'{DESIRED}{{role="both", {OPERATOR}}}', "2x40"), POOL_PODS, *HEARTBEAT],
        "9m", []),
    # ... then an outage
    "engines Pending for 12 minutes": (
        [(f'{DESIRED}{{role="both", {OPERATOR}}}', "2x40"), POOL_PODS, *HEARTBEAT],
        "12m",
        [engines_unavailable("both", 2)]),
    "engines Pending until a node came at 8m": (
        [(f'{DESIRED}{{role="both", {OPERATOR}}}', "2x40"), POOL_PODS, *HEARTBEAT,
         (f'up{{pod="e0", role="both", {POOL}}}', "_x7 1x30"),
         (f'{LOADING}{{pod="e0", role="both", {POOL}}}', "_x7 1x5 0x20")],
        "15m", []),
    # aggregated -> disaggregated at 20m: the operator drops both's series and both's pods go (their targets with
    # them) as the new roles serve. Its 15-minute minimum outlives them, but the operator no longer wants the role
    "a change of mode away from a role": (
        [(f'{DESIRED}{{role="both", {OPERATOR}}}', "1x20 stale"),
         (f'up{{pod="b0", role="both", {POOL}}}', "1x20 stale"),
         *[(f'{DESIRED}{{role="{r}", {OPERATOR}}}', "_x10 1x40") for r in ("prefill", "decode")],
         *[(f'up{{pod="{r[0]}0", role="{r}", {POOL}}}', "_x10 1x40") for r in ("prefill", "decode")],
         POOL_PODS, *HEARTBEAT],
        "31m", []),
    "every engine of a role down for 12 minutes": (
        # targets that do not answer: KvmeshPoolHasNoEngines after 1 minute, this one beside it after 10
        [(f'{DESIRED}{{role="decode", {OPERATOR}}}', "1x40"), (f'up{{pod="e0", role="decode", {POOL}}}', "0x40"),
         POOL_PODS, *HEARTBEAT],
        "12m",
        [alert("KvmeshPoolHasNoEngines", {"severity": "critical", "role": "decode", **WHERE}, *NO_DECODE),
         alert("KvmeshEngineDown", E0, *DOWN), engines_unavailable("decode", 1)]),
    "a role scaled to zero": (
        [(f'{DESIRED}{{role="both", {OPERATOR}}}', "0x40"), POOL_PODS, *HEARTBEAT],
        "30m", []),
    # scaling.scaleToZero: wanted again from 5m, its pods Pending: a cold start for 15 minutes, then 10 more ...
    "a pool starting from zero, Pending for 20 minutes": (
        [(f'{DESIRED}{{role="decode", {OPERATOR}}}', "0x5 1x40"), POOL_PODS, *HEARTBEAT],
        "25m", []),
    # ... and an outage after that
    "a pool starting from zero, Pending for 30 minutes": (
        [(f'{DESIRED}{{role="decode", {OPERATOR}}}', "0x5 1x40"), POOL_PODS, *HEARTBEAT],
        "35m",
        [engines_unavailable("decode", 1)]),
}

ALERTS = [rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
          if "alert" in rule]  # not the recording rules the alerts read


def promtool_test(series: list[tuple[str, str]], at: str, firing: list[dict[str, Any]], tmp_path: Path) -> str:
    """Run `promtool test rules`: every alert of the file is checked at `at`; those not in `firing` must be
    silent. Returns promtool's output; raises with it when a check fails."""
    unknown = {a["alertname"] for a in firing} - set(ALERTS)
    assert not unknown, f"expected to fire but not in the rule file: {sorted(unknown)}"
    checks = []
    for name in ALERTS:
        expected = [{"exp_labels": a["labels"],
                     "exp_annotations": {"summary": a["summary"], "description": a["description"]}}
                    for a in firing if a["alertname"] == name]
        checks.append({"eval_time": at, "alertname": name, "exp_alerts": expected})
    test = {"rule_files": [str(RULES)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
                       "alert_rule_test": checks}]}
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    out = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_the_rule_file_is_valid() -> None:
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(ALERTS) == sorted(["KvmeshKVForecastAbove95Percent", "KvmeshPrefixHitRatioDropped",
                                     "KvmeshRouterShedding", "KvmeshKVEventLag", "KvmeshEngineDown",
                                     "KvmeshEngineLoadingTooLong",
                                     "KvmeshPoolHasNoEngines", "KvmeshPoolNotServing", "KvmeshWarmupNotReached",
                                     "KvmeshLoraAdapterRefused", "KvmeshApiKeysRotationRefused", "KvmeshBatchStalled",
                                     "KvmeshResponseStoreFailing", "KvmeshDatabaseFailing",
                                     "KvmeshOperatorDown", "KvmeshOperatorStalled",
                                     "KvmeshOperatorEvaluationsFailing",
                                     "KvmeshPoolEnginesUnavailable", "KvmeshRouterDown", "KvmeshPoolHasNoRouters"])


def test_every_alert_is_seen_firing() -> None:
    seen = {a["alertname"] for _, _, firing in CASES.values() for a in firing}
    assert seen == set(ALERTS)


@pytest.mark.parametrize("case", CASES)
def test_an_alert_fires_above_its_threshold_and_not_below(case: str, tmp_path: Path) -> None:
    series, at, firing = CASES[case]
    promtool_test(series, at, firing, tmp_path)


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """The harness can fail: a silent case claimed to fire is caught."""
    series, at, _ = CASES["event lag of 5 batches"]
    _, _, firing = CASES["event lag of 500 batches"]
    with pytest.raises(AssertionError, match="FAILED"):
        promtool_test(series, at, firing, tmp_path)


def test_the_chart_ships_the_rule_file_unchanged() -> None:
    with helm_python.Chart.load(CHART) as chart:
        options = {"name": "kvmesh", "namespace": "ml", "api_versions": ["monitoring.coreos.com/v1"]}
        rendered = json.loads(_native.call_string("helm_render", chart._raw(), None, json.dumps(options)))
    rule = yaml.safe_load(rendered["kvmesh/templates/prometheusrule.yaml"])
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
