"""The engine's Prometheus metrics (docs/contracts.md, contract 3), in one registry per engine.

Counters and histograms are updated as things happen. Gauges of state (queue lengths, block states, the
forecast) are read at scrape time from one immutable snapshot the engine publishes after each step, so a
scrape never sees half of a step: used + evictable + free always equals the total.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from kvmesh.engine.forecast import Forecast
from kvmesh.engine.kv.blocks import KVStats
from kvmesh.engine.protocol import (
    DEFAULT_KV_CACHE_DTYPE,
    EVICTION_REASONS,
    FINISH_REASONS,
    FORECAST_LEVELS,
    GATE_REASONS,
    KV_BLOCK_STATES,
    LOAD_DECISIONS,
    LORA_INFO_LABELS,
    MODEL_LABEL,
    PREEMPTION_MODES,
    RESIDENCY_KINDS,
    STRUCTURED_KINDS,
    TIER_MOVES,
    TIERS,
    TRANSFER_DIRECTIONS,
    TRANSFER_KINDS,
    TRANSFER_OUTCOMES,
    DecodeStepCost,
)
from kvmesh.engine.protocol import (
    Metric as M,
)
from kvmesh.engine.protocol import (
    VllmMetric as V,
)

# Whole requests (TTFT, end-to-end, queue, prefill and decode time): from a cached short prompt's milliseconds to
# an hour, so that a long generation or a long wait in the queue lands in a bucket of its own rather than in +Inf
REQUEST_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 30.0, 40.0, 60.0, 80.0, 120.0, 180.0, 300.0, 450.0, 600.0, 900.0, 1200.0, 1800.0, 2700.0, 3600.0
)
# One step or one transfer (inter-token latency, time per output token, KV transfers): a decode step takes 1 to 50 ms,
# so the bottom is fine-grained; the top still holds a stalled step or a large transfer
STEP_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0
)
TOKEN_BUCKETS = (0, 1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
NO_STEP_COST = DecodeStepCost(0.0, 0.0, 0.0)  # exported until a line is fitted (readers take no slope as none)
_STEP_COST_HELP = {
    M.DECODE_STEP_BASE: "Fitted decode step cost: the fixed part of a step, seconds.",
    M.DECODE_STEP_PER_SEQUENCE: "Fitted decode step cost: seconds per sequence in the batch.",
    M.DECODE_STEP_PER_KV_TOKEN: "Fitted decode step cost: seconds per KV token the batch attends to.",
}
RESIDENCY_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
_LOADING_HELP = "1 while the engine loads its model (every route but /metrics answers 503), 0 once loaded."
_LOAD_PROGRESS_HELP = ("Share of the model's weights read so far (a GGUF converted at this start: converting is the "
                       "first half), 1 once loaded: a flat one while loading is a stuck load.")


def _process_registry(loading: bool) -> tuple[CollectorRegistry, Gauge]:
    """A registry with the engine's load state, its load progress (returned, at 0 while loading, else 1) and the
    process's own metrics (CPU, resident memory, open files), which /metrics shows from the start."""
    registry = CollectorRegistry(auto_describe=True)
    Gauge(M.ENGINE_LOADING, _LOADING_HELP, registry=registry).set(int(loading))
    progress = Gauge(M.ENGINE_LOAD_PROGRESS, _LOAD_PROGRESS_HELP, registry=registry)
    progress.set(int(not loading))
    ProcessCollector(registry=registry)
    return registry, progress


class LoadingMetrics:
    """/metrics while the model loads: kvmesh_engine_loading 1, the load's progress and the process's metrics, so
    that Prometheus sees a starting engine (its target up) rather than a down one, and its readers leave it out
    (serving_metrics)."""

    def __init__(self) -> None:
        self.registry, self._progress = _process_registry(loading=True)

    def progress(self, ratio: float) -> None:
        """The load's progress callback (engine.LOAD_PROGRESS), called on the loading thread."""
        self._progress.set(ratio)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True)
class EngineState:
    """What the scrape-time gauges show; replaced whole after each step."""

    running: int = 0
    waiting: int = 0
    kv: KVStats = field(default_factory=lambda: KVStats(0, 0, 0, 0, 16))
    pending_prefill_tokens: int = 0
    prefill_tokens_per_second: float = 0.0
    decode_step_seconds: float = 0.0
    decode_step_cost: DecodeStepCost | None = None  # fitted over the recent decode steps (engine/step_cost.py)
    forecast: Forecast | None = None
    events_seq: int = 0
    draining: bool = False
    pinned_blocks: int = 0
    tiers: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # lower tier -> (used, evictable, free)
    lora_running: tuple[str, ...] = ()  # LoRA adapters with running requests
    lora_waiting: tuple[str, ...] = ()  # ... and with waiting ones
    loras_loaded: int = 0
    max_loras: int = 0
    lora_updated: float = 0.0  # unix time of this snapshot: vllm:lora_requests_info's value, as vLLM sets it


