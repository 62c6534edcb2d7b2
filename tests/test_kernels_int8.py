"""The Triton kernels over an int8 KV cache (engine/kvcache.py's format), run by Triton's CPU interpreter: the KV
write quantizes to exactly the bytes the torch path writes (values and scales), and decode and extend attention
over the int8 cache equal the fp32 reference computed over the same cache dequantized, to the query dtype's
tolerance (reference.TOLERANCE)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined: triton decides when a kernel is decorated

import random

import pytest
import torch

from kvmesh.engine.kernels import decode, extend, kv_write
from kvmesh.engine.kernels import reference as ref
from kvmesh.engine.kernels.common import Scales
from kvmesh.engine.kvcache import KVLayout, LayerKV

PAGE = 16
CPU = torch.device("cpu")


def int8_cache(blocks: int, kv_heads: int, dim: int, seed: int) -> tuple[KVLayout, torch.Tensor]:
    """A two-layer int8 cache with every slot written (through the torch path) from random rows."""
    layout = KVLayout(num_layers=2, block_size=PAGE, num_kv_heads=kv_heads, head_dim=dim, dtype=torch.float32,
                      cache_dtype="int8")
    cache = layout.allocate(blocks, CPU)
    g = torch.Generator().manual_seed(seed)
    ids, offsets = torch.arange(blocks).repeat_interleave(PAGE), torch.arange(PAGE).repeat(blocks)
    for k, v in layout.layers(cache):
        k.write(ids, offsets, torch.randn((blocks * PAGE, kv_heads, dim), generator=g) * 3)
        v.write(ids, offsets, torch.randn((blocks * PAGE, kv_heads, dim), generator=g))
    return layout, cache


def dequantized(part: LayerKV) -> torch.Tensor:
    """[blocks, page, Hkv, D] fp32: what attention over this int8 K or V must read."""
    return part.read(torch.arange(part.values.shape[0]), torch.float32)


def kernel_arguments(layer: tuple[LayerKV, LayerKV]) -> tuple[torch.Tensor, torch.Tensor, Scales]:
    k, v = layer
    assert k.scales is not None and v.scales is not None
    return k.values, v.values, Scales(k.scales, v.scales)


@pytest.mark.parametrize(("kv_heads", "dim"), [(2, 64), (3, 80)])
def test_the_kv_write_stores_the_torch_paths_bytes(kv_heads: int, dim: int) -> None:
    layout, _ = int8_cache(1, kv_heads, dim, 0)
    mine, theirs = layout.allocate(8, CPU), layout.allocate(8, CPU)
    g = torch.Generator().manual_seed(1)
    k = torch.randn((6, kv_heads, dim), generator=g) * 5
    k[2, 1] = 0.0  # an all-zero row: scale 0, reads back as zeros
    k[0, 0, :5] = torch.tensor([127.0, -2.5, 2.5, -0.5, 0.5])  # scale 1: exact halves, rounded away from zero
    k[0, 0, 5:] = 0.25
    v = torch.randn((6, kv_heads, dim), generator=g)
    slots = torch.tensor([3, -1, 17, 40, 99, 64])
    k_values, v_values, scales = kernel_arguments(layout.layers(mine)[1])
    kv_write.write_kv(k, v, k_values, v_values, slots, scales)
    keep = slots >= 0
    tk, tv = layout.layers(theirs)[1]
    tk.write(slots[keep] // PAGE, slots[keep] % PAGE, k[keep])
    tv.write(slots[keep] // PAGE, slots[keep] % PAGE, v[keep])
    assert torch.equal(mine, theirs)  # every byte: values, scales, and nothing written for slot -1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(2, 2), (6, 2)])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_over_an_int8_cache(dtype: torch.dtype, q_heads: int, kv_heads: int, splits: int) -> None:
    rng = random.Random(f"{dtype}{q_heads}{splits}")
    dim, lengths = 64, [1, 16, 37, 130]
    blocks = sum(-(-n // PAGE) for n in lengths) + 3
    layout, cache = int8_cache(blocks, kv_heads, dim, rng.randrange(1000))
    ids = list(range(blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in lengths:
        tables.append(ids[at : at + -(-n // PAGE)])
        at += -(-n // PAGE)
    q = torch.randn((len(lengths), q_heads, dim)).to(dtype)
    layer = layout.layers(cache)[1]
    k_values, v_values, scales = kernel_arguments(layer)
    batch = decode.DecodeBatch.build(list(range(len(lengths))), tables, lengths, CPU)
    got = decode.decode_attention(q, k_values, v_values, batch, dim**-0.5, num_splits=splits, scales=scales)
    want = ref.decode_reference(q, dequantized(layer[0]), dequantized(layer[1]), list(range(len(lengths))), tables,
                                lengths, dim**-0.5)
    tol = ref.TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_over_an_int8_cache(dtype: torch.dtype) -> None:
    kv_heads, q_heads, dim = 2, 6, 64
    q_lens, prefixes = [1, 40, 70], [50, 0, 90]
    contexts = [a + b for a, b in zip(q_lens, prefixes, strict=True)]
    blocks = sum(-(-n // PAGE) for n in contexts)
    layout, cache = int8_cache(blocks, kv_heads, dim, 5)
    tables, at = [], 0
    for n in contexts:
        tables.append(list(range(at, at + -(-n // PAGE)))[::-1])  # reversed: non-contiguous reads
        at += -(-n // PAGE)
    starts = [0, 1, 41]
    q = torch.randn((sum(q_lens), q_heads, dim)).to(dtype)
    layer = layout.layers(cache)[1]
    k_values, v_values, scales = kernel_arguments(layer)
    got = extend.extend_attention(q, k_values, v_values, extend.ExtendBatch.build(starts, q_lens, contexts, tables,
                                                                                  CPU), dim**-0.5, scales=scales)
    want = torch.cat(ref.extend_reference(q, dequantized(layer[0]), dequantized(layer[1]), starts, q_lens, contexts,
                                          tables, dim**-0.5))
    tol = ref.TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_scales_must_match_the_caches_format() -> None:
    layout, cache = int8_cache(2, 2, 64, 0)
    k_values, v_values, scales = kernel_arguments(layout.layers(cache)[1])
    batch = decode.DecodeBatch.build([0], [[0]], [5], CPU)
    q = torch.randn((1, 2, 64))
    with pytest.raises(ValueError, match="needs its scales"):
        decode.decode_attention(q, k_values, v_values, batch, 0.125)
    with pytest.raises(ValueError, match="scales go with an int8 cache"):
        decode.decode_attention(q, torch.randn(2, PAGE, 2, 64), torch.randn(2, PAGE, 2, 64), batch, 0.125,
                                scales=scales)
