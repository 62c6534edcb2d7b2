"""Slow clients on every route of the router and `kvmesh gateway` that reads a body (engine/body_deadline.py,
around each whole app): a client that sends its headers and then trickles its body, or sends none, gets a 408
after body_read_timeout_seconds and its connection closed; it holds no pod, no tenant slot, and nobody else's
request waits on it."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine
from kvmesh.engine.protocol import TOKENIZE_PATH
from kvmesh.router.app import Router, build_router
from kvmesh.router.batches import RESPONSES_PATH
from kvmesh.router.config import RouterConfig
from kvmesh.router.gateway_app import Gateway, GatewayApp, static_routers

from .engines import serve_router, wait_idle
from .test_gateway import serve_asgi
from .test_router_disconnect import wait_nothing_in_flight
from .test_server import served

__all__ = ["served"]  # the fixture: one in-process engine behind uvicorn

DEADLINE = 0.3


@dataclass
class Routed:
    engine: Engine
    router: Router
    url: str  # the router's


@pytest.fixture
def routed(served: tuple[str, Engine], tiny_dir: Path, tmp_path: Path) -> Iterator[Routed]:
    """The served engine behind a router with a short body deadline, one request at a time per tenant (a slot
    a slow client held would turn the next request into a 429) and a database (the Batch API's file uploads)."""
    config = RouterConfig(pods=[served[0]], body_read_timeout_seconds=DEADLINE, scrape_interval_seconds=0.1,
                          tenants={"default": {"max_concurrent_requests": 1}},
                          database_url=f"sqlite:///{tmp_path / 'pool.db'}")
    router = build_router(config, tiny_dir)
    with serve_router(router) as url:
        yield Routed(served[1], router, url)


def slow_client(url: str, path: str, sent: bytes = b"", content_type: str = "application/json",
                ) -> tuple[int, dict[str, str], dict]:
    """A slowloris client: POST `path` with headers that promise a 1000-byte body of `content_type`, send `sent`
    of it, then nothing. The answer (status, headers, JSON body), read until the server closes the connection; a
    server that never does fails the read (socket timeout)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: %s\r\ncontent-length: 1000\r\n\r\n%s"
                     % (path.encode(), parts.netloc.encode(), content_type.encode(), sent))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


def assert_body_timeout(answer: tuple[int, dict[str, str], dict]) -> None:
    status, headers, body = answer
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == "body_timeout" and body["error"]["type"] == "invalid_request_error"
    assert f"the request body did not arrive within {DEADLINE:g} s" in body["error"]["message"]


def errors_counted(metrics: str) -> float:
    line = 'kvmesh_router_requests_total{outcome="error",route="aggregated",source="client"} '
    return next((float(row[len(line):]) for row in metrics.splitlines() if row.startswith(line)), 0.0)


def test_a_slow_body_is_a_408_that_closes_the_connection_and_holds_nothing(routed: Routed) -> None:
    before = errors_counted(httpx.get(routed.url + "/metrics").text)
    for path, sent in (("/v1/completions", b""), ("/v1/chat/completions", b'{"messages": [{"role": "us')):
        assert_body_timeout(slow_client(routed.url, path, sent))
    assert errors_counted(httpx.get(routed.url + "/metrics").text) == before + 2
    assert routed.router.limits.inflight == {}  # no tenant slot held
    wait_nothing_in_flight(routed.router)
    ok = httpx.post(routed.url + "/v1/completions", json={"prompt": "fine", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    wait_idle(routed.engine)


def test_every_other_route_that_reads_a_body_is_bounded_too_and_a_whole_upload_still_works(routed: Routed) -> None:
    """The Batch API's file upload (multipart), the Responses API and /tokenize: a 408 and the connection closed,
    counted in no completion series; an upload sent whole is stored as before."""
    before = errors_counted(httpx.get(routed.url + "/metrics").text)
    boundary = "kvmesh-slow"
    upload = f'--{boundary}\r\ncontent-disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode()
    assert_body_timeout(slow_client(routed.url, "/v1/files", upload, f"multipart/form-data; boundary={boundary}"))
    assert_body_timeout(slow_client(routed.url, RESPONSES_PATH, b'{"input": "hel'))
    assert_body_timeout(slow_client(routed.url, TOKENIZE_PATH))
    assert errors_counted(httpx.get(routed.url + "/metrics").text) == before
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "fine", "max_tokens": 3}}) + "\n"
    stored = httpx.post(routed.url + "/v1/files", data={"purpose": "batch"},
                        files={"file": ("input.jsonl", line.encode(), "application/jsonl")}, timeout=30)
    assert stored.status_code == 200 and stored.json()["bytes"] == len(line)
    assert httpx.get(routed.url + f"/v1/files/{stored.json()['id']}/content").text == line


def test_a_stream_longer_than_the_body_deadline_is_relayed_whole(routed: Routed,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real_run = routed.engine.runner.run
    monkeypatch.setattr(routed.engine.runner, "run", lambda seqs: (time.sleep(0.01), real_run(seqs))[1])
    body = {"prompt": "x", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", routed.url + "/v1/completions", json=body, timeout=30) as reply:
        chunks = [line for line in reply.iter_lines() if line.startswith("data: {")]
    assert reply.status_code == 200 and len(chunks) == 60  # 0.6 s or more, twice the deadline
    wait_idle(routed.engine)


def test_the_gateway_answers_a_slow_body_408_and_closes_the_connection(routed: Routed) -> None:
    gateway = Gateway(static_routers([routed.url]), refresh_seconds=3600, body_read_timeout_seconds=DEADLINE)
    with serve_asgi(GatewayApp(gateway)) as url:
        assert_body_timeout(slow_client(url, "/v1/chat/completions", b'{"model": "'))
        metrics = httpx.get(url + "/metrics").text
        assert 'kvmesh_gateway_requests_total{model="unknown",outcome="bad_request"} 1.0' in metrics
        ok = httpx.post(url + "/v1/completions", json={"model": routed.engine.model_name, "prompt": "fine",
                                                       "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert routed.router.limits.inflight == {}
    wait_idle(routed.engine)


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan")])
def test_a_deadline_of_no_time_is_refused_at_start(seconds: float) -> None:
    with pytest.raises(ValueError, match="body_read_timeout_seconds must be above 0"):
        RouterConfig(pods=["http://127.0.0.1:1"], body_read_timeout_seconds=seconds).validate()
    with pytest.raises(ValueError, match="body_read_timeout_seconds must be above 0"):
        EngineConfig(body_read_timeout_seconds=seconds).validate()
