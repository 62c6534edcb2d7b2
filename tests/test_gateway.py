"""`kvmesh gateway`: the model table and its choices (pure), the edge against a stub router (headers, query, streams,
errors), then end to end: two real routers, each in front of a tiny engine serving its own model name (one set of
processes for the module), and Kubernetes discovery against kmock's emulator."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import string
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import kmock
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kvmesh.cli import main
from kvmesh.engine.protocol import MODELS_PATH, GatewayMetric, RouterMetric
from kvmesh.operator.crd import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kvmesh.processes import free_port, spawn, stop, wait_healthy
from kvmesh.router.app import Router, build_router
from kvmesh.router.config import MAX_HOLD_SECONDS, RouterConfig
from kvmesh.router.discovery import kube_configuration
from kvmesh.router.gateway import (
    API_KEY_MAX_CHARS,
    DEFAULT_WEIGHT,
    DOWN,
    FAILING,
    LISTED,
    NAMES_IN_ERROR,
    REQUEST_OWN,
    UNKNOWN_MODEL,
    BodyError,
    ModelTable,
    Polls,
    broken_stream_ending,
    key_in_file,
    model_table,
    pool_routers,
    relayed_headers,
    requested_model,
    router_weights,
    smooth_pick,
)
from kvmesh.router.gateway_app import ApiKeyFile, Gateway, GatewayApp, PoolDiscovery, static_routers
from kvmesh.router.lora import ServedModels

from .conftest import make_engine
from .engines import serve_engine, serve_router
from .test_operator import write_kubeconfig
from .test_router_auth import write_keys
from .waiting import wait_for


def served(*names: str, adapters: dict[str, str] | None = None) -> ServedModels:
    cards = [{"id": n, "object": "model"} for n in names]
    cards += [{"id": a, "object": "model", "parent": base} for a, base in (adapters or {}).items()]
    return ServedModels.of({"object": "list", "data": cards})


def unweighted(*urls: str) -> dict[str, int]:
    """Routers as discovery gives them, each at the default weight."""
    return dict.fromkeys(urls, DEFAULT_WEIGHT)


# ---- the model table ---------------------------------------------------------------------------------------------


def test_each_model_maps_to_the_routers_that_list_it_in_their_order() -> None:
    listings = {"http://a": served("llama", adapters={"sql": "llama"}), "http://b": served("qwen"),
                "http://c": served("llama")}
    table = model_table(["http://c", "http://a", "http://b"], listings, {})
    assert table.routers == {"llama": ("http://c", "http://a"), "sql": ("http://a",), "qwen": ("http://b",)}
    assert [c["id"] for c in table.cards] == ["llama", "qwen", "sql"]  # once each: base models, then adapters
    assert table.cards[2]["parent"] == "llama"
    assert table.states == {"http://a": LISTED, "http://b": LISTED, "http://c": LISTED}


def picks(table: ModelTable, model: str, n: int) -> list[str | None]:
    """`n` requests' routers for `model`, each pick taking its turn as the gateway does."""
    turns: dict[str, int] = {}
    chosen = []
    for _ in range(n):
        router, turns = table.pick(model, turns)
        chosen.append(router)
    return chosen


def weighted_table(weights: dict[str, int], model: str = "m") -> ModelTable:
    return model_table(list(weights), {url: served(model) for url in weights}, {}, weights=weights)


def test_a_model_s_requests_split_by_weight_exactly_and_interleaved() -> None:
    """Smooth weighted round-robin: 9:1 is 900:100 of 1000 requests, one light request after another, and every
    run of 10 has the canary once (not 100 in a row)."""
    chosen = picks(weighted_table({"http://stable": 9, "http://canary": 1}), "m", 1000)
    assert Counter(chosen) == {"http://stable": 900, "http://canary": 100}
    assert all(chosen[i:i + 10].count("http://canary") == 1 for i in range(0, 1000, 10))
    five = Counter(picks(weighted_table({"http://stable": 95, "http://canary": 5}), "m", 1000))
    assert five == {"http://stable": 950, "http://canary": 50}
    three = Counter(picks(weighted_table({"http://a": 500, "http://b": 300, "http://c": 200}), "m", 100))
    assert three == {"http://a": 50, "http://b": 30, "http://c": 20}


def test_equal_weights_take_turns_starting_with_the_first() -> None:
    table = model_table(["http://a", "http://b", "http://c"],
                        {u: served("m") for u in ("http://a", "http://b", "http://c")}, {})
    assert picks(table, "m", 6) == ["http://a", "http://b", "http://c"] * 2
    assert table.pick("other", {}) == (None, {})


def test_a_router_at_weight_zero_drains_unless_every_router_of_the_model_is_at_zero() -> None:
    """Weight 0 takes no request while another router of the model has weight; when all are 0 they share equally
    (a served model never 404s or 502s for its weights)."""
    table = model_table(["http://a", "http://b", "http://c"],
                        {"http://a": served("m", "solo"), "http://b": served("m"), "http://c": served("m")}, {},
                        weights={"http://a": 0, "http://b": 100, "http://c": 0})
    assert set(picks(table, "m", 50)) == {"http://b"}
    assert picks(table, "solo", 3) == ["http://a"] * 3  # its only router is at 0: it still serves
    drained = weighted_table({"http://a": 0, "http://b": 0})
    assert picks(drained, "m", 4) == ["http://a", "http://b"] * 2


