"""`kvmesh bench engine`: the engine's throughput and prefix-cache TTFT, beside transformers' `generate`.

Everything runs in one process on the same machine and dtype, so the ratios compare like with like:
- output tokens per second with 1, 8 and 32 concurrent requests of 128 prompt and 128 output tokens (greedy),
  and transformers' `generate` on the same 32 prompts as one padded batch, the two taking turns for several
  rounds (new prompts each round, each side first in every other round): on a shared machine one pair of runs
  moved the ratio from 1.0x to 1.5x, so the ratio reported is the median of the rounds' ratios, with their range;
- TTFT of a 2,000-token prompt cold, and with all but its last block cached;
- peak resident memory of the engine with the bundled model (before the baseline loads).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine
from kvmesh.engine.model.loader import resolve_model_dir
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.sampling import SamplingParams

FIRST_ORDINARY_TOKEN = 100  # below this the bundled vocabulary holds special tokens


@dataclass
class ThroughputPoint:
    concurrency: int
    output_tokens: int
    seconds: float
    tokens_per_second: float
    mean_ttft_seconds: float
    steps: int


def random_prompts(count: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ORDINARY_TOKEN, vocab, (count, length), generator=g).tolist()


def run_all_at_once(engine: Engine, prompts: list[list[int]], output_tokens: int,
                    tag: str) -> tuple[float, list[float]]:
    """Submit all prompts at once, step until done; (seconds, TTFT per request)."""
    first: dict[str, float] = {}

    def on_output(out: RequestOutput) -> None:
        if out.request_id not in first and out.new_token_ids:
            first[out.request_id] = time.perf_counter()

    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        engine.submit(Request(f"{tag}-{i}", prompt, params, on_output=on_output))
    engine.run_until_idle()
    return time.perf_counter() - start, [t - start for t in first.values()]


def throughput(engine: Engine, prompts: list[list[int]], output_tokens: int) -> ThroughputPoint:
    concurrency = len(prompts)
    steps = engine.runner.steps
    seconds, ttfts = run_all_at_once(engine, prompts, output_tokens, f"tp{concurrency}")
    total = concurrency * output_tokens
    return ThroughputPoint(concurrency, total, seconds, total / seconds, sum(ttfts) / len(ttfts),
                           engine.runner.steps - steps)


def prefix_ttft(engine: Engine, prefix_tokens: int, seed: int) -> dict[str, float]:
    """TTFT of a prompt cold, then of another with the same first (prefix - one block) tokens cached."""
    block = engine.config.block_size
    cached = (prefix_tokens // block - 1) * block
    base = random_prompts(1, prefix_tokens, seed, engine.vocab_size)[0]
    tail = random_prompts(1, prefix_tokens - cached, seed + 1, engine.vocab_size)[0]
    cold, _ = run_all_at_once(engine, [base], 1, "cold")
    warm_prompt = base[:cached] + tail
    computed = engine.runner.computed_tokens
    warm, _ = run_all_at_once(engine, [warm_prompt], 1, "warm")
    return {
        "prompt_tokens": prefix_tokens,
        "cached_tokens": cached,
        "cold_ttft_seconds": cold,
        "warm_ttft_seconds": warm,
        "speedup": cold / warm,
        "warm_computed_tokens": engine.runner.computed_tokens - computed,
    }


@dataclass
class BaselineRound:
    """One turn of the engine and one of transformers on the same prompts."""

    engine: ThroughputPoint
    transformers_tokens_per_second: float
    first: str  # which ran first ("engine" or "transformers"): they alternate, so a drift favours neither

    @property
    def ratio(self) -> float:
        return self.engine.tokens_per_second / self.transformers_tokens_per_second


def load_transformers(model_dir: Path, dtype: torch.dtype, quantization: str) -> Any:
    """The baseline model. With int8 it gets torch's dynamic int8 quantization of its linear layers, per
    channel: the same arithmetic as the engine's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if quantization == "int8":
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        model = quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    return model


