"""The engine's HTTP edge: OpenAI API, /metrics, KV config, events and snapshot, health and drain.

Handlers validate, turn a body into engine requests, and relay outputs from the engine thread through an
asyncio queue per request. Nothing here computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Query
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kvmesh.engine.body_deadline import DEFAULT_BODY_READ_TIMEOUT_SECONDS, BodyDeadline
from kvmesh.engine.constraint import ChecksBusy, parse_off_loop
from kvmesh.engine.engine import LOAD_PROGRESS, Engine
from kvmesh.engine.internal_token import InternalToken, RequireToken
from kvmesh.engine.kv.transfer import KV_FETCH_PATH, PulledBlocks, TransferError, pull_blocks
from kvmesh.engine.metrics import LoadingMetrics
from kvmesh.engine.model.lora import LoraConflict, LoraError, LoraNotFound
from kvmesh.engine.model.token_cache import CACHE_SCOPE
from kvmesh.engine.openai_types import (
    CONTEXT_LENGTH_CODE,
    MODEL_NOT_FOUND,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    FetchRequest,
    HotChainBody,
    HotResponse,
    ReleaseRequest,
    TokenizeRequest,
    WarmRequest,
    WarmResponse,
    completion_token_length,
    completion_token_name,
    error_body,
    finish_apart,
    http_error_handler,
    read_json,
    validation_problem,
)
from kvmesh.engine.protocol import (
    CACHE_SOURCES,
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    DETOKENIZE_PATH,
    DRAIN_PATH,
    GATE_REASONS,
    HEALTH_LOADING,
    HEALTH_STALLED,
    HEALTH_WARMING,
    HOT_CHAINS_DEFAULT,
    HOT_CHAINS_MAX,
    INTERNAL_HTTP_CLIENT,
    KV_BLOCKS_PATH,
    KV_CONFIG_PATH,
    KV_EVENTS_PATH,
    KV_HOT_PATH,
    KV_RELEASE_PATH,
    KV_TRANSFER_FIELD,
    KV_WARM_PATH,
    LIVENESS_PATH,
    LOAD_LORA_PATH,
    LORA_FINGERPRINT_FIELD,
    LORA_NAME_PATTERN,
    MAX_PRIORITY,
    MIN_PRIORITY,
    MODEL_PATH_PREFIX,
    MODELS_PATH,
    PRIORITY_HEADER,
    READY_PATH,
    TOKENIZE_PATH,
    UNLOAD_LORA_PATH,
    WORKLOAD_HEADER,
    BlockExtra,
    HashAlgo,
    block_hashes,
    parse_priority,
    workload_class,
)
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.sampling import InvalidParam, SamplingParams
from kvmesh.engine.structured import Guide, StructuredError
from kvmesh.engine.tools import ToolStream, tool_constraint, tool_message
from kvmesh.engine.tracing import OFF, ChoiceTokens, Tracing, call_usage, engine_call

log = logging.getLogger("kvmesh.engine.server")
EVENTS_HEARTBEAT_SECONDS = 10.0
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI; chat gets the rest of the context
DISCONNECT_CHECK_SECONDS = 0.5
COMPLETION_ROUTES = (CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH)
BodyT = TypeVar("BodyT", bound=BaseModel)  # a request body's model


class ApiError(Exception):
    """A client error: becomes an OpenAI error body with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def body(self) -> dict[str, Any]:
        """OpenAI's error object (a response's body, or a streamed event's)."""
        return error_body(self.message, "invalid_request_error" if self.status < 500 else "server_error", self.param,
                          self.code)


def _validated(model: type[BodyT], raw: bytes, json_body: bool) -> BodyT:
    """The body as `model`, read as FastAPI reads one (JSON unless sent with another Content-Type, whose bytes are
    then no object) and refused alike (RequestValidationError). Called in a worker thread: validation checks a
    request's grammar, which may wait seconds for a checker (engine/constraint.py), and on the event loop that
    wait stalled every stream of the pod. The body's cache_salt is its CACHE_SCOPE first, so the verdict is
    remembered for requests with that salt only, as its texts' pieces are."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    data: Any = raw
    if json_body:
        try:
            data = read_json(raw)  # with its nesting bound: json.loads in a worker thread crashed on a deep one
        except ValueError as exc:  # "malformed JSON: ... at line L column C"
            raise ApiError(400, f"body: {exc}") from None
    salt = data.get("cache_salt") if isinstance(data, dict) else None
    CACHE_SCOPE.set(salt if isinstance(salt, str) else "")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


async def parsed_body(http: HttpRequest, model: type[BodyT]) -> BodyT:
    """The request's body as `model`, validated off the event loop (`_validated`): every route that takes a JSON body
    reads it here, so each answers a malformed one with the same 400 ("body: malformed JSON: ... line L column C")."""
    media = http.headers.get("content-type", "").split(";")[0].strip().lower()
    json_body = not media or media.endswith("/json") or media.endswith("+json")
    return await parse_off_loop(_validated, model, await http.body(), json_body)


class WarmupGate:
    """Keeps a new pod out of Services and routers (/health 503 "warming") from its model's load until the
    operator's warm-up has copied the pool's hottest prefixes into it (issue 5): the first POST /v1/kv/warm ends
    (however it went: a failed warm-up must not keep a pod out), POST /v1/admin/ready says there is nothing to
    copy, or the grace passes (nobody came). Readiness only: a client calling the pod directly is served."""

    def __init__(self, grace_seconds: float, opened: Counter, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start = clock()
        self.deadline = self._start + grace_seconds
        self.reason: str | None = None  # why it opened; None while closed, or when there never was a gate
        self._closed = grace_seconds > 0
        self._opened = opened  # the engine's kvmesh_warmup_gate_opened_total, by reason
        self._lock = threading.Lock()  # opened from the event loop and from the grace timer
        self._timer: threading.Timer | None = None

    def start_grace(self) -> None:
        """Open the gate when the grace ends even if nobody asks /health then (its metric and log say so)."""
        if self._closed:
            self._timer = threading.Timer(self.seconds_left(), self.open, ("grace_expired",))
            self._timer.daemon = True
            self._timer.start()

    def closed(self) -> bool:
        """Whether /health must still say warming; past the grace the gate opens (here, or by its timer)."""
        if self._closed and self._clock() >= self.deadline:
            self.open("grace_expired")
        return self._closed

    def seconds_left(self) -> float:
        return max(self.deadline - self._clock(), 0.0) if self._closed else 0.0

    def open(self, reason: str) -> None:
        """Open for good (a later call changes nothing)."""
        assert reason in GATE_REASONS, reason
        with self._lock:
            if not self._closed:
                return
            self._closed, self.reason = False, reason
        if self._timer is not None and reason != "grace_expired":
            self._timer.cancel()  # opened before its grace ran out: no thread waits out the rest
        self._opened.labels(reason).inc()
        log.info("warm-up gate open (%s) after %.1f s: /health answers 200", reason, self._clock() - self._start)


class HeldStream(StreamingResponse):
    """A stream whose handler took something before its body starts (pinned KV blocks, a pulled prefix):
    `on_end` gives it back when the response ends, however it ends. A generator's own `finally` is not enough:
    Starlette never starts the body when the client leaves while the response is starting, and a generator
    never started never runs its `finally`, so what it held would stay held for good."""

    def __init__(self, content: AsyncIterator[Any], on_end: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


class EngineHolder:
    """The engine, or why there is none yet: the server answers /health 503 while the model loads (and /metrics
    says it loads, and how far: `loading_metrics`), and while its warm-up gate holds it."""

    def __init__(self, engine: Engine | None = None, loader: Callable[[], Engine] | None = None) -> None:
        self.engine: Engine | None = None
        self.gate: WarmupGate | None = None
        self.error: str | None = None
        self.loading_metrics = LoadingMetrics()
        self._loader = loader
        if engine is not None:
            self._loaded(engine)

    def _loaded(self, engine: Engine) -> None:
        self.gate = WarmupGate(engine.config.warmup_grace_seconds, engine.metrics.warmup_gate_opened)  # from now
        self.gate.start_grace()
        self.engine = engine

    def load_in_background(self) -> threading.Thread:
        """Load on a thread (returned: a test may wait for it) while the server answers."""

        def run() -> None:
            try:
                LOAD_PROGRESS.set(self.loading_metrics.progress)  # this thread's context: its load reports here
                engine = self._loader()  # type: ignore[misc]
                engine.start()
                self._loaded(engine)
            except Exception as exc:  # shown by /health and logged; the process stays up for the operator to see it
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("the model could not be loaded: %s", self.error)

        loading = threading.Thread(target=run, name="kvmesh-load", daemon=True)
        loading.start()
        return loading

    def get(self) -> Engine:
        if self.engine is None:
            raise self._not_ready()
        return self.engine

    def loaded_gate(self) -> WarmupGate:
        """The loaded engine's warm-up gate (503 while the model loads, as every endpoint)."""
        if self.gate is None:
            raise self._not_ready()
        return self.gate

    def _not_ready(self) -> ApiError:
        return ApiError(503, self.error or "the engine is loading its model", code="not_ready")


