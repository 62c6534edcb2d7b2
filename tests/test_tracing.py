"""Distributed tracing: one trace from a client through the router to every engine it calls.

The end-to-end tests run a real OTLP/HTTP receiver (http.server decoding the protobuf ExportTraceServiceRequest with
the opentelemetry-proto classes the exporter ships) in front of which real engine processes and a real router
export; the finer checks use the SDK's in-memory exporter with an in-process engine."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Status
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.cli import main
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.tracing import (
    ENGINE_SERVICE,
    OFF,
    ROUTER_SERVICE,
    ChoiceTokens,
    call_usage,
    resolve_endpoint,
    setup_tracing,
)
from kvmesh.processes import free_port, spawn, stop, wait_healthy
from kvmesh.router.app import Router, build_router
from kvmesh.router.auth import tenant_hash
from kvmesh.router.config import RouterConfig, load_router_config
from kvmesh.router.picker import RequestInfo
from kvmesh.router.tracing import hop, request_span

from .conftest import make_engine
from .engines import serve_checked, serve_router
from .waiting import wait_for

CLIENT_TRACE = "0af7651916cd43dd8421aaa7b7a1c9e5"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
STATUS_ERROR = Status.STATUS_CODE_ERROR


# ---- configuration -------------------------------------------------------------------------------------------


def test_the_endpoint_comes_from_the_flag_then_the_standard_environment() -> None:
    assert resolve_endpoint(None, {}) is None  # nothing set: tracing off
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}
    assert resolve_endpoint(None, env) == "http://collector:4318/v1/traces"  # a base URL gets the traces path
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://tempo:4318/custom"
    assert resolve_endpoint(None, env) == "http://tempo:4318/custom"  # the traces URL is used as it is
    assert resolve_endpoint("https://mine:443/v1/traces", env) == "https://mine:443/v1/traces"


@pytest.mark.parametrize("bad", ["collector:4318", "ftp://collector/v1/traces", "http://:4318/v1/traces",
                                 "http://collector:port/v1/traces"])
def test_an_unusable_endpoint_is_a_clear_error_at_start(bad: str, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="OTLP traces endpoint"):
        resolve_endpoint(bad, {})
    with pytest.raises(ValueError, match="OTLP traces endpoint"):
        load_router_config(None, {"pods": ["http://127.0.0.1:1"], "otlp_traces_endpoint": bad})
    with pytest.raises(ValueError, match="OTLP traces endpoint"):
        EngineConfig(otlp_traces_endpoint=bad).validate()
    assert main(["router", "--pod", "http://127.0.0.1:1", "--otlp-traces-endpoint", bad]) == 2
    assert "OTLP traces endpoint" in capsys.readouterr().err
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", bad)  # the environment is checked as strictly
    assert main(["router", "--pod", "http://127.0.0.1:1"]) == 2
    assert "OTLP traces endpoint" in capsys.readouterr().err


def test_tracing_off_creates_no_provider_and_loads_no_sdk() -> None:
    """Off by default: the router and engine hold OFF, and the SDK and exporter are never even imported."""
    program = ("import json, os, sys\n"
               "for name in [k for k in os.environ if k.startswith('OTEL_')]: del os.environ[name]\n"
               "from kvmesh.engine.tracing import OFF, ROUTER_SERVICE, setup_tracing\n"
               "import kvmesh.router.app\n"
               "assert setup_tracing(ROUTER_SERVICE, None) is OFF\n"
               "print(json.dumps(sorted(m for m in sys.modules if m.startswith('opentelemetry'))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", program], check=True, capture_output=True,
                                       text=True).stdout)
    assert not [m for m in loaded if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))]
    assert OFF.tracer is None


def test_a_router_built_without_an_endpoint_traces_nothing(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert build_router(RouterConfig(pods=["http://127.0.0.1:1"]), tiny_dir).tracing is OFF
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")  # the standard variable turns it on
    assert build_router(RouterConfig(pods=["http://127.0.0.1:1"]), tiny_dir).tracing.enabled


@pytest.mark.parametrize(("body", "expected"), [
    ({"prompt": "x"}, "whole"),
    ({"prompt": "x", "resume_output_ids": [5, 6]}, "resume"),  # a migrated stream, or a decode pod recomputing
    ({"prompt": "x", "kv_transfer": {"mode": "pull", "source": "http://p", "tokens": 64}}, "pull"),
    ({"prompt": "x", "kv_transfer": {"mode": "prefill"}}, "prefill"),
])
def test_each_call_to_a_pod_names_its_hop(body: dict[str, Any], expected: str) -> None:
    assert hop(body) == expected


# ---- an in-process engine and router, spans in memory ------------------------------------------------------


@dataclass
class Memory:
    engine_spans: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)
    router_spans: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)
    engine: str = ""
    router: str = ""
    router_obj: Router | None = None

    def spans(self) -> list[Any]:
        return list(self.router_spans.get_finished_spans()) + list(self.engine_spans.get_finished_spans())

    def clear(self) -> None:
        self.engine_spans.clear()
        self.router_spans.clear()


@pytest.fixture(scope="module")
def memory(tiny_dir: Path) -> Iterator[Memory]:
    m = Memory()
    engine = make_engine(tiny_dir, kv_cache_blocks=256)
    with serve_checked(engine, setup_tracing(ENGINE_SERVICE, None, exporter=m.engine_spans)) as url:
        router = build_router(RouterConfig(pods=[url], scrape_interval_seconds=0.1), tiny_dir)
        router.tracing = setup_tracing(ROUTER_SERVICE, None, exporter=m.router_spans)
        with serve_router(router) as router_url:
            m.engine, m.router, m.router_obj = url, router_url, router
            yield m


def named(spans: list[Any], name: str) -> list[Any]:
    return [s for s in spans if s.name == name]


def test_one_trace_from_the_client_through_the_router_into_the_engine(memory: Memory) -> None:
    memory.clear()
    body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 5, "temperature": 0.5,
            "seed": 7}
    for _ in range(2):  # the second finds the prompt cached
        reply = httpx.post(memory.router + "/v1/completions", json=body, headers={"traceparent": TRACEPARENT},
                           timeout=60)
        assert reply.status_code == 200, reply.text
    wait_for(lambda: len([s for s in memory.spans() if s.name.startswith("text_completion ")]) == 2,
             "two engine spans")
    spans = memory.spans()
    requests = named(spans, "kvmesh.router.request")
    upstreams = named(spans, "kvmesh.router.upstream")
    engines = [s for s in spans if s.name.startswith("text_completion ")]
    assert len(requests) == len(upstreams) == len(engines) == 2
    assert {format(s.context.trace_id, "032x") for s in spans} == {CLIENT_TRACE}  # the client's trace, continued
    for request, upstream, engine in zip(requests, upstreams, engines, strict=True):
        assert format(request.parent.span_id, "016x") == CLIENT_SPAN
        assert upstream.parent.span_id == request.context.span_id
        assert engine.parent.span_id == upstream.context.span_id  # traceparent went upstream
        a = request.attributes
        assert a["kvmesh.pod"] == memory.engine and a["kvmesh.pods"] == (memory.engine,)
        assert a["kvmesh.outcome"] == "ok" and a["http.response.status_code"] == 200
        assert a["kvmesh.tenant"] == tenant_hash("default") and a["kvmesh.route"] == "aggregated"
        assert a["kvmesh.decision.reason"] and "kvmesh.predicted_cached_tokens" in a
        assert a["gen_ai.usage.output_tokens"] == 5 and a["kvmesh.disaggregated"] is False
        assert upstream.attributes["kvmesh.hop"] == "whole"
        assert upstream.attributes["http.response.status_code"] == 200
        e = engine.attributes
        assert e["gen_ai.request.max_tokens"] == 5 and e["gen_ai.request.temperature"] == 0.5
        assert e["gen_ai.request.seed"] == 7 and e["gen_ai.response.finish_reasons"] == ("length",)
        assert e["gen_ai.usage.input_tokens"] == a["gen_ai.usage.input_tokens"] == a["kvmesh.prompt_tokens"]
        assert e["gen_ai.usage.output_tokens"] == 5 and e["kvmesh.ttft_seconds"] >= e["kvmesh.queue_seconds"] >= 0
        assert e["kvmesh.cached_tokens"] == a["kvmesh.cached_tokens"]
        phases = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == engine.context.span_id}
        assert set(phases) == {"kvmesh.engine.queue", "kvmesh.engine.prefill", "kvmesh.engine.decode"}
        prefill = phases["kvmesh.engine.prefill"].attributes
        assert prefill["kvmesh.computed_tokens"] + prefill["kvmesh.cached_tokens"] == e["gen_ai.usage.input_tokens"]
        assert phases["kvmesh.engine.queue"].end_time <= phases["kvmesh.engine.prefill"].start_time
        assert engine.start_time <= phases["kvmesh.engine.queue"].start_time
        assert [ev.name for ev in engine.events] == ["first_token"]
    assert engines[0].attributes["kvmesh.cached_tokens"] == 0
    assert engines[1].attributes["kvmesh.cached_tokens"] > 0  # the repeated prompt hit the cache
    assert engines[1].attributes["kvmesh.cached_tokens.device"] == engines[1].attributes["kvmesh.cached_tokens"]
    assert requests[1].attributes["kvmesh.predicted_cached_tokens"] > 0
    assert {s.resource.attributes["service.name"] for s in requests} == {ROUTER_SERVICE}
    assert {s.resource.attributes["service.name"] for s in engines} == {ENGINE_SERVICE}


def test_a_request_without_a_traceparent_starts_a_trace_and_a_stream_is_traced_to_its_end(memory: Memory) -> None:
    memory.clear()
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", memory.router + "/v1/chat/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    wait_for(lambda: any(s.name.startswith("chat ") for s in memory.spans()), "the engine's span")
    spans = memory.spans()
    (request,) = named(spans, "kvmesh.router.request")
    (engine,) = [s for s in spans if s.name.startswith("chat ")]
    assert request.parent is None  # a new trace, rooted at the router
    assert engine.context.trace_id == request.context.trace_id
    assert request.attributes["gen_ai.operation.name"] == engine.attributes["gen_ai.operation.name"] == "chat"
    assert request.attributes["gen_ai.usage.output_tokens"] == engine.attributes["gen_ai.usage.output_tokens"] == 4
    assert engine.status.is_ok


def test_a_client_that_does_not_sample_is_served_and_not_traced(memory: Memory) -> None:
    """The sampled flag off in the client's traceparent: the router and the engine follow it (parent-based)."""
    memory.clear()
    reply = httpx.post(memory.router + "/v1/completions", json={"prompt": "hello there", "max_tokens": 2},
                       headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"}, timeout=60)
    assert reply.status_code == 200
    traced = httpx.post(memory.router + "/v1/completions", json={"prompt": "hello there", "max_tokens": 2},
                        timeout=60)  # sent after: its spans come after any the first could have made
    assert traced.status_code == 200
    wait_for(lambda: any(s.name.startswith("text_completion ") for s in memory.spans()), "the second's spans")
    assert all(format(s.context.trace_id, "032x") != CLIENT_TRACE for s in memory.spans())


def test_several_choices_count_their_prompt_once_and_each_has_its_phases(memory: Memory) -> None:
    memory.clear()
    body = {"prompt": "Count to ten: one, two,", "max_tokens": 3, "n": 2, "seed": 1}
    reply = httpx.post(memory.engine + "/v1/completions", json=body, timeout=60)  # the engine alone: no parent
    assert reply.status_code == 200
    usage = reply.json()["usage"]
    (engine,) = [s for s in memory.spans() if s.name.startswith("text_completion ")]
    assert engine.parent is None and engine.attributes["gen_ai.request.choice.count"] == 2
    assert engine.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]  # once, not twice
    assert engine.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    phases = [s for s in memory.spans() if s.parent is not None and s.parent.span_id == engine.context.span_id]
    assert sorted((s.name, s.attributes["kvmesh.choice"]) for s in phases) == [
        (f"kvmesh.engine.{name}", choice) for name in ("decode", "prefill", "queue") for choice in (0, 1)]


