"""The operator at fleet scale (many pools, one operator): its calls to pods share one HTTP client, its handlers
run on enough threads for pods that do not answer, and a pool whose evaluation changes nothing is not written."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import kmock
import kopf
import pytest
import uvicorn
from kubernetes.client import Configuration

from kvmesh import cli
from kvmesh.engine.internal_token import InternalToken
from kvmesh.operator import handlers
from kvmesh.operator.crd import PLURAL
from kvmesh.operator.engines import http_open_gates, http_scrape, http_warm, scrape_all
from kvmesh.operator.handlers import DEFAULT_WORKERS, OperatorConfig, last_decision, register
from kvmesh.operator.lora import LOAD, AdapterAction, http_act, http_served
from kvmesh.operator.pod_client import POD_CONNECTION_LIMITS
from kvmesh.operator.scaling import Decision, RoleDecision
from kvmesh.operator.warmup import ServingPod, Warmup
from kvmesh.processes import free_port

from .test_operator import NS, POOLS, FakeEngine, MetricsServer, eventually, operator, pod_body, pool_body, run

# ---- one HTTP client for every call to a pod ---------------------------------------------------------------------


def test_the_operator_drops_an_idle_pod_connection_before_the_engine_does() -> None:
    """The engines serve with uvicorn's keep-alive; the shared client reusing a connection idle for just under it met
    the pod closing it (1 call in 40 reset at 4.99 s idle in review 206's run), read as a pod that does not answer.
    Its connections expire sooner."""
    engines_keep_alive = uvicorn.Config(app=None).timeout_keep_alive  # kvmesh serve runs uvicorn's default
    assert POD_CONNECTION_LIMITS.keepalive_expiry is not None
    assert POD_CONNECTION_LIMITS.keepalive_expiry < engines_keep_alive

def test_every_call_to_a_pod_goes_through_one_shared_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client made per call (httpx.get) loaded the CA bundle into a new TLS context at every scrape: 31 ms of CPU
    each, which at 15 pools left healthy pods reported as not answering. Over scrapes, warm-ups, gates and adapter
    calls from many threads at once, at most one client is made (none if an earlier test made it), and the calls
    that carry the pool's token still do."""
    made: list[httpx.Client] = []
    init = httpx.Client.__init__

    def counted(self: httpx.Client, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "__init__", counted)
    engine = FakeEngine("127.0.0.1", free_port())
    try:
        url = f"http://127.0.0.1:{engine.server.server_address[1]}"
        source, target = ServingPod("a", "both", url), ServingPod("b", "both", url)
        token = InternalToken.fixed("s" * 43)
        texts = scrape_all({f"pod-{i}": url + "/metrics" for i in range(40)}, http_scrape)
        assert not [t for t in texts.values() if isinstance(t, Exception)]
        for _ in range(3):
            assert http_warm(Warmup("both", source, (target,)), 4, auth=token) == {"b": {}}
            assert http_open_gates([target], auth=token) == {"b": None}
            assert http_served(url, auth=token) == {}
            assert http_act(url, AdapterAction(LOAD, "sql", "/a/sql"), auth=token)[0] == 200
        assert len(made) <= 1, f"{len(made)} clients made for {len(engine.requests)} calls"
        assert {(method, path, sent) for method, path, sent in engine.calls()} == {
            ("GET", "/v1/kv/hot", "s" * 43), ("POST", "/v1/kv/warm", "s" * 43), ("POST", "/v1/admin/ready", "s" * 43),
            ("GET", "/v1/models", "s" * 43), ("POST", "/v1/load_lora_adapter", "s" * 43)}
        seen = len(engine.requests)
        http_open_gates([target])  # a pool without a token: the shared client adds none of its own
        assert engine.calls(seen) == [("POST", "/v1/admin/ready", None)]
    finally:
        engine.close()


# ---- the handlers' threads ---------------------------------------------------------------------------------------


def configured_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    """kopf's settings after the operator's startup handler ran on them, as kopf.operator runs it."""
    registry = kopf.OperatorRegistry()
    register(registry, config, Configuration())
    (configure,) = [h for h in registry._activities.get_all_handlers() if h.activity == "startup"]
    settings = kopf.OperatorSettings()
    configure.fn(settings=settings)
    return settings


def test_the_handlers_run_on_the_operators_threads_not_kopfs_few() -> None:
    """kopf's default pool is min(32, CPUs + 4) threads (6 on 2 CPUs): 20 pools each with a pod that never
    answered stretched every pool's evaluation period from 3.6 s to 11.1 s. The operator sets its own."""
    assert configured_settings(OperatorConfig()).execution.max_workers == DEFAULT_WORKERS
    assert DEFAULT_WORKERS > 32  # more than kopf's default on any node
    assert configured_settings(OperatorConfig(workers=200)).execution.max_workers == 200


def test_the_workers_flag_reaches_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[OperatorConfig] = []
    monkeypatch.setattr(handlers, "run", ran.append)
    assert cli.main(["operator", "--workers", "128", "--kubeconfig", "unused"]) == 0
    assert cli.main(["operator", "--kubeconfig", "unused"]) == 0
    assert [c.workers for c in ran] == [128, DEFAULT_WORKERS]


@pytest.mark.parametrize("workers", ["0", "-4", "many"])
def test_the_workers_flag_refuses_what_is_not_a_number_of_threads(workers: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["operator", "--workers", workers, "--render-crd"])
    assert exit_.value.code == 2
    assert f"argument --workers: expected a whole number >= 1, got '{workers}'" in capsys.readouterr().err


# ---- status written only when it changes -------------------------------------------------------------------------


def decision(replicas: int, reason: str = "HoldWithinTarget") -> Decision:
    return Decision(0.0, {"both": RoleDecision(replicas, replicas, reason, 0.1, 0.0)}, ())


def test_last_decision_keeps_its_time_while_the_decision_stays() -> None:
    """lastDecision.time is when the pool's decision last changed (a reason or a count of any role), not when it
    was last evaluated."""
    earlier = {"time": "2026-01-01T00:00:00Z", "reason": "both: HoldWithinTarget", "replicas": {"both": 2}}
    assert last_decision(earlier, decision(2)) == {
        "time": earlier["time"], "reason": "both: HoldWithinTarget",
        "replicas": {"prefill": None, "decode": None, "both": 2}}  # the roles the pool lacks are removed
    for changed in (decision(3), decision(2, "HoldStabilizing")):
        assert last_decision(earlier, changed)["time"] != earlier["time"]
    assert last_decision(None, decision(2))["time"]  # the first decision


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_evaluation_that_changes_nothing_writes_nothing(tmp_path: Path) -> None:
    """Every evaluation patched the pool's status (lastDecision.time, stamped anew): at 200 pools every 15 s, 13
    writes a second to the API server while nothing changed, each a new resourceVersion that woke every watcher.
    A pool whose pod says the same at every tick is written while it settles, then not again."""
    port = free_port()
    server = MetricsServer("127.0.0.2", port)

    def status_patches(env: Any) -> int:
        return sum(1 for r in env.operator_requests() if r.action == kmock.action.UPDATE
                   and r.resource is not None and r.resource.plural == PLURAL)

    async def main() -> None:
        async with operator(tmp_path) as env:
            await env.k8s.post(POOLS, json=pool_body(engine={"port": port}, scaling={"intervalSeconds": 1}))
            await eventually(lambda: env.get("apps/v1/deployments", "chat-both"))
            await env.k8s.post(f"/api/v1/namespaces/{NS}/pods", json=pod_body("chat-both-0", "127.0.0.2"))
            await env.k8s.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/chat-both/status",
                                json={"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}})

            async def clock() -> None:  # the operator's clock runs 10x faster than the test's
                while True:
                    await asyncio.sleep(0.05)
                    env.clock[0] += 0.5

            ticking = asyncio.create_task(clock())
            await eventually(lambda: env.ticks() >= 6 and server.scrapes >= 6)
            status = env.pool()["status"]
            assert status["lastDecision"]["reason"] == "both: HoldWithinTarget" and status["ready"] == "both 1/1"
            settled, evaluated, began = status_patches(env), env.ticks(), time.monotonic()
            await eventually(lambda: env.ticks() >= evaluated + 10 and time.monotonic() > began + 1.5)
            ticking.cancel()
            assert status_patches(env) == settled, "an evaluation that changed nothing patched the pool"
            assert env.pool()["status"]["lastDecision"] == status["lastDecision"]  # its time too

    try:
        run(main)
    finally:
        server.close()
