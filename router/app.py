"""The router's HTTP edge: one OpenAI endpoint for a pool of engines.

Per request: validate the body (the engine's own request types, so errors read the same), derive the tenant
and its cache salt, tokenize exactly as the engines do, hash the blocks (contract 1), ask the picker, and
proxy to the chosen pod, streaming chunks through as they arrive. A pod that answers 429 or 503, or fails
before its first byte, is skipped for the next best one. The choice itself is `picker.pick`, a pure function.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvmesh.engine.body_deadline import BodyDeadline
from kvmesh.engine.constraint import ChecksBusy, parse_off_loop
from kvmesh.engine.internal_token import InternalToken
from kvmesh.engine.model.token_cache import CACHE_SCOPE
from kvmesh.engine.model.tokenizer import Tokenizer
from kvmesh.engine.openai_types import (
    CONTEXT_LENGTH_CODE,
    MAX_SEQUENCES_PER_REQUEST,
    MODEL_NOT_FOUND,
    ChatRequest,
    CompletionRequest,
    checks_a_grammar,
    completion_token_length,
    error_body,
    finish_apart,
    http_error_handler,
    read_json,
    stop_strings,
    validation_param,
    validation_problems,
)
from kvmesh.engine.protocol import (
    CACHE_SALT_FIELD,
    FAIR_SHARE,
    KEYS_RELOAD_OUTCOMES,
    KV_RELEASE_PATH,
    KV_TRANSFER_FIELD,
    LIMIT_REASONS,
    MAX_PRIORITY,
    MIN_PRIORITY,
    MODEL_PATH_PREFIX,
    MODELS_PATH,
    POD_STATES,
    PRIORITY_CLASSES,
    PRIORITY_HEADER,
    RATE_LIMIT_CODE,
    RESUME_OUTPUT_IDS_FIELD,
    RETURN_TOKEN_IDS_FIELD,
    ROUTER_OUTCOMES,
    ROUTES,
    WORKLOAD_HEADER,
    BlockExtra,
    HashAlgo,
    KVConfig,
    RouterMetric,
    block_hashes,
    parse_priority,
    sendable_length,
    workload_class,
)
from kvmesh.engine.tracing import OFF, ROUTER_SERVICE, Tracing, setup_tracing
from kvmesh.router.asgi import (
    OVERLOADED_CODE,
    RouteError,
    error_response,
    read_body,
    sse_data,
    stream_error_ending,
    wait_disconnected,
)
from kvmesh.router.auth import (
    CACHE_SALT_SECRET_ENV,
    DEFAULT_TENANT,
    KEYS_CHECK_SECONDS,
    UNAUTHORIZED,
    ApiKeys,
    KeysFile,
    cache_salt_for,
    tenant_hash,
)
from kvmesh.router.batch_api import BatchMetrics, UploadSlots, batch_routes, tenants_by_pseudonym
from kvmesh.router.batch_runner import Answer, BatchRunner
from kvmesh.router.batch_store import BatchStore
from kvmesh.router.batches import (
    BATCH_SOURCE,
    CHAT_PATH,
    CLIENT_SOURCE,
    COMPLETIONS_PATH,
    MAX_CONCURRENT_UPLOADS,
    REQUEST_SOURCES,
    RESPONSES_PATH,
    new_id,
)
from kvmesh.router.config import (
    INLINE_TOKENIZE_BYTES,
    MAX_REQUEST_BODY_BYTES,
    SHUTDOWN_DRAIN_SECONDS,
    SHUTDOWN_SETTLE_SECONDS,
    RouterConfig,
)
from kvmesh.router.index import PrefixIndex, PrefixMatch
from kvmesh.router.limit_sync import DemandTable, LimitSync
from kvmesh.router.limits import Lease, Limiter, LimitTable, Refusal, parse_tenants, unkeyed_tenants
from kvmesh.router.lora import union_cards
from kvmesh.router.picker import REASONS, Decision, PickerConfig, PodState, RequestInfo, pick
from kvmesh.router.pods import Pod, PodSet
from kvmesh.router.pool_status import (
    POOL_STATUS_PATH,
    POOL_STATUS_REFUSED,
    POOL_STATUS_REFUSED_CODE,
    pod_state,
    pool_status,
)
from kvmesh.router.proxy import Upstream, UpstreamError, UpstreamReply, UpstreamTimeout
from kvmesh.router.pull import PullPlan, PullPolicy, plan_pull
from kvmesh.router.responses_api import STORE_OPERATIONS, Responses, response_routes
from kvmesh.router.responses_store import (
    RESPONSES_MEMORY_ITEMS,
    RESPONSES_TTL_SECONDS,
    MemoryResponses,
    ResponseStore,
    open_store,
)
from kvmesh.router.shed import ShedPolicy, fair_share, priority_label, should_shed
from kvmesh.router.store import DATABASE_COMPONENTS, AsyncRequestLog, RequestLog, RequestRecord
from kvmesh.router.tokenize_api import (
    body_bound,
    checks_busy,
    past_body_bound,
    tokenize_routes,
    unknown_model,
)
from kvmesh.router.tracing import RequestSpan, request_span
from kvmesh.router.usage import cached_tokens, usage_count, usage_object

if TYPE_CHECKING:
    from kvmesh.router.extproc import ExtProcServer

T = TypeVar("T")
COMPLETION_PATHS = {COMPLETIONS_PATH: False, CHAT_PATH: True}  # the routes that take completions -> chat
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
# refusals another pod may not give: busy, draining, or (401) holding another internal token while a new one spreads
RETRYABLE = (401, 429, 503)
SERVING_ROLES = ("both", "decode")  # pods that answer a whole request; prefill pods only take the prefill hop
# Request fields only the router sets (a prefix pull, a resumed stream): a client's would make an engine fetch KV
# from any address it names, or skip tokens. Admission drops them; the router adds its own after deciding.
ROUTER_ONLY_FIELDS = (KV_TRANSFER_FIELD, RESUME_OUTPUT_IDS_FIELD)
# Shutdown, one bound for both edges (SHUTDOWN_DRAIN_SECONDS, which the router pod's grace period is derived from):
# the HTTP port stays open, /health at 503, as long as the picker goes on taking new streams; then it closes and
# the requests open get the rest of the bound.
HTTP_DRAIN_SECONDS = SHUTDOWN_DRAIN_SECONDS - SHUTDOWN_SETTLE_SECONDS
assert HTTP_DRAIN_SECONDS >= 0, "the minimum wait is part of the drain bound"


# A request held until its pool started from zero and then timed out: retry soon, the pool is still starting (the
# retry is held again, for the whole hold).
STARTING_RETRY_AFTER_SECONDS = 5


class PodWait:
    """Requests held while no pod can serve at all (none ready: a pool starting from zero, not one whose pods are
    all busy, which is shedding), for up to `seconds` each and at most `limit` at once. Pods become ready by their
    scrapes: after each, while a request is held, the pod set is looked at and the current `asyncio.Event` set
    when a serving pod is ready; every held request waits on that event with its own timeout, so holding costs no
    loop at all."""

    def __init__(self, pods: PodSet, seconds: float, limit: int) -> None:
        self.pods, self.seconds, self.limit = pods, seconds, limit
        self.held = 0  # kvmesh_router_requests_waiting_for_pods
        self.draining = False  # the router stops: nothing is held any more (`stop`)
        self._ready = asyncio.Event()
        pods.scrape_listeners.append(self._pod_scraped)

    def ready(self) -> bool:
        """Whether a pod that serves whole requests is up with a usable configuration and not draining."""
        return any(p.healthy and p.refused is None and not p.draining and p.kv_config is not None
                   and p.kv_config.role in SERVING_ROLES for p in self.pods.pods.values())

    def should_hold(self) -> bool:
        """Whether a request arriving now waits: no pod is ready, and there is room."""
        return self.held < self.limit and not self.draining and not self.ready()

    def stop(self) -> None:
        """The router begins draining: every held request wakes at once (answered `stopping`), instead of waiting
        out its hold past the router's drain bound, to be cut by the server's shutdown with a plain-text 500."""
        self.draining = True
        self._ready.set()

    async def wait(self) -> bool:
        """Hold one request until a pod is ready (True) or `seconds` pass or the router drains (False). Cancelling
        it (the client left) drops it from the count."""
        if self.draining:
            return False
        self.held += 1
        try:
            try:
                await asyncio.wait_for(self._ready.wait(), self.seconds)
            except TimeoutError:
                return self.ready()
            return True
        finally:
            self.held -= 1

    def timed_out(self) -> RouteError:
        """The answer to a request held the whole hold with no pod ready, on both edges: 503, retry in a while (the
        retry is held again while the pool goes on starting)."""
        return RouteError(503, f"the pool is starting from zero and no engine was ready within {self.seconds:g} s; "
                               "retry later", code="no_pod", kind="server_error",
                          headers={"retry-after": str(STARTING_RETRY_AFTER_SECONDS)})

    def stopping(self) -> RouteError:
        """The answer to a request held when the router began draining: 503, retry (another router, or this pool
        once it runs again)."""
        return RouteError(503, "the router is shutting down and no engine is ready; retry later", code="no_pod",
                          kind="server_error", headers={"retry-after": str(STARTING_RETRY_AFTER_SECONDS)})

    def _pod_scraped(self) -> None:
        if self.held and self.ready():
            self._ready.set()  # wakes every request held now; later ones find the pod ready or wait anew
            self._ready = asyncio.Event()


class RouterMetrics:
    def __init__(self, pods: PodSet, index: PrefixIndex, tenants: Iterable[str] = (DEFAULT_TENANT,),
                 held: Callable[[], int] = lambda: 0) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(RouterMetric.REQUESTS, "Requests by outcome, route and source.",
                                ["outcome", "route", "source"], registry=r)
        self.decision = Histogram(RouterMetric.DECISION_SECONDS, "Tokenize, hash and pick.",
                                  buckets=DECISION_BUCKETS, registry=r)
        self.predicted = Counter(RouterMetric.PREDICTED_CACHED_TOKENS, "Cached tokens the router predicted.",
                                 registry=r)
        self.actual = Counter(RouterMetric.ACTUAL_CACHED_TOKENS, "Cached tokens the engines reported.", registry=r)
        self.retries = Counter(RouterMetric.RETRIES, "Requests sent to another pod after a refusal.", registry=r)
        self.migrations = Counter(RouterMetric.MIGRATIONS, "Streams continued on another pod.", registry=r)
        self.pulls = Counter(RouterMetric.PULLS, "Requests sent with a prefix pull from a peer.", registry=r)
        self.shed = Counter(RouterMetric.SHED, "Requests refused with 429 under overload, by priority and source "
                            "(batch: deferred and retried by the batch runner).", ["priority", "source"], registry=r)
        for priority in PRIORITY_CLASSES:
            for source in REQUEST_SOURCES:
                self.shed.labels(priority, source)
        self.rate_limited = Counter(RouterMetric.RATE_LIMITED, "Requests refused with 429 by their tenant's limits "
                                    "or fair share.", ["tenant", "reason"], registry=r)
        self.api_keys_reloads = Counter(RouterMetric.API_KEYS_RELOADS, "Changes of the API keys file, taken "
                                        "(loaded) or refused (the keys in force stay).", ["outcome"], registry=r)
        for outcome in KEYS_RELOAD_OUTCOMES:
            self.api_keys_reloads.labels(outcome)
        self.batches = BatchMetrics(r)
        self.response_store_errors = Counter(RouterMetric.RESPONSE_STORE_ERRORS, "Reads and writes of stored "
                                             "responses (the Responses API) that failed.", ["operation"], registry=r)
        for operation in STORE_OPERATIONS:
            self.response_store_errors.labels(operation)
        self.database_errors = Counter(RouterMetric.DATABASE_ERRORS, "Operations on the pool's database that failed, "
                                       "by what used it.", ["component"], registry=r)
        for component in DATABASE_COMPONENTS:  # at 0 from the start: alerts see a first failure as an increase
            self.database_errors.labels(component)
        self.request_log_dropped = Counter(RouterMetric.REQUEST_LOG_DROPPED, "Request log records never written "
                                           "(a failed write, or a full buffer).", registry=r)
        self._tenant_series: set[str] = set()  # the pseudonyms with rate_limited series (`set_tenants` prunes them)
        self.set_tenants(tenants)
        index_blocks = Gauge(RouterMetric.INDEX_BLOCKS, "Distinct block hashes in the prefix index.", registry=r)
        index_blocks.set_function(index.size)
        self.decisions = Counter(RouterMetric.DECISIONS, "Routing decisions by what decided them.", ["reason"],
                                 registry=r)
        # the series every request counts in, made here and kept: looking a child up costs more than its count
        self._decided = {reason: self.decisions.labels(reason) for reason in REASONS}
        r.register(_EventLag(pods, index))
        waiting = Gauge(RouterMetric.REQUESTS_WAITING_FOR_PODS, "Requests held while no pod is ready (a pool "
                        "starting from zero).", registry=r)
        waiting.set_function(held)
        pod_states = Gauge(RouterMetric.PODS, "Pods by state.", ["state"], registry=r)
        for state in POD_STATES:
            pod_states.labels(state).set_function(lambda s=state: _count_pods(pods, s))
        self._ended = {(outcome, route, source): self.requests.labels(outcome, route, source)
                       for outcome in ROUTER_OUTCOMES for route in ROUTES for source in REQUEST_SOURCES}

    def database_failed(self, component: str) -> Callable[[], None]:
        """What `component` (DATABASE_COMPONENTS) calls at each failed operation on the pool's database."""
        return self.database_errors.labels(component).inc

    def count_request(self, outcome: str, route: str, source: str) -> None:
        """One request ended (kvmesh_router_requests_total), by outcome (ROUTER_OUTCOMES), route (ROUTES) and
        source (REQUEST_SOURCES)."""
        (self._ended.get((outcome, route, source)) or self.requests.labels(outcome, route, source)).inc()

    def count_decision(self, reason: str) -> None:
        """One routing decision sent (kvmesh_router_decisions_total), by what decided it (REASONS)."""
        (self._decided.get(reason) or self.decisions.labels(reason)).inc()

    def set_tenants(self, tenants: Iterable[str]) -> None:
        """Every tenant's 429 series at 0 from the start (also those a rotated keys file adds), by pseudonym, as
        in the request log: tenant names may be secret. The series of a tenant no longer keyed go: a router whose
        keys rotate for months must not export every tenant it ever had."""
        live = {tenant_hash(tenant) for tenant in tenants}
        for gone in self._tenant_series - live:
            for reason in LIMIT_REASONS:  # one counted back after its key went has only that reason's series
                with contextlib.suppress(KeyError):  # (prometheus-client before 0.22 raises for a missing one)
                    self.rate_limited.remove(gone, reason)
        for pseudonym in live - self._tenant_series:
            for reason in LIMIT_REASONS:
                self.rate_limited.labels(pseudonym, reason)
        self._tenant_series = live

    def count_rate_limited(self, tenant: str, reason: str) -> None:
        """One 429 of `tenant`'s limits or fair share, by reason (LIMIT_REASONS); a tenant whose key went while its
        requests were in flight gets its series back until the next keys reload removes it."""
        pseudonym = tenant_hash(tenant)
        self._tenant_series.add(pseudonym)
        self.rate_limited.labels(pseudonym, reason).inc()