def _usage(finals: dict[int, RequestOutput], job: _Job) -> dict[str, Any]:
    """OpenAI's usage, counted as the engine's span counts it (tracing.call_usage), with where the cached tokens
    came from (every source, zero when none)."""
    usage = call_usage([ChoiceTokens(job.prompt_of[i], o.prompt_tokens, o.completion_tokens, o.cached_tokens,
                                     o.peer_tokens, o.cached_by_tier) for i, o in sorted(finals.items())])
    by_source = dict.fromkeys(CACHE_SOURCES, 0) | usage.cached_by_tier
    by_source["peer"], by_source["device"] = usage.peer_tokens, usage.device_tokens
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "kvmesh_cached_by_source": by_source},
    }


class _Job:
    """The engine requests of one HTTP call (n choices, or several prompts) and their output queue."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.requests: list[Request] = []
        self.prompt_of: list[int] = []  # which prompt each request answers (n choices share one)
        self.open: set[int] = set()
        self.submitted = False
        self._checked = time.monotonic()

    def add(self, request: Request, prompt_index: int) -> None:
        index = len(self.requests)
        self.prompt_of.append(prompt_index)
        request.on_output = lambda out, i=index: self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, out))
        self.requests.append(request)
        self.open.add(index)

    def submit(self) -> None:
        self.submitted = True
        for request in self.requests:
            self.engine.submit(request)

    def close(self) -> None:
        """The response ended: a job never submitted (its client left before the stream began) gives back the
        peer's blocks pulled for it, which the engine frees only for a request it runs."""
        if not self.submitted:
            for key in [r.import_key for r in self.requests if r.import_key is not None]:
                self.engine.call(lambda k=key: self.engine.release(k))

    def abort(self) -> None:
        for i in self.open:
            self.engine.abort(self.requests[i].request_id)

    async def next(self, http: HttpRequest | None) -> tuple[int, RequestOutput]:
        """The next output; aborts the requests if the client has gone away meanwhile (checked at least every
        DISCONNECT_CHECK_SECONDS, whether or not outputs keep arriving)."""
        while True:
            if http is not None and time.monotonic() - self._checked > DISCONNECT_CHECK_SECONDS:
                self._checked = time.monotonic()
                if await http.is_disconnected():
                    self.abort()
                    raise ConnectionAbortedError
            try:
                item = await asyncio.wait_for(self.queue.get(), DISCONNECT_CHECK_SECONDS)
            except TimeoutError:
                continue
            if item[1].finish_reason is not None:
                self.open.discard(item[0])
            return item


def _check_model(engine: Engine, model: str | None) -> None:
    """404 for a `model` this engine does not serve (its base model or a loaded adapter); None means the base."""
    if model is not None and model != engine.model_name and model not in engine.loras.loaded:
        served = ", ".join(repr(n) for n in [engine.model_name, *engine.loras.names()])
        raise ApiError(404, f"model {model!r} does not exist; this engine serves {served}", param="model",
                       code=MODEL_NOT_FOUND)


_Entry = tuple[int, float | None, list[tuple[int, float]] | None]  # a token, its logprob, its top alternatives


def _token_entries(outs: list[RequestOutput]) -> list[_Entry]:
    """The generated tokens of `outs` with their logprobs (None when not asked) and alternatives."""
    return [(t, o.logprobs[k] if o.logprobs else None, o.top_logprobs[k] if o.top_logprobs else [])
            for o in outs for k, t in enumerate(o.new_token_ids)]


def _logprob_token(engine: Engine, token: int) -> str:
    return engine.tokenizer.decode([token], skip_special_tokens=False)


def _chat_token(engine: Engine, token: int) -> tuple[str, list[int]]:
    """A token as chat's logprobs give it: its text, and its own bytes (a token that is part of a character
    decodes alone to U+FFFD, whose UTF-8 is not what it stands for: OpenAI's `bytes` are the token's)."""
    text = _logprob_token(engine, token)
    return text, list(engine.tokenizer.token_bytes(token, text))


