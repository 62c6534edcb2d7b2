"""Request parameters as OpenAI's clients send them, refused alike by an engine and by the router in front of it
(one in-process tiny engine for the module): each 4xx names the field the client sent (`param`) and says what is
wrong with it in words the client knows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh.engine.protocol import PRIORITY_HEADER
from kvmesh.router.app import build_router
from kvmesh.router.config import RouterConfig

from .conftest import make_engine
from .engines import serve_engine, serve_router

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def pool(tiny_dir: Path) -> Iterator[dict[str, str]]:
    """The engine's URL and the router's, in front of it."""
    with serve_engine(make_engine(tiny_dir, kv_cache_blocks=64, max_model_len=256)) as engine:
        router = build_router(RouterConfig(pods=[engine], scrape_interval_seconds=0.1), tiny_dir)
        with serve_router(router) as url:
            yield {"engine": engine, "router": url}


def refusal(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    reply = httpx.post(url + path, json=body, headers=headers, timeout=30)
    return reply.status_code, reply.json()["error"]


@pytest.mark.parametrize(("path", "body", "headers", "status", "param", "says"), [
    (CHAT, {"model": "nope", "messages": HI}, None, 404, "model", "nope"),
    (COMPLETIONS, {"prompt": [99999999], "max_tokens": 1}, None, 400, "prompt", "99999999"),
    (CHAT, {"messages": [{"role": "user", "content": []}]}, None, 400, "messages", "messages[0].content"),
    (CHAT, {"messages": HI}, {PRIORITY_HEADER: "urgent"}, 400, PRIORITY_HEADER, PRIORITY_HEADER),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, None, 400, "max_tokens", "max_tokens: must be at least 1"),
    (CHAT, {"messages": HI, "web_search_options": {}}, None, 400, "web_search_options", "web search"),
    (CHAT, {"messages": HI, "verbosity": "low"}, None, 400, "verbosity", "not steered to a length"),
])
def test_engine_and_router_name_the_same_field(pool: dict[str, str], path: str, body: dict[str, Any],
                                               headers: dict[str, str] | None, status: int, param: str,
                                               says: str) -> None:
    for url in pool.values():
        got, error = refusal(url, path, body, headers)
        assert (got, error["param"]) == (status, param), (url, error)
        assert says in error["message"] and not error["message"].startswith("body"), (url, error)


def test_a_completion_of_max_tokens_0_with_echo_is_the_prompt(pool: dict[str, str]) -> None:
    for url in pool.values():
        reply = httpx.post(url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 0, "echo": True}, timeout=30)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "hi", reply.text


def test_a_chat_of_the_default_verbosity_is_answered(pool: dict[str, str]) -> None:
    """`verbosity: medium` is OpenAI's default, what every answer is: SDKs that send it get their answer."""
    for url in pool.values():
        reply = httpx.post(url + CHAT, json={"messages": HI, "max_tokens": 2, "verbosity": "medium"}, timeout=30)
        assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("url_of", ["engine", "router"])
def test_a_body_that_is_not_a_json_object_is_told_so(pool: dict[str, str], url_of: str) -> None:
    """`curl -d 'prompt=hi'` sends form data; a JSON array is no request either."""
    url = pool[url_of] + COMPLETIONS
    array = httpx.post(url, json=[{"prompt": "hi"}], timeout=30)
    assert array.status_code == 400 and "must be a JSON object" in array.json()["error"]["message"], array.text
    form = httpx.post(url, data={"prompt": "hi"}, timeout=30)
    assert form.status_code == 400, form.text
    if url_of == "engine":  # the router reads any body as JSON: form data is malformed JSON there
        assert "must be a JSON object" in form.json()["error"]["message"], form.text