def test_a_call_counts_each_prompt_once_with_its_first_choice_s_cached_prefix() -> None:
    usage = call_usage([ChoiceTokens(0, 40, 5, 32, 16, {"host": 16, "disk": 0}),
                        ChoiceTokens(0, 40, 7, 40, 0, {"host": 0, "disk": 0}),  # a later choice: its prompt is counted
                        ChoiceTokens(1, 20, 3, 16, 0, {"host": 0, "disk": 16})])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (60, 15, 48)
    assert usage.peer_tokens == 16 and usage.cached_by_tier == {"host": 16, "disk": 16} and usage.device_tokens == 0


def test_the_span_and_the_http_usage_agree_for_several_choices_of_cached_prompts(memory: Memory) -> None:
    """n choices of two prompts, one of them cached: the span reports the very counts the client's usage says."""
    memory.clear()
    cached = "The span and the usage count a cached prompt once per call, whatever n is. " * 3
    body = {"prompt": cached, "max_tokens": 2, "seed": 4}
    assert httpx.post(memory.engine + "/v1/completions", json=body, timeout=60).status_code == 200
    reply = httpx.post(memory.engine + "/v1/completions", timeout=60,
                       json={**body, "prompt": [cached, "A prompt seen once."], "n": 3})
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    wait_for(lambda: len([s for s in memory.spans() if s.name.startswith("text_completion ")]) == 2, "two spans")
    (span,) = [s for s in memory.spans() if s.name.startswith("text_completion ")
               and s.attributes["gen_ai.request.choice.count"] == 3]
    a, details = span.attributes, usage["prompt_tokens_details"]
    by_source = details["kvmesh_cached_by_source"]
    assert details["cached_tokens"] > 0 and usage["completion_tokens"] == 2 * 3 * 2  # 2 prompts, n=3, 2 tokens
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (usage["prompt_tokens"],
                                                                                usage["completion_tokens"])
    assert a["kvmesh.cached_tokens"] == details["cached_tokens"] == by_source["device"] < usage["prompt_tokens"]
    assert (a["kvmesh.cached_tokens.device"], a["kvmesh.cached_tokens.peer"]) == (by_source["device"],
                                                                                 by_source["peer"])


