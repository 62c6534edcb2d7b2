"""`kvmesh bench router`: the router's decision latency, its proxy overhead, and the requests per second it sustains.

- Decision latency for a pool of 64 pods and an 8,000-token prompt, part by part, with the router's own code:
  tokenization with the bundled tokenizer, block hashing (xxh3_64, and sha256_cbor_64bit beside it), the prefix
  index match over the 64 pods (the index fed by stored/removed event batches: every pod holds the shared system
  prompt, some prefix of this prompt, partly on the host tier, and thousands of other blocks; a few pods have
  provisional entries), and `picker.pick` over 64 pod snapshots. The pod holding the longest prefix must win.
- Proxy overhead: one real engine process (a tiny random Llama, so the model's own time is small and steady) and
  a `kvmesh router` process in front of it, and a `kvmesh gateway` in front of the router; sequential
  non-streaming completions (max_tokens=1) sent directly, through the router, and through the gateway and the
  router, interleaved, so drift on the machine affects all alike.
- Throughput: requests per second through the router against a stub upstream that answers at once, beside the
  same load sent to the stub directly (the bound of this client and this machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh.bench.machine import machine_info
from kvmesh.bench.stats import percentile
from kvmesh.engine.protocol import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HASH_ROOT,
    KV_CONFIG_PATH,
    KV_EVENTS_PATH,
    MODELS_PATH,
    TIERS,
    BlockExtra,
    HashAlgo,
    KVConfig,
    KVEvent,
    KVEventBatch,
    block_hashes,
)
from kvmesh.processes import free_port, launch, spawn, stop, wait_healthy
from kvmesh.router.config import RouterConfig
from kvmesh.router.index import PrefixIndex
from kvmesh.router.picker import Decision, PickerConfig, PodState, RequestInfo, pick

if TYPE_CHECKING:  # httpx and the tokenizer load on use: `kvmesh --help` builds this command's parser
    from kvmesh.engine.model.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
TARGET_MATCH_PICK_P99_MS = 1.0
TARGET_TOTAL_P99_MS = 5.0
TARGET_PROXY_P50_MS = 2.0
EVENT_HASHES = 64  # at most this many hashes in one stored event (an engine step's worth)
BATCH_EVENTS = 8  # events per batch of a pod's stream
PROVISIONAL_TTL = 3600.0  # the bench's provisional entries outlive the run

_SENTENCES = (
    "The router keeps one index of every block that each pod holds, fed by the pods' event streams.",
    "A request whose prompt shares a long prefix with an earlier one should land where that prefix is cached.",
    "Prefill dominates the time to the first token for long prompts, so a cached prefix saves most of it.",
    "When a pod is close to its memory limit, its forecast says so before the allocator runs out of blocks.",
    "Quarterly revenue grew by 12.5 percent, driven by the subscription business in Europe and Asia.",
    "def handler(request):\n    body = json.loads(request.body)\n    return {'status': 'ok', 'items': body['items']}",
    "Section 4.2 describes the eviction policy: least recently used blocks go first, shared ones last.",
    "Customers asked for invoices in PDF, a weekly summary by e-mail, and an export to CSV files.",
    "The patient reported mild symptoms on day 3; the dose was reduced to 20 mg and monitored daily.",
    "In 1969 the mission landed on the Moon; the crew spent about 21 hours on the surface.",
    "Tokens are grouped into blocks of sixteen, and each block's hash depends on every token before it.",
    "Please summarise the document above in five bullet points and list any open questions at the end.",
)


# ---- statistics ----------------------------------------------------------------------------------------------


def summary_ms(ns: Sequence[int]) -> dict[str, float]:
    """p50, p90, p99, mean and max of durations in nanoseconds, in milliseconds."""
    ms = [v / 1e6 for v in ns]
    return {
        "p50_ms": percentile(ms, 0.50),
        "p90_ms": percentile(ms, 0.90),
        "p99_ms": percentile(ms, 0.99),
        "mean_ms": sum(ms) / len(ms) if ms else float("nan"),
        "max_ms": max(ms) if ms else float("nan"),
        "count": len(ms),
    }


@contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside a timed loop (a collection would land in one sample); back on afterwards."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def resolve_model_dir(model: str | None, progress: bool = True) -> Path:
    """The loader's, imported on use: it brings torch, which `kvmesh --help` should not pay for."""
    from kvmesh.engine.model.loader import resolve_model_dir as resolve

    return resolve(model, progress)


def load_tokenizer(model_dir: Path) -> Tokenizer:
    from kvmesh.engine.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- part 1: decision latency --------------------------------------------------------------------------------