class _EventLag:
    """Per pod: KV event batches the pod has published (its last scrape) that the index has not applied yet.
    A lag that keeps growing means the router routes on a stale picture of that pod's cache."""

    def __init__(self, pods: PodSet, index: PrefixIndex) -> None:
        self._pods, self._index = pods, index

    def collect(self) -> Iterator[GaugeMetricFamily]:
        lag = GaugeMetricFamily(RouterMetric.EVENT_LAG, "KV event batches not yet applied, per engine.",
                                labels=["engine"])
        for pod in self._pods.pods.values():
            published = pod.metrics.get("events_seq")
            if published is not None:
                lag.add_metric([pod.name], max(published - self._index.resume_point(pod.name)[1], 0))
        yield lag


def _count_pods(pods: PodSet, state: str) -> int:
    return sum(1 for pod in pods.pods.values() if pod_state(pod) == state)


@dataclass
class Trace:
    """What the router learns about one request on its way, for the request log."""

    info: RequestInfo
    tenant: str
    workload: str
    start: float = field(default_factory=time.monotonic)
    route: str = "aggregated"
    pods: list[str] = field(default_factory=list)
    predicted: int = 0
    first_chunk_at: float | None = None
    chunks: int = 0
    lease: Lease | None = None  # the request's hold on its tenant's limits, closed when it ends (each edge's)
    span: RequestSpan | None = None  # tracing on: the request's span (router/tracing.py)
    source: str = CLIENT_SOURCE  # REQUEST_SOURCES: a client's request, or the batch runner's
    charged_prompt_tokens: int = 0  # every prompt's tokens, charged at admission (info.prompt_tokens: the first's)


def text_offset_after(logprobs: Any) -> int | None:
    """Where the text of the token after a completion's `logprobs` starts (its last text_offset plus its last
    token's length); None for chat's logprobs or none at all."""
    if not isinstance(logprobs, dict) or not logprobs.get("text_offset") or not logprobs.get("tokens"):
        return None
    return int(logprobs["text_offset"][-1]) + completion_token_length(logprobs["tokens"][-1])


def merge_logprobs(first: Any, rest: Any) -> Any:
    """A split request's logprobs: the prefill pod's first token, then the decode pod's (whose text_offset starts
    at 0 with its own tokens: moved on after the first's). Chat's `content` lists are joined."""
    if not first:
        return rest
    if not rest:
        return first
    if "content" in first:
        return {**rest, "content": [*(first.get("content") or []), *(rest.get("content") or [])]}
    shift = text_offset_after(first) or 0
    return {"tokens": [*first["tokens"], *rest["tokens"]],
            "token_logprobs": [*first["token_logprobs"], *rest["token_logprobs"]],
            "top_logprobs": [*first["top_logprobs"], *rest["top_logprobs"]],
            "text_offset": [*first["text_offset"], *(o + shift for o in rest["text_offset"])]}


