"""The KV tensor's two formats (engine/kvcache.py): what a layer writes it reads back (exactly for `auto`, within
half a quantization step for `int8`), every layer and block lands in its own bytes, and a block copied as one
run of bytes (what tiers and transfers do) carries its values and scales with it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.kvcache import INT8_MAX, KVLayout, dequantize, quantize

LAYOUT = {"num_layers": 3, "block_size": 4, "num_kv_heads": 2, "head_dim": 8, "dtype": torch.float32}


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 6), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))
def test_int8_rows_read_back_within_half_a_step(rows: int, magnitude: float, seed: int) -> None:
    x = torch.randn((rows, 2, 16), generator=torch.Generator().manual_seed(seed)) * magnitude
    values, scales = quantize(x)
    assert values.dtype == torch.int8 and values.abs().max() <= INT8_MAX
    back = dequantize(values, scales, torch.float32)
    step = x.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-5))


def test_a_zero_row_reads_back_as_zeros() -> None:
    values, scales = quantize(torch.zeros((2, 3, 8)))
    assert torch.equal(dequantize(values, scales, torch.float32), torch.zeros((2, 3, 8)))


def test_int8_block_is_smaller_by_the_expected_ratio() -> None:
    bf16 = KVLayout(30, 16, 3, 64, torch.bfloat16)
    int8 = KVLayout(30, 16, 3, 64, torch.bfloat16, "int8")
    assert bf16.block_bytes() == 30 * 2 * 16 * 3 * 64 * 2
    assert int8.block_bytes() == 30 * 2 * 16 * 3 * (64 + 4)
    assert int8.allocate(5, torch.device("cpu")).shape == (5, int8.block_bytes())


def test_unknown_cache_dtype_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="auto, int8"):
        KVLayout(**LAYOUT, cache_dtype="fp4")


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_each_layer_and_slot_lands_in_its_own_place(cache_dtype: str) -> None:
    layout = KVLayout(**LAYOUT, cache_dtype=cache_dtype)
    cache = layout.allocate(6, torch.device("cpu"))
    layers = layout.layers(cache)
    written = {}
    gen = torch.Generator().manual_seed(0)
    for layer, (k, v) in enumerate(layers):
        for which, part in enumerate((k, v)):
            rows = torch.randn((2, 2, 8), generator=gen)
            part.write(torch.tensor([1, 4]), torch.tensor([layer, 3 - layer]), rows)
            written[layer, which] = rows
    for (layer, which), rows in written.items():
        got = layers[layer][which].read(torch.tensor([1, 4]), torch.float32)
        got = torch.stack([got[0, layer], got[1, 3 - layer]])
        tol = 0 if cache_dtype == "auto" else rows.abs().max().item() / INT8_MAX
        assert (got - rows).abs().max().item() <= tol
    untouched = [0, 2, 3, 5]
    assert not cache[untouched].any()


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_a_block_copied_as_bytes_reads_the_same_in_another_cache(cache_dtype: str) -> None:
    layout = KVLayout(**LAYOUT, cache_dtype=cache_dtype)
    src, dst = layout.allocate(4, torch.device("cpu")), layout.allocate(4, torch.device("cpu"))
    rows = torch.randn((4, 2, 8))
    for k, v in layout.layers(src):
        k.write(torch.full((4,), 2), torch.arange(4), rows)
        v.write(torch.full((4,), 2), torch.arange(4), -rows)
    dst[0] = src[2]  # one run of bytes, as a tier or a peer moves it
    for (sk, sv), (dk, dv) in zip(layout.layers(src), layout.layers(dst), strict=True):
        assert torch.equal(dk.read(torch.tensor([0]), torch.float32), sk.read(torch.tensor([2]), torch.float32))
        assert torch.equal(dv.read(torch.tensor([0]), torch.float32), sv.read(torch.tensor([2]), torch.float32))
