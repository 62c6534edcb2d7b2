"""Moving KV blocks between pods (DESIGN.md contract 4): the wire format, and the client that pulls blocks.

A pod serves cached blocks by hash at `POST /v1/kv/fetch` as a stream of frames. Each frame is one JSON line
(the blocks' hashes, and per block its size and xxh3 checksum) followed by those blocks' bytes, back to back:
many blocks, all layers, in one contiguous copy per frame (the block-first layout makes a block one run of
memory), never one small copy per block and layer. The receiver checks every block's size and checksum and
the layout of the whole; anything wrong and it recomputes instead.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np
import torch
import xxhash

from kvmesh.engine.kernels import gather_blocks

KV_FETCH_PATH = "/v1/kv/fetch"


class TransferError(Exception):
    """A pull that cannot be used: the caller recomputes."""


@dataclass(frozen=True)
class Layout:
    """What must match for a block's bytes to mean the same KV on both sides."""

    shape: tuple[int, ...]  # one block: [layers, 2, block_size, kv_heads, head_dim], or [block_bytes] for int8
    dtype: str

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> Layout:
        return cls(tuple(kv_cache.shape[1:]), str(kv_cache.dtype).removeprefix("torch."))

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def _as_bytes(blocks: torch.Tensor) -> bytes:
    """The raw bytes of contiguous blocks, whatever their dtype."""
    return blocks.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def encode_frame(kv_cache: torch.Tensor, block_ids: Sequence[int], hashes: Sequence[int]) -> bytes:
    """One frame: these blocks (block_ids[i] holds hashes[i]) in one contiguous copy, behind their header.
    The caller keeps the blocks pinned while this runs."""
    layout = Layout.of(kv_cache)
    ids = torch.tensor(list(block_ids), device=kv_cache.device)
    data = _as_bytes(gather_blocks(kv_cache, ids))  # one Triton launch on CUDA, index_select elsewhere
    size = layout.block_bytes
    blocks = [
        {"hash": h, "nbytes": size, "xxh3": xxhash.xxh3_64_intdigest(data[i * size : (i + 1) * size])}
        for i, h in enumerate(hashes)
    ]
    header = {"shape": list(layout.shape), "dtype": layout.dtype, "blocks": blocks}
    return json.dumps(header).encode() + b"\n" + data


@dataclass(frozen=True)
class PulledBlocks:
    hashes: list[int]
    data: torch.Tensor  # [n, *layout.shape], ready to copy into the cache
    nbytes: int
    seconds: float


async def pull_blocks(
    client: httpx.AsyncClient,
    source: str,
    hashes: Sequence[int],
    layout: Layout,
    handle: str | None = None,
    timeout: float = 30.0,
) -> PulledBlocks:
    """Fetch the blocks of `hashes` from a peer. Returns the leading run the peer had, verified; raises
    TransferError when the peer refuses (an unknown or expired handle), the layout differs, a block is
    damaged, or the whole transfer takes longer than `timeout` seconds (a slow peer costs at most that)."""
    try:
        async with asyncio.timeout(timeout):
            return await _pull(client, source, hashes, layout, handle)
    except TimeoutError:
        raise TransferError(f"transfer from {source} took longer than {timeout:.1f} s") from None


async def _pull(
    client: httpx.AsyncClient, source: str, hashes: Sequence[int], layout: Layout, handle: str | None
) -> PulledBlocks:
    start = time.perf_counter()
    body = {"block_hashes": list(hashes), "handle": handle}
    got: list[int] = []
    chunks: list[bytes] = []
    try:
        async with client.stream("POST", source.rstrip("/") + KV_FETCH_PATH, json=body) as reply:
            if reply.status_code != 200:
                detail = (await reply.aread()).decode(errors="replace")[:300]
                raise TransferError(f"{source} refused the transfer ({reply.status_code}): {detail}")
            buffer = bytearray()
            async for piece in reply.aiter_bytes():
                buffer.extend(piece)
                while True:
                    newline = buffer.find(b"\n")
                    if newline < 0:
                        break
                    header = json.loads(buffer[:newline])
                    need = sum(b["nbytes"] for b in header["blocks"])
                    if len(buffer) - newline - 1 < need:
                        break
                    data = bytes(buffer[newline + 1 : newline + 1 + need])
                    del buffer[: newline + 1 + need]
                    _check(header, data, layout, hashes[len(got) : len(got) + len(header["blocks"])])
                    got += [b["hash"] for b in header["blocks"]]
                    chunks.append(data)
            if buffer:
                raise TransferError(f"{source} ended the transfer mid-frame")
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise TransferError(f"transfer from {source} failed: {exc}") from exc
    raw = bytearray(b"".join(chunks))
    storage = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    data = storage.view(getattr(torch, layout.dtype)).reshape(len(got), *layout.shape)
    return PulledBlocks(got, data, len(raw), time.perf_counter() - start)


def _check(header: dict, data: bytes, layout: Layout, expected: Sequence[int]) -> None:
    if tuple(header["shape"]) != layout.shape or header["dtype"] != layout.dtype:
        raise TransferError(f"peer layout {header['shape']} {header['dtype']} differs from ours "
                            f"{list(layout.shape)} {layout.dtype}")
    offset = 0
    for i, block in enumerate(header["blocks"]):
        if i >= len(expected) or block["hash"] != expected[i]:
            raise TransferError("the peer sent blocks out of order")
        if block["nbytes"] != layout.block_bytes:
            raise TransferError(f"block {block['hash']} has {block['nbytes']} bytes, expected {layout.block_bytes}")
        if xxhash.xxh3_64_intdigest(data[offset : offset + block["nbytes"]]) != block["xxh3"]:
            raise TransferError(f"block {block['hash']} failed its checksum")
        offset += block["nbytes"]
