"""The router as a Gateway API Inference Extension endpoint picker: Envoy's external processing (ext_proc) protocol.

A Gateway (Envoy) opens one `ExternalProcessor.Process` gRPC stream per HTTP request and sends the request's
headers, then its body, and, if it is configured to, the response's headers, body and trailers. The router
reads the whole request body, admits and decides it with the very code of its own HTTP edge (`Router.admit`,
`view`, `decide`, `refuse`, `commit`), and tells the gateway which engine to send it to: the
`x-gateway-destination-endpoint` header and the same value as dynamic metadata under `envoy.lb`: the chosen
`IP:PORT`, then the next best pods' (as many as the router's `retries`), comma-separated, which a gateway set to
retry tries in order. The gateway proxies; the router only picks. When the response names another pod as the one
that served (`x-gateway-destination-endpoint-served`), the request's hold moves to that pod. A subset the gateway
sends (filter metadata `envoy.lb.subset_hint`, key `x-gateway-destination-endpoint-subset`) limits the choice to
those endpoints.

Only what the router's HTTP edge serves to clients passes: POST /v1/completions and /v1/chat/completions, and
GET /v1/models and /v1/models/{model}; anything else (an engine's /v1/admin or /v1/kv endpoints above all) is
answered 404 here, and every stream's API key is checked, whether it is decided on its body or at its headers.

Request body modes (Envoy's `request_body_mode`, which a stream's first message reports in `protocol_config`):
- FULL_DUPLEX_STREAMED, the extension's convention (also assumed when the gateway does not say): Envoy streams
  headers and body chunks without waiting; once the body ends the picker answers with the headers response that
  carries the choice, then the body back in chunks (Envoy forwards only the body the processor returns).
- BUFFERED: Envoy waits for a headers response (an empty one), then sends the body whole; the body response
  carries the choice (Envoy applies header mutations in a body response only in this mode).
- NONE: a completion, which needs its body to be decided, salted and checked, is answered 500 saying which mode
  to configure.
- STREAMED and BUFFERED_PARTIAL let the headers leave before the body is read, so no choice could use the prompt:
  such a stream is answered 500 with a message saying which mode to configure.
GET /v1/models is answered by the picker itself at its headers (an ImmediateResponse 200, in any mode): the
models the pool's pods serve, base models and LoRA adapters, as the router's HTTP edge lists them; no one pod
could answer it, since each lists only the adapters it has loaded. GET /v1/models/{model} (OpenAI's retrieve) is
answered so too: that model's card of the list, or 404 `model_not_found`.
Response bodies are echoed back as streamed responses only when the gateway declares FULL_DUPLEX_STREAMED for
them; otherwise (another mode, or no protocol_config: an Envoy before 1.34) they are let through unchanged.
Refusals are ImmediateResponses with OpenAI-style error bodies: 400 (not a valid request), 401, 404 (unknown
path, or a model or adapter no pod serves: `model_not_found`), 405, 413 (body over MAX_BODY_BYTES), 429 (shed by
priority), 503 (no pod fits, or, while the pool starts from zero, none became ready within the hold). A request
that finds no pod ready at all is held first, as on the HTTP edge (`hold_without_pods_seconds`), so a pool at zero
behind a Gateway starts on its first request.

The port serves TLS unless told otherwise: gateways dial an endpoint picker with TLS and, by the extension's
convention, without verifying its certificate, so a self-signed one made at start will do; a mounted pair
(tls.crt, tls.key) is served instead when given, and re-read when it changes. Plaintext is for gateways set up
for h2c.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.engine.openai_types import error_body
from kvmesh.engine.protocol import GATEWAY_ROUTE, KV_TRANSFER_FIELD, MODEL_PATH_PREFIX, MODELS_PATH
from kvmesh.engine.tracing import Tracing
from kvmesh.router.app import (
    COMPLETION_PATHS,
    Admitted,
    Booking,
    Router,
    Trace,
    View,
    echoes,
    forwarded_headers,
    refusal_outcome,
    wants_usage,
    with_usage,
)
from kvmesh.router.asgi import RouteError, sse_data
from kvmesh.router.batches import CLIENT_SOURCE
from kvmesh.router.config import (
    EXT_PROC_CERT_FILE,
    EXT_PROC_KEY_FILE,
    MAX_REQUEST_BODY_BYTES,
    SHUTDOWN_SETTLE_SECONDS,
    read_certificate_pair,
)
from kvmesh.router.picker import Decision, RequestInfo
from kvmesh.router.usage import cached_tokens, usage_object

log = logging.getLogger("kvmesh.router.extproc")

DESTINATION_NAMESPACE = "envoy.lb"  # where the gateway's load balancer reads the choice
DESTINATION_KEY = "x-gateway-destination-endpoint"  # the header and the metadata key of the choice
SERVED_KEY = "x-gateway-destination-endpoint-served"  # in the response's metadata: the endpoint that answered
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# What the router's HTTP edge serves to clients, and so all a Gateway may send to an engine through the picker:
# path -> method.
CLIENT_ROUTES = {**dict.fromkeys(COMPLETION_PATHS, "POST"), MODELS_PATH: "GET"}
BODY_CHUNK_BYTES = 62_000  # per streamed body message: under the 64 KiB some gateways allow per chunk
MAX_BODY_BYTES = MAX_REQUEST_BODY_BYTES  # a request body the picker holds in memory at most
# The largest gRPC message either way: a BUFFERED body comes (and a rewritten one goes back) whole in one message.
# gRPC's default (4 MiB) would fail such a stream; a margin over the body limit lets a body just over it get its 413.
MAX_MESSAGE_BYTES = MAX_BODY_BYTES + (1 << 20)
MAX_USAGE_BYTES = 4 << 20  # a non-streamed response body is read for its usage up to this size
FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
NO_PICK_MODES = (ProcessingMode.STREAMED, ProcessingMode.BUFFERED_PARTIAL, ProcessingMode.GRPC)
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD  # a client's own destination header never counts


def endpoint_of(url: str) -> str:
    """A pod's base URL as the gateway addresses it: `IP:PORT` (`[IPv6]:PORT`)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_subset(metadata: Mapping[str, Any]) -> set[str] | None:
    """The endpoints the gateway allows (`IP:PORT`, or a bare `IP` for any port), from a request's filter
    metadata; None when it sets no subset (every pod may be chosen). Lists and comma-separated strings both occur."""
    hint = metadata.get(SUBSET_NAMESPACE)
    if not isinstance(hint, dict) or SUBSET_KEY not in hint:
        return None
    value = hint[SUBSET_KEY]
    items = value if isinstance(value, list) else [value]
    return {part.strip() for item in items if isinstance(item, str) for part in item.split(",") if part.strip()}


