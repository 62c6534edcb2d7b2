"""The router's connections to its pods: keep-alive HTTP/1.1 connections pooled per pod, replies parsed by httptools.

A small client of its own rather than aiohttp (or httpx) because this call is much of what the router adds to
each request: a keep-alive POST of a small JSON body and its reply cost about 0.19 ms of CPU with aiohttp (1.1 ms
with httpx) and 0.07 ms here, system calls included, where a request is one write and its reply is parsed in C
(`kvmesh bench router` measures the router end to end). It does only what the router asks of it: POST a JSON
body, then read the reply whole or line by line; a reply read to its end hands its connection back for the next
request, and one closed before its end drops the connection, which tells the pod its client has gone (the engine
aborts the request and frees its blocks). Control traffic (metrics, events, health) stays on httpx in pods.py,
where a millisecond does not matter. Every failure (no connection, a reset, a read timeout, a malformed reply) is
one `UpstreamError`, so callers retry or migrate on one exception type.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from kvmesh.engine.internal_token import InternalToken
from kvmesh.router.tracing import RequestSpan, UpstreamSpan

CONNECT_TIMEOUT_SECONDS = 10.0
# A pooled connection idle this long is closed rather than reused: under the engines' keep-alive (uvicorn's 5 s),
# so the router seldom writes on a connection the pod is closing (the rare one that loses that race is resent).
IDLE_SECONDS = 4.0
_BODY_HEADERS = (b"content-length", b"transfer-encoding")  # a reply without either ends when its connection does
READ_AHEAD_BYTES = 1 << 20  # reading from a pod pauses while this much of its reply waits for the reader
# Connections open to one pod at most (in use, idle or opening): each request in flight holds one, so this is far
# above what an engine runs at once (max_num_seqs 64) with its queue; past it a request waits for one to come free
# (at most CONNECT_TIMEOUT_SECONDS, then UpstreamError: the router tries another pod), never opening sockets
# without bound to a pod that stalls.
MAX_CONNECTIONS_PER_POD = 1024


class UpstreamError(Exception):
    """The pod could not be reached, or the connection broke before the reply was whole."""


class UpstreamTimeout(UpstreamError):
    """Nothing more of the reply came within the read timeout (the pod may still be working on the request)."""


class _OutOfStep(Exception):
    """Raised in the parser's callback (which stops it) when bytes come that answer no request."""