def test_a_planned_prefix_pull_is_on_the_call_that_asks_for_it() -> None:
    spans = InMemorySpanExporter()
    tracing = setup_tracing(ROUTER_SERVICE, None, exporter=spans)
    info = RequestInfo("m", 300, (1, 2, 3))
    request = request_span(tracing, {}, time.time_ns(), False, info, "acme", "completion-short")
    assert request is not None
    call = request.upstream("http://pod-b:8000/v1/completions", {
        "prompt": "x", "kv_transfer": {"mode": "pull", "source": "http://pod-a:8000", "tokens": 256}})
    assert call.headers({"x-kvmesh-priority": "1"})["traceparent"].split("-")[1] == format(
        request.span.get_span_context().trace_id, "032x")
    call.answered(200)
    call.end()
    request.end("ok", 200, "aggregated", ["pod-b"], None)
    request.end("error", 500, "aggregated", ["pod-b"], None)  # a second end changes nothing
    upstream, router = spans.get_finished_spans()
    assert upstream.attributes["kvmesh.hop"] == "pull" and upstream.attributes["kvmesh.pull.tokens"] == 256
    assert upstream.attributes["kvmesh.pull.source"] == "http://pod-a:8000"
    assert router.attributes["kvmesh.outcome"] == "ok" and router.attributes["kvmesh.tenant"] == tenant_hash("acme")
    assert "acme" not in json.dumps(dict(router.attributes))  # the tenant's name never leaves the router


