"""Scale to zero end to end: the router holding a request while no engine is ready (and what it answers when none
becomes ready, when the client leaves, when too many are held), the operator's idle clock and its reading of the
routers' gauge, and the operator against kmock scaling a pool with min 0 up from zero on a real router's held
request and back to zero once idle."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.protocol import POOL_LABEL, ROLE_LABEL, RouterMetric, VllmMetric
from kvmesh.operator.crd import DEFAULT_ACTIVATION_TIMEOUT_SECONDS, HOLD_SETTING, parse_pool
from kvmesh.operator.desired import COMPONENT_LABEL, initial_replicas, router_settings
from kvmesh.operator.forecast import Counters, PodMetrics, parse_router_held
from kvmesh.operator.memory import IdleClock, RouterView
from kvmesh.operator.scaling import PodObservation
from kvmesh.processes import free_port, write_json_atomically
from kvmesh.router.app import build_router
from kvmesh.router.config import RouterConfig

from .conftest import make_engine
from .engines import serve_engine, serve_router
from .test_operator import NS, POOLS, MetricsServer, eventually, operator, pool_body, run
from .waiting import wait_for

PROMPT = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0}


def held(url: str) -> float:
    """The router's kvmesh_router_requests_waiting_for_pods now."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == RouterMetric.REQUESTS_WAITING_FOR_PODS)


class Client:
    """One completion sent from a thread (it is held), its answer kept for the test."""

    def __init__(self, url: str, timeout: float = 120.0) -> None:
        self.reply: httpx.Response | Exception | None = None

        def send() -> None:
            try:
                self.reply = httpx.post(url + "/v1/completions", json=PROMPT, timeout=timeout)
            except httpx.HTTPError as exc:
                self.reply = exc

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()

    def answer(self) -> httpx.Response:
        self.thread.join(timeout=120)
        assert isinstance(self.reply, httpx.Response), self.reply
        return self.reply


@contextmanager
def router_without_pods(tiny_dir: Path, tmp_path: Path, **settings: Any) -> Iterator[tuple[str, Path]]:
    """A router whose pods file lists no engine yet (a pool at zero), holding requests as `settings` say; yields
    its URL and the pods file."""
    pods_file = tmp_path / "pods.json"
    write_json_atomically(pods_file, {"pods": []})
    router = build_router(RouterConfig(pods_file=str(pods_file), scrape_interval_seconds=0.1, **settings), tiny_dir)
    with serve_router(router) as url:  # ready while it holds: a pool at zero must hear of its first request
        yield url, pods_file


@pytest.mark.slow
def test_a_request_is_held_while_no_engine_is_ready_and_served_once_one_is(tiny_dir: Path, tmp_path: Path) -> None:
    with router_without_pods(tiny_dir, tmp_path, hold_without_pods_seconds=120) as (url, pods_file):
        assert httpx.get(url + "/health").json()["status"] == "waiting_for_pods"
        client = Client(url)
        wait_for(lambda: held(url) == 1, "the request to be held")
        with serve_engine(make_engine(tiny_dir)) as engine:
            write_json_atomically(pods_file, {"pods": [engine]})
            reply = client.answer()
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-kvmesh-pod"] == engine
            assert held(url) == 0
            served = httpx.get(url + "/v1/models").json()["data"]
            assert served and all(m["id"] for m in served)
            write_json_atomically(pods_file, {"pods": []})  # back at zero: a gateway must still route its model here
            wait_for(lambda: httpx.get(url + "/health").json()["status"] == "waiting_for_pods", "the pool at zero")
            assert httpx.get(url + "/v1/models").json()["data"] == served


@pytest.mark.slow
def test_a_held_request_times_out_with_503_and_retry_after(tiny_dir: Path, tmp_path: Path) -> None:
    with router_without_pods(tiny_dir, tmp_path, hold_without_pods_seconds=0.5) as (url, _):
        reply = Client(url).answer()
        assert reply.status_code == 503
        assert "starting from zero" in reply.json()["error"]["message"]
        assert int(reply.headers["retry-after"]) > 0
        assert held(url) == 0


