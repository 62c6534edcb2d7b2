"""The transfer client against a peer that trickles (a slow transfer is abandoned, so the request recomputes),
sends a malformed header (a TransferError, so the request recomputes, never a 500) or blocks computed by other
weights (refused)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvmesh.engine.engine import Engine
from kvmesh.engine.kv.transfer import KV_FETCH_PATH, Layout, PulledBlocks, TransferError, encode_frame, pull_blocks
from kvmesh.processes import free_port

from .conftest import make_engine
from .engines import serve_engine
from .test_kv_weights import transfers


class Trickle(httpx.AsyncByteStream):
    """A stand-in peer (no real slow network exists here) that sends a frame a few bytes at a time."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(0, len(self.body), 64):
            await asyncio.sleep(0.05)
            yield self.body[i : i + 64]


def test_a_slow_peer_is_abandoned_after_the_timeout() -> None:
    cache = torch.randn(2, 2, 2, 16, 2, 8)
    frame = encode_frame(cache, [0, 1], [10, 20])
    transport = httpx.MockTransport(lambda _: httpx.Response(200, stream=Trickle(frame)))

    async def pull() -> None:
        async with httpx.AsyncClient(transport=transport) as client:
            await pull_blocks(client, "http://peer", [10, 20], Layout.of(cache), timeout=0.3)

    with pytest.raises(TransferError, match=r"longer than 0\.3 s"):
        asyncio.run(pull())


def _header(**fields: object) -> dict:
    blocks = [{"hash": 10, "nbytes": 2 * 2 * 16 * 2 * 8 * 4, "xxh3": 1}, {"hash": 20, "nbytes": 2048, "xxh3": 2}]
    return {"shape": [2, 2, 16, 2, 8], "dtype": "float32", "weights": "", "blocks": blocks, **fields}


MALFORMED: dict[str, bytes] = {  # header lines a broken or hostile peer may send: valid JSON, the wrong shape
    "a list": b"[1,2]",
    "null": b"null",
    "a string": b'"frame"',
    "not JSON": b"<html>oops</html>",
    "blocks an int": json.dumps(_header(blocks=5)).encode(),
    "blocks missing": json.dumps({k: v for k, v in _header().items() if k != "blocks"}).encode(),
    "a block a list": json.dumps(_header(blocks=[[10, 2048, 1]])).encode(),
    "nbytes a string": json.dumps(_header(blocks=[{"hash": 10, "nbytes": "x", "xxh3": 1}])).encode(),
    "nbytes negative": json.dumps(_header(blocks=[{"hash": 10, "nbytes": -5, "xxh3": 1}])).encode(),
    "nbytes a float": json.dumps(_header(blocks=[{"hash": 10, "nbytes": 2048.0, "xxh3": 1}])).encode(),
    "nbytes a bool": json.dumps(_header(blocks=[{"hash": 10, "nbytes": True, "xxh3": 1}])).encode(),
    "hash a string": json.dumps(_header(blocks=[{"hash": "10", "nbytes": 2048, "xxh3": 1}])).encode(),
    "xxh3 missing": json.dumps(_header(blocks=[{"hash": 10, "nbytes": 2048}])).encode(),
    "shape a string": json.dumps(_header(shape="2x2")).encode(),
    "shape of strings": json.dumps(_header(shape=["2", 2, 16, 2, 8])).encode(),
    "dtype a number": json.dumps(_header(dtype=4)).encode(),
    "weights a list": json.dumps(_header(weights=["a"])).encode(),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_header_is_a_transfer_error(case: str) -> None:
    """Whatever the header line holds, the pull ends in a TransferError (the caller recomputes), never a
    TypeError or AttributeError escaping to the request as a 500."""
    body = MALFORMED[case] + b"\n" + bytes(4096)
    transport = httpx.MockTransport(lambda _: httpx.Response(200, content=body))

    async def pull() -> None:
        async with httpx.AsyncClient(transport=transport) as client:
            await pull_blocks(client, "http://peer", [10, 20], Layout((2, 2, 16, 2, 8), "float32"))

    with pytest.raises(TransferError, match="malformed frame header"):
        asyncio.run(pull())


def test_a_frame_from_other_weights_is_refused() -> None:
    cache = torch.randn(2, 2, 2, 16, 2, 8)
    frame = encode_frame(cache, [0, 1], [10, 20], weights="aaaa")
    assert json.loads(frame.split(b"\n", 1)[0])["weights"] == "aaaa"

    async def pull(layout: Layout) -> PulledBlocks:
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(200, content=frame))) as c:
            return await pull_blocks(c, "http://peer", [10, 20], layout)

    assert asyncio.run(pull(Layout.of(cache, "aaaa"))).hashes == [10, 20]
    with pytest.raises(TransferError, match="other weights"):
        asyncio.run(pull(Layout.of(cache, "bbbb")))
    with pytest.raises(TransferError, match="other weights"):  # a sender that does not say is not trusted
        asyncio.run(pull_old(cache))


