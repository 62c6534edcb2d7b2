"""An engine whose step hangs (a device call that never returns, a deadlock) while its HTTP server answers: its
/health and /livez say "stalled" past stall_timeout_seconds, and the router moves the stream it was serving to
the other pod at once. Before, /health said ok, the stream waited out the router's 600 s request timeout, and
new requests sharing its prefix went to the hung pod. Two tiny engines in this process; one's model call is held
on an event, as a hung device call holds the engine thread."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh.engine.engine import Engine
from kvmesh.router.app import build_router
from kvmesh.router.config import RouterConfig

from .conftest import make_engine
from .engines import serve_engine, serve_router
from .test_router_disconnect import wait_nothing_in_flight
from .test_router_migration import migrations_of
from .waiting import wait_for

STALL_SECONDS = 1.0


class Hang:
    """Holds an engine's model calls while set, as a device call that never returns."""

    def __init__(self, engine: Engine) -> None:
        self.on, self.released = threading.Event(), threading.Event()
        run = engine.runner.run

        def held(*args: Any, **kwargs: Any) -> Any:
            if self.on.is_set():
                self.released.wait(120)
            return run(*args, **kwargs)

        engine.runner.run = held  # type: ignore[method-assign]


@pytest.fixture()
def pool(tiny_dir: Path) -> Iterator[tuple[str, dict[str, Hang]]]:
    with ExitStack() as stack:
        hangs: dict[str, Hang] = {}
        for _ in range(2):
            engine = make_engine(tiny_dir, kv_cache_blocks=256, max_model_len=1024,
                                 stall_timeout_seconds=STALL_SECONDS)
            hang = Hang(engine)
            hangs[stack.enter_context(serve_engine(engine))] = hang
            stack.callback(hang.released.set)  # the held thread ends before its engine stops
        router = build_router(RouterConfig(pods=list(hangs), scrape_interval_seconds=0.1), tiny_dir)
        url = stack.enter_context(serve_router(router))
        wait_for(lambda: len(httpx.get(url + "/health").json()["pods"]) == 2)
        yield url, hangs
        wait_nothing_in_flight(router)


def test_a_stalled_pod_says_so_and_its_stream_goes_on_on_the_other(pool: tuple[str, dict[str, Hang]],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    url, hangs = pool
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    expected = httpx.post(next(iter(hangs)) + "/v1/completions", json=body, timeout=60).json()
    migrations = migrations_of(url)
    ids: list[int] = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as reply:
        serving = reply.headers["x-kvmesh-pod"]
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            ids += [t for choice in chunk["choices"] for t in choice.get("token_ids", [])]
            if len(ids) >= 10 and not hangs[serving].on.is_set():
                hangs[serving].on.set()  # its next step hangs
                stalled = wait_for(lambda: httpx.get(serving + "/health").json()["status"] == "stalled")
                alive = httpx.get(serving + "/livez")  # the liveness probe's: the kubelet restarts the pod
                assert stalled and alive.status_code == 503 and alive.json()["status"] == "stalled"
                for _ in range(3):  # every probe is answered 503, but the log says it once, with where it hangs
                    assert httpx.get(serving + "/livez").status_code == 503
    (stall,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine stalled")]
    assert "in held" in stall  # Hang's function, where the engine thread waits
    assert ids == expected["choices"][0]["token_ids"]
    assert migrations_of(url) == migrations + 1
    hangs[serving].released.set()  # the step returns: steps progress again
    assert wait_for(lambda: httpx.get(serving + "/livez").status_code == 200)
