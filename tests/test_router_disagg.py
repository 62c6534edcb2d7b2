"""A disaggregated pool: one prefill and one decode engine process behind the router (the tiny model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from kvmesh.router.app import build_router, create_router_app
from kvmesh.router.config import RouterConfig

from .test_router_e2e import wait_health
from .test_server import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("disagg")
    procs, urls = [], {}
    for role in ("prefill", "decode"):
        port = free_port()
        urls[role] = f"http://127.0.0.1:{port}"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", "--model", str(tiny_dir), "--port", str(port), "--role",
             role, "--dtype", "float32", "--threads", "1", "--kv-cache-memory-mib", "16", "--log-level", "warning"],
            stdout=(logs / f"{role}.log").open("w"), stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    for url, proc in zip(urls.values(), procs, strict=True):
        wait_health(url, proc)
    router = build_router(RouterConfig(pods=list(urls.values()), scrape_interval_seconds=0.1,
                                       prefill_hop_min_tokens=32), tiny_dir)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_router_app(router), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    urls["router"] = f"http://127.0.0.1:{port}"
    wait_health(urls["router"], timeout=30)
    for _ in range(100):  # the router knows both roles
        if len(httpx.get(urls["router"] + "/health").json()["pods"]) == 2:
            break
        threading.Event().wait(0.1)
    yield urls
    server.should_exit = True
    thread.join(timeout=10)
    for proc in procs:
        proc.send_signal(signal.SIGINT)
    for proc in procs:
        proc.wait(timeout=20)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 48000 + 200 for i in range(n)]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}])
def test_disaggregated_equals_aggregated(pool: dict[str, str], sampling: dict) -> None:
    prompt = tokens(5 + len(sampling), 90)
    body = {"prompt": prompt, "max_tokens": 12, "return_token_ids": True, **sampling}
    split = httpx.post(pool["router"] + "/v1/completions", json=body, timeout=60)
    assert split.status_code == 200, split.text
    assert split.headers["x-kvmesh-pod"] == f"{pool['prefill']},{pool['decode']}"
    whole = httpx.post(pool["decode"] + "/v1/completions", json=body, timeout=60).json()
    assert split.json()["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
    assert split.json()["choices"][0]["text"] == whole["choices"][0]["text"]
    usage = split.json()["usage"]
    assert usage["prompt_tokens"] == 90 and usage["completion_tokens"] == 12


def test_disaggregated_streaming_chat(pool: dict[str, str]) -> None:
    messages = [{"role": "user", "content": "Write a long story about a cat and a dog. " * 4}]
    body = {"messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(pool["prefill"] + "/v1/chat/completions", json=body, timeout=60).json()
    text, roles, ids = "", 0, set()
    with httpx.stream("POST", pool["router"] + "/v1/chat/completions", timeout=60,
                      json=body | {"stream": True, "stream_options": {"include_usage": True}}) as reply:
        assert reply.headers["x-kvmesh-pod"].startswith(pool["prefill"])
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    for chunk in chunks:
        ids.add(chunk["id"])
        for choice in chunk["choices"]:
            assert "token_ids" not in choice  # the router asked for them, the client did not
            text += choice["delta"].get("content") or ""
            roles += "role" in choice["delta"]
    assert text == whole["choices"][0]["message"]["content"]
    assert roles == 1 and len(ids) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_a_short_uncached_prompt_skips_the_prefill_hop(pool: dict[str, str]) -> None:
    reply = httpx.post(pool["router"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200 and reply.headers["x-kvmesh-pod"] == pool["decode"]
