"""Per-tenant rate limits: requests and tokens per minute, and concurrent requests, as token buckets.

A bucket holds one minute's worth and refills continuously, so a tenant that spent its minute waits only for what
its next request needs, never for a window to roll over (Envoy's and OpenAI's limits work this way). Prompt tokens
are charged once the router has tokenized an admitted request (it does anyway); output tokens when its usage comes back,
so tokens per minute stay honest for long answers: that charge may take the bucket below zero, and the tenant's
next requests wait until it has refilled. Each router replica enforces its own buckets, a share of each limit
(`rate_limit_replicas`, or split by demand: router/limit_sync.py).
A tenant's Batch API requests have buckets of their own (`Limiter.batch`), BATCH_RATE_SHARE of each limit by
default: a big batch waits on its own buckets and never spends the limits of the tenant's interactive requests.
Pure: every bucket operation takes the time, and the Limiter reads the clock it is given.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from kvmesh.engine.protocol import LIMIT_REASONS, MAX_PRIORITY, MIN_PRIORITY
from kvmesh.router.auth import DEFAULT_TENANT

MIN_PER_MINUTE = 1.0  # the least a replica's share of a rate may be: one request (or token) a minute
BATCH_RATE_SHARE = 0.5  # the fraction of each of a tenant's limits its Batch API requests get, beside its own
DEFAULTS_ENTRY = DEFAULT_TENANT  # the `tenants:` entry whose limits apply to tenants without one of their own
SHOULD_RETRY_HEADER = "x-should-retry"  # "false": OpenAI's SDKs do not retry the answer (they read it first)
RATE_LIMIT_HEADERS = ("x-ratelimit-limit-{}", "x-ratelimit-remaining-{}", "x-ratelimit-reset-{}")


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits, or one replica's part of them; None is unlimited. `weight` is its share of a saturated
    pool (router/shed.py). Configured limits are checked by `parse_tenants`; a part may hold no concurrent request.

    `max_priority` is the highest `x-kvmesh-priority` the tenant's requests get (a higher one is lowered to it: the
    header is the client's own word, and the engines' queues and the router's shedding obey it), and
    `trust_workload_header` whether its `x-kvmesh-workload` is taken (else the class is derived from the request),
    and `read_pool_status` whether its key reads the pool's document (GET /kvmesh/pool: every engine's load, so
    the other tenants' traffic); None for any: the router's default (`Router.priority_ceiling`,
    `Router.trusts_workload`, `Router.reads_pool_status`), which trusts the client only when the router has no API
    keys (every client is then one tenant: nobody to protect from whom)."""

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrent_requests: int | None = None
    weight: float = 1.0
    max_priority: int | None = None
    trust_workload_header: bool | None = None
    read_pool_status: bool | None = None

    def share(self, fraction: float) -> TenantLimits:
        """This fraction of the limits: what one replica enforces when the replicas split them evenly. A rate is never
        under MIN_PER_MINUTE (a request must be able to pass); a concurrent-request limit rounds up (one request
        always fits)."""
        def part(rate: float | None) -> float | None:
            return None if rate is None else max(rate * fraction, MIN_PER_MINUTE)

        concurrent = self.max_concurrent_requests
        return replace(self, requests_per_minute=part(self.requests_per_minute),
                       tokens_per_minute=part(self.tokens_per_minute),
                       max_concurrent_requests=None if concurrent is None else max(math.ceil(concurrent * fraction),
                                                                                   1))

    def split(self, fractions: Mapping[str, float]) -> dict[str, TenantLimits]:
        """The parts of the limits for parts taking these `fractions` of them (adding up to 1): the router replicas
        splitting a tenant's limits by demand (router/limit_sync.py). Rates divide as `share`; concurrent requests
        are whole, so they are apportioned (`apportion`) and add up to the limit exactly."""
        concurrent = self.max_concurrent_requests
        seats = None if concurrent is None else apportion(concurrent, fractions)
        return {name: replace(self.share(fraction), max_concurrent_requests=None if seats is None else seats[name])
                for name, fraction in fractions.items()}


