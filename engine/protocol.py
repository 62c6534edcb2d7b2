"""The contracts between kvmesh's programs (docs/contracts.md, contracts 0 to 3).

The router and the operator import this module (and the torch-free tokenizer) from the engine and nothing
else, so it must stay free of torch and of engine internals. Every fact here has this one home: request
extensions, block hashing, KV event types, metric names and the workload-class function.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, Literal

import cbor2
import xxhash
from prometheus_client import disable_created_metrics
from prometheus_client.parser import text_string_to_metric_families

# ---------------------------------------------------------------------------------------------------------
# Contract 0: request extensions and pod conventions
# ---------------------------------------------------------------------------------------------------------

WORKLOAD_HEADER = "x-kvmesh-workload"
PRIORITY_HEADER = "x-kvmesh-priority"
CACHE_SALT_FIELD = "cache_salt"
KV_TRANSFER_FIELD = "kv_transfer"
RESUME_OUTPUT_IDS_FIELD = "resume_output_ids"
# response extension (vLLM's name): each choice carries the token ids it adds, so a router that loses a pod
# mid-stream knows exactly which tokens the client has and resumes with resume_output_ids
RETURN_TOKEN_IDS_FIELD = "return_token_ids"



def sendable_length(text: str, start: int, stops: Sequence[str], include_stop_str_in_output: bool = False) -> int:
    """How much of an output's `text` a pod sends: all but a tail (after `start`, what was sent already) that could
    still grow into a stop string. A pod resuming after `resume_output_ids` takes the client to have their text up
    to here (from 0), so it sends a held-back tail itself, or drops it when the stop string completes; a router
    that sends a first token's text (a disaggregated request) sends the same much. With the request's
    `include_stop_str_in_output` nothing is held back (vLLM's rule): a stop string that completes stays in the
    output, so no text sent could be taken back."""
    if include_stop_str_in_output:
        return len(text)
    keep = len(text)
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text) - start), 0, -1):
            if text.endswith(stop[:k]):
                keep = min(keep, len(text) - k)
                break
    return keep


# Calls between kvmesh's own programs (router to engines, engine to engine, operator to pods, `kvmesh up` to its
# children) take no proxy from the environment (HTTP_PROXY and the like): a laptop's or a cluster's proxy cannot reach
# loopback or pod addresses, and without this every such call went to it. httpx clients take these keywords.
INTERNAL_HTTP_CLIENT = {"trust_env": False}
POOL_LABEL = "kvmesh.io/pool"
ROLE_LABEL = "kvmesh.io/role"
Role = Literal["prefill", "decode", "both", "router"]
ROLES: tuple[str, ...] = ("prefill", "decode", "both", "router")

DRAIN_PATH = "/v1/admin/drain"
HOST_TIER_DIR = "/dev/shm"  # the host KV tier's file by default; a pod mounts a memory-backed volume there
# POST: the operator has nothing to warm this new pod with: open its warm-up gate now (issue 5)
READY_PATH = "/v1/admin/ready"
HEALTH_WARMING = "warming"  # /health's status (503) while a new pod waits for its warm-up
HEALTH_LOADING = "loading"  # /health's status (503) while the engine loads its model (kvmesh_engine_loading 1)
# /health's and /livez's status (503) when a step has run longer than the engine's stall_timeout_seconds (a hung
# device call, a deadlock): routers move its streams elsewhere, and the liveness probe restarts the pod
HEALTH_STALLED = "stalled"
LIVENESS_PATH = "/livez"  # 200 while the process serves HTTP and its steps progress: loading, warming, draining too
# LoRA adapters at run time, as vLLM: POST {"lora_name", "lora_path"} / {"lora_name"}
LOAD_LORA_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"
TOKENIZE_PATH, DETOKENIZE_PATH = "/tokenize", "/detokenize"  # vLLM's: a prompt's ids, and ids back to text
CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"  # OpenAI's, on engine and router
MODELS_PATH = "/v1/models"  # the base model and each loaded adapter (with its parent): what the router serves by
MODEL_PATH_PREFIX = MODELS_PATH + "/"  # GET /v1/models/{model}: OpenAI's retrieve; a model id may hold "/"
LORA_FINGERPRINT_FIELD = "kvmesh_fingerprint"  # an adapter card's: its weights, as its blocks are hashed (BlockExtra)
DEFAULT_MAX_LORAS = 8  # adapters an engine holds at once: the slots it allocates at the first load
DEFAULT_MAX_NUM_SEQS = 64  # sequences an engine batches in a step; the operator's ITL sizing caps a pod's batch by it
DEFAULT_MAX_LORA_RANK = 64  # the largest rank an engine loads
# an adapter's name: a request's `model`, a label value of vllm:lora_requests_info (comma-separated lists, so no
# comma), a key in block hashes; the CRD's names are a stricter subset (DNS-like)
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$"
LORA_INFO_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")  # vllm:lora_requests_info's
KV_CONFIG_PATH = "/v1/kv/config"
KV_EVENTS_PATH = "/v1/kv/events"
KV_BLOCKS_PATH = "/v1/kv/blocks"
KV_HOT_PATH = "/v1/kv/hot"  # GET ?limit=N: the hottest cached prefix chains (warm-up, issue 5)
KV_RELEASE_PATH = "/v1/kv/release"  # POST {"handle"}: a handoff the router gave up on, unpinned before its TTL
KV_WARM_PATH = "/v1/kv/warm"  # POST {"source", "chains"}: pull those chains' missing blocks from a peer
HOT_CHAINS_DEFAULT = 16  # chains /v1/kv/hot lists and a pool warms a new pod with, unless told otherwise
HOT_CHAINS_MAX = 1024
MAX_CHAIN_BLOCKS = 100_000  # blocks one fetch or one warm-up chain may name (bounds a request's work)

# Where cached tokens came from (usage.prompt_tokens_details.kvmesh_cached_by_source).
CACHE_SOURCES: tuple[str, ...] = ("device", "host", "disk", "peer")
Tier = Literal["device", "host", "disk"]
TIERS: tuple[str, ...] = ("device", "host", "disk")

# Workload classes: a bounded set, so it can be a metric label. The header may name one of these; any other
# value is ignored and the class is derived.
WORKLOAD_CLASSES: tuple[str, ...] = ("chat-short", "chat-long", "completion-short", "completion-long")
LONG_PROMPT_TOKENS = 1024


# Prefix reuse refines a class for eviction (a conversation's later turns come back sooner and more often than
# its first): buckets of how many earlier requests opened with the same first OPENING_TOKENS tokens.
OPENING_TOKENS = 1024
PREFIX_REUSE_BUCKETS: tuple[tuple[int, str], ...] = ((0, "first"), (1, "repeat"), (3, "frequent"))


def workload_class(
    api: Literal["chat", "completion"], prompt_tokens: int, header: str | None = None
) -> str:
    """The workload class of a request, used by the forecast, eviction, the request log and the autoscaler.

    A client that knows its class says so in the `x-kvmesh-workload` header; otherwise the class follows from
    the API used (chat turns and raw completions have different output-length distributions) and whether the
    prompt is long (long prompts are documents and agents; short ones are turns).
    """
    if header and header in WORKLOAD_CLASSES:
        return header
    return f"{api}-{'long' if prompt_tokens >= LONG_PROMPT_TOKENS else 'short'}"


def eviction_class(workload: str, prefix_seen: int) -> str:
    """`workload` (one of WORKLOAD_CLASSES) refined by how many earlier requests shared the request's opening,
    `<class>/<bucket>`: one of len(WORKLOAD_CLASSES) x len(PREFIX_REUSE_BUCKETS) classes the eviction policy
    learns reuse for."""
    bucket = next(name for least, name in reversed(PREFIX_REUSE_BUCKETS) if prefix_seen >= least)
    return f"{workload}/{bucket}"


# the x-kvmesh-priority values taken: the router's request log stores them in an integer column (PostgreSQL's
# INTEGER), and a row out of it would fail the write of its whole batch, other requests' rows with it
MIN_PRIORITY, MAX_PRIORITY = -2**31, 2**31 - 1


def parse_priority(value: str | None) -> int:
    """The `x-kvmesh-priority` header as an integer (0 when absent); raises ValueError when malformed or outside
    MIN_PRIORITY to MAX_PRIORITY (shedding saturates far within)."""
    if value is None or value == "":
        return 0
    priority = int(value)
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority {priority} is outside {MIN_PRIORITY} to {MAX_PRIORITY}")
    return priority


# ---------------------------------------------------------------------------------------------------------
# Contract 1: block hashing
# ---------------------------------------------------------------------------------------------------------


class HashAlgo(StrEnum):
    """How block hashes are built. xxh3 is the fast default; sha256_cbor is vLLM's construction."""

    XXH3 = "xxh3_64"
    SHA256_CBOR = "sha256_cbor_64bit"


CACHE_DIR_ENV = "KVMESH_CACHE_DIR"  # where engines keep converted models (default ~/.cache/kvmesh)
DEFAULT_BLOCK_SIZE = 16
QUANTIZATIONS: tuple[str, ...] = ("none", "int8")  # the engine's weights and activations (engine/model/linear.py)
# how the engine stores K and V (engine/kvcache.py): auto = the model's dtype; int8 = int8 with a scale per row.
# Engines of one pool must agree: a KV transfer between two formats is refused.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "int8")
DEFAULT_KV_CACHE_DTYPE = KV_CACHE_DTYPES[0]
DEFAULT_HASH_ROOT = 0x6B766D657368  # "kvmesh" as an integer: the parent of block 0
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class BlockExtra:
    """What makes equal token runs different caches: a LoRA adapter and its weights, and the tenant's salt (first
    block only). The weights' fingerprint (LoraAdapter.fingerprint, published in the adapter's `/v1/models` card as
    LORA_FINGERPRINT_FIELD) keys an adapter's blocks with what computed them, so new weights under an old name never
    find the old weights' KV in any cache, tier or peer."""

    lora: str | None = None
    cache_salt: str | None = None
    lora_fingerprint: str | None = None  # None: hashed by the name alone (a pod that publishes no fingerprint)


def _encode_xxh3(parent: int, tokens: Sequence[int], extra: tuple[str, ...]) -> bytes:
    head = struct.pack("<QI", parent & _U64, len(tokens))
    body = struct.pack(f"<{len(tokens)}I", *tokens)
    tail = b"".join(struct.pack("<I", len(e)) + e.encode() for e in extra)
    return head + body + tail


def hash_block(
    parent: int, tokens: Sequence[int], extra: tuple[str, ...] = (), algo: HashAlgo = HashAlgo.XXH3
) -> int:
    """H(parent, token ids of the block, extra) as an unsigned 64-bit integer, stable across processes."""
    if algo is HashAlgo.XXH3:
        return xxhash.xxh3_64_intdigest(_encode_xxh3(parent, tokens, extra))
    payload = cbor2.dumps((parent, tuple(tokens), extra if extra else None))
    return int.from_bytes(hashlib.sha256(payload).digest()[-8:], "big")


NO_EXTRA = BlockExtra()


def block_extras(extra: BlockExtra, index: int) -> tuple[str, ...]:
    """The extra keys of block `index`: the LoRA adapter for every block, the salt for the first only."""
    keys: list[str] = []
    if extra.lora:
        keys.append(f"lora:{extra.lora}@{extra.lora_fingerprint}" if extra.lora_fingerprint else f"lora:{extra.lora}")
    if index == 0 and extra.cache_salt:
        keys.append(f"salt:{extra.cache_salt}")
    return tuple(keys)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    extra: BlockExtra = NO_EXTRA,
    algo: HashAlgo = HashAlgo.XXH3,
    root: int = DEFAULT_HASH_ROOT,
    start: int = 0,
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a partial last block is not hashed).

    `start` and `parent` continue a chain: hash blocks from index `start` on, given the hash of block start-1.
    """
    hashes: list[int] = []
    prev = root if parent is None else parent
    for i in range(start, len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[i * block_size : (i + 1) * block_size], block_extras(extra, i), algo)
        hashes.append(prev)
    return hashes


@dataclass(frozen=True)
class KVConfig:
    """What a pod publishes at /v1/kv/config; a router indexes only pods whose config equals its own."""

    model: str
    block_size: int
    hash_algo: str
    hash_root: int
    tokenizer_fingerprint: str
    num_device_blocks: int
    boot_id: str
    role: str = "both"
    block_bytes: int = 0  # bytes of one block, all layers (what a transfer of it moves)
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE  # as configured: auto (the model's dtype) or int8
    kv_format: str = ""  # as stored (KVLayout.stored_format): int8, bfloat16, float16 or float32
    # the base weights that compute this pod's KV (loader.weights_fingerprint: the loaded tensors and the
    # architecture); "" from an engine that does not say (older ones). Block hashes do not cover it (the router
    # hashes without knowing it): two pods with the same name and other weights cache the same hashes
    weights_fingerprint: str = ""

    def hashing(self) -> tuple[int, str, int, str]:
        """What decides which token run a block hash names: block size, algorithm, root and tokenizer."""
        return (self.block_size, self.hash_algo, self.hash_root, self.tokenizer_fingerprint)

    def compatible_with(self, other: KVConfig) -> bool:
        """Whether block hashes computed under `other` name the same token runs here. The model (name or weights)
        is not part of it: the router keeps one index per pod and filters pods by the model they serve, and pairs
        for pulls and handoffs only pods whose blocks mean the same KV (`stores_like`)."""
        return self.hashing() == other.hashing()

    def stores_like(self, other: KVConfig) -> bool:
        """Whether a block moves between the two as raw bytes (pulls, handoffs): the same stored format and size
        (two `auto` caches of a bf16 and an fp16 model have the same size, not the same bytes), computed by the
        same base weights (a pool midway through a weights change holds both, under one name and the same block
        hashes; an engine that does not say, "", is like only those that do not either: a receiving engine
        refuses blocks whose sender's weights differ from its own)."""
        return ((self.kv_format, self.block_bytes, self.weights_fingerprint)
                == (other.kv_format, other.block_bytes, other.weights_fingerprint))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> KVConfig:
        """A pod's /v1/kv/config answer, less fields this release does not know (a newer engine's, mid-roll)."""
        return cls(**_known_fields(cls, body))


def _known_fields(kind: type, body: dict[str, Any]) -> dict[str, Any]:
    """The entries of `body` that name fields of dataclass `kind`: what an older reader takes of a newer writer's
    answer (a writer adds only what a reader may leave unread)."""
    known = {f.name for f in fields(kind)}
    return {k: v for k, v in body.items() if k in known}


# ---------------------------------------------------------------------------------------------------------
# Contract 2: KV events
# ---------------------------------------------------------------------------------------------------------

EventKind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True)
class KVEvent:
    """One change to a pod's cache. `stored` carries the parent hash and token count; `cleared` may name a tier."""

    kind: EventKind
    block_hashes: tuple[int, ...] = ()
    tier: str | None = "device"
    parent_hash: int | None = None
    token_count: int = 0

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.kind, "tier": self.tier}
        if self.kind != "cleared":
            body["block_hashes"] = list(self.block_hashes)
        if self.kind == "stored":
            body["parent_hash"] = self.parent_hash
            body["token_count"] = self.token_count
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> KVEvent:
        return cls(
            kind=body["type"],
            block_hashes=tuple(body.get("block_hashes", ())),
            tier=body.get("tier"),
            parent_hash=body.get("parent_hash"),
            token_count=body.get("token_count", 0),
        )