def test_a_router_that_refused_the_connection_is_passed_over_and_keeps_its_turn() -> None:
    weights = {"http://a": 3, "http://b": 1}
    router, turns = smooth_pick(weights, {})
    assert router == "http://a"
    router, turns = smooth_pick(weights, turns, exclude={"http://a"})  # the next one refused by a: b takes it
    assert router == "http://b"
    assert smooth_pick(weights, turns, exclude={"http://a", "http://b"})[0] is None  # none left: a 502
    table = weighted_table(weights)
    assert table.pick("m", {}, exclude={"http://a"})[0] == "http://b"
    # the weighted ones all refused: a drained one (a rollback's old pool at 0) takes it, not a 502
    rollback = weighted_table({"http://canary": 100, "http://old": 0})
    assert rollback.pick("m", {}, exclude={"http://canary"})[0] == "http://old"
    assert rollback.pick("m", {}, exclude={"http://canary", "http://old"})[0] is None
    # a router gone from the table leaves the turns; the others keep the split
    assert set(smooth_pick({"http://b": 1}, {"http://a": -2, "http://b": 2})[1]) == {"http://b"}


def test_a_router_that_stops_answering_drops_out_after_max_failures_and_comes_back() -> None:
    polls = Polls().with_routers(unweighted("http://a", "http://b"))
    polls = polls.answered("http://a", served("alpha", "shared")).answered("http://b", served("beta", "shared"))
    for _ in range(2):
        polls = polls.missed("http://b")
        table = polls.table(max_failures=3)
        assert table.states["http://b"] == FAILING and table.serves("beta")  # still routed to meanwhile
    polls = polls.missed("http://b")
    table = polls.table(max_failures=3)
    assert table.states == {"http://a": LISTED, "http://b": DOWN}
    assert not table.serves("beta")
    assert table.routers["shared"] == ("http://a",)  # another router still serves it
    assert table.listed() == ("http://a",)
    polls = polls.answered("http://b", served("beta"))
    assert polls.table(3).routers["beta"] == ("http://b",)


def test_a_router_that_lists_nothing_after_models_keeps_them() -> None:
    """Its pool scaled to zero (or lost its engines) and the router still answers: its models stay routed there,
    where a request wakes the pool, rather than 404 at the gateway. A router that never listed any has none."""
    polls = Polls().with_routers(unweighted("http://a", "http://b")).answered("http://a", served("alpha"))
    polls = polls.answered("http://a", served()).answered("http://b", served())
    assert polls.table().serves("alpha") and polls.table().pick("alpha", {})[0] == "http://a"


def test_the_table_is_a_function_of_the_listings_and_failure_counts() -> None:
    a = Polls().with_routers(unweighted("http://a", "http://b")).answered("http://a", served("x")).missed("http://b")
    b = Polls().with_routers(unweighted("http://a", "http://b")).missed("http://b").answered("http://a", served("x"))
    assert a.table(2) == b.table(2)


def test_a_router_never_listed_is_down_and_one_discovery_lost_is_forgotten() -> None:
    polls = Polls().with_routers(unweighted("http://a", "http://b")).answered("http://a", served("x"))
    assert polls.table().states["http://b"] == DOWN
    polls = polls.missed("http://b").with_routers({"http://b": 7})
    assert polls.order == ("http://b",) and "http://a" not in polls.listings and polls.failures == {"http://b": 1}
    assert not polls.table().serves("x")
    assert polls.answered("http://b", served("x")).table().weights == {"http://b": 7}  # the weight found now


def test_an_unknown_model_is_named_with_a_few_known_ones() -> None:
    names = [f"model-{i}" for i in range(NAMES_IN_ERROR + 3)]
    table = model_table(["http://a"], {"http://a": served(*names)}, {})
    message = table.unknown("nope")
    assert "`nope`" in message and ", ".join(sorted(names)[:NAMES_IN_ERROR]) in message and "and 3 more" in message
    assert "x" * 200 not in table.unknown("x" * 5000)  # a client's long name is cut
    assert "no pool's router" in model_table([], {}, {}).unknown("m")
    assert table.label("model-1") == "model-1" and table.label("nope") == UNKNOWN_MODEL
    assert table.label(None) == UNKNOWN_MODEL


def test_pool_routers_are_every_pool_with_an_address_in_namespace_and_name_order_with_its_weight() -> None:
    def pool(namespace: str, name: str, address: str | None, weight: Any = None) -> dict[str, Any]:
        return {"metadata": {"namespace": namespace, "name": name},
                "spec": {"gateway": {"weight": weight}} if weight is not None else {},
                "status": {"routerAddress": address} if address is not None else {}}

    pools = [pool("b", "x", "http://x.b.svc:8080/", 5), pool("a", "z", "http://z.a.svc:8080"), pool("a", "y", None),
             pool("a", "w", ""), {"metadata": {"namespace": "c", "name": "v"}},
             pool("c", "dup", "http://z.a.svc:8080", 0)]
    assert list(pool_routers(pools).items()) == [("http://z.a.svc:8080", DEFAULT_WEIGHT), ("http://x.b.svc:8080", 5)]
    # a weight the CRD would refuse (an object it never checked): the default, not a crash or a 0
    for bad in (-1, 1001, "5", True, 2.5):
        assert pool_routers([pool("a", "z", "http://z", bad)]) == {"http://z": DEFAULT_WEIGHT}
    assert pool_routers([pool("a", "z", "http://z", 0)]) == {"http://z": 0}
    for spec in ("weight", ["x"], {"gateway": "heavy"}, {"gateway": [5]}):  # not the shape the CRD gives
        odd = {"metadata": {"namespace": "a", "name": "z"}, "spec": spec, "status": {"routerAddress": "http://z"}}
        assert pool_routers([odd]) == {"http://z": DEFAULT_WEIGHT}