def apportion(total: int, fractions: Mapping[str, float]) -> dict[str, int]:
    """`total` whole seats split by `fractions` (adding up to 1) with the largest-remainder method: each part gets
    the whole part of its quota, and the seats left go to the largest remainders, a tie to the larger fraction
    (the replica with more demand), then to the first name, so that every replica computes the same split. The
    parts add up to `total` exactly, so a part whose quota is under one may get none."""
    quotas = {name: total * fraction for name, fraction in fractions.items()}
    seats = {name: math.floor(quota) for name, quota in quotas.items()}
    left = max(total - sum(seats.values()), 0)
    for name in sorted(fractions, key=lambda n: (seats[n] - quotas[n], -fractions[n], n))[:left]:
        seats[name] += 1
    return seats


LIMIT_FIELDS = tuple(f.name for f in fields(TenantLimits))


@dataclass(frozen=True)
class LimitTable:
    """The limits of every tenant: its own entry's fields, over the `default` entry's, over unlimited."""

    default: TenantLimits = TenantLimits()
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", MappingProxyType(dict(self.tenants)))

    def of(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.default)


def parse_tenants(raw: Any, where: str = "tenants") -> LimitTable:
    """`{"default": {...}, "acme": {...}}` from the router's config; ValueError saying what is wrong and where.

    A tenant's entry overrides the fields it names of the `default` entry; null sets a limit off for that tenant.
    """
    if raw is None:
        return LimitTable()
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must map tenant names to their limits, not {type(raw).__name__}")
    base: dict[str, Any] = {}
    entries: dict[str, dict[str, Any]] = {}
    for name, entry in raw.items():
        here = f"{where}.{name}"
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}: tenant names must be non-empty strings, not {name!r}")
        if not isinstance(entry, Mapping):
            raise ValueError(f"{here} must be a mapping of limits ({', '.join(LIMIT_FIELDS)})")
        if unknown := sorted(set(entry) - set(LIMIT_FIELDS)):
            raise ValueError(f"{here}: unknown fields {unknown}; allowed: {', '.join(LIMIT_FIELDS)}")
        (base if name == DEFAULTS_ENTRY else entries.setdefault(name, {})).update(entry)
    try:
        default = _checked(base)
    except ValueError as exc:
        raise ValueError(f"{where}.{DEFAULTS_ENTRY}: {exc}") from None
    tenants = {}
    for name, entry in entries.items():
        try:
            tenants[name] = _checked({**base, **entry})
        except ValueError as exc:
            raise ValueError(f"{where}.{name}: {exc}") from None
    return LimitTable(default, tenants)


def _checked(entry: Mapping[str, Any]) -> TenantLimits:
    """One tenant's configured limits; ValueError naming the field that is wrong. `max_priority: null` lifts the
    ceiling (MAX_PRIORITY); left out, the router's default applies."""
    entry = dict(entry)
    if "max_priority" in entry:
        ceiling = entry["max_priority"]
        if ceiling is None:
            entry["max_priority"] = MAX_PRIORITY
        elif isinstance(ceiling, bool) or not isinstance(ceiling, int) or not MIN_PRIORITY <= ceiling <= MAX_PRIORITY:
            raise ValueError(f"max_priority must be a whole number from {MIN_PRIORITY} to {MAX_PRIORITY} or null (no "
                             f"ceiling), not {ceiling!r}")
    for trust in ("trust_workload_header", "read_pool_status"):
        if trust in entry and not isinstance(entry[trust], bool):
            raise ValueError(f"{trust} must be true or false, not {entry[trust]!r}")
    for name, nullable in (("requests_per_minute", True), ("tokens_per_minute", True), ("weight", False)):
        value = entry.get(name)
        if name not in entry or (value is None and nullable):
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive number{' or null' if nullable else ''}, not "
                             f"{'null' if value is None else repr(value)}")
    concurrent = entry.get("max_concurrent_requests")
    if concurrent is not None and (isinstance(concurrent, bool) or not isinstance(concurrent, int) or concurrent < 1):
        raise ValueError(f"max_concurrent_requests must be a whole number of at least 1 or null, not {concurrent!r}")
    return TenantLimits(**entry)