def in_subset(endpoint: str, subset: set[str]) -> bool:
    return endpoint in subset or endpoint.rsplit(":", 1)[0].strip("[]") in subset


# How an engine's chunk ends when its stream asked for the usage and this is not the last chunk (json.dumps writes
# the key last): the top-level key, since the closing brace is the object's own, found without parsing the chunk
NULL_USAGE_END = ', "usage": null}'


def usage_from_sse(line: str) -> dict[str, Any] | None:
    """The usage object of one `data: {...}` line of a streamed answer, if it carries one."""
    data = sse_data(line)
    if data is None or not data.startswith("{") or '"usage"' not in data or data.endswith(NULL_USAGE_END):
        return None
    try:
        usage = json.loads(data).get("usage")
    except (json.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def without_null_usage(line: str) -> str:
    """A chunk's line for a client that did not ask for the usage, which the router asked for: the `"usage": null`
    it carries taken out (cut from the text when the engine wrote it last; a pod of another make's chunk parsed and
    written again)."""
    if line.endswith(NULL_USAGE_END):
        return line[: -len(NULL_USAGE_END)] + "}"
    data = sse_data(line)
    if data is None or not data.startswith("{") or '"usage"' not in data:
        return line
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        return line
    if not isinstance(chunk, dict) or "usage" not in chunk or chunk["usage"] is not None:
        return line
    del chunk["usage"]
    return "data: " + json.dumps(chunk)


# ---- messages to Envoy -----------------------------------------------------------------------------------------


def _header(key: str, value: str, action: int = base_pb2.HeaderValueOption.APPEND_IF_EXISTS_OR_ADD
            ) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=action)


def _choice_mutation(endpoint: str, extra: Mapping[str, str]) -> pb.CommonResponse:
    headers = {DESTINATION_KEY: endpoint, **extra}
    return pb.CommonResponse(
        clear_route_cache=True,  # the route may depend on the new header
        header_mutation=pb.HeaderMutation(set_headers=[_header(k, v, OVERWRITE) for k, v in headers.items()]))


def _choice_metadata(endpoint: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_KEY: endpoint}})
    return metadata


