"""The kernel benchmark's measurements (engine/kernels/bench.py is the command): correctness on the device,
decode attention in bytes of K and V read per second beside torch SDPA on the same KV made contiguous and
beside the device's measured copy bandwidth, extend attention in TFLOP/s, block copy in GB/s.

Imports only torch, triton, numpy and sibling modules. Importing it defines the kernels, so TRITON_INTERPRET
must be settled first (bench.py does that).
"""

from __future__ import annotations

import platform
import random
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.runtime.errors
import triton.testing

from . import reference as ref
from .block_copy import gather_blocks_triton, scatter_blocks_triton
from .common import Scales
from .decode import DEFAULT_LAUNCH, DecodeBatch, DecodeLaunch, decode_attention
from .extend import ExtendBatch, extend_attention
from .kv_write import write_kv

TARGET_SHARE = 0.70  # decode attention at 70 % of copy bandwidth or more, from 8k context up (issue 7)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds of fn: CUDA events through triton's do_bench on a GPU; one run after one warm-up on the
    interpreter."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paged_cache(blocks: int, layers: int, page: int, kv_heads: int, dim: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    return torch.randn((blocks, layers, 2, page, kv_heads, dim), device=device, dtype=dtype)


def random_tables(lengths: list[int], page: int, blocks: int, rng: random.Random) -> list[list[int]]:
    ids = list(range(blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in lengths:
        need = -(-n // page)
        tables.append(ids[at : at + need])
        at += need
    return tables


# ---- correctness ---------------------------------------------------------------------------------------


def correctness(device: torch.device, dtypes: list[torch.dtype], heads: tuple[int, int], dim: int) -> list[dict]:
    """Every kernel against its torch reference on this device: ragged lengths, permuted tables, splits
    (shorter contexts under the interpreter)."""
    rng = random.Random(0)
    q_heads, kv_heads = heads
    page, rows = 16, []
    gpu = device.type == "cuda"
    for dtype in dtypes:
        tol = ref.TOLERANCE[dtype]
        lengths = [1, 16, 300, 777] if gpu else [1, 16, 100, 200]
        blocks = sum(-(-n // page) for n in lengths) + 4
        cache = paged_cache(blocks, 2, page, kv_heads, dim, dtype, device)
        k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
        tables = random_tables(lengths, page, blocks, rng)
        q = torch.randn((len(lengths), q_heads, dim), device=device).to(dtype)
        scale = dim**-0.5
        want = ref.decode_reference(q, k_cache, v_cache, list(range(len(lengths))), tables, lengths, scale)
        batch = DecodeBatch.build(list(range(len(lengths))), tables, lengths, device)
        for splits in (1, 4):
            got = decode_attention(q, k_cache, v_cache, batch, scale, num_splits=splits).float()
            rows.append(_check(f"decode splits={splits}", dtype, got, want, tol))
        rows.extend(_int8_checks(cache, q, tables, lengths, dtype, scale))
        q_lens, prefixes = ([1, 40, 200], [50, 0, 333]) if gpu else ([1, 40, 70], [50, 0, 90])
        contexts = [a + b for a, b in zip(q_lens, prefixes, strict=True)]
        tables = random_tables(contexts, page, blocks, rng)
        starts = [0, 1, 41]  # back to back
        q = torch.randn((sum(q_lens), q_heads, dim), device=device).to(dtype)
        got = extend_attention(q, k_cache, v_cache, ExtendBatch.build(starts, q_lens, contexts, tables, device), scale)
        want = torch.cat(ref.extend_reference(q, k_cache, v_cache, starts, q_lens, contexts, tables, scale))
        rows.append(_check("extend", dtype, got.float(), want, tol))
        k = torch.randn((8, kv_heads, dim), device=device).to(dtype)
        slots = torch.tensor([3, -1, 17, 40, 41, 5, 99, 64], device=device)
        mine, theirs = cache.clone(), cache.clone()
        write_kv(k, k * 2, mine[:, 0, 0], mine[:, 0, 1], slots)
        ref.write_kv_reference(k, k * 2, theirs[:, 0, 0], theirs[:, 0, 1], slots)
        rows.append(_exact("kv_write", dtype, torch.equal(mine, theirs)))
        ids = torch.tensor(rng.sample(range(blocks), 9), device=device)
        gathered = gather_blocks_triton(cache, ids)
        back = torch.zeros_like(cache)
        scatter_blocks_triton(back, ids, gathered)
        ok = torch.equal(gathered, cache[ids]) and torch.equal(back[ids], cache[ids])
        rows.append(_exact("gather/scatter", dtype, ok))
    return rows


def quantized(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Scales]:
    """An int8 copy of one layer's K and V (a scale per token and head), written by the KV write kernel."""
    n, page, heads, dim = k_cache.shape
    kq = torch.empty((n, page, heads, dim), dtype=torch.int8, device=k_cache.device)
    vq = torch.empty_like(kq)
    scales = Scales(torch.empty((n, page, heads), device=k_cache.device),
                    torch.empty((n, page, heads), device=k_cache.device))
    slots = torch.arange(n * page, device=k_cache.device)
    write_kv(k_cache.reshape(-1, heads, dim), v_cache.reshape(-1, heads, dim), kq, vq, slots, scales)
    return kq, vq, scales


def _int8_checks(cache: torch.Tensor, q: torch.Tensor, tables: list[list[int]], lengths: list[int],
                 dtype: torch.dtype, scale: float) -> list[dict]:
    """The int8 cache: its KV write within half a quantization step of the rows (K and V), and decode over it
    equal to the reference over the same cache dequantized."""
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    kq, vq, scales = quantized(k_cache, v_cache)
    k_back, v_back = kq.float() * scales.k[..., None], vq.float() * scales.v[..., None]
    ok = all(bool(((back - orig.float()).abs() <= orig.float().abs().amax(dim=-1, keepdim=True) / 254 * 1.001
                   + 1e-12).all()) for back, orig in ((k_back, k_cache), (v_back, v_cache)))
    rows = [_exact("kv_write int8", dtype, ok)]
    batch = DecodeBatch.build(list(range(len(lengths))), tables, lengths, q.device)
    want = ref.decode_reference(q, k_back, v_back, list(range(len(lengths))), tables, lengths, scale)
    got = decode_attention(q, kq, vq, batch, scale, num_splits=4, scales=scales).float()
    rows.append(_check("decode int8", dtype, got, want, ref.TOLERANCE[dtype]))
    return rows


def _check(name: str, dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor, tol: float) -> dict:
    error = ((got - want).abs() / (1 + want.abs())).max().item()
    return {"kernel": name, "dtype": dtype_label(dtype), "max_error": error, "tolerance": tol,
            "ok": error <= tol}


def _exact(name: str, dtype: torch.dtype, ok: bool) -> dict:
    return {"kernel": name, "dtype": dtype_label(dtype), "max_error": 0.0 if ok else None,
            "tolerance": 0.0, "ok": ok}


# ---- throughput ----------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy, bytes read plus bytes written per second: what memory can move."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device)


def decode_throughput(device: torch.device, dtype: torch.dtype, contexts: list[int], batches: list[int],
                      heads: tuple[int, int], dim: int, copy_bps: float) -> list[dict]:
    """KV bytes read per second by the paged kernel and by SDPA over the same KV made contiguous."""
    rows = []
    elem = torch.empty((), dtype=dtype).element_size()
    for context in contexts:
        for size in batches:
            need = 2 * 2 * size * context * heads[1] * dim * elem * 2  # the paged cache (2 layers), then a copy
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the last case's cache is free but still held by torch's allocator
            if device.type == "cuda" and need > 0.8 * torch.cuda.mem_get_info(device)[0]:
                log(f"decode context {context:>6} batch {size:>3}: skipped, needs {need / 2**30:.0f} GiB")
                continue
            row = _decode_case(device, dtype, context, size, heads, dim, copy_bps)
            rows.append(row)
            log(f"decode context {context:>6} batch {size:>3}: {row['kernel_gbps']:8.4g} GB/s "
                f"({row['share_of_copy']:.0%} of copy), SDPA contiguous {row['sdpa_gbps']:8.4g} GB/s")
    return rows


def _decode_setup(device: torch.device, dtype: torch.dtype, context: int, size: int, heads: tuple[int, int],
                  dim: int) -> tuple[torch.Tensor, torch.Tensor, DecodeBatch, list[list[int]]]:
    """A paged cache of `size` sequences of `context` tokens in permuted blocks, and their queries."""
    page = 16
    lengths = [context] * size
    blocks = size * -(-context // page)
    cache = paged_cache(blocks, 2, page, heads[1], dim, dtype, device)
    tables = random_tables(lengths, page, blocks, random.Random(context + size))
    q = torch.randn((size, heads[0], dim), device=device).to(dtype)
    return q, cache, DecodeBatch.build(list(range(size)), tables, lengths, device), tables


def _decode_case(device: torch.device, dtype: torch.dtype, context: int, size: int, heads: tuple[int, int],
                 dim: int, copy_bps: float) -> dict:
    kv_heads = heads[1]
    q, cache, batch, tables = _decode_setup(device, dtype, context, size, heads, dim)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    out = torch.empty_like(q)
    kv_bytes = 2 * size * context * kv_heads * dim * cache.element_size()
    seconds = timed(lambda: decode_attention(q, k_cache, v_cache, batch, dim**-0.5, out=out), device)
    ids = torch.tensor(tables, device=device).flatten()
    k = k_cache[ids].view(size, -1, kv_heads, dim)[:, :context].transpose(1, 2).contiguous()
    v = v_cache[ids].view(size, -1, kv_heads, dim)[:, :context].transpose(1, 2).contiguous()
    qs = q[:, :, None, :]
    sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True), device)
    return {"context": context, "batch": size, "kernel_gbps": kv_bytes / seconds / 1e9,
            "sdpa_gbps": kv_bytes / sdpa / 1e9, "share_of_copy": kv_bytes / seconds / copy_bps, "us": seconds * 1e6}


def launch_sweep(device: torch.device, dtype: torch.dtype, cases: list[tuple[int, int]], launches: list[DecodeLaunch],
                 heads: tuple[int, int], dim: int, copy_bps: float) -> dict:
    """Decode share of copy bandwidth for each launch shape on each (context, batch) case, and the one launch
    whose worst case is best: what the engine's default should be on this card. One GPU run then says both
    whether the default meets the target and what would, if it does not."""
    table: dict[DecodeLaunch, list[float]] = {launch: [] for launch in launches}
    for context, size in cases:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        shares = _sweep_case(device, dtype, context, size, launches, heads, dim, copy_bps)
        for launch, share in zip(launches, shares, strict=True):
            table[launch].append(share)
    best = max(launches, key=lambda launch: min(table[launch]))
    log(f"decode launch sweep over {len(launches)} shapes x {len(cases)} cases: best {best} worst share "
        f"{min(table[best]):.0%}, the default's {min(table[DEFAULT_LAUNCH]):.0%}")
    return {"cases": [{"context": c, "batch": b} for c, b in cases],
            "launches": [{**vars(launch), "share_of_copy": table[launch]} for launch in launches],
            "best": vars(best), "best_worst_share": min(table[best]),
            "default_worst_share": min(table[DEFAULT_LAUNCH])}


def int8_decode_throughput(device: torch.device, dtype: torch.dtype, cases: list[tuple[int, int]],
                           heads: tuple[int, int], dim: int) -> list[dict]:
    """Decode over an int8 cache beside the same cache in the model's dtype: fewer bytes to read (one byte a
    value and a 4-byte scale a row), a multiply more a value."""
    rows = []
    for context, size in cases:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row = _int8_case(device, dtype, context, size, heads, dim)
        rows.append(row)
        log(f"decode context {context:>6} batch {size:>3}: int8 cache {row['int8_us']:.4g} us, "
            f"{dtype_label(dtype)} cache {row['model_dtype_us']:.4g} us ({row['speedup']:.2f}x)")
    return rows


def _int8_case(device: torch.device, dtype: torch.dtype, context: int, size: int, heads: tuple[int, int],
               dim: int) -> dict:
    q, cache, batch, _ = _decode_setup(device, dtype, context, size, heads, dim)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    kq, vq, scales = quantized(k_cache, v_cache)
    out = torch.empty_like(q)
    plain = timed(lambda: decode_attention(q, k_cache, v_cache, batch, dim**-0.5, out=out), device)
    int8 = timed(lambda: decode_attention(q, kq, vq, batch, dim**-0.5, out=out, scales=scales), device)
    int8_bytes = 2 * size * context * heads[1] * (dim + 4)
    return {"context": context, "batch": size, "model_dtype_us": plain * 1e6, "int8_us": int8 * 1e6,
            "speedup": plain / int8, "int8_gbps": int8_bytes / int8 / 1e9}


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sweep_case(device: torch.device, dtype: torch.dtype, context: int, size: int, launches: list[DecodeLaunch],
                heads: tuple[int, int], dim: int, copy_bps: float) -> list[float]:
    """Each launch's share of copy bandwidth on one case: 0 for a launch the card cannot run (too much shared
    memory) or whose output differs from the default launch's beyond the dtype's tolerance."""
    q, cache, batch, _ = _decode_setup(device, dtype, context, size, heads, dim)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    kv_bytes = 2 * size * context * heads[1] * dim * cache.element_size()
    want = decode_attention(q, k_cache, v_cache, batch, dim**-0.5).float()
    shares = []
    for launch in launches:
        out = torch.empty_like(q)
        try:
            seconds = timed(lambda launch=launch, out=out: decode_attention(
                q, k_cache, v_cache, batch, dim**-0.5, out=out, launch=launch), device)
        except triton.runtime.errors.OutOfResources as error:
            log(f"decode launch {launch}: cannot run here ({error})")
            shares.append(0.0)
            continue
        error = ((out.float() - want).abs() / (1 + want.abs())).max().item()
        if error > ref.TOLERANCE[dtype]:
            log(f"decode launch {launch}: WRONG, max error {error} against the default launch")
            shares.append(0.0)
            continue
        shares.append(kv_bytes / seconds / copy_bps)
    return shares


def sweep_launches(gpu: bool) -> list[DecodeLaunch]:
    """The default first, then tokens per step x warps x pipelining stages x waves (two on the interpreter,
    which ignores warps and stages). Stages beyond 3 compile to the same code as 3 for sm_90."""
    if not gpu:
        return [DEFAULT_LAUNCH, DecodeLaunch(block_n=32)]
    shapes = [DecodeLaunch(block_n=n, num_warps=w, num_stages=st, waves=wv)
              for n in (32, 64, 128) for w in (4, 8) for st in (2, 3) for wv in (1, 2, 4)]
    return [DEFAULT_LAUNCH] + [s for s in shapes if s != DEFAULT_LAUNCH]


def extend_throughput(device: torch.device, dtype: torch.dtype, cases: list[tuple[int, int, int]],
                      heads: tuple[int, int], dim: int) -> list[dict]:
    """TFLOP/s of extend attention for (sequences, new tokens, cached prefix) cases; SDPA (causal, contiguous)
    beside it where there is no prefix, the one case SDPA takes without an explicit mask."""
    rows = []
    for seqs, new, prefix in cases:
        row = _extend_case(device, dtype, seqs, new, prefix, heads, dim)
        rows.append(row)
        log(f"extend {seqs} x {new} new after {prefix} cached: {row['kernel_tflops']:.4g} TFLOP/s"
            + (f", SDPA causal {row['sdpa_tflops']:.4g}" if row["sdpa_tflops"] else ""))
    return rows


def _extend_case(device: torch.device, dtype: torch.dtype, seqs: int, new: int, prefix: int,
                 heads: tuple[int, int], dim: int) -> dict:
    q_heads, kv_heads = heads
    page = 16
    context = new + prefix
    blocks = seqs * -(-context // page)
    cache = paged_cache(blocks, 2, page, kv_heads, dim, dtype, device)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    tables = random_tables([context] * seqs, page, blocks, random.Random(seqs * new + prefix))
    batch = ExtendBatch.build([i * new for i in range(seqs)], [new] * seqs, [context] * seqs, tables, device)
    q = torch.randn((seqs * new, q_heads, dim), device=device).to(dtype)
    out = torch.empty_like(q)
    visible = seqs * sum(prefix + i + 1 for i in range(new))  # (query, key) pairs attended
    flops = 4 * visible * q_heads * dim  # Q.K and P.V, two flops a multiply-add
    seconds = timed(lambda: extend_attention(q, k_cache, v_cache, batch, dim**-0.5, out=out), device)
    row = {"sequences": seqs, "new_tokens": new, "prefix": prefix, "kernel_tflops": flops / seconds / 1e12,
           "sdpa_tflops": None}
    if prefix == 0:
        qs = q.view(seqs, new, q_heads, dim).transpose(1, 2)
        ks = torch.randn((seqs, kv_heads, new, dim), device=device).to(dtype)
        sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
            qs, ks, ks, is_causal=True, enable_gqa=True), device)
        row["sdpa_tflops"] = flops / sdpa / 1e12
    return row


def copy_throughput(device: torch.device, dtype: torch.dtype, block_shape: tuple[int, ...], blocks: int,
                    moved: int, copy_bps: float) -> list[dict]:
    """Gather `moved` scattered blocks into one buffer and scatter it back; GB/s counts bytes read plus
    written, like the copy bandwidth, so the two compare directly. torch's index_select beside it."""
    rng = random.Random(3)
    kv = torch.randn((blocks, *block_shape), device=device).to(dtype)
    ids = torch.tensor(rng.sample(range(blocks), moved), device=device)
    nbytes = 2 * moved * kv[0].numel() * kv.element_size()
    gathered = gather_blocks_triton(kv, ids)
    gather_s = timed(lambda: gather_blocks_triton(kv, ids), device)
    scatter_s = timed(lambda: scatter_blocks_triton(kv, ids, gathered), device)
    torch_s = timed(lambda: kv.index_select(0, ids), device)
    row = {"blocks": moved, "block_mib": kv[0].numel() * kv.element_size() / 2**20,
           "gather_gbps": nbytes / gather_s / 1e9, "scatter_gbps": nbytes / scatter_s / 1e9,
           "torch_index_select_gbps": nbytes / torch_s / 1e9, "gather_share_of_copy": nbytes / gather_s / copy_bps}
    log(f"block copy {moved} x {row['block_mib']:.2f} MiB: gather {row['gather_gbps']:.4g} GB/s, scatter "
        f"{row['scatter_gbps']:.4g} GB/s, torch index_select {row['torch_index_select_gbps']:.4g} GB/s")
    return [row]


# ---- all of it ----------------------------------------------------------------------------------------


def run_all(dtype_name: str) -> dict:
    """Every measurement on this machine's GPU, or tiny sizes under the interpreter; the report as a dict."""
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    dtype = getattr(torch, dtype_name)
    if gpu:  # a Llama-3-8B-shaped layer: 32 query heads over 8 KV heads of 128
        heads, dim = (32, 8), 128
        contexts, batches = [1024, 4096, 8192, 16384, 32768], [1, 8, 32, 64]
        sweep_cases = [(8192, 1), (8192, 64), (32768, 1), (32768, 8)]
        int8_cases = [(8192, 8), (32768, 8)]
        extend_cases = [(1, 4096, 0), (4, 1024, 0), (4, 512, 4096), (16, 128, 2048)]
        block_shape, blocks, moved, copy_bytes = (32, 2, 16, 8, 128), 2048, 256, 1 << 30
    else:  # the interpreter: tiny sizes, a smoke run
        heads, dim = (4, 2), 64
        contexts, batches = [64, 256], [1, 2]
        sweep_cases = [(256, 1)]
        int8_cases = [(256, 1)]
        extend_cases = [(1, 64, 0), (2, 16, 48)]
        block_shape, blocks, moved, copy_bytes = (2, 2, 16, 2, 64), 32, 8, 1 << 20
    name = torch.cuda.get_device_name(device) if gpu else f"CPU ({platform.processor() or platform.machine()})"
    log(f"kernel benchmark on {name}{'' if gpu else ', Triton interpreter: a smoke run, not a performance number'}")
    started = time.perf_counter()
    checks = correctness(device, [torch.float16, torch.bfloat16, torch.float32], heads, dim)
    for c in checks:
        log(f"correctness {c['kernel']:<16} {c['dtype']:<9} max error {c['max_error']} "
            f"(tolerance {c['tolerance']}): {'ok' if c['ok'] else 'FAILED'}")
    copy_bps = copy_bandwidth(device, copy_bytes)
    log(f"device-to-device copy: {copy_bps / 1e9:.1f} GB/s (read + write)")
    decode_rows = decode_throughput(device, dtype, contexts, batches, heads, dim, copy_bps)
    sweep = launch_sweep(device, dtype, sweep_cases, sweep_launches(gpu), heads, dim, copy_bps)
    int8_rows = int8_decode_throughput(device, dtype, int8_cases, heads, dim)
    extend_rows = extend_throughput(device, dtype, extend_cases, heads, dim)
    copy_rows = copy_throughput(device, dtype, block_shape, blocks, moved, copy_bps)
    long = [r["share_of_copy"] for r in decode_rows if r["context"] >= 8192]
    target_met = bool(long) and min(long) >= TARGET_SHARE
    if long:
        log(f"target (decode >= {TARGET_SHARE:.0%} of copy bandwidth from 8k context): "
            f"{'met' if target_met else 'not met'}, worst {min(long):.0%}")
    result = {
        "device": name, "interpreted": not gpu, "dtype": dtype_label(dtype), "heads": heads,
        "head_dim": dim, "torch": torch.__version__, "triton": triton.__version__, "numpy": np.__version__,
        "python": platform.python_version(), "copy_gbps": copy_bps / 1e9, "correctness": checks,
        "decode": decode_rows, "decode_launch_sweep": sweep, "decode_int8": int8_rows, "extend": extend_rows,
        "block_copy": copy_rows,
        "target_met": target_met if long else None, "seconds": time.perf_counter() - started,
    }
    return result
