"""Choosing a pod: filters, then scorers, then a picker (the shape of the Gateway API Inference Extension).

Pure functions over pod snapshots and prefix matches: no tokenizer, no HTTP, no clock. Two router replicas
given the same state choose the same pod, because candidates are ordered by name before any arithmetic and
ties are broken by rendezvous hashing (each pod's name hashed with the request's deepest block): a fixed order
per request that every replica computes alike, and that differs between requests, so equal pods share new
prefixes evenly instead of the first name taking them all.

The scores aim at the pod that answers soonest. The TTFT estimate already credits a pod's cached prefix to
this request; the prefix score adds stickiness on top (keeping a prefix's traffic together keeps the pool's
hit ratio up), so a pod holding the whole prefix keeps its traffic until its estimated TTFT is about 1.5
times another pod's (prefix weight 1 against TTFT weight 3: 1 + 3 x (t_best / t) = 3 at t = 1.5 t_best).
The TTFT estimate is a cost in seconds, as Dynamo's KV router counts one in blocks: the prefill queued ahead and
this request's uncached tokens at the pod's prefill speed, plus its decode contention (on a pod running
requests, one measured decode step, shared with theirs).

A long prefix every request shares (a system prompt) makes the TTFT of a pod without it look hopeless next to a
holder's, whatever the holders' queues: the balance guard bounds that. A holder whose load passes
`balance_factor` x the least loaded candidate's + `balance_slack` competes as if it held nothing (consistent
hashing with bounded loads, measured against the least loaded pod as AIBrix's imbalance rule does), so traffic
spreads to a pod without the prefix, which then holds it too, once the holders queue up, and never before.

LoRA adapters: only pods that serve the requested name (base model or adapter) are candidates, and a request
for an adapter prefers pods already running it (the Gateway API Inference Extension's LoRA affinity), with a
small weight: its blocks are hashed with the adapter's name and weights (each pod matched with its own weights'
hashes), so the prefix score already tells which pods cached its prefix; affinity only breaks what prefix and
load leave close.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvmesh.engine.protocol import TIERS
from kvmesh.router.index import PrefixMatch

_TTFT_FLOOR_SECONDS = 0.01  # TTFTs closer than this are the same to a client: 2 ms is not "twice" 1 ms


@dataclass(frozen=True)
class PodState:
    """A snapshot of one pod as the router sees it (from /metrics, /health, /v1/kv/config and its own counters)."""

    name: str
    url: str
    role: str = "both"
    model: str = ""  # the base model (its KV config's)
    models: frozenset[str] = frozenset()  # every name it answers to: the base model and its loaded adapters
    # its adapters' weights (adapter -> fingerprint, None where it publishes none): how it hashes their blocks
    adapter_fingerprints: Mapping[str, str | None] = field(default_factory=dict)
    adapters_active: frozenset[str] = frozenset()  # adapters with requests running or waiting there
    adapters_running: int = 0  # adapters with requests running there (what a vLLM-like engine holds in its slots)
    max_loras: int = 0  # its adapter slots (0: unknown, or no LoRA)
    healthy: bool = True
    draining: bool = False
    stale: bool = False  # metrics older than the staleness bound
    running: int = 0
    waiting: int = 0
    inflight: int = 0  # requests this router has outstanding there
    # of those, the ones sent since the pod's last /metrics read began (its running and waiting lack them yet),
    # and their uncached prompt tokens (its pending_prefill_tokens lacks them yet)
    unseen_requests: int = 0
    unseen_prefill_tokens: int = 0
    ended_requests: int = 0  # this router's requests that ended since the report counted them (it overstates)
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc
    forecast_usage_p90: float = 0.0  # kvmesh_kv_forecast_usage_ratio{level="p90"}
    overload_probability: float = 0.0
    pending_prefill_tokens: int = 0
    prefill_tokens_per_second: float = 0.0  # 0 = not measured yet
    decode_step_seconds: float = 0.0
    num_blocks: int = 0
    block_size: int = 16

    @property
    def load(self) -> int:
        """Outstanding requests: what the pod reports, corrected by what this router knows happened since (its
        requests sent, and those ended), each request counted once: one the report saw is in running or waiting,
        not again in inflight; at least this router's own in-flight count, should the report lag behind it."""
        reported = max(0, self.running + self.waiting - self.ended_requests)
        return max(reported + self.unseen_requests, self.inflight)

    @property
    def busy(self) -> bool:
        """Whether the pod is running requests, as far as the report and this router's own requests since tell."""
        return self.running > self.ended_requests or self.unseen_requests > 0

    @property
    def pending_prefill(self) -> int:
        """Prompt tokens queued for prefill: the pod's report plus what this router sent since (a burst between
        two scrapes would otherwise see the same queue at every pick)."""
        return self.pending_prefill_tokens + self.unseen_prefill_tokens


