"""Every engine route that takes a JSON body answers a malformed one as the completion routes do: a 400 saying
"body: malformed JSON: ... line L column C" (server.parsed_body, the one reader of bodies)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.engine.protocol import (
    COMPLETIONS_PATH,
    DETOKENIZE_PATH,
    DRAIN_PATH,
    KV_RELEASE_PATH,
    KV_WARM_PATH,
    LOAD_LORA_PATH,
    READY_PATH,
    UNLOAD_LORA_PATH,
)

from .conftest import make_engine
from .engines import serve_engine

BODILESS_POSTS = {READY_PATH, DRAIN_PATH}  # they read no body (and drain would stop the engine taking requests)
MALFORMED = b'{"lora_name": "a", "prompt": [1, 2'


@pytest.fixture(scope="module")
def url(tiny_dir: Path) -> Iterator[str]:
    with serve_engine(make_engine(tiny_dir, kv_cache_blocks=64)) as base:
        yield base


def _post_paths(url: str) -> list[str]:
    """The POST routes the engine's app declares (a route added later is checked too)."""
    paths = httpx.get(url + "/openapi.json", timeout=30).json()["paths"]
    return sorted(path for path, methods in paths.items() if "post" in methods and path not in BODILESS_POSTS)


def test_every_json_route_words_a_malformed_body_as_the_completion_routes(url: str) -> None:
    expected = httpx.post(url + COMPLETIONS_PATH, content=MALFORMED, headers={"content-type": "application/json"},
                          timeout=30)
    assert expected.status_code == 400
    message = expected.json()["error"]["message"]
    assert message.startswith("body: malformed JSON: ") and "line 1 column" in message
    paths = _post_paths(url)
    assert {DETOKENIZE_PATH, LOAD_LORA_PATH, UNLOAD_LORA_PATH, KV_RELEASE_PATH, KV_WARM_PATH} <= set(paths)
    answers = {path: httpx.post(url + path, content=MALFORMED, headers={"content-type": "application/json"},
                                timeout=30) for path in paths}
    assert {path: (a.status_code, a.json()["error"]["message"]) for path, a in answers.items()} == {
        path: (400, message) for path in paths}
