"""`kvmesh bench lora`: multi-LoRA serving beside the base model and beside serving one adapter at a time.

One process, the model loaded once, N random PEFT adapters written to a temporary directory, and the same
workload (C requests of P random prompt and O output tokens, greedy, each assigned an adapter round-robin or by
a Zipf skew, all arriving at once) served by a fresh engine per setup:
- base: no adapters at all, the upper bound;
- multi-LoRA: every adapter loaded, requests of different adapters batched together (what kvmesh does);
- one at a time: the same engine and adapters, but each adapter's requests submitted as a wave that finishes
  before the next starts, so a batch holds one adapter (a server without mixed-batch LoRA groups requests by
  adapter and serves the groups in turn). TTFT still counts from the common arrival, so later waves wait;
- merged, one engine per adapter: not run (N engines on a shared CPU say nothing); its weight memory is
  N x the model's weight bytes, beside one engine's weights plus its LoRA slots.
A runner that counts the distinct adapters in every model step proves what each setup batched.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from kvmesh.bench.engine import random_prompts
from kvmesh.bench.stats import percentile
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine, LoadedModel, load_model
from kvmesh.engine.model.loader import ModelConfig, load_weights, resolve_model_dir
from kvmesh.engine.model.lora import CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE, module_shapes
from kvmesh.engine.protocol import BlockExtra
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.runner import ModelRunner, StepInput, StepResult
from kvmesh.engine.sampling import SamplingParams

BASE, MIXED, ONE_AT_A_TIME = "base", "multi-LoRA", "one at a time"
SETUPS = (BASE, MIXED, ONE_AT_A_TIME)
MIB = 1024 * 1024


@dataclass
class RunStats:
    """One setup's run: what a user sees (rates, latencies) and what proves the batching (adapters per step)."""

    setup: str
    seconds: float
    cpu_seconds: float  # this process's CPU time, all threads: steadier than wall time on a shared machine
    output_tokens: int
    requests_completed: int  # finished with all O tokens and no error
    output_tokens_per_second: float
    mean_ttft_seconds: float
    p90_ttft_seconds: float
    mean_itl_seconds: float
    steps: int
    mean_adapters_per_step: float
    max_adapters_per_step: int


@dataclass
class Memory:
    """Weight memory of N merged engines (one per adapter) against one engine serving all N as LoRA adapters."""

    adapters: int
    weight_bytes: int  # the model's weights at the engine's dtype, as loaded
    lora_slot_bytes: int  # the allocated slot tensors (max_loras x max_lora_rank, every projection and layer)
    merged_bytes: int  # adapters x weight_bytes
    multi_lora_bytes: int  # weight_bytes + lora_slot_bytes
    ratio: float  # merged / multi-LoRA


@dataclass
class LoraBenchResult:
    model: str
    dtype: str
    threads: int
    adapters: int
    rank: int
    targets: list[str]
    requests_per_adapter: list[int]
    runs: list[RunStats]  # every run, in the order run
    medians: dict[str, RunStats]  # per setup, the median of each field over repeats
    memory: Memory


