"""The router's upstream client (router/proxy.py) against a scripted HTTP/1.1 server on loopback: a raw asyncio
server that answers each request as the test says (a whole reply, chunks on cue, a reply cut off, nothing), so
each case is exact. What the router relies on: keep-alive reuse, lines of a stream as they come, a reply closed
early dropping its connection (the engine's signal to abort), and every failure as one UpstreamError."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import pytest

from kvmesh.processes import free_port
from kvmesh.router.config import RouterConfig
from kvmesh.router.proxy import IDLE_SECONDS, READ_AHEAD_BYTES, Upstream, UpstreamError, _Pod

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Pod:
    url: str
    connections: int = 0
    requests: list[tuple[bytes, bytes]] = field(default_factory=list)  # (head, body) as received
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a connection was closed by the client


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return head, await reader.readexactly(length)


@asynccontextmanager
async def pod(handler: Handler) -> AsyncIterator[Pod]:
    """A server that hands every request to `handler` with the connection's writer, on keep-alive connections."""
    state = Pod("")

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        try:
            while True:
                head, body = await read_request(reader)
                state.requests.append((head, body))
                await handler(body, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            state.closed.set()
        finally:
            writer.close()

    port = free_port()
    server = await asyncio.start_server(connection, "127.0.0.1", port)
    state.url = f"http://127.0.0.1:{port}"
    async with server:
        yield state


def whole(body: bytes, status: int = 200) -> bytes:
    return b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body),
                                                                                                  body)