def unkeyed_tenants(table: LimitTable, known: set[str]) -> list[str]:
    """The tenants with limits of their own that no API key names (a misspelt name, or a team whose last key was
    revoked): their limits are unused, which the router says."""
    return sorted(set(table.tenants) - known)


@dataclass
class TokenBucket:
    """`per_minute` units a minute, holding at most one minute's worth; `level` below zero is debt."""

    per_minute: float
    level: float
    updated: float

    @classmethod
    def full(cls, per_minute: float, now: float) -> TokenBucket:
        return cls(per_minute, per_minute, now)

    def available(self, now: float) -> float:
        self.level = min(self.per_minute, self.level + max(now - self.updated, 0.0) * self.per_minute / 60.0)
        self.updated = max(now, self.updated)
        return self.level

    def take(self, amount: float, now: float) -> bool:
        """Take `amount` if the bucket holds it; otherwise take nothing."""
        if self.available(now) < amount:
            return False
        self.level -= amount
        return True

    def charge(self, amount: float, now: float) -> None:
        """Take `amount` whatever the bucket holds (spent already: output tokens), going into debt if need be."""
        self.level = self.available(now) - amount

    def wait_seconds(self, amount: float, now: float) -> float:
        """Until the bucket holds `amount` (infinite when it never can: more than a minute's worth)."""
        if amount > self.per_minute:
            return math.inf
        return max(amount - self.available(now), 0.0) * 60.0 / self.per_minute

    def reset_seconds(self, now: float) -> float:
        """Until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        return self.wait_seconds(self.per_minute, now)


@dataclass(frozen=True)
class Refusal:
    """A request over its tenant's limits: the 429's message, its headers (Retry-After unless waiting cannot help)
    and why (one of LIMIT_REASONS)."""

    reason: str
    message: str
    headers: Mapping[str, str]


class Lease:
    """One admitted request's hold on its tenant's limits. `close` gives the concurrency slot back and charges the
    output tokens, exactly once, however the request ended: each edge closes it where a request's handling ends,
    in a `finally` (router/app.py `serve` and a stream's relay, router/extproc.py's stream), so no slot waits for
    the garbage collector. `headers` are the x-ratelimit-* values at admission (its prompt's tokens taken)."""

    def __init__(self, limiter: Limiter, tenant: str, headers: Mapping[str, str]) -> None:
        self.tenant, self.headers, self._limiter = tenant, MappingProxyType(dict(headers)), limiter
        self.closed = False

    def take_prompt(self, prompt_tokens: int) -> Refusal | None:
        """Charge the prompt tokens of a request `Limiter.open` admitted, once counted, or the refusal of a prompt
        over the tenant's tokens per minute; the headers then say what the prompt left. A refused request keeps its
        request (OpenAI counts refused requests against the limit too); its caller closes the lease."""
        refusal = self._limiter.take_prompt(self.tenant, prompt_tokens)
        if refusal is None:
            self.headers = MappingProxyType(self._limiter.headers(self.tenant))
        return refusal

    def close(self, spent_tokens: int = 0) -> None:
        """`spent_tokens`: those the request used beyond the prompt charged at admission (its output, and the other
        prompts of a several-prompt completion), charged even into debt. Later closes do nothing."""
        if not self.closed:
            self.closed = True
            self._limiter.release(self.tenant, spent_tokens)


@dataclass
class _Buckets:
    requests: TokenBucket | None
    tokens: TokenBucket | None


class Limiter:
    """The tenants' buckets and in-flight counts on this router replica. A completion is admitted by `open` before
    its body is parsed (one request and a concurrency slot, held while the router tokenizes it), its prompt tokens
    taken by `Lease.take_prompt` once counted; the router's own calls by `take` (all or nothing); `Lease.close`
    when the request ends.

    `batch` is the limiter of the tenants' Batch API requests: `batch_share` of each limit, in buckets, counts and
    demand of its own (its own `batch` is itself), so that a batch never holds back the tenant's interactive
    requests; together the two admit up to 1 + batch_share of the tenant's limits."""

    def __init__(self, table: LimitTable | None = None, replicas: int = 1,
                 clock: Callable[[], float] = time.monotonic, batch_share: float = BATCH_RATE_SHARE, *,
                 batch: bool = False) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"rate_limit_replicas must be a whole number of at least 1, not {replicas!r}")
        if isinstance(batch_share, bool) or not isinstance(batch_share, int | float) or not 0 < batch_share <= 1:
            raise ValueError(f"batch_rate_share must be a number above 0 and at most 1, not {batch_share!r}")
        self.table, self.replicas, self.clock = table or LimitTable(), replicas, clock
        self.scale = batch_share if batch else 1.0  # of each limit
        self.batch: Limiter = self if batch else Limiter(table, replicas, clock, batch_share, batch=True)
        self.inflight: dict[str, int] = {}  # admitted requests not yet ended, per tenant (fair sharing reads it)
        self.demand: dict[str, float] = {}  # requests asked for per tenant since router/limit_sync.py last read it
        self._buckets: dict[str, _Buckets] = {}
        # what this replica enforces, per `tenants:` entry: worked out once, read on every request
        self._default = self.table.default.share(self.scale / replicas)
        self._here = {name: limits.share(self.scale / replicas) for name, limits in self.table.tenants.items()}
        self._shared: dict[str, TenantLimits] = {}  # by demand, when the replicas share a database (set_shares)
        if not batch:  # a batch's share under one a minute is raised to one (`share`): it waits, it is never refused
            _check_rates(self.table, replicas)

    def limits(self, tenant: str) -> TenantLimits:
        """What this replica enforces for `tenant`."""
        return self._shared.get(tenant) or self._here.get(tenant, self._default)

    def set_shares(self, shares: Mapping[str, Mapping[str, float]], mine: str) -> None:
        """Enforce replica `mine`'s part of the tenants' whole limits from now on, split by these fractions per tenant
        and replica (the replicas split each tenant's limits by where its requests arrive: router/limit_sync.py); a
        tenant not named goes back to the even split. Each bucket keeps how full it is, as a fraction, so a share
        that grows does not hand out a burst."""
        now = self.clock()
        self._shared = {tenant: self.table.of(tenant).share(self.scale).split(fractions)[mine]
                        for tenant, fractions in shares.items()}
        for tenant, buckets in self._buckets.items():
            limits = self.limits(tenant)
            for bucket, rate in ((buckets.requests, limits.requests_per_minute),
                                 (buckets.tokens, limits.tokens_per_minute)):
                if bucket is not None and rate is not None:
                    bucket.level = bucket.available(now) * rate / bucket.per_minute
                    bucket.per_minute = rate

    def retain(self, tenants: Iterable[str]) -> None:
        """Forget the buckets and demand of every tenant not in `tenants` (those with an API key after a keys
        reload), in both lanes: a router whose keys rotate for months must not hold every tenant it ever served. A
        tenant with requests in flight keeps its buckets (its requests end under them, and a batch still in its turn
        sends its next lines under them, not under fresh ones) until a later reload finds none in flight."""
        kept = frozenset(tenants)
        for lane in (self, self.batch):
            lane.demand = {tenant: asked for tenant, asked in lane.demand.items() if tenant in kept}
            lane._buckets = {tenant: buckets for tenant, buckets in lane._buckets.items()
                             if tenant in kept or tenant in lane.inflight}

    def weight(self, tenant: str) -> float:
        return self.table.of(tenant).weight

    def _of(self, tenant: str) -> _Buckets:
        buckets = self._buckets.get(tenant)
        if buckets is None:
            limits, now = self.limits(tenant), self.clock()
            rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
            buckets = self._buckets[tenant] = _Buckets(None if rpm is None else TokenBucket.full(rpm, now),
                                                       None if tpm is None else TokenBucket.full(tpm, now))
        return buckets

    def check(self, tenant: str) -> Refusal | None:
        """Whether a request of `tenant` could pass now, judged before its prompt is read: one request, one token
        (every prompt has one) and a concurrency slot. Takes nothing; counts the request in the tenant's demand."""
        self.demand[tenant] = self.demand.get(tenant, 0.0) + 1.0
        return self._refusal(tenant, 1)

    def open(self, tenant: str) -> Lease | Refusal:
        """Admit a request before its body is read (`check`): one request and a concurrency slot, held while its
        prompt is parsed and tokenized, so a tenant's requests being tokenized count against its limits and cost
        the router no more than its concurrency allows; the prompt tokens are taken once counted
        (`Lease.take_prompt`)."""
        refusal = self.check(tenant)
        return refusal if refusal is not None else self._hold(tenant, True, None)

    def take(self, tenant: str, prompt_tokens: int | None, request: bool = True) -> Lease | Refusal:
        """Admit a call of the router's own APIs: one request, its tokens and a concurrency slot, or nothing.
        `prompt_tokens` None: a call that spends no tokens (the Files and Batches API's), judged on the request
        and concurrency limits only, so a tenant in token debt can still read its batches; `request` False: a call
        that takes no request either, only a concurrency slot (polling a batch's status)."""
        refusal = self._refusal(tenant, prompt_tokens, request)
        return refusal if refusal is not None else self._hold(tenant, request, prompt_tokens)

    def _hold(self, tenant: str, request: bool, tokens: int | None) -> Lease:
        """Charge what `_refusal` found available (time only adds to the buckets) and take a concurrency slot."""
        buckets, now = self._of(tenant), self.clock()
        if buckets.requests is not None and request:
            buckets.requests.charge(1, now)
        if buckets.tokens is not None and tokens is not None:
            buckets.tokens.charge(tokens, now)
        self.inflight[tenant] = self.inflight.get(tenant, 0) + 1
        return Lease(self, tenant, self.headers(tenant))

    def take_prompt(self, tenant: str, prompt_tokens: int) -> Refusal | None:
        """Charge an opened request's prompt tokens, or refuse it over the tokens limit (its slot and request are
        the lease's already: neither is judged again)."""
        refusal = self._refusal(tenant, prompt_tokens, request=False, slot=False)
        if refusal is None and (tokens := self._of(tenant).tokens) is not None:
            tokens.charge(prompt_tokens, self.clock())
        return refusal

    def release(self, tenant: str, output_tokens: int) -> None:
        """A request of `tenant` ended, having spent `output_tokens` beyond its admitted prompt."""
        assert self.inflight.get(tenant, 0) > 0, f"tenant {tenant!r} has no request in flight to release"
        tokens = self._of(tenant).tokens
        if tokens is not None and output_tokens > 0:
            tokens.charge(output_tokens, self.clock())
        self.inflight[tenant] -= 1
        if not self.inflight[tenant]:
            del self.inflight[tenant]

    def _refusal(self, tenant: str, tokens_needed: int | None, request: bool = True,
                 slot: bool = True) -> Refusal | None:
        limits, buckets, now = self.limits(tenant), self._of(tenant), self.clock()
        concurrent = limits.max_concurrent_requests
        if slot and concurrent is not None and (inflight := self.inflight.get(tenant, 0)) >= concurrent:
            whole = self.table.of(tenant).share(self.scale).max_concurrent_requests
            part = f" (this router replica's part of {whole})" if concurrent != whole else ""
            return self._refuse(tenant, "concurrency", 1.0, f"Too many concurrent requests: limit {concurrent}"
                                                            f"{part}, in flight {inflight}")
        over: list[tuple[str, float, str]] = []  # (reason, wait, what) for each limit the request is over
        if request and buckets.requests is not None and buckets.requests.available(now) < 1:
            over.append(("requests", buckets.requests.wait_seconds(1, now), "Rate limit reached for requests per "
                         f"minute (RPM): limit {_number(buckets.requests.per_minute)}"))
        tokens = buckets.tokens
        if tokens is not None and tokens_needed is not None:
            whole = self.table.of(tenant).tokens_per_minute
            assert whole is not None
            if tokens_needed > whole:  # no wait helps: judged against the tenant's whole limit, not this replica's
                return self._refuse(tenant, "tokens", math.inf, f"Request too large for tokens per minute (TPM): "
                                                                f"limit {_number(whole)}, requested {tokens_needed}; "
                                                                "shorten the prompt")
            # more than this replica's minute but within the tenant's: it passes once the bucket is full, into debt
            needed = min(tokens_needed, tokens.per_minute)
            if tokens.available(now) < needed:
                used = max(tokens.per_minute - tokens.level, 0)
                over.append(("tokens", tokens.wait_seconds(needed, now), "Rate limit reached for tokens per minute "
                             f"(TPM): limit {_number(tokens.per_minute)}, used {_number(used)}, requested "
                             f"{tokens_needed}"))
        if not over:
            return None
        reason, _, what = over[0]
        return self._refuse(tenant, reason, max(wait for _, wait, _ in over), what)  # the wait that clears all

    def _refuse(self, tenant: str, reason: str, wait: float, what: str) -> Refusal:
        assert reason in LIMIT_REASONS
        headers = dict(self.headers(tenant))
        if math.isinf(wait):  # OpenAI's clients retry a 429 unless told not to: each retry would cost a request
            headers[SHOULD_RETRY_HEADER] = "false"
            return Refusal(reason, f"{what}.", headers)
        wait = max(wait, 0.001)
        headers["retry-after"] = str(math.ceil(wait))
        headers["retry-after-ms"] = str(math.ceil(wait * 1000))  # read first by OpenAI's own clients
        return Refusal(reason, f"{what}. Please try again in {duration(wait)}.", headers)

    def headers(self, tenant: str) -> dict[str, str]:
        """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the tenant's limited dimensions."""
        buckets, now = self._of(tenant), self.clock()
        out: dict[str, str] = {}
        for kind, bucket in (("requests", buckets.requests), ("tokens", buckets.tokens)):
            if bucket is not None:
                limit, remaining, reset = (name.format(kind) for name in RATE_LIMIT_HEADERS)
                out[limit] = _whole(bucket.per_minute)
                out[remaining] = str(max(math.floor(bucket.available(now)), 0))
                out[reset] = duration(bucket.reset_seconds(now))
        return out


def _check_rates(table: LimitTable, replicas: int) -> None:
    """ValueError for a rate that comes to under one a minute per replica: a bucket must hold one request, so
    `share` would raise it to one and the replicas would allow more than the configured limit."""
    for name, whole in ((DEFAULTS_ENTRY, table.default), *table.tenants.items()):
        for field_name in ("requests_per_minute", "tokens_per_minute"):
            rate = getattr(whole, field_name)
            if rate is not None and rate / replicas < MIN_PER_MINUTE:
                split = f" split over rate_limit_replicas {replicas}" if replicas > 1 else ""
                raise ValueError(f"tenants.{name}: {field_name}{split} is {_number(rate / replicas)} per replica, "
                                 "under one a minute, so a replica's bucket could not hold one request; raise it"
                                 f"{' or lower rate_limit_replicas' if replicas > 1 else ''}")


def duration(seconds: float) -> str:
    """OpenAI's reset format (Go's durations): 20ms, 1s, 6.5s, 1m0s, 1m30.25s."""
    ms = round(seconds * 1000)
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.2f}"


def _whole(value: float) -> str:
    """A header's count: OpenAI sends whole numbers (a replica's share of a limit may not be one)."""
    return str(math.floor(value))