@dataclass(frozen=True)
class KVEventBatch:
    """A line of the event stream: events under one boot id, numbered by `seq` (grows within a boot).

    A batch with `reset` set tells the reader that its resume point is gone (new boot or events dropped):
    it must forget the pod and read the /v1/kv/blocks snapshot.
    """

    boot_id: str
    seq: int
    events: tuple[KVEvent, ...] = ()
    reset: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "boot_id": self.boot_id,
            "seq": self.seq,
            "reset": self.reset,
            "events": [e.to_json() for e in self.events],
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> KVEventBatch:
        return cls(
            boot_id=body["boot_id"],
            seq=body["seq"],
            events=tuple(KVEvent.from_json(e) for e in body.get("events", ())),
            reset=body.get("reset", False),
        )


@dataclass
class KVBlocksSnapshot:
    """GET /v1/kv/blocks: every cached block hash by tier, current to sequence number `seq`."""

    boot_id: str
    seq: int
    blocks: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> KVBlocksSnapshot:
        """A pod's /v1/kv/blocks answer, less fields this release does not know (a newer engine's, mid-roll)."""
        return cls(**_known_fields(cls, body))


# ---------------------------------------------------------------------------------------------------------
# Contract 3: metric names (one home; engine, router and operator import them)
# ---------------------------------------------------------------------------------------------------------