def prompt_text(tokenizer: Tokenizer, tokens: int, seed: int = 0) -> str:
    """A document-like prompt of about `tokens` tokens (prose, numbers, a little code), cut at a token boundary."""
    rng = random.Random(seed)
    parts: list[str] = []
    ids: list[int] = []
    while len(ids) < tokens:
        for _ in range(200):
            sentence = rng.choice(_SENTENCES)
            parts.append(sentence + ("\n\n" if rng.random() < 0.15 else " "))
            if rng.random() < 0.1:
                parts.append(f"(ref. {rng.randint(1, 9999)}) ")
        ids = tokenizer.encode("".join(parts))
    return tokenizer.decode(ids[:tokens], skip_special_tokens=False)


def _pod_name(i: int) -> str:
    return f"http://10.0.{i // 250}.{i % 250 + 1}:8000"


def _random_chain(rng: random.Random, length: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(length)]


@dataclass
class PodPlan:
    """What one pod of the scene holds of the benchmark's prompt, and how busy it is."""

    name: str
    prefix_blocks: int  # leading prompt blocks it holds (device, then possibly host), confirmed by events
    host_from: int  # prompt blocks from this index on are on the host tier (== prefix_blocks: none)
    provisional_blocks: int = 0  # prompt blocks after the confirmed ones, held only provisionally
    other_blocks: int = 0  # blocks of other prompts

    @property
    def expected_match(self) -> int:
        return self.prefix_blocks + self.provisional_blocks


@dataclass
class Scene:
    """A pool as the router would see it for one request: the filled index, the pod snapshots, the request."""

    index: PrefixIndex
    states: list[PodState]
    plans: dict[str, PodPlan]
    token_ids: list[int]
    hashes: list[int]
    longest: str  # the pod holding the longest prefix of the prompt
    events_applied: int
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.states]

    def request(self, hashes: Sequence[int] | None = None) -> RequestInfo:
        return RequestInfo(model="bench", prompt_tokens=len(self.token_ids),
                           block_hashes=tuple(self.hashes if hashes is None else hashes))


def _stored_events(hashes: Sequence[int], parent: int | None, tier: str, block_size: int) -> list[KVEvent]:
    """Stored events for a chain, EVENT_HASHES at a time, as an engine publishes them step by step."""
    events = []
    for start in range(0, len(hashes), EVENT_HASHES):
        chunk = tuple(hashes[start : start + EVENT_HASHES])
        events.append(KVEvent("stored", chunk, tier, parent if start == 0 else hashes[start - 1],
                              len(chunk) * block_size))
    return events


