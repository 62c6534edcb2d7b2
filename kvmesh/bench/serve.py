"""`kvmesh bench serve`: OpenAI-API load against any endpoint, measured as vLLM's and SGLang's serving benchmarks do.

Prompts are token ids sent through `/v1/completions` (vLLM, SGLang and kvmesh all take a list of ints), so a
shared prefix is shared exactly, whatever the tokenizer: no text has to re-tokenize the same way. Every request
streams with usage, which gives the time of each token, and the server's `cached_tokens` (the hit ratio).

Datasets: random; shared prefix (groups x prompts, a system prompt per group and a question per prompt); and
replay of a Mooncake trace (one block of token ids per hash id, so equal ids are equal prefixes), with a length
scale for engines whose context is shorter than the trace's prompts. Arrivals: all at once, a Poisson or bursty
(gamma) process at a rate, or the trace's own times; at most `concurrency` in flight; bounded by a request count
and a duration.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.bench.machine import machine_info
from kvmesh.bench.stats import percentile

FIRST_ORDINARY_TOKEN = 100  # synthetic prompts stay clear of the special tokens of the usual vocabularies
DEFAULT_VOCAB = 32000  # the smallest common vocabulary (Llama 2): ids below it are valid for nearly every model
PERCENTILES = (50, 90, 99)


# ---- requests -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]  # token ids
    max_tokens: int
    arrival: float | None = None  # seconds from the start (trace replay); None: the arrival process decides
    group: int = 0  # the shared-prefix group or trace conversation, for reports


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(n)]


def random_requests(count: int, input_tokens: int, output_tokens: int, seed: int = 0,
                    vocab: int = DEFAULT_VOCAB) -> list[BenchRequest]:
    """`count` prompts of random token ids: no two share a block (with overwhelming probability)."""
    rng = random.Random(seed)
    return [BenchRequest(_random_ids(rng, input_tokens, vocab), output_tokens) for _ in range(count)]


def shared_prefix_requests(groups: int, prompts_per_group: int, system_tokens: int, question_tokens: int,
                           output_tokens: int, seed: int = 0, vocab: int = DEFAULT_VOCAB,
                           shuffle: bool = True) -> list[BenchRequest]:
    """SGLang's generated-shared-prefix workload: each group has its own system prompt, each prompt its own question
    after it. Shuffled (seeded) so groups interleave as users would, unless `shuffle` is false."""
    if groups < 1 or prompts_per_group < 1 or system_tokens < 0 or question_tokens < 0:
        raise ValueError("groups and prompts per group must be at least 1, lengths at least 0")
    if system_tokens + question_tokens < 1:
        raise ValueError("a prompt needs at least one token")
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        system = _random_ids(rng, system_tokens, vocab)
        out += [BenchRequest(system + _random_ids(rng, question_tokens, vocab), output_tokens, group=g)
                for _ in range(prompts_per_group)]
    if shuffle:
        rng.shuffle(out)
    return out


def split_shared(prompt_tokens: int, shared_fraction: float) -> tuple[int, int]:
    """(system, question) tokens of a prompt whose first `shared_fraction` is shared."""
    if not 0.0 <= shared_fraction <= 1.0:
        raise ValueError(f"the shared fraction must be between 0 and 1, not {shared_fraction}")
    system = round(prompt_tokens * shared_fraction)
    return system, prompt_tokens - system


def trace_requests(path: str | Path | None, limit: int | None, length_scale: float = 1.0, speedup: float = 1.0,
                   max_model_len: int | None = None, vocab: int = DEFAULT_VOCAB) -> tuple[list[BenchRequest], int]:
    """A Mooncake trace as requests, and how many prompts were cut to fit the context.

    `length_scale` shrinks every 512-token block (and output) by the same factor, so the trace's prefix structure
    survives: equal hash ids still give equal blocks. A prompt that still does not fit `max_model_len` with its
    output keeps its leading blocks (its shared prefix) and loses its tail."""
    from kvmesh.bench.traces import MOONCAKE_BLOCK_TOKENS, MOONCAKE_TRACE, load_mooncake, prompt_token_ids

    if length_scale <= 0:
        raise ValueError(f"the length scale must be positive, not {length_scale}")
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))
    out, cut = [], 0
    for r in load_mooncake(path or MOONCAKE_TRACE, limit, speedup):
        n = len(r.hash_ids)
        scaled = min(max(round(r.input_tokens * block / MOONCAKE_BLOCK_TOKENS), (n - 1) * block + 1), n * block)
        prompt = prompt_token_ids(dataclasses.replace(r, input_tokens=scaled), block, vocab)
        output = max(1, round(r.output_tokens * length_scale))
        if max_model_len is not None and len(prompt) + output > max_model_len:
            output = min(output, max_model_len // 2)
            prompt = prompt[: max_model_len - output]
            cut += 1
        out.append(BenchRequest(prompt, output, arrival=r.arrival, group=r.hash_ids[0]))
    return out, cut


# ---- arrivals -----------------------------------------------------------------------------------------------------


def arrival_times(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Start offsets in seconds: all at once for an infinite rate; else gaps drawn from a gamma distribution with
    mean 1/rate and shape `burstiness` (1: a Poisson process; below 1: bursts and lulls), as vLLM's benchmark."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("the rate and the burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


# ---- one request --------------------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int  # the server's count when it answered, else the prompt's length
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks that carried text
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for single-token answers)."""
        return (self.e2e - self.ttft) / (self.completion_tokens - 1) if self.completion_tokens > 1 else None


