"""A deadline on reading a request's body, on every HTTP edge: the engine, the router and `kvmesh gateway`.

uvicorn bounds only how long a kept-alive connection may idle between requests. A client that sends a request's
headers and then trickles its body, or never sends it, would hold a connection, a task and the bytes buffered so
far for as long as it liked (slowloris). Each edge wraps its whole app in BodyDeadline: a body not whole within
`body_read_timeout_seconds` of the app asking for it, plus one second for every MIN_BODY_BYTES_PER_SECOND received
(a large upload on a fair link is not cut; a trickle is), is answered 408 with an OpenAI-style error and the
connection closes. The answer's own body, a stream included, is not bounded by it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmesh.engine.openai_types import error_body

log = logging.getLogger("kvmesh.body_deadline")

DEFAULT_BODY_READ_TIMEOUT_SECONDS = 30.0  # the engine's and the router's (and the gateway's) default
BODY_TIMEOUT_STATUS = 408
BODY_TIMEOUT_CODE = "body_timeout"
CONNECTION_CLOSE = {"connection": "close"}  # uvicorn closes the connection once such an answer is sent
BODILESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # read by no route: never waited for
DISCONNECTED: Message = {"type": "http.disconnect"}  # what the app reads once its body is refused
# Each byte received extends the deadline by 1 / this many seconds: a body sent at least this fast is never cut (a
# 100 MiB batch file needs ~27 min at it), a slowloris that trickles bytes gains next to nothing.
MIN_BODY_BYTES_PER_SECOND = 64 * 1024
BODY_REFUSED = "kvmesh.body_refused"  # set in the scope once the 408 went out: the app's disconnect is not a client's


def body_timeout_message(seconds: float) -> str:
    return (f"the request body did not arrive within {seconds:g} s (body_read_timeout_seconds, plus 1 s per "
            f"{MIN_BODY_BYTES_PER_SECOND // 1024} KiB received); send the whole body with its headers")


def check_body_read_timeout(seconds: float) -> None:
    """Refuse a deadline of no time (or NaN): an error at start, not a 408 for every request."""
    if not seconds > 0:
        raise ValueError(f"body_read_timeout_seconds must be above 0, not {seconds!r}")


async def send_json(send: Send, status: int, body: Mapping[str, Any], headers: Iterable[tuple[str, str]] = ()) -> None:
    """A whole JSON answer, as plain ASGI (the edges' answers that skip a framework)."""
    content = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
        *((name.encode("latin-1"), value.encode("latin-1")) for name, value in headers)]})
    await send({"type": "http.response.body", "body": content})


async def send_body_timeout(send: Send, seconds: float) -> None:
    """The 408 answer: an OpenAI-style error, and the connection closed after it."""
    await send_json(send, BODY_TIMEOUT_STATUS, error_body(body_timeout_message(seconds), code=BODY_TIMEOUT_CODE),
                    CONNECTION_CLOSE.items())


class BodyDeadline:
    """ASGI middleware: a request's body must be whole within `seconds()` of the app first asking for it (plus
    its bytes' allowance at MIN_BODY_BYTES_PER_SECOND); otherwise `timed_out(scope)` counts it, the client gets the
    408, `scope[BODY_REFUSED]` is set and the app reads a disconnect, as from a client that left (what it answers
    then is dropped: the 408 was the answer). An app that answered before reading its body reads the rest
    unbounded (its answer, a stream perhaps, is not cut). Nothing is buffered here: each
    route reads the body as it comes, after its own checks (a key before a byte is read) and within its own size
    bound, so a stranger cannot make an edge hold a body of any size."""

    def __init__(self, app: ASGIApp, seconds: Callable[[], float], timed_out: Callable[[Scope], None]) -> None:
        self.app, self.seconds, self.timed_out = app, seconds, timed_out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in BODILESS_METHODS:
            await self.app(scope, receive, send)
            return
        seconds = self.seconds()
        deadline: float | None = None  # set when the app first asks for the body
        whole = answered = refused = False

        async def bounded_receive() -> Message:
            nonlocal deadline, whole, refused
            if whole or answered:  # the body came, or the app answered: later messages are the server's
                return await receive()
            if refused:
                return dict(DISCONNECTED)
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + seconds
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                if answered:  # the app answered while it waited: its answer stands, the rest is unbounded
                    return await receive()
                refused = True
                scope[BODY_REFUSED] = True
                self.timed_out(scope)
                await send_body_timeout(send, seconds)
                return dict(DISCONNECTED)
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            deadline += len(message.get("body", b"")) / MIN_BODY_BYTES_PER_SECOND
            return message

        async def answer(message: Message) -> None:
            nonlocal answered
            if refused:
                return
            answered = True
            await send(message)

        try:
            await self.app(scope, bounded_receive, answer)
        except Exception:
            if not refused:
                raise
            # the app failed on the disconnect it read (a framework's ClientDisconnect): the 408 was its answer
            log.debug("after a 408 for %s, the app ended with an error", scope["path"], exc_info=True)