class CountingRunner(ModelRunner):
    """The model runner, also recording how many distinct LoRA adapters each step computed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.adapters_per_step: list[int] = []

    def run(self, seqs: list[StepInput]) -> StepResult:
        self.adapters_per_step.append(len({s.lora_slot for s in seqs if s.lora_slot is not None}))
        return super().run(seqs)


class CountingEngine(Engine):
    """The engine with a CountingRunner: what a benchmark reads to prove how steps were batched."""

    def make_runner(self, loaded: LoadedModel, num_blocks: int) -> ModelRunner:
        return CountingRunner(loaded.model, num_blocks, self.kv_layout, loaded.model.device,
                              self.config.attention_backend)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """`kvmesh bench lora` and its options."""
    p = bench_subparsers.add_parser("lora", help="multi-LoRA serving beside the base model and one adapter at a "
                                                 "time: throughput, TTFT, ITL, memory")
    p.add_argument("--model", help="HF directory or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="the model's dtype (default auto)")
    p.add_argument("--adapters", type=int, default=4, help="random adapters written and served, N (default 4)")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank (default 16)")
    p.add_argument("--targets", default=",".join(TARGET_MODULES),
                   help=f"comma-separated target modules (default all seven: {','.join(TARGET_MODULES)})")
    p.add_argument("--max-loras", type=int, help="the engine's adapter slots (default: --adapters)")
    p.add_argument("--max-lora-rank", type=int, help="the slots' rank (default: --rank)")
    p.add_argument("--concurrency", type=int, default=16, help="requests, all arriving at once, C (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="random prompt tokens a request, P (default 128)")
    p.add_argument("--output-tokens", type=int, default=64, help="output tokens a request, O (default 64)")
    p.add_argument("--skew", type=float, default=0.0,
                   help="0 (default): adapters assigned round-robin; s > 0: by a Zipf law, adapter k drawn with "
                        "weight 1/k^s")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every setup, in rotating order; the report takes medians (default 1)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here as JSON")


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, said for the command line, or None."""
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if not targets or unknown:
        return f"--targets must name some of {', '.join(TARGET_MODULES)}; unknown: {', '.join(unknown) or '(none)'}"
    for name in ("adapters", "rank", "concurrency", "prompt_tokens", "repeats"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if args.output_tokens < 2:
        return f"--output-tokens must be at least 2 (ITL needs two tokens), got {args.output_tokens}"
    if args.max_loras is not None and args.adapters > args.max_loras:
        return f"--adapters {args.adapters} do not fit in --max-loras {args.max_loras} slots"
    if args.max_lora_rank is not None and args.rank > args.max_lora_rank:
        return f"--rank {args.rank} is above --max-lora-rank {args.max_lora_rank}"
    if args.skew < 0:
        return f"--skew must be 0 (round-robin) or positive, got {args.skew}"
    if args.threads is not None and args.threads < 1:
        return f"--threads must be at least 1, got {args.threads}"
    return None


def assign_adapters(requests: int, adapters: int, skew: float, seed: int) -> list[int]:
    """Each request's adapter index: round-robin with skew 0, else drawn with weight 1/(k+1)^skew (Zipf)."""
    if skew == 0:
        return [i % adapters for i in range(requests)]
    weights = torch.tensor([1.0 / (k + 1) ** skew for k in range(adapters)], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(weights, requests, replacement=True, generator=g).tolist()


def write_adapter(path: Path, config: ModelConfig, rank: int, targets: list[str], seed: int) -> Path:
    """A random PEFT LoRA directory for `config`'s model (every layer, the given modules), with a nonzero B so
    the adapter changes the output, sized so the output stays a model's (alpha = 2 rank, small deltas)."""
    shapes = module_shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS_FILE))
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none",
            "task_type": "CAUSAL_LM"}
    (path / CONFIG_FILE).write_text(json.dumps(body))
    return path


@dataclass
class _Timing:
    first: float | None = None
    last: float = 0.0
    tokens: int = 0
    done: bool = False


def serve(engine: CountingEngine, prompts: list[list[int]], loras: list[str | None], output_tokens: int,
          waves: list[list[int]], setup: str) -> RunStats:
    """Every request arrives at the start; the requests of each wave are submitted together and the wave is
    stepped to completion before the next is submitted."""
    timings = [_Timing() for _ in prompts]
    bar = tqdm(total=len(prompts) * output_tokens, desc=setup, unit="tok", file=sys.stderr, leave=False)

    def on_output(index: int) -> Callable[[RequestOutput], None]:
        def record(out: RequestOutput) -> None:
            t = timings[index]
            if out.new_token_ids:
                now = time.perf_counter()
                t.first = now if t.first is None else t.first
                t.last = now
                t.tokens += len(out.new_token_ids)
                bar.update(len(out.new_token_ids))
            if out.finish_reason is not None:
                t.done = out.error is None
        return record

    runner = engine.runner
    assert isinstance(runner, CountingRunner)
    runner.adapters_per_step.clear()
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    for wave in waves:
        for i in wave:
            engine.submit(Request(f"{setup}-{i}", prompts[i], params, extra=BlockExtra(lora=loras[i]),
                                  on_output=on_output(i)))
        engine.run_until_idle()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    bar.close()
    engine.kv.check_invariants()
    complete = [t for t in timings if t.done and t.tokens == output_tokens and t.first is not None]
    ttfts = [t.first - start for t in complete]  # type: ignore[operator]
    itls = [(t.last - t.first) / (t.tokens - 1) for t in complete]  # type: ignore[operator]
    tokens = sum(t.tokens for t in timings)
    steps = runner.adapters_per_step
    return RunStats(setup, seconds, cpu_seconds, tokens, len(complete), tokens / seconds,
                    statistics.fmean(ttfts) if ttfts else float("nan"), percentile(ttfts, 0.9),
                    statistics.fmean(itls) if itls else float("nan"), len(steps),
                    statistics.fmean(steps) if steps else 0.0, max(steps, default=0))