# vLLM's label for the model an engine serves. Every vllm: series carries it except cache_config_info and
# lora_requests_info, and so do the single-valued kvmesh_ gauges of engine/metrics.py's _StateCollector (its
# gauge()); no other kvmesh_ series does (labelled families, counters, histograms, kvmesh_engine_loading)
MODEL_LABEL = "model_name"

# No counter or histogram exports a `_created` series (the Prometheus client's default): no reader uses them and
# docs/metrics.md lists none. Here, in the one module every component's metrics import (engine, router, gateway,
# operator), so that no process exports them whichever of its modules is imported first.
disable_created_metrics()


class VllmMetric:
    """Names existing gateways read; exported under vLLM's names (with its colon) for compatibility."""

    RUNNING = "vllm:num_requests_running"
    WAITING = "vllm:num_requests_waiting"
    KV_USAGE = "vllm:kv_cache_usage_perc"
    CACHE_CONFIG = "vllm:cache_config_info"
    PREFIX_QUERIES = "vllm:prefix_cache_queries"  # counter; exposed with the _total suffix
    PREFIX_HITS = "vllm:prefix_cache_hits"
    TTFT = "vllm:time_to_first_token_seconds"
    ITL = "vllm:inter_token_latency_seconds"
    E2E = "vllm:e2e_request_latency_seconds"
    PREEMPTIONS = "vllm:num_preemptions"
    PROMPT_TOKENS = "vllm:prompt_tokens"
    GENERATION_TOKENS = "vllm:generation_tokens"
    REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
    # gauge, value = the time (unix seconds) of the update; labels running_lora_adapters, waiting_lora_adapters
    # (comma-separated adapter names with running / waiting requests), max_lora: what LoRA-affinity pickers read
    LORA_REQUESTS_INFO = "vllm:lora_requests_info"
    # speculative decoding (engine/spec.py), counters with the _total suffix: draft runs verified, draft tokens
    # proposed, drafts accepted, and drafts accepted at each draft position (label position, 0 = first draft)
    SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
    SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
    SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
    SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class Metric:
    """kvmesh's own metric names (Prometheus conventions: no colons, base units, _total for counters)."""

    KV_BLOCKS = "kvmesh_kv_blocks"  # gauge; labels state (used, evictable, free), tier
    KV_TOKENS_USED = "kvmesh_kv_tokens_used"  # gauge; label tier
    KV_BLOCK_SIZE = "kvmesh_kv_block_size_tokens"
    PREFIX_QUERY_TOKENS = "kvmesh_prefix_cache_query_tokens"  # counter
    PREFIX_HIT_TOKENS = "kvmesh_prefix_cache_hit_tokens"  # counter; label tier
    PREFIX_SHORT_QUERIES = "kvmesh_prefix_cache_short_queries"  # counter: prompts shorter than one block
    PREFIX_HIT_LENGTH = "kvmesh_prefix_cache_hit_length_tokens"  # histogram per request
    # counters: the prompt tokens of requests this pod continued (they arrived with output: a handoff's decode, a
    # migrated stream), which the pod that started them counted as prompt lookups and hits; and of those, the
    # tokens this pod did not compute (pulled from that pod, or found in its own cache)
    CONTINUED_PROMPT_TOKENS = "kvmesh_continued_prompt_tokens"
    CONTINUED_CACHED_TOKENS = "kvmesh_continued_cached_tokens"
    EVICTIONS = "kvmesh_kv_evictions"  # counter; labels tier, reason
    PREEMPTIONS = "kvmesh_preemptions"  # counter; label mode (recompute, swap)
    QUEUED_PREFILL_TOKENS = "kvmesh_prefill_tokens_pending"  # gauge: uncached prompt tokens waiting or in flight
    PREFILL_THROUGHPUT = "kvmesh_prefill_throughput_tokens_per_second"  # gauge, moving average
    DECODE_STEP_SECONDS = "kvmesh_decode_step_seconds_avg"  # gauge, moving average
    # gauges, the decode step's fitted cost (DecodeStepCost), exported once the batch has varied enough to fit it
    DECODE_STEP_BASE = "kvmesh_decode_step_base_seconds"  # a step's fixed part (reading the weights)
    DECODE_STEP_PER_SEQUENCE = "kvmesh_decode_step_sequence_seconds"  # each sequence in the batch
    DECODE_STEP_PER_KV_TOKEN = "kvmesh_decode_step_kv_token_seconds"  # each KV token the step's attention reads
    QUEUE_TIME = "kvmesh_request_queue_seconds"  # histogram
    PREFILL_TIME = "kvmesh_request_prefill_seconds"  # histogram
    DECODE_TIME = "kvmesh_request_decode_seconds"  # histogram
    TPOT = "kvmesh_request_time_per_output_token_seconds"  # histogram
    STEP_BATCH_SIZE = "kvmesh_step_batch_size"  # histogram: sequences per model step
    STEPS = "kvmesh_model_steps"  # counter
    COMPUTED_TOKENS = "kvmesh_computed_tokens"  # counter: tokens the model ran (prompt and output)
    REQUESTS = "kvmesh_requests"  # counter; label finish_reason
    DRAINING = "kvmesh_draining"  # gauge 0/1
    FORECAST_USAGE = "kvmesh_kv_forecast_usage_ratio"  # gauge; label level (p50, p90, p99)
    FORECAST_PEAK = "kvmesh_kv_forecast_peak_usage_ratio"  # gauge; label level: the peak within the horizon
    FORECAST_OVERLOAD = "kvmesh_kv_forecast_overload_probability"  # gauge
    FORECAST_EXHAUSTION = "kvmesh_kv_forecast_exhaustion_seconds"  # gauge
    FORECAST_HORIZON = "kvmesh_kv_forecast_horizon_seconds"  # gauge
    EVENTS_SEQ = "kvmesh_kv_events_seq"  # gauge: last sequence number published
    KV_TRANSFERS = "kvmesh_kv_transfers"  # counter; labels kind (TRANSFER_KINDS), outcome (ok, failed)
    KV_TRANSFER_BYTES = "kvmesh_kv_transfer_bytes"  # counter; label direction (sent, received)
    KV_TRANSFER_SECONDS = "kvmesh_kv_transfer_seconds"  # histogram; label kind
    KV_HANDLES_EXPIRED = "kvmesh_kv_handles_expired"  # counter: handoff handles whose time ran out unused
    KV_BLOCKS_PINNED = "kvmesh_kv_blocks_pinned"  # gauge: blocks held for transfers (handles, sends, imports)
    STRUCTURED_REQUESTS = "kvmesh_structured_requests"  # counter; label kind (STRUCTURED_KINDS)
    STRUCTURED_MASKS = "kvmesh_structured_masks"  # counter: token masks computed (a constrained sequence a step)
    STRUCTURED_MASK_SECONDS = "kvmesh_structured_mask_seconds"  # counter: seconds spent computing them
    KV_TIER_MOVED_BLOCKS = "kvmesh_kv_tier_moved_blocks"  # counter; label move (TIER_MOVES)
    KV_TIER_MOVED_BYTES = "kvmesh_kv_tier_moved_bytes"  # counter; label move
    KV_TIER_MOVE_SECONDS = "kvmesh_kv_tier_move_seconds"  # counter: copy-thread seconds spent; label move
    KV_TIER_COPIES = "kvmesh_kv_tier_copies"  # counter: chunk copies (many blocks each); label move
    KV_TIER_RECOVERED = "kvmesh_kv_tier_recovered_blocks"  # counter: blocks found valid at start; label tier
    KV_TIER_DECISIONS = "kvmesh_kv_tier_load_decisions"  # counter: prefixes in lower tiers; label decision
    KV_BLOCK_LIFETIME = "kvmesh_kv_block_lifetime_seconds"  # histogram, sampled: stored to evicted; label tier
    KV_BLOCK_IDLE = "kvmesh_kv_block_idle_before_evict_seconds"  # histogram, sampled: last use to eviction; tier
    KV_BLOCK_REUSE_GAP = "kvmesh_kv_block_reuse_gap_seconds"  # histogram, sampled: idle until reused; label tier
    WARMUP_GATE_OPENED = "kvmesh_warmup_gate_opened"  # counter; label reason (GATE_REASONS): how /health opened
    LORA_ADAPTERS_LOADED = "kvmesh_lora_adapters_loaded"  # gauge: LoRA adapters loaded now
    # gauge, no label: 1 while the engine loads its model (its /metrics then holds this, ENGINE_LOAD_PROGRESS and
    # the process's metrics only, every other route answers 503), 0 once loaded: a starting engine, not a dead one
    ENGINE_LOADING = "kvmesh_engine_loading"
    # gauge, no label: the share (0..1) of the model's weights read so far while it loads (a GGUF converted at
    # this start: converting is the first half, loading the second), 1 once loaded: a flat one is a stuck load
    ENGINE_LOAD_PROGRESS = "kvmesh_engine_load_progress_ratio"


