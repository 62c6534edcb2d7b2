"""Scale to zero in a local pool (`kvmesh up -f` with `scaling.scaleToZero`), as in a cluster: the local operator
reads its router's held requests and keeps the idle clock (pure, below), and a simulated pool with min 0 goes to
no engine once idle (its pods file empty), starts one for a request its router holds, which is then answered, and
goes back to zero. The operator's clock runs 20x faster (`KVMESH_UP_CLOCK_RATE`), so the CRD's idleSeconds of at
least 60 pass in 3 s."""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import httpx
import pytest

from kvmesh.engine.protocol import RouterMetric
from kvmesh.operator.crd import HOLD_SETTING
from kvmesh.operator.local import LocalOperator, LocalPod
from kvmesh.operator.memory import RouterView
from kvmesh.processes import free_port, launch
from kvmesh.up import CLOCK_RATE_ENV, Child, LocalEngines, PoolPlan, observe_router, plan_from_file

from .engines import stop_up
from .test_operator_local import engine_text
from .test_up_scaling import engine_urls, wait_for

POOL = """
apiVersion: kvmesh.io/v1alpha1
kind: InferencePool
metadata: {name: idle}
spec:
  model: {source: bundled}
  engine: {kvCacheMemoryMiB: 8}
  replicas:
    both: {min: 0, max: 2}
  scaling: {intervalSeconds: 1, scaleToZero: {idleSeconds: 60, activationTimeoutSeconds: 120}}
"""


def test_a_pool_file_that_scales_to_zero_starts_one_engine_and_a_router_that_holds(tmp_path: Path) -> None:
    """Min 0 starts serving, as the operator creates such a pool (its router must see an engine once to list the
    pool's model); the router gets the hold the operator writes."""
    (tmp_path / "pool.yaml").write_text(POOL)
    plan = plan_from_file(tmp_path / "pool.yaml")
    assert plan.engines == 1
    assert plan.router[HOLD_SETTING] == 120


def router_metrics(held: int) -> str:
    return f"{RouterMetric.REQUESTS_WAITING_FOR_PODS} {held}\n"


def test_the_local_operator_wakes_on_held_requests_and_idles_down_only_when_it_sees_the_pool(
        tmp_path: Path) -> None:
    (tmp_path / "pool.yaml").write_text(POOL)
    operator = LocalOperator(plan_from_file(tmp_path / "pool.yaml").pool)
    idle = [LocalPod("engine-0", "both", "http://127.0.0.1:9000", engine_text(0.0, 0.0, 0.0), True)]

    def reasons(now: float, pods: list[LocalPod], replicas: int, router: RouterView) -> tuple[int, str]:
        decision = operator.decide(now, pods, {"both": replicas}, router).decision
        return decision.replicas["both"], decision.roles["both"].reason

    assert reasons(0.0, idle, 1, RouterView())[0] == 1  # the idle clock starts at the first tick
    # a router or engine unseen leaves the idleness unknown: the clock restarts
    assert reasons(59.0, idle, 1, RouterView(unseen=True))[0] == 1
    assert reasons(100.0, idle, 1, RouterView())[0] == 1  # idle since 59 only
    assert reasons(119.0, idle, 1, RouterView()) == (0, "ScaleToZero")
    assert reasons(130.0, [], 0, RouterView()) == (0, "HoldAtZero")
    assert reasons(140.0, [], 0, RouterView(held=3)) == (1, "ScaleFromZero")


def test_the_router_s_held_requests_and_an_unanswered_scrape_are_read_as_the_operator_reads_them(
        tmp_path: Path) -> None:
    engines = LocalEngines(PoolPlan(), [], tmp_path, None)
    process = launch([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "router.log")
    try:
        engines.router = Child("router", "http://127.0.0.1:1", process, tmp_path / "router.log")
        assert observe_router(engines, [], lambda url: router_metrics(2)) == RouterView(2, False)

        def no_answer(url: str) -> str:
            raise httpx.ConnectError("refused")

        assert observe_router(engines, [], no_answer) == RouterView(0, True)
        engines.router_starting = True  # a router not yet serving (a restart) is not counted unseen, as not Ready
        assert observe_router(engines, [], no_answer) == RouterView(0, False)
    finally:
        process.kill()
        process.wait()


def pods_file(log: Path) -> Path:
    """The router's pods file, in the pool's work folder (which `kvmesh up` names in its output)."""
    match = re.search(r"logs in (\S+)\)", log.read_text())
    assert match, log.read_text()
    return Path(match.group(1)) / "pods.json"


def pods(log: Path) -> list[str]:
    return [p["url"] for p in json.loads(pods_file(log).read_text())["pods"]]


@pytest.mark.slow
def test_kvmesh_up_scales_an_idle_pool_to_zero_and_back_for_a_held_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pool.yaml").write_text(POOL)
    port, ready, targets, log = free_port(), tmp_path / "ready", tmp_path / "targets.json", tmp_path / "up.log"
    monkeypatch.setenv(CLOCK_RATE_ENV, "20")
    proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "-f", str(tmp_path / "pool.yaml"), "--sim", "--port",
                   str(port), "--ready-file", str(ready), "--targets-file", str(targets)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(ready.exists, "the pool to be ready", proc, log)
        assert list(engine_urls(targets)) == ["engine-0"]
        wait_for(lambda: "engine-0 stopped" in log.read_text(), "the idle pool to stop its engine", proc, log)
        assert "both: 1 -> 0 replicas (ScaleToZero" in log.read_text()
        assert pods(log) == [] and engine_urls(targets) == {}
        assert proc.poll() is None  # at zero, the pool runs on: its router holds what comes

        replies: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: replies.append(httpx.post(
            url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=120)))
        sender.start()
        wait_for(lambda: "engine-1" in engine_urls(targets), "an engine started for the held request", proc, log)
        woken = engine_urls(targets)["engine-1"]
        sender.join(timeout=120)
        (reply,) = replies
        assert reply.status_code == 200, reply.text
        assert "both: 0 -> 1 replicas (ScaleFromZero" in log.read_text()  # woken by the router's held request
        assert reply.headers["x-kvmesh-pod"] == woken

        wait_for(lambda: "engine-1 stopped" in log.read_text(), "the pool to idle back to zero", proc, log)
        assert log.read_text().count("(ScaleToZero") == 2
        assert pods(log) == []
    finally:
        stop_up(proc, log)