def median_stats(runs: list[RunStats]) -> RunStats:
    """Each numeric field's median over the runs of one setup (the max of the per-step adapter counts)."""
    values = {}
    for f in fields(RunStats):
        column = [getattr(r, f.name) for r in runs]
        if f.name == "setup":
            values[f.name] = column[0]
        elif f.name == "max_adapters_per_step":
            values[f.name] = max(column)
        elif isinstance(column[0], int):
            values[f.name] = statistics.median_low(column)  # a count some run really had
        else:
            values[f.name] = statistics.median(column)
    return RunStats(**values)


def lora_slot_bytes(engine: Engine) -> int:
    """The bytes of the allocated slot tensors, checked against the slots' formula."""
    lora = engine.runner.model.lora
    assert lora is not None and lora.a, "no adapter slots allocated"
    actual = sum(t.numel() * t.element_size() for t in (*lora.a.values(), *(b for bs in lora.b.values() for b in bs)))
    assert actual == lora.nbytes(), (actual, lora.nbytes())
    return actual


def measure(args: argparse.Namespace) -> LoraBenchResult:
    """Run every setup `args.repeats` times; raises ValueError for options the model cannot take."""
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    max_loras = args.max_loras or args.adapters
    max_rank = args.max_lora_rank or args.rank
    model_dir = resolve_model_dir(args.model)
    print("loading the model ...", file=sys.stderr)
    loaded = load_model(EngineConfig(model=str(model_dir), dtype=args.dtype, max_loras=max_loras,
                                     max_lora_rank=max_rank))
    if args.prompt_tokens + args.output_tokens > loaded.config.max_position_embeddings:
        raise ValueError(f"--prompt-tokens + --output-tokens = {args.prompt_tokens + args.output_tokens} exceeds "
                         f"the model's context of {loaded.config.max_position_embeddings}")
    weight_bytes = sum(t.numel() * t.element_size() for t in load_weights(model_dir, loaded.dtype).values())
    # every request's KV at once, plus a spare block, so no setup preempts
    blocks = args.concurrency * -(-(args.prompt_tokens + args.output_tokens) // EngineConfig.block_size) + 1

    def fresh(adapter_dirs: dict[str, Path]) -> CountingEngine:
        engine = CountingEngine(EngineConfig(model=str(model_dir), dtype=args.dtype, kv_cache_blocks=blocks,
                                             max_num_seqs=args.concurrency, max_loras=max_loras,
                                             max_lora_rank=max_rank), loaded)
        for name, path in adapter_dirs.items():
            engine.add_lora(engine.read_lora(name, str(path)))
        engine.warmup()
        return engine

    prompts = random_prompts(args.concurrency, args.prompt_tokens, args.seed, loaded.config.vocab_size)
    assigned = assign_adapters(args.concurrency, args.adapters, args.skew, args.seed)
    names = [f"lora-{k}" for k in range(args.adapters)]
    loras = [names[k] for k in assigned]
    everyone = [list(range(args.concurrency))]
    by_adapter = [[i for i, k in enumerate(assigned) if k == a] for a in range(args.adapters)]
    runs: list[RunStats] = []
    slot_bytes = 0
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-lora-") as tmp:
        print(f"writing {args.adapters} rank-{args.rank} adapters on {len(targets)} modules ...", file=sys.stderr)
        dirs = {name: write_adapter(Path(tmp) / name, loaded.config, args.rank, targets, args.seed + k)
                for k, name in enumerate(names)}
        plan = {BASE: ({}, [None] * args.concurrency, everyone),
                MIXED: (dirs, loras, everyone),
                ONE_AT_A_TIME: (dirs, loras, [wave for wave in by_adapter if wave])}
        for r in range(args.repeats):
            order = SETUPS[r % 3:] + SETUPS[: r % 3]  # rotating, so no setup always runs first
            for setup in order:
                adapter_dirs, request_loras, waves = plan[setup]
                print(f"[repeat {r + 1}/{args.repeats}] {setup} ...", file=sys.stderr)
                engine = fresh(adapter_dirs)
                runs.append(serve(engine, prompts, request_loras, args.output_tokens, waves, setup))
                if adapter_dirs:
                    slot_bytes = lora_slot_bytes(engine)
                del engine
    memory = Memory(args.adapters, weight_bytes, slot_bytes, args.adapters * weight_bytes, weight_bytes + slot_bytes,
                    args.adapters * weight_bytes / (weight_bytes + slot_bytes))
    medians = {s: median_stats([r for r in runs if r.setup == s]) for s in SETUPS}
    return LoraBenchResult(loaded.name, str(loaded.dtype), torch.get_num_threads(), args.adapters, args.rank,
                           targets, [len(w) for w in by_adapter], runs, medians, memory)


def run(args: argparse.Namespace) -> int:
    problem = check_args(args)
    if problem:
        print(f"kvmesh bench lora: {problem}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = measure(args)
    except (OSError, ValueError) as exc:  # a missing model, an unreadable directory, sizes the model cannot take
        print(f"kvmesh bench lora: {exc}", file=sys.stderr)
        return 2
    report(result, args)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(result), indent=2))
    short = [r for r in result.runs if r.requests_completed < args.concurrency]
    for r in short:  # a setup that lost requests measured less work: its ratios mean nothing
        print(f"kvmesh bench lora: {r.setup} completed {r.requests_completed} of {args.concurrency} requests",
              file=sys.stderr)
    return 1 if short else 0


