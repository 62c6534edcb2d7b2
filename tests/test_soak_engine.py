"""What an engine holds for one HTTP call is given back however the call ends, also when the client leaves
while the response is starting (Starlette then never starts a stream's body): pinned KV blocks of a peer's
fetch, a pulled prefix's blocks, an events subscription. Held forever, these would shrink the KV cache and
grow the engine's lists over weeks of traffic. Driven through the ASGI interface directly, the one way to put
the disconnect at that moment (as tests/test_router_disconnect.py does for the router)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvmesh.bench.sim_engine import PROFILES, LatencyModel
from kvmesh.bench.sim_runner import SimEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine
from kvmesh.engine.protocol import KV_EVENTS_PATH, BlockExtra, HashAlgo, block_hashes
from kvmesh.engine.server import EngineHolder, create_app

from .engines import serve_engine

FREE = LatencyModel(0.0, 0.0, 0.0, 0.0, 1e15)  # every step takes no modelled time
PROMPT = list(range(1000, 1100))  # several full blocks


def sim_engine() -> SimEngine:
    return SimEngine(EngineConfig(kv_cache_blocks=64), PROFILES["cpu-smollm"], FREE)


@pytest.fixture(scope="module")
def source() -> Iterator[tuple[str, Engine]]:
    """A served engine that has PROMPT's blocks cached: the peer a fetch or pull reads."""
    engine = sim_engine()
    with serve_engine(engine) as url:
        reply = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
        assert reply.status_code == 200, reply.text
        yield url, engine


@pytest.fixture
def target() -> Iterator[Engine]:
    """A running engine whose app the test drives by hand."""
    engine = sim_engine()
    engine.start()
    yield engine
    engine.stop()


async def leave_as_response_starts(engine: Engine, method: str, path: str, body: dict[str, Any] | None = None,
                                   query: bytes = b"") -> None:
    """Call the engine's app as uvicorn would for a client that leaves once its request is read: `receive`
    gives the body, then says the client has gone; `send` of the response's start never returns."""
    app = create_app(EngineHolder(engine))
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1234)}
    messages = [{"type": "http.request", "body": json.dumps(body).encode() if body else b"", "more_body": False}]
    started = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            started.append(message["status"])
            await asyncio.Event().wait()  # the client is gone: the response never gets out

    await app(scope, receive, send)
    assert started == [200]  # the handler answered: what it took is held until the response ends


def held_sequences(engine: Engine) -> list[str]:
    """The block tables the engine holds, once the commands sent so far have run on its thread."""
    return engine.call(lambda: sorted(engine.kv.seqs)).result(timeout=30)


def source_hashes(engine: Engine) -> list[int]:
    bs = engine.config.block_size
    return block_hashes(PROMPT[: len(PROMPT) // bs * bs], bs, BlockExtra(), HashAlgo(engine.config.hash_algo),
                        engine.config.hash_root)


@pytest.mark.asyncio
async def test_a_fetch_whose_client_leaves_as_it_starts_unpins_its_blocks(source: tuple[str, Engine]) -> None:
    _, engine = source
    hashes = source_hashes(engine)
    assert engine.call(lambda: engine.cached_run(hashes)).result(timeout=30) == len(hashes)
    await leave_as_response_starts(engine, "POST", "/v1/kv/fetch", {"block_hashes": hashes})
    assert held_sequences(engine) == []  # the blocks pinned for the fetch are evictable again


@pytest.mark.asyncio
async def test_a_pulled_prefix_of_a_stream_never_started_is_given_back(source: tuple[str, Engine],
                                                                       target: Engine) -> None:
    url, _ = source
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True,
            "kv_transfer": {"mode": "pull", "source": url, "tokens": len(PROMPT)}}
    await leave_as_response_starts(target, "POST", "/v1/completions", body)
    assert held_sequences(target) == []  # the pulled blocks are not held for a request that never ran
    assert target.call(lambda: target.cached_run(source_hashes(target))).result(timeout=30) > 0  # it did pull


@pytest.mark.asyncio
async def test_an_events_stream_never_started_leaves_no_listener(target: Engine) -> None:
    before = len(target.events._listeners)
    for _ in range(3):
        await leave_as_response_starts(target, "GET", KV_EVENTS_PATH, query=b"after=0")
    assert len(target.events._listeners) == before
