"""A client that leaves a request through the router, streamed or not: the router closes its upstream call, the
engine aborts the request and the pod's in-flight count goes back to zero (an in-process engine whose steps are
slowed, so the request is still running when the client leaves)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvmesh.engine.engine import Engine
from kvmesh.router.app import Booking, Relay, RelayResponse, Router, build_router
from kvmesh.router.config import RouterConfig

from .engines import serve_router, wait_idle
from .test_server import _aborts, served

__all__ = ["served"]  # the fixture: one in-process engine behind uvicorn


@dataclass
class Slowed:
    """The served engine, slowed by 10 ms a step so a client can leave mid-request, behind a router."""

    url: str  # the engine's
    engine: Engine
    router: Router
    router_url: str
    aborts_before: int


@pytest.fixture
def slowed(served: tuple[str, Engine], tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Slowed]:
    url, engine = served
    real_run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda seqs: (time.sleep(0.01), real_run(seqs))[1])
    router = build_router(RouterConfig(pods=[url], scrape_interval_seconds=0.1), tiny_dir)
    before = _aborts(engine)
    with serve_router(router) as router_url:
        yield Slowed(url, engine, router, router_url, before)


def test_a_client_that_leaves_stops_the_request_on_the_engine(slowed: Slowed) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slowed.router_url + "/v1/completions", json={"prompt": "x", "max_tokens": 400, "ignore_eos": True},
                   timeout=0.5)
    wait_idle(slowed.engine)
    assert _aborts(slowed.engine) == slowed.aborts_before + 1
    metrics = httpx.get(slowed.router_url + "/metrics").text
    assert 'kvmesh_router_requests_total{outcome="client_gone",route="aggregated",source="client"} 1.0' in metrics
    wait_nothing_in_flight(slowed.router)


def test_a_client_that_leaves_mid_stream_stops_the_request_and_frees_its_pod(slowed: Slowed) -> None:
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", slowed.router_url + "/v1/completions", json=body, timeout=30) as reply:
        chunks = (line for line in reply.iter_lines() if line.startswith("data: {"))
        next(chunks), next(chunks)  # the stream is under way...
        assert slowed.router.pods.pods[slowed.url].inflight == 1
    # ...and the client has gone
    wait_idle(slowed.engine)
    assert _aborts(slowed.engine) == slowed.aborts_before + 1
    wait_nothing_in_flight(slowed.router)
    metrics = httpx.get(slowed.router_url + "/metrics").text
    assert 'kvmesh_router_requests_total{outcome="client_gone",route="aggregated",source="client"} 1.0' in metrics


def wait_nothing_in_flight(router: Router) -> None:
    """Wait (a bounded poll) until the router counts no request in flight on any pod: the router's side of a
    request ends a moment after the client's."""
    for _ in range(400):
        if all(pod.inflight == 0 for pod in router.pods.pods.values()):
            return
        time.sleep(0.025)
    raise AssertionError(f"requests left in flight: { {p.name: p.inflight for p in router.pods.pods.values()} }")


@pytest.mark.asyncio
async def test_a_client_gone_before_the_first_chunk_frees_its_pod(tiny_dir: Path) -> None:
    """Starlette never starts a stream's body when the client leaves while the response is starting; the pod's
    in-flight count must come back all the same, and the request be counted as gone. Driven through the ASGI
    interface directly, the one way to put the disconnect at that moment: the server's `send` of the response
    start waits, its `receive` says the client has gone."""
    router = build_router(RouterConfig(pods=["http://127.0.0.1:9"]), tiny_dir)
    pod = router.pods.pods["http://127.0.0.1:9"]
    started = []

    async def lines() -> AsyncGenerator[str, None]:
        started.append(True)
        yield "data: [DONE]\n\n"

    state = Relay(Booking(pod), {}, "/v1/completions", {}, set(), strip_ids=True, migratable=True)
    assert pod.inflight == 1

    async def receive() -> dict[str, str]:
        return {"type": "http.disconnect"}

    async def send(_: object) -> None:
        await asyncio.Event().wait()  # the client is too slow to take the response's start

    ended = []
    await RelayResponse(lines(), state, {}, lambda: ended.append("client_gone"))({"type": "http"}, receive, send)
    assert not started and pod.inflight == 0
    assert ended == ["client_gone"]  # counted and logged as the relay's own ending would have