class RouterMetric:
    """The router's own metrics."""

    REQUESTS = "kvmesh_router_requests"  # counter; labels outcome, route, source (router/batches.REQUEST_SOURCES)
    DECISION_SECONDS = "kvmesh_router_decision_seconds"  # histogram: tokenize + hash + pick
    PREDICTED_CACHED_TOKENS = "kvmesh_router_predicted_cached_tokens"  # counter
    ACTUAL_CACHED_TOKENS = "kvmesh_router_actual_cached_tokens"  # counter (from the engines' usage)
    RETRIES = "kvmesh_router_retries"  # counter
    PULLS = "kvmesh_router_pulls"  # counter: requests sent with a prefix pull from a peer
    SHED = "kvmesh_router_shed"  # counter; labels priority (low, normal, high), source: 429s (batch: deferrals)
    MIGRATIONS = "kvmesh_router_migrations"  # counter: streams continued on another pod
    INDEX_BLOCKS = "kvmesh_router_index_blocks"  # gauge: distinct block hashes indexed
    PODS = "kvmesh_router_pods"  # gauge; label state (POD_STATES)
    DECISIONS = "kvmesh_router_decisions"  # counter; label reason (what decided the choice)
    EVENT_LAG = "kvmesh_router_kv_event_lag_batches"  # gauge; label engine: its last batch minus the index's
    # counter; labels tenant (auth.tenant_hash, never the name), reason (LIMIT_REASONS): 429s of a tenant's limits
    RATE_LIMITED = "kvmesh_router_rate_limited"
    API_KEYS_RELOADS = "kvmesh_router_api_keys_reloads"  # counter; label outcome (KEYS_RELOAD_OUTCOMES)
    BATCH_REQUESTS = "kvmesh_router_batch_requests"  # counter; label outcome (router/batches.BATCH_REQUEST_OUTCOMES)
    BATCHES = "kvmesh_router_batches"  # counter; label status (router/batches.FINAL_STATUSES): batches ended here
    BATCHES_RUNNING = "kvmesh_router_batches_running"  # gauge: batches this replica holds the lease of
    # counter; label operation (router/responses_api.STORE_OPERATIONS): stored-response reads and writes that failed
    RESPONSE_STORE_ERRORS = "kvmesh_router_response_store_errors"
    # counter; label component (router/store.DATABASE_COMPONENTS): operations on the pool's database that failed
    DATABASE_ERRORS = "kvmesh_router_database_errors"
    # counter: request log records never written (failed writes, a full buffer while the database is slow or away)
    REQUEST_LOG_DROPPED = "kvmesh_router_request_log_dropped"
    # gauge: requests held while no pod is ready (hold_without_pods_seconds: a pool starting from zero); the operator
    # sums it over router pods to scale a pool up from zero
    REQUESTS_WAITING_FOR_PODS = "kvmesh_router_requests_waiting_for_pods"