def _completion_token(engine: Engine, token: int) -> str:
    """A token as completions' logprobs name it: openai_types.completion_token_name."""
    text = _logprob_token(engine, token)
    return completion_token_name(text, engine.tokenizer.token_bytes(token, text))


def _chat_logprobs(engine: Engine, out: RequestOutput) -> list[dict[str, Any]]:
    items = []
    for k, token in enumerate(out.new_token_ids):
        text, raw = _chat_token(engine, token)
        top = (out.top_logprobs or [[]])[k] if out.top_logprobs else []
        alternatives = []
        for tid, lp in top:
            alt_text, alt_raw = _chat_token(engine, tid)
            alternatives.append({"token": alt_text, "logprob": lp, "bytes": alt_raw})
        items.append({"token": text, "logprob": out.logprobs[k] if out.logprobs else None, "bytes": raw,
                      "top_logprobs": alternatives})
    return items


class _Completions:
    """Body -> engine requests -> OpenAI responses, for both endpoints."""

    def __init__(self, engine: Engine, chat: bool, body: ChatRequest | CompletionRequest, http: HttpRequest) -> None:
        self.engine = engine
        self.chat = chat
        self.body = body
        self.http = http
        self.created = int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.model = body.model if body.model in engine.loras.loaded else engine.model_name  # an adapter's name
        # a stream asked for its usage: every chunk carries the key, null until the last (as OpenAI's API sends it;
        # typed clients declare it on the chunk)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.streamed_text: dict[int, int] = {}  # per streamed choice, the length of its tokens' text so far
        self.echoed: list[tuple[str, list[int]]] = []  # with echo, per choice: the prompt's text and ids
        # the output constraint: a structured output's, or a tool_choice's (validation allows one or the other)
        self.constraint = body.constraint or (tool_constraint(body.tool_mode, body.tool_dicts, body.named_tool,
                                                              body.parallel_tool_calls)
                                              if isinstance(body, ChatRequest) else None)

    # ---- building requests --------------------------------------------------------------------------------

    def prompts(self) -> list[list[int]]:
        """The prompts' ids (run in a thread of its own: the scope set here is this call's alone)."""
        CACHE_SCOPE.set(self.body.cache_salt or "")  # one tenant's texts never tokenize faster for another
        tok = self.engine.tokenizer
        if isinstance(self.body, ChatRequest):
            try:
                return [self.body.truncated(self.body.prompt_ids(tok), self.engine.max_model_len)]
            except ValueError as exc:
                raise ApiError(400, f"messages: {exc}", param="messages") from None
        return [self.body.truncated(ids, self.engine.max_model_len) for ids in self._completion_prompts()]

    def _completion_prompts(self) -> list[list[int]]:
        assert isinstance(self.body, CompletionRequest)
        tok, prompt, special = self.engine.tokenizer, self.body.prompt, self.body.add_special_tokens
        if isinstance(prompt, str):
            return [tok.encode(prompt, add_special_tokens=special)]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        if all(isinstance(p, str) for p in prompt):
            return [tok.encode(p, add_special_tokens=special) for p in prompt]  # type: ignore[arg-type]
        return [list(p) for p in prompt]  # type: ignore[union-attr]

    def params(self, prompt_len: int) -> SamplingParams:
        b = self.body
        e = self.engine
        room = e.max_model_len - prompt_len
        field = "max_tokens"  # the field the client set (max_completion_tokens, OpenAI's newer name, wins)
        if isinstance(b, ChatRequest):
            asked = b.max_completion_tokens or b.max_tokens
            field = "max_completion_tokens" if b.max_completion_tokens else field
        else:
            asked = DEFAULT_COMPLETION_TOKENS if b.max_tokens is None else b.max_tokens
        if asked is not None and asked > room:
            raise ApiError(400, f"This model's maximum context length is {e.max_model_len} tokens; the prompt "
                                f"({prompt_len} tokens) plus {field} ({asked}) asks for {prompt_len + asked}",
                           param=field, code=CONTEXT_LENGTH_CODE)
        if isinstance(b, ChatRequest):
            logprobs, top = b.logprobs, b.top_logprobs or 0
            if top and not logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        else:
            logprobs, top = b.logprobs is not None, b.logprobs or 0
        echoed = isinstance(b, CompletionRequest) and b.echo and b.logprobs is not None
        params = SamplingParams(
            max_tokens=asked if asked is not None else room,
            temperature=b.temperature,
            top_p=b.top_p,
            top_k=b.top_k,
            min_p=b.min_p,
            seed=b.seed,
            stop=b.stops,
            stop_token_ids=b.stop_token_ids or [],
            ignore_eos=b.ignore_eos,
            min_tokens=b.min_tokens,
            logprobs=logprobs,
            top_logprobs=top,
            prompt_logprobs=top if echoed else None,
            presence_penalty=b.presence_penalty,
            frequency_penalty=b.frequency_penalty,
            repetition_penalty=b.repetition_penalty,
            logit_bias=b.logit_bias_ids(),
            allowed_token_ids=b.allowed_token_ids or [],
            include_stop_str_in_output=b.include_stop_str_in_output,
            skip_special_tokens=b.skip_special_tokens,
        )
        try:
            params.validate(e.vocab_size, e.tokenizer.eos_token_ids)
        except InvalidParam as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        return params

    async def job(self) -> _Job:
        b, e = self.body, self.engine
        _check_model(e, b.model)
        transfer = b.kv_transfer
        if transfer is not None and transfer.mode == "prefill" and (b.stream or b.n > 1):
            raise ApiError(400, "a kv_transfer prefill is one non-streamed choice", param="kv_transfer")
        if transfer is not None and transfer.mode == "decode" and transfer.first_token >= e.vocab_size:
            raise ApiError(400, "kv_transfer.first_token is outside the vocabulary", param="kv_transfer")
        if isinstance(b, CompletionRequest) and b.suffix:
            raise ApiError(400, "suffix (insertion) is not supported", param="suffix")
        if isinstance(b, CompletionRequest) and b.echo and (b.resume_output_ids or transfer is not None):
            raise ApiError(400, "echo is for a request from its start, on one pod: not with resume_output_ids "
                                "or kv_transfer", param="echo")
        if e.draining:
            raise ApiError(503, "the engine is draining and takes no new requests", code="draining")
        try:
            priority = parse_priority(self.http.headers.get(PRIORITY_HEADER))
        except ValueError:
            raise ApiError(400, f"{PRIORITY_HEADER} must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}",
                           param=PRIORITY_HEADER) from None
        vocab = e.vocab_size
        adapter = e.loras.loaded.get(self.model)  # None for the base model (or an adapter unloaded since: a 404 later)
        # the weights as read now, for a pull's hashes; the engine thread sets those the request runs with
        extra = BlockExtra(lora=self.model if self.model != e.model_name else None, cache_salt=b.cache_salt,
                           lora_fingerprint=adapter.fingerprint if adapter is not None else None)
        job = _Job(e, asyncio.get_running_loop())
        prompts = await asyncio.to_thread(self.prompts)  # tokenizing a long prompt takes milliseconds: off the loop
        for prompt_index, prompt_ids in enumerate(prompts):
            if not prompt_ids:
                raise ApiError(400, "the prompt is empty", param="prompt")
            bad = [t for t in prompt_ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}",
                               param="prompt")
            if len(prompt_ids) >= e.max_model_len:
                raise ApiError(400, f"This model's maximum context length is {e.max_model_len} tokens; the prompt "
                                    f"has {len(prompt_ids)}, leaving no room to generate", param="prompt",
                               code=CONTEXT_LENGTH_CODE)
            capacity = e.kv.pool.num_blocks * e.config.block_size
            if len(prompt_ids) >= capacity:
                raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this engine's KV cache holds "
                                    f"{capacity}", param="prompt", code=CONTEXT_LENGTH_CODE)
            resume = list(b.resume_output_ids or [])
            if any(not 0 <= t < vocab for t in resume):
                raise ApiError(400, "resume_output_ids holds ids outside the vocabulary", param="resume_output_ids")
            workload = workload_class("chat" if self.chat else "completion", len(prompt_ids),
                                      self.http.headers.get(WORKLOAD_HEADER))
            if transfer is not None and transfer.mode == "decode":
                resume = [transfer.first_token]  # the prefill pod sampled it: this pod continues after it
            for i in range(b.n):
                params = self.params(len(prompt_ids))
                if b.seed is not None and i:
                    params.seed = b.seed + i
                if transfer is not None and transfer.mode == "prefill":
                    params.max_tokens = 1
                if resume and len(resume) >= params.max_tokens:
                    raise ApiError(400, "resume_output_ids already reaches max_tokens", param="resume_output_ids")
                guide = await asyncio.to_thread(self.guide, resume) if self.constraint is not None else None
                job.add(
                    Request(
                        request_id=f"{self.id}-{len(job.requests)}",
                        prompt_ids=list(prompt_ids),
                        params=params,
                        workload=workload,
                        priority=priority,
                        extra=extra,
                        output_ids=list(resume),
                        guide=guide,
                        handoff_ttl=(transfer.ttl_seconds or e.config.handoff_ttl_seconds)
                        if transfer is not None and transfer.mode == "prefill" else None,
                    ),
                    prompt_index,
                )
        if self.constraint is not None:
            e.metrics.structured_requests.labels(self.constraint.kind).inc()
        if isinstance(b, CompletionRequest) and b.echo:
            self.echoed = [(self._prompt_text(p, r.prompt_ids), r.prompt_ids)
                           for r, p in zip(job.requests, job.prompt_of, strict=True)]
        return job

    def guide(self, resume: list[int]) -> Guide:
        """A matcher for one choice of a constrained request, fed the tokens it resumes after: refused here,
        before anything is queued, when the grammar does not hold for this tokenizer or the tokens break it."""
        constraint = self.constraint
        assert constraint is not None
        try:
            return self.engine.structured.guide(constraint, resume)
        except StructuredError as exc:
            raise ApiError(400, str(exc), param="resume_output_ids") from None
        except ValueError as exc:
            raise ApiError(400, str(exc), param=constraint.param) from None

    async def pull(self, job: _Job, client: httpx.AsyncClient) -> None:
        """For a decode or pull request: fetch from the named peer the prompt blocks this pod lacks, so the
        engine computes only the rest. A failed, refused or damaged transfer is logged and counted, and the
        request simply computes its prompt: the client sees one answer either way."""
        transfer, e = self.body.kv_transfer, self.engine
        if transfer is None or transfer.mode == "prefill":
            return
        first = job.requests[0]
        bs = e.config.block_size
        limit = transfer.tokens if transfer.mode == "pull" else len(first.prompt_ids)
        wanted = await asyncio.to_thread(  # hashing a long prompt is work: off the event loop, like tokenizing
            block_hashes, first.prompt_ids[: (min(limit, len(first.prompt_ids) - 1) // bs) * bs], bs,
            first.extra, HashAlgo(e.config.hash_algo), e.config.hash_root)
        have = await asyncio.wrap_future(e.call(lambda: e.cached_run(wanted)))
        if have == len(wanted):
            return
        kind = "handoff" if transfer.mode == "decode" else "pull"
        key = f"import:{first.request_id}"
        try:
            pulled = await import_blocks(e, client, kind, transfer.source or "", wanted, have, key, transfer.handle)
        except TransferError as exc:
            log.warning("KV %s for %s failed, recomputing: %s", kind, first.request_id, exc)
            e.call(lambda: e.release(key))
            return
        except BaseException:  # cancelled mid-pull (the client left): the blocks reserved for it are nobody's
            e.call(lambda: e.release(key))
            raise
        first.import_key = key
        first.peer_tokens = len(pulled.hashes) * bs

    # ---- responses ----------------------------------------------------------------------------------------

    def _choice_delta(self, index: int, out: RequestOutput, first: bool) -> dict[str, Any]:
        choice = self._delta_body(index, out, first)
        if self.body.return_token_ids:
            choice["token_ids"] = out.new_token_ids
        return choice

    def _delta_body(self, index: int, out: RequestOutput, first: bool) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"content": out.new_text}
            if first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": out.finish_reason,
                                      "logprobs": None}
            if out.logprobs is not None:
                choice["logprobs"] = {"content": _chat_logprobs(self.engine, out)}
            return choice
        echo = first and isinstance(self.body, CompletionRequest) and self.body.echo
        text = self._echoed_text(index) + out.new_text if echo else out.new_text
        choice = {"index": index, "text": text, "finish_reason": out.finish_reason, "logprobs": None}
        entries = [*self._echoed_entries(index, out), *_token_entries([out])] if echo else _token_entries([out])
        if out.logprobs is not None or (echo and out.prompt_logprobs is not None):
            # text_offset goes on from the choice's earlier chunks, as unstreamed
            choice["logprobs"], self.streamed_text[index] = self._completion_logprobs(
                entries, self.streamed_text.get(index, 0))
        return choice

    def _echoed_text(self, index: int) -> str:
        return self.echoed[index][0]

    def _prompt_text(self, prompt_index: int, ids: list[int]) -> str:
        """The prompt text a choice echoes: as the client sent it, or its token ids decoded (those it kept, when
        truncate_prompt_tokens dropped some)."""
        prompt = self.body.prompt  # type: ignore[union-attr]
        if isinstance(prompt, str) and self.body.truncate_prompt_tokens is None:
            return prompt
        if isinstance(prompt[0], str) and self.body.truncate_prompt_tokens is None:
            return prompt[prompt_index]  # type: ignore[return-value]
        return self.engine.tokenizer.decode(ids, skip_special_tokens=False)

    def _echoed_entries(self, index: int, out: RequestOutput) -> list[_Entry]:
        """The prompt's tokens for an echoed choice's logprobs: the first has none (nothing comes before it)."""
        record = out.prompt_logprobs
        if record is None:
            return []
        ids = self.echoed[index][1]
        return [(ids[0], None, None),
                *zip(ids[1:], record.logprobs, record.top_logprobs, strict=True)]  # type: ignore[list-item]

    def _completion_logprobs(self, entries: list[_Entry], offset: int = 0) -> tuple[dict[str, Any], int]:
        """Completions' logprobs object for `entries` (token, its logprob, its top alternatives), their text_offset
        counted from `offset`; and the offset after them (where a stream's next chunk goes on)."""
        tokens, lps, tops, offsets = [], [], [], []
        for token, logprob, top in entries:
            name = _completion_token(self.engine, token)
            tokens.append(name)
            lps.append(logprob)
            # the token itself among its alternatives, as OpenAI's and vLLM's legacy completions give them (up to
            # k + 1 entries: lm-eval reads max(top_logprobs) against the token's own)
            tops.append(None if top is None or logprob is None else
                        {**{_completion_token(self.engine, tid): lp for tid, lp in top}, name: logprob})
            offsets.append(offset)
            offset += completion_token_length(name)  # as the router counts it on (text_offset_after)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    async def stream(self, job: _Job) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        started: set[int] = set()
        b = self.body
        mode = b.tool_mode if isinstance(b, ChatRequest) else None
        tool_streams = {i: ToolStream(mode, b.tool_names, b.named_tool,  # type: ignore[union-attr]
                                      b.parallel_tool_calls)  # type: ignore[union-attr]
                        for i in range(len(job.requests))} if mode else {}
        try:
            job.submit()
            while job.open:
                index, out = await job.next(self.http)
                if out.error and out.finish_reason not in ("stop", "length"):
                    yield f"data: {json.dumps(self._failure(job, index, out).body)}\n\n"
                    continue
                if out.finish_reason is not None:
                    finals[index] = out
                if not out.new_text and not out.new_token_ids and out.finish_reason is None:
                    continue
                choice = self._choice_delta(index, out, index not in started)
                if mode:
                    self._tool_delta(choice, tool_streams[index], out)
                    if not choice["delta"] and choice["finish_reason"] is None and choice["logprobs"] is None \
                            and "token_ids" not in choice:
                        continue  # auto holding back text that may open a call: nothing to send yet
                # a chat choice's finish_reason in a chunk of its own, as OpenAI's: one write, so a relaying
                # router never sees the delivered tokens without the end that follows them
                yield "".join(self._chunk([c]) for c in (finish_apart(choice) if self.chat else [choice]))
                started.add(index)
            if self.include_usage:
                yield self._chunk([], _usage(finals, job))
            yield "data: [DONE]\n\n"
        except ConnectionAbortedError:  # the client left: the stream ends there, no error (it was an ASGI traceback)
            job.abort()
        except (asyncio.CancelledError, GeneratorExit):
            job.abort()
            raise
        finally:
            if job.open:
                job.abort()

    def _failure(self, job: _Job, index: int, out: RequestOutput) -> ApiError:
        """Why a choice failed, as the client should read it: its adapter unloaded after the check (404), its
        constraint failing while generating (400: the grammar hit one of llguidance's limits; its matcher says
        so), else the engine's fault (500)."""
        assert out.error is not None
        if out.error_code == MODEL_NOT_FOUND:
            return ApiError(404, out.error, param="model", code=MODEL_NOT_FOUND)
        guide = job.requests[index].guide
        if guide is not None and guide.error() is not None and self.constraint is not None:
            return ApiError(400, out.error, param=self.constraint.param)
        return ApiError(500, out.error, code="engine_error")

    @staticmethod
    def _tool_delta(choice: dict[str, Any], stream: ToolStream, out: RequestOutput) -> None:
        """Rewrite a chat chunk's delta under a tool_choice: content only as the tool stream lets it through,
        tool_calls as they complete, finish_reason "tool_calls" when the choice ended with calls."""
        delta = stream.feed(out.new_text)
        if out.finish_reason is not None:
            last, choice["finish_reason"] = stream.finish(out.finish_reason)
            delta.content += last.content
            delta.tool_calls += last.tool_calls
        choice["delta"].pop("content", None)
        if delta.content:
            choice["delta"]["content"] = delta.content
        if delta.tool_calls:
            choice["delta"]["tool_calls"] = delta.tool_calls

    async def complete(self, job: _Job) -> dict[str, Any]:
        parts: dict[int, list[RequestOutput]] = {i: [] for i in range(len(job.requests))}
        job.submit()
        try:
            while job.open:
                index, out = await job.next(self.http)
                parts[index].append(out)
        except asyncio.CancelledError:
            job.abort()
            raise
        choices = []
        finals: dict[int, RequestOutput] = {}
        for index, outs in parts.items():
            final = outs[-1]
            finals[index] = final
            if final.error and final.finish_reason not in ("stop", "length"):
                raise self._failure(job, index, final)
            text = "".join(o.new_text for o in outs)
            if self.chat:
                choice: dict[str, Any] = {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": final.finish_reason,
                    "logprobs": None,
                }
                if isinstance(self.body, ChatRequest) and (mode := self.body.tool_mode):
                    choice["message"], choice["finish_reason"] = tool_message(
                        mode, text, self.body.tool_names, final.finish_reason, self.body.named_tool,
                        self.body.parallel_tool_calls)
                if final.logprobs is not None or any(o.logprobs for o in outs):
                    choice["logprobs"] = {"content": [x for o in outs for x in _chat_logprobs(self.engine, o)]}
            else:
                echo = isinstance(self.body, CompletionRequest) and self.body.echo
                choice = {"index": index, "text": self._echoed_text(index) + text if echo else text,
                          "finish_reason": final.finish_reason, "logprobs": None}
                echoed = [e for o in outs for e in self._echoed_entries(index, o)] if echo else []
                if echoed or any(o.logprobs for o in outs):
                    choice["logprobs"], _ = self._completion_logprobs(echoed + _token_entries(outs))
            if self.body.return_token_ids:
                choice["token_ids"] = [t for o in outs for t in o.new_token_ids]
            choices.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage(finals, job),
            **({KV_TRANSFER_FIELD: finals[0].kv_transfer} if finals[0].kv_transfer else {}),
        }


