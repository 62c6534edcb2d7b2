"""What every kernel module shares: the launch counter, the interpreter switch, dtype choices.

Kernel modules import only torch, triton, numpy and their siblings (relatively), so they run from the source
tree on a GPU machine that has none of kvmesh's other dependencies (engine/kernels/bench.py).
"""

from __future__ import annotations

import functools
import os
from collections import Counter

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
