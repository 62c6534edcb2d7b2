"""What both of the router's plain-ASGI edges share: the router's completion routes (router/app.py) and
`kvmesh gateway` (router/gateway_app.py). Torch-free and light, so the gateway imports no router app."""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.responses import JSONResponse
from starlette.types import Receive

from kvmesh.engine.openai_types import error_body

# the error code of a 429 the router answers its own overload with: a request the overloaded pool sheds
# (router/shed.py), a grammar no checker was free for (engine/constraint.py)
OVERLOADED_CODE = "overloaded"


class RouteError(Exception):
    """A request refused before an engine answered it: its status, OpenAI-style message, code and type."""

    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error",
                 headers: Mapping[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = status, message, code, kind, param
        self.headers = dict(headers or {})  # sent with the error (a rate limit's Retry-After and x-ratelimit-*)


def error_response(error: RouteError) -> JSONResponse:
    """A refusal as the HTTP edge answers it: an OpenAI-style error body, with the error's headers."""
    return JSONResponse(error_body(error.message, error.kind, error.param, error.code), status_code=error.status,
                        headers=error.headers)


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """A request's whole body; None when the client left before sending all of it (or did not send it in time:
    engine/body_deadline.py answered it); RouteError 413 past `limit` bytes, counted as they come (a chunked body
    says no length)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RouteError(413, f"the request body exceeds {limit >> 20} MiB")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def wait_disconnected(receive: Receive) -> None:
    """Return once the client has gone away: the body is read, so the next ASGI message is the disconnect (both
    edges that relay answers: the router's and the gateway's)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def sse_data(line: str) -> str | None:
    """The value of an SSE `data:` line (one space after the colon dropped, as the SSE spec says: `data:{...}` and
    `data: {...}` are the same event), None for any other line. Engines send the space; other makes may not."""
    if not line.startswith("data:"):
        return None
    value = line[5:]
    return value[1:] if value.startswith(" ") else value


def stream_error_ending(message: str) -> str:
    """The end of an SSE answer that cannot be finished: an error event, then [DONE], so a client (the openai SDK
    among them) reads an error rather than a dropped connection; the router's when no pod can continue a stream,
    the gateway's when a router's answer breaks off."""
    return f"data: {json.dumps(error_body(message, 'server_error'))}\n\ndata: [DONE]\n\n"