def test_router_weights_name_a_listed_router_and_a_weight_from_0_to_the_maximum() -> None:
    assert router_weights(["http://a/", "http://b"], ["http://a=5", "http://b/=0"]) == {"http://a": 5, "http://b": 0}
    assert router_weights(["http://a", "http://b"], []) == unweighted("http://a", "http://b")
    for bad in ("http://a", "http://a=", "http://a=-1", "http://a=1001", "http://a=2.5", "http://a= 5", "=5"):
        with pytest.raises(ValueError, match="expected URL=WEIGHT, WEIGHT an integer from 0 to 1000"):
            router_weights(["http://a"], [bad])
    with pytest.raises(ValueError, match="http://c is not one of the --router URLs"):
        router_weights(["http://a"], ["http://c=5"])
    with pytest.raises(ValueError, match="http://a is given twice"):
        router_weights(["http://a"], ["http://a=1", "http://a/=2"])


def test_headers_pass_on_less_those_of_one_connection() -> None:
    headers = [("Authorization", "Bearer k"), ("x-kvmesh-priority", "2"), ("traceparent", "00-ab-cd-01"),
               ("Connection", "keep-alive, X-Private"), ("x-private", "1"), ("Keep-Alive", "timeout=5"),
               ("TE", "trailers"), ("Transfer-Encoding", "chunked"), ("Upgrade", "h2c"), ("Host", "gw"),
               ("Content-Length", "12"), ("content-type", "application/json")]
    assert relayed_headers(headers, REQUEST_OWN) == [
        ("authorization", "Bearer k"), ("x-kvmesh-priority", "2"), ("traceparent", "00-ab-cd-01"),
        ("content-type", "application/json")]
    assert ("content-length", "12") in relayed_headers(headers)  # an answer keeps its length


@pytest.mark.parametrize(("body", "param", "says"), [
    (b"{not json", None, "malformed JSON"),
    (b"[1, 2]", None, "JSON object"),
    (b"{}", "model", "required"),
    (b'{"model": 7}', "model", "not int"),
    (b'{"model": null}', "model", "required"),
])
def test_a_body_without_a_model_name_is_refused_naming_the_field(body: bytes, param: str | None, says: str) -> None:
    with pytest.raises(BodyError) as caught:
        requested_model(body)
    assert caught.value.param == param and says in str(caught.value)


def test_the_model_is_read_from_the_body() -> None:
    assert requested_model(b'{"model": "m", "prompt": "x"}') == "m"


def test_a_stream_broken_at_a_line_end_ends_with_an_error_event_and_done() -> None:
    for tail, opening in ((b"", b""), (b"\n\n", b""), (b"}\n", b"\n"), (b"\r\n", b"\n")):
        ending = broken_stream_ending("text/event-stream; charset=utf-8", tail)
        assert ending is not None and ending.startswith(opening + b"data: {")
        events = (tail + ending).split(b"\n\n")
        assert json.loads(events[-3].strip().removeprefix(b"data: "))["error"]["type"] == "server_error"
        assert events[-2:] == [b"data: [DONE]", b""]
    assert broken_stream_ending("text/event-stream", b'{"') is None  # mid-line: no ending makes that event whole
    assert broken_stream_ending("application/json", b"\n\n") is None  # a JSON answer cut short stays cut


def test_a_key_file_holds_one_word_less_the_whitespace_around_it() -> None:
    assert key_in_file("sk-gateway\n") == key_in_file("  sk-gateway\r\n") == "sk-gateway"  # `echo` into a Secret
    assert key_in_file("k" * API_KEY_MAX_CHARS) == "k" * API_KEY_MAX_CHARS
    for no_key in (None, "", " \n", "sk one", "sk\none", "sk\x00", "clé", "k" * (API_KEY_MAX_CHARS + 1)):
        assert key_in_file(no_key) is None, no_key  # unreadable, empty, or no header could carry it


