"""The Responses API's HTTP edge: `/v1/responses` as OpenAI's clients call it.

A response request becomes a chat request (router/responses.py) that takes the router's own path for chat
completions (admission, tenant limits, the prefix- and load-aware choice, migration of a broken stream), so a
continuation, whose earlier turns come first, goes to the pod that holds them. Answers are stored per tenant
(router/responses_store.py) unless the request says `store: false`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmesh.engine.openai_types import error_body, read_json
from kvmesh.router.asgi import RouteError, error_response
from kvmesh.router.auth import tenant_hash, unauthorized_body
from kvmesh.router.batches import RESPONSES_PATH, new_id, whole_number
from kvmesh.router.config import MAX_REQUEST_BODY_BYTES
from kvmesh.router.limits import Lease
from kvmesh.router.responses import (
    RESPONSE_ID_PREFIX,
    ResponsesError,
    chat_request,
    input_items,
    response_error,
    response_object,
    turn_messages,
)
from kvmesh.router.responses_store import ResponseStore, StoredResponse
from kvmesh.router.responses_stream import ResponseEvents, sse

log = logging.getLogger(__name__)

STORE_THREADS = 4  # store calls at once per replica; more wait (a database away holds at most these)
STORE_OPERATIONS = ("read", "write")  # the label of kvmesh_router_response_store_errors_total
MAX_ITEMS_PAGE = 100  # OpenAI's bound on a page of input items
DEFAULT_ITEMS_PAGE = 20
# A chat request through the router's own path: (its tenant's limits, opened already; the chat body; the client's
# HTTP request, whose headers it keeps: a priority, a trace context).
SendChat = Callable[[Lease, dict[str, Any], HttpRequest], Awaitable[Response]]


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, "invalid_request_error", param, code), status_code=status)


def _renamed_error(answer: Response) -> Response:
    """The chat path's refusal of a response request, its error naming the fields the client sent
    (responses.response_error); a body that is no OpenAI error passes as it came."""
    try:
        body = json.loads(bytes(answer.body))
    except (ValueError, AttributeError):
        return answer
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return answer
    headers = {name: value for name, value in answer.headers.items() if name not in ("content-length", "content-type")}
    return JSONResponse({**body, "error": response_error(body["error"])}, status_code=answer.status_code,
                        headers=headers)


class StoreUnavailable(Exception):
    """The stored responses could not be read or written (the pool's database away): a 503, never a crash."""


def _unavailable() -> JSONResponse:
    return JSONResponse(error_body("the stored responses cannot be read now (the pool's database is unavailable); "
                                   "retry later", "server_error", code="store_unavailable"),
                        status_code=503, headers={"retry-after": "5"})


def _not_found(response_id: str, hint: str, param: str | None = None) -> JSONResponse:
    code = "previous_response_not_found" if param else "not_found"
    return _error(404, f"No response found with id '{response_id}'.{hint}", param, code)


async def _bounded_body(http: HttpRequest) -> bytes | None:
    """The body, read as it comes; None past MAX_REQUEST_BODY_BYTES (the completions' bound), so a client with a
    key cannot make the router hold a body of any size."""
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > MAX_REQUEST_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def items_page(items: list[dict[str, Any]], limit: int, after: str | None, newest_first: bool) -> dict[str, Any]:
    """OpenAI's list object of a response's input items, `limit` after the item `after`."""
    ordered = list(reversed(items)) if newest_first else list(items)
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ResponsesError(f"after: no input item with id '{after}'", "after")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}


@dataclass(frozen=True)
class Turn:
    """A response request made ready to send: whose, its chat request, the id its answer will carry, and the
    earlier turns' messages its prompt starts with."""

    owner: str  # the tenant's pseudonym (auth.tenant_hash), what stored responses are keyed by
    body: dict[str, Any]
    chat: dict[str, Any]
    response_id: str
    created_at: int
    history: list[dict[str, Any]]


