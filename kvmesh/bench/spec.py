"""What speculative decoding with n-gram drafts buys on the bundled model: output tokens per second with and without
it, greedy, in one run, on a workload whose answers repeat the prompt (copy a text, edit code) and on plain chat,
at a few concurrencies; with the drafts' acceptance rate, tokens per decoding step, whether the outputs were the
same token for token, and what one n-gram lookup costs on a long sequence.

    kvmesh bench spec [--concurrency 1,4] [--max-tokens 64] [--k 4] [--repeats 2] [--threads 1] [--json PATH]

The two engines' runs are interleaved and repeated, and each side's median is reported, so a machine shared with
other work slows both alike.

Prints a table; docs/benchmarks.md ("Speculative decoding") quotes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvmesh.bench.args import positive_int, positive_ints
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.spec import propose

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
           "the great lens until it shone, and wrote the weather in a leather book: wind from the west, a long swell, "
           "three fishing boats returning late. In winter the storms shook the tower and salt crusted the windows, "
           "but the light never failed.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
WORKLOADS = {
    "repeat": [
        f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
        f"Copy this code exactly as it is:\n\n{CODE}",
        f"Rename the function total_price to order_total in this code and print the whole code:\n\n{CODE}",
        f"Quote the text below back to me without changing anything.\n\n{PASSAGE}",
    ],
    "chat": [
        "Write a short story about a dragon who learns to bake bread.",
        "What are three good habits for staying healthy? Explain each.",
        "Describe a walk through a forest in autumn.",
        "Give me some advice for a first day at a new job.",
    ],
}


@dataclass(frozen=True)
class Run:
    """One workload at one concurrency on one engine."""

    seconds: float
    output_tokens: int
    drafted: float
    accepted: float
    outputs: list[list[int]]

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def _spec_totals(engine: Engine) -> tuple[float, float]:
    labels = {"model_name": engine.model_name}
    get = engine.metrics.registry.get_sample_value
    return (get("vllm:spec_decode_num_draft_tokens_total", labels) or 0.0,
            get("vllm:spec_decode_num_accepted_tokens_total", labels) or 0.0)


def serve(engine: Engine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> Run:
    """Run every prompt, greedy, at most `concurrency` at once, stepping the engine in this thread."""
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)

    def on_output(i: int, out: RequestOutput) -> None:
        outputs[i].extend(out.new_token_ids)
        done[i] = done[i] or out.finish_reason is not None

    drafted, accepted = _spec_totals(engine)
    start = time.perf_counter()
    submitted = 0
    while not all(done):
        while submitted < len(prompts) and submitted - sum(done[:submitted]) < concurrency:
            i = submitted
            engine.submit(Request(f"bench-{time.monotonic_ns()}-{i}", prompts[i],
                                  SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                  on_output=lambda out, i=i: on_output(i, out)))
            submitted += 1
        engine.step()
    seconds = time.perf_counter() - start
    d, a = _spec_totals(engine)
    return Run(seconds, sum(map(len, outputs)), d - drafted, a - accepted, outputs)


def lookup_cost(length: int, k: int, repeats: int = 200) -> float:
    """Median microseconds of one n-gram lookup (n 2..4) over a `length`-token sequence of natural-looking ids."""
    rng = np.random.default_rng(0)
    tokens = rng.zipf(1.3, length).clip(max=49151).astype(np.int64)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        propose(tokens, k, 2, 4)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e6)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """`kvmesh bench spec` and its options."""
    p = bench_subparsers.add_parser("spec", help="speculative decoding (n-gram drafts): output tok/s with and "
                                                 "without, on answers that repeat the prompt and on plain chat")
    p.add_argument("--model", help="HF directory or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--concurrency", type=positive_ints, default=[1, 4], help="requests at once (default 1,4)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--k", type=positive_int, default=4, help="num_speculative_tokens (default 4)")
    p.add_argument("--dtype", default="float32", help="float32 (default: exact comparisons), bfloat16 or auto")
    p.add_argument("--repeats", type=positive_int, default=2, help="interleaved runs of each case; medians "
                                                                   "(default 2)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (a shared machine: 1 is steadier)")
    p.add_argument("--json", help="write the results here as JSON")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                   "prompt_lookup_max": 4}
    engines = {name: Engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_blocks=1024,
                                         speculative_config=spec_config if name == "spec" else None))
               for name in ("plain", "spec")}
    tokenizer = engines["plain"].tokenizer
    prompts = {w: [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in texts]
               for w, texts in WORKLOADS.items()}
    for engine in engines.values():  # first-step costs out of the timings
        serve(engine, [prompts["chat"][0][:16]], 1, 4)
    rows = []
    cases = [(w, c) for w in WORKLOADS for c in args.concurrency]
    progress = tqdm(total=len(cases) * args.repeats * 2, desc="bench spec")
    for workload, concurrency in cases:
        runs: dict[str, list[Run]] = {"plain": [], "spec": []}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                runs[name].append(serve(engine, prompts[workload], concurrency, args.max_tokens))
                progress.update()
        plain_tps, spec_tps = (statistics.median(r.tokens_per_second for r in runs[n]) for n in ("plain", "spec"))
        plain, spec = runs["plain"][-1], runs["spec"][-1]
        rows.append({
            "workload": workload, "concurrency": concurrency,
            "plain_tokens_per_second": plain_tps, "spec_tokens_per_second": spec_tps, "speedup": spec_tps / plain_tps,
            "acceptance_rate": spec.accepted / spec.drafted if spec.drafted else 0.0,
            # every decoding step of a request emits one token plus the drafts it accepted
            "tokens_per_step": spec.output_tokens / (spec.output_tokens - spec.accepted),
            "identical_outputs": all(r.outputs == plain.outputs for r in runs["plain"] + runs["spec"]),
        })
    progress.close()
    print(f"{'workload':<8} {'conc':>4} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'accept':>7} "
          f"{'tok/step':>8} {'same':>5}")
    for r in rows:
        print(f"{r['workload']:<8} {r['concurrency']:>4} {r['plain_tokens_per_second']:>11.1f} "
              f"{r['spec_tokens_per_second']:>10.1f} {r['speedup']:>5.2f}x {r['acceptance_rate']:>7.0%} "
              f"{r['tokens_per_step']:>8.2f} {'yes' if r['identical_outputs'] else 'NO':>5}")
    lookups = {n: lookup_cost(n, args.k) for n in (1000, 8000, 32000)}
    step = engines["plain"].decode_step_s
    print("n-gram lookup: " + ", ".join(f"{n} tokens {us:.0f} us" for n, us in lookups.items())
          + f" (a decode step here: {step * 1e3:.1f} ms)")
    if args.json:
        results = {"config": {**spec_config, "max_tokens": args.max_tokens, "dtype": args.dtype,
                              "threads": args.threads, "repeats": args.repeats},
                   "rows": rows, "lookup_us": lookups, "decode_step_seconds": step}
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0

