"""Linear layers in the form the CPU computes fastest, chosen once at load.

- `none`: weights stored transposed ([in, out], contiguous); `x @ w` runs the CPU's small-batch products up to
  1.7x faster than `F.linear` on the [out, in] layout (measured on AVX2 EPYC, docs/benchmarks.md). bf16 weights
  on a CPU where oneDNN runs bf16 (AVX512-BF16 or AMX) are reordered once into oneDNN's blocked layout instead:
  a plain bf16 product reorders its weight on every call, which made the bundled model's 30 layers cost 31 ms a
  step at batch 1 and 58 ms at 128 rows on a Xeon with AMX, against 20 and 42 ms prepacked.
- `int8`: weights quantized per output channel to int8, activations quantized per call (dynamic
  quantization, fbgemm): 2 to 4x faster products and a quarter of the weight bytes, for about 2 % relative
  error per layer. Opt-in, CPU only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from kvmesh.engine.protocol import QUANTIZATIONS

Linear = Callable[[torch.Tensor], torch.Tensor]
FEW_ROWS = 8  # up to this many rows a wide [out, in] product runs as W x^T on a CPU (_few_rows_as_w_xt)


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    quantization: str,
    device: torch.device,
    transpose: bool = True,
) -> Linear:
    """y = x W^T + b for a weight of shape [out, in]. `transpose=False` keeps an unquantized weight as it is
    (the vocabulary product, whose [out, in] form is faster from batch 8 up and shares the embedding's memory)."""
    if quantization == "none" and not transpose:
        w = weight.to(device)
        b = None if bias is None else bias.to(device)
        return _few_rows_as_w_xt(w, b) if device.type == "cpu" else lambda x: torch.nn.functional.linear(x, w, b)
    if quantization == "none" and device.type == "cpu" and weight.dtype == torch.bfloat16 and onednn_bf16():
        return _prepacked(weight, bias)
    if quantization == "none":
        w = weight.t().contiguous().to(device)
        b = None if bias is None else bias.to(device)
        return (lambda x: x @ w) if b is None else (lambda x: torch.addmm(b, x, w))
    if quantization == "int8":
        if device.type != "cpu":
            raise ValueError("int8 quantization runs on the CPU only (fbgemm); use dtype bfloat16 on GPUs")
        w32 = weight.float()
        scales = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-8).double()
        zero_points = torch.zeros(w32.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated upstream; constraints.txt pins torch
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w32, scales, zero_points, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.float())
        # reduce_range: 7-bit activations, so AVX2's 16-bit intermediate sums cannot saturate
        return lambda x: torch.ops.quantized.linear_dynamic(x.float(), packed, True).to(x.dtype)
    raise ValueError(f"unknown quantization {quantization!r}; known: {', '.join(QUANTIZATIONS)}")


def onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 products on this CPU: natively with AVX512-BF16 or AMX, emulated on other AVX-512
    CPUs (where `--dtype auto` serves fp32; only a dtype asked for gets bf16 there, unmeasured)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _prepacked(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """x W^T + b by oneDNN on a weight reordered once into its blocked layout (the op torch's own compiler uses
    for frozen CPU linears); the result is bit-identical to `F.linear`."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    b = None if bias is None else bias.to(weight.dtype)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def _few_rows_as_w_xt(w: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """x W^T for a wide [out, in] weight (the vocabulary product), computed as (W x^T)^T for up to FEW_ROWS rows.
    torch's CPU products run few rows of x W^T slowly at this width: the bundled model's 49,152 x 576 head took
    9.2 ms for one row (a single-threaded gemv) and 23 and 34 ms for two and three, against 3.0 to 7.4 ms for
    one to eight rows as W x^T, and 15.6 ms either way at 8 to 16 (2 cores of an AVX512 EPYC, torch 2.13). One
    row is doubled (a copy: a broadcast view is slower still), since alone it takes the gemv again."""

    def product(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n > FEW_ROWS:
            return torch.nn.functional.linear(x, w, bias)
        y = (w @ (x.repeat(2, 1) if n == 1 else x).t()).t()[:n].contiguous()
        return y if bias is None else y + bias

    return product