def merge_usage(prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """A disaggregated request's usage: prompt and cached tokens from the prefill pod (what it did not compute),
    completion tokens from the decode pod (which counts the prefill's first token as generated)."""
    completion = usage_count(decode, "completion_tokens")
    total = usage_count(prefill, "prompt_tokens") + completion
    return {**prefill, "completion_tokens": completion, "total_tokens": total}


class Booking:
    """One request's hold on a pod: the pod's in-flight count, taken when the request is committed to it, and the
    pod's reply once it comes. `close` gives both back exactly once, whichever way the request ends (answered,
    refused, the pod failing, the client leaving, the stream moving on to another pod), so the picker never counts
    a request that is over; `with booking:` closes it when the block ends. Until the pod's next report it also
    counts in what that report lacks (`Pod.unseen`): the request and its `prefill_tokens` uncached prompt tokens.
    `withdraw`, for a try the pod refused or failed before taking, also takes back the provisional index entries
    `provisional` names (the pod, its hashes and their expiry), which no computed block will ever confirm."""

    def __init__(self, pod: Pod, prefill_tokens: int = 0,
                 provisional: tuple[PrefixIndex, tuple[int, ...], float] | None = None) -> None:
        self.pod = pod
        self.reply: UpstreamReply | None = None
        self.closed = False
        self.prefill_tokens = prefill_tokens
        self.provisional = provisional
        self.epoch = pod.unseen.sent(prefill_tokens)
        pod.inflight += 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.reply is not None:
            self.reply.close()
        self.pod.inflight -= 1
        self.pod.unseen.ended(self.epoch, self.prefill_tokens)

    def withdraw(self) -> None:
        """The pod did not take the request (refused, failed before its first byte): close, and drop the
        provisional entries its commit recorded."""
        self.close()
        if self.provisional is not None:
            index, hashes, expires = self.provisional
            index.drop_provisional(self.pod.name, hashes, expires)
            self.provisional = None

    def __enter__(self) -> Booking:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@dataclass
class Relay:
    """A stream's progress as the router relays it: the pod serving it now and what the client has received, so
    another pod can go on."""

    booking: Booking  # the serving pod and its reply, being relayed (another pod's after a migration)
    upstream: dict[str, Any]
    path: str
    headers: dict[str, str]
    tried: set[str]
    strip_ids: bool  # the client did not ask for token ids: the router asked for them, so it removes them
    migratable: bool
    sent_ids: list[int] = field(default_factory=list)  # output tokens the client has, in this request
    # a completion's logprobs.text_offset counts from the stream's start: a pod that goes on (a decode pod after the
    # prefill's first token, another after a migration) counts from its own first token, so the relay adds the
    # offset the client's text had reached (`text_offset_next`, from the chunks relayed) when that pod took over
    text_offset_base: int = 0
    text_offset_next: int = 0
    stream_id: str | None = None
    # the first answer's `created` and `model`: every chunk carries them, whichever pod sent it (clients that
    # accumulate a stream, such as the openai client's, read them from any chunk)
    stream_created: int | None = None
    stream_model: str | None = None
    chat: bool = False
    strip_role: bool = False  # the client already has the assistant role (a prefill hop or another pod sent it)
    role_sent: bool = False
    prefill_usage: dict[str, Any] | None = None  # after a prefill hop: the prompt side of the usage comes from it
    client_usage: bool = True  # the client asked for the usage chunk (the router always does, for its log)
    choices: int = 1  # the answer's choices (n, times the prompts of a list): it is whole once each has finished
    finished_choices: set[int] = field(default_factory=set)  # indexes of the choices that carried a finish_reason
    failed: bool = False  # the pod ended the stream with an error event
    done: bool = False  # [DONE] arrived
    started: bool = False  # the relay began (one that never did is counted by its RelayResponse)

    def on_chunk(self, chunk: dict[str, Any], trace: Trace) -> dict[str, Any]:
        """Record what a chunk delivers and make it look like one stream: first id, created and model, no second
        role."""
        if "error" in chunk:
            self.failed = True
            return chunk
        trace.chunks += 1
        if trace.first_chunk_at is None:
            trace.first_chunk_at = time.monotonic()
        self.stream_id = self.stream_id or chunk.get("id")
        self.stream_created = self.stream_created or chunk.get("created")
        self.stream_model = self.stream_model or chunk.get("model")
        chunk.update(id=self.stream_id, created=self.stream_created, model=self.stream_model)
        self.chat = chunk.get("object") == "chat.completion.chunk"
        for choice in chunk.get("choices", []):
            ids = choice.pop("token_ids", []) if self.strip_ids else choice.get("token_ids", [])
            self.sent_ids.extend(ids)
            delta = choice.get("delta")
            if delta is not None:
                if self.strip_role:
                    delta.pop("role", None)
                self.role_sent = self.role_sent or "role" in delta
            if choice.get("finish_reason"):
                self.finished_choices.add(choice.get("index", 0))
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and logprobs.get("text_offset"):
                logprobs["text_offset"] = [o + self.text_offset_base for o in logprobs["text_offset"]]
                self.text_offset_next = text_offset_after(logprobs) or self.text_offset_next
        if chunk.get("usage") and self.prefill_usage:
            chunk["usage"] = merge_usage(self.prefill_usage, chunk["usage"])
        if self.client_usage:  # OpenAI's: the key on every chunk, null until the last, whichever pod sent it
            chunk.setdefault("usage", None)
        elif not chunk.get("usage"):  # the null of the usage the router asked for, not the client
            chunk.pop("usage", None)
        return chunk

    @property
    def finished(self) -> bool:
        """Every choice finished: the answer is whole, whatever of the stream's tail was lost."""
        return len(self.finished_choices) >= self.choices

    def resume_ids(self) -> list[int]:
        return list(self.upstream.get(RESUME_OUTPUT_IDS_FIELD) or []) + self.sent_ids

    def text_chunk(self, text: str) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": None}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        chunk = {"id": self.stream_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.stream_created, "model": self.stream_model, "choices": [choice]}
        if self.client_usage:
            chunk["usage"] = None
        return chunk


class RelayResponse(StreamingResponse):
    """A relayed stream that gives its pod back however it ends. Starlette leaves a body it stopped early (the
    client left) to the garbage collector, and never starts one whose client left before the first chunk: that
    one is counted and logged here (`unstarted`), as the relay's own ending would have."""

    def __init__(self, lines: AsyncGenerator[str, None], state: Relay, headers: Mapping[str, str],
                 unstarted: Callable[[], None]) -> None:
        super().__init__(lines, media_type="text/event-stream", headers=headers)
        self.lines, self.state, self.unstarted = lines, state, unstarted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.lines.aclose()  # the relay's own ending (its pod, the count, the log) runs now
            self.state.booking.close()  # for a relay that never started
            if not self.state.started:
                self.unstarted()


@dataclass(frozen=True)
class Admitted:
    """A request that passed admission: the body as it goes upstream (with the tenant's salt), and its trace."""

    raw: dict[str, Any]
    body: ChatRequest | CompletionRequest
    trace: Trace
    rewritten: bool  # raw differs from the client's body (a salt set, a router-only field dropped)


@dataclass
class BodyWork:
    """An admitted request's parsing and tokenizing, done in a body thread (`parse_off_loop`) past
    INLINE_TOKENIZE_BYTES or when it holds a grammar, under its tenant's
    concurrency slot. A thread cannot be stopped: a request cancelled while one works on its body (a gateway's stream
    gone, a batch stopped) gives its slot back when the thread is done, so aborting requests never has more of a
    tenant's bodies worked on at once than its limit allows."""

    lease: Lease
    running: asyncio.Future[Any] | None = None  # the last thread's work

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)` in a thread, which a cancelled caller leaves running."""
        self.running = asyncio.ensure_future(parse_off_loop(call, *args))
        return await asyncio.shield(self.running)

    def close(self) -> None:
        """The slot back now, or when the thread still working ends."""
        if self.running is None or self.running.done():
            self.lease.close()
        else:
            self.running.add_done_callback(self._ended)

    def _ended(self, work: asyncio.Future[Any]) -> None:
        if not work.cancelled():
            work.exception()  # retrieved: its request is gone, nobody reads what it raised
        self.lease.close()


@dataclass(frozen=True)
class View:
    """What the router knows of its pods at one moment, and how much of one request's prefix each holds."""

    pods: list[PodState]
    matches: Mapping[str, PrefixMatch]


@dataclass
class Router:
    """The router's state: configuration, tokenizer, pods, index, metrics. Built once per process."""

    config: RouterConfig
    tokenizer: Tokenizer
    pods: PodSet
    index: PrefixIndex
    picker: PickerConfig
    metrics: RouterMetrics
    upstream: Upstream
    keys: ApiKeys
    log: AsyncRequestLog | None
    shed: ShedPolicy
    salt_secret: str
    pull: PullPolicy
    tracing: Tracing = OFF
    limits: Limiter = field(default_factory=Limiter)
    keys_file: KeysFile | None = None  # where `keys` come from, re-read when it changes (a rotated Secret)
    batches: BatchStore | None = None  # the Batch API's files and batches (in the request log's database)
    limit_sync: LimitSync | None = None  # tenants' limits split with the other replicas by demand (the same database)
    responses: ResponseStore = field(  # the Responses API's stored responses (the same database, or memory)
        default_factory=lambda: MemoryResponses(RESPONSES_MEMORY_ITEMS, RESPONSES_TTL_SECONDS))
    pod_wait: PodWait | None = None  # requests held while no pod is ready (hold_without_pods_seconds); None: none are
    # the models the pool served when a pod last was healthy: a pool at zero (holding requests) still lists them, so a
    # gateway in front keeps sending their requests here, where the first one wakes the pool
    served_before: list[dict[str, Any]] = field(default_factory=list)
    # the pool's internal token: sent by the proxy and the scrapes, and set by the ext_proc picker on what a Gateway
    # forwards to an engine (none: engines ask for none)
    internal_token: InternalToken = field(default_factory=lambda: InternalToken(None))
    # the uploads this replica reads at once (batch_max_concurrent_uploads), shared fairly by the tenants
    uploads: UploadSlots = field(default_factory=lambda: UploadSlots(MAX_CONCURRENT_UPLOADS))

    def tenants(self) -> Iterable[str]:
        """The tenants that have a key now (the one default tenant with auth off)."""
        return self.keys.tenants

    def record(self, trace: Trace, outcome: str, status: int, usage: dict[str, Any] | None) -> None:
        """The tenant's concurrency slot back, first: a bug below, or a pod's odd usage, must not keep it (a relayed
        stream's and a gateway's request have no other close); the end of the request's span; one row of the
        request log (numbers only), when the pool has one."""
        usage = usage_object(usage)
        if trace.lease is not None:  # charged: the tokens spent beyond those at admission: the output (or the chunks
            # relayed of a stream cut before its usage), and any prompt tokens the engine counted beyond the router's
            trace.lease.close(usage_count(usage, "completion_tokens", trace.chunks)
                              + max(usage_count(usage, "prompt_tokens") - trace.charged_prompt_tokens, 0))
        if trace.span is not None:
            trace.span.end(outcome, status, trace.route, trace.pods, usage)
        if self.log is None:
            return
        now = time.monotonic()
        itl = None
        if trace.first_chunk_at is not None and trace.chunks > 1:
            itl = (now - trace.first_chunk_at) / (trace.chunks - 1)
        self.log.submit(RequestRecord(
            pool=self.config.pool,
            tenant=tenant_hash(trace.tenant),
            workload=trace.workload,
            route=trace.route,
            outcome=outcome,
            status_code=status,
            priority=trace.info.priority,
            prompt_tokens=usage_count(usage, "prompt_tokens", trace.info.prompt_tokens),
            cached_tokens=cached_tokens(usage),
            predicted_cached_tokens=trace.predicted,
            output_tokens=usage_count(usage, "completion_tokens"),
            ttft_seconds=None if trace.first_chunk_at is None else trace.first_chunk_at - trace.start,
            mean_itl_seconds=itl,
            e2e_seconds=now - trace.start,
            pods=",".join(trace.pods),
            retries=max(len(trace.pods) - 1, 0),
            model=trace.info.model,
        ))

    def _token_ids(self, body: ChatRequest | CompletionRequest) -> list[int]:
        """The ids of the (first) prompt as the engines compute it, so its block hashes are theirs: without the BOS
        for `add_special_tokens: false`, and only its last `truncate_prompt_tokens` (-1, "as many as the context
        holds", keeps all here: the router does not know the pods' context, and a prompt longer than it is refused)."""
        return body.truncated(self._prompt_ids(body), sys.maxsize)

    def _prompt_ids(self, body: ChatRequest | CompletionRequest) -> list[int]:
        if isinstance(body, ChatRequest):
            try:  # as the engine builds it: the same prompt, the same block hashes
                return body.prompt_ids(self.tokenizer)
            except ValueError as exc:
                raise RouteError(400, f"messages: {exc}", param="messages") from None
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens)
        # Token ids from the client (several prompts: route by the first): the only ids that need checking.
        ids = list(prompt[0]) if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else list(prompt)
        vocab = self.tokenizer.vocab_size
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise RouteError(400, f"prompt token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}",
                             param="prompt")
        return ids

    async def admit(self, payload: bytes, headers: Mapping[str, str], chat: bool,
                    tenant: str | None = None, batch: bool = False, lease: Lease | None = None) -> Admitted:
        """Authenticate, validate, salt, tokenize and hash one request, the same whichever edge received it (this
        HTTP app, or a Gateway's ext_proc stream): RouteError (401, 400, 429) when it cannot be served. The key
        comes first, then the tenant's limits (a request and a concurrency slot, held from here on: parsing and
        tokenizing a body costs, and is for clients who may send), then a bound on the body's size.
        A request from inside the router comes with its `tenant`, whose key was checked already (a batch's when
        the batch was created), or with the `lease` its tenant's limits were opened with already (a Responses API
        request's, before its history was read); a `batch` request takes the tenant's batch limits."""
        arrived_ns = time.time_ns()
        if lease is None:
            tenant = tenant if tenant is not None else self.authenticate(headers)
            lease = self.open(tenant, batch)
        work = BodyWork(lease)
        try:
            return await self._admitted(payload, headers, chat, work, batch, arrived_ns)
        except BaseException:  # refused (or cancelled) after opening: the slot back, the request stays charged
            work.close()
            raise

    def open(self, tenant: str, batch: bool = False) -> Lease:
        """The tenant's limits opened for a request about to be read (Limiter.open): RouteError 429 over them."""
        lease = (self.limits.batch if batch else self.limits).open(tenant)
        if isinstance(lease, Refusal):
            raise self.rate_limited(tenant, lease)
        return lease

    async def _admitted(self, payload: bytes, headers: Mapping[str, str], chat: bool, work: BodyWork, batch: bool,
                        arrived_ns: int) -> Admitted:
        """`admit`'s work on the body once the tenant's limits are opened (`work.lease`): RouteError 400 past the
        body bound (a prompt no context could hold is never tokenized: an 18 MiB one took the router a minute of
        CPU), 400 for a bad body, 429 for a prompt over the tenant's tokens per minute."""
        lease = work.lease
        tenant = lease.tenant
        cards = self.models()["data"]
        # a completion may list up to MAX_SEQUENCES_PER_REQUEST prompts (lm-eval sends its contexts in batches),
        # each bounded once parsed, before any is tokenized
        if len(payload) > (bound := body_bound(cards, 1 if chat else MAX_SEQUENCES_PER_REQUEST)):
            raise RouteError(400, past_body_bound(bound), code=CONTEXT_LENGTH_CODE, headers=lease.headers)
        model = ChatRequest if chat else CompletionRequest
        inline = len(payload) <= INLINE_TOKENIZE_BYTES
        # this request's task and the threads it is checked and tokenized in: its tenant's verdicts and pieces only
        CACHE_SCOPE.set(tenant)
        try:
            raw = read_json(payload) if inline else await work.run(read_json, payload)
            # a grammar's check may take seconds (engine/constraint.py): never on the event loop
            inline = inline and not checks_a_grammar(raw)
            body = model.model_validate(raw) if inline else await work.run(model.model_validate, raw)
        except ValidationError as exc:
            raise RouteError(400, validation_problems(exc), param=validation_param(exc),
                             headers=lease.headers) from None
        except ValueError as exc:  # read_json's
            raise RouteError(400, str(exc), headers=lease.headers) from None
        except ChecksBusy as exc:
            raise checks_busy(exc, lease.headers) from None
        if isinstance(body, CompletionRequest) and (long := _longest_text_prompt(body)) > (each := body_bound(cards)):
            raise RouteError(400, past_body_bound(each, f"a prompt of {long} characters"), param="prompt",
                             code=CONTEXT_LENGTH_CODE, headers=lease.headers)
        priority = min(request_priority(headers.get(PRIORITY_HEADER)), self.priority_ceiling(tenant))
        dropped = [name for name in ROUTER_ONLY_FIELDS if raw.pop(name, None) is not None]
        retyped = _as_validated(raw, body)
        body.kv_transfer = body.resume_output_ids = None
        if self.keys.enabled:  # the tenant's salt, whatever the client sent: tenants never share cached blocks
            raw[CACHE_SALT_FIELD] = body.cache_salt = cache_salt_for(tenant, self.salt_secret)
        start = time.perf_counter()
        if len(payload) <= INLINE_TOKENIZE_BYTES:
            info, prompt_tokens = self.measure(body, priority)
        else:
            info, prompt_tokens = await work.run(self.measure, body, priority)
        self.metrics.decision.observe(time.perf_counter() - start)
        asked = headers.get(WORKLOAD_HEADER) if self.trusts_workload(tenant) else None
        workload = workload_class("chat" if chat else "completion", info.prompt_tokens, asked)
        if (over := lease.take_prompt(prompt_tokens)) is not None:
            raise self.rate_limited(tenant, over)
        span = request_span(self.tracing, headers, arrived_ns, chat, info, tenant, workload)
        return Admitted(raw, body, Trace(info, tenant, workload, lease=lease, span=span,
                                         source=BATCH_SOURCE if batch else CLIENT_SOURCE,
                                         charged_prompt_tokens=prompt_tokens),
                        rewritten=bool(dropped) or retyped or self.keys.enabled)

    def priority_ceiling(self, tenant: str) -> int:
        """The highest priority `tenant`'s requests get (`max_priority` of its `tenants:` entry): a client's
        x-kvmesh-priority above it is lowered to it, never refused (the header is a wish, as OpenAI's service_tier
        is; a client sharing code between tenants keeps working, and the request log shows the priority served).
        Unset: 0 with API keys (no tenant may jump the others' queue unless the operator says so), none without
        (every client is the one tenant `default`, as before: there is nobody to protect from whom)."""
        ceiling = self.limits.table.of(tenant).max_priority
        if ceiling is None:
            return 0 if self.keys.enabled else MAX_PRIORITY
        return ceiling

    def trusts_workload(self, tenant: str) -> bool:
        """Whether `tenant`'s x-kvmesh-workload is taken as its requests' class (`trust_workload_header`): the class
        steers the engines' eviction (reuse learnt per class) and forecasts, so a tenant naming a class its requests
        are not could have its blocks kept longer or skew the others' statistics. Unset: trusted only without API
        keys, as the priority; otherwise the class is derived from the request (protocol.workload_class)."""
        trusted = self.limits.table.of(tenant).trust_workload_header
        return not self.keys.enabled if trusted is None else trusted

    def reads_pool_status(self, tenant: str) -> bool:
        """Whether `tenant`'s key reads GET /kvmesh/pool (`read_pool_status`): every engine's address and live load,
        which with several tenants is the others' traffic, for an operator asking why a request went where it
        went, not for a tenant. Unset: only without API keys (every client is then the one tenant)."""
        allowed = self.limits.table.of(tenant).read_pool_status
        return not self.keys.enabled if allowed is None else allowed

    def reload_keys(self) -> bool:
        """Take a changed keys file (blocking: the app's background task runs it off the event loop); whether a new
        version was taken (then `keys_changed`, on the event loop)."""
        if self.keys_file is not None and self.keys_file.reload_if_changed():
            self.keys = self.keys_file.keys
            return True
        return False

    def keys_changed(self) -> None:
        """A new keys file taken: its tenants' 429 series made, and the series, buckets and demand of the tenants
        it no longer keys dropped (a router whose keys rotate for months must not keep every tenant it ever had).
        On the event loop, as every request's use of the limiter (it is not thread-safe)."""
        self.limits.retain(self.keys.tenants)
        self.metrics.set_tenants(self.keys.tenants)

    def authenticate(self, headers: Mapping[str, str]) -> str:
        """The tenant of a request's API key (DEFAULT_TENANT with auth off); RouteError 401 without a valid one."""
        tenant = self.keys.tenant_for(headers.get("authorization"))
        if tenant is None:
            message, kind, code = UNAUTHORIZED
            raise RouteError(401, message, code=code, kind=kind)
        return tenant

    def admit_call(self, tenant: str, tokens: int | None, request: bool = True) -> Lease:
        """A call of the router's own APIs (/tokenize, the Files and Batches API) under the tenant's interactive
        limits: one request (unless `request` is False), a concurrency slot until the lease is closed, and `tokens`
        (None: the call spends none); RouteError 429 over a limit, as a completion's. The caller closes the lease,
        with what it spent."""
        lease = self.limits.take(tenant, tokens, request)
        if isinstance(lease, Refusal):
            raise self.rate_limited(tenant, lease)
        return lease

    def rate_limited(self, tenant: str, refusal: Refusal) -> RouteError:
        """The 429 of a request over its tenant's limits (router/limits.py), counted by tenant pseudonym and reason."""
        self.metrics.count_rate_limited(tenant, refusal.reason)
        return RouteError(429, refusal.message, code=RATE_LIMIT_CODE, kind="rate_limit_error",
                          headers=refusal.headers)

    def measure(self, body: ChatRequest | CompletionRequest, priority: int) -> tuple[RequestInfo, int]:
        """The request's routing information (by its first prompt) and its prompt tokens, every prompt of a
        several-prompt completion counted: admission charges them all, so a list of prompts cannot pass a
        tokens-per-minute limit that each would pass alone. Each is tokenized rather than estimated from the first:
        a short first prompt would hide long ones, and the body bound keeps the work that of one long prompt."""
        info = self.request_info(body, priority)
        return info, info.prompt_tokens + self._other_prompts_tokens(body)

    def _other_prompts_tokens(self, body: ChatRequest | CompletionRequest) -> int:
        """The tokens of a completion's prompts after the first (0 for one prompt or a chat)."""
        prompt = body.prompt if isinstance(body, CompletionRequest) else None
        if not isinstance(prompt, list) or len(prompt) < 2 or not isinstance(prompt[0], str | list):
            return 0
        return sum(len(self.tokenizer.encode(p, add_special_tokens=body.add_special_tokens)) if isinstance(p, str)
                   else len(p) for p in prompt[1:])

    def request_info(self, body: ChatRequest | CompletionRequest, priority: int) -> RequestInfo:
        """Tokenize as the engines do and hash the leading blocks (at most max_hashed_tokens tokens), with the
        LoRA adapter the request names and its weights, as the engines hash its blocks: once per fingerprint of
        the adapter among the pods (one, unless new weights are being rolled out under the name)."""
        ids = self._token_ids(body)
        model = body.model or ""
        fingerprints = self.pods.adapter_fingerprints(model) if model else []
        if not fingerprints:
            hashes = self._hashes(ids, BlockExtra(None, body.cache_salt))
            return RequestInfo(model=model, prompt_tokens=len(ids), block_hashes=hashes, priority=priority)
        by_fingerprint = {f: self._hashes(ids, BlockExtra(model, body.cache_salt, f)) for f in fingerprints}
        return RequestInfo(model=model, prompt_tokens=len(ids), block_hashes=by_fingerprint[fingerprints[0]],
                           priority=priority, lora=model, lora_hashes=by_fingerprint)

    def _hashes(self, ids: list[int], extra: BlockExtra) -> tuple[int, ...]:
        c = self.config
        return tuple(block_hashes(ids[: c.max_hashed_tokens], c.block_size, extra, HashAlgo(c.hash_algo),
                                  c.hash_root))

    def refused_unlogged(self, trace: Trace, outcome: str, status: int) -> None:
        """A refusal after admission that no request-log row records (a 404 of an adapter gone, say): the request's
        span ends and the tenant's concurrency slot comes back here, on either edge."""
        if trace.span is not None:
            trace.span.end(outcome, status, trace.route, trace.pods, None)
        if trace.lease is not None:
            trace.lease.close()

    def view(self, info: RequestInfo) -> View:
        """The pods and the request's prefix matches, taken once: every choice for this request reads them."""
        now = time.monotonic()
        states = self.pods.snapshot(now)
        if info.lora is None:
            return View(states, self.index.match(info.block_hashes, [p.name for p in states], now))
        if len(info.lora_hashes) == 1:  # steady state: one hashing, for every pod but those loaded other weights since
            lora, (weights,) = info.lora, info.lora_hashes
            names = [p.name for p in states if p.adapter_fingerprints.get(lora, weights) == weights]
            return View(states, self.index.match(info.block_hashes, names, now))
        # a rollout: each pod matched with the hashes of its own weights
        groups: dict[int, tuple[tuple[int, ...], list[str]]] = {}
        for pod in states:
            hashes = info.hashes_for(pod)
            if hashes is not None:
                groups.setdefault(id(hashes), (hashes, []))[1].append(pod.name)
        matches: dict[str, PrefixMatch] = {}
        for hashes, names in groups.values():
            matches.update(self.index.match(hashes, names, now))
        return View(states, matches)

    def decide(
        self, info: RequestInfo, exclude: set[str], roles: tuple[str, ...] = SERVING_ROLES, view: View | None = None
    ) -> Decision:
        """The picker's choice among the pods in `roles`, not in `exclude` (over `view`, or a fresh one)."""
        view = view or self.view(info)
        states = [p for p in view.pods if p.name not in exclude]
        if info.model:
            served = {name for p in states if p.healthy for name in (p.models or {p.model})}
            if served and info.model not in served:
                raise RouteError(404, unknown_model(info.model, served), code=MODEL_NOT_FOUND, param="model")
        return pick(info, states, view.matches, self.picker, roles)

    def models(self) -> dict[str, Any]:
        """`/v1/models` of the pool: what its healthy pods serve, base models and then adapters (with their parent),
        each once, as both edges answer it; while the pool starts from zero (requests are held), what it served
        last."""
        cards = union_cards(
            p.models() for p in self.pods.pods.values() if p.healthy and p.refused is None and p.kv_config)
        if cards:
            self.served_before = cards
        elif self.pod_wait is not None:
            cards = self.served_before
        return {"object": "list", "data": cards}

    def model(self, model: str) -> dict[str, Any]:
        """`/v1/models/{model}` (OpenAI's retrieve): its card of `models()`, as both edges answer it; RouteError 404
        model_not_found for one the pool does not serve (or did not serve last, while it starts from zero)."""
        cards = self.models()["data"]
        for card in cards:
            if card["id"] == model:
                return card
        raise RouteError(404, unknown_model(model, {c["id"] for c in cards}), code=MODEL_NOT_FOUND, param="model")

    def refuse(self, trace: Trace, decision: Decision) -> RouteError | None:
        """The 429 for a request the overloaded pool sheds at its priority (counted and logged), as both edges
        answer it (with Retry-After), or None."""
        fair = fair_share(self.limits.inflight, self.limits.weight, trace.tenant)
        refusal = should_shed(decision, trace.info.priority, self.shed, fair)
        if refusal is None:
            return None
        if refusal.fair_share:
            self.metrics.count_rate_limited(trace.tenant, FAIR_SHARE)
        self.metrics.shed.labels(priority_label(trace.info.priority), trace.source).inc()
        self.metrics.count_request("shed", trace.route, trace.source)
        self.record(trace, "shed", 429, None)
        return RouteError(429, refusal.message, code=OVERLOADED_CODE, kind="rate_limit_error",
                          headers={"retry-after": str(refusal.retry_after_seconds)})

    def no_pod(self, trace: Trace) -> None:
        """Count and log a request no pod could take (answered 503 by whichever edge received it)."""
        self.metrics.count_request("no_pod", trace.route, trace.source)
        self.record(trace, "no_pod", 503, None)

    def commit(self, trace: Trace, pod: Pod, decision: Decision) -> Booking:
        """Send the request to `pod`, as far as the router's state goes: the trace, provisional index entries for
        its prompt (back-to-back requests find the prefix before the pod's events arrive) and the in-flight count,
        held by the booking returned, which the caller closes when the request ends (or withdraws, when the pod
        does not take it: the provisional entries go too)."""
        trace.pods.append(pod.name)
        trace.predicted = decision.predicted_cached_tokens
        if trace.span is not None:
            trace.span.decided(pod.name, decision)
        hashes = trace.info.hashes_for(decision.pod) if decision.pod is not None else None
        provisional = None
        if hashes is not None:  # the blocks the pod will cache, as it hashes them
            expires = self.index.add_provisional(pod.name, hashes, time.monotonic(),
                                                 self.config.provisional_ttl_seconds)
            provisional = (self.index, hashes, expires)
        uncached = max(0, trace.info.prompt_tokens - decision.predicted_cached_tokens)
        return Booking(pod, uncached, provisional)

    def plan_pull(self, decision: Decision, info: RequestInfo, view: View) -> PullPlan | None:
        """Whether the chosen pod should fetch a longer prefix from a peer before computing the rest."""
        if decision.pod is None or not info.block_hashes or self.pull.bytes_per_second <= 0:
            return None
        config = self.pods.kv_config_of(decision.pod.name)
        if config is None:
            return None
        unlike = self.stored_otherwise(decision.pod.name)
        alike = [p for p in view.pods if p.name not in unlike and self.pods.kv_config_of(p.name) is not None]
        if info.lora is not None:  # the pod pulls by its own hashes: a peer matched with other weights' lacks them
            hashes = info.hashes_for(decision.pod)
            if hashes is None:
                return None
            alike = [p for p in alike if info.hashes_for(p) is hashes]
        return plan_pull(decision.pod, info, alike, view.matches, config.block_bytes, self.picker, self.pull)

    def served_otherwise(self, name: str, lora: str | None) -> set[str]:
        """The pods that serve adapter `lora` with other weights than pod `name` (a new `path` reaching the pods one
        by one): the prefill pod's blocks are hashed with its weights, so a decode pod with others would find none,
        recompute the prompt and continue a first token of one version with the rest from another."""
        if lora is None:
            return set()
        served = {p.name: p.adapter_fingerprints for p in self.pods.snapshot()}
        mine = served.get(name, {}).get(lora)
        return {other for other, fingerprints in served.items() if lora in fingerprints and fingerprints[lora] != mine}

    def stored_otherwise(self, name: str) -> set[str]:
        """The pods that store KV blocks otherwise than pod `name` (another kv_cache_dtype or block size in
        bytes): blocks move as raw bytes, so a pull or handoff between them would be refused. A rolling change
        of kvCacheDtype leaves both formats in a pool for a while."""
        mine = self.pods.kv_config_of(name)
        if mine is None:
            return set()
        return {other for other, pod in self.pods.pods.items()
                if pod.kv_config is not None and not pod.kv_config.stores_like(mine)}


def build_router(config: RouterConfig, tokenizer_dir: Path) -> Router:
    """The router for `config`, tokenizing with the tokenizer and chat template in `tokenizer_dir`."""
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    expected = KVConfig(
        model="",
        block_size=config.block_size,
        hash_algo=config.hash_algo,
        hash_root=config.hash_root,
        tokenizer_fingerprint=tokenizer.fingerprint,
        num_device_blocks=0,
        boot_id="",
    )
    index = PrefixIndex()
    token = InternalToken.from_env()  # the pool's internal token: engines refuse requests without it
    pods = PodSet.from_config(config, expected, index, token)
    upstream = Upstream(config.request_timeout_seconds, config.max_connections_per_pod, token)
    pods.lost_listeners.append(lambda url, why: _abort_pod(upstream, url, why))
    table = parse_tenants(config.tenants)
    keys_file = KeysFile(config.api_keys_file) if config.api_keys_file else None  # re-read when it changes
    keys = keys_file.keys if keys_file is not None else ApiKeys({})
    retention = config.request_log_retention_days * 86400 or None  # 0: kept for good
    shed = ShedPolicy(config.ttft_slo_seconds, config.shed_overload_probability, config.priority_headroom)
    secret = config.cache_salt_secret or os.environ.get(CACHE_SALT_SECRET_ENV) or ""
    if keys.enabled and not secret:
        logging.getLogger("kvmesh.router").warning(
            "no cache_salt_secret: tenants' cache salts are keyed by the pool's name, which anyone who can reach "
            "an engine directly could use to probe another tenant's cached prefixes; set %s", CACHE_SALT_SECRET_ENV)
    pull = PullPolicy(config.pull_bytes_per_second, config.pull_setup_seconds)
    tenants = set(keys.tenants)
    _warn_unkeyed(table, tenants)
    limits = Limiter(table, config.rate_limit_replicas, batch_share=config.batch_rate_share)
    tracing = setup_tracing(ROUTER_SERVICE, config.otlp_traces_endpoint)
    pod_wait = (PodWait(pods, config.hold_without_pods_seconds, config.max_held_requests)
                if config.hold_without_pods_seconds > 0 else None)
    metrics = RouterMetrics(pods, index, tenants, lambda: pod_wait.held if pod_wait is not None else 0)
    log = AsyncRequestLog(RequestLog(config.database_url), retention_seconds=retention,
                          on_error=metrics.database_failed("request_log"),
                          on_dropped=metrics.request_log_dropped.inc) if config.database_url else None
    if keys_file is not None:
        keys_file.on_reload = lambda outcome, new: _keys_reloaded(metrics, table, outcome, new)
    picker = PickerConfig.from_weights(config.weights)
    return Router(config, tokenizer, pods, index, picker, metrics, upstream, keys, log, shed, secret or config.pool,
                  pull, tracing, limits=limits, keys_file=keys_file,
                  batches=BatchStore(config.database_url) if config.database_url else None,
                  limit_sync=LimitSync(DemandTable(config.database_url), limits, new_id("router-"),
                                       metrics.database_failed("limit_sync"))
                  if config.database_url and config.rate_limit_sync else None,
                  responses=open_store(config.database_url, config.responses_ttl_seconds,
                                       config.responses_memory_items), pod_wait=pod_wait, internal_token=token,
                  uploads=UploadSlots(config.batch_max_concurrent_uploads))


def _abort_pod(upstream: Upstream, url: str, why: str) -> None:
    broken = upstream.abort_pod(url, why)
    if broken:
        logging.getLogger("kvmesh.router").warning("%s: broke its %d open connections (%s)", url, broken, why)


def _keys_reloaded(metrics: RouterMetrics, table: LimitTable, outcome: str, keys: ApiKeys | None) -> None:
    """A new version of the keys file was taken (or refused): counted, and its unkeyed limits said (off the event
    loop: `Router.keys_changed` updates the tenants' series and buckets, on it)."""
    metrics.api_keys_reloads.labels(outcome).inc()
    if keys is not None:
        _warn_unkeyed(table, set(keys.tenants))


def _warn_unkeyed(table: LimitTable, tenants: set[str]) -> None:
    """Limits no key uses are said, at start and at each rotation, not refused: revoking a team's last key must cut
    it off at once and must not stop the next router from starting (a misspelt name shows here too)."""
    if strangers := unkeyed_tenants(table, tenants):
        logging.getLogger("kvmesh.router").warning(
            "tenants %s have limits but no API key (tenants with keys: %s): their limits are unused until a key "
            "names them", strangers, ", ".join(sorted(tenants)))


def _longest_text_prompt(body: CompletionRequest) -> int:
    """The characters of a completion's longest text prompt (0 for token ids, which cost no tokenizing)."""
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    return max((len(p) for p in prompts if isinstance(p, str)), default=0)


def _as_validated(raw: dict[str, Any], body: ChatRequest | CompletionRequest) -> bool:
    """The fields the router reads from the raw body itself (whether to stream, how many choices, whether the
    client gets token ids and the usage chunk) written as validated: pydantic reads "false" as False, where the raw
    text is truthy. Whether any changed."""
    changed = False
    for name in ("stream", "n", RETURN_TOKEN_IDS_FIELD):
        if name in raw and raw[name] != getattr(body, name):
            raw[name], changed = getattr(body, name), True
    options = raw.get("stream_options")
    if body.stream_options is not None and options.get("include_usage", False) != body.stream_options.include_usage:
        raw["stream_options"], changed = {**options, "include_usage": body.stream_options.include_usage}, True
    return changed


def request_priority(header: str | None) -> int:
    """The `x-kvmesh-priority` of a request, from MIN_PRIORITY to MAX_PRIORITY; RouteError 400 otherwise."""
    try:
        return parse_priority(header)
    except ValueError:
        raise RouteError(400, f"{PRIORITY_HEADER} must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}",
                         param=PRIORITY_HEADER) from None


def forwarded_headers(trace: Trace) -> dict[str, str]:
    """The kvmesh headers a request carries to its engine, on either edge: its priority and workload class as
    admission settled them (router/extproc.py overwrites the client's with these too)."""
    return {PRIORITY_HEADER: str(trace.info.priority), WORKLOAD_HEADER: trace.workload}


class PodTimeout(Exception):
    """A pod took a request that does not stream and sent no answer within the read timeout: not retried, since
    the pod may still be generating it (a long answer), and another pod would run it again."""


def refusal_outcome(error: RouteError) -> str:
    """How kvmesh_router_requests_total counts a request refused before an engine answered it."""
    if error.code == RATE_LIMIT_CODE:
        return "rate_limited"
    return "no_pod" if error.status == 503 else "error"


def wants_usage(raw: dict[str, Any]) -> bool:
    """Whether the client asked for the usage chunk of a stream (the router asks engines for it regardless)."""
    return bool((raw.get("stream_options") or {}).get("include_usage"))


def with_usage(raw: dict[str, Any]) -> dict[str, Any]:
    """The client's stream_options, asking for the usage chunk (the request log and the cached-token count
    need it; the router hides it again from a client that did not ask)."""
    return {**(raw.get("stream_options") or {}), "include_usage": True}


def _calls_tools(raw: Mapping[str, Any]) -> bool:
    """Whether the answer may be tool calls (tools given, and tool_choice not "none")."""
    return bool(raw.get("tools")) and raw.get("tool_choice") != "none"


def _pod_error(message: str) -> bytes:
    """The body of a 502 for a pod's answer that cannot be passed on."""
    return json.dumps(error_body(message, "server_error")).encode()


def _choices(raw: dict[str, Any]) -> int:
    """How many choices the answer has: n for each prompt."""
    return raw.get("n", 1) * (len(raw["prompt"]) if _several_prompts(raw) else 1)


def echoes(raw: Mapping[str, Any]) -> bool:
    """A completion with echo reads its prompt (and its prompt's logprobs) on the pod that computes the prompt: it
    is served whole on one pod, with no prefill hop and no pulled prefix (the engine refuses echo with either)."""
    return bool(raw.get("echo"))


def _several_prompts(raw: dict[str, Any]) -> bool:
    """A completion body with a list of prompts (texts or token lists): one choice per prompt."""
    prompt = raw.get("prompt")
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)


def _with_limits(response: Response, trace: Trace) -> Response:
    """Every answer to a tenant with limits carries their x-ratelimit-* headers as at its admission, as OpenAI's do."""
    if trace.lease is not None:
        response.headers.update(trace.lease.headers)
    return response


async def _single_chunk_stream(whole: dict[str, Any], raw: dict[str, Any]) -> AsyncIterator[str]:
    """A finished one-token answer as a stream: one chunk (a chat's finish_reason then in one of its own, as the
    engines send it), the usage if asked, [DONE]."""
    chat = whole["object"] == "chat.completion"
    choice = whole["choices"][0]
    if chat:
        delta = {"role": "assistant", "content": choice["message"]["content"]}
        choice = {k: v for k, v in choice.items() if k != "message"} | {"delta": delta}
    base = {"id": whole["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": whole["created"], "model": whole["model"]}
    if wants_usage(raw):
        base["usage"] = None  # until the last chunk, as the engines send it
    for part in finish_apart(choice) if chat else [choice]:  # a chat's finish_reason in a chunk of its own
        yield "data: " + json.dumps(base | {"choices": [part]}) + "\n\n"
    if "usage" in base:
        yield "data: " + json.dumps(base | {"choices": [], "usage": whole["usage"]}) + "\n\n"
    yield "data: [DONE]\n\n"


@dataclass
class Drain:
    """The router's shutdown, shared by the signal handler, `/health` and the app's shutdown. Once begun, the
    router stops advertising itself (HTTP `/health` 503, the picker's gRPC health NOT_SERVING) but goes on
    serving; it begins at SIGTERM or SIGINT (`RouterServer`), or at the app's shutdown when no signal came."""

    draining: bool = False
    settle: float = 0.0  # new requests still served this long: SHUTDOWN_SETTLE_SECONDS after a SIGTERM
    gateway: ExtProcServer | None = None
    pod_wait: PodWait | None = None  # the requests held while no pod is ready: answered at once when it begins
    picker_stopped: asyncio.Task[None] | None = None  # the picker's drain, once started

    def begin(self, settle: float | None = None) -> None:
        """Start draining, and the picker's drain if it serves and has not started one (on the event loop)."""
        self.draining = True
        self.settle = self.settle if settle is None else settle
        if self.pod_wait is not None:
            self.pod_wait.stop()
        if self.gateway is not None and self.picker_stopped is None:
            self.picker_stopped = asyncio.ensure_future(self.gateway.stop(drain=SHUTDOWN_DRAIN_SECONDS,
                                                                          settle=self.settle))

    async def finish(self) -> None:
        """Until the picker is drained (begun here if no signal began it)."""
        self.begin()
        if self.picker_stopped is not None:
            await self.picker_stopped


class RouterServer(uvicorn.Server):
    """uvicorn with the router's shutdown. At the first SIGTERM or SIGINT the drain begins at once; after SIGTERM
    (Kubernetes stopping the pod) the HTTP port keeps taking new requests for SHUTDOWN_SETTLE_SECONDS (a
    Service or load balancer learns of the 503 only at its next probe; a local Ctrl-C has nobody to tell and
    skips that wait), then uvicorn's own graceful shutdown closes it and lets the requests open finish, for up
    to HTTP_DRAIN_SECONDS; the app's shutdown then waits for the picker, whose drain ends by the same bound.
    uvicorn would re-raise the signal once done (exit by the signal); a drained router exits 0. A second
    Ctrl-C quits at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: concurrent.futures.Future[None] | None = None  # the drain begun by the first signal

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.stopping is not None:  # a second signal
            if sig == signal.SIGINT:
                self.should_exit = self.force_exit = True
            return
        assert self.loop is not None, "uvicorn captures signals only while serving"
        settle = SHUTDOWN_SETTLE_SECONDS if sig == signal.SIGTERM else 0.0
        self.stopping = asyncio.run_coroutine_threadsafe(self._drain(signal.Signals(sig).name, settle), self.loop)

    async def _drain(self, name: str, settle: float) -> None:
        self.drain.begin(settle)
        logging.getLogger("kvmesh.router").warning(
            "%s: draining; /health answers 503, new requests are served for %g s more, open ones for up to %g s "
            "after that (Ctrl-C again to quit now)", name, settle, HTTP_DRAIN_SECONDS)
        await asyncio.sleep(settle)
        self.should_exit = True


def run_router(router: Router, log_level: str = "info") -> None:
    """Serve `router` on its host and port until a signal, then drain both edges (see RouterServer)."""
    drain = Drain()
    config = uvicorn.Config(create_router_app(router, drain), host=router.config.host, port=router.config.port,
                            log_level=log_level, timeout_graceful_shutdown=HTTP_DRAIN_SECONDS)
    RouterServer(config, drain).run()


class RouterApp(FastAPI):
    """The router's FastAPI app, whose completion POSTs skip FastAPI: those are the router's hot path, and
    FastAPI's middleware, routing and request machinery were about a third of the CPU of each routed request
    (`kvmesh bench router`, docs/benchmarks.md). They go straight to `completions`, a plain ASGI handler; every
    other request (the Batch API, /tokenize, /v1/models, /health, /metrics, another method on a completion path)
    is FastAPI's. Every request goes through `edge` first: the body-read deadline (engine/body_deadline.py), so no
    route, completion or other, holds a connection for a body that does not come."""

    completions: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None
    edge: ASGIApp | None = None  # BodyDeadline around `dispatch`

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await (self.edge or self.dispatch)(scope, receive, send)

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.completions is not None and scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] in COMPLETION_PATHS):
            await self.completions(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def header_map(scope: Scope) -> dict[str, str]:
    """A request's headers by name (ASGI servers give names lowercased); of a repeated header, the first, as
    Starlette's `Headers.get` reads it."""
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in reversed(scope["headers"])}


def create_router_app(router: Router, drain: Drain | None = None) -> FastAPI:
    drain = drain or Drain()
    drain.pod_wait = router.pod_wait

    async def watch_keys() -> None:
        while True:
            await asyncio.sleep(KEYS_CHECK_SECONDS)
            try:
                if await asyncio.to_thread(router.reload_keys):
                    router.keys_changed()
            except Exception:  # a bug here must not end key rotation for the router's life
                logging.getLogger("kvmesh.router").exception(
                    "the API keys reload failed; the keys in force stay, and the file is read again")

    responses = Responses(router.responses, lambda operation: router.metrics.response_store_errors.labels(
        operation).inc())

    async def send_batch_request(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        """A batch's request through this router's own routing, at the batch priority (shed first); a response
        request through the Responses API's translation to a chat request."""
        headers = {PRIORITY_HEADER: str(router.config.batch_priority)}

        async def send(chat: dict[str, Any]) -> Response:
            return await serve(json.dumps(chat).encode(), headers, CHAT_PATH, True, tenant, batch=True)

        if path == RESPONSES_PATH:
            response = await responses.answer(tenant, body, send)
        else:
            response = await serve(json.dumps(body).encode(), headers, path, path == CHAT_PATH, tenant, batch=True)
        try:
            content = json.loads(bytes(response.body))
        except (json.JSONDecodeError, UnicodeDecodeError):
            content = None
        if not isinstance(content, dict):  # not an OpenAI answer (a pod's broken reply): kept as the error's text
            content = error_body(bytes(response.body).decode(errors="replace")[:1000], "server_error")
        retry = response.headers.get("retry-after")
        return Answer(response.status_code, content, float(retry) if retry else None)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        keys_task = asyncio.create_task(watch_keys()) if router.keys_file is not None else None
        sync_task = None
        if router.limit_sync is not None:
            sync_task = asyncio.create_task(router.limit_sync.run(router.tenants, lambda: drain.draining))
        batch_task = None
        if router.batches is not None:
            runner = BatchRunner(router.batches, send_batch_request, tenants_by_pseudonym(router.tenants),
                                 router.metrics.batches, router.config.batch_settings(),
                                 database_failed=router.metrics.database_failed("batch_runner"))
            batch_task = asyncio.create_task(runner.serve_forever())
        await router.pods.start()
        if router.config.ext_proc_port is not None:  # imported here: grpc only for routers that serve a Gateway
            from kvmesh.router.extproc import start_ext_proc

            drain.gateway = await start_ext_proc(router, router.config.host, router.config.ext_proc_port,
                                                 tls=router.config.ext_proc_tls,
                                                 cert_dir=router.config.ext_proc_cert_dir)
            if drain.draining:  # a signal came while it started
                drain.begin()
        yield
        if batch_task is not None:  # no new batch request; the batch's lease goes back for another replica
            batch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await batch_task
        await drain.finish()
        if keys_task is not None:
            keys_task.cancel()
        if sync_task is not None:  # ended before leaving: a report under way must not land after the leave
            sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sync_task
        await router.pods.stop()
        await router.upstream.close()
        if router.log is not None:
            router.log.close()
            router.log.log.close()  # the router made the RequestLog: its engine goes too (SQLite checkpoints the WAL)
        if router.batches is not None:
            router.batches.close()
        responses.close()
        if router.limit_sync is not None:
            with contextlib.suppress(Exception):  # a database away: its rows go stale on their own
                await asyncio.to_thread(router.limit_sync.table.leave, router.limit_sync.replica)
            router.limit_sync.table.close()
        await asyncio.to_thread(router.tracing.shutdown)  # the last batch of spans, signal or not

    app = RouterApp(title="kvmesh router", lifespan=lifespan)

    app.add_exception_handler(StarletteHTTPException, http_error_handler)  # type: ignore[arg-type]

    app.include_router(batch_routes(router.batches, lambda header: router.keys.tenant_for(header),
                                    router.config.batch_max_file_bytes, router.config.batch_max_enqueued_requests,
                                    router.admit_call, router.config.file_quota(), router.uploads,
                                    router.metrics.database_failed("batch_api")))
    app.include_router(tokenize_routes(router.tokenizer, lambda header: router.keys.tenant_for(header), router.models,
                                       router.admit_call))

    async def send_chat(lease: Lease, body: dict[str, Any], http: HttpRequest) -> Response:
        """A Responses API request's chat request through this router's own path under the limits it opened
        (`lease`), its client watched."""
        return await serve(json.dumps(body).encode(), header_map(http.scope), CHAT_PATH, True, http=http,
                           lease=lease)

    app.include_router(response_routes(responses, lambda header: router.keys.tenant_for(header), send_chat,
                                       router.open, router.admit_call))

    async def completions(scope: Scope, receive: Receive, send: Send) -> None:
        """A completion POST, as plain ASGI (RouterApp). The key is checked before a byte of the body is read,
        and the body is bounded in size (and in time, by RouterApp's edge), so a stranger cannot make the router
        hold an unbounded body, nor a connection for longer than body_read_timeout_seconds before its body is
        whole."""
        headers = header_map(scope)
        try:
            tenant = router.authenticate(headers)
            payload = await read_body(receive, MAX_REQUEST_BODY_BYTES)
        except RouteError as exc:
            router.metrics.count_request(refusal_outcome(exc), "aggregated", CLIENT_SOURCE)
            await error_response(exc)(scope, receive, send)
            return
        if payload is None:  # the client left before its request was whole (or was answered 408): nobody to answer
            return
        path = scope["path"]
        response = await serve(payload, headers, path, COMPLETION_PATHS[path], tenant, http=HttpRequest(scope,
                                                                                                       receive))
        await response(scope, receive, send)

    app.completions = completions

    def body_timed_out(scope: Scope) -> None:
        """A completion whose body never came in time was refused (outcome=error); other routes count no series."""
        if scope["path"] in COMPLETION_PATHS:
            router.metrics.count_request("error", "aggregated", CLIENT_SOURCE)

    app.edge = BodyDeadline(app.dispatch, lambda: router.config.body_read_timeout_seconds, body_timed_out)

    async def serve(payload: bytes, headers: Mapping[str, str], path: str, chat: bool, tenant: str | None = None,
                    http: HttpRequest | None = None, batch: bool = False, lease: Lease | None = None) -> Response:
        """One completion from a client of the HTTP edge (`http`: watched for a client that leaves), of the
        Responses API (`lease`: its tenant's limits, opened already), or of the batch runner in this process
        (`batch`; `tenant`: whose batch it is, authenticated when the batch was created)."""
        try:
            admitted = await router.admit(payload, headers, chat, tenant, batch, lease)
        except RouteError as exc:
            source = BATCH_SOURCE if batch else CLIENT_SOURCE
            router.metrics.count_request(refusal_outcome(exc), "aggregated", source)
            return error_response(exc)
        response: Response | None = None
        try:
            response = await respond(admitted, path, http)
            return response
        finally:  # the tenant's slot back, however the request ended (a bug's 500 too): every request but a relayed
            # stream ends here; a stream's relay gives the slot back when it ends (RelayResponse)
            if not isinstance(response, RelayResponse) and admitted.trace.lease is not None:
                admitted.trace.lease.close()

    async def respond(admitted: Admitted, path: str, http: HttpRequest | None) -> Response:
        """An admitted request's answer, forwarded to a pod (the client watched, when it is one that may leave)."""
        raw, body, trace = admitted.raw, admitted.body, admitted.trace
        try:
            if router.pod_wait is not None and router.pod_wait.should_hold():
                refused = await hold(router.pod_wait, trace, http)
                if refused is not None:
                    return _with_limits(refused, trace)
            work = asyncio.ensure_future(forward(path, raw, trace, bool(body.stream)))
            if http is None:  # the batch runner's: cancelled when its batch stops, which aborts the upstream call
                try:
                    return _with_limits(await work, trace)
                except asyncio.CancelledError:
                    client_gone(trace)
                    raise
            # watched until the answer begins (a stream's relay then notices a gone client itself: it is cancelled)
            gone = asyncio.ensure_future(wait_disconnected(http.receive))
            # the client leaving cancels the work, which closes the upstream call: the engine aborts the request
            # and frees its blocks (a callback, not asyncio.wait: this runs for every request)
            gone.add_done_callback(lambda _: work.cancel())
            try:
                return _with_limits(await work, trace)
            except asyncio.CancelledError:
                if not gone.done() or gone.cancelled():  # not the client: this request itself was cancelled
                    raise
                return client_gone(trace)
            finally:
                gone.cancel()
        except RouteError as exc:
            outcome = refusal_outcome(exc)
            router.metrics.count_request(outcome, "aggregated", trace.source)
            router.refused_unlogged(trace, outcome, exc.status)
            return _with_limits(error_response(exc), trace)

    async def open_upstream(
        trace: Trace,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
        tried: set[str],
        first: Decision | None = None,
        roles: tuple[str, ...] = SERVING_ROLES,
        require_ok: bool = False,
    ) -> tuple[Booking, UpstreamReply, Decision] | None:
        """Send `body` to the best pod in `roles` not yet tried (`first`, when already decided); skip pods that
        refuse (429, 503; any non-200 with `require_ok`) or fail before their first byte. The booking holds the
        pod and its reply until the caller closes it. None when no pod is left."""
        unloaded = False  # a pod answered 404 for the request's adapter: if no other serves it, that is the answer
        for attempt in range(router.config.retries + 1):
            decision, first = first or router.decide(trace.info, tried, roles), None
            if decision.pod is None:
                break
            pod = router.pods.pods[decision.pod.name]
            tried.add(pod.name)
            if attempt:
                router.metrics.retries.inc()
                trace.route = "retry" if trace.route == "aggregated" else trace.route
            booking = router.commit(trace, pod, decision)
            try:
                booking.reply = reply = await router.upstream.post(pod.url + path, body, headers, trace.span)
            except UpstreamTimeout as exc:
                if not body.get("stream"):  # it may be generating still: sent elsewhere, it would run twice or more
                    booking.close()
                    raise PodTimeout(f"the pod {pod.name} sent no answer within "
                                     f"{router.config.request_timeout_seconds:g} s") from exc
                booking.withdraw()
                continue  # a stream's headers come at once: this pod is stuck
            except UpstreamError:
                booking.withdraw()  # it never took the request: its provisional entries would steer others to it
                continue
            except BaseException:  # cancelled (the client left)
                booking.close()
                raise
            if reply.status in RETRYABLE or (require_ok and reply.status != 200):
                booking.withdraw()
                continue
            if reply.status == 404 and trace.info.lora is not None and pod.served is not None:
                # the adapter was unloaded there since its list was read: another pod may still serve it
                pod.served = pod.served.without(trace.info.lora)
                unloaded = True
                booking.withdraw()
                continue
            router.metrics.count_decision(decision.reason)
            return booking, reply, decision
        if unloaded:
            raise RouteError(404, f"The model `{trace.info.lora}` is no longer served by any pod it was sent to",
                             code=MODEL_NOT_FOUND, param="model")
        return None

    async def hold(wait: PodWait, trace: Trace, http: HttpRequest | None) -> Response | None:
        """Hold a request while no pod is ready (the client watched, when it may leave): None once one is, to be
        decided as usual; a 503 when none became ready in time, a 499 when the client left meanwhile."""
        waiting = asyncio.ensure_future(wait.wait())
        gone = asyncio.ensure_future(wait_disconnected(http.receive)) if http is not None else None
        try:
            await asyncio.wait([waiting] if gone is None else [waiting, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:  # the request itself cancelled, or the client gone: no longer held
            waiting.cancel()
            if gone is not None:
                gone.cancel()
        if not waiting.done() or waiting.cancelled():
            return client_gone(trace)
        if waiting.result():
            return None
        router.no_pod(trace)
        return error_response(wait.stopping() if wait.draining else wait.timed_out())

    def no_pod(trace: Trace, message: str) -> JSONResponse:
        """503 with Retry-After when every pod refused or failed: counted and logged as no_pod."""
        router.no_pod(trace)
        return JSONResponse(error_body(message, "server_error", code="no_pod"), status_code=503,
                            headers={"Retry-After": "1"})

    async def forward(path: str, raw: dict[str, Any], trace: Trace,
                      stream: bool) -> Response:
        tried: set[str] = set()
        # the priority and class admission settled (clamped to the tenant's ceiling, derived unless trusted), never
        # the client's own headers: the engines order their queues by them
        headers = forwarded_headers(trace)
        view = router.view(trace.info)
        # one pod answers a tool call whole: it parses the calls out of all the text it generated, which a split
        # or a migrated stream would give to two pods in parts
        single = raw.get("n", 1) == 1 and not _several_prompts(raw) and not _calls_tools(raw)
        first = router.decide(trace.info, tried, view=view)  # the whole request on one pod
        shed = router.refuse(trace, first)  # before any hop: a split request is shed (and shared) alike
        if shed is not None:
            return error_response(shed)
        prefill_pods = any(p.role == "prefill" and p.healthy for p in view.pods)
        # no pod to continue (none serving: a decode rollout, a crash loop): no prefill that would only pin its KV
        if prefill_pods and first.pod is not None and single and not echoes(raw) and (
                trace.info.prompt_tokens - first.predicted_cached_tokens >= router.config.prefill_hop_min_tokens):
            try:
                split = await disaggregate(path, raw, trace, stream, headers)
            except PodTimeout as exc:
                return timed_out(trace, exc)
            if split is not None:
                return split
            # served whole after all: decided again, as pods may have left or filled during the hop
            view = router.view(trace.info)
            first = router.decide(trace.info, tried, view=view)
        migratable = stream and single
        upstream = {**raw, RETURN_TOKEN_IDS_FIELD: True} if migratable else dict(raw)
        if stream:  # the request log and metrics need the usage even when the client did not ask for it
            upstream["stream_options"] = with_usage(raw)
        pull = None if echoes(raw) else router.plan_pull(first, trace.info, view)
        if pull is not None:  # cheaper to fetch the longer prefix a peer holds than to compute it
            upstream[KV_TRANSFER_FIELD] = {"mode": "pull", "source": pull.source.url, "tokens": pull.tokens}
            router.metrics.pulls.inc()
        try:
            opened = await open_upstream(trace, upstream, path, headers, tried, first)
        except PodTimeout as exc:
            return timed_out(trace, exc)
        if opened is None:
            return no_pod(trace, "no pod can take this request now; retry later")
        booking, reply, decision = opened
        router.metrics.predicted.inc(decision.predicted_cached_tokens)
        decided = {"x-kvmesh-pod": booking.pod.name,
                   "x-kvmesh-predicted-cached-tokens": str(decision.predicted_cached_tokens)}
        if stream and reply.status == 200:
            stream_state = Relay(booking, upstream, path, headers, tried,
                                 strip_ids=not raw.get(RETURN_TOKEN_IDS_FIELD), migratable=migratable,
                                 client_usage=wants_usage(raw), choices=_choices(raw))
            return RelayResponse(relay(trace, stream_state), stream_state, decided, lambda: ended(trace, "client_gone"))
        status, content, answer = await whole_answer(booking, reply)
        outcome = "ok" if answer is not None else "error"
        router.metrics.count_request(outcome, trace.route, trace.source)
        router.record(trace, outcome, status, _count_cached(answer) if answer is not None else None)
        return Response(content, status_code=status, media_type="application/json", headers=decided)

    async def whole_answer(booking: Booking, reply: UpstreamReply) -> tuple[int, bytes, dict[str, Any] | None]:
        """A pod's answer read whole, as the client gets it: (status, body, the body of a 200 parsed). One the pod
        broke off, or a 200 that is no JSON object, is a 502 with a message (an error's own body passes on)."""
        with booking:
            try:
                content = await reply.read()
            except UpstreamError as exc:  # the pod broke off mid-answer: a 502, counted and logged like any error
                return 502, _pod_error(f"the pod {booking.pod.name} broke off its answer: {exc}"), None
        if reply.status != 200:
            return reply.status, content, None
        try:
            answer = json.loads(content)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            return 502, _pod_error(f"the pod {booking.pod.name} answered with a body that is not a JSON object: "
                                   f"{content[:120].decode(errors='replace')!r}"), None
        return 200, content, answer

    async def disaggregate(
        path: str, raw: dict[str, Any], trace: Trace, stream: bool, headers: dict[str, str]
    ) -> Response | None:
        """Prefill on a prefill pod (it samples the first token and keeps the KV under a handle), then decode on
        a decode pod that pulls the KV and continues. None when the prefill hop failed: serve it whole."""
        asked = raw.get("max_completion_tokens") or raw.get("max_tokens")
        prefill_body = {**raw, "stream": False, RETURN_TOKEN_IDS_FIELD: True, KV_TRANSFER_FIELD: {"mode": "prefill"}}
        prefill_body.pop("stream_options", None)
        if asked == 1:  # the prefill pod's one token is the whole answer: no KV to keep for a decode step
            del prefill_body[KV_TRANSFER_FIELD]
        try:
            opened = await open_upstream(trace, prefill_body, path, headers, set(), roles=("prefill",))
        except PodTimeout:  # a prefill hop that failed like any other: served whole
            return None
        if opened is None:
            return None
        prefill, reply, decision = opened
        with prefill:  # the prefill pod's part ends with its answer (the KV it keeps is the decode pod's to pull)
            try:
                content = await reply.read()
            except UpstreamError:  # broke off mid-answer
                return None
        prefill_pod = prefill.pod
        if reply.status != 200:
            return None
        try:
            first = json.loads(content)
            choice = first["choices"][0]
            ids = choice.pop("token_ids")
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            # the decode pod sends a tail of it that may yet grow into a stop string, or drops it (contract 0)
            opening_text = text[: sendable_length(text, 0, stop_strings(raw.get("stop")),
                                                  bool(raw.get("include_stop_str_in_output")))]
        except (ValueError, LookupError, TypeError):  # not an answer this router can continue
            logging.getLogger("kvmesh.router").warning(
                "the prefill pod %s sent an answer that is not a completion; serving the request whole",
                prefill_pod.name)
            return None
        ticket = first.pop(KV_TRANSFER_FIELD, None)  # none when the request ended as it arrived (a constraint)
        trace.route = "disaggregated"
        router.metrics.predicted.inc(decision.predicted_cached_tokens)
        _count_cached(first)
        client_ids = bool(raw.get(RETURN_TOKEN_IDS_FIELD))
        if choice["finish_reason"] == "stop" or asked == 1 or ticket is None or len(ids) != 1:
            if ticket is not None:  # the prefill pod keeps the KV for a decode step that will not come
                release_handoff(prefill_pod.url, ticket)
            if client_ids:
                choice["token_ids"] = ids
            router.metrics.count_request("ok", trace.route, trace.source)
            router.record(trace, "ok", 200, first["usage"])
            decided = {"x-kvmesh-pod": prefill_pod.name,
                       "x-kvmesh-predicted-cached-tokens": str(decision.predicted_cached_tokens)}
            if not stream:
                return JSONResponse(first, headers=decided)
            return StreamingResponse(_single_chunk_stream(first, raw), media_type="text/event-stream",
                                     headers=decided)
        (token,) = ids
        decode_body = {**raw, KV_TRANSFER_FIELD: {"mode": "decode", "source": prefill_pod.url,
                                                  "handle": ticket["handle"], "first_token": token}}
        if stream:
            decode_body[RETURN_TOKEN_IDS_FIELD] = True
            decode_body["stream_options"] = with_usage(raw)
        # could not take the prefill pod's KV: stored in another format, or computed with other adapter weights
        unlike = router.stored_otherwise(prefill_pod.name) | router.served_otherwise(prefill_pod.name, trace.info.lora)
        tried: set[str] = set(unlike)
        # the prefill pod pins the KV until a decode pod pulls it, which an engine does before it answers: a hop
        # given up before the decode pod's answer opens (the client gone, a timeout, an error) releases it now
        try:
            opened = await open_upstream(trace, decode_body, path, headers, tried)
            tried -= unlike  # a pod of any format may continue the stream later (it recomputes the prompt)
            if opened is None and unlike:  # none of its format left: one of another recomputes the prompt
                recompute = {k: v for k, v in decode_body.items() if k != KV_TRANSFER_FIELD}
                opened = await open_upstream(trace, {**recompute, RESUME_OUTPUT_IDS_FIELD: [token]}, path,
                                             headers, tried)
        except BaseException:
            release_handoff(prefill_pod.url, ticket)
            raise
        if opened is None:
            release_handoff(prefill_pod.url, ticket)
            return no_pod(trace, "no decode pod can take this request now; retry later")
        booking, reply, _ = opened
        decided = {"x-kvmesh-pod": f"{prefill_pod.name},{booking.pod.name}",
                   "x-kvmesh-predicted-cached-tokens": str(decision.predicted_cached_tokens)}
        if stream and reply.status == 200:
            resumable = {**raw, RETURN_TOKEN_IDS_FIELD: True, "stream_options": with_usage(raw)}
            shift = text_offset_after(choice.get("logprobs")) or 0
            state = Relay(booking, resumable, path, headers, tried, strip_ids=not client_ids, migratable=True,
                          sent_ids=[token], stream_id=first["id"], stream_created=first["created"],
                          stream_model=first["model"], strip_role=True, role_sent=True,
                          prefill_usage=first["usage"], chat="message" in choice, client_usage=wants_usage(raw),
                          text_offset_base=shift, text_offset_next=shift)
            opening = state.text_chunk(opening_text)
            opening["choices"][0]["logprobs"] = choice.get("logprobs")  # the first token's, from the prefill pod
            if state.chat:
                opening["choices"][0]["delta"]["role"] = "assistant"
            if client_ids:
                opening["choices"][0]["token_ids"] = [token]
            return RelayResponse(relay(trace, state, "data: " + json.dumps(opening) + "\n\n"), state, decided,
                                 lambda: ended(trace, "client_gone"))
        status, content, rest = await whole_answer(booking, reply)
        if rest is None:
            release_handoff(prefill_pod.url, ticket)
            router.metrics.count_request("error", trace.route, trace.source)
            router.record(trace, "error", status, None)
            return Response(content, status_code=status, media_type="application/json", headers=decided)
        merged = rest["choices"][0]
        if "message" in merged:
            merged["message"]["content"] = opening_text + (merged["message"]["content"] or "")
        else:
            merged["text"] = opening_text + merged["text"]
        if client_ids:
            merged["token_ids"] = [token, *merged.get("token_ids", [])]
        merged["logprobs"] = merge_logprobs(choice.get("logprobs"), merged.get("logprobs"))
        rest["usage"] = merge_usage(first["usage"], rest["usage"])
        rest["id"] = first["id"]
        router.metrics.count_request("ok", trace.route, trace.source)
        router.record(trace, "ok", 200, rest["usage"])
        return JSONResponse(rest, headers=decided)

    releasing: set[asyncio.Task[None]] = set()  # the releases in flight (a task nobody holds may be collected)

    def release_handoff(pod_url: str, ticket: dict[str, Any]) -> None:
        """The decode step was given up: the prefill pod unpins the handoff's KV now, not at its TTL (30 s of
        blocks held for nobody: under load they filled the pod, and its next requests waited for them)."""

        async def release() -> None:
            try:
                reply = await router.upstream.post(pod_url + KV_RELEASE_PATH, {"handle": ticket["handle"]}, {})
                try:
                    await reply.read()
                finally:
                    reply.close()
            except UpstreamError:  # the handle expires at its TTL anyway
                pass

        task = asyncio.create_task(release())
        releasing.add(task)
        task.add_done_callback(releasing.discard)

    def timed_out(trace: Trace, exc: PodTimeout) -> JSONResponse:
        """504 for a request a pod took and did not answer in time: counted and logged as an error."""
        router.metrics.count_request("error", trace.route, trace.source)
        router.record(trace, "error", 504, None)
        return JSONResponse(error_body(str(exc), "server_error", code="upstream_timeout"), status_code=504)

    def client_gone(trace: Trace) -> Response:
        ended(trace, "client_gone")
        return Response(status_code=499)

    def _count_cached(body: dict[str, Any]) -> dict[str, Any]:
        usage = usage_object(body.get("usage"))
        router.metrics.actual.inc(cached_tokens(usage))
        return usage

    async def relay(trace: Trace, state: Relay, opening: str | None = None) -> AsyncGenerator[str, None]:
        """Pass SSE lines through as they arrive (after `opening`, a first chunk the router already has). If the pod
        fails mid-stream, continue on another pod with the prompt plus the tokens already sent
        (`resume_output_ids`), so the client's stream goes on with no repeated or missing token; only when no pod
        can continue does it end with an error event."""
        state.started = True
        outcome = "ok"
        usage = None
        try:
            if opening is not None:
                yield opening
            while True:
                with state.booking as booking:
                    assert booking.reply is not None  # open_upstream's bookings come with their reply
                    try:
                        async for line in booking.reply.lines():
                            data = sse_data(line)
                            if data is not None and data.startswith("{"):
                                try:
                                    parsed = json.loads(data)
                                except ValueError:
                                    raise UpstreamError(f"a malformed event from the pod: {line[:80]!r}") from None
                                chunk = state.on_chunk(parsed, trace)
                                if chunk.get("usage"):
                                    usage = _count_cached(chunk)
                                    if not state.client_usage:
                                        continue
                                line = "data: " + json.dumps(chunk)
                            elif data == "[DONE]":
                                state.done = True
                                line = "data: [DONE]"
                            yield line + "\n"
                    except UpstreamError:
                        pass
                if state.finished and not state.done:  # the answer is whole; only the tail of the stream was lost
                    state.done = True
                    yield "data: [DONE]\n\n"
                if state.done or not state.migratable:
                    break
                router.metrics.migrations.inc()
                trace.route = "migrated"
                body = {**state.upstream, RESUME_OUTPUT_IDS_FIELD: state.resume_ids()}
                if body[RESUME_OUTPUT_IDS_FIELD]:
                    body["echo"] = False  # the client has the prompt: its first chunk echoed it
                opened = await open_upstream(trace, body, state.path, state.headers, state.tried, require_ok=True)
                if opened is None:
                    break
                state.booking, _, _ = opened
                state.strip_role = state.role_sent
                state.text_offset_base = state.text_offset_next
            if not state.done:
                outcome = "error"
                yield stream_error_ending("the pod serving this stream failed and no other pod could continue it")
            elif state.failed:  # the pod's own error event, passed on as it came
                outcome = "error"
        except (asyncio.CancelledError, GeneratorExit):  # the client left (the stream was stopped or closed early)
            outcome = "client_gone"
            raise
        finally:
            ended(trace, outcome, usage)

    def ended(trace: Trace, outcome: str, usage: dict[str, Any] | None = None) -> None:
        """A relayed stream's end, counted and logged once (a client gone as 499, as on the Gateway edge)."""
        router.metrics.count_request(outcome, trace.route, trace.source)
        router.record(trace, outcome, 499 if outcome == "client_gone" else 200, usage)

    async def served_by_router_app() -> Response:
        """Never runs: RouterApp hands completion POSTs to `completions` before FastAPI routes them. Declared so
        that the OpenAPI schema lists the paths and another method gets FastAPI's 405."""
        raise AssertionError("RouterApp serves completion POSTs")

    for path in COMPLETION_PATHS:
        app.add_api_route(path, served_by_router_app, methods=["POST"], name=path)

    @app.get(MODELS_PATH)
    async def models(http: HttpRequest) -> Response:
        try:  # the key, as for completions and as the Gateway edge asks it
            router.authenticate(http.headers)
        except RouteError as exc:
            return error_response(exc)
        return JSONResponse(router.models())

    @app.get(MODEL_PATH_PREFIX + "{model:path}")  # an adapter's name may hold "/"
    async def model(model: str, http: HttpRequest) -> Response:
        try:
            router.authenticate(http.headers)
            return JSONResponse(router.model(model))
        except RouteError as exc:
            return error_response(exc)

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = [p.name for p in router.pods.snapshot() if p.healthy and not p.draining]
        # a router that holds requests while no pod is ready stays ready itself: it is how a pool at zero hears of
        # its first request (its Service must keep sending them)
        holds = router.pod_wait is not None
        status = "draining" if drain.draining else "ok" if healthy else "waiting_for_pods" if holds else "no_pods"
        return JSONResponse({"status": status, "pods": healthy},
                            status_code=200 if status in ("ok", "waiting_for_pods") else 503)

    @app.get(POOL_STATUS_PATH)
    async def pool(http: HttpRequest) -> JSONResponse:
        """Every pod as this replica sees it (`kvmesh status` prints it). It names the engines' addresses and their
        live load, so with API keys it asks the key of a tenant trusted with it (`Router.reads_pool_status`;
        $KVMESH_API_KEY for `kvmesh status`): 401 without a valid key, 403 for another tenant's."""
        try:
            tenant = router.authenticate(http.headers)
        except RouteError as exc:
            return error_response(exc)
        if not router.reads_pool_status(tenant):
            return error_response(RouteError(403, POOL_STATUS_REFUSED, code=POOL_STATUS_REFUSED_CODE,
                                             kind="permission_error"))
        return JSONResponse(pool_status(router.pods.pods, router.pods.snapshot(), router.index, time.monotonic()))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type="text/plain; version=0.0.4")

    return app