def test_a_refused_request_is_a_failed_span(memory: Memory) -> None:
    """A model the pool does not serve: 404, and the router's span says so."""
    memory.clear()
    reply = httpx.post(memory.router + "/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 1},
                       timeout=60)
    assert reply.status_code == 404
    (request,) = named(memory.spans(), "kvmesh.router.request")
    assert request.attributes["http.response.status_code"] == 404 and not request.status.is_ok
    assert request.attributes["gen_ai.request.model"] == "nope"


# ---- a real OTLP/HTTP receiver, engine processes, a disaggregated pool --------------------------------------


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP collector on 127.0.0.1: POST /v1/traces, protobuf ExportTraceServiceRequest, spans kept."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ReceiverHandler)
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def received(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.spans)


class _ReceiverHandler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        data = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            data = gzip.decompress(data)
        request = ExportTraceServiceRequest.FromString(data)
        spans = []
        for resource_spans in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    spans.append({"service": service, "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                                  "parent": s.parent_span_id.hex(), "failed": s.status.code == STATUS_ERROR,
                                  "attributes": {a.key: _value(a.value) for a in s.attributes}})
        with self.server.lock:
            self.server.spans.extend(spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


@dataclass
class Pool:
    receiver: Receiver
    engines: list[str]  # their URLs, in the order of their roles
    procs: dict[str, subprocess.Popen[bytes]]
    router: str
    router_obj: Router


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    yield receiver
    receiver.shutdown()


@contextmanager
def traced_pool(tiny_dir: Path, logs: Path, receiver: Receiver, roles: tuple[str, ...]) -> Iterator[Pool]:
    """Engine processes of these roles and an in-process router in front of them, all exporting to `receiver`."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the engines export every 0.1 s, not every 5 s
            for i, role in enumerate(roles):
                url = f"http://127.0.0.1:{free_port()}"
                procs[url] = spawn(["serve", "--model", str(tiny_dir), "--port", url.rsplit(":", 1)[1], "--dtype",
                                    "float32", "--threads", "1", "--kv-cache-memory-mib", "16", "--log-level",
                                    "warning", "--role", role, "--otlp-traces-endpoint", receiver.url],
                                   logs / f"{role}-{i}.log")
            for i, (url, proc) in enumerate(procs.items()):
                wait_healthy(url, proc, log=logs / f"{roles[i]}-{i}.log")
            router = build_router(RouterConfig(pods=list(procs), scrape_interval_seconds=0.1,
                                               prefill_hop_min_tokens=32, otlp_traces_endpoint=receiver.url),
                                  tiny_dir)
        with serve_router(router) as url:
            wait_for(lambda: len(httpx.get(url + "/health").json()["pods"]) == len(roles), "every pod healthy")
            yield Pool(receiver, list(procs), procs, url, router)
    finally:
        stop(procs.values())


@pytest.fixture(scope="module")
def pool(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Iterator[Pool]:
    """A disaggregated pool: a prefill and a decode engine."""
    with traced_pool(tiny_dir, tmp_path_factory.mktemp("tracing"), receiver, ("prefill", "decode")) as pool:
        yield pool


def trace_of(pool: Pool, trace_id: str, engine_spans: int) -> list[dict[str, Any]]:
    """The receiver's spans of one trace, once the engines' `engine_spans` request spans and the router's are in."""
    pool.router_obj.tracing.flush()

    def spans() -> list[dict[str, Any]]:
        return [s for s in pool.receiver.received() if s["trace"] == trace_id]

    wait_for(lambda: len([s for s in spans() if s["service"] == ENGINE_SERVICE
                          and "gen_ai.operation.name" in s["attributes"]]) >= engine_spans
             and any(s["name"] == "kvmesh.router.request" for s in spans()), f"trace {trace_id}")
    return spans()


def children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in spans if s["parent"] == parent["id"]]


