"""vLLM's `/tokenize` and `/detokenize` on the router: answered with the router's own tokenizer (the engines', as the
router checks their fingerprints), so counting a prompt's tokens costs no engine any work."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from kvmesh.engine.model.tokenizer import Tokenizer
from kvmesh.engine.openai_types import (
    MODEL_NOT_FOUND,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    validation_problems,
)
from kvmesh.engine.protocol import DETOKENIZE_PATH, TOKENIZE_PATH
from kvmesh.router.auth import unauthorized_body
from kvmesh.router.config import INLINE_TOKENIZE_BYTES, MAX_REQUEST_BODY_BYTES


def unknown_model(model: str, served: set[str]) -> str:
    """The 404 message for a model the pool does not serve (the completion routes and these say it alike)."""
    return f"The model `{model}` does not exist; this pool serves {', '.join(sorted(served))}"


def tokenize_routes(tokenizer: Tokenizer, tenant_for: Callable[[str | None], str | None],
                    models: Callable[[], dict[str, Any]]) -> APIRouter:
    """`tenant_for(authorization header)`: the tenant of a valid key (None: 401); `models()`: the pool's
    `/v1/models` answer, for the model check and `max_model_len`."""
    api = APIRouter()

    async def parse(http: HttpRequest, kind: type[BaseModel]) -> tuple[Any, bool] | JSONResponse:
        """The body as `kind` and whether it is large (worked on in a thread, as admission does), or the
        JSONResponse that refuses the call (401 before a byte is read, 413 past the body bound, 400, 404)."""
        if tenant_for(http.headers.get("authorization")) is None:
            return JSONResponse(unauthorized_body(), status_code=401)
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > MAX_REQUEST_BODY_BYTES:
                return JSONResponse(error_body(f"the request body exceeds {MAX_REQUEST_BODY_BYTES >> 20} MiB"),
                                    status_code=413)
            chunks.append(chunk)
        payload, large = b"".join(chunks), size > INLINE_TOKENIZE_BYTES
        try:
            body = await asyncio.to_thread(kind.model_validate_json, payload) if large else \
                kind.model_validate_json(payload)
        except ValidationError as exc:
            return JSONResponse(error_body(validation_problems(exc)), status_code=400)
        cards = models()["data"]
        served = {card["id"] for card in cards}
        if body.model is not None and served and body.model not in served:
            return JSONResponse(error_body(unknown_model(body.model, served), code=MODEL_NOT_FOUND), status_code=404)
        return body, large

    def max_model_len(model: str | None) -> int | None:
        cards = models()["data"]
        card = next((c for c in cards if c["id"] == model), None) if model else None
        card = card or next((c for c in cards if c.get("parent") is None), None)
        return None if card is None else card.get("max_model_len")

    async def answer(http: HttpRequest, kind: type[BaseModel], work: Callable[[Any], dict[str, Any]],
                     param: str) -> Any:
        """Parse and check the call, then `work(body)` (in a thread for a large body, as admission tokenizes: the
        event loop routes meanwhile); its ValueError is the client's 400 on `param`."""
        parsed = await parse(http, kind)
        if isinstance(parsed, JSONResponse):
            return parsed
        body, large = parsed
        try:
            return await asyncio.to_thread(work, body) if large else work(body)
        except ValueError as exc:
            return JSONResponse(error_body(str(exc), param=param), status_code=400)

    def count(body: TokenizeRequest) -> dict[str, Any]:
        try:
            ids = body.token_ids(tokenizer)
        except ValueError as exc:  # the chat template refused the messages: said as the engine says it
            raise ValueError(f"messages: {exc}") from None
        return {"count": len(ids), "max_model_len": max_model_len(body.model), "tokens": ids}

    @api.post(TOKENIZE_PATH)
    async def tokenize(http: HttpRequest) -> Any:
        return await answer(http, TokenizeRequest, count, "messages")

    @api.post(DETOKENIZE_PATH)
    async def detokenize(http: HttpRequest) -> Any:
        return await answer(http, DetokenizeRequest, lambda body: {"prompt": body.text(tokenizer)}, "tokens")

    return api