def test_the_key_file_is_read_each_time_and_logged_once_per_change(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "api-key"
    key_file = ApiKeyFile(str(path))
    caplog.set_level(logging.INFO, "kvmesh.gateway")

    def said() -> list[str]:
        lines = [r.getMessage() for r in caplog.records]
        caplog.clear()
        return lines

    assert key_file.read() is None and key_file.read() is None
    (missing,) = said()
    assert "cannot be read" in missing and "without a key" in missing
    path.write_text("sk-1\n")
    assert key_file.read() == key_file.read() == "sk-1"
    (taken,) = said()
    assert "sk-1" not in taken  # the key never reaches the log
    path.write_text("sk-2")
    assert key_file.read() == "sk-2"
    assert ["a new key" in line for line in said()] == [True]
    path.write_text("\n")
    assert key_file.read() is None and key_file.read() is None
    (emptied,) = said()
    assert "is empty" in emptied


# ---- the edge against a stub router ------------------------------------------------------------------------------


@contextmanager
def serve_asgi(app: Any, healthy: bool = True) -> Iterator[str]:
    """`app` on a free loopback port in a daemon thread; its URL once it answers /health (200 with `healthy`)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           server_header=False, date_header=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        if healthy:
            wait_healthy(url, timeout=30)
        else:
            wait_for(lambda: _answers(url))
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.TransportError:
        return False
    return True


def stub_router(model: str, seen: list[dict[str, Any]], release: threading.Event) -> Starlette:
    """A router's shape: /v1/models lists `model`; a completion echoes what it received, or streams three events,
    the second once `release` is set."""

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def complete(request: Request) -> Any:
        body = await request.json()
        seen.append({"headers": dict(request.headers), "query": request.url.query, "body": body})
        if body.get("stream"):
            async def events() -> AsyncIterator[str]:
                yield f"data: {json.dumps({'i': 0})}\n\n"
                # the rest only once the client has the first event (or, failing that, after a while)
                seen[-1]["released"] = await asyncio.to_thread(release.wait, 30)
                for i in (1, 2):
                    yield f"data: {json.dumps({'i': i})}\n\n"
                yield "data: [DONE]\n\n"

            async def broken() -> AsyncIterator[str]:  # the router dies mid-answer: its connection closes unfinished
                yield 'data: {"i": 0}\n\n' if body["stream"] == "broken" else 'data: {"i": 0}\n\ndata: {"i'
                raise RuntimeError("the router broke off")

            if body["stream"] in ("broken", "broken-mid-line"):
                return StreamingResponse(broken(), media_type="text/event-stream")
            return StreamingResponse(events(), media_type="text/event-stream", headers={"x-kvmesh-pod": "stub-0"})
        return JSONResponse({"model": body["model"], "echo": body}, status_code=body.get("status", 200),
                            headers={"x-kvmesh-pod": "stub-0", "x-ratelimit-remaining-requests": "9"})

    return Starlette(routes=[Route(MODELS_PATH, models), Route("/health", health),
                             Route("/v1/completions", complete, methods=["POST"]),
                             Route("/v1/chat/completions", complete, methods=["POST"]),
                             Route("/v1/responses", complete, methods=["POST"])])


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[str, list[dict[str, Any]], threading.Event]]:
    seen: list[dict[str, Any]] = []
    release = threading.Event()
    with serve_asgi(stub_router("stub-model", seen, release)) as url:
        yield url, seen, release


def test_a_request_reaches_the_router_with_its_headers_query_and_body(
        stub: tuple[str, list[dict[str, Any]], threading.Event]) -> None:
    url, seen, release = stub
    with serve_asgi(GatewayApp(Gateway(static_routers([url]), refresh_seconds=3600))) as gateway:
        body = b'{"model": "stub-model", "prompt": "hi",   "max_tokens": 1.0}'
        reply = httpx.post(gateway + "/v1/chat/completions?api-version=1", content=body, timeout=30, headers={
            "authorization": "Bearer sk-1", "x-kvmesh-priority": "1", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16
            + "-01", "content-type": "application/json", "connection": "keep-alive, x-secret", "x-secret": "no"})
        assert reply.status_code == 200
        assert reply.json()["echo"] == {"model": "stub-model", "prompt": "hi", "max_tokens": 1.0}
        assert reply.headers["x-kvmesh-pod"] == "stub-0" and reply.headers["x-ratelimit-remaining-requests"] == "9"
        received = seen[-1]
        assert received["query"] == "api-version=1"
        assert received["headers"]["authorization"] == "Bearer sk-1"
        assert received["headers"]["x-kvmesh-priority"] == "1"
        assert received["headers"]["traceparent"].startswith("00-aaaa")
        assert "x-secret" not in received["headers"]
        assert received["headers"]["host"] == url.removeprefix("http://")

        refused = httpx.post(gateway + "/v1/completions", json={"model": "stub-model", "status": 429}, timeout=30)
        assert refused.status_code == 429 and refused.json()["echo"]["status"] == 429  # relayed as it was

        with httpx.stream("POST", gateway + "/v1/responses", json={"model": "stub-model", "stream": True},
                          timeout=30) as streamed:
            assert streamed.headers["content-type"].startswith("text/event-stream")
            lines = streamed.iter_lines()
            assert next(lines) == 'data: {"i": 0}'  # relayed before the router sent more
            release.set()
            rest = [line for line in lines if line]
        assert rest == ['data: {"i": 1}', 'data: {"i": 2}', "data: [DONE]"] and seen[-1]["released"]
        metrics = scrape(gateway)
        assert metrics[(f"{GatewayMetric.REQUESTS}_total", (("model", "stub-model"), ("outcome", "ok")))] == 2
        assert metrics[(f"{GatewayMetric.REQUESTS}_total", (("model", "stub-model"), ("outcome", "refused")))] == 1


def test_a_header_value_that_is_not_ascii_reaches_the_router_as_it_came(
        stub: tuple[str, list[dict[str, Any]], threading.Event]) -> None:
    """A client's UTF-8 header (a user name, tracing baggage): passed on byte for byte, as the router and Envoy
    do (it was a bare 500 with a traceback)."""
    url, seen, _ = stub
    with serve_asgi(GatewayApp(Gateway(static_routers([url]), refresh_seconds=3600))) as gateway:
        reply = httpx.post(gateway + "/v1/completions", json={"model": "stub-model"}, timeout=30,
                           headers=[(b"x-user", "café".encode()), (b"traceparent", b"00-\xff\xfe-01")])
        assert reply.status_code == 200, reply.text
        received = seen[-1]["headers"]
        assert received["x-user"].encode("latin-1") == "café".encode()
        assert received["traceparent"].encode("latin-1") == b"00-\xff\xfe-01"


def test_a_router_stream_that_breaks_off_ends_with_an_error_event_or_is_cut_mid_line(
        stub: tuple[str, list[dict[str, Any]], threading.Event]) -> None:
    """As the router ends a stream no pod could continue: the openai SDK raises the error (rather than a dropped
    connection); a stream cut mid-event cannot be ended whole, so the client's connection is cut."""
    url, _, _ = stub
    with serve_asgi(GatewayApp(Gateway(static_routers([url]), refresh_seconds=3600))) as gateway:
        with httpx.stream("POST", gateway + "/v1/completions", json={"model": "stub-model", "stream": "broken"},
                          timeout=30) as streamed:
            events = [line for line in streamed.iter_lines() if line]
        assert events[0] == 'data: {"i": 0}' and events[-1] == "data: [DONE]"
        assert "broke off" in json.loads(events[1].removeprefix("data: "))["error"]["message"]
        with pytest.raises(httpx.RemoteProtocolError), httpx.stream(
                "POST", gateway + "/v1/completions", json={"model": "stub-model", "stream": "broken-mid-line"},
                timeout=30) as streamed:
            list(streamed.iter_lines())
        client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIError, match="broke off"):
            list(client.completions.create(model="stub-model", prompt="x", stream=True,
                                           extra_body={"stream": "broken"}))
        metrics = scrape(gateway)
        assert metrics[(f"{GatewayMetric.REQUESTS}_total", (("model", "stub-model"), ("outcome", "broken")))] == 3


