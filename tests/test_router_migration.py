"""A pod killed mid-stream: the router continues the stream on another pod, or ends it with an error event when no
pod can, and counts nothing left in flight either way (its own engine processes, since this module kills them)."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.processes import wait_healthy
from kvmesh.router.app import Router, build_router
from kvmesh.router.config import RouterConfig

from .engines import serve_router, serve_tiny, tiny_engines
from .test_router_disconnect import wait_nothing_in_flight

pytestmark = pytest.mark.slow


Pool = tuple[str, dict[str, subprocess.Popen], Router]  # the router's URL, the engines by URL, the router


@pytest.fixture(scope="module")
def pool(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with tiny_engines(tiny_dir, tmp_path_factory.mktemp("migration")) as procs:
        router = build_router(RouterConfig(pods=list(procs), scrape_interval_seconds=0.1), tiny_dir)
        with serve_router(router) as url:
            yield url, procs, router


@pytest.fixture
def both_alive(pool: Pool, tiny_dir: Path, tmp_path: Path) -> None:
    """Restart a pod an earlier test killed, and wait until the router sees both again."""
    url, procs, _ = pool
    for i, (pod, proc) in enumerate(list(procs.items())):
        if proc.poll() is not None:
            log = tmp_path / f"engine-{i}.log"
            procs[pod] = serve_tiny(tiny_dir, pod, log)
            wait_healthy(pod, procs[pod], log=log)
    for _ in range(100):
        if len(httpx.get(url + "/health").json()["pods"]) == 2:
            return
        threading.Event().wait(0.1)
    raise AssertionError("the router did not see both pods again")


@pytest.mark.parametrize("kind", ["completion", "chat", "echo"])
@pytest.mark.usefixtures("both_alive")
def test_a_pod_killed_mid_stream_is_replaced_without_a_repeated_or_lost_token(pool: Pool, kind: str) -> None:
    """Also an echo: the pod that goes on does not echo the prompt a second time."""
    url, procs, router = pool
    alive = [u for u, p in procs.items() if p.poll() is None]
    chat = kind == "chat"
    if chat:
        body = {"messages": [{"role": "user", "content": "Tell me a story"}]}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": "Once upon a time", "echo": kind == "echo", "logprobs": 1 if kind == "echo" else None}
        path = "/v1/completions"
    # long enough that the serving pod is still generating when it is killed
    body |= {"max_tokens": 300, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    migrations = migrations_of(url)
    reference = httpx.post(alive[0] + path, json={**body, "stream": False}, timeout=60).json()
    expected_ids = reference["choices"][0]["token_ids"]
    expected_text = reference["choices"][0]["message"]["content"] if chat else reference["choices"][0]["text"]
    ids: list[int] = []
    text = ""
    events = []
    offsets: list[int] = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as reply:
        serving = reply.headers["x-kvmesh-pod"]
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            events.append(chunk)
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                ids += choice.get("token_ids", [])
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                offsets += (choice.get("logprobs") or {}).get("text_offset") or []
            if len(ids) >= 10 and procs[serving].poll() is None:
                procs[serving].kill()  # the serving pod dies mid-stream
    assert killed(procs[serving]), "the pod was not killed during the stream"
    assert ids == expected_ids
    assert text == expected_text
    if kind == "echo":  # the pod that went on counted its offsets from its own first token: the router moves them on
        assert offsets == reference["choices"][0]["logprobs"]["text_offset"]
    assert len({c["id"] for c in events}) == 1
    assert migrations_of(url) == migrations + 1
    wait_nothing_in_flight(router)  # neither the dead pod nor the one that went on still counts the stream


@pytest.mark.usefixtures("both_alive")
def test_a_stream_no_pod_can_go_on_with_ends_with_an_error_and_holds_no_pod(pool: Pool) -> None:
    url, procs, router = pool
    body = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
        serving = reply.headers["x-kvmesh-pod"]
        (other,) = [u for u in procs if u != serving]
        procs[other].kill()  # the pod that could have gone on is gone first...
        procs[other].wait()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 10:
                    procs[serving].kill()  # ...then the serving pod dies mid-stream
    assert "error" in chunks[-1] and all("error" not in c for c in chunks[:-1])
    wait_nothing_in_flight(router)


def response_events(url: str, body: dict, procs: dict[str, subprocess.Popen], kill_others: bool) -> list[dict]:
    """A Responses API stream whose serving pod is killed after 10 text deltas (with `kill_others`, the pod that
    could go on first); its events."""
    events = []
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=60) as reply:
        serving = reply.headers["x-kvmesh-pod"]
        if kill_others:
            (other,) = [u for u in procs if u != serving]
            procs[other].kill()
            procs[other].wait()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if sum(e["type"] == "response.output_text.delta" for e in events) == 10:
                    procs[serving].kill()
    assert killed(procs[serving]), f"the pod was not killed during the stream: {events[-3:]}"
    return events


@pytest.mark.usefixtures("both_alive")
def test_a_responses_stream_goes_on_on_another_pod(pool: Pool) -> None:
    """The Responses API rides the chat path: a pod killed mid-stream is replaced, and the events carry the whole
    answer once, as the Responses API's stream."""
    url, procs, router = pool
    body = {"input": "Tell me a story", "max_output_tokens": 300, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(url + "/v1/responses", json={**body, "store": False}, timeout=60).json()
    migrations = migrations_of(url)
    events = response_events(url, body, procs, kill_others=False)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    (answer,) = [item for item in whole["output"] if item["type"] == "message"]
    assert text == answer["content"][0]["text"]
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["usage"]["output_tokens"] == 300
    assert migrations_of(url) == migrations + 1
    wait_nothing_in_flight(router)


@pytest.mark.usefixtures("both_alive")
def test_a_responses_stream_no_pod_can_go_on_with_ends_failed(pool: Pool) -> None:
    url, procs, router = pool
    body = {"input": "Once upon a time", "max_output_tokens": 300, "ignore_eos": True}
    events = response_events(url, body, procs, kill_others=True)
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["error"]["code"] == "server_error"
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in events)
    wait_nothing_in_flight(router)


def killed(proc: subprocess.Popen) -> bool:
    """Whether `proc` was killed (or died): waited for, since its sockets close before it can be reaped, so the
    stream can end and this run before poll() sees the exit (a busy machine widens that window)."""
    try:
        return proc.wait(timeout=10) is not None
    except subprocess.TimeoutExpired:
        return False


def migrations_of(router: str) -> float:
    (line,) = [x for x in httpx.get(router + "/metrics").text.splitlines()
               if x.startswith("kvmesh_router_migrations_total ")]
    return float(line.split()[1])


def test_with_no_pod_left_a_request_gets_503(pool: Pool) -> None:
    url, procs, router = pool
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
    reply = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=30)
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    wait_nothing_in_flight(router)