def _body_chunks(body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """The request body handed back to Envoy in full-duplex mode, in chunks of at most BODY_CHUNK_BYTES."""
    pieces = [body[i:i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
    return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=piece, end_of_stream=end_of_stream and i == len(pieces) - 1)))))
        for i, piece in enumerate(pieces)]


def immediate(error: RouteError, retry_after: int | None = None) -> pb.ProcessingResponse:
    """The gateway answers the client at once with this status and an OpenAI-style error body."""
    body = error_body(error.message, error.kind, error.param, error.code)
    extra = dict(error.headers)  # a rate limit's Retry-After and x-ratelimit-*, as the HTTP edge sends them
    if retry_after is not None:
        extra["retry-after"] = str(retry_after)
    return _immediate_json(error.status, body, f"kvmesh_{error.code or error.status}", extra)


def _immediate_json(status: int, body: Mapping[str, Any], details: str,
                    extra: Mapping[str, str] | None = None) -> pb.ProcessingResponse:
    headers = [_header("content-type", "application/json")]
    headers += [_header(key.lower(), value) for key, value in (extra or {}).items()]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=pb.HeaderMutation(set_headers=headers),
        body=json.dumps(body).encode(), details=details))  # Envoy's response code details: one token, no spaces


class Refused(Exception):
    """A request the picker answers itself (an ImmediateResponse) instead of naming an endpoint. `outcome` is how
    kvmesh_router_requests_total counts it, None when the refusal was counted where it was made (shed, no_pod)."""

    def __init__(self, error: RouteError, retry_after: int | None = None, outcome: str | None = "error") -> None:
        super().__init__(error.message)
        self.status = error.status
        self.reply = immediate(error, retry_after)
        self.outcome = refusal_outcome(error) if outcome == "error" else outcome


class Answered(Refused):
    """A request the picker answers itself with a 200 (GET /v1/models: the pool's list, which no one pod has);
    like the HTTP edge's /v1/models, not counted as a request."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        Exception.__init__(self, "answered by the picker")
        self.status, self.outcome = 200, None
        self.reply = _immediate_json(200, body, "kvmesh_models")


def _mode_refusal(mode: int, why: str) -> Refused:
    name = ProcessingMode.BodySendMode.Name(mode)
    return Refused(RouteError(500, f"the gateway sends the request body to the endpoint picker in {name} mode, {why}; "
                                   "configure FULL_DUPLEX_STREAMED (or BUFFERED)", kind="server_error"))


# ---- one stream ------------------------------------------------------------------------------------------------


@dataclass
class Choice:
    endpoint: str  # the chosen pod's IP:PORT
    body: bytes  # what goes upstream: the client's bytes, or re-encoded (the tenant's salt, a prefix pull)
    booking: Booking | None = None  # an inference request's hold on its pod, which the stream's end gives back
    trace: Trace | None = None
    hide_usage: bool = False  # the router asked the engine for a stream's usage chunk the client did not ask for
    rewritten: bool = False  # `body` is re-encoded, not the client's bytes: the gateway must forward it instead
    fallbacks: tuple[str, ...] = ()  # the next best pods' IP:PORT, which a gateway configured to retry tries in order

    @property
    def destination(self) -> str:
        """The protocol's value: the chosen endpoint, then the fallbacks, comma-separated."""
        return ",".join((self.endpoint, *self.fallbacks))