def test_a_router_address_that_is_no_url_is_down_and_the_refresh_goes_on(
        stub: tuple[str, list[dict[str, Any]], threading.Event]) -> None:
    """One pool's malformed status.routerAddress failed the gateway's start (and ended its refresh task for good,
    leaving the table as it was): it is a router that does not answer."""
    url, _, _ = stub

    async def pools_listed() -> dict[str, int]:  # what PoolDiscovery reads from the pools' status (--router is
        return {"http://[::1": DEFAULT_WEIGHT, url: DEFAULT_WEIGHT}  # refused at the command line instead)

    gateway = Gateway(pools_listed, refresh_seconds=0.01)
    refreshes = []

    async def failing_once() -> None:
        refreshes.append(1)
        if len(refreshes) == 1:
            raise RuntimeError("an unexpected failure")

    async def main() -> None:
        await gateway.open()
        try:
            assert gateway.table.states == {"http://[::1": DOWN, url: LISTED}
            assert gateway.table.routers == {"stub-model": (url,)}
            gateway.refresh = failing_once  # type: ignore[method-assign]
            forever = asyncio.ensure_future(gateway.refresh_forever())
            while len(refreshes) < 2:
                assert not forever.done(), forever.exception()
                await asyncio.sleep(0.01)
            forever.cancel()
        finally:
            await gateway.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_gateway_waits_for_a_router_that_holds_a_request_while_its_pool_starts() -> None:
    """A router holds a request up to activationTimeoutSeconds (at most MAX_HOLD_SECONDS) and then waits up to
    its request timeout for the pod: the gateway's 502 came at 660 s, while the router still held it."""
    gateway = Gateway(static_routers([]))

    async def main() -> None:
        await gateway.open()
        try:
            assert gateway.client is not None
            assert gateway.client.timeout.read >= MAX_HOLD_SECONDS + RouterConfig().request_timeout_seconds
        finally:
            await gateway.close()

    asyncio.run(main())


def test_only_model_requests_are_routed(stub: tuple[str, list[dict[str, Any]], threading.Event]) -> None:
    url, _, _ = stub
    with serve_asgi(GatewayApp(Gateway(static_routers([url]), refresh_seconds=3600))) as gateway:
        for method, path in (("GET", "/v1/responses/resp_1"), ("POST", "/v1/files"), ("GET", "/v1/batches"),
                             ("POST", "/tokenize"), ("GET", "/")):
            reply = httpx.request(method, gateway + path, timeout=30)
            assert reply.status_code == 404, path
            message = reply.json()["error"]["message"]
            assert "Batch API" in message and "/tokenize" in message and "each pool's router" in message
        assert httpx.get(gateway + "/v1/completions", timeout=30).status_code == 405
        assert httpx.post(gateway + MODELS_PATH, timeout=30).status_code == 405


def test_a_models_card_is_read_by_its_id_even_one_holding_a_slash() -> None:
    """OpenAI's `GET /v1/models/{model}` (client.models.retrieve) through the gateway: the card the routers list,
    as /v1/models holds it; an id no router lists is a 404 model_not_found naming those that are."""
    seen: list[dict[str, Any]] = []
    with serve_asgi(stub_router("org/stub-model", seen, threading.Event())) as url, \
            serve_asgi(GatewayApp(Gateway(static_routers([url]), refresh_seconds=3600))) as gateway:
        client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
        card = client.models.retrieve("org/stub-model")
        assert card.id == "org/stub-model" and card.object == "model"
        for path in ("org/stub-model", "org%2Fstub-model"):  # the "/" as it is or percent-encoded
            reply = httpx.get(f"{gateway}{MODELS_PATH}/{path}", timeout=30)
            assert reply.status_code == 200 and reply.json() == {"id": "org/stub-model", "object": "model"}
        assert httpx.head(f"{gateway}{MODELS_PATH}/org/stub-model", timeout=30).status_code == 200
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("org/other")
        error = missing.value.body
        assert isinstance(error, dict) and error["code"] == "model_not_found" and error["param"] == "model"
        assert "org/stub-model" in error["message"]
        assert httpx.delete(f"{gateway}{MODELS_PATH}/org/stub-model", timeout=30).status_code == 405
    assert seen == []  # answered from the routers' lists: no request reached a router