def report(result: LoraBenchResult, args: argparse.Namespace) -> None:
    base, alone = result.medians[BASE], result.medians[ONE_AT_A_TIME]
    print()
    print("| setup | output tok/s | CPU s | mean TTFT (s) | p90 TTFT (s) | mean ITL (ms) | adapters a step (mean, "
          "max) | steps | tok/s vs base | tok/s vs one at a time | CPU vs base |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in result.medians.values():
        print(f"| {s.setup} | {s.output_tokens_per_second:.1f} | {s.cpu_seconds:.1f} | {s.mean_ttft_seconds:.2f} | "
              f"{s.p90_ttft_seconds:.2f} | {s.mean_itl_seconds * 1000:.0f} | {s.mean_adapters_per_step:.2f}, "
              f"{s.max_adapters_per_step} | {s.steps} | "
              f"{s.output_tokens_per_second / base.output_tokens_per_second:.2f}x | "
              f"{s.output_tokens_per_second / alone.output_tokens_per_second:.2f}x | "
              f"{s.cpu_seconds / base.cpu_seconds:.2f}x |")
    m = result.memory
    print()
    print("| deployment | weights (MiB) | LoRA slots (MiB) | total (MiB) | vs multi-LoRA |")
    print("|---|---:|---:|---:|---:|")
    print(f"| merged, one engine per adapter ({m.adapters} engines) | {m.merged_bytes / MIB:,.1f} | 0 | "
          f"{m.merged_bytes / MIB:,.1f} | {m.ratio:.2f}x |")
    print(f"| multi-LoRA, one engine | {m.weight_bytes / MIB:,.1f} | {m.lora_slot_bytes / MIB:,.1f} | "
          f"{m.multi_lora_bytes / MIB:,.1f} | 1.00x |")
    skew = "round-robin" if args.skew == 0 else f"Zipf s={args.skew}"
    print(f"\n({args.concurrency} requests of {args.prompt_tokens} prompt and {args.output_tokens} output tokens, "
          f"{result.adapters} rank-{result.rank} adapters on {len(result.targets)} modules, {skew}: "
          f"{result.requests_per_adapter} requests per adapter; {result.dtype}, torch threads: {result.threads}; "
          f"medians of {args.repeats} repeats)")
