"""`kvmesh bench transfer`: what moving KV between two engines costs, beside the prefill it saves.

Real `kvmesh serve` processes on loopback, each with `--threads` torch threads, all serving the same model. A
source's `transfer_frame_blocks` (blocks per frame on the wire) is fixed when it starts, so the engines form a
chain, one per frame size plus a last puller: for each prompt length, a fresh random prompt (token ids >= 100)

1. is computed cold on the first engine (a completion with max_tokens=1): the TTFT of recomputing it;
2. is pulled by engine k+1 from engine k, for k = 1..n (`kv_transfer: {"mode": "pull", "source": ...}`,
   max_tokens=1), so pull k crosses the wire in engine k's frame size; each puller lacks the prompt, computes
   only the tail the pull leaves (at most one block), and then holds the prompt for the next pull. Measured: the
   TTFT with the pull, and from the puller's /metrics the bytes received and the seconds of the transfer
   (`kvmesh_kv_transfer_bytes_total{direction="received"}`, the `kvmesh_kv_transfer_seconds{kind="pull"}` sum);
3. is fetched raw from each source with httpx (`POST /v1/kv/fetch` with the blocks' hashes), reading the
   stream and nothing more: the wire alone, without the puller's checks and copies.

One prefill per prompt warms every source, instead of one per point, and is the cold TTFT as well. Each length
gets `--repeats` fresh prompts; the table shows medians. Progress goes to stderr, the markdown table to stdout.
Every engine is stopped at the end, whatever happens; every request has a timeout. MB is 10^6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh.bench.args import positive_ints
from kvmesh.bench.machine import machine_info
from kvmesh.bench.router import Processes, resolve_model_dir
from kvmesh.bench.scrape import metric, read_metrics
from kvmesh.bench.stats import percentile
from kvmesh.engine.protocol import DEFAULT_BLOCK_SIZE, block_hashes
from kvmesh.processes import free_port, wait_healthy

if TYPE_CHECKING:
    import httpx

DEFAULT_LENGTHS = (512, 1024, 2048, 4096)
DEFAULT_FRAMES = (1, 8, 32, 128)
FIRST_ORDINARY_TOKEN = 100  # below this the bundled vocabulary holds special tokens
KV_FETCH_PATH = "/v1/kv/fetch"  # engine/kv/transfer.py's; not imported, so `kvmesh --help` does not load torch
MB = 1e6
NEAR_BEST = 0.10  # frame sizes within 10 % of the best MB/s are on the flat part of the curve
WARMUP_TOKENS = 64


@dataclass
class TransferPoint:
    prompt_tokens: int
    frame_blocks: int
    source: str
    puller: str
    blocks: int  # blocks the pull asked for (the prompt's full blocks, less a last one that ends the prompt)
    pull_ok: bool  # every pull of this point succeeded
    peer_tokens: int  # prompt tokens the puller took from the peer (its usage)
    bytes_moved: int  # the puller's received bytes (block payload, no frame headers)
    transfer_seconds: float  # the puller's kvmesh_kv_transfer_seconds{kind="pull"}: request to last block checked
    mb_per_s: float
    ttft_pull_seconds: float  # the completion with the pull, max_tokens=1, as the client saw it
    ttft_cold_seconds: float  # the same prompt computed from nothing (the first engine of the chain)
    speedup: float
    computed_tokens_pull: int  # kvmesh_computed_tokens_total delta on the puller
    computed_tokens_cold: int  # the same delta for the cold computation
    raw_blocks: int  # blocks the source sent to a plain fetch (x-kvmesh-blocks)
    raw_bytes: int  # the whole stream: blocks and frame headers
    raw_seconds: float  # median over every raw fetch of the point
    raw_mb_per_s: float
    frames: int  # frames the source sent
    block_bytes: int  # one block's size, from the source's frame header
    pulls: int = 1  # fresh prompts measured; the times above are their medians
    pulls_failed: int = 0
    transfer_seconds_all: list[float] = field(default_factory=list)
    ttft_pull_all: list[float] = field(default_factory=list)
    ttft_cold_all: list[float] = field(default_factory=list)
    raw_seconds_all: list[float] = field(default_factory=list)


@dataclass
class TransferResult:
    model: str
    block_size: int
    block_bytes: int
    lengths: list[int]
    frames: list[int]
    threads: int
    kv_cache_memory_mib: int
    repeats: int
    raw_repeats: int
    points: list[TransferPoint]
    near_best: dict[str, dict[int, list[int]]]  # "pull"/"raw" -> prompt tokens -> best frame size, then those near
    seconds: float
    load_before: list[float]
    load_after: list[float]
    engines_peak_rss_mib: float | None
    skipped_lengths: list[int] = field(default_factory=list)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def random_prompt(length: int, vocab: int, seed: int, tag: str) -> list[int]:
    """`length` random token ids in [100, vocab), fresh for each (seed, tag, length)."""
    rng = random.Random(f"kvmesh-bench-transfer:{seed}:{tag}:{length}")
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(length)]


def pulled_blocks(prompt_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks a pull of the whole prompt asks for: the engine computes at least the prompt's last token, so a
    last full block that ends the prompt is left to compute (engine/server.py `_Completions.pull`)."""
    return (prompt_tokens - 1) // block_size