async def send(client: Any, url: str, request: BenchRequest, model: str | None,
               extra: dict[str, Any] | None = None) -> RequestResult:
    """One streamed completion; its timings, usage and error (never raises for a server's or network's fault)."""
    import httpx

    body: dict[str, Any] = {"prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                            **(extra or {})}
    if model:
        body["model"] = model
    result = RequestResult(ok=False, prompt_tokens=len(request.prompt))
    start = time.perf_counter()
    last: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                result.error = f"HTTP {reply.status_code}: {_message(text)}"
                return result
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {_message(data)}"
                    return result
                now = time.perf_counter()
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                usage = chunk.get("usage") or usage
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.e2e = time.perf_counter() - start
    if usage is None:
        result.error = "no usage in the stream (the server ignored stream_options.include_usage)"
        return result
    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
    result.completion_tokens = usage.get("completion_tokens", 0)
    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if last is None:
        result.ttft = result.e2e  # nothing but empty chunks: the first token came with the end
    result.ok = True
    return result


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return text[:200]


# ---- a run --------------------------------------------------------------------------------------------------------


async def run_load(url: str, requests: Sequence[BenchRequest], *, concurrency: int | None = None,
                   rate: float = math.inf, burstiness: float = 1.0, seed: int = 0, duration: float | None = None,
                   model: str | None = None, timeout: float = 600.0, progress: bool = True,
                   extra: dict[str, Any] | None = None, auth: Any = None) -> tuple[list[RequestResult], float]:
    """Send `requests` (at their own arrival times if they have them, else by the arrival process), at most
    `concurrency` in flight, none started after `duration` s, each with `auth` (an httpx.Auth: `pool_token`'s, for
    an engine of a pool). Returns the results of those sent, in order, and the run's wall time (first send to last
    answer)."""
    import httpx
    from tqdm import tqdm

    url = base_url(url)
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    offsets = ([r.arrival or 0.0 for r in requests] if requests and requests[0].arrival is not None
               else arrival_times(len(requests), rate, burstiness, seed))
    gate = asyncio.Semaphore(concurrency or len(requests) or 1)
    limits = httpx.Limits(max_connections=concurrency or max(len(requests), 1), max_keepalive_connections=64)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, file=sys.stderr)
    results: list[RequestResult | None] = [None] * len(requests)
    start = time.perf_counter()

    async def one(i: int, client: httpx.AsyncClient) -> None:
        if duration is None or offsets[i] <= duration:
            await asyncio.sleep(max(0.0, offsets[i] - (time.perf_counter() - start)))
            async with gate:
                if duration is None or time.perf_counter() - start <= duration:
                    results[i] = await send(client, url, requests[i], model, extra)
        bar.update()

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits, auth=auth,
                                 **user_http_client(url)) as client:
        await asyncio.gather(*(one(i, client) for i in range(len(requests))))
    bar.close()
    return [r for r in results if r is not None], time.perf_counter() - start


def base_url(url: str) -> str:
    """`http://host:port`, whether the user gave that, a trailing slash, or the `/v1` of OpenAI clients."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def user_http_client(url: str) -> dict[str, Any]:
    """httpx client keywords for a user's --url (`kvmesh chat`, `status`, `bench serve`): the environment's proxy
    settings apply as they do to curl, but never to a loopback host (127.0.0.0/8, ::1, localhost), which no proxy
    can reach: with HTTP_PROXY set, every call to `kvmesh up`'s own router went to the proxy and hung."""
    import ipaddress

    import httpx

    from kvmesh.engine.protocol import INTERNAL_HTTP_CLIENT

    host = httpx.URL(url).host.rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return dict(INTERNAL_HTTP_CLIENT)
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: the proxy settings decide
        loopback = False
    return dict(INTERNAL_HTTP_CLIENT) if loopback else {}


# ---- the report ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan)
        ordered = sorted(values)
        return cls(sum(ordered) / len(ordered), *(percentile(ordered, p / 100) for p in PERCENTILES))