async def import_blocks(e: Engine, client: httpx.AsyncClient, kind: str, source: str, wanted: list[int], have: int,
                        key: str, handle: str | None = None) -> PulledBlocks:
    """Pull from `source` the blocks of the chain `wanted` after the first `have` (which this pod holds), and
    register them under their hashes, held under `key` until the caller releases it; counted in the transfer
    metrics under `kind`. Raises TransferError."""
    try:
        pulled = await _import_blocks(e, client, source, wanted, have, key, handle)
    except TransferError:
        e.metrics.transfers.labels(kind, "failed").inc()
        raise
    e.metrics.transfers.labels(kind, "ok").inc()
    e.metrics.transfer_bytes.labels("received").inc(pulled.nbytes)
    e.metrics.transfer_seconds.labels(kind).observe(pulled.seconds)
    return pulled


async def _import_blocks(e: Engine, client: httpx.AsyncClient, source: str, wanted: list[int], have: int, key: str,
                         handle: str | None) -> PulledBlocks:
    pulled = await pull_blocks(client, source, wanted[have:], e.frame_layout, handle, e.config.transfer_timeout_seconds)
    if not pulled.hashes:
        raise TransferError(f"{source} holds none of the blocks")
    ids = await asyncio.wrap_future(e.call(lambda: e.reserve_import(key, len(pulled.hashes))))
    if ids is None:
        raise TransferError("no room in this pod's KV cache for the pulled blocks")
    # the reserved blocks belong to nobody else until registered: fill them off the engine thread. A caller
    # cancelled meanwhile releases them only once the write is done (released earlier, they could go to another
    # request while this write still lands in them)
    writing = asyncio.ensure_future(asyncio.to_thread(e.write_blocks, ids, pulled.data))
    try:
        await asyncio.shield(writing)
    except asyncio.CancelledError:
        while not writing.done():  # a second cancel must not cut this wait short either
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([writing])
        raise
    parent = wanted[have - 1] if have else None
    await asyncio.wrap_future(e.call(lambda: e.finish_import(ids, pulled.hashes, parent)))
    return pulled