@pytest.mark.slow
def test_a_repeated_prompt_exported_over_otlp_shows_its_pod_and_cached_tokens(pool: Pool) -> None:
    body = {"prompt": [(i * 7919) % 48000 + 200 for i in range(20)], "max_tokens": 3}  # under the prefill hop
    decode = pool.engines[1]
    for n in range(2):
        trace_id = f"{n + 1:032x}"
        reply = httpx.post(pool.router + "/v1/completions", json=body, timeout=60,
                           headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"})
        assert reply.status_code == 200 and reply.headers["x-kvmesh-pod"] == decode
        spans = trace_of(pool, trace_id, 1)
        (request,) = [s for s in spans if s["name"] == "kvmesh.router.request"]
        assert request["parent"] == CLIENT_SPAN and request["service"] == ROUTER_SERVICE
        assert request["attributes"]["kvmesh.pod"] == decode
        (upstream,) = children(spans, request)
        (engine,) = children(spans, upstream)
        assert engine["service"] == ENGINE_SERVICE and engine["attributes"]["gen_ai.usage.input_tokens"] == 20
        assert {s["name"] for s in children(spans, engine)} >= {"kvmesh.engine.queue", "kvmesh.engine.prefill"}
    assert engine["attributes"]["kvmesh.cached_tokens"] == 16  # the second time: one full block
    assert request["attributes"]["kvmesh.cached_tokens"] == 16


@pytest.mark.slow
def test_a_disaggregated_request_is_one_trace_over_both_pods(pool: Pool) -> None:
    trace_id = "d" * 32
    prefill, decode = pool.engines
    body = {"prompt": [(i * 104729) % 48000 + 200 for i in range(90)], "max_tokens": 6, "stream": True}
    with httpx.stream("POST", pool.router + "/v1/completions", json=body, timeout=60,
                      headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}) as reply:
        assert reply.headers["x-kvmesh-pod"] == f"{prefill},{decode}"
        assert [line for line in reply.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
    spans = trace_of(pool, trace_id, 2)
    (request,) = [s for s in spans if s["name"] == "kvmesh.router.request"]
    a = request["attributes"]
    assert a["kvmesh.disaggregated"] is True and a["kvmesh.pods"] == [prefill, decode]
    assert a["kvmesh.route"] == "disaggregated" and a["gen_ai.usage.output_tokens"] == 6
    hops = {s["attributes"]["kvmesh.hop"]: s for s in children(spans, request)}
    assert set(hops) == {"prefill", "decode"}
    assert hops["prefill"]["attributes"]["url.full"].startswith(prefill)
    assert hops["decode"]["attributes"]["url.full"].startswith(decode)
    (prefill,) = children(spans, hops["prefill"])
    (decode,) = children(spans, hops["decode"])
    assert prefill["attributes"]["kvmesh.kv_transfer.mode"] == "prefill"
    assert prefill["attributes"]["gen_ai.usage.output_tokens"] == 1
    assert decode["attributes"]["kvmesh.kv_transfer.mode"] == "decode"
    assert decode["attributes"]["gen_ai.usage.output_tokens"] == 6  # the prefill's token counts as generated
    assert decode["attributes"]["kvmesh.cached_tokens.peer"] > 0  # the decode pod pulled the prefill's KV
    assert "kvmesh.engine.kv_pull" in {s["name"] for s in children(spans, decode)}


@pytest.mark.slow
def test_a_stream_moved_off_a_killed_pod_stays_one_trace(tiny_dir: Path, tmp_path: Path, receiver: Receiver) -> None:
    """The serving engine dies mid-stream: the router's span shows the migration, the broken call failed, and the
    engine that continues is a child of the resuming call."""
    with traced_pool(tiny_dir, tmp_path, receiver, ("both", "both")) as pair:
        trace_id = "e" * 32
        body = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
        chunks = 0
        with httpx.stream("POST", pair.router + "/v1/completions", json=body, timeout=60,
                          headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}) as reply:
            serving = reply.headers["x-kvmesh-pod"]
            lines = []
            for line in reply.iter_lines():
                lines += [line] if line.startswith("data: ") else []
                chunks += line.startswith("data: {")
                if chunks == 5:
                    pair.procs[serving].kill()
            assert lines[-1] == "data: [DONE]" and "error" not in "".join(lines)
        (other,) = set(pair.engines) - {serving}
        spans = trace_of(pair, trace_id, 1)  # the killed engine never sent its span
    (request,) = [s for s in spans if s["name"] == "kvmesh.router.request"]
    assert request["attributes"]["kvmesh.route"] == "migrated" and request["attributes"]["kvmesh.pods"] == [serving,
                                                                                                           other]
    assert request["attributes"]["gen_ai.usage.output_tokens"] == 300 and not request["failed"]
    first, resumed = sorted(children(spans, request), key=lambda s: s["attributes"]["kvmesh.hop"] != "whole")
    assert first["attributes"]["url.full"].startswith(serving) and first["failed"]
    assert resumed["attributes"]["kvmesh.hop"] == "resume" and resumed["attributes"]["url.full"].startswith(other)
    (engine,) = children(spans, resumed)
    assert engine["service"] == ENGINE_SERVICE and engine["attributes"]["gen_ai.usage.output_tokens"] == 300


