"""Every kernel compiles for a Hopper GPU (sm_90: H100, H200) down to a cubin, on this machine without a GPU.

The interpreter checks what the kernels compute but not that Triton's real code generator accepts them (types,
layouts, the bf16 tensor-core product the interpreter cannot run). Triton's NVIDIA backend and its ptxas ship
with the triton wheel, so compiling ahead of time needs no device. It runs in a subprocess: this test session
has TRITON_INTERPRET=1 set (test_kernels.py), under which the kernels are defined as interpreted functions.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SM = 90
SMALL_STRIDES = ("stride_kst", "stride_vst")  # an int8 cache's scale rows: KV heads apart (8 for Llama-3-8B)


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9 warns when it is unset
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = done.stdout.split()
    assert len(compiled) == 17, done.stdout


def compile_all() -> None:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvmesh.engine.kernels import block_copy, decode, extend, kv_write

    target = GPUTarget("cuda", SM, 32)

    def build(kernel: triton.JITFunction, pointers: dict[str, str], constants: dict[str, object],
              options: dict[str, int] | None = None) -> None:
        """Compile with every argument not named here an i32 (strides, lengths), like most launches pass, and
        pointers and strides known to be multiples of 16, as Triton specializes them at a real launch (torch
        allocations are aligned, head sizes are multiples of 16): without that the loads are neither
        vectorized nor pipelined, and the code compiled is not the code that runs."""
        signature = {name: "constexpr" if name in constants else pointers.get(name, "i32")
                     for name in kernel.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                   if name not in constants and (name.endswith("_ptr") or name.startswith("stride"))
                   and name not in SMALL_STRIDES}
        result = triton.compile(ASTSource(kernel, signature, constants, aligned), target=target, options=options)
        assert result.asm["cubin"], kernel.__name__
        print(f"{kernel.__name__}:{constants.get('DOT', constants.get('GATHER', ''))}:{constants.get('QUANT', '')}:"
              f"{result.metadata.shared}")

    dots = {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}
    # (query dtype, cache dtype): every model dtype over its own cache, and bf16 over an int8 cache
    for name, cache in (("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "i8")):
        precision = "ieee" if name == "fp32" else "tf32"
        quant = cache == "i8"
        scales = "*fp32" if quant else f"*{cache}"  # a model-dtype cache passes its K view, unread
        io = {"q_ptr": f"*{name}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "ks_ptr": scales, "vs_ptr": scales,
              "out_ptr": f"*{name}", "scale_log2": "fp32"}
        for splits in (1, 4) if not quant else (4,):
            parts = "*fp32" if splits > 1 else f"*{name}"
            build(decode._decode_kernel, {**io, "part_out_ptr": parts, "part_lse_ptr": parts, "rows_ptr": "*i32",
                                          "tables_ptr": "*i32", "lens_ptr": "*i32"},
                  {"GROUP": 4, "HEAD_DIM": 128, "PAGE": 16, "BLOCK_G": 16, "BLOCK_D": 128,
                   "BLOCK_N": decode.DEFAULT_LAUNCH.block_n, "SPLIT": splits > 1, "DOT": dots[name],
                   "PRECISION": precision, "QUANT": quant},
                  {"num_warps": decode.DEFAULT_LAUNCH.num_warps, "num_stages": decode.DEFAULT_LAUNCH.num_stages})
        if name != "fp32":  # the fp32 extend compiles too (checked by hand), but takes a minute
            build(extend._extend_kernel, {**io, **{p: "*i32" for p in ("q_starts_ptr", "q_lens_ptr", "lens_ptr",
                                                                       "tables_ptr", "tile_seqs_ptr",
                                                                       "tile_starts_ptr")}},
                  {"GROUP": 4, "HEAD_DIM": 128, "PAGE": 16, "BLOCK_M": extend.BLOCK_M, "BLOCK_D": 128,
                   "BLOCK_N": extend.BLOCK_N, "DOT": dots[name], "PRECISION": precision, "QUANT": quant})
        build(kv_write._kv_write_kernel, {"k_ptr": f"*{name}", "v_ptr": f"*{name}", "k_cache_ptr": f"*{cache}",
                                          "v_cache_ptr": f"*{cache}", "ks_ptr": scales, "vs_ptr": scales,
                                          "slots_ptr": "*i64"},
              {"HEADS": 8, "HEAD_DIM": 128, "PAGE": 16, "BLOCK_H": 8, "BLOCK_D": 128, "QUANT": quant})
    build(decode._merge_kernel, {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16",
                                 "rows_ptr": "*i32"},
          {"HEAD_DIM": 128, "BLOCK_S": 4, "BLOCK_D": 128})
    for gather in (True, False):
        build(block_copy._copy_blocks_kernel, {"src_ptr": "*bf16", "dst_ptr": "*bf16", "ids_ptr": "*i64",
                                               "numel": "i64"},
              {"GATHER": gather, "BLOCK": block_copy.BLOCK})


if __name__ == "__main__":
    compile_all()