@pytest.mark.slow
def test_a_client_that_leaves_while_held_is_no_longer_counted(tiny_dir: Path, tmp_path: Path) -> None:
    with router_without_pods(tiny_dir, tmp_path, hold_without_pods_seconds=120) as (url, _):
        client = Client(url, timeout=1.0)  # gives up long before the hold would end
        client.thread.join(timeout=60)
        assert isinstance(client.reply, httpx.TimeoutException)
        wait_for(lambda: held(url) == 0, "the router to drop the request that left")


@pytest.mark.slow
def test_past_max_held_requests_a_request_is_refused_at_once(tiny_dir: Path, tmp_path: Path) -> None:
    with router_without_pods(tiny_dir, tmp_path, hold_without_pods_seconds=120, max_held_requests=1) as (url, _):
        first = Client(url, timeout=5.0)
        wait_for(lambda: held(url) == 1, "the first request to be held")
        second = httpx.post(url + "/v1/completions", json=PROMPT, timeout=60)  # not held: 503 now
        assert second.status_code == 503 and second.json()["error"]["code"] == "no_pod"
        assert held(url) == 1
        first.thread.join(timeout=60)


def test_without_a_hold_a_request_is_never_held(tiny_dir: Path, tmp_path: Path) -> None:
    """The default (0 s): no request waits, as before scale to zero (503 at once, the router unready)."""
    router = build_router(RouterConfig(pods_file=str(tmp_path / "pods.json")), tiny_dir)
    assert router.pod_wait is None


def engine_metrics(name: str, running: int = 0, finished: float = 0.0) -> PodMetrics:
    return PodMetrics(PodObservation(name, "both", 100, running=running), Counters(finished=finished), 16)


def test_the_idle_clock_restarts_on_any_request() -> None:
    clock = IdleClock()
    assert clock.update(0, [engine_metrics("a")]) == 0  # the first tick starts it
    assert clock.update(30, [engine_metrics("a")]) == 30
    assert clock.update(60, [engine_metrics("a", finished=1)]) == 0  # one began and ended between ticks
    assert clock.update(90, [engine_metrics("a", finished=1)]) == 30
    assert clock.update(120, [engine_metrics("a", running=1, finished=1)]) == 0  # one runs
    assert clock.update(150, [engine_metrics("a", finished=2), engine_metrics("b", finished=7)]) == 0
    assert clock.update(180, [engine_metrics("a", finished=2), engine_metrics("b", finished=7)]) == 30
    assert clock.update(210, [], RouterView(held=1)) == 0  # a router holds one (no engine left to count it)
    assert clock.update(240, []) == 30
    unseen = RouterView(unseen=True)  # a ready pod did not answer its scrape
    assert clock.update(270, [engine_metrics("a", finished=2)], unseen) == 0
    assert clock.update(300, [engine_metrics("a", finished=2)]) == 30


def test_a_pool_that_scales_to_zero_starts_with_a_pod_of_each_role() -> None:
    """Its router must see a pod once to list the pool's models (a gateway routes by them); it idles down after."""
    spec = {"model": {"source": "bundled"}, "replicas": {"both": {"min": 0, "max": 3}},
            "scaling": {"scaleToZero": {"idleSeconds": 60}}}
    assert initial_replicas(parse_pool({"metadata": {"name": "p"}, "spec": spec})) == {"both": 1}


def test_the_operator_reads_the_routers_gauge_and_writes_the_hold_into_their_settings() -> None:
    assert parse_router_held(f"{RouterMetric.REQUESTS_WAITING_FOR_PODS} 3.0\n") == 3
    assert parse_router_held(f"{RouterMetric.REQUESTS} 3.0\n") == 0  # an older router: nothing held
    body = pool_body(replicas={"both": {"min": 0, "max": 2}}, scaling={"scaleToZero": {"idleSeconds": 120}})
    assert router_settings(parse_pool(body))[HOLD_SETTING] == DEFAULT_ACTIVATION_TIMEOUT_SECONDS
    assert HOLD_SETTING not in router_settings(parse_pool(pool_body()))