def near_best(mb_per_s: dict[int, float], within: float = NEAR_BEST) -> list[int]:
    """The frame sizes whose MB/s is within `within` of the best (the best first): where the curve is flat."""
    good = {f: v for f, v in mb_per_s.items() if v > 0}
    if not good:
        return []
    best = max(good, key=lambda f: good[f])
    return [best, *sorted(f for f, v in good.items() if f != best and v >= (1 - within) * good[best])]


# ---- metrics ---------------------------------------------------------------------------------------------------


def _delta(before: list, after: list, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


# ---- requests --------------------------------------------------------------------------------------------------


def complete(client: httpx.Client, url: str, prompt: list[int], **extra: Any) -> tuple[float, dict[str, Any]]:
    """A non-streamed completion with max_tokens=1 (so its time is the TTFT); (seconds, body)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    start = time.perf_counter()
    reply = client.post(url + "/v1/completions", json=body)
    seconds = time.perf_counter() - start
    if reply.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {reply.status_code}: {reply.text[:300]}")
    return seconds, reply.json()


@dataclass
class RawFetch:
    blocks: int
    nbytes: int
    seconds: float
    block_bytes: int


def raw_fetch(client: httpx.Client, source: str, hashes: Sequence[int]) -> RawFetch:
    """POST /v1/kv/fetch and read the stream to its end, counting bytes; only the first frame's header is
    parsed (after the clock stops) for the block size."""
    head = bytearray()
    nbytes = 0
    start = time.perf_counter()
    with client.stream("POST", source + KV_FETCH_PATH, json={"block_hashes": list(hashes)}) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{source}{KV_FETCH_PATH}: HTTP {reply.status_code}: {reply.read()[:300]!r}")
        blocks = int(reply.headers.get("x-kvmesh-blocks", "0"))
        for piece in reply.iter_raw():
            nbytes += len(piece)
            if len(head) < (1 << 16) and b"\n" not in head:
                head.extend(piece[: 1 << 16])
    seconds = time.perf_counter() - start
    block_bytes = 0
    if b"\n" in head:
        header = json.loads(head[: head.index(b"\n")])
        block_bytes = int(header["blocks"][0]["nbytes"]) if header.get("blocks") else 0
    return RawFetch(blocks, nbytes, seconds, block_bytes)


# ---- engines ---------------------------------------------------------------------------------------------------


@dataclass
class Chain:
    urls: list[str]  # engine k serves with frames[k]; the last one only pulls
    frames: list[int]
    pids: list[int]

    def sources(self) -> list[tuple[int, str, str]]:
        """(frame blocks, source, puller) for each frame size."""
        return [(f, self.urls[k], self.urls[k + 1]) for k, f in enumerate(self.frames)]


def start_chain(procs: Processes, workdir: Path, frames: Sequence[int], model: str | None, threads: int,
                kv_mib: int, timeout: float) -> Chain:
    """One engine per frame size (its `transfer_frame_blocks` from a `--config` file) and a last puller, started
    together, each waited for until healthy."""
    urls, started = [], []
    for k, frame in enumerate([*frames, None]):
        name = f"engine{k}-frame{frame}" if frame is not None else f"engine{k}-puller"
        port = free_port()
        args = ["serve", "--port", str(port), "--dtype", "float32", "--threads", str(threads), "--kv-cache-memory-mib",
                str(kv_mib), "--log-level", "warning"]
        if model is not None:
            args += ["--model", model]
        if frame is not None:
            config = workdir / f"{name}.yaml"
            config.write_text(f"engine:\n  transfer_frame_blocks: {frame}\n")
            args += ["--config", str(config)]
        proc, log = procs.kvmesh(name, args)
        urls.append(f"http://127.0.0.1:{port}")
        started.append((proc, log))
    for url, (proc, log) in zip(urls, started, strict=True):
        wait_healthy(url, proc, timeout, log)
    return Chain(urls, list(frames), [proc.pid for proc, _ in started])


def peak_rss_mib(pids: Sequence[int]) -> float | None:
    """The engines' summed peak resident memory (VmHWM), where /proc has it."""
    total = 0.0
    try:
        for pid in pids:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return total


# ---- one prompt ------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One fresh prompt's measurements for one frame size."""

    frame: int
    source: str
    puller: str
    blocks: int
    ok: bool
    peer_tokens: int
    bytes_moved: int
    transfer_seconds: float
    ttft_pull: float
    computed_pull: int
    ttft_cold: float
    computed_cold: int
    raw: list[RawFetch]


def measure_prompt(client: httpx.Client, chain: Chain, prompt: list[int], raw_repeats: int,
                   block_size: int = DEFAULT_BLOCK_SIZE, log: bool = True) -> list[Sample]:
    """Cold on the first engine, then the pulls down the chain, then raw fetches from every source."""
    length = len(prompt)
    first = chain.urls[0]
    before = read_metrics(client, first)
    cold_seconds, _ = complete(client, first, prompt)
    cold_computed = int(_delta(before, read_metrics(client, first), "kvmesh_computed_tokens_total"))
    if log:
        _progress(f"  cold on the first engine: {cold_seconds:.3f} s ({cold_computed} tokens computed)")
    blocks = pulled_blocks(length, block_size)
    samples = []
    for frame, source, puller in chain.sources():
        before = read_metrics(client, puller)
        seconds, body = complete(client, puller, prompt,
                                 kv_transfer={"mode": "pull", "source": source, "tokens": length})
        after = read_metrics(client, puller)
        details = body.get("usage", {}).get("prompt_tokens_details") or {}
        moved = int(_delta(before, after, "kvmesh_kv_transfer_bytes_total", direction="received"))
        took = _delta(before, after, "kvmesh_kv_transfer_seconds_sum", kind="pull")
        ok = (_delta(before, after, "kvmesh_kv_transfers_total", kind="pull", outcome="ok") == 1
              and _delta(before, after, "kvmesh_kv_transfers_total", kind="pull", outcome="failed") == 0)
        samples.append(Sample(
            frame=frame, source=source, puller=puller, blocks=blocks, ok=ok,
            peer_tokens=int((details.get("kvmesh_cached_by_source") or {}).get("peer", 0)), bytes_moved=moved,
            transfer_seconds=took, ttft_pull=seconds,
            computed_pull=int(_delta(before, after, "kvmesh_computed_tokens_total")),
            ttft_cold=cold_seconds, computed_cold=cold_computed, raw=[],
        ))
        if log:
            rate = f"{moved / took / MB:.0f} MB/s" if ok and took > 0 else "FAILED"
            _progress(f"  pull, {frame} blocks/frame: {moved:,} bytes in {took:.3f} s ({rate}), TTFT {seconds:.3f} s, "
                      f"{samples[-1].computed_pull} tokens computed")
    hashes = block_hashes(prompt[: blocks * block_size], block_size)
    for sample in samples:
        sample.raw = [raw_fetch(client, sample.source, hashes) for _ in range(raw_repeats)]
        if log:
            seconds = percentile([f.seconds for f in sample.raw], 0.5)
            _progress(f"  raw fetch, {sample.frame} blocks/frame: {sample.raw[0].nbytes:,} bytes in {seconds:.3f} s "
                      f"({sample.raw[0].nbytes / seconds / MB:.0f} MB/s; median of {raw_repeats})")
    return samples


def _median(values: Sequence[float]) -> float:
    return percentile(values, 0.5) if values else 0.0


def combine(length: int, samples: Sequence[Sample]) -> TransferPoint:
    """One table row from the samples of one (prompt length, frame size): medians over the fresh prompts."""
    good = [s for s in samples if s.ok]
    first = good[0] if good else samples[0]
    raws = [f for s in samples for f in s.raw]
    transfer = _median([s.transfer_seconds for s in good])
    raw_seconds = _median([f.seconds for f in raws])
    ttft_pull = _median([s.ttft_pull for s in samples])
    ttft_cold = _median([s.ttft_cold for s in samples])
    return TransferPoint(
        prompt_tokens=length, frame_blocks=first.frame, source=first.source, puller=first.puller,
        blocks=first.blocks, pull_ok=len(good) == len(samples), pulls=len(samples),
        pulls_failed=len(samples) - len(good), peer_tokens=first.peer_tokens, bytes_moved=first.bytes_moved,
        transfer_seconds=transfer, mb_per_s=first.bytes_moved / transfer / MB if good and transfer > 0 else 0.0,
        ttft_pull_seconds=ttft_pull, ttft_cold_seconds=ttft_cold,
        speedup=ttft_cold / ttft_pull if ttft_pull > 0 else 0.0,
        computed_tokens_pull=max(s.computed_pull for s in samples), computed_tokens_cold=first.computed_cold,
        raw_blocks=raws[0].blocks, raw_bytes=raws[0].nbytes, raw_seconds=raw_seconds,
        raw_mb_per_s=raws[0].nbytes / raw_seconds / MB if raw_seconds > 0 else 0.0,
        frames=-(-raws[0].blocks // first.frame), block_bytes=raws[0].block_bytes,
        transfer_seconds_all=[s.transfer_seconds for s in samples], ttft_pull_all=[s.ttft_pull for s in samples],
        ttft_cold_all=[s.ttft_cold for s in samples], raw_seconds_all=[f.seconds for f in raws],
    )


def run_transfer_bench(lengths: Sequence[int] = DEFAULT_LENGTHS, frames: Sequence[int] = DEFAULT_FRAMES,
                       model: str | None = None, threads: int = 1, kv_mib: int = 512, repeats: int = 3,
                       raw_repeats: int = 3, seed: int = 0, startup_timeout: float = 300.0,
                       request_timeout: float = 600.0, time_limit: float = 3600.0) -> TransferResult:
    """Start the chain, warm it up, measure every prompt length with `repeats` fresh prompts (starting no further
    length past `time_limit` seconds), and stop every engine, whatever happens."""
    import httpx

    from kvmesh.engine.model.tokenizer import Tokenizer

    model_dir = resolve_model_dir(model)
    vocab = Tokenizer.from_dir(model_dir).vocab_size
    load_before = _load()
    start = time.monotonic()
    points: list[TransferPoint] = []
    skipped: list[int] = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-transfer-") as tmp, Processes(Path(tmp)) as procs, \
            httpx.Client(timeout=httpx.Timeout(request_timeout, connect=10.0)) as client:
        _progress(f"starting {len(frames) + 1} engines (frames of {', '.join(map(str, frames))} blocks, and a puller;"
                  f" {threads} thread(s), {kv_mib} MiB KV each) ...")
        chain = start_chain(procs, Path(tmp), frames, model, threads, kv_mib, startup_timeout)
        _progress(f"warm-up: a {WARMUP_TOKENS}-token prompt down the chain ...")
        warm = measure_prompt(client, chain, random_prompt(WARMUP_TOKENS, vocab, seed, "warmup"), 1, log=False)
        block_bytes = next((f.block_bytes for s in warm for f in s.raw if f.block_bytes), 0)
        for i, length in enumerate(lengths):
            if time.monotonic() - start > time_limit:
                skipped = list(lengths[i:])
                _progress(f"time limit of {time_limit:.0f} s reached: skipping {skipped}")
                break
            by_frame: dict[int, list[Sample]] = {f: [] for f in frames}
            for r in range(repeats):
                _progress(f"[{i + 1}/{len(lengths)}] {length}-token prompt, {r + 1} of {repeats} ...")
                for sample in measure_prompt(client, chain, random_prompt(length, vocab, seed, f"prompt{r}"),
                                             raw_repeats):
                    by_frame[sample.frame].append(sample)
            points += [combine(length, by_frame[f]) for f in frames]
        rss = peak_rss_mib(chain.pids)
        kv_config = client.get(chain.urls[0] + "/v1/kv/config").json()
    near: dict[str, dict[int, list[int]]] = {"pull": {}, "raw": {}}
    for length in sorted({p.prompt_tokens for p in points}):
        row = [p for p in points if p.prompt_tokens == length]
        near["pull"][length] = near_best({p.frame_blocks: p.mb_per_s for p in row})
        near["raw"][length] = near_best({p.frame_blocks: p.raw_mb_per_s for p in row})
    return TransferResult(
        model=str(kv_config.get("model", model_dir)), block_size=int(kv_config.get("block_size", DEFAULT_BLOCK_SIZE)),
        block_bytes=block_bytes, lengths=list(lengths), frames=list(frames), threads=threads,
        kv_cache_memory_mib=kv_mib, repeats=repeats, raw_repeats=raw_repeats, points=points, near_best=near,
        seconds=time.monotonic() - start, load_before=load_before, load_after=_load(), engines_peak_rss_mib=rss,
        skipped_lengths=skipped,
    )


# ---- the command -----------------------------------------------------------------------------------------------


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """`kvmesh bench transfer` and its options."""
    p = bench_subparsers.add_parser("transfer", help="KV transfer between two engines: bytes, seconds and MB/s by "
                                                     "prompt length and frame size, beside the prefill saved")
    p.add_argument("--lengths", type=positive_ints, default=list(DEFAULT_LENGTHS),
                   help="comma-separated prompt lengths in tokens (default 512,1024,2048,4096)")
    p.add_argument("--frames", type=positive_ints, default=list(DEFAULT_FRAMES),
                   help="comma-separated blocks per frame, one source engine each (default 1,8,32,128)")
    p.add_argument("--model", help="HF directory or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (default 1)")
    p.add_argument("--kv-cache-memory-mib", type=int, default=512, help="KV cache per engine (default 512)")
    p.add_argument("--repeats", type=int, default=3,
                   help="fresh prompts per length (one cold prefill and one pull per frame size each; default 3)")
    p.add_argument("--raw-repeats", type=int, default=3, help="raw fetches per prompt and frame size (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for the engines to become healthy")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds for one request")
    p.add_argument("--time-limit", type=float, default=3600.0,
                   help="start no further prompt length after this many seconds (default 3600)")
    p.add_argument("--json", help="write the results here as JSON")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def print_result(r: TransferResult) -> None:
    print(f"KV transfer between engines on loopback: {r.model}, {r.block_size}-token blocks of {r.block_bytes:,} "
          f"bytes; {len(r.frames) + 1} engines, {r.threads} torch thread(s) and {r.kv_cache_memory_mib} MiB of KV "
          f"each; load average {r.load_before} before, {r.load_after} after")
    print()
    print(f"Times are medians over {r.repeats} fresh prompt(s) per length (raw fetches: {r.raw_repeats} per prompt); "
          f"MB is 10^6 bytes.")
    print()
    print("| prompt tokens | frame blocks | blocks (frames) | bytes moved | transfer (s) | MB/s | raw fetch (s) | "
          "raw MB/s | TTFT with pull (s) | TTFT cold (s) | speedup | computed tokens (pull / cold) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in r.points:
        failed = f" ({p.pulls_failed} of {p.pulls} failed)" if p.pulls_failed else ""
        pull = f"{p.transfer_seconds:.3f}{failed} | {p.mb_per_s:.0f}" if p.mb_per_s else "all failed | -"
        print(f"| {p.prompt_tokens} | {p.frame_blocks} | {p.blocks} ({p.frames}) | {p.bytes_moved:,} | {pull} | "
              f"{p.raw_seconds:.3f} | {p.raw_mb_per_s:.0f} | {p.ttft_pull_seconds:.3f} | {p.ttft_cold_seconds:.3f} | "
              f"{p.speedup:.1f}x | {p.computed_tokens_pull} / {p.computed_tokens_cold} |")
    print()
    for kind, label in (("pull", "pull (the puller's transfer)"), ("raw", "raw fetch (the wire alone)")):
        parts = []
        for length, near in r.near_best[kind].items():
            if not near:
                continue
            (best,) = [p for p in r.points if p.prompt_tokens == length and p.frame_blocks == near[0]]
            rate = best.mb_per_s if kind == "pull" else best.raw_mb_per_s
            also = f" (within {NEAR_BEST:.0%}: {', '.join(map(str, near[1:]))})" if near[1:] else ""
            parts.append(f"{length} tokens: {near[0]} at {rate:.0f} MB/s{also}")
        print(f"best frame size (blocks), {label}: {'; '.join(parts)}")
    if r.engines_peak_rss_mib is not None:
        print(f"engines' peak resident memory, summed: {r.engines_peak_rss_mib:,.0f} MiB")
    if r.skipped_lengths:
        print(f"skipped (time limit): {r.skipped_lengths}")
    failed = sum(p.pulls_failed for p in r.points)
    if failed:
        print(f"{failed} pulls failed (the puller recomputed; the times are over the others): see the table")
    print(f"run time: {r.seconds:.0f} s")


def run(args: argparse.Namespace) -> int:
    """`kvmesh bench transfer`: markdown on stdout, progress on stderr, JSON with --json."""
    if min(args.threads, args.kv_cache_memory_mib, args.repeats, args.raw_repeats) < 1:
        print("kvmesh bench transfer: --threads, --kv-cache-memory-mib, --repeats and --raw-repeats must be at least 1",
              file=sys.stderr)
        return 2
    if min(args.lengths) <= DEFAULT_BLOCK_SIZE:
        print(f"kvmesh bench transfer: every prompt length must exceed one block ({DEFAULT_BLOCK_SIZE} tokens)",
              file=sys.stderr)
        return 2
    if len(set(args.frames)) != len(args.frames):
        print("kvmesh bench transfer: --frames must not repeat a frame size", file=sys.stderr)
        return 2
    import httpx

    try:
        result = run_transfer_bench(args.lengths, args.frames, args.model, args.threads, args.kv_cache_memory_mib,
                                    args.repeats, args.raw_repeats, args.seed, args.startup_timeout,
                                    args.request_timeout, args.time_limit)
    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:  # the engines are stopped by now
        print(f"kvmesh bench transfer: {exc}", file=sys.stderr)
        return 1
    print()
    print_result(result)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "machine": machine_info(),
            **asdict(result),
        }, indent=2))
    return 0