class _StateCollector:
    def __init__(self, state: Callable[[], EngineState], model: str, cache_dtype: str, kv_format: str,
                 weights_fingerprint: str) -> None:
        self._state = state
        self._model = model
        self._cache_dtype = cache_dtype
        self._kv_format = kv_format
        self._weights_fingerprint = weights_fingerprint

    def collect(self) -> Iterator[Metric]:
        s = self._state()
        labels = [MODEL_LABEL]
        mv = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(mv, value)
            return g

        yield gauge(V.RUNNING, "Requests in the running batch.", s.running)
        yield gauge(V.WAITING, "Requests waiting to be scheduled.", s.waiting)
        yield gauge(V.KV_USAGE, "Device KV blocks held by requests over all device blocks (0..1).", s.kv.usage)
        info = GaugeMetricFamily(V.CACHE_CONFIG, "KV cache configuration.",
                                 labels=["block_size", "num_gpu_blocks", "cache_dtype", "kv_format",
                                         "weights_fingerprint"])
        info.add_metric([str(s.kv.block_size), str(s.kv.total), self._cache_dtype, self._kv_format,
                         self._weights_fingerprint], 1)
        yield info
        blocks = GaugeMetricFamily(M.KV_BLOCKS, "KV blocks by state and tier; states sum to the tier's total.",
                                   labels=["tier", "state"])
        by_tier = {**s.tiers, "device": (s.kv.used, s.kv.evictable, s.kv.free)}
        for tier in TIERS:
            for state, count in zip(KV_BLOCK_STATES, by_tier.get(tier, (0, 0, 0)), strict=True):
                blocks.add_metric([tier, state], count)
        yield blocks
        tokens = GaugeMetricFamily(M.KV_TOKENS_USED, "KV tokens held by requests (lower tiers: by copies in "
                                   "flight), by tier.", labels=["tier"])
        for tier in TIERS:
            tokens.add_metric([tier], by_tier.get(tier, (0, 0, 0))[0] * s.kv.block_size)
        yield tokens
        yield gauge(M.KV_BLOCK_SIZE, "Tokens per KV block.", s.kv.block_size)
        yield gauge(M.QUEUED_PREFILL_TOKENS, "Uncached prompt tokens waiting or in flight.", s.pending_prefill_tokens)
        yield gauge(M.PREFILL_THROUGHPUT, "Measured prefill speed (moving average).", s.prefill_tokens_per_second)
        yield gauge(M.DECODE_STEP_SECONDS, "Measured decode step time (moving average).", s.decode_step_seconds)
        for name, value in (s.decode_step_cost or NO_STEP_COST).metrics.items():  # 0 until the batch has varied
            yield gauge(name, _STEP_COST_HELP[name], value)
        yield gauge(M.EVENTS_SEQ, "Last KV event batch number published.", s.events_seq)
        yield gauge(M.DRAINING, "1 while the engine drains.", float(s.draining))
        yield gauge(M.KV_BLOCKS_PINNED, "Blocks held for transfers.", s.pinned_blocks)
        f = s.forecast
        usage = GaugeMetricFamily(M.FORECAST_USAGE, "Forecast device KV usage at the horizon.", labels=["level"])
        for level in FORECAST_LEVELS:
            usage.add_metric([level], f.usage_quantiles.get(level, 0.0) if f else 0.0)
        yield usage
        peak = GaugeMetricFamily(M.FORECAST_PEAK, "Forecast peak device KV usage within the horizon.",
                                 labels=["level"])
        for level in FORECAST_LEVELS:
            peak.add_metric([level], f.peak_quantiles.get(level, 0.0) if f else 0.0)
        yield peak
        yield gauge(M.FORECAST_OVERLOAD, "Probability that usage passes 95 % within the horizon.",
                    f.overload_probability if f else 0.0)
        yield gauge(M.FORECAST_EXHAUSTION, "Expected seconds until the device KV pool is exhausted.",
                    f.seconds_to_exhaustion if f else float("inf"))
        yield gauge(M.FORECAST_HORIZON, "The forecast's horizon.", f.horizon_seconds if f else 0.0)
        lora = GaugeMetricFamily(V.LORA_REQUESTS_INFO, "LoRA adapters with running and waiting requests; the value "
                                 "is the time of the update.",
                                 labels=list(LORA_INFO_LABELS))
        lora.add_metric([",".join(s.lora_running), ",".join(s.lora_waiting), str(s.max_loras)], s.lora_updated)
        yield lora
        yield gauge(M.LORA_ADAPTERS_LOADED, "LoRA adapters loaded.", s.loras_loaded)


