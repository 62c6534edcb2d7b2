"""What structured outputs cost on the bundled model (49,152-token vocabulary): the mask per token for each kind
of constraint, alone, and a decode step with every sequence constrained against the same step unconstrained.

    python -m kvmesh.bench.structured [--batch 8] [--tokens 32] [--repeats 3] [--threads 1]

Prints a table; docs/engine.md ("Structured outputs") quotes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm import tqdm

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a shared machine: 1 is steadier)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(dtype="float32", kv_cache_blocks=256))
    start = time.perf_counter()
    engine.structured.ll_tokenizer  # noqa: B018  (built once per engine)
    print(f"llguidance tokenizer built in {time.perf_counter() - start:.2f} s")
    print(f"{'constraint':<12} {'tokens':>6} {'mask us/token':>14} {'apply us/row':>13}")
    for kind, (n, fill, apply) in mask_cost(engine, args.repeats).items():
        print(f"{kind:<12} {n:>6} {fill:>14.0f} {apply:>13.0f}")
    free, constrained = step_cost(engine, args.batch, args.tokens, args.repeats)
    print(f"decode step, batch {args.batch}: {free * 1e3:.1f} ms free, {constrained * 1e3:.1f} ms constrained "
          f"({constrained / free:.2f}x)")


if __name__ == "__main__":
    main()