@dataclass(frozen=True)
class RequestInfo:
    """What the picker knows of a request: its model, its size and its prompt's block hashes (contract 1)."""

    model: str
    prompt_tokens: int
    block_hashes: tuple[int, ...]  # for an adapter, as hashed with the first of `lora_hashes`' fingerprints
    priority: int = 0
    lora: str | None = None  # `model` names a LoRA adapter (its blocks are hashed with it)
    # an adapter's block hashes per fingerprint of its weights among the pods serving it: one entry in steady state,
    # more while pods are moved to new weights under the name
    lora_hashes: Mapping[str | None, tuple[int, ...]] = field(default_factory=dict)

    def hashes_for(self, pod: PodState) -> tuple[int, ...] | None:
        """The prompt's block hashes as `pod` hashes them: with its weights of the adapter; `block_hashes` for a
        base-model request or a pod not serving the adapter (only a pull source: it holds what it was sent);
        None where the pod serves the adapter with weights this request was not hashed with (loaded since)."""
        if self.lora is None or self.lora not in pod.adapter_fingerprints:
            return self.block_hashes
        return self.lora_hashes.get(pod.adapter_fingerprints[self.lora])


def _default_tier_weights() -> dict[str, float]:
    return {"device": 1.0, "host": 0.8, "disk": 0.5}


@dataclass(frozen=True)
class PickerConfig:
    """Weights and thresholds. The field names are the keys of the router config's `weights` section."""

    prefix_weight: float = 1.0
    kv_weight: float = 1.0
    load_weight: float = 1.0
    ttft_weight: float = 3.0
    lora_weight: float = 0.5  # adapter affinity: less than a tenth of the others together
    tier_weights: dict[str, float] = field(default_factory=_default_tier_weights)  # a hit's worth by tier
    kv_penalty_threshold: float = 0.8  # PreServe: route away from pods predicted above 80 %
    saturation_usage: float = 0.98  # a pod at or above this KV usage (current or p90 forecast) is saturated...
    max_waiting: int = 64  # ...as is one with this many waiting requests
    balance_factor: float = 2.0  # a pod whose load exceeds factor x the least loaded candidate's load
    balance_slack: int = 4  # (+ slack) is not chosen for its prefix
    default_prefill_tokens_per_second: float = 2000.0  # for a pod that has not measured it yet

    def __post_init__(self) -> None:
        # the tiers given override the defaults, the others keep theirs: {host: 0.5} must not make device hits
        # worth nothing
        object.__setattr__(self, "tier_weights", {**_default_tier_weights(), **self.tier_weights})

    def weight(self, scorer: str) -> float:
        return float(getattr(self, f"{scorer}_weight"))

    @classmethod
    def from_weights(cls, weights: Mapping[str, Any]) -> PickerConfig:
        """The config a router's `weights` section asks for, checked: ValueError naming an unknown key (with the
        nearest valid one), an unknown tier, or a value of the wrong kind or range, so a typo stops the router at
        its config check rather than as it builds the picker, or silently."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in weights:
            if key not in fields:
                raise ValueError(f"unknown picker weight {key!r}{_did_you_mean(key, fields)}; valid keys: "
                                 f"{', '.join(sorted(fields))}")
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for key, value in weights.items():
            if key == "tier_weights":
                values[key] = _tier_weights(value)
            else:
                values[key] = _number(f"weights.{key}", value, hints[key] is int)
        config = cls(**values)
        config.check()
        return config

    def check(self) -> None:
        """ValueError for a value outside its meaningful range."""
        for name in ("prefix_weight", "kv_weight", "load_weight", "ttft_weight", "lora_weight", "balance_slack"):
            if getattr(self, name) < 0:
                raise ValueError(f"weights.{name} must be at least 0, not {getattr(self, name)}")
        for name in ("kv_penalty_threshold", "saturation_usage"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"weights.{name} must be in [0, 1], not {getattr(self, name)}")
        if self.max_waiting < 1:
            raise ValueError(f"weights.max_waiting must be at least 1, not {self.max_waiting}")
        if self.balance_factor < 1:
            raise ValueError(f"weights.balance_factor must be at least 1 (the least loaded pod is never over "
                             f"the bound), not {self.balance_factor}")
        if self.default_prefill_tokens_per_second <= 0:
            raise ValueError(f"weights.default_prefill_tokens_per_second must be above 0, not "
                             f"{self.default_prefill_tokens_per_second}")


def _did_you_mean(key: str, known: Mapping[str, object]) -> str:
    """' (did you mean 'x'?)' for the nearest known name, '' when none is near."""
    near = f"{key}_weight" if f"{key}_weight" in known else next(iter(difflib.get_close_matches(key, known, 1)), None)
    return f" (did you mean {near!r}?)" if near else ""


def _number(what: str, value: Any, whole: bool) -> float | int:
    """`value` as the number a field wants (a YAML 1 is a fine 1.0; true is no number)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or (whole and not isinstance(value, int)):
        raise ValueError(f"{what} must be {'a whole number' if whole else 'a number'}, not {value!r}")
    return int(value) if whole else float(value)