def build_scene(
    tokenizer: Tokenizer,
    text: str,
    pods: int = 64,
    other_blocks: int = 4000,
    seed: int = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    now: float | None = None,
) -> Scene:
    """A pool of `pods` whose index was filled through `PrefixIndex.apply`, as the router's event readers do.

    Every pod holds the shared system prompt (the first blocks of the prompt); most hold a longer prefix of it
    (a quarter with the tail of that prefix offloaded to the host tier), some continue it with blocks of
    other conversations, and one pod holds all but the last few blocks (the previous turn of this conversation).
    Each pod also holds `other_blocks` blocks of other prompts (a few popular prefixes shared by several pods,
    the rest its own), some of them since removed; a few pods hold provisional entries (the router's recent
    decisions), one of them a provisional continuation of its prompt prefix.
    """
    if pods < 2:
        raise ValueError("the scene needs at least two pods")
    rng = random.Random(seed)
    now = time.monotonic() if now is None else now
    ids = tokenizer.encode(text)
    hashes = block_hashes(ids, block_size)
    total = len(hashes)
    if total < 8:
        raise ValueError(f"the prompt has {total} blocks; the scene needs at least 8")
    system = max(1, min(32, total // 8))
    longest_blocks = total - max(1, total // 25)
    cap = max(system, int(total * 0.8))  # everybody else holds at most this much of the prompt
    winner = rng.randrange(pods)
    popular = [_random_chain(rng, 64) for _ in range(16)]

    index = PrefixIndex()
    plans: dict[str, PodPlan] = {}
    states: list[PodState] = []
    applied = 0
    for i in range(pods):
        name = _pod_name(i)
        # A pod holds the system prompt only, or some longer prefix; the winner all but the last blocks.
        prefix = system if rng.random() < 0.4 else rng.randint(system, cap)
        if i == winner:
            prefix = longest_blocks
        host_from = prefix
        if i != winner and prefix > system and rng.random() < 0.25:
            host_from = rng.randint(system, prefix)
        plan = PodPlan(name, prefix, host_from)
        events = _stored_events(hashes[:host_from], None, TIERS[0], block_size)
        if host_from < prefix:
            events += _stored_events(hashes[host_from:prefix], hashes[host_from - 1], TIERS[1], block_size)
        # Other conversations: branches off this prompt's prefix, popular prefixes, the pod's own prompts.
        others: list[int] = []
        if i != winner and rng.random() < 0.3:
            branch = _random_chain(rng, rng.randint(8, 64))
            events += _stored_events(branch, hashes[prefix - 1], TIERS[0], block_size)
            others += branch
        for chain in rng.sample(popular, 4):
            events += _stored_events(chain, None, TIERS[0], block_size)
            others += chain
        while len(others) < other_blocks:
            chain = _random_chain(rng, min(rng.randint(16, 256), other_blocks - len(others)))
            events += _stored_events(chain, None, rng.choice(TIERS[:2]), block_size)
            others += chain
        gone = rng.sample(others, len(others) // 20)
        for start in range(0, len(gone), EVENT_HASHES):
            events.append(KVEvent("removed", tuple(gone[start : start + EVENT_HASHES]), None))
        plan.other_blocks = len(others) - len(gone)
        for seq, start in enumerate(range(0, len(events), BATCH_EVENTS), start=1):
            batch = KVEventBatch(f"boot-{i}", seq, tuple(events[start : start + BATCH_EVENTS]))
            if not index.apply(name, batch):
                raise RuntimeError(f"the index refused batch {seq} of {name}")
            applied += len(batch.events)
        plans[name] = plan
        busy = i != winner
        kv_usage = rng.uniform(0.2, 0.75) if busy else 0.45
        states.append(PodState(
            name=name,
            url=name,
            model="bench",
            running=rng.randint(0, 4) if busy else 1,
            waiting=rng.randint(0, 2) if busy else 0,
            kv_usage=kv_usage,
            forecast_usage_p90=min(1.0, kv_usage + rng.uniform(0.0, 0.1)),
            pending_prefill_tokens=rng.randint(0, 4000) if busy else 0,
            prefill_tokens_per_second=rng.uniform(1500.0, 2500.0) if busy else 2000.0,
            decode_step_seconds=0.03,
            num_blocks=20000,
            block_size=block_size,
        ))

    # Provisional entries: recent decisions for other prompts, and one pod's continuation of this prompt.
    names = list(plans)
    for name in rng.sample(names, min(4, pods)):
        index.add_provisional(name, _random_chain(rng, 32), now, PROVISIONAL_TTL)
    candidates = [p for p in plans.values() if p.name != names[winner] and p.prefix_blocks + 16 < longest_blocks]
    if candidates:
        extended = rng.choice(candidates)
        extended.provisional_blocks = 16
        index.add_provisional(extended.name, hashes[extended.prefix_blocks : extended.prefix_blocks + 16], now,
                              PROVISIONAL_TTL)
    return Scene(index, states, plans, ids, hashes, names[winner], applied, block_size)


@dataclass
class DecisionResult:
    pods: int
    prompt_tokens: int
    prompt_blocks: int
    decisions: int
    index_blocks: int
    events_applied: int
    other_blocks_per_pod: int
    longest_prefix_pod: str
    longest_prefix_blocks: int
    chosen_pod: str
    chosen_reason: str
    predicted_cached_tokens: int
    pods_matching: int
    parts: dict[str, dict[str, float]] = field(default_factory=dict)


def _timed(fn: Callable[[], object], count: int, warmup: int) -> list[int]:
    for _ in range(warmup):
        fn()
    samples = []
    with gc_paused():
        for _ in range(count):
            start = time.perf_counter_ns()
            fn()
            samples.append(time.perf_counter_ns() - start)
    return samples


def follow_up(i: int) -> str:
    """The i-th next turn of the conversation whose earlier turns are the benchmark's prompt: about 60 new
    tokens, different for every decision so nothing of it is cached."""
    rng = random.Random(i)
    return "\nUser: " + " ".join(rng.choice(_SENTENCES) for _ in range(3)) + f" (question {i})"


def measure_decisions(
    tokenizer: Tokenizer, text: str, scene: Scene, decisions: int = 500, warmup: int = 20
) -> DecisionResult:
    """Time the router's request path over `scene` part by part: tokenize, hash (xxh3_64, as the router's
    default), match, pick. Each decision's prompt is `text` (earlier turns, seen by the router before) plus a new
    turn, as in a conversation, so the tokenizer's piece cache holds the earlier turns; then, as comparisons not
    in the total: tokenizing `text` with an empty cache (first sight of a document), hashing with
    sha256_cbor_64bit, and the chat path's tokenization."""
    config = RouterConfig()
    picker = PickerConfig()
    extra = BlockExtra(cache_salt=None)
    names = scene.names
    states = scene.states
    parts: dict[str, list[int]] = {k: [] for k in ("tokenize", "hash", "match", "pick", "match_pick", "total")}
    last: Decision | None = None
    matches: dict[str, Any] = {}
    turns = iter(range(1_000_000))

    def decide() -> tuple[Decision, dict[str, Any], list[int]]:
        prompt = text + follow_up(next(turns))
        t0 = time.perf_counter_ns()
        ids = tokenizer.encode(prompt)
        t1 = time.perf_counter_ns()
        hashes = block_hashes(ids[: config.max_hashed_tokens], config.block_size, extra, HashAlgo(config.hash_algo),
                              config.hash_root)
        info = RequestInfo(model="bench", prompt_tokens=len(ids), block_hashes=tuple(hashes))
        t2 = time.perf_counter_ns()
        found = scene.index.match(info.block_hashes, names, time.monotonic())
        t3 = time.perf_counter_ns()
        decision = pick(info, states, found, picker)
        t4 = time.perf_counter_ns()
        for key, value in (("tokenize", t1 - t0), ("hash", t2 - t1), ("match", t3 - t2), ("pick", t4 - t3),
                           ("match_pick", t4 - t2), ("total", t4 - t0)):
            parts[key].append(value)
        return decision, found, ids

    tokenizer.encode(text)  # the earlier turns, as the router saw them when they were sent
    for _ in range(warmup):
        decide()
    for values in parts.values():
        values.clear()
    with gc_paused():
        for _ in range(decisions):
            last, matches, ids = decide()
    assert last is not None and last.pod is not None
    settled = len(scene.token_ids) - scene.block_size  # the new turn may re-merge the last few tokens
    if ids[:settled] != scene.token_ids[:settled]:
        raise RuntimeError("the benchmark's prompt tokenized differently from the scene's")

    def cold() -> None:
        if tokenizer.token_cache is not None:
            tokenizer.token_cache.clear()
        tokenizer.encode(text)

    cold_samples = _timed(cold, decisions, min(warmup, 5))
    sha = _timed(lambda: block_hashes(scene.token_ids, config.block_size, extra, HashAlgo.SHA256_CBOR,
                                      config.hash_root), decisions, min(warmup, 5))
    history = [{"role": "user", "content": text}, {"role": "assistant", "content": "Noted."}]
    chat = _timed(lambda: tokenizer.encode_chat([*history, {"role": "user", "content": follow_up(next(turns))}]),
                  decisions, min(warmup, 5))
    summaries = {key: summary_ms(values) for key, values in parts.items()}
    summaries["hash_sha256_cbor"] = summary_ms(sha)
    summaries["tokenize_chat"] = summary_ms(chat)
    summaries["tokenize_cold"] = summary_ms(cold_samples)
    return DecisionResult(
        pods=len(states),
        prompt_tokens=len(scene.token_ids),
        prompt_blocks=len(scene.hashes),
        decisions=decisions,
        index_blocks=scene.index.size(),
        events_applied=scene.events_applied,
        other_blocks_per_pod=round(sum(p.other_blocks for p in scene.plans.values()) / len(scene.plans)),
        longest_prefix_pod=scene.longest,
        longest_prefix_blocks=scene.plans[scene.longest].expected_match,
        chosen_pod=last.pod.name,
        chosen_reason=last.reason,
        predicted_cached_tokens=last.predicted_cached_tokens,
        pods_matching=len(matches),
        parts=summaries,
    )


def decision_latency(
    pods: int = 64, prompt_tokens: int = 8000, decisions: int = 500, other_blocks: int = 4000, seed: int = 0,
    warmup: int = 20,
) -> DecisionResult:
    """Part 1 on its own: the bundled tokenizer, a prompt of `prompt_tokens`, a scene of `pods`, timed."""
    tokenizer = load_tokenizer(resolve_model_dir(None, progress=False))
    text = prompt_text(tokenizer, prompt_tokens, seed)
    scene = build_scene(tokenizer, text, pods, other_blocks, seed)
    return measure_decisions(tokenizer, text, scene, decisions, warmup)


# ---- processes -----------------------------------------------------------------------------------------------


class Processes:
    """Child processes with their logs; all stopped (SIGINT, then kill) on exit."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        """Any command (the stub upstream), its output in `name`.log."""
        log = self.logs / f"{name}.log"
        self.procs.append(launch(argv, log))
        return self.procs[-1], log

    def kvmesh(self, name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        """`python -m kvmesh.cli *args` (an engine, a router), its output in `name`.log."""
        log = self.logs / f"{name}.log"
        self.procs.append(spawn(args, log))
        return self.procs[-1], log

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *_: object) -> None:
        stop(self.procs, timeout=15)


def make_tiny_model(path: Path) -> Path:
    """A two-layer random Llama (hidden 64) with the bundled tokenizer, saved by transformers (as the tests')."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, initializer_range=0.2, eos_token_id=2, bos_token_id=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    bundled = resolve_model_dir(None, progress=False)
    for name in TOKENIZER_FILES:
        if (bundled / name).exists():
            shutil.copy(bundled / name, path / name)
    return path


def start_router(procs: Processes, pod: str, model_dir: Path, timeout: float) -> str:
    port = free_port()
    proc, log = procs.kvmesh("router", ["router", "--pod", pod, "--model", str(model_dir), "--port", str(port),
                                        "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, timeout, log)
    return url


# ---- part 2: proxy overhead ----------------------------------------------------------------------------------

PROXY_PROMPT = ("You are a helpful assistant. Answer briefly and precisely. The user asks: what is the capital "
                "of France, and which river flows through it?")


@dataclass
class ProxyResult:
    requests: int  # rounds measured (one direct, one through the router, one through the gateway and the router)
    seconds: float
    prompt_tokens: int
    direct: dict[str, float]
    router: dict[str, float]
    p50_difference_ms: float
    paired_difference: dict[str, float]  # router minus direct, pair by pair
    router_decision_mean_ms: float | None  # from the router's own kvmesh_router_decision_seconds
    gateway: dict[str, float]  # through `kvmesh gateway` in front of the router
    gateway_paired_difference: dict[str, float]  # gateway minus router, round by round: the gateway's own hop


def _decision_mean_ms(metrics: str) -> float | None:
    total = count = None
    for line in metrics.splitlines():
        if line.startswith("kvmesh_router_decision_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("kvmesh_router_decision_seconds_count"):
            count = float(line.split()[-1])
    return total / count * 1e3 if total is not None and count else None


def start_gateway(procs: Processes, router: str, timeout: float) -> str:
    port = free_port()
    proc, log = procs.kvmesh("gateway", ["gateway", "--router", router, "--port", str(port), "--refresh-seconds",
                                         "0.5", "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, timeout, log)  # healthy once the router's models are in its table
    return url


def proxy_overhead(requests: int = 200, warmup: int = 20, time_limit: float = 300.0,
                   startup_timeout: float = 180.0) -> ProxyResult:
    """One engine process with a tiny model, a router process in front, and `kvmesh gateway` in front of that;
    `requests` interleaved rounds of a completion sent directly, through the router, and through the gateway and
    the router, stopping early at `time_limit` seconds."""
    import httpx

    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-router-") as tmp, Processes(Path(tmp)) as procs:
        _progress("proxy: saving a tiny random Llama ...")
        model_dir = make_tiny_model(Path(tmp) / "tiny")
        port = free_port()
        engine_url = f"http://127.0.0.1:{port}"
        proc, log = procs.kvmesh("engine", ["serve", "--model", str(model_dir), "--port", str(port), "--dtype",
                                            "float32", "--threads", "1", "--kv-cache-memory-mib", "16",
                                            "--log-level", "warning"])
        _progress("proxy: starting the engine and the router ...")
        wait_healthy(engine_url, proc, startup_timeout, log)
        router_url = start_router(procs, engine_url, model_dir, startup_timeout)
        gateway_url = start_gateway(procs, router_url, startup_timeout)
        model = httpx.get(router_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROXY_PROMPT, "max_tokens": 1, "temperature": 0}
        samples: dict[str, list[int]] = {"direct": [], "router": [], "gateway": []}
        prompt_tokens = 0
        with httpx.Client(base_url=engine_url, timeout=30) as direct, \
                httpx.Client(base_url=router_url, timeout=30) as routed, \
                httpx.Client(base_url=gateway_url, timeout=30) as gateway:
            clients = {"direct": direct, "router": routed, "gateway": gateway}

            def send(which: str) -> int:
                start = time.perf_counter_ns()
                reply = clients[which].post("/v1/completions", json=body)
                elapsed = time.perf_counter_ns() - start
                if reply.status_code != 200:
                    raise RuntimeError(f"{which}: HTTP {reply.status_code}: {reply.text[:200]}")
                if which != "direct" and reply.headers.get("x-kvmesh-pod") != engine_url:
                    raise RuntimeError(f"the router answered from {reply.headers.get('x-kvmesh-pod')!r}")
                nonlocal prompt_tokens
                prompt_tokens = reply.json()["usage"]["prompt_tokens"]
                return elapsed

            _progress(f"proxy: {warmup} warm-up rounds, then {requests} measured rounds (direct, router, gateway "
                      f"interleaved) ...")
            for _ in range(warmup):
                for which in clients:
                    send(which)
            start = time.monotonic()
            with gc_paused():
                for i in range(requests):
                    if time.monotonic() - start > time_limit:
                        _progress(f"proxy: time limit reached after {i} rounds")
                        break
                    for which, kept in samples.items():
                        kept.append(send(which))
            seconds = time.monotonic() - start
            decision = _decision_mean_ms(routed.get("/metrics").text)
    direct_s, router_s = summary_ms(samples["direct"]), summary_ms(samples["router"])
    paired = [r - d for d, r in zip(samples["direct"], samples["router"], strict=True)]
    hop = [g - r for r, g in zip(samples["router"], samples["gateway"], strict=True)]
    return ProxyResult(
        requests=len(samples["direct"]),
        seconds=seconds,
        prompt_tokens=prompt_tokens,
        direct=direct_s,
        router=router_s,
        p50_difference_ms=router_s["p50_ms"] - direct_s["p50_ms"],
        paired_difference={"p50_ms": percentile(paired, 0.5) / 1e6, "mean_ms": sum(paired) / len(paired) / 1e6},
        router_decision_mean_ms=decision,
        gateway=summary_ms(samples["gateway"]),
        gateway_paired_difference={"p50_ms": percentile(hop, 0.5) / 1e6, "mean_ms": sum(hop) / len(hop) / 1e6},
    )


# ---- part 3: throughput against a stub upstream --------------------------------------------------------------

_REASONS = {200: b"OK", 404: b"Not Found"}


def _stub_routes(fingerprint: str, role: str = "both") -> dict[bytes, tuple[int, bytes, bytes]]:
    config = KVConfig(model="stub", block_size=DEFAULT_BLOCK_SIZE, hash_algo=HashAlgo.XXH3.value,
                      hash_root=DEFAULT_HASH_ROOT, tokenizer_fingerprint=fingerprint, num_device_blocks=100000,
                      boot_id="stub", role=role)
    completion = {
        "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
        "choices": [{"index": 0, "text": " Paris", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }
    metrics = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n"
    as_json = b"application/json"
    return {
        b"/health": (200, as_json, b'{"status": "ok"}'),
        b"/metrics": (200, b"text/plain; version=0.0.4", metrics),
        KV_CONFIG_PATH.encode(): (200, as_json, json.dumps(config.to_json()).encode()),
        KV_EVENTS_PATH.encode(): (200, b"application/x-ndjson", b""),  # no events: the router reconnects later
        MODELS_PATH.encode(): (200, as_json, json.dumps({"object": "list", "data": [
            {"id": "stub", "object": "model", "created": 0, "owned_by": "kvmesh"}]}).encode()),
        b"/v1/completions": (200, as_json, json.dumps(completion).encode()),
    }


def serve_stub(port: int, fingerprint: str) -> None:
    """An upstream that answers every completion at once, with what the router needs to accept it as a pod.
    Raw asyncio HTTP/1.1 with keep-alive: it should cost the machine far less than the router does."""
    import asyncio  # here, not at the top: `kvmesh --help` imports this module

    routes = _stub_routes(fingerprint)
    missing = (404, b"application/json", b'{"error": "not found"}')

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                target = lines[0].split(b" ")[1]
                length = 0
                for line in lines[1:]:
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if length:
                    await reader.readexactly(length)
                status, kind, body = routes.get(target.split(b"?", 1)[0], missing)
                writer.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, _REASONS[status], kind, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(connection, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    with suppress(KeyboardInterrupt):
        asyncio.run(main())


async def _load(port: int, body: bytes, concurrency: int, seconds: float) -> tuple[int, int, list[int]]:
    """`concurrency` keep-alive connections sending POST /v1/completions back to back for `seconds`:
    (ok responses, other responses, latencies in ns). A raw client, to leave the CPU to the server."""
    import asyncio  # here, not at the top: `kvmesh --help` imports this module

    request = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + seconds
    ok = failed = 0
    latencies: list[int] = []

    async def worker() -> None:
        nonlocal ok, failed
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.monotonic() < deadline:
                start = time.perf_counter_ns()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                latencies.append(time.perf_counter_ns() - start)
                if head.startswith(b"HTTP/1.1 200"):
                    ok += 1
                else:
                    failed += 1
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok, failed, latencies


@dataclass
class ThroughputResult:
    concurrency: int
    seconds: float
    direct_rps: float
    router_rps: float
    direct_latency: dict[str, float]
    router_latency: dict[str, float]
    router_failed: int
    nginx_rps: float | None = None  # None: nginx is not installed
    nginx_latency: dict[str, float] | None = None


def nginx_config(workdir: Path, port: int, upstream_port: int) -> Path:
    """A one-worker nginx proxying to the stub with keep-alive upstream connections: the bound a plain
    round-robin proxy sets on this machine (one upstream, so round-robin has one choice; the cost is the hop)."""
    conf = workdir / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    upstream pool {{ server 127.0.0.1:{upstream_port}; keepalive 64; keepalive_requests 100000000; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://pool;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
""")
    return conf


def router_throughput(concurrency: int = 32, seconds: float = 10.0, startup_timeout: float = 60.0) -> ThroughputResult:
    """Requests per second through the router against the stub, and the stub's own rate with the same client."""
    import asyncio  # here, not at the top: `kvmesh --help` imports this module

    model_dir = resolve_model_dir(None, progress=False)
    fingerprint = load_tokenizer(model_dir).fingerprint
    body = json.dumps({"prompt": PROXY_PROMPT, "max_tokens": 1}).encode()
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-rps-") as tmp, Processes(Path(tmp)) as procs:
        port = free_port()
        stub_url = f"http://127.0.0.1:{port}"
        proc, log = procs.start("stub", [sys.executable, "-c",
                                         "import sys; from kvmesh.bench.router import serve_stub; "
                                         "serve_stub(int(sys.argv[1]), sys.argv[2])", str(port), fingerprint])
        wait_healthy(stub_url, proc, startup_timeout, log)
        router_url = start_router(procs, stub_url, model_dir, startup_timeout)
        router_port = int(router_url.rsplit(":", 1)[1])
        targets = [("direct", port), ("router", router_port)]
        nginx = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)
        if nginx is not None:
            nginx_port = free_port()
            conf = nginx_config(Path(tmp), nginx_port, port)
            proc, log = procs.start("nginx", [nginx, "-c", str(conf), "-p", tmp])
            wait_healthy(f"http://127.0.0.1:{nginx_port}", proc, startup_timeout, log)
            targets.append(("nginx", nginx_port))
        results = {}
        for which, target in targets:
            _progress(f"throughput: {concurrency} connections, {which}, {seconds:.0f} s ...")
            asyncio.run(_load(target, body, concurrency, min(2.0, seconds)))  # warm-up
            with gc_paused():
                results[which] = asyncio.run(_load(target, body, concurrency, seconds))
    (d_ok, _, d_lat), (r_ok, r_failed, r_lat) = results["direct"], results["router"]
    n_ok, _, n_lat = results.get("nginx", (None, 0, None))
    return ThroughputResult(concurrency, seconds, d_ok / seconds, r_ok / seconds, summary_ms(d_lat),
                            summary_ms(r_lat), r_failed, None if n_ok is None else n_ok / seconds,
                            None if n_lat is None else summary_ms(n_lat))


# ---- the command ---------------------------------------------------------------------------------------------


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """`kvmesh bench router` and its options."""
    p = bench_subparsers.add_parser("router", help="router decision latency, proxy overhead and requests per second")
    p.add_argument("--pods", type=int, default=64, help="pods in the decision-latency pool (default 64)")
    p.add_argument("--prompt-tokens", type=int, default=8000, help="prompt length for decision latency")
    p.add_argument("--decisions", type=int, default=500, help="timed decisions (default 500)")
    p.add_argument("--other-blocks", type=int, default=4000, help="blocks of other prompts per pod (default 4000)")
    p.add_argument("--requests", type=int, default=200,
                   help="rounds (direct, through the router, through the gateway) for proxy overhead")
    p.add_argument("--proxy-time-limit", type=float, default=300.0, help="stop the proxy pairs after this many s")
    p.add_argument("--no-proxy", action="store_true", help="skip the proxy overhead (no engine process)")
    p.add_argument("--rps-seconds", type=float, default=10.0, help="throughput run length; 0 skips it")
    p.add_argument("--concurrency", type=int, default=32, help="connections for the throughput run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here as JSON")


def _row(label: str, s: dict[str, float], target: str = "") -> str:
    return f"| {label} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | {target} |"


def print_decisions(r: DecisionResult) -> None:
    p = r.parts
    met = {True: "met", False: "not met"}
    print(f"Decision latency: {r.pods} pods, {r.prompt_tokens}-token prompt ({r.prompt_blocks} blocks), "
          f"{r.decisions} decisions; index of {r.index_blocks} distinct blocks from {r.events_applied} events")
    print()
    print("| part | p50 (ms) | p99 (ms) | target (p99) |")
    print("|---|---:|---:|---|")
    print(_row("(a) tokenize (earlier turns cached, a new turn)", p["tokenize"]))
    print(_row(f"(b) hash {r.prompt_blocks} blocks, xxh3_64", p["hash"]))
    print(_row(f"(c) index match, {r.pods} pods", p["match"]))
    print(_row(f"(d) pick, {r.pods} pods", p["pick"]))
    match_pick_ok = p["match_pick"]["p99_ms"] < TARGET_MATCH_PICK_P99_MS
    total_ok = p["total"]["p99_ms"] < TARGET_TOTAL_P99_MS
    print(_row("(c + d) hashes known", p["match_pick"], f"< {TARGET_MATCH_PICK_P99_MS:g} ms: {met[match_pick_ok]}"))
    print(_row("total (a + b + c + d)", p["total"], f"< {TARGET_TOTAL_P99_MS:g} ms: {met[total_ok]}"))
    print(_row(f"hash {r.prompt_blocks} blocks, sha256_cbor_64bit (instead of b)", p["hash_sha256_cbor"]))
    print(_row("chat template + encode, a new turn (the chat path's a)", p["tokenize_chat"]))
    print(_row("tokenize, nothing cached (first sight of the whole prompt)", p["tokenize_cold"]))
    print()
    print(f"chosen: {r.chosen_pod} ({r.chosen_reason}; {r.predicted_cached_tokens} cached tokens predicted); "
          f"longest prefix: {r.longest_prefix_pod} ({r.longest_prefix_blocks} blocks); "
          f"{r.pods_matching} pods hold part of the prompt")


def print_proxy(r: ProxyResult) -> None:
    ok = r.p50_difference_ms < TARGET_PROXY_P50_MS
    print(f"Proxy overhead: {r.requests} rounds of non-streaming completions (max_tokens=1, {r.prompt_tokens}-token "
          f"prompt), direct, through the router and through the gateway and the router, interleaved; one engine "
          f"(tiny random Llama, 1 thread)")
    print()
    print("| path | p50 (ms) | p90 (ms) | p99 (ms) |")
    print("|---|---:|---:|---:|")
    for label, s in (("engine directly", r.direct), ("through the router", r.router),
                     ("through kvmesh gateway and the router", r.gateway)):
        print(f"| {label} | {s['p50_ms']:.2f} | {s['p90_ms']:.2f} | {s['p99_ms']:.2f} |")
    print()
    decision = "" if r.router_decision_mean_ms is None else (
        f"; the router's own decision time (tokenize, hash, pick) averaged {r.router_decision_mean_ms:.3f} ms")
    print(f"router p50 - direct p50: {r.p50_difference_ms:.2f} ms (target < {TARGET_PROXY_P50_MS:g} ms: "
          f"{'met' if ok else 'not met'}); median of paired differences {r.paired_difference['p50_ms']:.2f} ms"
          f"{decision}")
    print(f"the gateway's hop (gateway minus router, round by round): median "
          f"{r.gateway_paired_difference['p50_ms']:.2f} ms, mean {r.gateway_paired_difference['mean_ms']:.2f} ms")


def print_throughput(r: ThroughputResult) -> None:
    print(f"Throughput: {r.concurrency} keep-alive connections for {r.seconds:.0f} s against a stub upstream that "
          f"answers at once")
    print()
    print("| path | requests/s | p50 (ms) | p99 (ms) |")
    print("|---|---:|---:|---:|")
    print(f"| stub directly (the bound of this client and machine) | {r.direct_rps:.0f} | "
          f"{r.direct_latency['p50_ms']:.2f} | {r.direct_latency['p99_ms']:.2f} |")
    print(f"| through the router | {r.router_rps:.0f} | {r.router_latency['p50_ms']:.2f} | "
          f"{r.router_latency['p99_ms']:.2f} |")
    if r.nginx_rps is not None and r.nginx_latency is not None:
        print(f"| through nginx, round-robin (a C proxy's bound) | {r.nginx_rps:.0f} | "
              f"{r.nginx_latency['p50_ms']:.2f} | {r.nginx_latency['p99_ms']:.2f} |")
        print(f"\nthe router sustains {r.router_rps / r.nginx_rps:.2f}x nginx's requests per second")
    else:
        print("| through nginx | not installed (apt-get install nginx-light) | | |")
    if r.router_failed:
        print(f"\n{r.router_failed} routed requests failed")


def run(args: argparse.Namespace) -> int:
    """`kvmesh bench router`: every part in one run; markdown on stdout, progress on stderr."""
    if min(args.pods, args.decisions, args.requests, args.concurrency) < 1 or args.pods < 2:
        print("kvmesh bench router: --pods must be at least 2, and --decisions, --requests and --concurrency "
              "at least 1", file=sys.stderr)
        return 2
    _progress(f"decision latency: {args.pods} pods, {args.prompt_tokens}-token prompt, filling the index ...")
    tokenizer = load_tokenizer(resolve_model_dir(None))
    text = prompt_text(tokenizer, args.prompt_tokens, args.seed)
    scene = build_scene(tokenizer, text, args.pods, args.other_blocks, args.seed)
    _progress(f"decision latency: {args.decisions} decisions ...")
    decisions = measure_decisions(tokenizer, text, scene, args.decisions)
    if decisions.chosen_pod != decisions.longest_prefix_pod:
        _progress(f"warning: the picker chose {decisions.chosen_pod}, not the longest prefix holder")
    proxy = None if args.no_proxy else proxy_overhead(args.requests, time_limit=args.proxy_time_limit)
    throughput = router_throughput(args.concurrency, args.rps_seconds) if args.rps_seconds > 0 else None

    print()
    print_decisions(decisions)
    if proxy is not None:
        print()
        print_proxy(proxy)
    if throughput is not None:
        print()
        print_throughput(throughput)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        import tokenizers

        path.write_text(json.dumps({
            "machine": machine_info(tokenizers=tokenizers.__version__),
            "decision": asdict(decisions),
            "proxy": None if proxy is None else asdict(proxy),
            "throughput": None if throughput is None else asdict(throughput),
        }, indent=2))
    return 0