async def echo(body: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(whole(body))


async def ask(upstream: Upstream, url: str, body: dict) -> object:
    """POST `body`, read the reply whole and give its connection back: the reply's JSON."""
    reply = await upstream.post(url + "/v1/completions", body, {})
    answer = json.loads(await reply.read())
    reply.close()
    return answer


@pytest.mark.asyncio
async def test_requests_reuse_one_keep_alive_connection_and_send_json_with_the_headers() -> None:
    async with pod(echo) as server:
        upstream = Upstream(30.0)
        for i in range(3):
            reply = await upstream.post(server.url + "/v1/completions", {"prompt": "hi", "n": i},
                                        {"x-kvmesh-priority": "2"})
            assert reply.status == 200 and json.loads(await reply.read()) == {"prompt": "hi", "n": i}
            reply.close()
        await upstream.close()
    assert server.connections == 1
    head = server.requests[0][0].decode()
    assert head.startswith("POST /v1/completions HTTP/1.1\r\n") and "x-kvmesh-priority: 2\r\n" in head
    assert "content-type: application/json\r\n" in head and f"host: {server.url[7:]}\r\n" in head


@pytest.mark.asyncio
async def test_a_stream_arrives_line_by_line_as_the_pod_sends_it() -> None:
    go_on = asyncio.Event()

    async def stream(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in (b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\ndata: [DONE]\n\n'):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await go_on.wait()  # the second event only once the first line was read
        writer.write(b"0\r\n\r\n")

    async with pod(stream) as server:
        upstream = Upstream(30.0)
        reply = await upstream.post(server.url + "/v1/completions", {"stream": True}, {})
        lines = []
        async for line in reply.lines():
            lines.append(line)
            go_on.set()
        reply.close()
        again = await upstream.post(server.url + "/v1/completions", {}, {})  # the stream ended: connection reused
        again.close()
        await upstream.close()
    assert lines == ['data: {"a": 1}', "", 'data: {"b": 2}', "", "data: [DONE]", ""]
    assert server.connections == 1


@pytest.mark.asyncio
async def test_a_reply_closed_before_its_end_drops_the_connection() -> None:
    """The router closes a reply early when its client left: the pod must see the connection go (it then aborts
    the request and frees its blocks), and the next request gets a new connection."""
    async def endless(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()

    async with pod(endless) as server:
        upstream = Upstream(30.0)
        reply = await upstream.post(server.url + "/v1/completions", {}, {})
        assert reply.status == 200
        reply.close()
        await server.closed.wait()  # the pod saw its client leave
        reply = await upstream.post(server.url + "/v1/completions", {}, {})
        reply.close()
        await upstream.close()
    assert server.connections == 2


@pytest.mark.asyncio
async def test_failures_are_upstream_errors() -> None:
    async def cut(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        writer.close()

    async def silent(_: bytes, writer: asyncio.StreamWriter) -> None:
        await asyncio.Event().wait()

    async def garbage(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"not HTTP at all\r\n\r\n")

    upstream = Upstream(0.2)
    async with pod(cut) as server:
        reply = await upstream.post(server.url + "/v1/completions", {}, {})
        with pytest.raises(UpstreamError):
            await reply.read()  # the pod broke off mid-answer
        reply.close()
    async with pod(silent) as server:
        with pytest.raises(UpstreamError, match=r"no reply within 0\.2 s"):
            await upstream.post(server.url + "/v1/completions", {}, {})
    async with pod(garbage) as server:
        with pytest.raises(UpstreamError, match="malformed reply"):
            await upstream.post(server.url + "/v1/completions", {}, {})
    with pytest.raises(UpstreamError, match="cannot connect"):
        await upstream.post(f"http://127.0.0.1:{free_port()}/v1/completions", {}, {})  # nothing listens
    with pytest.raises(UpstreamError, match="line break"):
        await upstream.post(server.url + "/v1/completions", {}, {"x-kvmesh-workload": "a\r\nx-injected: 1"})
    await upstream.close()


@pytest.mark.asyncio
async def test_a_body_that_runs_to_the_connections_end_and_a_closed_idle_connection() -> None:
    """A reply with neither length nor chunks ends with its connection; the next request, finding that connection
    gone, opens another."""
    async def unsized(body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n" + body)
        writer.close()

    async with pod(unsized) as server:
        upstream = Upstream(30.0)
        for i in range(2):
            assert await ask(upstream, server.url, {"n": i}) == {"n": i}
        await upstream.close()
    assert server.connections == 2


@pytest.mark.asyncio
async def test_a_reply_larger_than_the_read_ahead_is_read_whole() -> None:
    """Over READ_AHEAD_BYTES the pod's socket pauses until the reader takes what came: a whole read takes it as
    it comes (it used to wait for the end with the socket paused, and failed at the read timeout)."""
    big = json.dumps({"text": "x" * (3 * READ_AHEAD_BYTES)}).encode()

    async def large(body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(whole(big))

    async with pod(large) as server:
        upstream = Upstream(5.0)
        reply = await upstream.post(server.url + "/v1/completions", {}, {})
        assert await reply.read() == big
        reply.close()
        await upstream.close()


@pytest.mark.asyncio
async def test_a_kept_alive_connection_the_pod_closed_is_resent_on_a_new_one() -> None:
    """Each connection answers one request and closes when the next arrives, unanswered (a pod closing an idle
    keep-alive connection as the router writes on it): the router sends that request once more on a new
    connection, so the client never sees the race."""
    answered: set[int] = set()

    async def one_per_connection(body: bytes, writer: asyncio.StreamWriter) -> None:
        if id(writer) in answered:
            writer.close()  # read, never answered
            return
        answered.add(id(writer))
        writer.write(whole(body))

    async with pod(one_per_connection) as server:
        upstream = Upstream(5.0)
        for i in range(3):
            assert await ask(upstream, server.url, {"n": i}) == {"n": i}
        assert server.connections == 3  # requests 1 and 2 each went out twice: on the closing connection, then anew
        assert [json.loads(body)["n"] for _, body in server.requests] == [0, 1, 1, 2, 2]
        await upstream.close()


@pytest.mark.asyncio
async def test_interim_replies_are_skipped_and_the_real_reply_read() -> None:
    async def hints(body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + whole(body))

    async with pod(hints) as server:
        upstream = Upstream(5.0)
        for i in range(2):  # and the connection stays in step for the next request
            reply = await upstream.post(server.url + "/v1/completions", {"n": i}, {})
            assert reply.status == 200 and json.loads(await reply.read()) == {"n": i}
            reply.close()
        assert server.connections == 1
        await upstream.close()


@pytest.mark.asyncio
async def test_idle_connections_of_a_pod_no_longer_asked_are_closed() -> None:
    """A pod the router stops sending to (it left the pool) keeps no idle socket open: the next request to any pod
    past IDLE_SECONDS sweeps it, and the pod sees its connection closed."""
    async with pod(echo) as gone, pod(echo) as other:
        upstream = Upstream(5.0)
        reply = await upstream.post(gone.url + "/v1/completions", {}, {})
        await reply.read()
        reply.close()  # pooled, idle
        loop = asyncio.get_running_loop()
        later = loop.time() + IDLE_SECONDS + 1
        original = loop.time
        loop.time = lambda: later  # type: ignore[method-assign]  # the idle time passes (no sleep)
        try:
            reply = await upstream.post(other.url + "/v1/completions", {}, {})
        finally:
            loop.time = original  # type: ignore[method-assign]
        await reply.read()
        reply.close()
        await asyncio.wait_for(gone.closed.wait(), 5)
        await upstream.close()


@pytest.mark.asyncio
async def test_a_pod_gone_from_the_pool_is_forgotten_once_its_connections_are_closed() -> None:
    """Pods come and go at new addresses for weeks: the upstream's table of pods must not keep every address it
    ever sent to. Once a pod's idle connection is swept and closed, a later sweep forgets the pod."""
    async with AsyncExitStack() as stack:
        other = await stack.enter_async_context(pod(echo))
        gone = [await stack.enter_async_context(pod(echo)) for _ in range(5)]  # each asked once, then not again
        upstream = Upstream(5.0)
        for server in gone:
            await ask(upstream, server.url, {})
        loop, original = asyncio.get_running_loop(), asyncio.get_running_loop().time
        for sweep in (1, 2):  # the first sweep closes their idle connections, the next forgets the pods
            later = original() + sweep * (IDLE_SECONDS + 1)
            loop.time = lambda later=later: later  # type: ignore[method-assign]  # time passes (no sleep)
            try:
                reply = await upstream.post(other.url + "/v1/completions", {}, {})  # its sweep runs first
            finally:
                loop.time = original  # type: ignore[method-assign]
            await reply.read()
            reply.close()
            for server in gone:
                await asyncio.wait_for(server.closed.wait(), 5)
            await asyncio.sleep(0.05)  # our ends of the closed connections are seen too
        assert list(upstream._pods) == [other.url]  # only the pod still asked
        assert await ask(upstream, gone[0].url, {"back": 1}) == {"back": 1}  # a pod asked again starts afresh
        await upstream.close()


async def held_requests(server: Pod, count: int) -> None:
    """Until the pod has received `count` requests in all."""
    for _ in range(1000):
        if len(server.requests) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the pod received {len(server.requests)} requests, not {count}")


@pytest.mark.asyncio
async def test_connections_to_a_pod_are_bounded_and_a_request_past_the_bound_waits_for_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod that stalls must not get a new socket for every request the router is asked: past
    max_connections_per_pod a request waits for a connection to come free, and gives up (UpstreamError, so the
    router tries another pod) when none does."""
    release = asyncio.Event()

    async def held(body: bytes, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        writer.write(whole(body))

    async with pod(held) as server:
        upstream = Upstream(30.0, max_connections_per_pod=2)
        calls = [asyncio.ensure_future(ask(upstream, server.url, {"n": i})) for i in range(3)]
        await held_requests(server, 2)
        assert server.connections == 2 and not calls[2].done()
        release.set()
        assert await asyncio.gather(*calls) == [{"n": 0}, {"n": 1}, {"n": 2}]
        assert server.connections == 2  # the third took a connection the others gave back
        release.clear()
        monkeypatch.setattr("kvmesh.router.proxy.CONNECT_TIMEOUT_SECONDS", 0.05)
        stuck = [asyncio.ensure_future(ask(upstream, server.url, {})) for _ in range(2)]
        await held_requests(server, 5)
        with pytest.raises(UpstreamError, match=r"all 2 connections to 127\.0\.0\.1:\d+ stayed busy"):
            await ask(upstream, server.url, {})
        release.set()
        await asyncio.gather(*stuck)
        await upstream.close()
    with pytest.raises(ValueError, match="max_connections_per_pod must be a whole number of at least 1, not 0"):
        RouterConfig(pods=["http://127.0.0.1:1"], max_connections_per_pod=0).validate()


@pytest.mark.asyncio
async def test_a_pod_a_request_waits_for_is_not_forgotten_so_its_connection_bound_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request waiting for a connection to a pod at max_connections_per_pod is woken when the pod's last
    connection is lost; if another request's idle sweep runs before it resumes, the pod must not be forgotten:
    the waiting request then opens its connection on the pod the next requests find, and they share the bound
    (a forgotten pod's connections were counted apart, and the pod got one connection per table)."""
    drop, release, waiting = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def dropped_first(body: bytes, writer: asyncio.StreamWriter) -> None:
        if json.loads(body).get("drop"):
            await drop.wait()
            writer.close()  # the connection is lost, no reply
            return
        await release.wait()
        writer.write(whole(body))

    async with pod(dropped_first) as server, pod(echo) as other:
        upstream = Upstream(30.0, max_connections_per_pod=1)
        loop, original, real_wait = asyncio.get_running_loop(), asyncio.get_running_loop().time, _Pod.wait_change

        async def woken_then_another_sweeps(self: _Pod, timeout: float) -> None:
            first = not waiting.is_set()
            waiting.set()
            await real_wait(self, timeout)
            if first:  # before this request resumes, another one (to another pod) sweeps, idle time past
                later = original() + IDLE_SECONDS + 1
                loop.time = lambda: later  # type: ignore[method-assign]
                try:
                    assert await ask(upstream, other.url, {"other": 1}) == {"other": 1}
                finally:
                    loop.time = original  # type: ignore[method-assign]

        monkeypatch.setattr(_Pod, "wait_change", woken_then_another_sweeps)
        lost = asyncio.ensure_future(ask(upstream, server.url, {"drop": 1}))
        await held_requests(server, 1)
        second = asyncio.ensure_future(ask(upstream, server.url, {"n": 2}))
        await asyncio.wait_for(waiting.wait(), 5)  # at the bound: waits for the only connection
        drop.set()
        with pytest.raises(UpstreamError):
            await lost
        await held_requests(server, 2)  # the second request is at the pod, on a new connection
        third = asyncio.ensure_future(ask(upstream, server.url, {"n": 3}))
        release.set()
        assert await asyncio.gather(second, third) == [{"n": 2}, {"n": 3}]
        assert server.connections == 2  # the lost one and one more, which the third request reused
        await upstream.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("extra", [whole(b'{"bogus": true}', 503), b"HTTP/1.1 200 OK\r\ncontent-length: 30\r\n\r\n"],
                         ids=["a whole second reply", "the head of one"])
async def test_bytes_after_a_reply_that_answer_no_request_drop_the_connection(extra: bytes) -> None:
    """A pod (or something between) that sends a reply nobody asked for, in the same write as the real one: the
    request gets its own reply, and the connection is never reused. Reused, the extra reply became the next
    request's (its status, or a half-read body that made the next request wait forever without yielding the event
    loop: the whole router froze)."""
    async def twice(body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(whole(body) + extra)

    async with pod(twice) as server:
        upstream = Upstream(2.0)
        for i in range(3):
            assert await asyncio.wait_for(ask(upstream, server.url, {"n": i}), 5) == {"n": i}
        await upstream.close()
    assert server.connections == 3


@pytest.mark.asyncio
async def test_a_pod_that_switches_protocols_is_an_upstream_error() -> None:
    async def upgrade(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n")

    async with pod(upgrade) as server:
        upstream = Upstream(2.0)
        with pytest.raises(UpstreamError, match="switched protocols"):
            await upstream.post(server.url + "/v1/completions", {}, {})
        await upstream.close()


@pytest.mark.asyncio
async def test_a_long_line_split_over_many_reads_is_one_line() -> None:
    piece = b"x" * 4096

    async def long_line(_: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in [b"data: ", *[piece] * 64, b"\n\ndata: [DONE]\n\n"]:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    async with pod(long_line) as server:
        upstream = Upstream(5.0)
        reply = await upstream.post(server.url + "/v1/completions", {}, {})
        lines = [line async for line in reply.lines()]
        reply.close()
        await upstream.close()
    assert lines == ["data: " + "x" * 4096 * 64, "", "data: [DONE]", ""]
