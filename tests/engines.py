"""Real engine processes over conftest's tiny model, and a router served in a thread of the test process: the
pools the end-to-end tests run against, started and stopped one way."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn
import yaml

from kvmesh.engine.engine import Engine
from kvmesh.engine.internal_token import InternalToken
from kvmesh.engine.server import EngineHolder, create_app
from kvmesh.engine.tracing import OFF, Tracing
from kvmesh.processes import free_port, spawn, stop, wait_healthy
from kvmesh.router.app import Router, build_router, create_router_app
from kvmesh.router.auth import hash_key
from kvmesh.router.config import RouterConfig

from .conftest import make_engine


def serve_tiny(tiny_dir: Path, url: str, log: Path, role: str | None = None) -> subprocess.Popen[bytes]:
    """`kvmesh serve` over the tiny model on `url`'s port: fp32 (exact comparisons), one thread and 16 MiB of KV
    (several engines share the machine), quiet logs."""
    args = ["serve", "--model", str(tiny_dir), "--port", url.rsplit(":", 1)[1], "--dtype", "float32", "--threads",
            "1", "--kv-cache-memory-mib", "16", "--log-level", "warning"]
    return spawn(args + (["--role", role] if role else []), log)


@contextmanager
def tiny_engines(
    tiny_dir: Path, logs: Path, roles: Sequence[str | None] = (None, None)
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """One engine per entry of `roles` (None: the default role), all healthy; yields url -> process, in order.
    A test may replace a process in the dict (a restarted pod): every process in it at the end is stopped."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        started = []
        for i, role in enumerate(roles):
            url, log = f"http://127.0.0.1:{free_port()}", logs / f"{role or f'engine-{i}'}.log"
            procs[url] = serve_tiny(tiny_dir, url, log, role)
            started.append((url, procs[url], log))
        for url, proc, log in started:
            wait_healthy(url, proc, log=log)
        yield procs
    finally:
        stop(procs.values())


KEYED_POOL_CONTEXT = 512  # keyed_pool's engine's max_model_len


@contextmanager
def keyed_pool(tiny_dir: Path, where: Path, keys: Mapping[str, str], tenants: dict[str, Any]
               ) -> Iterator[tuple[str, Router]]:
    """A router asking for API keys (`keys`: tenant -> key, stored hashed in a file under `where`) with `tenants`'
    limits, in front of one tiny engine (a KEYED_POOL_CONTEXT-token context), both in this process: a module's keyed
    pool."""
    path = where / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [{"tenant": t, "key_sha256": hash_key(k)} for t, k in keys.items()]}))
    with serve_engine(make_engine(tiny_dir, kv_cache_blocks=64, max_model_len=KEYED_POOL_CONTEXT)) as engine:
        router = build_router(RouterConfig(pods=[engine], scrape_interval_seconds=0.1, api_keys_file=str(path),
                                           tenants=tenants), tiny_dir)
        with serve_router(router) as url:
            yield url, router


@contextmanager
def serve_router(router: Router) -> Iterator[str]:
    """`router`'s app on a free port, in a daemon thread of this process (so tests can inspect the Router);
    yields its URL once healthy, and shuts it down at the end."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_router_app(router), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=30)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def serve_engine(engine: Engine, healthy: bool = True, tracing: Tracing = OFF,
                 token: InternalToken | None = None) -> Iterator[str]:
    """`engine` (started here) behind the engine's own HTTP app (traced with `tracing`, asking for `token`), in a
    daemon thread of this process; yields its URL once healthy (with `healthy` False: once it answers at all, e.g.
    while its warm-up gate holds it), and stops both at the end. For in-process engines such as simulated ones."""
    engine.start()
    port = free_port()
    app = create_app(EngineHolder(engine), tracing, token=token if token is not None else InternalToken(None))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        if healthy:
            wait_healthy(url, timeout=60)
        else:
            _wait_answering(url, timeout=60)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.stop()


@contextmanager
def serve_checked(engine: Engine, tracing: Tracing = OFF) -> Iterator[str]:
    """serve_engine for a module's tests, then the engine's KV accounting checked once they all ended."""
    with serve_engine(engine, tracing=tracing) as url:
        yield url
    engine.kv.check_invariants()


def _wait_answering(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url + "/health")
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"{url} never answered"
            time.sleep(0.05)


def stop_up(proc: subprocess.Popen[bytes], log: Path) -> None:
    """Stop a `kvmesh up` as Ctrl-C does and check it exited cleanly (its log's tail if not)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    assert proc.returncode == 0, log.read_text()[-3000:]


class Load:
    """Completions sent one after another by `threads` threads until stopped, each worker's n-th with
    `prompt(worker, n)`: how many were sent, which pods served them (the router's x-kvmesh-pod) and every answer
    that was not a 200, or no answer."""

    def __init__(self, url: str, prompt: Callable[[int, int], list[int]], threads: int = 3,
                 max_tokens: int = 4) -> None:
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.sent, self.served, self.failed = 0, set[str](), list[str]()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, worker: int) -> None:
        with httpx.Client(timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                body = {"prompt": self.prompt(worker, n), "max_tokens": self.max_tokens}
                try:
                    reply = client.post(self.url + "/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    self.failed.append(repr(exc))
                else:
                    if reply.status_code == 200:
                        self.served.add(reply.headers["x-kvmesh-pod"])
                    else:
                        self.failed.append(f"{reply.status_code}: {reply.text[:200]}")
                self.sent += 1

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)


def wait_idle(engine: Engine, timeout: float = 60.0) -> None:
    """Until the engine has nothing left: no work and no KV block in use (the bound only ends a failing test on a
    loaded machine)."""
    deadline = time.monotonic() + timeout
    while engine.scheduler.has_work() or engine.kv.stats().used:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: work={engine.scheduler.has_work()} used={engine.kv.stats().used}")
        time.sleep(0.025)


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
