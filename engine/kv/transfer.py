"""Moving KV blocks between pods (docs/contracts.md, contract 4): the wire format, and the client that pulls blocks.

A pod serves cached blocks by hash at `POST /v1/kv/fetch` as a stream of frames. Each frame is one JSON line
(the block layout, the fingerprint of the base weights that computed the blocks, the blocks' hashes, and per
block its size and xxh3 checksum) followed by those blocks' bytes, back to back: many blocks, all layers, in one
contiguous copy per frame (the block-first layout makes a block one run of memory), never one small copy per
block and layer. The receiver checks the header's shape and types, every block's size and checksum, the layout
of the whole and that its own weights computed them; anything wrong and it recomputes instead.
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
    weights: str = ""  # the base weights that computed the blocks (KVConfig.weights_fingerprint)

    @classmethod
    def of(cls, kv_cache: torch.Tensor, weights: str = "") -> Layout:
        return cls(tuple(kv_cache.shape[1:]), str(kv_cache.dtype).removeprefix("torch."), weights)

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def _as_bytes(blocks: torch.Tensor) -> bytes:
    """The raw bytes of contiguous blocks, whatever their dtype."""
    return blocks.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def encode_frame(kv_cache: torch.Tensor, block_ids: Sequence[int], hashes: Sequence[int], weights: str = "") -> bytes:
    """One frame: these blocks (block_ids[i] holds hashes[i]) in one contiguous copy, behind their header, which
    names the base weights that computed them (`weights`). The caller keeps the blocks pinned while this runs."""
    layout = Layout.of(kv_cache, weights)
    ids = torch.tensor(list(block_ids), device=kv_cache.device)
    data = _as_bytes(gather_blocks(kv_cache, ids))  # one Triton launch on CUDA, index_select elsewhere
    size = layout.block_bytes
    blocks = [
        {"hash": h, "nbytes": size, "xxh3": xxhash.xxh3_64_intdigest(data[i * size : (i + 1) * size])}
        for i, h in enumerate(hashes)
    ]
    header = {"shape": list(layout.shape), "dtype": layout.dtype, "weights": layout.weights, "blocks": blocks}
    return json.dumps(header).encode() + b"\n" + data


@dataclass(frozen=True)
class FrameBlock:
    hash: int
    nbytes: int
    xxh3: int


@dataclass(frozen=True)
class FrameHeader:
    """A frame's header line, read and typed: whatever a peer (or something posing as one) sent."""

    shape: tuple[int, ...]
    dtype: str
    weights: str  # "" from a sender that does not say (an older engine)
    blocks: tuple[FrameBlock, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)


def _uint(value: object, what: str) -> int:
    if type(value) is not int or value < 0:  # not bool, float or string: a well-formed peer sends plain integers
        raise TransferError(f"malformed frame header: {what} is {value!r}, not an integer >= 0")
    return value


def parse_header(line: bytes | bytearray) -> FrameHeader:
    """A frame's header line as a FrameHeader; TransferError for anything that is not one (not JSON, another
    type, a field missing or of another type), so a bad peer costs a recompute, never an error."""
    try:
        raw = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TransferError(f"malformed frame header: {exc}") from None
    if not isinstance(raw, dict):
        raise TransferError(f"malformed frame header: a {type(raw).__name__}, not an object")
    shape, dtype, weights, blocks = raw.get("shape"), raw.get("dtype"), raw.get("weights", ""), raw.get("blocks")
    if not isinstance(shape, list) or not isinstance(dtype, str) or not isinstance(weights, str):
        raise TransferError("malformed frame header: shape must be a list, dtype and weights strings")
    if not isinstance(blocks, list):
        raise TransferError(f"malformed frame header: blocks is {blocks!r}, not a list")
    parsed: list[FrameBlock] = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict):
            raise TransferError(f"malformed frame header: block {i} is {block!r}, not an object")
        parsed.append(FrameBlock(_uint(block.get("hash"), f"block {i}'s hash"),
                                 _uint(block.get("nbytes"), f"block {i}'s nbytes"),
                                 _uint(block.get("xxh3"), f"block {i}'s xxh3")))
    return FrameHeader(tuple(_uint(d, "a shape dimension") for d in shape), dtype, weights, tuple(parsed))


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
                    header = parse_header(buffer[:newline])
                    # before waiting for the bytes: another layout sends them in vain, and a frame's size is the
                    # peer's word (a bad one would have us buffer whatever it declared)
                    _check_layout(header, layout, len(hashes) - len(got))
                    need = header.nbytes
                    if len(buffer) - newline - 1 < need:
                        break
                    data = bytes(buffer[newline + 1 : newline + 1 + need])
                    del buffer[: newline + 1 + need]
                    _check(header, data, hashes[len(got) : len(got) + len(header.blocks)])
                    got += [b.hash for b in header.blocks]
                    chunks.append(data)
            if buffer:
                raise TransferError(f"{source} ended the transfer mid-frame")
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise TransferError(f"transfer from {source} failed: {exc}") from exc
    raw = bytearray(b"".join(chunks))
    storage = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    data = storage.view(getattr(torch, layout.dtype)).reshape(len(got), *layout.shape)
    return PulledBlocks(got, data, len(raw), time.perf_counter() - start)


def _check_layout(header: FrameHeader, layout: Layout, left: int) -> None:
    """A frame's header against our layout and the `left` blocks still asked for, before its bytes are read."""
    if header.shape != layout.shape or header.dtype != layout.dtype:
        raise TransferError(f"peer layout {list(header.shape)} {header.dtype} differs from ours "
                            f"{list(layout.shape)} {layout.dtype}")
    if header.weights != layout.weights:  # same name and shape, other weights (a rollout): its KV is not ours
        raise TransferError(f"peer's blocks were computed by other weights (fingerprint {header.weights or 'unknown'}"
                            f", ours {layout.weights or 'unknown'})")
    if len(header.blocks) > left:
        raise TransferError(f"the peer sent {len(header.blocks)} blocks in a frame; {left} were left to send")
    for block in header.blocks:
        if block.nbytes != layout.block_bytes:
            raise TransferError(f"block {block.hash} has {block.nbytes} bytes, expected {layout.block_bytes}")


def _check(header: FrameHeader, data: bytes, expected: Sequence[int]) -> None:
    """A frame's blocks, once read (their layout and sizes checked already): the ones asked for, in order, intact."""
    offset = 0
    for i, block in enumerate(header.blocks):
        if i >= len(expected) or block.hash != expected[i]:
            raise TransferError("the peer sent blocks out of order")
        if xxhash.xxh3_64_intdigest(data[offset : offset + block.nbytes]) != block.xxh3:
            raise TransferError(f"block {block.hash} failed its checksum")
        offset += block.nbytes