def _tier_weights(value: Any) -> dict[str, float]:
    """A `tier_weights` mapping, checked: known tiers, numbers from 0 to 1 (a hit is worth at most a computed
    block's saving)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"weights.tier_weights must be a mapping of tier to weight ({', '.join(TIERS)}), "
                         f"not {value!r}")
    out = {}
    for tier, weight in value.items():
        if tier not in TIERS:
            hint = _did_you_mean(str(tier), dict.fromkeys(TIERS))
            raise ValueError(f"weights.tier_weights: unknown tier {tier!r}{hint}; tiers: {', '.join(TIERS)}")
        out[tier] = _number(f"weights.tier_weights.{tier}", weight, whole=False)
        if not 0 <= out[tier] <= 1:
            raise ValueError(f"weights.tier_weights.{tier} must be in [0, 1], not {weight}")
    return out


@dataclass(frozen=True)
class Decision:
    """The picker's answer, with what the logs, metrics and the caller's load shedding need."""

    pod: PodState | None  # None: no candidate (all filtered out)
    scores: dict[str, float]  # final score per candidate pod name
    predicted_cached_tokens: int  # what the chosen pod should report as cached_tokens
    estimated_ttft_seconds: float  # for the chosen pod; 0.0 when there is none
    reason: str  # what decided (one of REASONS): for logs and the decisions metric
    runners_up: tuple[str, ...] = ()  # the other candidates, best first: where a gateway falls back to


@dataclass(frozen=True)
class Context:
    """What a filter or scorer may read besides the candidates."""

    request: RequestInfo
    matches: Mapping[str, PrefixMatch]
    config: PickerConfig
    roles: tuple[str, ...]


Filter = Callable[[list[PodState], Context], list[PodState]]
Scorer = Callable[[list[PodState], Context], list[float]]  # one score per candidate, in the candidates' order

# ---- estimates -----------------------------------------------------------------------------------------------


def predicted_cached_tokens(pod: PodState, request: RequestInfo, match: PrefixMatch | None) -> int:
    """Prompt tokens `pod` will not compute: its consecutive hit blocks, short of the last prompt token, which
    the engine always computes (so at most prompt_tokens - 1, rounded down to a block)."""
    usable_blocks = max(0, request.prompt_tokens - 1) // pod.block_size
    return min(match.blocks if match else 0, usable_blocks) * pod.block_size


def estimate_ttft(pod: PodState, request: RequestInfo, cached_tokens: int, config: PickerConfig) -> float:
    """Seconds to the first token on `pod`: the prefill queued before this request (the pod's report and what
    this router sent since), then its own uncached part, both at the pod's measured prefill speed (DistServe's
    and Mooncake's TTFT model); plus, on a pod running requests, their decode contention: the prefill shares a
    step with their decoding, one measured decode step (which grows with the batch). One step, not one per
    running request: a batching engine decodes them together, and a step per request would rate a holder of a
    long shared prefix, running a few, below a pod that must compute the prefix. Longer queues are the load
    scorer's and the balance guard's (Dynamo's KV router adds the pod's decode load to its prefill cost alike)."""
    speed = pod.prefill_tokens_per_second or config.default_prefill_tokens_per_second
    prefill = (pod.pending_prefill + max(0, request.prompt_tokens - cached_tokens)) / speed
    return prefill + (pod.decode_step_seconds if pod.busy else 0.0)


def _kv_pressure(pod: PodState) -> float:
    """The usage that matters: now, or where the pod's own forecast says it is heading, whichever is higher."""
    return max(pod.kv_usage, pod.forecast_usage_p90)


# ---- filters: each keeps the pods that may take the request --------------------------------------------------


