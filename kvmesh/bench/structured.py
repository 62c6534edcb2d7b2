"""What structured outputs cost on the bundled model (49,152-token vocabulary): the mask per token for each kind
of constraint, alone, and a decode step with every sequence constrained against the same step unconstrained.

    kvmesh bench structured [--batch 8] [--tokens 32] [--repeats 3] [--threads 1] [--json PATH]

Prints a table; docs/engine.md ("Structured outputs") quotes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvmesh.bench.args import positive_int
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.constraint import Constraint
from kvmesh.engine.engine import Engine
from kvmesh.engine.request import Request
from kvmesh.engine.sampling import SamplingParams, sample

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}}
# each constraint with an output it accepts, whose tokens are fed one at a time
CASES = {
    "json_schema": (Constraint("json_schema", PERSON, "bench"),
                    json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["mathematician", "writer", "analyst"]})),
    "json_object": (Constraint("json_object", None, "bench"),
                    json.dumps({"city": "Paris", "country": "France", "population": 2102650, "capital": True})),
    "regex": (Constraint("regex", r"[A-Z][a-z]+( [a-z]+)*\.", "bench"), "The quick brown fox jumps over the dog."),
    "grammar": (Constraint("grammar", 'root ::= item ("," item)*\nitem ::= [a-z]+', "bench"),
                "alpha,beta,gamma,delta,epsilon,zeta,eta,theta"),
}


def mask_cost(engine: Engine, repeats: int) -> dict[str, tuple[int, float, float]]:
    """Per kind: tokens, median microseconds to compute one token's mask, and to unpack and apply it to a row."""
    out = {}
    for kind, (constraint, text) in tqdm(CASES.items(), desc="masks", leave=False):
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        fills, applies = [], []
        for _ in range(repeats):
            guide = engine.structured.guide(constraint)
            logits = torch.randn(1, engine.model_config.vocab_size)
            params = [SamplingParams(temperature=0.0)]
            for token in ids:
                start = time.perf_counter()
                masks = engine.structured.masks([guide])
                fills.append(time.perf_counter() - start)
                start = time.perf_counter()
                sample(logits, params, [0], masks=masks)
                applied = time.perf_counter() - start
                start = time.perf_counter()
                sample(logits, params, [0])
                applies.append(applied - (time.perf_counter() - start))
                guide.consume([token])
        out[kind] = (len(ids), statistics.median(fills) * 1e6, statistics.median(applies) * 1e6)
    return out


def step_cost(engine: Engine, batch: int, tokens: int, repeats: int) -> tuple[float, float]:
    """Median seconds per decode step for `batch` sequences of `tokens` tokens, unconstrained and constrained (a
    regex no output completes, so both run to max_tokens)."""
    constraint = Constraint("regex", "[a-z ]+", "bench")
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Write about the sea."}])
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in tqdm(range(repeats), desc="steps", leave=False):
        for constrained in (False, True):
            for i in range(batch):
                guide = engine.structured.guide(constraint) if constrained else None
                params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True)
                engine.submit(Request(f"b-{constrained}-{i}", prompt, params, guide=guide))
            engine.step()  # the prefill, not timed
            steps = 0
            start = time.perf_counter()
            while engine.scheduler.has_work():
                engine.step()
                steps += 1
            times[constrained].append((time.perf_counter() - start) / steps)
    return statistics.median(times[False]), statistics.median(times[True])


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """`kvmesh bench structured` and its options."""
    p = bench_subparsers.add_parser("structured", help="structured outputs: mask cost per token, and a constrained "
                                                       "decode step beside the same step unconstrained")
    p.add_argument("--model", help="HF directory or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--batch", type=positive_int, default=8, help="sequences in the decode step (default 8)")
    p.add_argument("--tokens", type=positive_int, default=32, help="decode steps timed (default 32)")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs of each measurement; medians (default 3)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (a shared machine: 1 is steadier)")
    p.add_argument("--json", help="write the results here as JSON")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model, dtype="float32", kv_cache_blocks=256))
    start = time.perf_counter()
    engine.structured.ll_tokenizer  # noqa: B018  (built once per engine)
    built = time.perf_counter() - start
    print(f"llguidance tokenizer built in {built:.2f} s")
    costs = mask_cost(engine, args.repeats)
    print(f"{'constraint':<12} {'tokens':>6} {'mask us/token':>14} {'apply us/row':>13}")
    for kind, (n, fill, apply) in costs.items():
        print(f"{kind:<12} {n:>6} {fill:>14.0f} {apply:>13.0f}")
    free, constrained = step_cost(engine, args.batch, args.tokens, args.repeats)
    print(f"decode step, batch {args.batch}: {free * 1e3:.1f} ms free, {constrained * 1e3:.1f} ms constrained "
          f"({constrained / free:.2f}x)")
    if args.json:
        results = {"tokenizer_seconds": built, "batch": args.batch,
                   "masks": {kind: {"tokens": n, "mask_us": fill, "apply_us": apply}
                             for kind, (n, fill, apply) in costs.items()},
                   "step_seconds": {"unconstrained": free, "constrained": constrained},
                   "constrained_over_unconstrained": constrained / free}
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