class GatewayMetric:
    """`kvmesh gateway`'s own metrics (router/gateway_app.py; label values in router/gateway.py)."""

    # counter; labels model (a name in the gateway's model table, else "unknown"), outcome (GATEWAY_OUTCOMES)
    REQUESTS = "kvmesh_gateway_requests"
    UPSTREAMS = "kvmesh_gateway_upstreams"  # gauge; label state (UPSTREAM_STATES): the pools' routers
    # counter; labels model (as REQUESTS'), router (its URL: the pools' routers are few): requests sent to a router
    # (not those it refused the connection to), whose rates by router show the weighted split of a model
    UPSTREAM_REQUESTS = "kvmesh_gateway_upstream_requests"


class OperatorMetric:
    """The operator's own metrics; labels pool_namespace, pool, role (a pool's name is the user's, one per pool)."""

    DESIRED_REPLICAS = "kvmesh_operator_desired_replicas"  # gauge
    SCALING_DECISIONS = "kvmesh_operator_scaling_decisions"  # counter; also label direction (up, down)
    PREDICTED_KV_USAGE = "kvmesh_operator_predicted_kv_usage_ratio"  # gauge: demand at the policy's level / capacity
    OVERLOAD_PROBABILITY = "kvmesh_operator_kv_overload_probability"  # gauge: P(usage > 95 %) within the horizon
    # counter; also labels action (LORA_ACTIONS), outcome (LORA_OUTCOMES): adapter loads and unloads in running engines
    LORA_ACTIONS = "kvmesh_operator_lora_actions"
    # the operator's heartbeat, per pool (labels pool_namespace, pool; no role): counter, also label outcome
    # (EVALUATION_OUTCOMES); gauges: when it last evaluated the pool (Unix seconds), its scaling.intervalSeconds
    EVALUATIONS = "kvmesh_operator_evaluations"
    LAST_EVALUATION = "kvmesh_operator_last_evaluation_timestamp_seconds"
    EVALUATION_INTERVAL = "kvmesh_operator_evaluation_interval_seconds"
    # leader election (operator/leader.py; only with --leader-elect, no labels): gauge, 1 while this process holds the
    # lease; counter, the times it took the lease
    LEADER = "kvmesh_operator_leader"
    LEADER_TRANSITIONS = "kvmesh_operator_leader_transitions"


