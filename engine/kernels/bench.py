"""Kernel benchmark: correctness on the device, then decode attention in bytes of K and V read per second
(beside torch SDPA on the same KV made contiguous, and beside the device's measured copy bandwidth), extend
attention in TFLOP/s, block copy in GB/s (measure.py).

Runs from a source tree with only torch, triton and numpy installed (a GPU machine may have none of kvmesh's
other dependencies):  python engine/kernels/bench.py [--json FILE]
`kvmesh bench kernels` runs the same code. Without CUDA it runs tiny sizes under Triton's interpreter, so the
command cannot rot; those timings measure the interpreter, not the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"],
                        help="dtype of the throughput runs (correctness runs all three; default: bfloat16)")
    parser.add_argument("--json", help="write the results here as JSON")


def run(args: argparse.Namespace) -> int:
    """Settle the interpreter switch, then import the kernels (triton reads TRITON_INTERPRET as it defines
    them) and measure."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .measure import run_all

    result = run_all(args.dtype)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("device", "copy_gbps", "target_met", "seconds")}))
    return 0 if all(c["ok"] for c in result["correctness"]) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    if not __package__:  # run as a file: import this folder as the package `kernels`, not as kvmesh's
        sys.path[0] = str(Path(__file__).resolve().parents[1])
        __package__ = "kernels"
    sys.exit(main())
