"""The router in front of two real engine processes (the tiny model; one set of processes for the module):
prefix affinity, predicted against reported cached tokens, draining, retries, tenants, replicas agreeing."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from kvmesh.cli import main
from kvmesh.engine.openai_types import CompletionRequest
from kvmesh.engine.protocol import PRIORITY_HEADER
from kvmesh.processes import free_port
from kvmesh.router.app import Router, build_router
from kvmesh.router.batches import BATCH_PRIORITY
from kvmesh.router.config import RouterConfig
from kvmesh.router.pool_status import POOL_STATUS_PATH

from .engines import serve_router, tiny_engines

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    with tiny_engines(tiny_dir, tmp_path_factory.mktemp("engines")) as procs:
        yield list(procs)


@pytest.fixture(scope="module")
def router(engines: list[str], tiny_dir: Path) -> Iterator[tuple[str, Router]]:
    r = build_router(RouterConfig(pods=engines, scrape_interval_seconds=0.1), tiny_dir)
    with serve_router(r) as url:
        yield url, r


def complete(url: str, prompt: list[int], **extra: object) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 48000 + 200 for i in range(n)]


def test_a_repeated_prefix_lands_on_the_pod_that_holds_it(router: tuple[str, Router]) -> None:
    url, _ = router
    shared = tokens(1, 160)
    first = complete(url, [*shared, 1, 2, 3])
    time.sleep(0.5)
    pod = first.headers["x-kvmesh-pod"]
    for k in range(4):
        again = complete(url, [*shared, 10 + k, 11, 12])
        assert again.headers["x-kvmesh-pod"] == pod
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
    metrics = httpx.get(url + "/metrics").text
    assert 'kvmesh_router_decisions_total{reason="prefix"}' in metrics
    assert 'kvmesh_router_decisions_total{reason="prefix"} 0.0' not in metrics
    lags = [line for line in metrics.splitlines() if line.startswith("kvmesh_router_kv_event_lag_batches{")]
    assert len(lags) == 2 and all(float(line.split()[-1]) < 5 for line in lags)


def test_kvmesh_status_shows_each_pod_and_the_prefix_it_holds(router: tuple[str, Router], engines: list[str],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`kvmesh status` against the router: both engines healthy, and the one that served a 160-token prompt holds
    its 10 blocks in the router's index (from the engine's KV events); a URL that is no router is a clear error."""
    url, _ = router
    pod = complete(url, [*tokens(7, 160), 1, 2]).headers["x-kvmesh-pod"]
    for _ in range(100):
        rows = {row["name"]: row for row in httpx.get(url + POOL_STATUS_PATH, timeout=10).json()["pods"]}
        if rows[pod]["indexed_blocks"]["device"] >= 10:
            break
        time.sleep(0.1)
    assert sorted(rows) == sorted(engines) and {row["state"] for row in rows.values()} == {"healthy"}
    assert rows[pod]["indexed_blocks"]["device"] >= 10 and rows[pod]["num_blocks"] > 0
    assert main(["status", "--url", url]) == 0
    table = capsys.readouterr().out
    assert pod.removeprefix("http://") in table and "2 pods, 2 healthy" in table
    assert main(["status", "--url", engines[0]]) == 1  # an engine has no pool to show
    assert "is it a kvmesh router?" in capsys.readouterr().err


def test_predicted_cached_tokens_match_the_engines(router: tuple[str, Router]) -> None:
    url, _ = router
    agree = total = 0
    for k in range(20):
        prefix = tokens(100 + k % 5, 64 + 16 * (k % 5))
        reply = complete(url, [*prefix, *tokens(500 + k, 20)])
        predicted = int(reply.headers["x-kvmesh-predicted-cached-tokens"])
        actual = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        agree += predicted == actual
        total += 1
        time.sleep(0.2)
    assert agree / total >= 0.95, f"{agree} of {total} predictions matched"


def test_another_tenants_salt_gets_nothing_cached(router: tuple[str, Router]) -> None:
    url, _ = router
    prompt = tokens(7, 80)
    complete(url, prompt, cache_salt="tenant-a")
    time.sleep(0.3)
    assert complete(url, prompt, cache_salt="tenant-a").json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert complete(url, prompt, cache_salt="tenant-b").json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_streaming_through_the_router_with_openai(router: tuple[str, Router]) -> None:
    url, _ = router
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    whole = client.completions.create(
        model=model, prompt="The sky is", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.completions.create(
            model=model, prompt="The sky is", max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=1, temperature=9)


def test_a_relayed_chat_stream_ends_with_its_own_finish_chunk(router: tuple[str, Router]) -> None:
    """The engines send a chat choice's finish_reason in a chunk of its own, after its last tokens, as OpenAI
    does: the relay passes both, the token ids the router asked for stripped unless the client asked, the usage
    last; stream_options without a stream is refused at admission, as the engines refuse it."""
    url, _ = router
    body = {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    for ids in (True, False):
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "return_token_ids": ids},
                          timeout=60) as reply:
            chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
        *answer, usage = chunks
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
        finish = answer[-1]["choices"][0]
        assert finish == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                          **({"token_ids": []} if ids else {})}
        assert all(c["choices"][0]["finish_reason"] is None for c in answer[:-1])
        if ids:
            assert len([t for c in answer for t in c["choices"][0]["token_ids"]]) == 5
        else:
            assert not any("token_ids" in c["choices"][0] for c in answer)
    refused = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"