class EngineMetrics:
    """Event-driven metrics; `render()` gives the Prometheus text for /metrics."""

    def __init__(self, model: str, state: Callable[[], EngineState], cache_dtype: str = DEFAULT_KV_CACHE_DTYPE,
                 kv_format: str = "", num_speculative_tokens: int = 0, weights_fingerprint: str = "") -> None:
        self.registry, _ = _process_registry(loading=False)  # the same series as while loading, now loaded
        r = self.registry
        lm = [MODEL_LABEL]
        self._m = model
        self.warmup_gate_opened = Counter(M.WARMUP_GATE_OPENED, "How the warm-up gate opened (once per start).",
                                          ["reason"], registry=r)
        for reason in GATE_REASONS:
            self.warmup_gate_opened.labels(reason)
        self.prefix_queries = Counter(V.PREFIX_QUERIES, "Prompt tokens looked up in the prefix cache.", lm, registry=r)
        self.prefix_hits = Counter(V.PREFIX_HITS, "Prompt tokens found in the prefix cache.", lm, registry=r)
        self.preemptions = Counter(V.PREEMPTIONS, "Preemptions.", lm, registry=r)
        self.prompt_tokens = Counter(V.PROMPT_TOKENS, "Prompt tokens of admitted requests.", lm, registry=r)
        self.generation_tokens = Counter(V.GENERATION_TOKENS, "Generated tokens.", lm, registry=r)
        self.ttft = Histogram(V.TTFT, "Time to first token, on the pod that produced it.", lm,
                              buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(V.ITL, "Time between output tokens.", lm, buckets=STEP_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(V.E2E, "Request latency, arrival to finish, on the pod where it ended.", lm,
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            V.REQUEST_GENERATION_TOKENS, "Generated tokens per request.", lm, buckets=TOKEN_BUCKETS, registry=r
        )
        self.query_tokens = Counter(M.PREFIX_QUERY_TOKENS, "Prompt tokens looked up in the cache.", registry=r)
        self.hit_tokens = Counter(M.PREFIX_HIT_TOKENS, "Prompt tokens served from cache.", ["tier"], registry=r)
        self.short_queries = Counter(M.PREFIX_SHORT_QUERIES, "Prompts shorter than one block.", registry=r)
        self.continued_prompt_tokens = Counter(M.CONTINUED_PROMPT_TOKENS, "Prompt tokens of requests another pod "
                                               "started (a handoff's decode, a migrated stream).", registry=r)
        self.continued_cached_tokens = Counter(M.CONTINUED_CACHED_TOKENS, "Of those, tokens not computed here "
                                               "(pulled from the pod that started it, or cached here).", registry=r)
        self.hit_length = Histogram(M.PREFIX_HIT_LENGTH, "Cached prompt tokens per request.", buckets=TOKEN_BUCKETS,
                                    registry=r)
        self.evictions = Counter(M.EVICTIONS, "Blocks evicted, by tier and reason.", ["tier", "reason"], registry=r)
        self.preemptions_by_mode = Counter(M.PREEMPTIONS, "Preemptions by mode.", ["mode"], registry=r)
        self.queue_time = Histogram(M.QUEUE_TIME, "Arrival to first schedule.", buckets=REQUEST_LATENCY_BUCKETS,
                                    registry=r)
        self.prefill_time = Histogram(M.PREFILL_TIME, "First schedule to first token.", buckets=REQUEST_LATENCY_BUCKETS,
                                      registry=r)
        self.decode_time = Histogram(M.DECODE_TIME, "First token to finish.", buckets=REQUEST_LATENCY_BUCKETS,
                                     registry=r)
        self.tpot = Histogram(M.TPOT, "Mean time per output token after the first.", buckets=STEP_LATENCY_BUCKETS,
                              registry=r)
        self.batch_size = Histogram(M.STEP_BATCH_SIZE, "Sequences per model step.", buckets=BATCH_BUCKETS, registry=r)
        self.steps = Counter(M.STEPS, "Model steps run.", registry=r)
        self.computed_tokens = Counter(M.COMPUTED_TOKENS, "Tokens the model computed.", registry=r)
        self.requests = Counter(M.REQUESTS, "Finished requests by reason.", ["finish_reason"], registry=r)
        self.transfers = Counter(M.KV_TRANSFERS, "KV transfers by kind and outcome.", ["kind", "outcome"], registry=r)
        self.transfer_bytes = Counter(M.KV_TRANSFER_BYTES, "KV bytes moved between pods.", ["direction"],
                                      registry=r)
        self.transfer_seconds = Histogram(M.KV_TRANSFER_SECONDS, "KV transfer time.", ["kind"],
                                          buckets=STEP_LATENCY_BUCKETS, registry=r)
        self.handles_expired = Counter(M.KV_HANDLES_EXPIRED, "Handoff handles that expired unused.", registry=r)
        self.structured_requests = Counter(M.STRUCTURED_REQUESTS, "Requests with a structured output constraint.",
                                           ["kind"], registry=r)
        for kind in STRUCTURED_KINDS:
            self.structured_requests.labels(kind)
        self.structured_masks = Counter(M.STRUCTURED_MASKS, "Structured-output token masks computed.", registry=r)
        self.structured_mask_seconds = Counter(M.STRUCTURED_MASK_SECONDS, "Seconds spent computing them.",
                                               registry=r)
        self.tier_moved_blocks = Counter(M.KV_TIER_MOVED_BLOCKS, "Blocks moved between tiers.", ["move"], registry=r)
        self.tier_moved_bytes = Counter(M.KV_TIER_MOVED_BYTES, "Bytes moved between tiers.", ["move"], registry=r)
        self.tier_move_seconds = Counter(M.KV_TIER_MOVE_SECONDS, "Copy-thread seconds spent moving between tiers.",
                                         ["move"], registry=r)
        self.tier_copies = Counter(M.KV_TIER_COPIES, "Chunk copies between tiers (many blocks each).", ["move"],
                                   registry=r)
        self.tier_recovered = Counter(M.KV_TIER_RECOVERED, "Blocks a tier's file held, valid, at start.", ["tier"],
                                      registry=r)
        self.tier_decisions = Counter(M.KV_TIER_DECISIONS, "Prefixes found in a lower tier: loaded or recomputed.",
                                      ["decision"], registry=r)
        self.residency = {
            kind: Histogram(name, doc, ["tier"], buckets=RESIDENCY_BUCKETS, registry=r)
            for kind, name, doc in zip(RESIDENCY_KINDS, (M.KV_BLOCK_LIFETIME, M.KV_BLOCK_IDLE, M.KV_BLOCK_REUSE_GAP), (
                "Seconds a block stayed in a tier, stored to evicted (sampled).",
                "Seconds an evicted block had been idle (sampled).",
                "Seconds an idle cached block waited until it was used again (sampled).",
            ), strict=True)
        }
        for histogram in self.residency.values():
            for tier in TIERS:
                histogram.labels(tier)
        for move in TIER_MOVES:
            for c in (self.tier_moved_blocks, self.tier_moved_bytes, self.tier_move_seconds, self.tier_copies):
                c.labels(move)
        for decision in LOAD_DECISIONS:
            self.tier_decisions.labels(decision)
        for kind in TRANSFER_KINDS:
            self.transfer_seconds.labels(kind)
            for outcome in TRANSFER_OUTCOMES:
                self.transfers.labels(kind, outcome)
        for direction in TRANSFER_DIRECTIONS:
            self.transfer_bytes.labels(direction)
        for tier in TIERS:
            self.hit_tokens.labels(tier)
            if tier != "device":
                self.tier_recovered.labels(tier)
            for reason in EVICTION_REASONS:
                self.evictions.labels(tier, reason)
        for mode in PREEMPTION_MODES:
            self.preemptions_by_mode.labels(mode)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.spec_drafts = Counter(V.SPEC_DRAFTS, "Speculative draft runs verified.", lm, registry=r)
        self.spec_draft_tokens = Counter(V.SPEC_DRAFT_TOKENS, "Speculative draft tokens verified.", lm, registry=r)
        self.spec_accepted_tokens = Counter(V.SPEC_ACCEPTED_TOKENS, "Speculative draft tokens accepted.", lm,
                                            registry=r)
        self.spec_accepted_per_pos = Counter(V.SPEC_ACCEPTED_PER_POS, "Speculative draft tokens accepted, by draft "
                                             "position (0 = first).", [MODEL_LABEL, "position"], registry=r)
        for position in range(num_speculative_tokens):  # positions known at start: every series from 0
            self.spec_accepted_per_pos.labels(model, str(position))
        for c in (self.prefix_queries, self.prefix_hits, self.preemptions, self.prompt_tokens, self.generation_tokens,
                  self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens):
            c.labels(model)
        # the model's histograms too, so that their buckets exist (at 0) before the first request ends
        for h in (self.ttft, self.itl, self.e2e, self.request_generation_tokens):
            h.labels(model)
        r.register(_StateCollector(state, model, cache_dtype, kv_format, weights_fingerprint))

    def render(self) -> bytes:
        return generate_latest(self.registry)
