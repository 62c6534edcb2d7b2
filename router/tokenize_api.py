"""vLLM's `/tokenize` and `/detokenize` on the router: answered with the router's own tokenizer (the engines', as the
router checks their fingerprints), so counting a prompt's tokens costs no engine any work. The router's work is a
tenant's like a completion's: admitted under its limits (a request, a concurrency slot while it runs, the tokens
counted charged), and bounded to a few times the model's context (`body_bound`, which bounds a completion's body
too)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from kvmesh.engine.constraint import ChecksBusy, parse_off_loop
from kvmesh.engine.model.token_cache import CACHE_SCOPE
from kvmesh.engine.model.tokenizer import Tokenizer
from kvmesh.engine.openai_types import (
    CONTEXT_LENGTH_CODE,
    MODEL_NOT_FOUND,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    validation_problems,
)
from kvmesh.engine.protocol import DETOKENIZE_PATH, TOKENIZE_PATH
from kvmesh.router.asgi import OVERLOADED_CODE, RouteError, error_response
from kvmesh.router.auth import unauthorized_body
from kvmesh.router.config import INLINE_TOKENIZE_BYTES, MAX_REQUEST_BODY_BYTES
from kvmesh.router.limits import Lease

# What one call may make the router count, so that a huge prompt costs no more than a prompt the pool could serve
# (an 18 MiB one took 68 s of CPU and answered 10.8 M ids): at most this many times the model's max_model_len tokens
# (a prompt somewhat over it is still worth counting: how far over), and a body of at most this many bytes for each
# of those (text runs about 4 bytes a token; JSON escapes and chat messages add some), known before it is read.
TOKENIZE_MAX_MODEL_LENS = 4
TOKENIZE_BYTES_PER_TOKEN = 6
FALLBACK_MAX_MODEL_LEN = 32768  # before any pod has said its max_model_len


def body_bound(cards: list[dict[str, Any]], prompts: int = 1) -> int:
    """The most bytes a body the router counts may have (a /tokenize call, a completion it admits), for up to
    `prompts` prompts in it (a legacy completion's list of them): TOKENIZE_BYTES_PER_TOKEN for each of the tokens
    counted at most, under the router's bound on any body. Known before the body (and its model) is read, so the
    longest context the pool serves (`cards`, its model cards) sets it."""
    lengths = [card.get("max_model_len") for card in cards]
    longest = max((n for n in lengths if isinstance(n, int)), default=FALLBACK_MAX_MODEL_LEN)
    return min(TOKENIZE_BYTES_PER_TOKEN * TOKENIZE_MAX_MODEL_LENS * longest * prompts, MAX_REQUEST_BODY_BYTES)


def past_body_bound(bound: int, what: str = "the request body") -> str:
    """The message of a body (or one prompt in it) over `body_bound`: the bound and why (its code is
    CONTEXT_LENGTH_CODE)."""
    return (f"{what} exceeds {bound} bytes, the most this pool counts: {TOKENIZE_BYTES_PER_TOKEN} bytes "
            f"for each of {TOKENIZE_MAX_MODEL_LENS} times its longest max_model_len in tokens; a prompt this long "
            "could never be served")


def unknown_model(model: str, served: set[str]) -> str:
    """The 404 message for a model the pool does not serve (the completion routes and these say it alike)."""
    if not served:  # no engine has said what it serves yet (the pool starting, every pod down)
        return f"The model `{model}` does not exist; this pool serves no model yet (no engine has listed one)"
    return f"The model `{model}` does not exist; this pool serves {', '.join(sorted(served))}"


def checks_busy(exc: ChecksBusy, headers: Mapping[str, str] | None = None) -> RouteError:
    """The refusal of a request whose grammar no checker was free for (engine/constraint.py), on these routes and
    the completion routes alike: the router's overload, not the request's fault, so a 429 with Retry-After, as a
    shed request's, which clients retry (a 400 they would not)."""
    return RouteError(429, str(exc), code=OVERLOADED_CODE, kind="rate_limit_error",
                      headers={**(headers or {}), "retry-after": str(exc.retry_after_seconds)})


def tokenize_routes(tokenizer: Tokenizer, tenant_for: Callable[[str | None], str | None],
                    models: Callable[[], dict[str, Any]],
                    admit: Callable[[str, int | None], Lease] | None = None) -> APIRouter:
    """`tenant_for(authorization header)`: the tenant of a valid key (None: 401); `models()`: the pool's
    `/v1/models` answer, for the model check and `max_model_len`; `admit(tenant, tokens)`: the tenant's limits
    (Router.admit_call: RouteError 429 over them), taken before the body is read, so a tenant over its limits
    costs no tokenizing."""
    api = APIRouter()

    def max_model_len(model: str | None) -> int | None:
        cards = models()["data"]
        card = next((c for c in cards if c["id"] == model), None) if model else None
        card = card or next((c for c in cards if c.get("parent") is None), None)
        return None if card is None else card.get("max_model_len")

    async def parse(http: HttpRequest, kind: type[BaseModel]) -> tuple[Any, bool] | JSONResponse:
        """The body as `kind` and whether it is large (worked on in a thread, as admission does), or the
        JSONResponse that refuses the call (400 past the body bound, 400, 404)."""
        chunks, size, bound = [], 0, body_bound(models()["data"])
        async for chunk in http.stream():
            size += len(chunk)
            if size > bound:
                return too_long(past_body_bound(bound))
            chunks.append(chunk)
        payload, large = b"".join(chunks), size > INLINE_TOKENIZE_BYTES
        try:  # in a thread whatever its size: a tool's schema is a grammar to check, which may take seconds
            body = await parse_off_loop(kind.model_validate_json, payload)
        except ValidationError as exc:
            return JSONResponse(error_body(validation_problems(exc)), status_code=400)
        except ChecksBusy as exc:
            return error_response(checks_busy(exc))
        cards = models()["data"]
        served = {card["id"] for card in cards}
        if body.model is not None and served and body.model not in served:
            return JSONResponse(error_body(unknown_model(body.model, served), param="model", code=MODEL_NOT_FOUND),
                                status_code=404)
        return body, large

    async def answer(http: HttpRequest, kind: type[BaseModel], work: Callable[[Any], tuple[dict[str, Any], int]],
                     param: str) -> Any:
        """Authenticate and take the tenant's limits (one request, one token, a concurrency slot while the call
        runs), parse and check the call, then `work(body)` (in a thread for a large body, as admission tokenizes:
        the event loop routes meanwhile), whose second value, the tokens counted, is charged to the tenant as a
        completion's prompt is; its ValueError is the client's 400 on `param`."""
        tenant = tenant_for(http.headers.get("authorization"))
        if tenant is None:
            return JSONResponse(unauthorized_body(), status_code=401)
        try:
            lease = admit(tenant, 1) if admit is not None else None
        except RouteError as exc:
            return error_response(exc)
        spent = 0
        CACHE_SCOPE.set(tenant)  # one tenant's texts never tokenize, nor its tools' schemas check, faster for another
        try:
            parsed = await parse(http, kind)
            if isinstance(parsed, JSONResponse):
                return parsed
            body, large = parsed
            try:
                result, spent = await asyncio.to_thread(work, body) if large else work(body)
            except ValueError as exc:
                return JSONResponse(error_body(str(exc), param=param), status_code=400)
            if spent > (most := TOKENIZE_MAX_MODEL_LENS * (max_model_len(body.model) or FALLBACK_MAX_MODEL_LEN)):
                return too_long(f"the prompt has {spent} tokens; this pool counts at most {most} "
                                f"({TOKENIZE_MAX_MODEL_LENS} times its max_model_len): it could never be served")
            return JSONResponse(result, headers=lease.headers if lease is not None else None)
        finally:
            if lease is not None:
                lease.close(max(spent - 1, 0))  # the one token taken at admission, and the rest counted

    def count(body: TokenizeRequest) -> tuple[dict[str, Any], int]:
        try:
            ids = body.token_ids(tokenizer)
        except ValueError as exc:  # the chat template refused the messages: said as the engine says it
            raise ValueError(f"messages: {exc}") from None
        return {"count": len(ids), "max_model_len": max_model_len(body.model), "tokens": ids}, len(ids)

    def text(body: DetokenizeRequest) -> tuple[dict[str, Any], int]:
        return {"prompt": body.text(tokenizer)}, len(body.tokens)

    @api.post(TOKENIZE_PATH)
    async def tokenize(http: HttpRequest) -> Any:
        return await answer(http, TokenizeRequest, count, "messages")

    @api.post(DETOKENIZE_PATH)
    async def detokenize(http: HttpRequest) -> Any:
        return await answer(http, DetokenizeRequest, text, "tokens")

    return api


def too_long(message: str) -> JSONResponse:
    """The 400 of a call past what /tokenize counts, as OpenAI says a prompt past the context: its code."""
    return JSONResponse(error_body(message, code=CONTEXT_LENGTH_CODE), status_code=400)
