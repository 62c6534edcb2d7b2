"""Linear layers in the form the CPU computes fastest, chosen once at load.

- `none`: weights stored transposed ([in, out], contiguous); `x @ w` runs the CPU's small-batch products up to
  1.7x faster than `F.linear` on the [out, in] layout (measured on AVX2 EPYC, docs/benchmarks.md).
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
        return lambda x: torch.nn.functional.linear(x, w, bias)
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
