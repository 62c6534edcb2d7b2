"""A deadline on reading a request's body, on every HTTP edge: the engine, the router and `kvmesh gateway`.

uvicorn bounds only how long a kept-alive connection may idle between requests. A client that sends a request's
headers and then trickles its body, or never sends it, would hold a connection, a task and the bytes buffered so
far for as long as it liked (slowloris). Each edge reads the whole body within `body_read_timeout_seconds` of
asking for it, or answers 408 with an OpenAI-style error and closes the connection. The answer's own body, a
stream included, is not bounded by it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmesh.engine.openai_types import error_body

DEFAULT_BODY_READ_TIMEOUT_SECONDS = 30.0  # the engine's and the router's (and the gateway's) default
BODY_TIMEOUT_STATUS = 408
BODY_TIMEOUT_CODE = "body_timeout"
CONNECTION_CLOSE = {"connection": "close"}  # uvicorn closes the connection once such an answer is sent
BODILESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # read by no route: never waited for


def body_timeout_message(seconds: float) -> str:
    return (f"the request body did not arrive within {seconds:g} s (body_read_timeout_seconds); send the whole body "
            "with its headers")


def check_body_read_timeout(seconds: float) -> None:
    """Refuse a deadline of no time (or NaN): an error at start, not a 408 for every request."""
    if not seconds > 0:
        raise ValueError(f"body_read_timeout_seconds must be above 0, not {seconds!r}")


async def send_body_timeout(send: Send, seconds: float) -> None:
    """The 408 answer, as plain ASGI: an OpenAI-style error, and the connection closed after it."""
    content = json.dumps(error_body(body_timeout_message(seconds), code=BODY_TIMEOUT_CODE)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
               *((name.encode(), value.encode()) for name, value in CONNECTION_CLOSE.items())]
    await send({"type": "http.response.start", "status": BODY_TIMEOUT_STATUS, "headers": headers})
    await send({"type": "http.response.body", "body": content})


class BodyDeadline:
    """ASGI middleware: a request's body is received whole within `seconds()` before the app sees the request;
    otherwise `timed_out(scope)` counts it and the client gets the 408. The app then reads the messages as they
    came (a disconnect among them), and later ones (a disconnect while it answers) from the server."""

    def __init__(self, app: ASGIApp, seconds: Callable[[], float], timed_out: Callable[[Scope], None]) -> None:
        self.app, self.seconds, self.timed_out = app, seconds, timed_out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in BODILESS_METHODS:
            await self.app(scope, receive, send)
            return
        seconds = self.seconds()
        messages: list[Message] = []
        try:
            async with asyncio.timeout(seconds):
                while True:
                    message = await receive()
                    messages.append(message)
                    if message["type"] != "http.request" or not message.get("more_body", False):
                        break
        except TimeoutError:
            self.timed_out(scope)
            await send_body_timeout(send, seconds)
            return
        received = iter(messages)

        async def replay() -> Message:
            return next(received, None) or await receive()

        await self.app(scope, replay, send)
