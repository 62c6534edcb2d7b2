"""Triton kernels for paged attention, KV writes and block copies, with their torch references.

Modules here import only torch, triton, numpy and each other, so they run from the source tree on a GPU
machine without kvmesh's other dependencies (`python engine/kernels/bench.py`). This file imports triton
lazily: triton decides at a kernel's definition whether to interpret it (TRITON_INTERPRET), so nothing may
define kernels before a test or the benchmark has chosen.
"""

from __future__ import annotations

import torch


def _use_triton(kv: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be auto, torch or triton, got {backend!r}")
    return backend == "triton" or (backend == "auto" and kv.is_cuda)


def gather_blocks(kv: torch.Tensor, block_ids: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The blocks `block_ids` of a block-first KV tensor as one new contiguous tensor
    [len(block_ids), *kv.shape[1:]]: one launch on CUDA (Triton), index_select elsewhere."""
    if _use_triton(kv, backend):
        from .block_copy import gather_blocks_triton

        return gather_blocks_triton(kv, block_ids)
    return kv.index_select(0, block_ids.long())


def scatter_blocks(kv: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor, backend: str = "auto") -> None:
    """kv[block_ids[i]] = data[i]: the inverse of gather_blocks. `data` must already be on kv's device."""
    if _use_triton(kv, backend):
        from .block_copy import scatter_blocks_triton

        scatter_blocks_triton(kv, block_ids, data.contiguous())
        return
    kv.index_copy_(0, block_ids.long(), data)
