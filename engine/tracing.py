"""Distributed tracing (OpenTelemetry, OTLP over HTTP): the one setup the engine and the router share.

Off unless an endpoint is configured (`--otlp-traces-endpoint`, vLLM's flag; the `otlp_traces_endpoint` config key;
or the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT). Off, a program holds `OFF`, whose
tracer is None: every hook is one `is None` test and the SDK is never imported. On, spans leave through a batch
processor on its own thread, so a slow or absent collector costs requests nothing. The W3C `traceparent` header
carries one trace from a client through the router to every engine it calls.

The engine's span of a request is built when the request ends, at the HTTP edge, from the timestamps the request
already carries (arrival, first scheduled, first and last token): the step loop never touches a span. No torch here:
the router imports this module. How a call's tokens are counted (`call_usage`) lives here too, as the span and the
HTTP answer's usage (engine/server.py) must count alike and both can import it.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, Awaitable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from kvmesh.engine.request import Request

TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"  # the traces URL, used as it is
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"  # a base URL: traces go to its /v1/traces (the OTLP spec's rule)
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"
ENGINE_SERVICE, ROUTER_SERVICE = "kvmesh-engine", "kvmesh-router"
INSTRUMENTATION = "kvmesh"
FINISHED = ("stop", "length")  # finish reasons of a request that ended well (not abort, error, or none yet)
_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent/tracestate only, whatever OTEL_PROPAGATORS says


def check_endpoint(url: str) -> str:
    """`url` if it is an http(s) URL with a host (an OTLP/HTTP collector's traces URL); ValueError otherwise."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError:
        raise ValueError(f"OTLP traces endpoint {url!r} has an invalid port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"OTLP traces endpoint {url!r} is not an http(s) URL with a host, "
                         "e.g. http://otel-collector:4318/v1/traces")
    return url


def resolve_endpoint(configured: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where traces go: the configured endpoint (flag or config file), else the standard environment variables;
    None: tracing is off. ValueError for an endpoint that cannot be used, so a program fails at start."""
    if configured:
        return check_endpoint(configured)
    if environ.get(TRACES_ENDPOINT_ENV):
        return check_endpoint(environ[TRACES_ENDPOINT_ENV])
    if environ.get(ENDPOINT_ENV):
        return check_endpoint(environ[ENDPOINT_ENV].rstrip("/") + "/v1/traces")
    return None


class Tracing:
    """A program's tracer, or none (`OFF`). Holds its own provider rather than the global one, so a router and an
    engine in one process (tests, `kvmesh bench`) report under their own service names."""

    def __init__(self, tracer: trace.Tracer | None = None, provider: Any = None) -> None:
        self.tracer = tracer
        self._provider = provider

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    @staticmethod
    def extract(headers: Mapping[str, str]) -> Context:
        """The caller's trace context from its `traceparent` header (an empty context when it sent none)."""
        return _PROPAGATOR.extract(headers)

    @staticmethod
    def inject(headers: MutableMapping[str, str], context: Context) -> None:
        """Add `traceparent` (and `tracestate`) for a call made within `context`."""
        _PROPAGATOR.inject(headers, context)

    def flush(self, timeout_millis: int = 30000) -> bool:
        return self._provider.force_flush(timeout_millis) if self._provider is not None else True

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


OFF = Tracing()


def setup_tracing(service: str, configured: str | None, exporter: SpanExporter | None = None) -> Tracing:
    """The program's tracing: OFF without an endpoint; else a provider named by OTEL_SERVICE_NAME (or `service`),
    sampled per OTEL_TRACES_SAMPLER (the SDK's default: follow the parent, sample roots), exporting OTLP/HTTP in
    batches. `exporter` replaces the OTLP exporter with a synchronous one (tests). ValueError: a bad endpoint."""
    endpoint = resolve_endpoint(configured)
    if endpoint is None and exporter is None:
        return OFF
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: os.environ.get(SERVICE_NAME_ENV) or service}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # a start error that says what to do, not a traceback deep in the exporter
            raise ValueError(f"the OTLP exporter cannot load ({exc}); xds-protos ships an older copy of "
                             "opentelemetry-proto's files and was installed after it: reinstall it last with `pip "
                             "install --force-reinstall --no-deps opentelemetry-proto==<its version>` (the "
                             "Makefile and the image do)") from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return Tracing(provider.get_tracer(INSTRUMENTATION), provider)


# ---- the engine's span of one HTTP request ---------------------------------------------------------------------


@dataclass
class EngineCall:
    """One traced completion call at the engine's edge: its parent (the router's upstream span, or a client's),
    when it arrived, and what the body asked for. `finish` builds the spans once its requests have ended."""

    tracing: Tracing
    parent: Context
    start_ns: int
    operation: str  # gen_ai.operation.name: chat or text_completion
    request: dict[str, Any]  # gen_ai.request.* attributes (no prompt text)
    pull_ns: tuple[int, int] | None = None  # the KV pull from a peer before the requests were queued

    async def timed_pull(self, pull: Awaitable[None]) -> None:
        """Run the call's KV pull (a decode or pull request's; nothing for others), noting when it ran."""
        start = time.time_ns()
        await pull
        if self.request.get("kvmesh.kv_transfer.mode") in ("decode", "pull"):
            self.pull_ns = (start, time.time_ns())

    async def relay(self, lines: AsyncGenerator[str, None], response_id: str, model: str, requests: Sequence[Request],
                    prompt_of: Sequence[int]) -> AsyncGenerator[str, None]:
        """A stream's lines, passed through; the spans are built when it ends, however it ends."""
        try:
            async for line in lines:
                yield line
        finally:
            await lines.aclose()  # the stream's own ending (aborting what is left) runs first
            self.finish(response_id, model, requests, prompt_of)

    def finish(self, response_id: str, model: str, requests: Sequence[Request], prompt_of: Sequence[int]) -> None:
        """Build and end the call's span and its phases' (requests: the call's engine requests; prompt_of: which
        prompt each answers, as n choices share one)."""
        tracer = self.tracing.tracer
        assert tracer is not None, "an EngineCall exists only with tracing on"
        end_ns = time.time_ns()
        offset = end_ns - time.monotonic_ns()  # the requests' timestamps are monotonic seconds
        span = tracer.start_span(f"{self.operation} {model}", self.parent, SpanKind.SERVER,
                                 attributes=self.request, start_time=self.start_ns)
        span.set_attributes({"gen_ai.response.id": response_id, "gen_ai.response.model": model,
                             **_usage(requests, prompt_of)})
        finish_reasons = [r.finish_reason for r in requests if r.finish_reason]
        if finish_reasons:
            span.set_attribute("gen_ai.response.finish_reasons", finish_reasons)
        unfinished = [r.finish_reason or "unfinished" for r in requests if r.finish_reason not in FINISHED]
        if unfinished or not requests:
            span.set_status(Status(StatusCode.ERROR, ", ".join(unfinished) or "no request"))
        inside = trace.set_span_in_context(span)
        if self.pull_ns is not None:
            tracer.start_span("kvmesh.engine.kv_pull", inside, start_time=self.pull_ns[0],
                              attributes={"kvmesh.peer_tokens": sum(r.peer_tokens for r in requests)}
                              ).end(self.pull_ns[1])
        for index, request in enumerate(requests):
            _phases(tracer, inside, request, index, offset, span)
        span.end(end_ns)


def engine_call(tracing: Tracing, headers: Mapping[str, str], chat: bool, body: Any) -> EngineCall | None:
    """An EngineCall for a completion body arriving now with `headers`; None when tracing is off."""
    if tracing.tracer is None:
        return None
    request: dict[str, Any] = {"gen_ai.operation.name": "chat" if chat else "text_completion",
                               "gen_ai.request.model": body.model or "", "gen_ai.request.choice.count": body.n}
    limit = getattr(body, "max_completion_tokens", None) or body.max_tokens
    for name, value in (("max_tokens", limit), ("temperature", body.temperature), ("top_p", body.top_p),
                        ("seed", body.seed)):
        if value is not None:
            request[f"gen_ai.request.{name}"] = value
    transfer = body.kv_transfer
    if transfer is not None:
        request["kvmesh.kv_transfer.mode"] = transfer.mode
    return EngineCall(tracing, tracing.extract(headers), time.time_ns(), request["gen_ai.operation.name"], request)


@dataclass(frozen=True)
class ChoiceTokens:
    """One choice's token counts (read from its Request, or its final RequestOutput) and the prompt it answers."""

    prompt_index: int
    prompt: int
    completion: int
    cached: int
    peer: int  # of cached, pulled from another pod
    cached_by_tier: Mapping[str, int]  # of cached, promoted from host/disk


@dataclass(frozen=True)
class CallUsage:
    """A call's token counts: each prompt once however many choices answer it (n choices share their prompt and
    its cached prefix), completions summed."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    peer_tokens: int
    cached_by_tier: dict[str, int]

    @property
    def device_tokens(self) -> int:
        """Cached tokens that were on the device already: neither pulled from a peer nor promoted from a tier."""
        return self.cached_tokens - self.peer_tokens - sum(self.cached_by_tier.values())


def call_usage(choices: Sequence[ChoiceTokens]) -> CallUsage:
    """The usage of a call's choices (in choice order): a prompt's counts are its first choice's."""
    prompts: dict[int, ChoiceTokens] = {}
    for choice in choices:
        prompts.setdefault(choice.prompt_index, choice)
    by_tier: dict[str, int] = {}
    for choice in prompts.values():
        for tier, tokens in choice.cached_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + tokens
    return CallUsage(sum(c.prompt for c in prompts.values()), sum(c.completion for c in choices),
                     sum(c.cached for c in prompts.values()), sum(c.peer for c in prompts.values()), by_tier)


def _usage(requests: Sequence[Request], prompt_of: Sequence[int]) -> dict[str, Any]:
    """The span's token counts (call_usage's, from the requests themselves) and the first request's timings."""
    usage = call_usage([ChoiceTokens(p, len(r.prompt_ids), r.num_generated, r.cached_tokens, r.peer_tokens,
                                     r.cached_by_tier) for p, r in zip(prompt_of, requests, strict=True)])
    attributes: dict[str, Any] = {
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
        "kvmesh.cached_tokens": usage.cached_tokens,
        "kvmesh.cached_tokens.peer": usage.peer_tokens,
        "kvmesh.cached_tokens.device": usage.device_tokens,
        "kvmesh.preemptions": sum(r.num_preemptions for r in requests),
    }
    attributes.update({f"kvmesh.cached_tokens.{tier}": tokens for tier, tokens in usage.cached_by_tier.items()})
    if requests:
        attributes["kvmesh.request_id"] = requests[0].request_id
        times = _seconds(requests[0])
        attributes.update({f"kvmesh.{name}_seconds": value for name, value in times.items() if value is not None})
    return attributes


def _seconds(r: Request) -> dict[str, float | None]:
    """Queue, time to first token, prefill and decode of one request, from its own timestamps."""
    scheduled, first, last = r.first_scheduled_time, r.first_token_time, r.last_token_time
    return {
        "queue": None if scheduled is None else scheduled - r.arrival_time,
        "ttft": None if first is None else first - r.arrival_time,
        "prefill": None if scheduled is None or first is None else first - scheduled,
        "decode": None if first is None or last is None else last - first,
    }


def _phases(tracer: trace.Tracer, inside: Context, r: Request, index: int, offset: int, parent: trace.Span) -> None:
    """A request's queue wait, prefill and decode as child spans with the times the engine recorded, and its
    first token as an event on the call's span."""

    def ns(t: float) -> int:
        return int(t * 1e9) + offset

    choice = {"kvmesh.choice": index}
    scheduled, first, last = r.first_scheduled_time, r.first_token_time, r.last_token_time
    if scheduled is None:
        return
    queue = tracer.start_span("kvmesh.engine.queue", inside, start_time=ns(r.arrival_time), attributes=choice)
    queue.end(ns(scheduled))
    if first is None:
        return
    tracer.start_span("kvmesh.engine.prefill", inside, start_time=ns(scheduled), attributes={
        **choice, "kvmesh.prompt_tokens": len(r.prompt_ids), "kvmesh.cached_tokens": r.cached_tokens,
        "kvmesh.computed_tokens": len(r.prompt_ids) - r.cached_tokens}).end(ns(first))
    parent.add_event("first_token", choice, timestamp=ns(first))
    if last is not None and last > first:
        tracer.start_span("kvmesh.engine.decode", inside, start_time=ns(first),
                          attributes={**choice, "kvmesh.output_tokens": r.num_generated}).end(ns(last))