# rate_limited: a tenant's own limits (router/limits.py), apart from errors and from sheds of an overloaded pool
ROUTER_OUTCOMES: tuple[str, ...] = ("ok", "error", "shed", "rate_limited", "no_pod", "client_gone")
RATE_LIMIT_CODE = "rate_limit_exceeded"  # the error code of a 429 for a tenant's limits, as OpenAI's
# why a tenant's request got 429 (router/limits.py): its requests or tokens per minute, its concurrent requests, or
# its share of a saturated pool (router/shed.py)
FAIR_SHARE = "fair_share"  # a tenant shed under overload while above its share of the requests in flight
LIMIT_REASONS: tuple[str, ...] = ("requests", "tokens", "concurrency", FAIR_SHARE)
KEYS_RELOAD_OUTCOMES: tuple[str, ...] = ("loaded", "refused")  # a changed API keys file: taken, or not (old stay)
GATEWAY_ROUTE = "gateway"  # requests a Gateway sent through the router's ext_proc endpoint picker
ROUTES: tuple[str, ...] = ("aggregated", "disaggregated", "retry", "migrated", GATEWAY_ROUTE)
PRIORITY_CLASSES: tuple[str, ...] = ("low", "normal", "high")
POD_STATES: tuple[str, ...] = ("healthy", "unhealthy", HEALTH_LOADING, HEALTH_WARMING, "draining", "refused")
STARTING_POD_STATES: tuple[str, ...] = (HEALTH_LOADING, HEALTH_WARMING)  # on their way to serving: not down
KV_BLOCK_STATES: tuple[str, ...] = ("used", "evictable", "free")
TRANSFER_KINDS: tuple[str, ...] = ("serve", "pull", "handoff", "warm")
TRANSFER_OUTCOMES: tuple[str, ...] = ("ok", "failed")
TRANSFER_DIRECTIONS: tuple[str, ...] = ("sent", "received")
SCALING_DIRECTIONS: tuple[str, ...] = ("up", "down")  # kvmesh_operator_scaling_decisions_total{direction}
LORA_ACTIONS: tuple[str, ...] = ("load", "unload")  # kvmesh_operator_lora_actions_total{action}
# ok: done; retry: busy, full or no answer (tried again next tick); refused: another 4xx (not tried again)
LORA_OUTCOMES: tuple[str, ...] = ("ok", "retry", "refused")
# error: a scaling evaluation that raised or could not read its inputs (the API, the pool's spec)
EVALUATION_OUTCOMES: tuple[str, ...] = ("ok", "error")
FORECAST_LEVELS: tuple[str, ...] = ("p50", "p90", "p99")
EVICTION_REASONS: tuple[str, ...] = ("capacity", "cleared", "damaged")  # damaged: failed its check at start
# promotions end in device, demotions leave it; host gets every block (write-through), disk only reused ones
TIER_MOVES: tuple[str, ...] = ("device_to_host", "device_to_disk", "host_to_disk", "host_to_device", "disk_to_device")
LOAD_DECISIONS: tuple[str, ...] = ("load", "recompute")
RESIDENCY_KINDS: tuple[str, ...] = ("lifetime", "idle", "reuse_gap")  # the three residency histograms
RESIDENCY_SAMPLE = 16  # residency is observed for one block in 16 (by hash: the same blocks in every tier)
PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap")
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")
# why a new pod's warm-up gate opened: its warm-up copied every chain, or not all; the operator had nothing to
# copy; or nobody warmed it within the grace
GATE_REASONS: tuple[str, ...] = ("warmed", "warm_failed", "nothing_to_copy", "grace_expired")
# what a structured-output request constrains its output to (engine/structured.py)
STRUCTURED_KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "grammar")
OVERLOAD_USAGE = 0.95  # the forecast's "passes 95 %" threshold


