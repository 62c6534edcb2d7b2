"""What every kernel module shares: the launch counter, the interpreter switch, dtype choices.

Kernel modules import only torch, triton, numpy and their siblings (relatively), so they run from the source
tree on a GPU machine that has none of kvmesh's other dependencies (engine/kernels/bench.py).
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LAUNCHES: Counter[str] = Counter()  # kernel name -> launches; tests read it to prove a kernel actually ran

# Triton reads TRITON_INTERPRET when a kernel is decorated (module import), so the kernels here are interpreted
# or compiled once and for all; this records which, as they are defined (each kernel module imports this first)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype tl.dot multiplies in: the input's own (fp32 accumulation either way). Triton's CPU
    interpreter stores bf16 as raw uint16 and multiplies those bits, so interpreted bf16 dots run in fp32:
    bf16 loads, stores and conversions are still exercised, the bf16 tensor-core product only on a GPU."""
    if dtype not in _TL_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; supported: float16, bfloat16, float32")
    if dtype == torch.bfloat16 and INTERPRETED:
        return tl.float32
    return _TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply exactly ("ieee"), not in tf32, so an fp32 engine matches the torch path."""
    return "ieee" if dot_dtype(dtype) == tl.float32 else "tf32"


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (how many programs fill it); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def attention_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(q heads, head dim, block size, KV heads) of an attention call, after checking that q ([T, Hq, D]) fits
    one layer's view of the block-first cache ([blocks, block_size, Hkv, D]) with contiguous head dims."""
    _, q_heads, head_dim = q.shape
    _, page, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or q_heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the head dimension must be contiguous")
    return q_heads, head_dim, page, kv_heads


@dataclass(frozen=True)
class Scales:
    """The per-row scales of an int8 cache's K and V for one layer (`[num_blocks, block_size, Hkv]` fp32 views,
    engine/kvcache.py), as the attention kernels take them; None for a cache in the model's dtype."""

    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        if self.k.dtype != torch.float32 or self.v.dtype != torch.float32:
            raise TypeError("int8 KV scales are fp32")
        if self.k.stride(-1) != 1 or self.v.stride(-1) != 1:
            raise ValueError("the scales' head dimension must be contiguous")


def scale_arguments(scales: Scales | None, k_cache: torch.Tensor) -> tuple[object, ...]:
    """(k scales, v scales, their block and token strides, QUANT) for a kernel launch; a model-dtype cache passes
    its own K view as an unread pointer."""
    if scales is None:
        if k_cache.dtype == torch.int8:
            raise ValueError("an int8 cache needs its scales")
        return k_cache, k_cache, 0, 0, 0, 0, False
    if k_cache.dtype != torch.int8:
        raise ValueError(f"scales go with an int8 cache, not {k_cache.dtype}")
    return (scales.k, scales.v, scales.k.stride(0), scales.k.stride(1), scales.v.stride(0), scales.v.stride(1),
            True)


@triton.jit
def load_kv_tile(
    table, k_ptr, v_ptr, ks_ptr, vs_ptr, tok, tok_ok, d, d_ok, kv_head,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_vsb, stride_vst,
    PAGE: tl.constexpr, DOT: tl.constexpr, QUANT: tl.constexpr,
):
    """K and V of tokens `tok` of one sequence for one KV head, through its block table ([N, D] each, in the dot
    dtype; masked tokens and dims read as 0). Block ids widen to int64 before the multiply. An int8 cache
    (QUANT) is dequantized here: each token's row times its fp32 scale."""
    block = tl.load(table + tok // PAGE, mask=tok_ok, other=0).to(tl.int64)
    slot = tok % PAGE
    k_off = block[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
    v_off = block[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :]
    kv_mask = tok_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + k_off, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + v_off, mask=kv_mask, other=0.0)
    if QUANT:
        k_scale = tl.load(ks_ptr + block * stride_ksb + slot * stride_kst + kv_head, mask=tok_ok, other=0.0)
        v_scale = tl.load(vs_ptr + block * stride_vsb + slot * stride_vst + kv_head, mask=tok_ok, other=0.0)
        return (k.to(tl.float32) * k_scale[:, None]).to(DOT), (v.to(tl.float32) * v_scale[:, None]).to(DOT)
    return k.to(DOT), v.to(DOT)


@triton.jit
def online_softmax_step(q, k, v, visible, m_i, l_i, acc, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of flash attention in log2 units: scores of q against k where `visible`, the running max,
    normalizer and output rescaled. Every row must see at least one key in its first tile (the max is finite)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PRECISION)
    return m_new, l_i, acc
