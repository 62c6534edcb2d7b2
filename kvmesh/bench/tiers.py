"""`kvmesh bench tiers`: KV tiers on this machine.

Three measurements, in one process, with the same model and dtype:
- copy bandwidth (MB/s) against chunk size, for device -> host, host -> device and disk -> device, with the
  engine's own chunked copy: where the curve flattens is the default `kv-tier-chunk-blocks`;
- TTFT against prefix length for a prefix held by the device, the host tier, the disk tier, and none
  (recompute), each with a fresh 16-token suffix; the decision the measured costs would take for each;
- recovery: TTFT of the longest prompt right after a restart that kept the host tier (a killed process) and
  one that kept only the disk tier (a full restart, page cache dropped for the file), against recompute.

Every fresh engine serves an untimed cold prompt of the length about to be timed before anything is timed: its
first request pays seconds of one-time cost (6 s against 0.7 s for the next at 256 tokens, review r307), which
made recompute look flat over prefix length and every ratio against it too large. Each cell is the median of
three samples, reported with their range.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvmesh.bench.args import positive_ints
from kvmesh.bench.machine import machine_info
from kvmesh.engine.config import MIB, EngineConfig
from kvmesh.engine.engine import Engine, LoadedModel, load_model
from kvmesh.engine.kv.tiers import SlotFile, copy_blocks, plan_load, staging_buffer
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.sampling import SamplingParams

FIRST_ORDINARY_TOKEN = 100
SUFFIX = 16
SAMPLES = 3  # per cell; the median is reported with the range
# prompts of the longest length the host tier holds with room to spare, so nothing the run writes evicts the
# prefix it measures: the first engine's untimed prompt, its three cold ones and the hits' suffixes, and the
# untimed first prompts of the three restarts that keep the host tier (recovered blocks evict in slot order)
HOST_TIER_PROMPTS = 8


@dataclass
class ChunkPoint:
    chunk_blocks: int
    move: str
    mb_per_second: float  # wall clock, best of five
    mb_per_cpu_second: float  # bytes over the CPU time the copy used: steady on a shared machine
    copies: int


@dataclass
class TTFTPoint:
    """One cell: the median of its samples, reported with their range (one sample per cell made rows cross)."""
    prefix_tokens: int
    source: str  # device, host, disk, recompute
    ttft_seconds: float  # the median
    min_seconds: float
    max_seconds: float
    samples_seconds: list[float]
    cached_tokens: list[int]  # per sample
    measured_decision: str  # what the measured profile would do with a prefix in this tier

    @classmethod
    def of(cls, prefix_tokens: int, source: str, samples: list[tuple[float, int]], decision: str) -> TTFTPoint:
        seconds = [s for s, _ in samples]
        return cls(prefix_tokens, source, statistics.median(seconds), min(seconds), max(seconds), seconds,
                   [c for _, c in samples], decision)

    def cell(self) -> str:
        """'median ms (min-max)'."""
        return f"{self.ttft_seconds * 1000:>6.0f} ms ({self.min_seconds * 1000:.0f}-{self.max_seconds * 1000:.0f})"


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("tiers", help="KV tiers: MB/s against chunk size, TTFT by prefix source, recovery")
    p.add_argument("--model", help="HF directory or .gguf (default: the bundled model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefix-tokens", type=positive_ints, default="256,512,1024,2048",
                   help="comma-separated prefix lengths")
    p.add_argument("--chunks", type=positive_ints, default="1,2,4,8,16,32,64",
                   help="comma-separated chunk sizes in blocks")
    p.add_argument("--copy-blocks", type=int, default=64, help="blocks per bandwidth measurement")
    p.add_argument("--disk-dir", help="where the disk tier's file goes (default: a temporary directory)")
    p.add_argument("--block-bytes", type=int, help="sweep chunk sizes with blocks of this size instead of the "
                   "model's (small blocks show the per-copy overhead that chunking amortizes)")
    p.add_argument("--only-chunks", action="store_true", help="measure bandwidth against chunk size only")
    p.add_argument("--json", help="write the results here as JSON")


def _slots(path: Path, n: int, block_bytes: int) -> SlotFile:
    return SlotFile(path, n, block_bytes, "bench")


def _best_mb_s(src: torch.Tensor, dst: torch.Tensor, n: int, chunk: int) -> tuple[float, float, int]:
    """(MB/s by the wall clock, MB per CPU second, copies), the best of five runs: a shared machine's noise only
    ever slows a copy down."""
    order = list(range(n))
    wall, cpu, copies = float("inf"), float("inf"), 0
    stage = staging_buffer(chunk, src.shape[1])  # the copy thread keeps one for good
    for _ in range(5):
        start, start_cpu = time.perf_counter(), time.process_time()
        copies = copy_blocks(src, order, dst, order[::-1], chunk, stage)  # scattered destinations, as in a move
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, max(time.process_time() - start_cpu, 1e-6))
    nbytes = n * src.shape[1]
    return nbytes / wall / 1e6, nbytes / cpu / 1e6, copies


def chunk_sweep(block_bytes: int, n: int, chunks: list[int], shm: Path, disk: Path) -> list[ChunkPoint]:
    device = torch.randint(0, 255, (n, block_bytes), dtype=torch.uint8)
    host = _slots(shm / "bench-host.kv", n, block_bytes)
    disk_file = _slots(disk / "bench-disk.kv", n, block_bytes)
    copy_blocks(device, range(n), host.data, range(n), n)
    copy_blocks(device, range(n), disk_file.data, range(n), n)
    disk_file.dirty = True
    disk_file.flush()
    points = []
    try:
        for chunk in tqdm(chunks, desc="chunk sizes", unit="size"):
            for move, src, dst in (("device_to_host", device, host.data), ("host_to_device", host.data, device),
                                   ("disk_to_device", disk_file.data, device)):
                if move == "disk_to_device":
                    _drop_page_cache(disk / "bench-disk.kv")
                mb_s, mb_cpu_s, copies = _best_mb_s(src, dst, n, chunk)
                points.append(ChunkPoint(chunk, move, mb_s, mb_cpu_s, copies))
    finally:
        host.close()
        disk_file.close()
        (shm / "bench-host.kv").unlink(missing_ok=True)
    return points


def _drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's clean cached pages (mapped ones stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _engine(loaded: LoadedModel, model: str | None, dtype: str, blocks: int, host: Path | None,
            disk: Path | None, host_mib: float, disk_mib: float) -> Engine:
    config = EngineConfig(model=model, dtype=dtype, kv_cache_blocks=blocks,
                          kv_host_memory_mib=host_mib if host else 0, kv_host_path=str(host) if host else None,
                          kv_disk_mib=disk_mib if disk else 0, kv_disk_path=str(disk) if disk else None,
                          kv_tier_cost_profile="cpu")  # always load, so every source is measured
    engine = Engine(config, loaded)
    engine.warmup()
    return engine


def _ttft(engine: Engine, tokens: list[int]) -> tuple[float, int]:
    """Seconds from submit to the first token, and the cached tokens, of one greedy request."""
    first: list[float] = []
    final: list[RequestOutput] = []

    def on_output(out: RequestOutput) -> None:
        if not first:
            first.append(time.perf_counter())
        if out.finish_reason is not None:
            final.append(out)

    start = time.perf_counter()
    engine.submit(Request(f"bench-{time.monotonic_ns()}", tokens, SamplingParams(max_tokens=1, temperature=0.0,
                                                                                 ignore_eos=True),
                          on_output=on_output))
    engine.run_until_idle()
    return first[0] - start, final[0].cached_tokens


def _close(engine: Engine) -> None:
    engine.close()
    del engine
    gc.collect()


def run(args: argparse.Namespace) -> int:
    """The benchmark, its tier files in folders of its own that go with it, however it ends."""
    with contextlib.ExitStack() as folders:
        work = Path(folders.enter_context(tempfile.TemporaryDirectory(prefix="kvmesh-bench-tiers-")))
        shm = Path(folders.enter_context(tempfile.TemporaryDirectory(prefix="kvmesh-bench-", dir="/dev/shm"))) \
            if Path("/dev/shm").is_dir() else work
        return _run(args, shm, Path(args.disk_dir) if args.disk_dir else work)


def _run(args: argparse.Namespace, shm: Path, disk: Path) -> int:
    lengths, chunks = args.prefix_tokens, args.chunks
    config = EngineConfig(model=args.model, dtype=args.dtype)
    loaded = load_model(config)
    vocab = loaded.tokenizer.vocab_size
    g = torch.Generator().manual_seed(0)
    probe = _engine(loaded, args.model, args.dtype, 4, None, None, 0, 0)
    block_bytes = probe.runner.kv_cache[0].numel() * probe.runner.kv_cache.element_size()
    del probe
    sweep_bytes = args.block_bytes or block_bytes
    sweep = chunk_sweep(sweep_bytes, args.copy_blocks, chunks, shm, disk)
    print(f"\nblock: {sweep_bytes / 1e6:.3f} MB (the model's, all layers, K and V: {block_bytes / 1e6:.3f} MB)")
    moves = ("device_to_host", "host_to_device", "disk_to_device")
    print(f"{'chunk':>6} " + " ".join(f"{m + ' wall / per CPU s':>30}" for m in moves))
    for chunk in chunks:
        row = {p.move: p for p in sweep if p.chunk_blocks == chunk}
        print(f"{chunk:>6} " + " ".join(f"{row[m].mb_per_second:>11.0f} / {row[m].mb_per_cpu_second:>6.0f} MB/s"
                                        for m in moves))

    if args.only_chunks:
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine_info(torch_threads=torch.get_num_threads()),
                                                   "block_bytes": sweep_bytes,
                                                   "chunks": [asdict(p) for p in sweep]}, indent=2))
        return 0
    longest = max(lengths)
    prompt_blocks = -(-(longest + SUFFIX) // 16)
    blocks = prompt_blocks * 2 + 16
    host_mib = (prompt_blocks * HOST_TIER_PROMPTS + 16) * block_bytes / MIB
    disk_mib = (longest // 16 + 8) * block_bytes / MIB

    def fresh(tokens: int) -> list[int]:
        return torch.randint(FIRST_ORDINARY_TOKEN, vocab, (tokens,), generator=g).tolist()

    def started(host: Path | None, disk_path: Path, n: int) -> Engine:
        """A fresh engine whose first request is behind it: an untimed cold prompt of the length to be timed."""
        engine = _engine(loaded, args.model, args.dtype, blocks, host, disk_path, host_mib, disk_mib)
        _ttft(engine, fresh(n + SUFFIX))
        return engine

    began = time.perf_counter()
    points: list[TTFTPoint] = []
    prefixes = {n: fresh(n) for n in lengths}
    suffix = iter(torch.randint(FIRST_ORDINARY_TOKEN, vocab, (1000, SUFFIX), generator=g).tolist())
    for n in tqdm(lengths, desc="prefix lengths", unit="length"):
        prefix = prefixes[n]
        host_file, disk_file = shm / f"host-{n}.kv", disk / f"disk-{n}.kv"
        engine = started(host_file, disk_file, n)
        # distinct prompts, so none hits the cache; the last one's prefix is the one the other sources hold
        cold = [_ttft(engine, fresh(n) + next(suffix)) for _ in range(SAMPLES - 1)]
        cold.append(_ttft(engine, prefix + next(suffix)))
        points.append(TTFTPoint.of(n, "recompute", cold, "recompute"))
        hits = [_ttft(engine, prefix + next(suffix)) for _ in range(SAMPLES)]  # the first also writes it to disk
        points.append(TTFTPoint.of(n, "device", hits, "load"))
        assert engine.tiers is not None
        measured = engine.tiers.costs()  # the engine's own prefill speed and tier bandwidths
        hits = []
        for _ in range(SAMPLES):
            engine.kv.pool.clear()  # so the prefix comes from the host tier
            hits.append(_ttft(engine, prefix + next(suffix)))
        decide = "load" if plan_load(["host"] * (n // 16), 16, block_bytes, measured) else "recompute"
        points.append(TTFTPoint.of(n, "host", hits, decide))
        _close(engine)
        hits = []
        for _ in range(SAMPLES):  # a fresh engine each: its first load pays for the file's page faults
            engine = started(None, disk_file, n)
            _drop_page_cache(disk_file)
            hits.append(_ttft(engine, prefix + next(suffix)))
            _close(engine)
        decide = "load" if plan_load(["disk"] * (n // 16), 16, block_bytes, measured) else "recompute"
        points.append(TTFTPoint.of(n, "disk", hits, decide))
        if n != longest:  # the longest prefix's files stay, as a killed process leaves them
            host_file.unlink(missing_ok=True)
            disk_file.unlink(missing_ok=True)

    host_file, disk_file = shm / f"host-{longest}.kv", disk / f"disk-{longest}.kv"
    prefix = prefixes[longest]
    recovery: dict[str, TTFTPoint] = {}
    start_seconds: dict[str, list[float]] = {}
    for kept, host in (("host", host_file), ("disk", None)):
        start_seconds[kept], hits = [], []
        for _ in range(SAMPLES):
            if host is None:
                _drop_page_cache(disk_file)
            start = time.perf_counter()
            engine = _engine(loaded, args.model, args.dtype, blocks, host, disk_file, host_mib, disk_mib)
            start_seconds[kept].append(time.perf_counter() - start)
            _ttft(engine, fresh(longest + SUFFIX))  # its first request, untimed, as in every cell
            hits.append(_ttft(engine, prefix + next(suffix)))
            _close(engine)
        recovery[kept] = TTFTPoint.of(longest, kept, hits, "load")
        host_file.unlink(missing_ok=True)
    disk_file.unlink(missing_ok=True)
    cold = next(p for p in points if p.prefix_tokens == longest and p.source == "recompute")
    seconds = time.perf_counter() - began

    print(f"\nTTFT, median of {SAMPLES} (min-max), and recompute's median over it")
    print(f"{'prefix':>7} {'recompute':>20} {'device':>28} {'host':>28} {'disk':>28}  measured decision (host, disk)")
    for n in lengths:
        row = {p.source: p for p in points if p.prefix_tokens == n}
        base = row["recompute"].ttft_seconds
        cells = " ".join(f"{row[s].cell()} ({base / row[s].ttft_seconds:>4.1f}x)" for s in ("device", "host", "disk"))
        decisions = f"{row['host'].measured_decision}, {row['disk'].measured_decision}"
        print(f"{n:>7} {row['recompute'].cell():>20} {cells}  {decisions}")
    print(f"\nrecovery, {longest}-token prefix + {SUFFIX}: recompute {cold.cell()}")
    for kept, point in recovery.items():
        print(f"  restart keeping the {kept} tier: engine start {statistics.median(start_seconds[kept]):.2f} s, "
              f"TTFT {point.cell()} ({cold.ttft_seconds / point.ttft_seconds:.1f}x)")
    print(f"\nTTFT and recovery measurements took {seconds:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine_info(torch_threads=torch.get_num_threads()),
            "model": loaded.name, "dtype": args.dtype, "block_bytes": block_bytes,
            "chunks": [asdict(p) for p in sweep], "ttft": [asdict(p) for p in points], "ttft_run_seconds": seconds,
            "recovery": {kept: {"start_seconds": start_seconds[kept], **asdict(point)}
                         for kept, point in recovery.items()},
        }, indent=2))
    return 0
