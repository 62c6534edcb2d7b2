"""The router's spans: one per request, and one per call it makes to a pod (engine/tracing.py sets tracing up).

A request's span opens at admission, continuing the client's trace when it sent a `traceparent`; each pod the
request is committed to adds a decision event (pod, role, reason, predicted cached tokens); each call to a pod is a
client span whose context goes upstream in `traceparent`, so the engine's span is its child; the request's span
ends once, where its request-log row is written, with the outcome and usage. With tracing off none of these objects
exist: the app's hooks test one `None`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvmesh.engine.protocol import KV_TRANSFER_FIELD, RESUME_OUTPUT_IDS_FIELD
from kvmesh.engine.tracing import Tracing
from kvmesh.router.auth import tenant_hash
from kvmesh.router.picker import Decision, RequestInfo
from kvmesh.router.usage import cached_tokens, usage_count

FAILED_OUTCOMES = ("error", "no_pod")  # outcomes that mark the router's span as failed (not shed, not a gone client)


class UpstreamSpan:
    """One call to a pod: from sending the request to the end of its reply (the reply's close)."""

    def __init__(self, tracer: trace.Tracer, parent: Context, url: str, body: Mapping[str, Any]) -> None:
        transfer = body.get(KV_TRANSFER_FIELD) or {}
        attributes: dict[str, Any] = {"url.full": url, "kvmesh.hop": hop(body)}
        if transfer.get("mode") == "pull":  # the planned prefix pull, as the pod was asked
            attributes.update({"kvmesh.pull.source": transfer.get("source", ""),
                               "kvmesh.pull.tokens": transfer.get("tokens", 0)})
        self.span = tracer.start_span("kvmesh.router.upstream", parent, SpanKind.CLIENT, attributes=attributes)

    def headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        """`headers` with this call's `traceparent`."""
        out = dict(headers)
        Tracing.inject(out, trace.set_span_in_context(self.span))
        return out

    def answered(self, status: int) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 400:
            self.span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))

    def failed(self, error: str) -> None:
        self.span.set_status(Status(StatusCode.ERROR, error))
        self.end()

    def end(self) -> None:
        if self.span.is_recording():
            self.span.end()


def hop(body: Mapping[str, Any]) -> str:
    """What a call to a pod is for: a prefill or decode hop, a prefix pull, a resumed stream, or the whole request."""
    mode = (body.get(KV_TRANSFER_FIELD) or {}).get("mode")
    if mode is not None:
        return str(mode)
    return "resume" if body.get(RESUME_OUTPUT_IDS_FIELD) else "whole"


class RequestSpan:
    """The router's span of one request (kind SERVER)."""

    def __init__(self, tracer: trace.Tracer, parent: Context, start_ns: int, attributes: dict[str, Any]) -> None:
        self.tracer = tracer
        self.span = tracer.start_span("kvmesh.router.request", parent, SpanKind.SERVER, start_time=start_ns,
                                      attributes=attributes)
        self.context = trace.set_span_in_context(self.span)

    def decided(self, pod: str, decision: Decision) -> None:
        """The request was committed to `pod` (every attempt: a retry, the decode hop, a migration add one)."""
        role = decision.pod.role if decision.pod is not None else ""
        facts = {"kvmesh.pod": pod, "kvmesh.pod.role": role, "kvmesh.decision.reason": decision.reason,
                 "kvmesh.predicted_cached_tokens": decision.predicted_cached_tokens}
        self.span.add_event("kvmesh.decision", facts)
        self.span.set_attributes(facts)  # the last decision: the pod that answered (the decode pod of a split)

    def upstream(self, url: str, body: Mapping[str, Any]) -> UpstreamSpan:
        return UpstreamSpan(self.tracer, self.context, url, body)

    def end(self, outcome: str, status: int, route: str, pods: list[str], usage: Mapping[str, Any] | None) -> None:
        """Once, where the request ends (the request-log row): a later call changes nothing."""
        if not self.span.is_recording():
            return
        usage = usage or {}
        attributes: dict[str, Any] = {
            "kvmesh.outcome": outcome, "http.response.status_code": status, "kvmesh.route": route,
            "kvmesh.disaggregated": route == "disaggregated", "kvmesh.pods": pods, "kvmesh.attempts": len(pods),
        }
        if usage:
            attributes.update({
                "gen_ai.usage.input_tokens": usage_count(usage, "prompt_tokens"),
                "gen_ai.usage.output_tokens": usage_count(usage, "completion_tokens"),
                "kvmesh.cached_tokens": cached_tokens(usage),
            })
        self.span.set_attributes(attributes)
        if outcome in FAILED_OUTCOMES or status >= 500:
            self.span.set_status(Status(StatusCode.ERROR, f"{outcome} (HTTP {status})"))
        self.span.end()


def request_span(tracing: Tracing, headers: Mapping[str, str], start_ns: int, chat: bool, info: RequestInfo,
                 tenant: str, workload: str) -> RequestSpan | None:
    """The span of a request admitted now (begun at `start_ns`), child of the client's `traceparent` if it sent
    one; None when tracing is off. The tenant appears as its request-log pseudonym, never by name."""
    if tracing.tracer is None:
        return None
    attributes = {"gen_ai.operation.name": "chat" if chat else "text_completion", "gen_ai.request.model": info.model,
                  "kvmesh.tenant": tenant_hash(tenant), "kvmesh.workload": workload, "kvmesh.priority": info.priority,
                  "kvmesh.prompt_tokens": info.prompt_tokens}
    return RequestSpan(tracing.tracer, tracing.extract(headers), start_ns, attributes)