def available(pods: list[PodState], ctx: Context) -> list[PodState]:
    """Healthy, not draining, and with fresh metrics (a pod we cannot see is not one to send to)."""
    return [p for p in pods if p.healthy and not p.draining and not p.stale]


def serves_model(pods: list[PodState], ctx: Context) -> list[PodState]:
    """Serves the requested model, base or adapter (a request naming none may go to any pod)."""
    model = ctx.request.model
    return [p for p in pods if not model or model in p.models or p.model == model]


def has_role(pods: list[PodState], ctx: Context) -> list[PodState]:
    """Plays a role this step needs (aggregated: both; disaggregated: prefill or decode)."""
    return [p for p in pods if p.role in ctx.roles]


def not_saturated(pods: list[PodState], ctx: Context) -> list[PodState]:
    """Drops pods at the edge of their KV or queue. When every pod is there, keeps them all: refusing is the
    caller's call (it sheds by priority), not the picker's."""
    c = ctx.config
    kept = [p for p in pods if _kv_pressure(p) < c.saturation_usage and p.waiting < c.max_waiting]
    return kept or pods


FILTERS: tuple[Filter, ...] = (available, serves_model, has_role, not_saturated)

# ---- scorers: each 0..1 per candidate, higher is better ------------------------------------------------------
# A scorer runs for every pod on every request: plain loops over the candidates, lists rather than dicts.


def prefix_score(pods: list[PodState], ctx: Context) -> list[float]:
    """The share of the request's blocks a pod holds as a consecutive prefix, each block weighted by the tier it
    would be served from (a device hit is worth more than one that must come back from disk)."""
    total = len(ctx.request.block_hashes)
    matches = ctx.matches
    if not total or not matches:
        return [0.0] * len(pods)
    weights = ctx.config.tier_weights
    scores = []
    for p in pods:
        match = matches.get(p.name)
        if match is None:
            scores.append(0.0)
            continue
        held = 0.0
        for tier, n in match.by_tier.items():
            if n:
                held += weights.get(tier, 0.0) * n
        scores.append(min(1.0, held / total))
    return scores


def kv_score(pods: list[PodState], ctx: Context) -> list[float]:
    """KV headroom, 1 - max(current, p90 forecast). Above the threshold the share of the way from threshold to
    full is taken off too, so a pod forecast past it scores near zero (PreServe routes away from those)."""
    threshold = ctx.config.kv_penalty_threshold
    span = max(1.0 - threshold, 1e-9)
    scores = []
    for p in pods:
        usage = _kv_pressure(p)
        penalty = (usage - threshold) / span if usage > threshold else 0.0
        scores.append(min(1.0, max(0.0, 1.0 - usage - penalty)))
    return scores


def load_score(pods: list[PodState], ctx: Context) -> list[float]:
    """Fewer outstanding requests is better, relative to the least loaded candidate (which scores 1)."""
    loads = [p.load for p in pods]
    least = min(loads) + 1
    return [least / (load + 1) for load in loads]


def ttft_score(pods: list[PodState], ctx: Context) -> list[float]:
    """A lower estimated TTFT is better, relative to the best candidate (which scores 1): relative to the best
    rather than the worst, so one hopeless pod does not flatten the differences among the good ones."""
    request, config, matches = ctx.request, ctx.config, ctx.matches
    estimates = [estimate_ttft(p, request, predicted_cached_tokens(p, request, matches.get(p.name)), config)
                 for p in pods]
    best = min(estimates) + _TTFT_FLOOR_SECONDS
    return [best / (t + _TTFT_FLOOR_SECONDS) for t in estimates]


def lora_score(pods: list[PodState], ctx: Context) -> list[float]:
    """For a request for an adapter: 1 where the adapter has requests running or waiting already (they batch
    together), 0.5 where an adapter slot is free, 0 where every slot runs other adapters (an engine that swaps
    adapters, as vLLM does, would have to wait for one). 0 for base-model requests, which every pod serves alike."""
    adapter = ctx.request.lora
    if adapter is None:
        return [0.0] * len(pods)
    return [1.0 if adapter in p.adapters_active else 0.5 if p.adapters_running < p.max_loras else 0.0 for p in pods]


SCORERS: dict[str, Scorer] = {"prefix": prefix_score, "kv": kv_score, "load": load_score, "ttft": ttft_score,
                              "lora": lora_score}

REASONS: tuple[str, ...] = ("no-candidates", "only-candidate", "balance", "tie", *SCORERS)

# ---- the picker ----------------------------------------------------------------------------------------------


