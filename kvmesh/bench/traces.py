"""Production traces as lists of requests: the Mooncake conversation trace and the Azure LLM conversation trace.

One loader per format, one request type for all, so the serving benchmark, the cluster simulator and the
autoscaling study replay the same arrivals. The Mooncake trace names each 512-token block of a prompt by a
chained id (equal leading ids = a shared prefix); `block_token_ids` turns an id into the same token ids every
time, so shared ids become shared prefixes for a real engine or for the KV manager.
"""

from __future__ import annotations

import csv
import itertools
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512  # the Mooncake trace's hash_ids each cover this many prompt tokens
TRACES_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
MOONCAKE_TRACE = TRACES_DIR / "mooncake_conversation_trace.jsonl"
AZURE_CONV_TRACE = TRACES_DIR / "azure_llm_2023_conv.csv"
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")  # what load_azure reads of an Azure trace


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives and how long its prompt and answer are."""

    arrival: float  # seconds from the trace's first request
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: one chained id per 512-token block of the prompt; else empty


def _check(path: Path, speedup: float, limit: int | None) -> None:
    if not path.is_file():
        raise ValueError(f"trace {path} does not exist")
    if speedup <= 0:
        raise ValueError(f"speedup must be positive, not {speedup}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")


def load_mooncake(
    path: str | Path = MOONCAKE_TRACE, limit: int | None = None, speedup: float = 1.0
) -> list[TraceRequest]:
    """The first `limit` requests (all by default) of a Mooncake-format JSONL trace, arrivals divided by `speedup`.

    Checks the format's promise that ids are chained (an id always follows the same id), since every prefix
    hit computed from the trace relies on it; raises ValueError naming the line otherwise."""
    path = Path(path)
    _check(path, speedup, limit)
    requests: list[TraceRequest] = []
    parent_of: dict[int, int | None] = {}
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = tuple(int(h) for h in row["hash_ids"])
                request = TraceRequest(row["timestamp"] / 1000 / speedup, int(row["input_length"]),
                                       int(row["output_length"]), ids)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a Mooncake trace line ({exc})") from None
            if request.input_tokens < 1 or request.output_tokens < 0:
                raise ValueError(f"{path}:{number}: lengths must be positive")
            if len(ids) != -(-request.input_tokens // MOONCAKE_BLOCK_TOKENS):
                raise ValueError(f"{path}:{number}: {len(ids)} hash ids for {request.input_tokens} tokens")
            for parent, h in zip((None, *ids), ids, strict=False):
                if parent_of.setdefault(h, parent) != parent:
                    raise ValueError(f"{path}:{number}: hash id {h} follows {parent}, elsewhere {parent_of[h]}")
            requests.append(request)
    if not requests:
        raise ValueError(f"trace {path} holds no requests")
    return requests


def load_azure(
    path: str | Path = AZURE_CONV_TRACE, limit: int | None = None, speedup: float = 1.0
) -> list[TraceRequest]:
    """The Azure LLM inference trace (CSV: TIMESTAMP, ContextTokens, GeneratedTokens): arrivals and lengths,
    no prefix information. Arrivals are seconds from the first request, divided by `speedup`."""
    path = Path(path)
    _check(path, speedup, limit)
    requests: list[TraceRequest] = []
    start: datetime | None = None
    with path.open(newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's byte-order mark is no column
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        if not any(name.strip() for name in header):
            raise ValueError(f"trace {path} holds no requests")
        if missing := [name for name in AZURE_COLUMNS if name not in header]:
            raise ValueError(f"trace {path}: its header needs the columns {', '.join(AZURE_COLUMNS)}; it has "
                             f"{', '.join(map(repr, header))} (missing {', '.join(missing)})")
        for number, row in enumerate(reader, 2):
            if limit is not None and len(requests) >= limit:
                break
            try:
                # 7 fractional digits: datetime takes at most 6
                stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
                prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not an Azure trace row ({exc})") from None
            start = start or stamp
            requests.append(TraceRequest((stamp - start).total_seconds() / speedup, max(prompt, 1), output))
    if not requests:
        raise ValueError(f"trace {path} holds no requests")
    if any(b.arrival < a.arrival for a, b in itertools.pairwise(requests)):
        raise ValueError(f"{path}: timestamps are not in order")
    return requests


def block_token_ids(
    hash_id: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS, vocab_size: int | None = None
) -> list[int]:
    """The token ids of block `hash_id`: always the same, and different ids give different blocks.

    Without a vocabulary, id h is the run h*block_tokens ... (h+1)*block_tokens - 1 (distinct by construction,
    and cheap: the simulator hashes every distinct id). With one (a real engine's), tokens are drawn from a
    generator seeded by the id."""
    if vocab_size is None:
        return list(range(hash_id * block_tokens, (hash_id + 1) * block_tokens))
    return random.Random(hash_id).choices(range(vocab_size), k=block_tokens)


def prompt_token_ids(request: TraceRequest, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                     vocab_size: int | None = None) -> list[int]:
    """The prompt of a Mooncake request: its blocks' tokens, cut to its length (the last block is partial)."""
    if not request.hash_ids:
        raise ValueError("this request has no hash ids (the trace carries no prefix information)")
    tokens: list[int] = []
    for h in request.hash_ids:
        tokens += block_token_ids(h, block_tokens, vocab_size)
    return tokens[: request.input_tokens]


def ideal_hit_ratio(requests: Sequence[TraceRequest], block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> float:
    """Prompt tokens an unbounded cache shared by all instances serves, over all prompt tokens: every block seen
    before is a hit, as long as the prefix before it was, and (as in the engine) only full blocks short of the
    prompt's last token count."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        usable = (r.input_tokens - 1) // block_tokens
        run = 0
        while run < usable and r.hash_ids[run] in seen:
            run += 1
        hit += run * block_tokens
        total += r.input_tokens
        seen.update(r.hash_ids[: r.input_tokens // block_tokens])
    return hit / total if total else 0.0
