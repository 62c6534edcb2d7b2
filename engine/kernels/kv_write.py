"""KV write: scatter a step's new K and V into their cache slots by a slot mapping.

A slot is `block * block_size + offset`; -1 means "do not store" (a token whose KV is not kept, such as
padding). One program stores one token's K and V for all KV heads of one layer. Into an int8 cache each
(token, head) row is quantized on the way, as engine/kvcache.py does it: scale = absmax / 127, values rounded
half away from zero, with IEEE divisions (Triton's `/` approximates on a GPU), so both backends write the same
bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LAUNCHES, Scales, next_pow2, scale_arguments

INT8_MAX = tl.constexpr(127)  # engine/kvcache.py's format (kernels import nothing of kvmesh; tests/test_kernels_int8.py
# checks that both write the same bytes)


@triton.jit
def _quantize_rows(x, row_ok):
    """Per-row symmetric int8 of x ([H, D] fp32): values (still fp32, integral) and scales [H]."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, INT8_MAX, tl.float32))  # IEEE division, as torch's: a GPU's
    y = tl.math.div_rn(x, tl.broadcast_to(tl.where(scale > 0, scale, 1.0)[:, None], x.shape))  # `/` approximates
    rounded = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))
    return tl.minimum(tl.maximum(rounded, -INT8_MAX), INT8_MAX), tl.where(row_ok, scale, 0.0)


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    stride_ksb, stride_kst, stride_vsb, stride_vst,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    keep = tl.full([BLOCK_H, BLOCK_D], 0, tl.int64) + slot >= 0  # a full tile: scalar masks do not broadcast
    mask = (h[:, None] < HEADS) & (d[None, :] < HEAD_DIM) & keep
    block = slot // PAGE
    offset = slot % PAGE
    k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct + h[:, None] * stride_kch + d[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct + h[:, None] * stride_vch + d[None, :]
    if QUANT:
        head_ok = (h < HEADS) & (tl.full([BLOCK_H], 0, tl.int64) + slot >= 0)
        k, k_scale = _quantize_rows(k.to(tl.float32), head_ok)
        v, v_scale = _quantize_rows(v.to(tl.float32), head_ok)
        tl.store(ks_ptr + block * stride_ksb + offset * stride_kst + h, k_scale, mask=head_ok)
        tl.store(vs_ptr + block * stride_vsb + offset * stride_vst + h, v_scale, mask=head_ok)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    scales: Scales | None = None,
) -> None:
    """Store k[t] and v[t] ([T, Hkv, D], any row stride) at slot slots[t] of one layer's K and V views
    ([num_blocks, block_size, Hkv, D]); slots[t] == -1 is skipped. Converts to the cache's dtype, or quantizes
    into an int8 cache and its `scales`."""
    tokens, heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != k.shape[1:] or slots.shape != (tokens,):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slots.shape)} do not fit the "
                         f"cache {tuple(k_cache.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the head dimension must be contiguous")
    if tokens == 0:
        return
    ks, vs, stride_ksb, stride_kst, stride_vsb, stride_vst, quant = scale_arguments(scales, k_cache)
    _kv_write_kernel[(tokens,)](
        k, v, k_cache, v_cache, ks, vs, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        stride_ksb, stride_kst, stride_vsb, stride_vst,
        HEADS=heads, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(head_dim), QUANT=quant,
    )
    LAUNCHES["kv_write"] += 1