class Responses:
    """What `POST /v1/responses` does, for the HTTP edge and the batch runner alike: read the earlier turns, send
    the chat request through the router (`send`), build and store the response."""

    def __init__(self, store: ResponseStore, failed: Callable[[str], None] = lambda operation: None) -> None:
        self.store, self.failed = store, failed  # failed(one of STORE_OPERATIONS): counted for the alert
        # threads of its own: a hung database holds these, not the default pool that tokenizes large requests
        self.threads = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="response-store")

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    async def use(self, operation: str, call: Callable[..., Any], *args: Any) -> Any:
        """`call(*args)` on the store in one of its threads; StoreUnavailable (counted, logged) when it fails."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.threads, functools.partial(call, *args))
        except Exception as exc:
            self.failed(operation)
            log.warning("the response store failed (%s): %s", operation, exc)
            raise StoreUnavailable from exc

    async def turn(self, tenant: str, body: Any) -> Turn | JSONResponse:
        """The request ready to send, or the 4xx that refuses it (a bad field, an unknown previous response)."""
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        owner, history = tenant_hash(tenant), []
        if (previous := body.get("previous_response_id")) is not None:
            try:
                earlier = await self.use("read", self.store.history, owner, str(previous))
            except StoreUnavailable:
                return _unavailable()
            if earlier is None:
                return _not_found(str(previous), self.store.not_found_hint, "previous_response_id")
            history = earlier
        try:
            chat = chat_request(body, history)
        except ResponsesError as exc:
            return _error(400, str(exc), exc.param)
        return Turn(owner, body, chat, new_id(RESPONSE_ID_PREFIX), int(time.time()), history)

    async def save(self, turn: Turn, completion: Mapping[str, Any], response: dict[str, Any]) -> None:
        """Store an answered response unless told not to; a database away loses only the stored copy, never the
        client's answer."""
        if not turn.body.get("store", True):
            return
        with contextlib.suppress(StoreUnavailable):  # a continuation of it will not find it
            await self.use("write", self.store.save, turn.owner,
                           StoredResponse(response, input_items(turn.body, turn.response_id)), turn.history,
                           turn_messages(turn.body, completion))

    async def whole(self, turn: Turn, send: Callable[[dict[str, Any]], Awaitable[Response]]) -> Response:
        """The answer as one response object (an error from the chat path as it came)."""
        answer = await send(turn.chat)
        if answer.status_code != 200:
            return _renamed_error(answer)
        completion = json.loads(bytes(answer.body))
        response = response_object(turn.response_id, turn.body, completion, turn.created_at)
        await self.save(turn, completion, response)
        return JSONResponse(response, headers={name: value for name, value in answer.headers.items()
                                               if name.startswith("x-")})  # the pod, the tenant's limits

    async def streamed(self, turn: Turn, send: Callable[[dict[str, Any]], Awaitable[Response]]) -> Response:
        """The answer as the Responses API's event stream over the relayed chat stream."""
        answer = await send({**turn.chat, "stream": True, "stream_options": {"include_usage": True}})
        if not isinstance(answer, StreamingResponse):  # refused before a byte was sent: its error, as sent
            return _renamed_error(answer)
        events = ResponseEvents(turn.response_id, turn.body, turn.created_at)

        async def saved(response: dict[str, Any]) -> None:
            await self.save(turn, events.completion(), response)

        answer.body_iterator = _events(answer.body_iterator, events, saved)
        return answer

    async def answer(self, tenant: str, body: Any, send: Callable[[dict[str, Any]], Awaitable[Response]]) -> Response:
        """A whole answer to `body` (a batch's request: batches never stream)."""
        turn = await self.turn(tenant, body)
        return turn if isinstance(turn, Response) else await self.whole(turn, send)