def test_completion_paths_are_listed_and_answer_other_methods_405(router: tuple[str, Router]) -> None:
    """Completion POSTs skip FastAPI (RouterApp), but the paths are still its routes: listed in the OpenAPI
    schema, and another method gets 405 rather than 404."""
    url, _ = router
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert httpx.get(url + path, timeout=30).status_code == 405
    paths = httpx.get(url + "/openapi.json", timeout=30).json()["paths"]
    assert "post" in paths["/v1/chat/completions"] and "post" in paths["/v1/completions"]
    assert "post" in paths["/v1/responses"]


def test_two_router_replicas_choose_the_same_pod(
    router: tuple[str, Router], engines: list[str], tiny_dir: Path
) -> None:
    url, first = router
    second = build_router(RouterConfig(pods=engines, scrape_interval_seconds=0.1), tiny_dir)
    with serve_router(second):
        for k in range(3):
            complete(url, [*tokens(300 + k, 96), 5])
        # both replicas read the same event streams: once the second has caught up, they choose alike
        bodies = [{"prompt": [*tokens(300 + k, 96), 9], "max_tokens": 1} for k in range(3)]
        deadline = time.monotonic() + 15
        while True:
            choices = []
            for body in bodies:
                infos = [r.request_info(CompletionRequest.model_validate(body), 0) for r in (first, second)]
                choices.append([r.decide(i, set()) for r, i in zip((first, second), infos, strict=True)])
            caught_up = all(b.predicted_cached_tokens == 96 for _, b in choices)
            if caught_up or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert caught_up, "the second replica's index never caught up with the pods' events"
        assert [a.pod.name for a, _ in choices] == [b.pod.name for _, b in choices]