class _Connection(asyncio.Protocol):
    """One connection to a pod and the reply being read on it (one at a time)."""

    def __init__(self, pod: _Pod, read_timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.pod, self.read_timeout = pod, read_timeout  # its pod, whose idle pool it leaves when it closes
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[None] | None = None
        self.idle_since = 0.0
        self.begin()

    def begin(self) -> None:
        """A new reply: nothing of it read yet."""
        self.status = 0
        self.head = False  # the status line and headers are in
        self.sized = False  # the reply says where its body ends (a length, or chunks)
        self.chunks: list[bytes] = []  # body bytes not yet taken by the reader
        self.buffered = 0  # their size
        self.complete = False
        self.keep_alive = False  # the pod keeps the connection open after this reply
        self.informational = False  # inside a 1xx interim reply
        self.received = False  # a byte of this reply came
        self.error: UpstreamError | None = None

    # ---- the reader's side ---------------------------------------------------------------------------------------

    async def wait(self) -> None:
        """Until more of the reply arrives, it ends or the connection fails (UpstreamError), at most the read
        timeout."""
        if self.error is None and not self.complete:
            self.waiter = self.loop.create_future()
            timer = self.loop.call_later(self.read_timeout, self.fail, f"no reply within {self.read_timeout:g} s",
                                         UpstreamTimeout)
            try:
                await self.waiter
            finally:
                timer.cancel()
                self.waiter = None
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        if self.buffered >= READ_AHEAD_BYTES and self.transport is not None:
            self.transport.resume_reading()
        self.buffered = 0
        return data

    def fail(self, why: str, error: type[UpstreamError] = UpstreamError) -> None:
        """The reply cannot be read whole: its reader gets an UpstreamError, and the connection is dropped."""
        if self.error is None and not self.complete:
            self.error = error(why)
        self.abort()
        self._wake()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def reusable(self) -> bool:
        return (self.transport is not None and not self.transport.is_closing() and self.complete
                and self.error is None and self.keep_alive)

    # ---- asyncio.Protocol and httptools' callbacks -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes
        self.pod.connected += 1
        self.pod.live.add(self)

    def data_received(self, data: bytes) -> None:
        if self in self.pod.idle:  # bytes with no request asked: the connection is out of step, never reused
            self.pod.idle.remove(self)
            self.abort()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.fail("the pod switched protocols")
            return
        except httptools.HttpParserError as exc:  # a callback's _OutOfStep among them
            self.fail(f"malformed reply: {exc}")
            return
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pod.connected -= 1
        self.pod.live.discard(self)
        self.pod.changed()
        if self in self.pod.idle:
            self.pod.idle.remove(self)
        if self.head and not self.sized and not self.complete and exc is None:
            self.complete = True  # a body that runs to the connection's end has ended
        self.fail(str(exc) if exc else "the pod closed the connection")

    def on_message_begin(self) -> None:
        if self.complete:  # a second reply to one request: out of step (a reply already read stays as it came)
            raise _OutOfStep("a reply to no request")

    def on_header(self, name: bytes, _: bytes) -> None:
        if name.lower() in _BODY_HEADERS:
            self.sized = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self.informational = 100 <= status < 200  # 100 Continue, 103 Early Hints: the reply itself follows
        if not self.informational:
            self.status, self.head = status, True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered >= READ_AHEAD_BYTES and self.buffered - len(body) < READ_AHEAD_BYTES:
            assert self.transport is not None
            self.transport.pause_reading()  # a slow reader: the pod's writes wait (TCP's flow control)

    def on_message_complete(self) -> None:
        if self.informational:  # an interim reply ended; the parser reads the real one next
            self.informational = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # readable only here: the parser resets after

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class UpstreamReply:
    """A pod's reply, its body not yet read: read it whole, or line by line for a stream; close it always."""

    def __init__(self, connection: _Connection, span: UpstreamSpan | None = None) -> None:
        self._connection: _Connection | None = connection
        self.status: int = connection.status
        self._span = span  # the call's trace span, ended with the reply
        if span is not None:
            span.answered(self.status)

    async def read(self) -> bytes:
        """The whole body, taken as it arrives: a body over READ_AHEAD_BYTES pauses the pod's socket until taken,
        so waiting for the end before taking any would never see it."""
        connection = self._reading()
        parts = []
        try:
            while True:
                if connection.chunks:
                    parts.append(connection.take())
                if connection.complete:
                    break
                await connection.wait()
        except UpstreamError as exc:
            raise self._broken(exc) from exc
        return b"".join(parts)

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines without their line ends, as they arrive (no length limit on a line)."""
        connection = self._reading()
        pending: list[bytes] = []  # the start of a line whose end has not come (searched once: a long line is linear)
        while True:
            if connection.chunks:
                data = connection.take()
                if b"\n" not in data:
                    pending.append(data)
                    continue
                *complete, tail = data.split(b"\n")
                complete[0] = b"".join([*pending, complete[0]])
                pending = [tail]
                for line in complete:
                    yield _text(line.rstrip(b"\r"))
                continue  # more may have come while the lines were taken
            if connection.complete:
                break
            try:
                await connection.wait()
            except UpstreamError as exc:
                raise self._broken(exc) from exc
        if rest := b"".join(pending):
            yield _text(rest)

    def _reading(self) -> _Connection:
        if self._connection is None:
            raise UpstreamError("the reply was closed")
        return self._connection

    def _broken(self, exc: UpstreamError) -> UpstreamError:
        """The reply broke off: the error to raise (and the call's span, failed)."""
        if self._span is not None:
            self._span.failed(str(exc))
        return exc

    def close(self) -> None:
        """Hand the connection back when the body was read to its end; otherwise drop it, which tells the pod
        its client has gone (the engine aborts the request and frees its blocks)."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if connection.reusable() and connection.buffered < READ_AHEAD_BYTES:  # the reply ended, read or not
            connection.idle_since = connection.loop.time()
            connection.pod.idle.append(connection)
            connection.pod.changed()
        else:
            connection.abort()
        if self._span is not None:
            self._span.end()


class _Pod:
    """Where one pod's requests go (scheme, host and port), its idle connections and how many are open."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"not an http(s) URL: {url}")
        self.tls = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port or (443 if self.tls else 80)
        default_port = parts.port is None or parts.port == (443 if self.tls else 80)
        self.authority = (f"[{self.host}]" if ":" in self.host else self.host) + ("" if default_port
                                                                                    else f":{self.port}")
        self.idle: list[_Connection] = []
        self.live: set[_Connection] = set()  # its open connections, idle or in use
        self.connected = 0  # open connections (from connection_made to connection_lost)
        self.opening = 0  # connections being opened
        self.posting = 0  # requests between finding this pod and having their connection (the sweep keeps it)
        self._change: asyncio.Future[None] | None = None  # set when a connection goes idle or closes

    def open(self) -> int:
        return self.connected + self.opening

    def changed(self) -> None:
        """A connection went idle or closed: wake the requests waiting for one."""
        if self._change is not None:
            if not self._change.done():
                self._change.set_result(None)
            self._change = None

    async def wait_change(self, timeout: float) -> None:
        """Until `changed` (TimeoutError after `timeout`)."""
        if self._change is None:
            self._change = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(asyncio.shield(self._change), timeout)  # shared: one waiter leaving cancels none


class Upstream:
    """Keep-alive connections to every pod, opened on first use inside the event loop that serves requests."""

    def __init__(self, read_timeout_seconds: float, max_connections_per_pod: int = MAX_CONNECTIONS_PER_POD,
                 token: InternalToken | None = None) -> None:
        """`token`: the pool's internal token, sent with every request (engines refuse requests without it)."""
        if (isinstance(max_connections_per_pod, bool) or not isinstance(max_connections_per_pod, int)
                or max_connections_per_pod < 1):
            raise ValueError(f"max_connections_per_pod must be a whole number of at least 1, not "
                             f"{max_connections_per_pod!r}")
        self._read_timeout, self._max_connections = read_timeout_seconds, max_connections_per_pod
        self._pods: dict[str, _Pod] = {}  # by base URL (scheme, host and port)
        self._tls: ssl.SSLContext | None = None
        self._swept = 0.0  # when idle connections were last swept
        self._token = token

    async def post(self, url: str, body: Mapping[str, Any], headers: Mapping[str, str],
                   traced: RequestSpan | None = None) -> UpstreamReply:
        """POST `body` as JSON; the reply once its status and headers are in. Within `traced` (a request's span,
        when tracing is on), the call is a child span whose context goes to the pod in `traceparent`."""
        span = traced.upstream(url, body) if traced is not None else None
        connection, pod = None, None
        try:
            pod, path = self._pod_of(url)
            pod.posting += 1
            payload = json.dumps(body).encode()
            sent = dict(headers) if span is None else span.headers(headers)
            if self._token is not None:
                sent.update(self._token.headers())
            lines = [f"POST {path} HTTP/1.1\r\nhost: {pod.authority}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(payload)}\r\n"]
            for name, value in sent.items():
                if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                    raise UpstreamError(f"a line break in the header {name!r}")
                lines.append(f"{name}: {value}\r\n")
            lines.append("\r\n")
            request = "".join(lines).encode("latin-1") + payload
            connection, reused = await self._connection(pod)
            try:
                await self._send(connection, request)
            except UpstreamError as exc:
                if not reused or connection.received or isinstance(exc, UpstreamTimeout):
                    raise
                # a kept-alive connection the pod closed as the request went out: it never read it, so once
                # more on a new connection (the pod's first byte had not come: nothing was answered twice)
                connection.abort()
                connection, _ = await self._connection(pod, fresh=True)
                await self._send(connection, request)
        except UpstreamError as exc:
            if connection is not None:
                connection.abort()
            if span is not None:
                span.failed(str(exc))
            raise
        except BaseException:  # cancelled (the client left)
            if connection is not None:
                connection.abort()
            if span is not None:
                span.failed("cancelled")
            raise
        finally:  # from here its connection, open, counts in pod.connected until its reply is closed
            if pod is not None:
                pod.posting -= 1
        return UpstreamReply(connection, span)

    def _pod_of(self, url: str) -> tuple[_Pod, str]:
        """The pod of `url` and the path to ask it for."""
        base, path = _split(url)
        pod = self._pods.get(base)
        if pod is None:
            pod = self._pods[base] = _Pod(base)
        return pod, path

    @staticmethod
    async def _send(connection: _Connection, request: bytes) -> None:
        """Write the request and wait for the reply's status and headers."""
        if connection.transport is None:
            raise connection.error or UpstreamError("the pod closed the connection")
        connection.transport.write(request)
        while not connection.head:
            if connection.complete:  # ended with no status line of its own (wait() would not wait)
                connection.abort()
                raise UpstreamError("the pod's reply ended before its status line")
            await connection.wait()

    def _sweep(self, now: float) -> None:
        """Close every pod's connections idle past IDLE_SECONDS: a pod that left the pool (or vanished without
        closing its end) keeps no socket open for long. A pod with no connection left and no request on its way
        to one is forgotten: pods come and go at new addresses for as long as the router runs, and a later
        request to one simply starts afresh. One that a request still holds (waiting for a connection to come
        free, or about to resend on a new one after its last was lost) stays: the connections that request opens
        must count against the same max_connections_per_pod as those of requests after it."""
        self._swept = now
        for base, pod in list(self._pods.items()):
            for connection in [c for c in pod.idle if now - c.idle_since >= IDLE_SECONDS]:
                pod.idle.remove(connection)
                connection.abort()
            if not pod.idle and not pod.open() and not pod.posting:
                del self._pods[base]

    async def _connection(self, pod: _Pod, fresh: bool = False) -> tuple[_Connection, bool]:
        """An idle connection to `pod` that is still open and fresh (unless `fresh`), or a new one; and whether
        it was kept alive from an earlier request. With max_connections_per_pod open, the first to come free (an
        idle one, or room for a new one), waiting at most CONNECT_TIMEOUT_SECONDS."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._swept >= IDLE_SECONDS:
            self._sweep(loop.time())
        deadline = loop.time() + CONNECT_TIMEOUT_SECONDS
        while True:
            while pod.idle and not fresh:
                connection = pod.idle.pop()
                if connection.reusable() and loop.time() - connection.idle_since < IDLE_SECONDS:
                    connection.begin()
                    return connection, True
                connection.abort()
            if pod.open() < self._max_connections:
                break
            try:
                await pod.wait_change(deadline - loop.time())
            except TimeoutError:
                raise UpstreamError(f"all {self._max_connections} connections to {pod.authority} stayed busy for "
                                    f"{CONNECT_TIMEOUT_SECONDS:g} s (max_connections_per_pod)") from None
        tls = None
        if pod.tls:
            self._tls = self._tls or ssl.create_default_context()
            tls = self._tls
        pod.opening += 1
        try:
            _, connection = await asyncio.wait_for(loop.create_connection(
                lambda: _Connection(pod, self._read_timeout), pod.host, pod.port, ssl=tls),
                CONNECT_TIMEOUT_SECONDS)
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise UpstreamError(f"cannot connect to {pod.authority}: {exc or type(exc).__name__}") from exc
        finally:
            pod.opening -= 1
            pod.changed()  # a failed open leaves room for another
        return connection, False

    def abort_pod(self, url: str, why: str) -> int:
        """Break every connection to the pod of `url`: the replies being read from it fail with `why` (a relayed
        stream moves to another pod) instead of waiting out the read timeout on a pod that went silent. How many
        were open."""
        pod = self._pods.get(_split(url)[0])
        if pod is None:
            return 0
        connections = list(pod.live)
        for connection in connections:
            connection.fail(why)
        return len(connections)

    async def close(self) -> None:
        """Close the idle connections (those in use close with their replies)."""
        for pod in self._pods.values():
            while pod.idle:
                pod.idle.pop().abort()


def _text(line: bytes) -> str:
    """A reply's line as text; one that is not UTF-8 is a broken reply (a stream migrates), like a malformed one."""
    try:
        return line.decode()
    except UnicodeDecodeError as exc:
        raise UpstreamError(f"a line that is not UTF-8 in the reply: {exc}") from None


def _split(url: str) -> tuple[str, str]:
    """(scheme://authority, path) of `url`: where its pod is, and what to ask it for."""
    scheme, _, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    return f"{scheme}://{authority}", slash + path if slash else "/"
