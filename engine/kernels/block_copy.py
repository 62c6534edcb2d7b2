"""Block copy: gather scattered KV blocks into one contiguous buffer, and scatter such a buffer back.

In the block-first layout a block (all layers, K and V) is one contiguous run, so moving n blocks to a host
tier or a peer is one launch and one buffer instead of n x layers x 2 small copies. Blocks are copied as
flat element runs; offsets are int64 because block id x block size overflows int32 on large caches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LAUNCHES

BLOCK = 4096  # elements a program copies


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, ids_ptr, src_stride, dst_stride, numel, GATHER: tl.constexpr,
                        BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    block = tl.load(ids_ptr + i).to(tl.int64)
    if GATHER:
        src = src_ptr + block * src_stride + offs
        dst = dst_ptr + i.to(tl.int64) * dst_stride + offs
    else:
        src = src_ptr + i.to(tl.int64) * src_stride + offs
        dst = dst_ptr + block * dst_stride + offs
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def _check(kv: torch.Tensor, ids: torch.Tensor) -> int:
    if not kv[0].is_contiguous():
        raise ValueError("each block of the KV tensor must be one contiguous run (the block-first layout)")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("block ids must be a 1-D int32 or int64 tensor")
    return kv[0].numel()


def gather_blocks_triton(kv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """kv[ids] as a new contiguous tensor [len(ids), *kv.shape[1:]]."""
    numel = _check(kv, ids)
    out = torch.empty((ids.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    if ids.shape[0]:
        _copy_blocks_kernel[(ids.shape[0], triton.cdiv(numel, BLOCK))](
            kv, out, ids, kv.stride(0), numel, numel, GATHER=True, BLOCK=BLOCK)
        LAUNCHES["gather_blocks"] += 1
    return out


def scatter_blocks_triton(kv: torch.Tensor, ids: torch.Tensor, data: torch.Tensor) -> None:
    """kv[ids[i]] = data[i] for every i; data is [len(ids), *kv.shape[1:]], contiguous."""
    numel = _check(kv, ids)
    if data.shape != (ids.shape[0], *kv.shape[1:]) or data.dtype != kv.dtype or not data.is_contiguous():
        raise ValueError(f"data must be contiguous {kv.dtype} of shape {(ids.shape[0], *kv.shape[1:])}, "
                         f"got {data.dtype} {tuple(data.shape)}")
    if ids.shape[0]:
        _copy_blocks_kernel[(ids.shape[0], triton.cdiv(numel, BLOCK))](
            data, kv, ids, numel, kv.stride(0), numel, GATHER=False, BLOCK=BLOCK)
        LAUNCHES["scatter_blocks"] += 1
