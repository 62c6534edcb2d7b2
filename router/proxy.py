"""The router's connections to its pods: one pooled aiohttp session for every proxied request.

aiohttp rather than httpx on this path because it is the router's whole overhead: a keep-alive POST and its
reply cost about 0.25 ms of CPU with aiohttp against about 1.1 ms with httpx on the development machine
(`kvmesh bench router` measures what the router adds end to end). Control traffic (metrics, events, health)
stays on httpx in pods.py, where a millisecond does not matter. Everything aiohttp raises for a failed or
broken connection becomes one `UpstreamError`, so callers retry or migrate on one exception type.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from kvmesh.router.tracing import RequestSpan, UpstreamSpan

CONNECT_TIMEOUT_SECONDS = 10.0


class UpstreamError(Exception):
    """The pod could not be reached, or the connection broke before the reply was whole."""


class UpstreamReply:
    """A pod's reply, its body not yet read: read it whole, or line by line for a stream; close it always."""

    def __init__(self, response: aiohttp.ClientResponse, span: UpstreamSpan | None = None) -> None:
        self._response = response
        self.status: int = response.status
        self._span = span  # the call's trace span, ended with the reply
        if span is not None:
            span.answered(response.status)

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._broken(exc) from exc

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines without their line ends, as they arrive (no length limit on a line)."""
        pending = b""
        try:
            async for chunk in self._response.content.iter_any():
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    yield line.rstrip(b"\r").decode()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._broken(exc) from exc
        if pending:
            yield pending.decode()

    def _broken(self, exc: BaseException) -> UpstreamError:
        """The reply broke off: the error to raise (and the call's span, failed)."""
        error = str(exc) or type(exc).__name__
        if self._span is not None:
            self._span.failed(error)
        return UpstreamError(error)

    def close(self) -> None:
        """Hand the connection back when the body was read to its end; otherwise drop it, which tells the pod
        its client has gone (the engine aborts the request and frees its blocks)."""
        self._response.close()
        if self._span is not None:
            self._span.end()


class Upstream:
    """One connection pool to all pods, opened on first use inside the event loop that serves requests."""

    def __init__(self, read_timeout_seconds: float) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_SECONDS,
                                              sock_read=read_timeout_seconds)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                                  json_serialize=json.dumps)
        return self._session

    async def post(self, url: str, body: Mapping[str, Any], headers: Mapping[str, str],
                   traced: RequestSpan | None = None) -> UpstreamReply:
        """POST `body` as JSON; the reply once its status and headers are in. Within `traced` (a request's span,
        when tracing is on), the call is a child span whose context goes to the pod in `traceparent`."""
        span = traced.upstream(url, body) if traced is not None else None
        try:
            response = await self._open().post(url, json=body, headers=dict(headers) if span is None
                                               else span.headers(headers))
        except (TimeoutError, aiohttp.ClientError) as exc:
            error = str(exc) or type(exc).__name__
            if span is not None:
                span.failed(error)
            raise UpstreamError(error) from exc
        except BaseException:  # cancelled (the client left)
            if span is not None:
                span.failed("cancelled")
            raise
        return UpstreamReply(response, span)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