def test_a_router_that_cannot_be_reached_is_a_502_after_trying_each(
        stub: tuple[str, list[dict[str, Any]], threading.Event]) -> None:
    url, seen, _ = stub
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    gateway = Gateway(static_routers([dead, url]), refresh_seconds=3600)

    async def main() -> None:
        await gateway.open()
        try:  # the dead router listed once, before it died: first in order, so tried first
            gateway.polls = gateway.polls.answered(dead, served("stub-model"))
            gateway.table = gateway.polls.table()
            assert gateway.table.routers["stub-model"] == (dead, url)
            app = httpx.AsyncClient(transport=httpx.ASGITransport(GatewayApp(gateway)), base_url="http://gw")
            before = len(seen)
            reply = await app.post("/v1/completions", json={"model": "stub-model"})
            assert reply.status_code == 200 and len(seen) == before + 1  # the other router took it
            gateway.table = gateway.polls.with_routers(unweighted(dead)).table()
            reply = await app.post("/v1/completions", json={"model": "stub-model"})
            assert reply.status_code == 502 and "could be reached" in reply.json()["error"]["message"]
            taken = gateway.metrics.registry.get_sample_value
            assert taken(f"{GatewayMetric.UPSTREAM_REQUESTS}_total", {"model": "stub-model", "router": url}) == 1
            assert taken(f"{GatewayMetric.UPSTREAM_REQUESTS}_total", {"model": "stub-model", "router": dead}) is None
        finally:
            await gateway.close()

    asyncio.run(main())


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ---- end to end: two pools, each a router in front of a tiny engine ------------------------------------------------


@pytest.fixture(scope="module")
def pools(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, Router]]]:
    """Model name -> (router URL, Router): engine processes serving `alpha` and `beta`, each behind its router."""
    logs = tmp_path_factory.mktemp("gateway")
    engines = {}
    try:
        for name in ("alpha", "beta"):
            url = f"http://127.0.0.1:{free_port()}"
            engines[name] = (url, spawn(["serve", "--model", str(tiny_dir), "--served-model-name", name, "--port",
                                         url.rsplit(":", 1)[1], "--dtype", "float32", "--threads", "1",
                                         "--kv-cache-memory-mib", "16", "--log-level", "warning"], logs / name))
        for name, (url, proc) in engines.items():
            wait_healthy(url, proc, log=logs / name)
        routers = {name: build_router(RouterConfig(pods=[url], scrape_interval_seconds=0.1), tiny_dir)
                   for name, (url, _) in engines.items()}
        with serve_router(routers["alpha"]) as alpha, serve_router(routers["beta"]) as beta:
            yield {"alpha": (alpha, routers["alpha"]), "beta": (beta, routers["beta"])}
    finally:
        stop(proc for _, proc in engines.values())


@pytest.fixture(scope="module")
def gateway(pools: dict[str, tuple[str, Router]]) -> Iterator[str]:
    with serve_asgi(GatewayApp(Gateway(static_routers([pools["alpha"][0], pools["beta"][0]]),
                                       refresh_seconds=0.2))) as url:
        yield url


def router_requests(router: Router, outcome: str = "ok") -> float:
    return router.metrics.registry.get_sample_value(f"{RouterMetric.REQUESTS}_total", {
        "outcome": outcome, "route": "aggregated", "source": "client"}) or 0.0


@pytest.mark.slow
def test_each_model_reaches_its_own_pool(gateway: str, pools: dict[str, tuple[str, Router]]) -> None:
    for name in ("alpha", "beta"):
        mine, other = pools[name][1], pools["beta" if name == "alpha" else "alpha"][1]
        before_mine, before_other = router_requests(mine), router_requests(other)
        reply = httpx.post(gateway + "/v1/completions", json={"model": name, "prompt": "Hello", "max_tokens": 2},
                           timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == name and reply.headers["x-kvmesh-pod"]  # the router's own header
        assert router_requests(mine) == before_mine + 1 and router_requests(other) == before_other


@pytest.mark.slow
def test_models_are_the_union_and_health_is_ok(gateway: str) -> None:
    assert [c["id"] for c in httpx.get(gateway + MODELS_PATH, timeout=30).json()["data"]] == ["alpha", "beta"]
    health = httpx.get(gateway + "/health", timeout=30)
    assert health.status_code == 200 and len(health.json()["routers"]) == 2


@pytest.mark.slow
def test_the_openai_client_works_through_the_gateway(gateway: str) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    assert sorted(m.id for m in client.models.list().data) == ["alpha", "beta"]
    for model in ("alpha", "beta"):
        whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert whole.model == model
        chunks = list(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))
        assert {c.model for c in chunks} == {model}
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gamma", prompt="x", max_tokens=1)
    error = missing.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found" and "alpha, beta" in error["message"]
    with pytest.raises(openai.BadRequestError):  # the router behind checks the rest of the body
        client.completions.create(model="alpha", prompt="x", max_tokens=1, temperature=9)