def idle_engine_metrics() -> str:
    """An engine's /metrics with nothing running, waiting or finishing: an idle pool."""
    return "\n".join([f"{VllmMetric.KV_USAGE} 0", f"{VllmMetric.RUNNING} 0", f"{VllmMetric.WAITING} 0",
                      f'{VllmMetric.CACHE_CONFIG}{{block_size="16",num_gpu_blocks="1000"}} 1', ""])


def pod(name: str, role: str, port_ip: str = "127.0.0.1") -> dict[str, Any]:
    """A pool's pod as the operator lists it (its address: where the test serves its /metrics)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {
                POOL_LABEL: "chat", ROLE_LABEL: role, COMPONENT_LABEL: "router" if role == "router" else "engine"}},
            "spec": {"containers": [{"name": role, "image": "kvmesh"}]},
            "status": {"phase": "Running", "podIP": port_ip}}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_operator_scales_a_pool_up_from_zero_on_a_held_request_and_back_once_idle(tiny_dir: Path,
                                                                                      tmp_path: Path) -> None:
    """The router is a real one (a thread of this test, on 127.0.0.1, holding a real client's request); the
    Deployments have no controller under kmock, so the engine pod the operator scrapes is a fake /metrics the test
    adds once the operator scaled up, while a real in-process engine joins the router's pods file and serves."""
    engine_port = free_port()
    fake_engine = MetricsServer("127.0.0.1", engine_port)
    fake_engine.text = idle_engine_metrics()
    with router_without_pods(tiny_dir, tmp_path, hold_without_pods_seconds=120) as (url, pods_file):
        router_port = int(url.rsplit(":", 1)[1])

        async def main() -> None:
            async with operator(tmp_path) as env:
                spec = {"engine": {"port": engine_port}, "router": {"port": router_port},
                        "replicas": {"both": {"min": 0, "max": 3}},
                        "scaling": {"intervalSeconds": 1, "scaleToZero": {"idleSeconds": 60}}}
                await env.k8s.post(POOLS, json=pool_body(**spec))
                deployment = await eventually(lambda: env.get("apps/v1/deployments", "chat-both"))
                # min 0 still starts serving (its router must see a pod to list its models), then idles down
                assert deployment["spec"]["replicas"] == 1
                await env.k8s.post(f"/api/v1/namespaces/{NS}/pods", json=pod("chat-router-0", "router"))

                async def clock() -> None:  # the operator's clock runs 10x faster than the test's
                    while True:
                        await asyncio.sleep(0.05)
                        env.clock[0] += 0.5

                ticking = asyncio.create_task(clock())
                await eventually(lambda: env.get("apps/v1/deployments", "chat-both")["spec"]["replicas"] == 0)
                await eventually(lambda: "HoldAtZero" in str(env.pool().get("status", {}).get("lastDecision")))
                client = Client(url)
                await eventually(lambda: env.get("apps/v1/deployments", "chat-both")["spec"]["replicas"] == 1)
                await eventually(lambda: any("ScaleFromZero" in e["message"] for e in env.events("Scaled")))
                # the pod starts: the operator scrapes it, and the router routes the held request to an engine
                await env.k8s.post(f"/api/v1/namespaces/{NS}/pods", json=pod("chat-both-0", "both"))
                with serve_engine(make_engine(tiny_dir)) as engine:
                    write_json_atomically(pods_file, {"pods": [engine]})
                    reply = await asyncio.to_thread(client.answer)
                    assert reply.status_code == 200, reply.text
                # nothing runs, waits or arrives for idleSeconds on the operator's clock: back to zero
                await eventually(lambda: env.get("apps/v1/deployments", "chat-both")["spec"]["replicas"] == 0)
                await eventually(lambda: any("ScaleToZero" in e["message"] for e in env.events("Scaled")))
                ticking.cancel()

        try:
            run(main, 150)
        finally:
            fake_engine.close()
