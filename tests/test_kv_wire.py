"""The transfer client against a peer that trickles: a slow transfer is abandoned, so the request recomputes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import torch

from kvmesh.engine.kv.transfer import Layout, TransferError, encode_frame, pull_blocks


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