@dataclass(frozen=True)
class DecodeStepCost:
    """What a decode step costs an engine, fitted from its own steps (engine/step_cost.py): seconds = base +
    per_sequence x batch + per_kv_token x the KV tokens the batch attends to. The operator sizes decode pods
    with it so that each pod's step stays within the pool's inter-token latency objective."""

    base: float
    per_sequence: float
    per_kv_token: float

    def seconds(self, batch: float, kv_tokens: float) -> float:
        return self.base + self.per_sequence * batch + self.per_kv_token * kv_tokens

    def largest_batch(self, step_seconds: float, context_tokens: float) -> int:
        """The most sequences, each attending to `context_tokens`, whose step takes at most `step_seconds`;
        at least 1 (a slower step cannot be had by spreading the batch thinner)."""
        each = self.per_sequence + self.per_kv_token * context_tokens
        if each <= 0:
            raise ValueError(f"a sequence must cost something, got {self}")
        return max(1, math.floor((step_seconds - self.base) / each + 1e-9))

    @property
    def metrics(self) -> dict[str, float]:
        """Exposed name -> value, as the engine exports it and `read_decode_step_cost` reads it back."""
        return {Metric.DECODE_STEP_BASE: self.base, Metric.DECODE_STEP_PER_SEQUENCE: self.per_sequence,
                Metric.DECODE_STEP_PER_KV_TOKEN: self.per_kv_token}