@pytest.mark.slow
def test_an_engine_stopped_by_sigterm_sends_its_last_spans(tiny_dir: Path, tmp_path: Path,
                                                            receiver: Receiver) -> None:
    """As a pod is stopped: the spans waiting for the next export (a minute away here) leave before the process
    does; uvicorn re-raises SIGTERM, so only its shutdown can send them."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
        proc = spawn(["serve", "--model", str(tiny_dir), "--port", url.rsplit(":", 1)[1], "--dtype", "float32",
                      "--threads", "1", "--kv-cache-memory-mib", "16", "--log-level", "warning",
                      "--otlp-traces-endpoint", receiver.url], tmp_path / "engine.log")
    try:
        wait_healthy(url, proc, log=tmp_path / "engine.log")
        trace_id = "f" * 32
        reply = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60,
                           headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"})
        assert reply.status_code == 200
        assert not [s for s in receiver.received() if s["trace"] == trace_id]  # still waiting in the batch
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        stop([proc])
    assert [s for s in receiver.received() if s["trace"] == trace_id and s["service"] == ENGINE_SERVICE]


# ---- a collector that is down -------------------------------------------------------------------------------


@pytest.mark.slow
def test_requests_succeed_when_the_collector_is_down(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens at the endpoint: spans fail to export on the batch thread, requests never notice."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")  # export (and fail) while requests run
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")  # the exit's last flush gives up fast
    closed = f"http://127.0.0.1:{free_port()}/v1/traces"
    engine_tracing = setup_tracing(ENGINE_SERVICE, closed)
    with serve_checked(make_engine(tiny_dir, kv_cache_blocks=128), engine_tracing) as url:
        router = build_router(RouterConfig(pods=[url], otlp_traces_endpoint=closed), tiny_dir)
        assert router.tracing.enabled
        with serve_router(router) as router_url:
            for i in range(4):
                body = {"prompt": f"request {i} " * 5, "max_tokens": 3, "stream": bool(i % 2)}
                reply = httpx.post(router_url + "/v1/completions", json=body, timeout=60)
                assert reply.status_code == 200, reply.text
    for tracing in (engine_tracing, router.tracing):
        tracing.shutdown()
