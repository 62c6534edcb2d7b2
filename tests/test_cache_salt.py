"""A cache_salt is bounded in length: the engine keys its piece cache and its prefix blocks by it, and a client
reaching an engine directly (or a router with auth off) chooses it. The router's own salts are 32 characters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.engine.engine import Engine
from kvmesh.engine.openai_types import MAX_CACHE_SALT_CHARS
from kvmesh.router.auth import cache_salt_for

from .conftest import make_engine
from .engines import serve_engine


@pytest.fixture(scope="module")
def url(tiny_dir: Path) -> Iterator[str]:
    engine: Engine = make_engine(tiny_dir, kv_cache_blocks=64, max_model_len=256)
    with serve_engine(engine) as served:
        yield served


BODIES = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_an_over_long_cache_salt_is_a_400_naming_it(url: str, path: str) -> None:
    reply = httpx.post(url + path, json={**BODIES[path], "cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "cache_salt"
    assert f"cache_salt: String should have at most {MAX_CACHE_SALT_CHARS} characters" in error["message"]
    reply = httpx.post(url + path, json={**BODIES[path], "cache_salt": "s" * MAX_CACHE_SALT_CHARS}, timeout=60)
    assert reply.status_code == 200, reply.text


def test_the_routers_salts_are_well_within_the_bound() -> None:
    assert len(cache_salt_for("a-tenant", "a-secret") or "") <= MAX_CACHE_SALT_CHARS // 8
