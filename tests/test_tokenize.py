"""vLLM's /tokenize and /detokenize, on a real engine (the tiny model, in-process) and on the router in front of it:
the ids are the ones a completion of the same prompt or messages prefills (its usage's prompt_tokens), both edges
agree, and bad input is a 4xx that says why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from kvmesh.engine.engine import Engine
from kvmesh.router.app import build_router
from kvmesh.router.auth import hash_key
from kvmesh.router.config import RouterConfig
from kvmesh.router.tokenize_api import unknown_model

from .conftest import make_engine
from .engines import serve_engine, serve_router

KEY = "sk-tokens"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def edges(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The engine's URL and a keyed router's in front of it."""
    keys = tmp_path_factory.mktemp("tokenize") / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"tenant": "team", "key_sha256": hash_key(KEY)}]}))
    engine: Engine = make_engine(tiny_dir, kv_cache_blocks=128, max_model_len=512)
    with serve_engine(engine) as engine_url:
        router = build_router(RouterConfig(pods=[engine_url], scrape_interval_seconds=0.1, api_keys_file=str(keys)),
                              tiny_dir)
        with serve_router(router) as router_url:
            yield {"engine": engine_url, "router": router_url}


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)


@pytest.mark.parametrize("edge", ["engine", "router"])
def test_the_ids_are_what_a_completion_prefills(edges: dict[str, str], edge: str) -> None:
    url = edges[edge]
    for tokenize, complete, path in (
        ({"messages": MESSAGES}, {"messages": MESSAGES}, "/v1/chat/completions"),
        ({"messages": MESSAGES, "tools": TOOLS}, {"messages": MESSAGES, "tools": TOOLS}, "/v1/chat/completions"),
        ({"prompt": "Once upon a time"}, {"prompt": "Once upon a time"}, "/v1/completions"),
    ):
        counted = post(url, "/tokenize", tokenize)
        assert counted.status_code == 200, counted.text
        answer = post(url, path, {**complete, "max_tokens": 1})
        assert answer.status_code == 200, answer.text
        assert counted.json()["count"] == len(counted.json()["tokens"]) == answer.json()["usage"]["prompt_tokens"]
        assert counted.json()["max_model_len"] == 512


def test_both_edges_agree_and_detokenize_inverts(edges: dict[str, str]) -> None:
    bodies = ({"messages": MESSAGES, "add_generation_prompt": False}, {"prompt": "Hello there", "add_special_tokens":
                                                                        False})
    for body in bodies:
        ids = [post(url, "/tokenize", body).json()["tokens"] for url in edges.values()]
        assert ids[0] == ids[1]
    with_turn = post(edges["engine"], "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    without = post(edges["engine"], "/tokenize", bodies[0]).json()["tokens"]
    assert len(with_turn) > len(without) and with_turn[: len(without)] == without  # the assistant's opening added
    ids = post(edges["router"], "/tokenize", bodies[1]).json()["tokens"]
    for url in edges.values():
        assert post(url, "/detokenize", {"tokens": ids}).json() == {"prompt": "Hello there"}


@pytest.mark.parametrize("edge", ["engine", "router"])
def test_bad_calls_say_why(edges: dict[str, str], edge: str) -> None:
    url = edges[edge]
    both = post(url, "/tokenize", {"prompt": "a", "messages": MESSAGES})
    assert both.status_code == 400 and "prompt or messages" in both.json()["error"]["message"]
    assert post(url, "/tokenize", {"prompt": "a", "tools": TOOLS}).status_code == 400
    gone = post(url, "/tokenize", {"prompt": "a", "model": "no-such-model"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert gone.json()["error"]["param"] == "model"
    outside = post(url, "/detokenize", {"tokens": [1, 10**9]})
    assert outside.status_code == 400 and "outside the vocabulary" in outside.json()["error"]["message"]


def test_the_router_asks_for_the_key(edges: dict[str, str]) -> None:
    assert httpx.post(edges["router"] + "/tokenize", json={"prompt": "a"}).status_code == 401


def test_an_unknown_model_names_the_served_ones_or_says_there_are_none_yet() -> None:
    assert unknown_model("gpt-4", {"b", "a"}) == "The model `gpt-4` does not exist; this pool serves a, b"
    nothing = unknown_model("gpt-4", set())  # a pool whose engines have not listed a model yet
    assert nothing.endswith("this pool serves no model yet (no engine has listed one)")