def balance_bound(pods: list[PodState], config: PickerConfig) -> float:
    """The most load a pod may carry and still be chosen for its prefix: factor x the least loaded candidate's
    load + slack. Against the least loaded, not a mean: when the holders of a shared prefix are most of the pool,
    a mean rises with them and is never passed, and the pods without it would idle for good."""
    return config.balance_factor * min(p.load for p in pods) + config.balance_slack


def overloaded_holders(pods: list[PodState], config: PickerConfig) -> set[str]:
    """The balance guard: pods loaded past `balance_bound`. They compete as if they held no prefix, so a popular
    prefix spreads to another pod once its holders queue up, and stays on them while they do not."""
    if len(pods) < 2:
        return set()
    bound = balance_bound(pods, config)
    return {p.name for p in pods if p.load > bound}


def _score(pods: list[PodState], ctx: Context) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Weighted totals per pod, and each scorer's weighted part per candidate (to tell which one decided)."""
    weighted = {}
    for name, scorer in SCORERS.items():
        weight = ctx.config.weight(name)
        weighted[name] = [weight * score for score in scorer(pods, ctx)]
    totals = {p.name: sum(parts) for p, parts in zip(pods, zip(*weighted.values(), strict=True), strict=True)}
    return totals, weighted


def _tie_rank(request: RequestInfo, name: str) -> int:
    """Rendezvous hashing: a pod's rank among equals for this request, the same in every replica."""
    key = request.block_hashes[-1] if request.block_hashes else request.prompt_tokens
    return xxhash.xxh3_64_intdigest(f"{key}/{name}".encode())


def _best(pods: list[PodState], totals: Mapping[str, float], request: RequestInfo) -> list[PodState]:
    """Candidates from best to worst; the pods tied for best in the request's rendezvous order (see the module
    doc), the others by score, then name (hashing every name costs, and only the choice is spread)."""
    ranked = sorted(pods, key=lambda p: -totals[p.name])  # stable: name order among equals
    best = totals[ranked[0].name]
    tied = next((i for i, p in enumerate(ranked) if totals[p.name] != best), len(ranked))
    if tied > 1:
        ranked[:tied] = sorted(ranked[:tied], key=lambda p: (_tie_rank(request, p.name), p.name))
    return ranked


def _deciding_score(
    candidates: list[PodState],
    chosen: PodState,
    runner_up: PodState,
    weighted: Mapping[str, Sequence[float]],
    request: RequestInfo,
    matches: Mapping[str, PrefixMatch],
) -> str:
    """The scorer with the largest weighted lead of the chosen pod over the runner-up (`weighted`: per scorer,
    per candidate). A TTFT lead that comes with a longer cached prefix is the prefix's doing, and is reported
    as such."""
    i, j = candidates.index(chosen), candidates.index(runner_up)
    reason = max(SCORERS, key=lambda name: weighted[name][i] - weighted[name][j])
    cached, other = (predicted_cached_tokens(p, request, matches.get(p.name)) for p in (chosen, runner_up))
    return "prefix" if reason == "ttft" and cached > other else reason


def pick(
    request: RequestInfo,
    pods: Sequence[PodState],
    matches: Mapping[str, PrefixMatch],
    config: PickerConfig = PickerConfig(),
    roles: tuple[str, ...] = ("both",),
) -> Decision:
    """Filter, score, guard and choose the pod for `request`."""
    ctx = Context(request, matches, config, roles)
    candidates = sorted(pods, key=lambda p: p.name)
    for keep in FILTERS:
        candidates = keep(candidates, ctx)
    if not candidates:
        return Decision(None, {}, 0, 0.0, "no-candidates")

    guarded = overloaded_holders(candidates, config) & matches.keys()
    fair = Context(request, {k: m for k, m in matches.items() if k not in guarded}, config, roles) if guarded else ctx
    totals, weighted = _score(candidates, fair)
    ranking = _best(candidates, totals, request)
    chosen = ranking[0]

    if len(ranking) == 1:
        reason = "only-candidate"
    elif guarded and _best(candidates, _score(candidates, ctx)[0], request)[0].name != chosen.name:
        reason = "balance"
    elif totals[chosen.name] == totals[ranking[1].name]:
        reason = "tie"
    else:
        reason = _deciding_score(candidates, chosen, ranking[1], weighted, request, matches)

    cached = predicted_cached_tokens(chosen, request, matches.get(chosen.name))
    return Decision(chosen, totals, cached, estimate_ttft(chosen, request, cached, config), reason,
                    tuple(p.name for p in ranking[1:]))