@dataclass
class Exchange:
    """One HTTP request as the gateway shows it to the picker, phase by phase."""

    router: Router
    headers: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    request_mode: int = FULL_DUPLEX  # the extension's convention, when the gateway does not say
    response_mode: int | None = None  # as the gateway declares it; None: not said, so bodies are not echoed
    choice: Choice | None = None
    status: int | None = None  # the engine's answer, when the gateway sends the response headers
    streaming: bool = False
    tail: str = ""  # an incomplete SSE line of a streamed answer
    answer: bytearray = field(default_factory=bytearray)  # a non-streamed answer, for its usage
    usage: dict[str, Any] | None = None
    done: bool = False  # the response ended (or was answered immediately)

    async def on(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The replies one message from the gateway calls for (possibly none yet: full duplex waits for the body)."""
        if message.HasField("protocol_config"):
            self.request_mode = message.protocol_config.request_body_mode
            self.response_mode = message.protocol_config.response_body_mode
        if message.HasField("metadata_context"):
            self.metadata.update(MessageToDict(message.metadata_context).get("filterMetadata", {}))
        phase = message.WhichOneof("request")
        if phase == "request_headers":
            return await self._request_headers(message.request_headers)
        if phase == "request_body":
            return await self._request_body(message.request_body)
        if phase == "request_trailers":
            replies = [] if self.choice else await self._decide_full_duplex(end_of_stream=False)
            return [*replies, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if phase == "response_headers":
            return [self._response_headers(message.response_headers)]
        if phase == "response_body":
            return [self._response_body(message.response_body)]
        if phase == "response_trailers":
            self.done = True
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    @property
    def path(self) -> str:
        return self.headers.get(":path", "").split("?", 1)[0]

    @property
    def model_id(self) -> str:
        """The model of a GET /v1/models/{model} (percent-decoded, as the HTTP edge reads it); "" for any other path."""
        return unquote(self.path.removeprefix(MODEL_PATH_PREFIX)) if self.path.startswith(MODEL_PATH_PREFIX) else ""

    async def _request_headers(self, headers: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        self.headers = {h.key.lower(): h.raw_value.decode(errors="replace") if h.raw_value else h.value
                        for h in headers.headers.headers}
        if self.request_mode in NO_PICK_MODES:
            raise _mode_refusal(self.request_mode, "where the request leaves before its body is read")
        method = "GET" if self.model_id else CLIENT_ROUTES.get(self.path)
        if method is None:  # exact paths only: no engine endpoint (admin, KV) is reachable through the gateway
            raise Refused(RouteError(404, f"no such endpoint: {self.path}; this pool serves "
                                          f"{', '.join(f'{m} {p}' for p, m in CLIENT_ROUTES.items())}, "
                                          f"GET {MODEL_PATH_PREFIX}{{model}}", code="not_found"))
        if self.headers.get(":method", "").upper() != method:
            raise Refused(RouteError(405, f"{self.path} takes {method}", code="method_not_allowed"))
        try:
            self.router.authenticate(self.headers)  # every stream, also those decided here without a body
        except RouteError as exc:
            raise Refused(exc) from None
        if self.path == MODELS_PATH:
            raise Answered(self.router.models())
        if self.model_id:  # its card of the list, or 404 model_not_found; uncounted, as on the HTTP edge
            try:
                card = self.router.model(self.model_id)
            except RouteError as exc:
                raise Refused(exc, outcome=None) from None
            raise Answered(card)
        if self.request_mode == ProcessingMode.NONE:
            raise _mode_refusal(self.request_mode, "so a completion cannot be read, checked or decided")
        if headers.end_of_stream:
            raise Refused(RouteError(400, f"{self.path} needs a JSON body"))
        if self.request_mode == ProcessingMode.BUFFERED:
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]  # go on: send the body
        return []  # full duplex: the answer to the headers waits for the body

    async def _request_body(self, chunk: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if len(self.body) + len(chunk.body) > MAX_BODY_BYTES:
            raise Refused(RouteError(413, f"the request body exceeds {MAX_BODY_BYTES >> 20} MiB"))
        self.body += chunk.body
        if self.request_mode == ProcessingMode.BUFFERED:  # the whole body, even when trailers follow
            if self.choice is not None:  # decided once: a second decision would admit and book the request again
                raise Refused(RouteError(500, "the gateway sent the request body in more than one message in "
                                              "BUFFERED mode, which sends it whole in one", kind="server_error"))
            self.choice = await self._choose(bytes(self.body))
            common = self._mutation()
            if self.choice.rewritten:
                common.body_mutation.body = self.choice.body
            return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                          dynamic_metadata=_choice_metadata(self.choice.destination))]
        return await self._decide_full_duplex(end_of_stream=True) if chunk.end_of_stream else []

    async def _decide_full_duplex(self, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        """The headers response with the choice, then the body back (Envoy sends upstream only what it gets back)."""
        self.choice = await self._choose(bytes(self.body))
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=self._mutation()),
                                      dynamic_metadata=_choice_metadata(self.choice.destination)),
                *_body_chunks(self.choice.body, end_of_stream)]

    def _mutation(self) -> pb.CommonResponse:
        assert self.choice is not None
        extra = {"content-length": str(len(self.choice.body))} if self.choice.rewritten else {}
        extra.update(self.router.internal_token.headers())  # the engine serves only its pool
        trace = self.choice.trace
        if trace is not None:  # the gateway forwards the client's headers: its priority and class are overwritten
            extra.update(forwarded_headers(trace))  # with admission's (the tenant's ceiling, a derived class)
        if trace is not None and trace.span is not None:  # the engine's span a child of the picker's, as over HTTP
            Tracing.inject(extra, trace.span.context)
        return _choice_mutation(self.choice.destination, extra)

    def _response_headers(self, headers: pb.HttpHeaders) -> pb.ProcessingResponse:
        values = {h.key.lower(): h.raw_value.decode(errors="replace") if h.raw_value else h.value
                  for h in headers.headers.headers}
        self.status = int(values.get(":status", "0") or 0)
        self.streaming = "text/event-stream" in values.get("content-type", "")
        served = self.metadata.get(DESTINATION_NAMESPACE, {}).get(SERVED_KEY)
        if self.choice and served and served != self.choice.endpoint:
            self._moved_to(served)
        self.done = headers.end_of_stream
        lease = self.choice.trace.lease if self.choice and self.choice.trace else None
        if lease is None or not lease.headers:
            return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        # the tenant's x-ratelimit-* as at its admission, on the answer as the HTTP edge sends them
        mutation = pb.HeaderMutation(set_headers=[_header(k, v, OVERWRITE) for k, v in lease.headers.items()])
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=mutation)))

    def _moved_to(self, served: str) -> None:
        """The gateway fell back down the list (the chosen pod failed or refused): the pod that answers holds the
        request now, in the in-flight counts the picker reads and in the request log."""
        choice, router = self.choice, self.router
        assert choice is not None
        log.info("the gateway served %s on %s, not the chosen %s", self.headers.get(":path"), served, choice.endpoint)
        pod = next((p for p in router.pods.pods.values() if endpoint_of(p.url) == served), None)
        if pod is None or choice.booking is None or choice.trace is None:
            return  # not an inference request, or a pod the router no longer knows: nothing of it to move
        choice.booking.withdraw()  # the chosen pod's provisional prefix too: it never took the request
        choice.booking = Booking(pod)
        choice.trace.pods.append(pod.name)
        router.metrics.retries.inc()

    def _response_body(self, chunk: pb.HttpBody) -> pb.ProcessingResponse:
        """Read the answer for its usage and timing (the request log), and hand it on (less the usage the router
        asked for and the client did not)."""
        trace = self.choice.trace if self.choice else None
        out = chunk.body
        if trace is not None and chunk.body:
            if trace.first_chunk_at is None:
                trace.first_chunk_at = time.monotonic()
            if self.streaming:
                lines = (self.tail + chunk.body.decode(errors="replace")).split("\n")
                self.tail = lines.pop()
                kept = []
                hide_usage = self.choice is not None and self.choice.hide_usage
                for line in lines:
                    trace.chunks += (sse_data(line) or "").startswith("{")
                    usage = usage_from_sse(line)
                    self.usage = usage or self.usage
                    if not hide_usage:
                        kept.append(line)
                    elif not usage:
                        kept.append(without_null_usage(line))
                if hide_usage:  # whole lines only; the tail waits
                    out = "".join(line + "\n" for line in kept).encode()
            elif len(self.answer) + len(chunk.body) <= MAX_USAGE_BYTES:
                self.answer += chunk.body
        if chunk.end_of_stream and self.choice is not None and self.choice.hide_usage and self.tail:
            out, self.tail = out + self.tail.encode(), ""
        self.done = chunk.end_of_stream
        if self.response_mode == FULL_DUPLEX:  # Envoy sends on only the body the processor gives back; in any
            # other mode a streamed response would be a protocol error, so undeclared modes are not echoed
            common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=out, end_of_stream=chunk.end_of_stream)))
            return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))
        return pb.ProcessingResponse(response_body=pb.BodyResponse())

    # ---- the decision -------------------------------------------------------------------------------------------

    async def _choose(self, body: bytes) -> Choice:
        """Admit, hold while no pod is ready and decide as the HTTP edge does, and book the request on the chosen
        pod."""
        router = self.router
        try:
            admitted = await router.admit(body, self.headers, COMPLETION_PATHS[self.path])
        except RouteError as exc:
            raise Refused(exc) from None
        admitted.trace.route = GATEWAY_ROUTE
        try:
            await self._hold(admitted.trace)
            return self._book(admitted, body)
        except BaseException:  # not booked (refused, held in vain, the stream gone, or a bug): the tenant's slot
            if admitted.trace.lease is not None:  # back now; a booked request's comes back at its stream's end
                admitted.trace.lease.close()
            raise

    async def _hold(self, trace: Trace) -> None:
        """While no pod is ready at all (a pool at zero, or starting), wait for one as the HTTP edge does, in the
        gauge the operator scales the pool up from zero on; Refused 503 when none was ready in time. A gateway that
        gives up (its client left, or its message timeout passed) cancels the stream, which ends the wait and drops
        it from the gauge at once."""
        wait = self.router.pod_wait
        if wait is None or not wait.should_hold():
            return
        try:
            ready = await wait.wait()
        except asyncio.CancelledError:
            self.router.metrics.count_request("client_gone", trace.route, trace.source)
            self.router.record(trace, "client_gone", 499, None)
            raise
        if not ready:
            self.router.no_pod(trace)  # counted and logged as on the HTTP edge
            raise Refused(wait.timed_out(), outcome=None)

    def _book(self, admitted: Admitted, body: bytes) -> Choice:
        """Decide an admitted request, shed it or book it on the chosen pod."""
        router, trace, raw = self.router, admitted.trace, admitted.raw
        try:
            decision, view = self._decide(trace.info)
        except Refused as refused:
            if refused.status == 503:  # counted and logged as on the HTTP edge
                router.no_pod(trace)
                refused.outcome = None
            else:  # counted where the stream answers it; nothing logs it
                router.refused_unlogged(trace, refused.outcome or "error", refused.status)
            raise
        assert decision.pod is not None
        shed = router.refuse(trace, decision)
        if shed is not None:  # counted and logged by refuse
            raise Refused(shed, outcome=None)
        # Everything that can fail comes before commit: once the pod's in-flight count is taken, finish() gives
        # it back only for a choice this returns.
        pull = None if echoes(raw) else router.plan_pull(decision, trace.info, view)
        if pull is not None:  # as on the HTTP edge: fetching the longer prefix a peer holds beats computing it
            raw[KV_TRANSFER_FIELD] = {"mode": "pull", "source": pull.source.url, "tokens": pull.tokens}
        # the request log needs a stream's usage: ask for it, and take it out of the answer the client did not ask
        # for it in (possible only when the answer's body passes through here: full duplex)
        hide_usage = bool(raw.get("stream")) and not wants_usage(raw) and self.response_mode == FULL_DUPLEX
        if hide_usage:
            raw["stream_options"] = with_usage(raw)
        rewritten = admitted.rewritten or pull is not None or hide_usage
        upstream = json.dumps(raw).encode() if rewritten else body
        pod = router.pods.pods[decision.pod.name]
        booking = router.commit(trace, pod, decision)
        router.metrics.count_decision(decision.reason)
        router.metrics.predicted.inc(decision.predicted_cached_tokens)
        if pull is not None:
            router.metrics.pulls.inc()
        fallbacks = self._fallbacks(decision, view, pull.source.name if pull is not None else None)
        return Choice(endpoint_of(pod.url), upstream, booking, trace, hide_usage, rewritten, fallbacks)

    def _fallbacks(self, decision: Decision, view: View, pull_source: str | None) -> tuple[str, ...]:
        """The next best candidates, as many as the router's own retries, for a gateway set to retry: any of them
        can serve the same body (the tenant's salt and a usage request are pod-neutral), except the source of a
        prefix pull, which would be asked to pull from itself."""
        pods = {p.name: p for p in view.pods}
        names = [n for n in decision.runners_up if n != pull_source and n in pods]
        return tuple(endpoint_of(pods[n].url) for n in names[: self.router.config.retries])


    def _decide(self, info: RequestInfo) -> tuple[Decision, View]:
        """The picker's choice among the pods the gateway's subset allows; Refused (404, 503) when there is none."""
        view = self.router.view(info)
        subset = parse_subset(self.metadata)
        excluded = set() if subset is None else {p.name for p in view.pods if not in_subset(endpoint_of(p.url), subset)}
        try:
            decision = self.router.decide(info, excluded, view=view)
        except RouteError as exc:
            raise Refused(exc) from None
        if decision.pod is None:
            where = "in the gateway's subset " if subset is not None else ""
            raise Refused(RouteError(503, f"no pod {where}can take this request now; retry later", code="no_pod",
                                     kind="server_error"), retry_after=1)
        return decision, view

    def finish(self, cancelled: bool) -> None:
        """The stream ended: give back the pod's in-flight count, count the request and log it."""
        if self.choice is None or self.choice.booking is None or self.choice.trace is None:
            return
        self.choice.booking.close()
        trace, router = self.choice.trace, self.router
        if self.usage is None and self.answer:
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                self.usage = json.loads(self.answer).get("usage")
        self.usage = usage_object(self.usage) or None
        if self.usage:
            router.metrics.actual.inc(cached_tokens(self.usage))
        # A stream cut before the answer ended (the gateway showed its start) is a client gone; without response
        # phases the gateway ends the stream once the request is sent, and the request counts as ok.
        status = self.status or 200
        cut = not self.done and (cancelled or self.status is not None)
        outcome = "client_gone" if cut else "ok" if status == 200 else "error"
        router.metrics.count_request(outcome, trace.route, trace.source)
        router.record(trace, outcome, 499 if outcome == "client_gone" else status, self.usage)


@dataclass
class Streams:
    """The ext_proc streams open now, and whether the picker is draining (its health then says NOT_SERVING)."""

    open: int = 0
    draining: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """Envoy's ExternalProcessor service over one Router."""

    def __init__(self, router: Router, streams: Streams) -> None:
        self.router = router
        self.streams = streams

    async def Process(  # the gRPC method's name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = Exchange(self.router)
        cancelled = True
        self.streams.open += 1
        self.streams.idle.clear()
        try:
            async for message in request_iterator:
                try:
                    replies = await exchange.on(message)
                except Exception as exc:  # a bug must not leave the gateway waiting: it answers 500, the stream ends
                    if not isinstance(exc, Refused):
                        log.exception("ext_proc stream failed")
                        exc = Refused(RouteError(500, "the endpoint picker failed on this request",
                                                 kind="server_error"))
                    if exc.outcome is not None:
                        self.router.metrics.count_request(exc.outcome, GATEWAY_ROUTE, CLIENT_SOURCE)
                    exchange.done = True
                    yield exc.reply
                    break
                for reply in replies:
                    yield reply
            cancelled = False
        finally:  # a gateway that gives up on a request cancels its stream, which may also just end the messages
            exchange.finish(cancelled or context.cancelled())
            self.streams.open -= 1
            if not self.streams.open:
                self.streams.idle.set()


# ---- gRPC health checking (grpc.health.v1), which the protocol asks an endpoint picker to serve ----------------

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
LIVENESS, READINESS = "liveness", "readiness"  # the extension's names; "" is the server as a whole
READY_SERVICES = ("", READINESS, pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name)


class PickerHealth(health.aio.HealthServicer):
    """The gRPC project's health servicer, told whether the picker can pick: `liveness` SERVING while the process
    runs; "", `readiness` and the ext_proc service SERVING while some pod is healthy and not draining, or requests
    are held while none is (the HTTP /health's rule), and the picker is not shutting down, NOT_SERVING otherwise.
    The servicer answers from the statuses it was last told, so each Check is told first, and Watch streams every
    `interval` seconds (the scrape interval: pod health changes only when a scrape reads it), or at once when
    shutdown begins."""

    def __init__(self, router: Router, streams: Streams) -> None:
        super().__init__()
        self.router, self.streams = router, streams
        self.status: int | None = None

    def ready(self) -> bool:
        if self.streams.draining:  # shutting down: the gateway is to send new requests to another replica
            return False
        # as the HTTP /health: a picker that holds requests while no pod is ready serves, since a pool at zero hears
        # of its first request only through it
        return self.router.pod_wait is not None or any(p.healthy and not p.draining
                                                       for p in self.router.pods.snapshot())

    async def refresh(self) -> None:
        status = SERVING if self.ready() else NOT_SERVING
        if status != self.status:
            self.status = status
            for service in READY_SERVICES:
                await self.set(service, status)

    async def follow(self, interval: float) -> None:
        """Keep the statuses current for Watch streams until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(interval)

    async def Check(  # the gRPC method's name
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self.refresh()
        return await super().Check(request, context)


# ---- serving: TLS by default -----------------------------------------------------------------------------------

SELF_SIGNED_DAYS = 365


def self_signed_certificate(names: Sequence[str]) -> tuple[bytes, bytes]:
    """A new EC P-256 key and a certificate it signs itself for `names` (host names or IP addresses), valid a
    year: (key, certificate), PEM. Enough for gateways, which encrypt but do not verify the picker's certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    now = datetime.datetime.now(datetime.UTC)
    sans: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    certificate = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a peer whose clock lags a little still accepts it
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, certificate.public_bytes(serialization.Encoding.PEM)


def local_names(host: str) -> list[str]:
    """What this picker is reached as: localhost, this machine's (the pod's) name, loopback, the bound address."""
    names = ["localhost", socket.gethostname(), "127.0.0.1", "::1"]
    return names if host in ("", "0.0.0.0", "::") else [*names, host]


@dataclass
class MountedCertificate:
    """A certificate pair in a directory, re-read at the first handshake after its files change, so a rotated
    Secret (cert-manager, or kubelet swapping a mounted Secret's files) is served without a restart."""

    cert_dir: str
    stamp: tuple[int, ...] = ()

    def _stamp(self) -> tuple[int, ...]:
        stats = [os.stat(Path(self.cert_dir) / name) for name in (EXT_PROC_CERT_FILE, EXT_PROC_KEY_FILE)]
        return tuple(n for st in stats for n in (st.st_ino, st.st_mtime_ns, st.st_size))

    def credentials(self) -> tuple[grpc.ServerCredentials, bytes]:
        """The server's credentials and the certificate served now."""
        self.stamp = self._stamp()
        key, chain = read_certificate_pair(self.cert_dir)
        return grpc.dynamic_ssl_server_credentials(grpc.ssl_server_certificate_configuration([(key, chain)]),
                                                   self._changed), chain

    def _changed(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC asks at each handshake: a new configuration, or None to keep the current one."""
        try:
            stamp = self._stamp()
            if stamp == self.stamp:
                return None
            self.stamp = stamp  # tried once per change: a half-written pair is read again when it changes again
            key, chain = read_certificate_pair(self.cert_dir)
        except (OSError, ValueError) as exc:
            log.warning("ext_proc keeps its certificate: the one in %s cannot be read (%s)", self.cert_dir, exc)
            return None
        log.info("ext_proc serves the new certificate in %s", self.cert_dir)
        return grpc.ssl_server_certificate_configuration([(key, chain)])


@dataclass
class ExtProcServer:
    """The started ext_proc server, how it serves, and the certificate it served at start (None in plaintext)."""

    server: grpc.aio.Server
    mode: str
    certificate: bytes | None
    streams: Streams
    health: PickerHealth
    follower: asyncio.Task[None]  # keeps the health statuses current for Watch streams

    async def stop(self, drain: float = 0.0, settle: float = SHUTDOWN_SETTLE_SECONDS) -> None:
        """Shut down without cutting requests: health says NOT_SERVING at once; new streams are still served, for
        at least `settle` seconds even with none open (a Gateway sees NOT_SERVING only at its next health check),
        and the streams open get up to `drain` seconds in all to end (the bound on the whole); then the server
        stops."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain
        self.streams.draining = True
        await self.health.refresh()
        await asyncio.sleep(min(settle, drain))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.streams.idle.wait(), max(deadline - loop.time(), 0.0))
        await self.server.stop(None)
        self.follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.follower


async def start_ext_proc(router: Router, host: str, port: int, *, tls: bool,
                         cert_dir: str | None = None) -> ExtProcServer:
    """The ext_proc gRPC server (and gRPC health checking) on host:port, started: TLS with the pair in `cert_dir`,
    or with a self-signed certificate when there is none; plaintext when `tls` is false."""
    if cert_dir is not None and not tls:
        raise ValueError("a certificate directory needs TLS on")
    certificate: bytes | None = None
    if not tls:
        credentials, mode = None, "plaintext gRPC (h2c)"
    elif cert_dir is None:
        key, certificate = self_signed_certificate(local_names(host))
        credentials, mode = grpc.ssl_server_credentials([(key, certificate)]), "TLS, self-signed certificate"
    else:
        credentials, certificate = MountedCertificate(cert_dir).credentials()
        mode = f"TLS, certificate from {cert_dir}"
    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 0),  # a second picker on the port fails, not shares
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ])
    streams = Streams()
    pb_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(router, streams), server)
    picker_health = PickerHealth(router, streams)
    await picker_health.set(LIVENESS, SERVING)
    await picker_health.refresh()
    health_pb2_grpc.add_HealthServicer_to_server(picker_health, server)
    address = f"{host}:{port}"
    try:
        if credentials is None:
            server.add_insecure_port(address)
        else:
            server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpc's "failed to bind", as the error the router's start-up reports
        raise OSError(f"cannot listen for ext_proc on {address} (is the port taken?)") from exc
    await server.start()
    log.info("ext_proc endpoint picker listening on %s (%s)", address, mode)
    follower = asyncio.ensure_future(picker_health.follow(router.config.scrape_interval_seconds))
    return ExtProcServer(server, mode, certificate, streams, picker_health, follower)
