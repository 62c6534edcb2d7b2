"""`kvmesh bench kv-cache`: the int8 KV cache beside the model-dtype cache, on one machine in one run.

What a user trades (engine/kvcache.py): more cached tokens in the same memory against a small error in what
attention reads and the cost of quantizing and dequantizing. Measured with the same model loaded once:
- capacity: blocks and tokens each format fits in the KV budget;
- accuracy, teacher-forced: both engines read the same prompts and the model-dtype engine's greedy
  continuation a token at a time (every step attends over the cache it wrote), and the next-token
  distributions are compared: top-1 agreement and KL divergence;
- throughput under memory pressure: concurrent requests whose KV does not all fit in the budget in the model's
  dtype, through the whole engine (scheduler, preemption, prefix cache), in output tokens per second;
- throughput with memory to spare (the same requests, a budget both fit in): the cost of the conversions alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvmesh.bench.engine import random_prompts, run_all_at_once
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine, LoadedModel, load_model
from kvmesh.engine.protocol import KV_CACHE_DTYPES, MODEL_LABEL, VllmMetric
from kvmesh.engine.runner import StepInput

ACCURACY_MIB = 256  # the accuracy pass's engines: one question and its continuation at a time
QUESTIONS = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "How do vaccines train the immune system?",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "Give me a recipe for pancakes.",
)


@dataclass
class Capacity:
    kv_cache_dtype: str
    block_bytes: int
    blocks: int
    tokens: int


@dataclass
class Accuracy:
    positions: int
    top1_agreement: float  # share of positions where both caches predict the same next token
    mean_kl: float  # KL(model-dtype cache || int8 cache), nats per position
    max_kl: float


@dataclass
class Throughput:
    kv_cache_dtype: str
    budget_mib: int
    blocks: int
    seconds: float
    output_tokens_per_second: float
    mean_ttft_seconds: float
    preemptions: int


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """`kvmesh bench kv-cache` and its options."""
    p = bench_subparsers.add_parser("kv-cache", help="int8 KV cache beside the model-dtype cache: capacity, "
                                                     "accuracy, throughput with and without memory pressure")
    p.add_argument("--model", help="HF directory or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="the model's dtype (default auto)")
    p.add_argument("--budget-mib", type=int, default=48,
                   help="the tight KV budget: the requests' KV does not all fit in the model's dtype (default 48)")
    p.add_argument("--ample-mib", type=int, default=1024, help="the budget both formats fit in (default 1024)")
    p.add_argument("--concurrency", type=int, default=16, help="requests submitted at once (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--accuracy-prompts", type=int, default=8, help="chat questions for the accuracy pass (max 8)")
    p.add_argument("--accuracy-tokens", type=int, default=48, help="continuation tokens compared per question")
    p.add_argument("--json", help="write the results here as JSON")


def _engine(loaded: LoadedModel, kv_cache_dtype: str, budget_mib: int, args: argparse.Namespace) -> Engine:
    return Engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=kv_cache_dtype,
                               kv_cache_memory_mib=budget_mib, max_num_seqs=max(64, args.concurrency)), loaded)


def capacity(engine: Engine) -> Capacity:
    blocks = engine.kv.pool.num_blocks
    return Capacity(engine.config.kv_cache_dtype, engine.kv_config.block_bytes, blocks,
                    blocks * engine.config.block_size)


def accuracy(engines: dict[str, Engine], questions: list[str], tokens: int) -> Accuracy:
    """Teacher-forced next-token comparison along the model-dtype engine's greedy continuation."""
    reference, candidate = engines["auto"], engines["int8"]
    block = reference.config.block_size
    agree, kls = 0, []
    for question in tqdm(questions, desc="accuracy", file=sys.stderr):
        ids = reference.tokenizer.encode_chat([{"role": "user", "content": question}])
        table = list(range(-(-(len(ids) + tokens) // block)))
        if len(table) > min(e.kv.pool.num_blocks for e in engines.values()):
            raise ValueError(f"question {question!r} and {tokens} tokens need {len(table)} KV blocks; the accuracy "
                             f"engines have fewer")
        want = reference.runner.run([StepInput(table, 0, ids, True)]).logits
        got = candidate.runner.run([StepInput(table, 0, ids, True)]).logits
        for position in range(len(ids), len(ids) + tokens):
            logp, logq = want.log_softmax(-1), got.log_softmax(-1)
            kls.append(torch.sum(logp.exp() * (logp - logq)).item())
            agree += int(want.argmax() == got.argmax())
            token = [int(want.argmax())]  # the model-dtype engine's greedy token feeds both
            want = reference.runner.run([StepInput(table, position, token, True)]).logits
            got = candidate.runner.run([StepInput(table, position, token, True)]).logits
    return Accuracy(len(kls), agree / len(kls), sum(kls) / len(kls), max(kls))


def throughput(engine: Engine, budget_mib: int, args: argparse.Namespace) -> Throughput:
    """All requests at once through the engine; distinct random prompts, so the prefix cache saves nothing."""
    prompts = random_prompts(args.concurrency, args.prompt_tokens, 0, engine.vocab_size)
    preempted = _preemptions(engine)
    seconds, ttfts = run_all_at_once(engine, prompts, args.output_tokens,
                                     f"kv-{engine.config.kv_cache_dtype}-{budget_mib}")
    total = args.concurrency * args.output_tokens
    return Throughput(engine.config.kv_cache_dtype, budget_mib, engine.kv.pool.num_blocks, seconds,
                      total / seconds, sum(ttfts) / len(ttfts), int(_preemptions(engine) - preempted))


def _preemptions(engine: Engine) -> float:
    name = f"{VllmMetric.PREEMPTIONS}_total"
    return engine.metrics.registry.get_sample_value(name, {MODEL_LABEL: engine.model_name}) or 0.0


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.accuracy_prompts <= len(QUESTIONS):
        print(f"kvmesh bench kv-cache: --accuracy-prompts must be 1 to {len(QUESTIONS)}", file=sys.stderr)
        return 2
    if min(args.concurrency, args.prompt_tokens, args.output_tokens, args.accuracy_tokens) < 1:
        print("kvmesh bench kv-cache: --concurrency, --prompt-tokens, --output-tokens and --accuracy-tokens must be "
              "at least 1", file=sys.stderr)
        return 2
    print("loading the model ...", file=sys.stderr)
    loaded = load_model(EngineConfig(model=args.model, dtype=args.dtype))
    tight = {f: _engine(loaded, f, args.budget_mib, args) for f in KV_CACHE_DTYPES}
    need = -(-(args.prompt_tokens + args.output_tokens) // tight["auto"].config.block_size) * args.concurrency
    caps = [capacity(e) for e in tight.values()]
    print(f"model dtype {loaded.dtype}; the requests need {need} blocks at once; "
          + ", ".join(f"{c.kv_cache_dtype}: {c.blocks} blocks in {args.budget_mib} MiB" for c in caps),
          file=sys.stderr)
    acc = accuracy({f: _engine(loaded, f, ACCURACY_MIB, args) for f in KV_CACHE_DTYPES},
                   list(QUESTIONS[: args.accuracy_prompts]), args.accuracy_tokens)
    runs: list[Throughput] = []
    cases = [(f, args.budget_mib) for f in KV_CACHE_DTYPES] + [(f, args.ample_mib) for f in KV_CACHE_DTYPES]
    for i, (fmt, budget) in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {args.concurrency} requests, {fmt} cache, {budget} MiB ...", file=sys.stderr)
        engine = tight[fmt] if budget == args.budget_mib else _engine(loaded, fmt, budget, args)
        engine.warmup()
        runs.append(throughput(engine, budget, args))
    _report(caps, acc, runs, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "model_dtype": str(loaded.dtype), "threads": torch.get_num_threads(), "blocks_needed": need,
            "capacity": [asdict(c) for c in caps], "accuracy": asdict(acc), "throughput": [asdict(r) for r in runs],
        }, indent=2))
    return 0


def _report(caps: list[Capacity], acc: Accuracy, runs: list[Throughput], args: argparse.Namespace) -> None:
    base = caps[0]
    print()
    print("| KV cache | bytes a block | blocks in the budget | tokens | vs model dtype |")
    print("|---|---:|---:|---:|---:|")
    for c in caps:
        ratio = c.blocks / base.blocks
        print(f"| {c.kv_cache_dtype} | {c.block_bytes:,} | {c.blocks:,} | {c.tokens:,} | {ratio:.2f}x |")
    print()
    print(f"Accuracy over {acc.positions} positions (teacher-forced): top-1 agreement {acc.top1_agreement:.1%}, "
          f"KL mean {acc.mean_kl:.2e} / max {acc.max_kl:.2e} nats")
    print()
    print("| KV cache | budget (MiB) | blocks | output tok/s | mean TTFT (s) | preemptions | vs model dtype |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        same = next(b for b in runs if b.budget_mib == r.budget_mib and b.kv_cache_dtype == "auto")
        print(f"| {r.kv_cache_dtype} | {r.budget_mib} | {r.blocks:,} | {r.output_tokens_per_second:.1f} | "
              f"{r.mean_ttft_seconds:.2f} | {r.preemptions} | "
              f"{r.output_tokens_per_second / same.output_tokens_per_second:.2f}x |")
    print(f"\n({args.concurrency} requests of {args.prompt_tokens} prompt and {args.output_tokens} output tokens)")