@pytest.mark.slow
def test_a_bad_body_is_a_400_naming_the_field(gateway: str) -> None:
    reply = httpx.post(gateway + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"
    reply = httpx.post(gateway + "/v1/chat/completions", content=b"{oops", timeout=30)
    assert reply.status_code == 400 and "malformed JSON" in reply.json()["error"]["message"]


@pytest.mark.slow
def test_random_model_names_make_no_series_of_their_own(gateway: str) -> None:
    rng = random.Random(7)
    for _ in range(20):
        name = "".join(rng.choices(string.ascii_letters, k=12))
        assert httpx.post(gateway + "/v1/completions", json={"model": name, "prompt": "x"}, timeout=30).status_code \
            == 404
    metrics = scrape(gateway)
    models = {dict(labels)["model"] for name, labels in metrics if name == f"{GatewayMetric.REQUESTS}_total"}
    assert models <= {"alpha", "beta", UNKNOWN_MODEL}
    assert metrics[(f"{GatewayMetric.REQUESTS}_total", (("model", UNKNOWN_MODEL), ("outcome", "unknown_model")))] \
        >= 20
    assert metrics[(GatewayMetric.UPSTREAMS, (("state", LISTED),))] == 2


@pytest.mark.slow
def test_a_client_leaving_a_stream_closes_it_upstream(gateway: str, pools: dict[str, tuple[str, Router]]) -> None:
    router = pools["alpha"][1]
    before = router_requests(router, "client_gone")
    body = {"model": "alpha", "prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=60) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("data: {"):
                break  # the first chunk: leave
    wait_for(lambda: router_requests(router, "client_gone") == before + 1)


@pytest.mark.slow
def test_a_canary_pool_takes_its_weight_s_share_and_none_once_drained(
        tiny_dir: Path, pools: dict[str, tuple[str, Router]]) -> None:
    """Two real routers listing `beta` (a second one in front of beta's engine: a canary pool serving the same
    model), weighted 3:1 through the real gateway: 8 requests one after another are 6 and 2, counted by each router
    and by the gateway's per-router metric; at weight 0 the canary takes none."""
    stable_url, stable = pools["beta"]
    engine = next(iter(stable.pods.pods.values())).url
    canary = build_router(RouterConfig(pods=[engine], scrape_interval_seconds=0.1), tiny_dir)
    with serve_router(canary) as canary_url:
        gateway = Gateway(static_routers([stable_url, canary_url], [f"{stable_url}=300", f"{canary_url}=100"]),
                          refresh_seconds=0.1)
        with serve_asgi(GatewayApp(gateway)) as url:

            def send(n: int) -> tuple[float, float]:
                """n requests for `beta`; what each router counted of them."""
                before = router_requests(stable), router_requests(canary)
                for _ in range(n):
                    reply = httpx.post(url + "/v1/completions", json={"model": "beta", "prompt": "x",
                                                                      "max_tokens": 1}, timeout=60)
                    assert reply.status_code == 200 and reply.headers["x-kvmesh-pod"] == engine, reply.text
                return router_requests(stable) - before[0], router_requests(canary) - before[1]

            wait_for(lambda: gateway.table.routers.get("beta") == (stable_url, canary_url))
            assert send(8) == (6, 2)
            taken = {dict(labels)["router"]: value for (name, labels), value in scrape(url).items()
                     if name == f"{GatewayMetric.UPSTREAM_REQUESTS}_total" and dict(labels)["model"] == "beta"}
            assert taken == {stable_url: 6, canary_url: 2}
            gateway.discover = static_routers([stable_url, canary_url], [f"{canary_url}=0"])  # rolled back
            wait_for(lambda: gateway.table.weights.get(canary_url) == 0)
            assert send(4) == (4, 0)


@pytest.mark.slow
def test_a_router_that_dies_drops_out_and_its_model_then_404s(
        tiny_dir: Path, pools: dict[str, tuple[str, Router]]) -> None:
    beta_engine = next(iter(pools["beta"][1].pods.pods.values())).url
    second = build_router(RouterConfig(pods=[beta_engine], scrape_interval_seconds=0.1), tiny_dir)
    gateway = Gateway(static_routers([pools["alpha"][0]]), refresh_seconds=0.1, max_failures=2)
    with serve_asgi(GatewayApp(gateway)) as url:
        with serve_router(second) as beta:
            gateway.discover = static_routers([pools["alpha"][0], beta])
            wait_for(lambda: gateway.table.serves("beta"))
            assert httpx.post(url + "/v1/completions", json={"model": "beta", "prompt": "x", "max_tokens": 1},
                              timeout=60).status_code == 200
        wait_for(lambda: not gateway.table.serves("beta"))  # that router stopped; the gateway goes on
        assert gateway.table.states[beta] == DOWN
        reply = httpx.post(url + "/v1/completions", json={"model": "beta", "prompt": "x", "max_tokens": 1},
                           timeout=60)
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
        assert httpx.post(url + "/v1/completions", json={"model": "alpha", "prompt": "x", "max_tokens": 1},
                          timeout=60).status_code == 200
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        assert scrape(url)[(GatewayMetric.UPSTREAMS, (("state", DOWN),))] == 1


# ---- routers that ask an API key ---------------------------------------------------------------------------------

GATEWAY_KEY, CLIENT_KEY = "sk-gateway-1", "sk-client"


@pytest.fixture(scope="module")
def keyed_engine(tiny_dir: Path) -> Iterator[str]:
    """An engine serving `keyed` (in-process), for routers with an API keys file."""
    with serve_engine(make_engine(tiny_dir, served_model_name="keyed", kv_cache_blocks=128)) as url:
        yield url


@pytest.fixture
def keyed_router(tiny_dir: Path, keyed_engine: str, tmp_path: Path) -> Iterator[tuple[str, Router, Path]]:
    """A router whose keys file has the gateway as a tenant of its own beside a client, the gateway's limits at one
    request a minute (its key is for listing models, which no limit counts): URL, Router, keys file."""
    keys = tmp_path / "keys.yaml"
    write_keys(keys, {GATEWAY_KEY: "gateway", CLIENT_KEY: "apps"})
    router = build_router(RouterConfig(pods=[keyed_engine], scrape_interval_seconds=0.1, api_keys_file=str(keys),
                                       tenants={"gateway": {"requests_per_minute": 1}}), tiny_dir)
    with serve_router(router) as url:
        yield url, router, keys


@pytest.mark.slow
def test_a_rotated_key_file_is_used_at_the_next_refresh_and_a_wrong_key_keeps_the_pool_out(
        keyed_router: tuple[str, Router, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The router's keys and the gateway's key file rotate as two Secrets would; the same Gateway, never restarted,
    lists the pool again at its first refresh after its file has the new key."""
    url, router, keys = keyed_router
    key_file = tmp_path / "gateway-key"
    key_file.write_text(GATEWAY_KEY + "\n")
    gateway = Gateway(static_routers([url]), refresh_seconds=3600, max_failures=2, api_key_file=ApiKeyFile(
        str(key_file)))

    async def main() -> None:
        await gateway.open()  # its first refresh
        try:
            assert gateway.table.routers == {"keyed": (url,)} and gateway.table.states[url] == LISTED
            write_keys(keys, {"sk-gateway-2": "gateway", CLIENT_KEY: "apps"})  # the old key revoked
            await asyncio.to_thread(router.reload_keys)
            await gateway.refresh()
            assert gateway.table.states[url] == FAILING
            key_file.write_text("sk-gateway-2")  # the gateway's Secret rotated too
            await gateway.refresh()  # its second listing within the minute: the tenant's limit counts none
            assert gateway.table.routers == {"keyed": (url,)} and gateway.table.states[url] == LISTED
            key_file.write_text("sk-wrong")
            for _ in range(2):
                await gateway.refresh()
            assert gateway.table.states[url] == DOWN and not gateway.table.serves("keyed")
            assert f"router {url} is out of the model table: {MODELS_PATH} answered 401 (it asks an API key" \
                in caplog.text
            key_file.unlink()  # no file: polls without a key, which this router refuses too
            await gateway.refresh()
            assert gateway.table.states[url] == DOWN
        finally:
            await gateway.close()

    asyncio.run(asyncio.wait_for(main(), 120))


@pytest.mark.slow
def test_a_keyed_pool_is_listed_and_the_client_s_own_key_reaches_its_router(
        keyed_router: tuple[str, Router, Path], tmp_path: Path) -> None:
    url, router, _ = keyed_router
    key_file = tmp_path / "gateway-key"
    key_file.write_text(GATEWAY_KEY)
    with serve_asgi(GatewayApp(Gateway(static_routers([url]), refresh_seconds=3600,
                                       api_key_file=ApiKeyFile(str(key_file))))) as gateway:
        client = openai.OpenAI(base_url=gateway + "/v1", api_key=CLIENT_KEY, max_retries=0)
        assert [m.id for m in client.models.list()] == ["keyed"]
        done = client.completions.create(model="keyed", prompt="hello", max_tokens=2)
        assert done.choices[0].text and done.usage is not None and done.usage.completion_tokens == 2
        assert router.metrics.registry.get_sample_value(f"{RouterMetric.REQUESTS}_total", {
            "outcome": "ok", "route": "aggregated", "source": "client"}) == 1
        stranger = openai.OpenAI(base_url=gateway + "/v1", api_key="sk-unknown", max_retries=0)
        with pytest.raises(openai.AuthenticationError):  # the router's 401, relayed: not the gateway's key used
            stranger.completions.create(model="keyed", prompt="hello", max_tokens=2)


# ---- Kubernetes discovery ----------------------------------------------------------------------------------------


def pool_object(namespace: str, name: str, address: str | None, weight: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace},
                            "spec": {"model": {"source": "bundled"}}}
    if weight is not None:
        body["spec"]["gateway"] = {"weight": weight}
    if address is not None:
        # not Ready (a role below its desired replicas, as in a scale-up), yet serving
        body["status"] = {"routerAddress": address, "conditions": [{"type": "Ready", "status": "False"}]}
    return body


@pytest.mark.slow
def test_pools_with_a_router_address_are_found_through_the_api(
        tmp_path: Path, pools: dict[str, tuple[str, Router]]) -> None:
    alpha, dead = pools["alpha"][0], f"http://127.0.0.1:{free_port()}"

    async def main() -> None:
        async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
            k8s.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = {"kind": KIND, "namespaced": True, "subresources": [],
                                                           "verbs": ["get", "list", "create"]}
            for namespace, name, address, weight in (("team-a", "chat", alpha, None), ("team-b", "code", dead, 5),
                                                     ("team-a", "new", None, None)):
                await k8s.post(f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}",
                               json=pool_object(namespace, name, address, weight))
            kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", str(server.url), namespace=None)
            configuration = kube_configuration(str(kubeconfig))
            kind = (GROUP, VERSION, PLURAL)
            # each with its pool's spec.gateway.weight (none written, as the emulator fills no CRD default: 100)
            assert await PoolDiscovery(configuration, kind)() == {alpha: DEFAULT_WEIGHT, dead: 5}
            assert await PoolDiscovery(configuration, kind, "team-a")() == {alpha: DEFAULT_WEIGHT}
            gateway = Gateway(PoolDiscovery(configuration, kind), refresh_seconds=3600)
            await gateway.open()
            try:  # the pool whose router answers is in the table (Ready or not); the other's answers nothing
                assert gateway.table.routers == {"alpha": (alpha,)}
                assert gateway.table.states[dead] == DOWN
            finally:
                await gateway.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_cli_refuses_no_discovery_and_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["gateway"])
    assert main(["gateway", "--router", "http://127.0.0.1:1", "--refresh-seconds", "0"]) == 2
    assert "--refresh-seconds" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "says"), [
    (["--router", "http://127.0.0.1:1", "--router-weight", "http://127.0.0.1:1=1001"], "from 0 to 1000"),
    (["--router", "http://127.0.0.1:1", "--router-weight", "http://127.0.0.1:1"], "expected URL=WEIGHT"),
    (["--router", "http://127.0.0.1:1", "--router-weight", "http://127.0.0.1:2=5"], "not one of the --router URLs"),
    (["--kubernetes", "--router-weight", "http://127.0.0.1:1=5"], "spec.gateway.weight"),
])
def test_the_cli_refuses_a_bad_router_weight(flags: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmesh gateway: ") and says in err
