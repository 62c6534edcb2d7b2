"""Kernels address blocks past 2^31 elements correctly (int64 offsets), on a cache of 4.1 GiB that costs
nothing: a sparse file mapped with torch.from_file, so only the pages the kernels touch exist.

Block 269,999 of a cache whose blocks hold 8,192 elements starts at element 2.2e9, past int32. Triton's
interpreter computes offsets with numpy's fixed-width integers, so a product left in int32 wraps here exactly
as on a GPU (removing the decode or extend kernel's int64 cast makes this test fail); a wrapped offset reads or
writes the wrong address and usually crashes the process, so the check runs in a subprocess and a crash fails
the test instead of ending the session. One gap: the interpreter widens scalar-by-scalar products, so the block
copy's cast (one block id times the block stride) is exercised here but would not be caught if removed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BLOCKS = 270_000
BLOCK_SHAPE = (2, 2, 16, 2, 64)  # layers, K/V, block size, KV heads, head dim: 8,192 elements a block


@pytest.mark.slow
def test_kernels_address_blocks_past_int32(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__, str(tmp_path / "sparse.kv")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    assert done.stdout.split() == ["kv_write", "decode", "extend", "gather", "scatter"]


def check(path: str) -> None:
    import torch

    from kvmesh.engine.kernels import block_copy, decode, extend, kv_write
    from kvmesh.engine.kernels import reference as ref

    per_block = 1
    for n in BLOCK_SHAPE:
        per_block *= n
    kv = torch.from_file(path, shared=True, size=BLOCKS * per_block, dtype=torch.float16).view(BLOCKS, *BLOCK_SHAPE)
    assert (BLOCKS - 1) * per_block > 2**31
    high = [BLOCKS - 2, BLOCKS - 1]
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    g = torch.Generator().manual_seed(0)

    k, v = (torch.randn((20, 2, 64), generator=g).half() for _ in range(2))
    slots = torch.tensor([high[i // 16] * 16 + i % 16 for i in range(20)])
    kv_write.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[high[1], 3], k[19]) and torch.equal(v_cache[high[0], 7], v[7])
    print("kv_write")

    q = torch.randn((20, 4, 64), generator=g).half()
    batch = decode.DecodeBatch.build([19], [high], [20], q.device)
    out = decode.decode_attention(q, k_cache, v_cache, batch, 0.125, num_splits=2)
    want = ref.decode_reference(q, k_cache, v_cache, [19], [high], [20], 0.125)
    torch.testing.assert_close(out[19:].float(), want, atol=3e-3, rtol=3e-3)
    print("decode")

    extend_batch = extend.ExtendBatch.build([0], [12], [20], [high], q.device)
    out = extend.extend_attention(q, k_cache, v_cache, extend_batch, 0.125)
    (want,) = ref.extend_reference(q, k_cache, v_cache, [0], [12], [20], [high], 0.125)
    torch.testing.assert_close(out[:12].float(), want, atol=3e-3, rtol=3e-3)
    print("extend")

    ids = torch.tensor([high[1], 5, high[0]], dtype=torch.int32)
    gathered = block_copy.gather_blocks_triton(kv, ids)
    assert torch.equal(gathered, kv[ids])
    print("gather")

    block_copy.scatter_blocks_triton(kv, torch.tensor([BLOCKS - 3, 1, BLOCKS - 4], dtype=torch.int32), gathered)
    assert torch.equal(kv[BLOCKS - 3], kv[high[1]]) and torch.equal(kv[BLOCKS - 4], kv[high[0]])
    print("scatter")


if __name__ == "__main__":
    check(sys.argv[1])