def read_decode_step_cost(values: dict[str, float]) -> DecodeStepCost | None:
    """An engine's fitted step cost from its scraped `values` (None until it exports one)."""
    names = (Metric.DECODE_STEP_BASE, Metric.DECODE_STEP_PER_SEQUENCE, Metric.DECODE_STEP_PER_KV_TOKEN)
    if not all(n in values for n in names):
        return None
    cost = DecodeStepCost(*(values[n] for n in names))
    return cost if cost.per_sequence > 0 or cost.per_kv_token > 0 else None


class EngineLoading(Exception):
    """An engine answered /metrics while it loads its model: it is starting, not serving with no load."""


def _sample(name: str) -> re.Pattern[str]:
    """The value of an unlabelled (or singly exposed) series in a /metrics text, found by a line search."""
    return re.compile(rf"^{name}(?:\{{[^}}]*\}})?[ \t]+(\S+)", re.MULTILINE)


_LOADING_SAMPLE = _sample(Metric.ENGINE_LOADING)
_LOAD_PROGRESS_SAMPLE = _sample(Metric.ENGINE_LOAD_PROGRESS)


def serving_metrics(text: str) -> str:
    """An engine's /metrics text, or EngineLoading while its model loads (kvmesh_engine_loading 1): its readers
    (the router's scraper, the operator) leave a loading engine out, as one that does not answer, rather than
    count it as a pod with nothing running. A line search, not a parse: readers call it on every scrape."""
    found = _LOADING_SAMPLE.search(text)
    if found is not None and float(found[1]) > 0:
        raise EngineLoading("the engine is loading its model")
    return text


def load_progress(text: str) -> float | None:
    """How far a loading engine's load is (kvmesh_engine_load_progress_ratio, 0..1) from its /metrics text; None
    when it does not say (an engine of an earlier version)."""
    found = _LOAD_PROGRESS_SAMPLE.search(text)
    return float(found[1]) if found is not None else None


@dataclass(frozen=True)
class ScrapedMetrics:
    """One engine's /metrics as its readers (the router, the operator) take it: each series that is one per engine
    (no label but the model's) by its exposed name, the usage forecast by level, and the KV geometry from vLLM's
    cache-config info (None when the engine does not say). Labelled families (histogram buckets, counters by
    reason) are not in `values`: one number per name would be whichever series came last."""

    values: dict[str, float]
    forecast_usage: dict[str, float]
    num_blocks: int | None = None
    block_size: int | None = None
    cache_dtype: str | None = None  # the configured KV cache dtype (KV_CACHE_DTYPES)
    kv_format: str | None = None  # how blocks are stored (KVConfig.kv_format)
    # vllm:lora_requests_info's labels, of its newest series (vLLM keeps one per label set it has shown, valued
    # with the time it was set); None when the engine exports none
    lora_info: dict[str, str] | None = None
    forecast_peak: dict[str, float] = field(default_factory=dict)  # the peak within the horizon, by level
    weights_fingerprint: str | None = None  # the weights its KV is computed with (KVConfig.weights_fingerprint)


def read_engine_metrics(text: str) -> ScrapedMetrics:
    """Parse an engine's Prometheus text (ValueError when it is not Prometheus text). A sample that is not a
    finite number (NaN, infinity: a broken gauge) is left out, as if not exported, so that one bad engine
    cannot stop its readers' arithmetic (the operator's scaling of the whole pool)."""
    values: dict[str, float] = {}
    forecast: dict[str, float] = {}
    peak: dict[str, float] = {}
    num_blocks = block_size = None
    cache_dtype = kv_format = weights = None
    lora: tuple[float, dict[str, str]] | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not math.isfinite(sample.value):
                continue
            if sample.name in (Metric.FORECAST_USAGE, Metric.FORECAST_PEAK):
                if sample.labels.get("level") in FORECAST_LEVELS:
                    (forecast if sample.name == Metric.FORECAST_USAGE else peak)[sample.labels["level"]] = sample.value
            elif sample.name == VllmMetric.CACHE_CONFIG:
                num_blocks = int(float(sample.labels.get("num_gpu_blocks", 0)))
                block_size = int(float(sample.labels.get("block_size", DEFAULT_BLOCK_SIZE)))
                cache_dtype = sample.labels.get("cache_dtype")
                kv_format = sample.labels.get("kv_format")
                weights = sample.labels.get("weights_fingerprint")
            elif sample.name == VllmMetric.LORA_REQUESTS_INFO:
                if lora is None or sample.value >= lora[0]:
                    lora = sample.value, dict(sample.labels)
            elif set(sample.labels) <= {MODEL_LABEL}:
                values[sample.name] = sample.value
    return ScrapedMetrics(values, forecast, num_blocks, block_size, cache_dtype, kv_format,
                          lora[1] if lora is not None else None, peak, weights or None)
