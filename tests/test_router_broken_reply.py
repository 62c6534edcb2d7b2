"""Pods that misbehave at the edges of the protocol, as loopback stub pods (kvmesh bench router's stub, which answers
the scrape as an engine does): one that breaks off a non-streamed answer after its headers (fault injection: a
real engine sends its whole answer at once) is a 502 with a message, counted and logged as an error, its in-flight
count given back; one without /v1/models (an engine of another make) serves the model its KV config names."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvmesh.bench.router import _stub_routes
from kvmesh.engine.model.tokenizer import Tokenizer
from kvmesh.engine.protocol import MODELS_PATH
from kvmesh.processes import free_port
from kvmesh.router.app import Router, build_router
from kvmesh.router.config import RouterConfig

from .engines import serve_router


@contextmanager
def stub_pod(tiny_dir: Path, breaks: bool = False, models: bool = True) -> Iterator[str]:
    """A stub pod; with `breaks` its completions promise their whole length and send half of it, then close; without
    `models` it has no /v1/models."""
    routes = _stub_routes(Tokenizer.from_dir(tiny_dir).fingerprint)
    if not models:
        del routes[MODELS_PATH.encode()]
    port = free_port()
    loop = asyncio.new_event_loop()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                target = lines[0].split(b" ")[1].split(b"?", 1)[0]
                length = next((int(line[15:]) for line in lines[1:] if line[:15].lower() == b"content-length:"), 0)
                if length:
                    await reader.readexactly(length)
                status, kind, body = routes.get(target, (404, b"application/json", b"{}"))
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (status, kind,
                                                                                                   len(body)))
                if breaks and target == b"/v1/completions":
                    writer.write(body[: len(body) // 2])
                    await writer.drain()
                    return  # the connection closes mid-body
                writer.write(body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(asyncio.start_server(connection, "127.0.0.1", port))
        started.set()
        loop.run_forever()
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(10)
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def ask(pod: str, tiny_dir: Path) -> tuple[httpx.Response, Router]:
    """One completion through a router in front of `pod` alone, once the router routes to it."""
    router = build_router(RouterConfig(pods=[pod], scrape_interval_seconds=0.1), tiny_dir)
    with serve_router(router) as url:
        for _ in range(100):
            if httpx.get(url + "/health").json()["pods"]:
                break
            threading.Event().wait(0.1)
        return httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=30), router


def test_a_pod_that_breaks_off_its_answer_is_a_502_counted_and_logged(tiny_dir: Path) -> None:
    with stub_pod(tiny_dir, breaks=True) as pod:
        reply, router = ask(pod, tiny_dir)
    assert reply.status_code == 502, reply.text
    assert "broke off its answer" in reply.json()["error"]["message"]
    assert router.metrics.requests.labels("error", "aggregated", "client")._value.get() == 1
    assert all(p.inflight == 0 for p in router.pods.pods.values())


def test_a_pod_without_a_model_list_serves_the_model_its_kv_config_names(tiny_dir: Path) -> None:
    with stub_pod(tiny_dir, models=False) as pod:
        reply, router = ask(pod, tiny_dir)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == " Paris"
    (served,) = [p.served for p in router.pods.pods.values()]
    assert served is not None and served.names == {"stub"}