def response_routes(responses: Responses, tenant_for: Callable[[str | None], str | None], send_chat: SendChat,
                    open_limits: Callable[[str], Lease], admit: Callable[[str, int | None], Lease]) -> APIRouter:
    """The endpoints; `tenant_for(authorization header)` is the tenant of a valid key (None: refused). Every call
    is under the tenant's limits before it reads the store (RouteError 429 over them): a creation opens them as a
    completion does (`open_limits`, Router.open: a request and a concurrency slot, held through the history read
    and handed to the chat path, which takes the prompt's tokens); a read or a delete takes a request and a slot
    while it runs, and no tokens (`admit(tenant, None)`, Router.admit_call, as the Files API's calls)."""
    api, store = APIRouter(), responses.store

    async def on_store(http: HttpRequest, operation: str, call: Callable[[str, str], Any], response_id: str) -> Any:
        """`call(tenant pseudonym, response_id)` for the caller's tenant, or the Response that ends the request (401
        without a valid key, 429 over its limits, 503 with the store away)."""
        tenant = tenant_for(http.headers.get("authorization"))
        if tenant is None:
            return JSONResponse(unauthorized_body(), status_code=401)
        try:
            lease = admit(tenant, None)
        except RouteError as exc:
            return error_response(exc)
        http.state.limits = lease.headers  # for the answer (`limited`)
        try:
            return await responses.use(operation, call, tenant_hash(tenant), response_id)
        except StoreUnavailable:
            return _unavailable()
        finally:
            lease.close()

    def limited(route: Callable[[HttpRequest, str], Awaitable[Response]]
                ) -> Callable[[HttpRequest, str], Awaitable[Response]]:
        """A read's or a delete's answer with the tenant's x-ratelimit-* headers as its call took them, as every
        answer under a tenant's limits carries them."""
        @functools.wraps(route)
        async def answered(http: HttpRequest, response_id: str) -> Response:
            response = await route(http, response_id)
            response.headers.update(getattr(http.state, "limits", {}))
            return response
        return answered

    async def stored(http: HttpRequest, response_id: str) -> StoredResponse | Response:
        found = await on_store(http, "read", store.get, response_id)
        return _not_found(response_id, store.not_found_hint) if found is None else found

    @api.post(RESPONSES_PATH)
    async def create(http: HttpRequest) -> Response:
        tenant = tenant_for(http.headers.get("authorization"))
        if tenant is None:
            return JSONResponse(unauthorized_body(), status_code=401)
        try:
            lease = open_limits(tenant)
        except RouteError as exc:
            return error_response(exc)
        sent = False

        async def send(chat: dict[str, Any]) -> Response:
            nonlocal sent
            sent = True  # the chat path holds the lease from here, and closes it
            return await send_chat(lease, chat, http)

        try:
            answer = await _created(http, tenant, send)
            if not sent:  # refused before the chat path (which sends them itself), still charged: the tenant's
                answer.headers.update(lease.headers)  # x-ratelimit-*, as on every answer
            return answer
        finally:
            if not sent:
                lease.close()

    async def _created(http: HttpRequest, tenant: str, send: Callable[[dict[str, Any]], Awaitable[Response]]
                       ) -> Response:
        """`create` under the tenant's opened limits: the body read and checked, the history read, the answer."""
        payload = await _bounded_body(http)
        if payload is None:
            return _error(413, f"the request body exceeds {MAX_REQUEST_BODY_BYTES >> 20} MiB")
        try:
            body = read_json(payload)  # a bounded nesting depth: json.loads hit the recursion limit (a 500)
        except ValueError as exc:
            return _error(400, str(exc))
        turn = await responses.turn(tenant, body)
        if isinstance(turn, Response):
            return turn
        return await (responses.streamed if body.get("stream") else responses.whole)(turn, send)

    @api.get(RESPONSES_PATH + "/{response_id}")
    @limited
    async def retrieve(http: HttpRequest, response_id: str) -> Response:
        found = await stored(http, response_id)
        return found if isinstance(found, Response) else JSONResponse(found.response)

    @api.get(RESPONSES_PATH + "/{response_id}/input_items")
    @limited
    async def list_input_items(http: HttpRequest, response_id: str) -> Response:
        found = await stored(http, response_id)
        if isinstance(found, Response):
            return found
        raw, order = http.query_params.get("limit", str(DEFAULT_ITEMS_PAGE)), http.query_params.get("order", "desc")
        limit = whole_number(raw)
        if limit is None or not 1 <= limit <= MAX_ITEMS_PAGE:
            return _error(400, f"limit must be a whole number from 1 to {MAX_ITEMS_PAGE}", "limit")
        if order not in ("asc", "desc"):
            return _error(400, f"order must be asc or desc, not {order!r}", "order")
        try:
            return JSONResponse(items_page(found.input_items, limit, http.query_params.get("after"),
                                           order == "desc"))
        except ResponsesError as exc:
            return _error(400, str(exc), exc.param)

    @api.delete(RESPONSES_PATH + "/{response_id}")
    @limited
    async def remove(http: HttpRequest, response_id: str) -> Response:
        deleted = await on_store(http, "write", store.delete, response_id)
        if isinstance(deleted, Response):
            return deleted
        if not deleted:
            return _not_found(response_id, store.not_found_hint)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return api


async def _events(lines: AsyncIterator[str | bytes], events: ResponseEvents,
                  saved: Callable[[dict[str, Any]], Awaitable[None]]) -> AsyncIterator[str]:
    """A relayed chat stream's SSE lines as response events. The closing events wait for the relay's end (its pod
    and the tenant's slot given back, so a slow store holds neither) and for the stored copy (`saved`: a client
    that continues on `response.completed` finds it)."""
    for event in events.start():
        yield sse(event)
    pending, done, failure = "", False, None
    async for piece in lines:  # read to its end: the relay counts a stream cut short as a client gone
        pending += piece.decode() if isinstance(piece, bytes) else piece
        *whole, pending = pending.split("\n")
        for line in whole:
            if done or failure is not None:
                continue
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:  # no pod could finish the answer (router/app.py's relay)
                    failure = chunk["error"]
                    continue
                for event in events.on_chunk(chunk):
                    yield sse(event)
            elif line == "data: [DONE]":
                done = True
    if failure is not None:
        for event in events.fail(failure):
            yield sse(event)
    elif done:
        closing = list(events.finish())
        assert events.result is not None  # finish() sets it
        await saved(events.result)
        for event in closing:
            yield sse(event)