def transformers_generate(model: Any, prompts: list[list[int]], output_tokens: int) -> float:
    """transformers' generate on the prompts as one padded batch (left padding, greedy); output tokens/s."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(input_ids=ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_tokens,
                             min_new_tokens=output_tokens, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
    generated = (out.shape[1] - width) * len(prompts)
    return generated / seconds


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_engine_bench(args: argparse.Namespace) -> int:
    levels = args.concurrency
    top = max(levels)
    print("loading the bundled model ...", file=sys.stderr)
    model_dir = resolve_model_dir(None)
    engine = Engine(EngineConfig(dtype=args.dtype, quantization=args.quantization, max_num_seqs=max(64, *levels)))
    engine.warmup()
    print(f"engine: dtype {engine.dtype}, quantization {args.quantization}, {engine.kv.pool.num_blocks} KV blocks, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)

    def prompts(count: int, seed: int) -> list[list[int]]:
        return random_prompts(count, args.prompt_tokens, seed, engine.vocab_size)

    points = []
    for i, c in enumerate(levels):
        print(f"[{i + 1}/{len(levels)}] {c} concurrent requests ...", file=sys.stderr)
        points.append(throughput(engine, prompts(c, 100 + c), args.output_tokens))
    print("prefix-cache TTFT ...", file=sys.stderr)
    ttft = prefix_ttft(engine, args.prefix_tokens, seed=7)
    rss = peak_rss_mib()
    rounds: list[BaselineRound] = []
    if not args.no_baseline:
        baseline_model = load_transformers(model_dir, engine.dtype, args.quantization)
        for r in range(args.rounds):
            first = ("engine", "transformers")[r % 2]
            order = "the engine, then transformers" if first == "engine" else "transformers, then the engine"
            print(f"round {r + 1}/{args.rounds}: {order} generate, {top} prompts ...", file=sys.stderr)
            batch = prompts(top, 1000 + r)  # new prompts each round: the engine's cache holds the last ones
            if first == "engine":
                point = throughput(engine, batch, args.output_tokens)
                baseline_speed = transformers_generate(baseline_model, batch, args.output_tokens)
            else:
                baseline_speed = transformers_generate(baseline_model, batch, args.output_tokens)
                point = throughput(engine, batch, args.output_tokens)
            rounds.append(BaselineRound(point, baseline_speed, first))
    ratio = statistics.median(r.ratio for r in rounds) if rounds else None
    baseline = statistics.median(r.transformers_tokens_per_second for r in rounds) if rounds else None
    print()
    extra = " vs transformers (median of rounds) |" if rounds else ""
    print(f"| concurrent requests | output tok/s | mean TTFT (s) | model steps |{extra}")
    print(f"|---:|---:|---:|---:|{'---:|' if rounds else ''}")
    for p in points:
        print(f"| {p.concurrency} | {p.tokens_per_second:.1f} | {p.mean_ttft_seconds:.3f} | {p.steps} |"
              + (" |" if rounds else ""))
    if rounds:
        engine_median = statistics.median(r.engine.tokens_per_second for r in rounds)
        print(f"| {top}, in the rounds (median) | {engine_median:.1f} | | | **{ratio:.2f}x** |")
        print(f"| transformers generate ({top} in one batch, median) | {baseline:.1f} | | | 1.00x |")
        print()
        print("rounds (engine tok/s / transformers tok/s = ratio): " + "; ".join(
            f"{r.engine.tokens_per_second:.0f} / {r.transformers_tokens_per_second:.0f} = {r.ratio:.2f}x"
            for r in rounds))
    print()
    print(f"TTFT, {ttft['prompt_tokens']}-token prompt: cold {ttft['cold_ttft_seconds']:.3f} s, "
          f"{ttft['cached_tokens']} tokens cached {ttft['warm_ttft_seconds']:.4f} s "
          f"({ttft['speedup']:.1f}x lower; computed {ttft['warm_computed_tokens']} tokens)")
    print(f"peak resident memory (engine, bundled model): {rss:.0f} MiB")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "dtype": str(engine.dtype),
            "quantization": args.quantization,
            "threads": torch.get_num_threads(),
            "throughput": [asdict(p) for p in points],
            "rounds": [{**asdict(r), "ratio": r.ratio} for r in rounds],
            "transformers_tokens_per_second": baseline,
            "ratio_median": ratio,
            "prefix_ttft": ttft,
            "peak_rss_mib": rss,
        }, indent=2))
    return 0