@contextmanager
def kvmesh_up(tiny_dir: Path, engines: int, ready: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`kvmesh up` over the tiny model (its output in a pipe), once it has written `ready`; yields it and its
    router's port, and kills it at the end if it still runs."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "up", "--model", str(tiny_dir), "--engines",
                             str(engines), "--port", str(port), "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "kvmesh up did not get ready"
            time.sleep(0.2)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()


def test_kvmesh_up_runs_a_pool_and_stops_it(tiny_dir: Path, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    with kvmesh_up(tiny_dir, 2, ready) as (proc, port):
        endpoint = ready.read_text()
        assert endpoint == f"http://127.0.0.1:{port}/v1"
        reply = httpx.post(endpoint + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
        pods = httpx.get(f"http://127.0.0.1:{port}/health").json()["pods"]
        assert len(pods) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for pod in pods:  # every child is gone with it
            with pytest.raises(httpx.TransportError):
                httpx.get(pod + "/health", timeout=2)


def test_overload_sheds_the_lowest_priority_first(engines: list[str], tiny_dir: Path) -> None:
    """A router whose TTFT SLO no pod can meet: normal requests get 429 with Retry-After, important ones pass. A
    request of the batch runner (admitted with `batch`, as send_batch_request does) is shed too, counted apart:
    the batch retries it, no client sees that 429, and KvmeshRouterShedding counts clients' requests only."""
    strict = build_router(RouterConfig(pods=engines, scrape_interval_seconds=0.1, ttft_slo_seconds=1e-6,
                                       priority_headroom=1e9), tiny_dir)
    with serve_router(strict) as url:
        body = {"prompt": tokens(42, 40), "max_tokens": 1}
        shed = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert shed.status_code == 429 and int(shed.headers["retry-after"]) >= 1
        assert shed.json()["error"]["code"] == "overloaded"
        served = httpx.post(url + "/v1/completions", json=body, headers={"x-kvmesh-priority": "5"}, timeout=30)
        assert served.status_code == 200
        batch = asyncio.run(strict.admit(json.dumps(body).encode(), {PRIORITY_HEADER: str(BATCH_PRIORITY)},
                                         chat=False, batch=True))
        deferred = strict.refuse(batch.trace, strict.decide(batch.trace.info, set()))
        assert deferred is not None and deferred.status == 429
        metrics = httpx.get(url + "/metrics").text
    for series in ('kvmesh_router_shed_total{priority="normal",source="client"} 1.0',
                   'kvmesh_router_shed_total{priority="low",source="client"} 0.0',
                   'kvmesh_router_shed_total{priority="low",source="batch"} 1.0',
                   'kvmesh_router_requests_total{outcome="shed",route="aggregated",source="client"} 1.0',
                   'kvmesh_router_requests_total{outcome="ok",route="aggregated",source="client"} 1.0',
                   'kvmesh_router_requests_total{outcome="shed",route="aggregated",source="batch"} 1.0'):
        assert series in metrics, series


def test_the_chosen_pod_pulls_a_longer_prefix_from_its_peer(engines: list[str], tiny_dir: Path) -> None:
    """Scoring by load alone makes idle pods tie, so the tie-break chooses; the prefix lives on the other pod."""
    flat = {"prefix_weight": 0.0, "ttft_weight": 0.0, "kv_weight": 0.0, "load_weight": 1.0}
    # the tiny model prefills faster than any link: count the pull's setup as free so the choice is the link's
    r = build_router(RouterConfig(pods=engines, scrape_interval_seconds=0.1, weights=flat, pull_setup_seconds=0.0,
                                  pull_bytes_per_second=1e12), tiny_dir)
    with serve_router(r) as url:
        prompt = tokens(77, 300)
        info = r.request_info(CompletionRequest.model_validate({"prompt": [*prompt, 3]}), 0)
        deadline = time.monotonic() + 15
        while len([p for p in r.view(info).pods if p.healthy]) < len(engines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len([p for p in r.view(info).pods if p.healthy]) == len(engines), "the pods never became healthy"
        tie = r.decide(info, set())
        assert tie.pod is not None and tie.reason == "tie"
        chosen = tie.pod.name
        holder = next(e for e in engines if e != chosen)
        complete(holder, prompt)  # straight to the engine: only its events tell the router
        deadline = time.monotonic() + 15
        while holder not in r.index.match(info.block_hashes, [holder]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.index.match(info.block_hashes, [holder])[holder].blocks >= 16, "the holder's events never arrived"
        reply = complete(url, [*prompt, 3], return_token_ids=True)
        assert reply.headers["x-kvmesh-pod"] == chosen
        assert reply.json()["usage"]["prompt_tokens_details"]["kvmesh_cached_by_source"]["peer"] >= 256
        assert "kvmesh_router_pulls_total 1.0" in httpx.get(url + "/metrics").text
        # an echo reads its prompt's logprobs where it computes the prompt: no pull (the engine refuses one: a 400)
        scored = tokens(78, 300)
        info = r.request_info(CompletionRequest.model_validate({"prompt": [*scored, 3]}), 0)
        chosen = r.decide(info, set()).pod.name  # type: ignore[union-attr]
        holder = next(e for e in engines if e != chosen)
        complete(holder, scored)
        deadline = time.monotonic() + 15
        while holder not in r.index.match(info.block_hashes, [holder]) and time.monotonic() < deadline:
            time.sleep(0.1)
        echo = complete(url, [*scored, 3], echo=True, logprobs=1, max_tokens=1)
        assert len(echo.json()["choices"][0]["logprobs"]["token_logprobs"]) == len(scored) + 2
        assert "kvmesh_router_pulls_total 1.0" in httpx.get(url + "/metrics").text


def test_a_removed_event_changes_the_next_choice(router: tuple[str, Router], engines: list[str]) -> None:
    """A prefix held by one pod draws its requests there for the prefix; once that pod evicts it (its `removed`
    events reach the router), the next choice no longer counts on it: no cached tokens predicted anywhere, and
    the prefix is not what decides."""
    url, r = router
    holder = engines[1]
    prompt = tokens(901, 160)
    info = r.request_info(CompletionRequest.model_validate({"prompt": [*prompt, 1]}), 0)
    complete(holder, [*prompt, 1])  # straight to the engine: only its stored events tell the router

    def held_by_holder() -> int:
        match = r.index.match(info.block_hashes, [holder])
        return match[holder].blocks if holder in match else 0

    deadline = time.monotonic() + 15
    while held_by_holder() < 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    before = r.decide(info, set())
    assert (before.pod.name, before.reason, before.predicted_cached_tokens) == (holder, "prefix", 160)
    routed = complete(url, [*prompt, 2])
    assert routed.headers["x-kvmesh-pod"] == holder
    assert routed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 160

    blocks = httpx.get(holder + "/v1/kv/config").json()["num_device_blocks"]
    for k in range(blocks * 16 // 900 + 4):  # more distinct tokens than the holder's whole cache: all evicted
        complete(holder, tokens(1000 + k, 900))
    deadline = time.monotonic() + 15
    while held_by_holder() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert held_by_holder() == 0, "the holder's removed events never reached the router"
    after = r.decide(info, set())
    assert after.predicted_cached_tokens == 0 and after.reason != "prefix"
    reply = complete(url, [*prompt, 3])
    assert reply.headers["x-kvmesh-predicted-cached-tokens"] == "0"
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_drained_pod_gets_no_new_requests(router: tuple[str, Router], engines: list[str]) -> None:
    """Last in the module: draining cannot be undone."""
    url, _ = router
    shared = tokens(9, 128)
    pod = complete(url, [*shared, 1]).headers["x-kvmesh-pod"]
    httpx.post(pod + "/v1/admin/drain")
    for k in range(3):  # immediately, before the router's next scrape: a 503 is retried on the other pod
        reply = complete(url, [*shared, 2 + k])
        assert reply.headers["x-kvmesh-pod"] != pod
