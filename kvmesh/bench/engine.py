"""`kvmesh bench engine`: the engine's throughput and prefix-cache TTFT, beside transformers' `generate`.

Everything runs in one process on the same machine and dtype, so the ratios compare like with like:
- output tokens per second with 1, 8 and 32 concurrent requests of 128 prompt and 128 output tokens (greedy),
  and transformers' `generate` on the same 32 prompts as one padded batch;
- TTFT of a 2,000-token prompt cold, and with all but its last block cached;
- peak resident memory of the engine with the bundled model (before the baseline loads).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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


def throughput(engine: Engine, concurrency: int, prompt_tokens: int, output_tokens: int, seed: int) -> ThroughputPoint:
    prompts = random_prompts(concurrency, prompt_tokens, seed, engine.vocab_size)
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


def transformers_generate(
    model_dir: Path, dtype: torch.dtype, quantization: str, prompts: list[list[int]], output_tokens: int
) -> float:
    """transformers' generate on the prompts as one padded batch (left padding, greedy); output tokens/s.
    With int8 the baseline gets torch's dynamic int8 quantization of its linear layers, per channel: the
    same arithmetic as the engine's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if quantization == "int8":
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        model = quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
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
    print("loading the bundled model ...", file=sys.stderr)
    model_dir = resolve_model_dir(None)
    engine = Engine(EngineConfig(dtype=args.dtype, quantization=args.quantization, max_num_seqs=max(64, *levels)))
    engine.warmup()
    print(f"engine: dtype {engine.dtype}, quantization {args.quantization}, {engine.kv.pool.num_blocks} KV blocks, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    points = []
    for i, c in enumerate(levels):
        print(f"[{i + 1}/{len(levels)}] {c} concurrent requests ...", file=sys.stderr)
        points.append(throughput(engine, c, args.prompt_tokens, args.output_tokens, seed=100 + c))
    print("prefix-cache TTFT ...", file=sys.stderr)
    ttft = prefix_ttft(engine, args.prefix_tokens, seed=7)
    rss = peak_rss_mib()
    baseline = None
    if not args.no_baseline:
        top = max(levels)
        print(f"transformers generate, {top} prompts as one batch ...", file=sys.stderr)
        prompts = random_prompts(top, args.prompt_tokens, 100 + top, engine.vocab_size)
        baseline = transformers_generate(model_dir, engine.dtype, args.quantization, prompts, args.output_tokens)
    print()
    extra = " vs transformers |" if baseline else ""
    print(f"| concurrent requests | output tok/s | mean TTFT (s) | model steps |{extra}")
    print(f"|---:|---:|---:|---:|{'---:|' if baseline else ''}")
    for p in points:
        ratio = f" {p.tokens_per_second / baseline:.2f}x |" if baseline and p.concurrency == max(levels) else (
            " |" if baseline else "")
        print(f"| {p.concurrency} | {p.tokens_per_second:.1f} | {p.mean_ttft_seconds:.3f} | {p.steps} |{ratio}")
    if baseline:
        print(f"| transformers generate ({max(levels)} in one batch) | {baseline:.1f} | | | 1.00x |")
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
            "transformers_tokens_per_second": baseline,
            "prefix_ttft": ttft,
            "peak_rss_mib": rss,
        }, indent=2))
    return 0