@dataclass(frozen=True)
class SLO:
    """Latency bounds a request must meet to count toward goodput (None: no bound), in seconds."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def met(self, r: RequestResult) -> bool:
        return r.ok and (self.ttft is None or r.ttft <= self.ttft) and (
            self.tpot is None or r.tpot is None or r.tpot <= self.tpot) and (self.e2e is None or r.e2e <= self.e2e)

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft, self.tpot, self.e2e))


@dataclass(frozen=True)
class ServeReport:
    completed: int
    failed: int
    seconds: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # completion tokens per second
    total_token_throughput: float  # prompt and completion tokens per second
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    hit_ratio: float  # cached over prompt tokens, of completed requests (docs/contracts.md, contract 0)
    goodput: float | None  # requests per second that met every SLO; None without SLOs
    slo_attainment: float | None  # share of sent requests that met every SLO
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    errors: dict[str, int]  # message -> count, the most frequent first


def summarize(results: Sequence[RequestResult], seconds: float, slo: SLO = SLO()) -> ServeReport:
    done = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    completion = sum(r.completion_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    good = sum(slo.met(r) for r in results)
    per_second = 1.0 / seconds if seconds > 0 else 0.0
    return ServeReport(
        completed=len(done),
        failed=len(results) - len(done),
        seconds=seconds,
        request_throughput=len(done) * per_second,
        output_throughput=completion * per_second,
        total_token_throughput=(prompt + completion) * per_second,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        hit_ratio=cached / prompt if prompt else 0.0,
        goodput=good * per_second if slo.given else None,
        slo_attainment=good / len(results) if slo.given and results else None,
        ttft=Stats.of([r.ttft for r in done]),
        tpot=Stats.of([t for r in done if (t := r.tpot) is not None]),
        itl=Stats.of([x for r in done for x in r.itl]),
        e2e=Stats.of([r.e2e for r in done]),
        errors=dict(Counter(r.error for r in results if r.error).most_common(10)),
    )


def format_report(report: ServeReport) -> str:
    """The table printed on screen (times in milliseconds)."""
    lines = [
        f"requests: {report.completed} completed, {report.failed} failed, in {report.seconds:.2f} s",
        f"throughput: {report.request_throughput:.2f} req/s, {report.output_throughput:.1f} output tok/s, "
        f"{report.total_token_throughput:.1f} total tok/s",
        f"tokens: {report.prompt_tokens} prompt ({report.cached_tokens} cached: hit ratio "
        f"{report.hit_ratio:.1%}), {report.completion_tokens} completion",
    ]
    if report.goodput is not None:
        lines.append(f"goodput: {report.goodput:.2f} req/s ({report.slo_attainment:.1%} of requests met the SLOs)")
    lines += ["", "| metric (ms) | mean | p50 | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s: Stats = getattr(report, name)
        lines.append(f"| {name.upper()} | " + " | ".join(f"{v * 1e3:.1f}" for v in (s.mean, s.p50, s.p90, s.p99))
                     + " |")
    for message, count in report.errors.items():
        lines.append(f"error x{count}: {message}")
    return "\n".join(lines)


# ---- CLI ----------------------------------------------------------------------------------------------------------


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("serve", help="OpenAI-API load against an endpoint: TTFT, ITL, TPOT, "
                                                  "throughput, goodput and the prefix-cache hit ratio")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the endpoint (router or engine) base URL")
    p.add_argument("--model", help="the model name to send (default: none, the server's own)")
    p.add_argument("--dataset", choices=["random", "shared-prefix", "trace"], default="random")
    p.add_argument("--num-requests", type=int, default=100, help="requests to send (trace: the first N)")
    p.add_argument("--duration", type=float, help="start no request after this many seconds")
    p.add_argument("--input-tokens", type=int, default=512, help="random: prompt length")
    p.add_argument("--output-tokens", type=int, default=128, help="random, shared-prefix: tokens to generate")
    p.add_argument("--groups", type=int, default=8, help="shared-prefix: groups (one system prompt each)")
    p.add_argument("--system-tokens", type=int, default=1024, help="shared-prefix: system prompt length")
    p.add_argument("--question-tokens", type=int, default=256, help="shared-prefix: question length")
    p.add_argument("--shared-fraction", type=float,
                   help="shared-prefix: instead of the two lengths, prompts of --input-tokens whose first "
                        "fraction is the group's system prompt")
    p.add_argument("--trace", help="trace: a Mooncake-format JSONL file (default: the Mooncake conversation trace)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="trace: scale prompt blocks and outputs by this factor (the trace averages 12k prompt "
                        "tokens; the bundled model's context is 8,192)")
    p.add_argument("--trace-speedup", type=float, default=1.0, help="trace: divide arrival times by this")
    p.add_argument("--max-model-len", type=int,
                   help="trace: cut prompts to fit this context (default: what /v1/models says, if anything)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="token ids stay below this")
    p.add_argument("--rate", type=float, default=math.inf,
                   help="requests per second (default: all at once; trace: its own times unless given)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson, < 1 bursty")
    p.add_argument("--concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--slo-e2e-ms", type=float)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for one request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report, the settings and the machine here")


def build_requests(args: argparse.Namespace) -> tuple[list[BenchRequest], str]:
    """The dataset the flags describe, and a line saying what it is."""
    n = args.num_requests
    if n < 1:
        raise ValueError("--num-requests must be at least 1")
    if args.dataset == "random":
        return (random_requests(n, args.input_tokens, args.output_tokens, args.seed, args.vocab_size),
                f"random: {n} x {args.input_tokens} prompt tokens")
    if args.dataset == "shared-prefix":
        system, question = args.system_tokens, args.question_tokens
        if args.shared_fraction is not None:
            system, question = split_shared(args.input_tokens, args.shared_fraction)
        per_group = max(1, math.ceil(n / args.groups))
        requests = shared_prefix_requests(args.groups, per_group, system, question, args.output_tokens, args.seed,
                                          args.vocab_size)[:n]
        return requests, f"shared prefix: {args.groups} groups, {system} system + {question} question tokens"
    max_len = args.max_model_len or _served_max_len(args.url, pool_token())
    requests, cut = trace_requests(args.trace, n, args.length_scale, args.trace_speedup, max_len, args.vocab_size)
    if not math.isinf(args.rate):
        requests = [dataclasses.replace(r, arrival=None) for r in requests]
    mean = sum(len(r.prompt) for r in requests) / len(requests)
    return requests, (f"trace: {len(requests)} requests, length scale {args.length_scale}, mean prompt "
                      f"{mean:.0f} tokens, {cut} cut to the context ({max_len})")


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float as None (null), so the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def pool_token() -> Any:
    """The internal token of the pool named by $KVMESH_INTERNAL_TOKEN_FILE (`<workdir>/internal-token` of a
    `kvmesh up`, whose engines answer only their pool), as an httpx.Auth that sends it; without it, one that sends
    nothing. Raises ValueError, naming the variable, for a file that cannot be read or holds no token."""
    from kvmesh.engine.internal_token import InternalToken

    return InternalToken.from_env()


def _served_max_len(url: str, auth: Any = None) -> int | None:
    """The context length the endpoint reports in /v1/models (kvmesh and vLLM do), if any."""
    import httpx

    try:
        with httpx.Client(**user_http_client(url), timeout=10, auth=auth) as client:
            data = client.get(f"{base_url(url)}/v1/models").json()["data"]
        return int(data[0]["max_model_len"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def run(args: argparse.Namespace) -> int:
    from kvmesh.bench.plots import check_output_path
    from kvmesh.cli import checked_base_url

    try:  # before the run: a bad path or URL must not cost its results
        check_output_path(args.json, "--json")
        checked_base_url(args.url)
    except ValueError as exc:
        print(f"kvmesh bench serve: {exc}", file=sys.stderr)
        return 2
    try:
        token = pool_token()
    except (OSError, ValueError) as exc:
        from kvmesh.engine.internal_token import INTERNAL_TOKEN_FILE_ENV

        print(f"kvmesh bench serve: ${INTERNAL_TOKEN_FILE_ENV}: {exc}", file=sys.stderr)
        return 2
    try:
        requests, what = build_requests(args)
        slo = SLO(*(v / 1e3 if v is not None else None for v in (args.slo_ttft_ms, args.slo_tpot_ms,
                                                                   args.slo_e2e_ms)))
        print(f"kvmesh bench serve: {what}, against {args.url}", file=sys.stderr)
        results, seconds = asyncio.run(run_load(args.url, requests, concurrency=args.concurrency, rate=args.rate,
                                                burstiness=args.burstiness, seed=args.seed, duration=args.duration,
                                                model=args.model, timeout=args.timeout, auth=token))
    except ValueError as exc:
        print(f"kvmesh bench serve: {exc}", file=sys.stderr)
        return 2
    report = summarize(results, seconds, slo)
    if not report.completed:  # a table of nan says nothing: why the requests failed does
        problem = next(iter(report.errors), "no request was sent")
        print(f"kvmesh bench serve: no request to {args.url} succeeded ({len(results)} sent): {problem}",
              file=sys.stderr)
        return 1
    print(format_report(report))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(finite({"dataset": what, "settings": vars(args), "machine": machine_info(),
                                           "report": asdict(report)}), indent=2))
    return 0 if report.completed else 1