class LoadLoraRequest(BaseModel):
    lora_name: str = Field(pattern=LORA_NAME_PATTERN)
    lora_path: str = Field(min_length=1)
    # vLLM's: a name already loaded takes the new weights with no gap, its running requests finishing on the old
    load_inplace: bool = False


class UnloadLoraRequest(BaseModel):
    lora_name: str = Field(min_length=1)


@contextmanager
def _lora_errors() -> Iterator[None]:
    """An adapter the engine refuses answers 4xx with the engine's reason: 404 unknown, 409 busy or no free
    slot, 400 anything wrong with the adapter itself."""
    try:
        yield
    except LoraNotFound as exc:
        raise ApiError(404, str(exc), param="lora_name", code="lora_not_found") from None
    except LoraConflict as exc:
        raise ApiError(409, str(exc), param="lora_name", code="lora_conflict") from None
    except LoraError as exc:
        raise ApiError(400, str(exc), param="lora_path") from None


MAX_WARM_ERRORS = 5  # a warm-up's answer names this many failures, not one per chain


async def warm(e: Engine, client: httpx.AsyncClient, body: WarmRequest) -> WarmResponse:
    """Pull each chain's missing blocks from the peer, one chain at a time; a chain that fails is counted and
    the rest still run, so an unreachable peer costs a new pod only its warm-up, never an error."""
    out = WarmResponse()
    seen: set[int] = set()  # chains share prefixes: each block is counted once
    for chain in body.chains:
        have = await asyncio.wrap_future(e.call(lambda c=chain: e.cached_run(c)))
        out.blocks_present += sum(1 for h in chain[:have] if h not in seen)
        seen.update(chain)
        if have == len(chain):
            continue
        key = f"import:warm-{uuid.uuid4().hex}"
        try:
            pulled = await import_blocks(e, client, "warm", body.source, chain, have, key)
        except TransferError as exc:
            out.failed += 1
            if len(out.errors) < MAX_WARM_ERRORS:
                out.errors.append(str(exc))
            continue
        finally:
            await asyncio.wrap_future(e.call(lambda k=key: e.release(k)))  # pulled blocks stay cached, evictable
        out.blocks_pulled += len(pulled.hashes)
        if have + len(pulled.hashes) < len(chain):
            out.failed += 1
            if len(out.errors) < MAX_WARM_ERRORS:
                out.errors.append(f"{body.source} holds {have + len(pulled.hashes)} of a chain's {len(chain)} blocks")
    if out.failed:
        log.warning("KV warm-up from %s: %d of %d chains failed: %s", body.source, out.failed, len(body.chains),
                    "; ".join(out.errors))
    return out