def test_a_frame_declaring_more_bytes_or_blocks_than_asked_is_refused_before_its_bytes_come() -> None:
    """A frame's size is the peer's word: a header declaring a huge block (or more blocks than were asked for) is
    refused at once, not after buffering whatever it declared."""
    cache = torch.randn(2, 2, 2, 16, 2, 8)
    layout = Layout.of(cache)
    headers = {"huge": _header(blocks=[{"hash": 10, "nbytes": 1 << 40, "xxh3": 1}]),
               "extra": _header(blocks=[{"hash": h, "nbytes": layout.block_bytes, "xxh3": 1} for h in (10, 20, 30)])}
    for why, header in headers.items():
        body = json.dumps(header).encode() + b"\n"  # and no bytes after it: only the header can refuse it
        transport = httpx.MockTransport(lambda _, body=body: httpx.Response(200, content=body))

        async def pull(transport: httpx.MockTransport = transport) -> None:
            async with httpx.AsyncClient(transport=transport) as client:
                await pull_blocks(client, "http://peer", [10, 20], layout)

        with pytest.raises(TransferError, match="expected" if why == "huge" else "left to send"):
            asyncio.run(pull())


async def pull_old(cache: torch.Tensor) -> PulledBlocks:
    """A frame as an engine before weights fingerprints sent it (no `weights`), pulled by one that has them."""
    line, data = encode_frame(cache, [0, 1], [10, 20]).split(b"\n", 1)
    header = json.loads(line)
    del header["weights"]
    frame = json.dumps(header).encode() + b"\n" + data
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(200, content=frame))) as c:
        return await pull_blocks(c, "http://peer", [10, 20], Layout.of(cache, "aaaa"))


@pytest.fixture(scope="module")
def fake_peer() -> Iterator[tuple[str, dict[str, bytes]]]:
    """A stand-in peer at a real URL whose /v1/kv/fetch answers whatever body the test puts in `reply["body"]`."""
    reply = {"body": b""}

    async def fetch(request: Request) -> Response:
        await request.body()
        return Response(reply["body"], media_type="application/octet-stream")

    port = free_port()
    app = Starlette(routes=[Route(KV_FETCH_PATH, fetch, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the fake peer never started"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", reply
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def puller(tiny_dir: Path) -> Iterator[tuple[str, Engine]]:
    engine = make_engine(tiny_dir)
    with serve_engine(engine) as url:
        yield url, engine
    engine.kv.check_invariants()


END_TO_END = ["a list", "null", "blocks an int", "nbytes a string", "hash a string"]


@pytest.mark.parametrize("case", END_TO_END)
def test_a_malformed_header_from_a_peer_is_recomputed_through_the_real_pull(
    fake_peer: tuple[str, dict[str, bytes]], puller: tuple[str, Engine], case: str
) -> None:
    """The engine's own pull (kv_transfer mode pull) against a peer that sends a malformed header: the request
    answers 200 with the prompt computed here, and the transfer counts as failed."""
    peer, reply = fake_peer
    url, engine = puller
    reply["body"] = MALFORMED[case] + b"\n" + bytes(4096)
    prompt = [(END_TO_END.index(case) * 7919 + i * 104729) % 48000 + 200 for i in range(96)]  # one per case
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    reference = httpx.post(url + "/v1/completions", json={**body, "cache_salt": case}, timeout=60).json()
    failed = transfers(engine, "pull", "failed")
    got = httpx.post(url + "/v1/completions", timeout=60,
                     json={**body, "kv_transfer": {"mode": "pull", "source": peer, "tokens": 80}})
    assert got.status_code == 200, got.text
    assert got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert got.json()["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    assert transfers(engine, "pull", "failed") == failed + 1