def create_app(holder: EngineHolder, tracing: Tracing = OFF, on_exit: Callable[[], None] | None = None,
               token: InternalToken | None = None) -> FastAPI:
    """`on_exit` runs when the server stops, signal or not: uvicorn re-raises a SIGTERM once it has stopped, so
    nothing after `uvicorn.run` runs in a pod (`kvmesh serve` closes the engine and flushes its spans here).
    `token`: the pool's internal token (engine/internal_token.py), by default from the environment; asked of every
    caller and sent to peers."""
    token = token if token is not None else InternalToken.from_env()
    peers = httpx.AsyncClient(**INTERNAL_HTTP_CLIENT, timeout=httpx.Timeout(10.0, read=60.0),
                              auth=token)  # KV transfers from other pods

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await peers.aclose()
        if on_exit is not None:
            await asyncio.to_thread(on_exit)

    # a JSON body without a Content-Type header (requests.post(url, data=json.dumps(body))) is read as JSON, as
    # OpenAI and the router read it: FastAPI refuses it by default, with a message about the body's shape
    app = FastAPI(title="kvmesh engine", lifespan=lifespan, strict_content_type=False)

    def body_read_timeout() -> float:
        """The loaded engine's setting (every route answers 503 before it loads, a body read in time or not)."""
        return holder.engine.config.body_read_timeout_seconds if holder.engine else DEFAULT_BODY_READ_TIMEOUT_SECONDS

    def body_timed_out(scope: Scope) -> None:
        """A completion whose body never came in time ended in error (kvmesh_requests_total, as any that fails)."""
        if holder.engine is not None and scope["path"] in COMPLETION_ROUTES:
            holder.engine.metrics.requests.labels("error").inc()

    app.add_middleware(BodyDeadline, seconds=body_read_timeout, timed_out=body_timed_out)
    if token.enabled:  # added last: the outermost, so a caller without the token costs no body read
        app.add_middleware(RequireToken, token=token)

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(ChecksBusy)
    async def _checks_busy(_: HttpRequest, exc: ChecksBusy) -> JSONResponse:
        """No grammar checker free: this pod's overload, retryable (a router tries another pod)."""
        return JSONResponse(ApiError(503, str(exc), code="checks_busy").body, status_code=503,
                            headers={"Retry-After": str(exc.retry_after_seconds)})

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        problems = []
        param = None
        for err in exc.errors():
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = param or (loc[0] if loc else None)
            problems.append(validation_problem(loc, err))
        return JSONResponse(error_body("; ".join(problems[:5]), param=param), status_code=400)

    app.add_exception_handler(StarletteHTTPException, http_error_handler)  # type: ignore[arg-type]

    async def _serve(body: ChatRequest | CompletionRequest, http: HttpRequest, chat: bool) -> Response:
        handler = _Completions(holder.get(), chat, body, http)
        call = engine_call(tracing, http.headers, chat, body)  # None: tracing off
        job = await handler.job()
        await (handler.pull(job, peers) if call is None else call.timed_pull(handler.pull(job, peers)))
        if body.stream:
            lines = handler.stream(job)
            if call is not None:  # its span is built when the stream ends
                lines = call.relay(lines, handler.id, handler.model, job.requests, job.prompt_of)
            return HeldStream(lines, job.close, media_type="text/event-stream")
        try:
            return JSONResponse(await handler.complete(job))
        except ConnectionAbortedError:
            return Response(status_code=499)
        finally:
            if call is not None:
                call.finish(handler.id, handler.model, job.requests, job.prompt_of)

    @app.post(CHAT_COMPLETIONS_PATH)
    async def chat_completions(http: HttpRequest) -> Response:
        return await _serve(await parsed_body(http, ChatRequest), http, chat=True)

    @app.post(COMPLETIONS_PATH)
    async def completions(http: HttpRequest) -> Response:
        return await _serve(await parsed_body(http, CompletionRequest), http, chat=False)

    def model_cards() -> list[dict[str, Any]]:
        e = holder.get()
        return ([{"id": e.model_name, "object": "model", "created": 0, "owned_by": "kvmesh", "root": e.model_name,
                  "parent": None, "max_model_len": e.max_model_len}]
                + [{"id": a.name, "object": "model", "created": 0, "owned_by": "kvmesh", "root": a.path,
                    "parent": e.model_name, "max_model_len": e.max_model_len, LORA_FINGERPRINT_FIELD: a.fingerprint}
                   for a in list(e.loras.loaded.values())])

    @app.get(MODELS_PATH)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards()}

    @app.get(MODEL_PATH_PREFIX + "{model:path}")
    async def model(model: str) -> dict[str, Any]:
        """OpenAI's retrieve: one card of /v1/models (an adapter's name may hold "/"), 404 model_not_found."""
        for card in model_cards():
            if card["id"] == model:
                return card
        raise ApiError(404, f"The model '{model}' does not exist", param="model", code=MODEL_NOT_FOUND)

    @app.post(TOKENIZE_PATH)
    async def tokenize(http: HttpRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the ids a completion of this prompt or these messages would prefill."""
        body = await parsed_body(http, TokenizeRequest)  # its tools' schemas are checked
        e = holder.get()
        _check_model(e, body.model)
        try:  # off the loop, as a completion's prompt: a long one takes milliseconds
            ids = await asyncio.to_thread(body.token_ids, e.tokenizer)
        except ValueError as exc:
            raise ApiError(400, f"messages: {exc}", param="messages") from None
        return {"count": len(ids), "max_model_len": e.max_model_len, "tokens": ids}

    @app.post(DETOKENIZE_PATH)
    async def detokenize(http: HttpRequest) -> dict[str, Any]:
        body = await parsed_body(http, DetokenizeRequest)
        e = holder.get()
        _check_model(e, body.model)
        try:
            return {"prompt": await asyncio.to_thread(body.text, e.tokenizer)}
        except ValueError as exc:
            raise ApiError(400, str(exc), param="tokens") from None

    @app.post(LOAD_LORA_PATH)
    async def load_lora_adapter(http: HttpRequest) -> dict[str, Any]:
        """Read the adapter off the event loop, then take a slot on the engine thread (vLLM's endpoint)."""
        body = await parsed_body(http, LoadLoraRequest)
        e = holder.get()
        if body.lora_name in e.loras.loaded and not body.load_inplace:  # before reading files: answers fast
            raise ApiError(400, f"LoRA adapter {body.lora_name!r} is already loaded; unload it first, or load it "
                                f"with load_inplace", param="lora_name")
        with _lora_errors():
            adapter = await asyncio.to_thread(e.read_lora, body.lora_name, body.lora_path)
            entry = await asyncio.wrap_future(e.call(lambda: e.add_lora(adapter, body.load_inplace)))
        return {"lora_name": entry.name, "lora_path": entry.path, "rank": entry.rank,
                LORA_FINGERPRINT_FIELD: entry.fingerprint, "message": f"LoRA adapter {entry.name!r} loaded"}

    @app.post(UNLOAD_LORA_PATH)
    async def unload_lora_adapter(http: HttpRequest) -> dict[str, Any]:
        body = await parsed_body(http, UnloadLoraRequest)
        e = holder.get()
        with _lora_errors():
            entry = await asyncio.wrap_future(e.call(lambda: e.remove_lora(body.lora_name)))
        return {"lora_name": entry.name, "message": f"LoRA adapter {entry.name!r} unloaded"}

    reported_stall: list[float | None] = [None]  # the start of the last stalled step logged: once per step

    def stalled() -> JSONResponse | None:
        """The 503 of an engine whose step has run past its stall timeout (None: steps progress)."""
        engine = holder.engine
        seconds = engine.stalled_for() if engine is not None else None
        if engine is None or seconds is None:
            return None
        if reported_stall[0] != (step := engine.step_started):  # not at every probe: once, with where it hangs
            reported_stall[0] = step
            log.error("engine stalled: its step has run for %.0f s, in\n%s", seconds, engine.step_stack())
        return JSONResponse({"status": HEALTH_STALLED, "message": f"a step has run for {seconds:.0f} s "
                             f"(stall_timeout_seconds {engine.config.stall_timeout_seconds:g})"}, status_code=503)

    @app.get(LIVENESS_PATH)
    async def livez() -> JSONResponse:
        """The liveness probe's: 200 while this process answers and its steps progress, loading, warming and
        draining included (none of those is fixed by a restart); 503 once stalled."""
        return stalled() or JSONResponse({"status": "alive"})

    @app.get("/health")
    async def health() -> JSONResponse:
        if holder.engine is None:
            return JSONResponse({"status": "error" if holder.error else HEALTH_LOADING, "error": holder.error},
                                status_code=503)
        if (stuck := stalled()) is not None:
            return stuck
        if holder.engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if holder.gate is not None and holder.gate.closed():
            return JSONResponse({"status": HEALTH_WARMING, "seconds_left": round(holder.gate.seconds_left(), 1),
                                 "message": f"waiting for a warm-up (POST {KV_WARM_PATH}) or POST {READY_PATH}"},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.post(READY_PATH)
    async def ready() -> dict[str, Any]:
        """The operator has nothing to warm this pod with: serve now (a pod without a gate is unaffected)."""
        gate = holder.loaded_gate()
        gate.open("nothing_to_copy")
        return {"warming": False, "opened": gate.reason}

    @app.post(DRAIN_PATH)
    async def drain() -> dict[str, Any]:
        e = holder.get()
        e.draining = True
        return {"draining": True, "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting)}

    @app.get("/metrics")
    async def metrics() -> Response:
        """Also while the model loads (kvmesh_engine_loading 1): the pod is starting, not down. A failed load
        answers 503, as every route: that engine will not serve."""
        loading = holder.engine is None and holder.error is None
        text = holder.loading_metrics.render() if loading else holder.get().metrics.render()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get(KV_CONFIG_PATH)
    async def kv_config() -> dict[str, Any]:
        return holder.get().kv_config.to_json()

    @app.post(KV_FETCH_PATH)
    async def kv_fetch(http: HttpRequest) -> Response:
        """Cached blocks by hash, in frames of many blocks, for a peer (docs/contracts.md, contract 4)."""
        body = await parsed_body(http, FetchRequest)
        e = holder.get()
        try:
            key, ids = await asyncio.wrap_future(e.call(lambda: e.pin_for_send(body.block_hashes, body.handle)))
        except LookupError as exc:
            raise ApiError(410, str(exc), param="handle", code="handle_expired") from None
        if len(ids) < len(body.block_hashes):  # the rest may be in the host or disk tier: load it first
            try:
                have = len(ids)
                loading = await asyncio.wrap_future(e.call(lambda: e.promote_for_send(key, body.block_hashes, have)))
                if loading is not None:  # bounded as a pull is: a copy that never lands must not pin blocks
                    ids = ids + await asyncio.wait_for(asyncio.wrap_future(loading), e.config.transfer_timeout_seconds)
            except BaseException:
                e.call(lambda: e.release(key))
                raise
        hashes = body.block_hashes[: len(ids)]
        frame = e.config.transfer_frame_blocks
        start, sent, outcome = time.perf_counter(), 0, "failed"

        async def frames() -> AsyncIterator[bytes]:
            nonlocal sent, outcome
            for i in range(0, len(ids), frame):
                data = await asyncio.to_thread(e.read_frame, ids[i : i + frame], hashes[i : i + frame])
                sent += len(data)
                yield data
            outcome = "ok"
            if body.handle is not None:
                e.call(lambda: e.drop_handle(body.handle))

        def ended() -> None:  # however the response ended, its body started or not
            e.call(lambda: e.release(key))
            e.metrics.transfers.labels("serve", outcome).inc()
            e.metrics.transfer_bytes.labels("sent").inc(sent)
            e.metrics.transfer_seconds.labels("serve").observe(time.perf_counter() - start)

        return HeldStream(frames(), ended, media_type="application/octet-stream",
                          headers={"x-kvmesh-blocks": str(len(ids))})

    @app.post(KV_RELEASE_PATH)
    async def kv_release(http: HttpRequest) -> dict[str, Any]:
        """The router gave up on a handoff (no decode pod took it): its blocks are unpinned now, not at its TTL;
        they stay cached."""
        body = await parsed_body(http, ReleaseRequest)
        e = holder.get()
        await asyncio.wrap_future(e.call(lambda: e.drop_handle(body.handle)))
        return {"released": body.handle}

    @app.get(KV_HOT_PATH)
    async def kv_hot(limit: int = Query(HOT_CHAINS_DEFAULT, ge=1, le=HOT_CHAINS_MAX)) -> dict[str, Any]:
        """The hottest cached prefix chains, for a peer's warm-up."""
        e = holder.get()
        chains = await asyncio.wrap_future(e.call(lambda: e.hot_chains(limit)))
        return HotResponse(chains=[HotChainBody(hashes=c.hashes, hits=c.hits) for c in chains]).model_dump()

    @app.post(KV_WARM_PATH)
    async def kv_warm(http: HttpRequest) -> dict[str, Any]:
        body = await parsed_body(http, WarmRequest)
        e, gate = holder.get(), holder.loaded_gate()  # both set together once the model loads
        outcome = "warm_failed"
        try:
            answer = await warm(e, peers, body)
            outcome = "warm_failed" if answer.failed else "warmed"
            return answer.model_dump()
        finally:  # the first warm-up opens the gate however it ended: the pod computes what it lacks
            gate.open(outcome)

    @app.get(KV_BLOCKS_PATH)
    async def kv_blocks() -> dict[str, Any]:
        return asdict(holder.get().events.snapshot())

    @app.get(KV_EVENTS_PATH)
    async def kv_events(after: int = 0, boot_id: str | None = None) -> StreamingResponse:
        e = holder.get()
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        async def lines() -> AsyncIterator[str]:
            last, boot = after, boot_id
            # subscribed here, not before the response: a body never started (the client left as it began)
            # never runs its `finally`, and would leave its listener called on every step for good
            unsubscribe = e.events.subscribe(lambda: loop.call_soon_threadsafe(wake.set))
            try:
                while True:
                    wake.clear()
                    batches = e.events.read(last, boot)
                    for batch in batches:
                        yield json.dumps(batch.to_json()) + "\n"
                        last, boot = batch.seq, batch.boot_id
                    if not batches:
                        try:
                            await asyncio.wait_for(wake.wait(), EVENTS_HEARTBEAT_SECONDS)
                        except TimeoutError:
                            yield json.dumps({"boot_id": e.events.boot_id, "seq": last, "events": [],
                                              "heartbeat": True}) + "\n"
            finally:
                unsubscribe()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app
