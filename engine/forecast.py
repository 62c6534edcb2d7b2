"""The engine's look-ahead of its own device KV usage (PreServe; docs/contracts.md, contract 3, "Forecast").

Only the engine knows the requests it holds, so it forecasts for itself: it samples each request's remaining
output from the output lengths its workload class has shown, replays the next few seconds of decode steps in
blocks, and exports usage levels at the horizon, the chance of passing OVERLOAD_USAGE, and the time left until
the pool is exhausted; it also computes levels of the peak within the horizon (`Forecast.peak_quantiles`).
The router and the operator read these numbers and re-derive nothing.

Numpy only, no model code: it runs in the metrics loop every few hundred milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvmesh.engine.protocol import FORECAST_LEVELS, OVERLOAD_USAGE, WORKLOAD_CLASSES

_MAX_TOKENS = np.iinfo(np.int32).max  # token counts are kept in 32 bits; no output is longer
_LEVEL_Q = {level: float(level[1:]) / 100 for level in FORECAST_LEVELS}  # "p90" -> 0.9


@dataclass(frozen=True)
class RequestLoad:
    """What the forecast needs to know of one running or queued request.

    `context_tokens` counts every token the request's KV will hold once its prompt is computed: the whole prompt
    plus the tokens generated so far, including the `pending_prefill_tokens` not yet computed. The blocks of
    the computed part are held now; the pending part arrives first, at the prefill rate, before decoding grows
    the request by one token per step.
    """

    context_tokens: int
    generated_tokens: int
    max_tokens: int
    workload: str
    pending_prefill_tokens: int = 0


@dataclass(frozen=True)
class Forecast:
    """Usage levels at the horizon, levels of the peak within it, and two risks within it; usage may exceed 1
    (demand beyond capacity)."""

    horizon_seconds: float
    usage_quantiles: dict[str, float]
    overload_probability: float
    seconds_to_exhaustion: float
    # Levels of each sampled future's highest usage within the horizon. Not a substitute for `usage_quantiles`:
    # the operator adds the pool's arrivals held at the horizon to the pods' usage at the horizon, and adding
    # them to the peak (which is mostly now, before the requests held now end) counted a steady pool twice (1.5x
    # the replica-seconds in the Azure study); the peak is a floor of the window's demand beside it.
    peak_quantiles: dict[str, float] = field(default_factory=dict)


def _exponential_prior(mean_tokens: float, n: int) -> np.ndarray:
    """n evenly spaced quantiles of an exponential: the least-committal length law with a given mean."""
    q = (np.arange(n) + 0.5) / n
    return np.clip(np.rint(-mean_tokens * np.log1p(-q)), 1, _MAX_TOKENS).astype(np.int32)


def _spread(sorted_values: np.ndarray, n: int) -> np.ndarray:
    """n evenly spaced order statistics: a small sample that keeps a distribution's shape, deterministically."""
    idx = ((np.arange(n) + 0.5) * len(sorted_values) / n).astype(np.int64)
    return sorted_values[idx]


class OutputLengthModel:
    """Per-workload-class output-length distributions learned online, in bounded memory.

    Each class keeps a ring of its last `capacity` output lengths, so the model follows drift and its memory is
    fixed. A class with fewer than `min_observations` lengths is topped up with pseudo-observations from a
    prior (all classes' lengths pooled once they are enough, else an exponential of mean `prior_mean_tokens`),
    whose weight falls to zero as the class's own evidence reaches `min_observations`.
    """

    def __init__(
        self,
        capacity: int = 1024,
        min_observations: int = 32,
        prior_mean_tokens: float = 256.0,
        classes: Sequence[str] = WORKLOAD_CLASSES,
    ) -> None:
        if capacity < 1 or min_observations < 1 or prior_mean_tokens <= 0:
            raise ValueError("capacity and min_observations must be >= 1, prior_mean_tokens > 0")
        self.capacity = capacity
        self.min_observations = min_observations
        self._default_prior = _exponential_prior(prior_mean_tokens, min_observations)
        self._rings = {c: np.zeros(capacity, dtype=np.int32) for c in classes}
        self._counts = dict.fromkeys(classes, 0)  # lengths ever observed, per class
        self._version = 0  # bumped by observe, so cached pools know they are stale
        self._pools: dict[str, tuple[int, np.ndarray]] = {}

    def observe(self, workload: str, output_tokens: int) -> None:
        """Record a finished request's output length (only the known classes, to keep memory bounded)."""
        if workload not in self._rings:
            raise ValueError(f"unknown workload class {workload!r}")
        if output_tokens < 0:
            raise ValueError("output_tokens must be >= 0")
        count = self._counts[workload]
        self._rings[workload][count % self.capacity] = min(output_tokens, _MAX_TOKENS)
        self._counts[workload] = count + 1
        self._version += 1

    def observations(self, workload: str) -> np.ndarray:
        """The lengths a class remembers (at most `capacity`), in no particular order."""
        if workload not in self._rings:
            return np.zeros(0, dtype=np.int32)
        return self._rings[workload][: min(self._counts[workload], self.capacity)]

    def pool(self, workload: str) -> np.ndarray:
        """The sorted lengths a class samples from: its own, plus prior pseudo-observations while it has few."""
        cached = self._pools.get(workload)
        if cached is not None and cached[0] == self._version:
            return cached[1]
        own = self.observations(workload)
        missing = self.min_observations - len(own)
        if missing > 0:
            pooled = np.sort(np.concatenate([self.observations(c) for c in self._rings]))
            prior = pooled if len(pooled) >= self.min_observations else self._default_prior
            own = np.concatenate([own, _spread(prior, missing)])
        values = np.sort(own)
        if workload in self._rings:  # an unknown class is not cached, so odd names cannot grow memory
            self._pools[workload] = (self._version, values)
        return values

    def sample_remaining(
        self,
        workload: str,
        generated: np.ndarray,
        max_tokens: np.ndarray,
        rng: np.random.Generator,
        n_samples: int,
    ) -> np.ndarray:
        """Remaining output lengths, shape (n_samples, n_requests), each in [0, max_tokens - generated].

        A request that has generated g tokens has shown it is longer than g, so its total is drawn from the
        class's lengths above g. When no remembered length exceeds g the request is in the unseen tail; then
        its remaining length is drawn from the whole distribution, as if it restarted (memoryless).
        """
        generated = np.asarray(generated, dtype=np.int64)
        cap = np.clip(np.asarray(max_tokens, dtype=np.int64) - generated, 0, _MAX_TOKENS).astype(np.int32)
        values = self.pool(workload)
        size = len(values)
        lo = np.searchsorted(values, generated, side="right")  # the lengths above g are values[lo:]
        tail = lo == size
        start = np.where(tail, 0, lo).astype(np.int32)
        width = np.where(tail, size, size - lo).astype(np.float32)
        offset = np.where(tail, 0, generated).astype(np.int32)  # remaining = total - g, or a fresh length
        floor = tail.astype(np.int32)  # a request in the unseen tail has at least one token to go
        # 32-bit and in place: these (samples, requests) arrays are the forecast's main cost.
        u = rng.random((n_samples, len(generated)), dtype=np.float32)
        u *= width
        idx = u.astype(np.int32)
        idx += start
        np.minimum(idx, size - 1, out=idx)
        remaining = values[idx]
        remaining -= offset
        np.maximum(remaining, floor, out=remaining)
        return np.minimum(remaining, cap, out=remaining)


def _points(horizon_steps: int, points: int, starts: np.ndarray) -> np.ndarray:
    """The steps each future is evaluated at: `points` intervals over 0..horizon_steps plus up to `points` decode
    starts within it.

    A future's usage only falls when a request ends, so it peaks just before an end or at the horizon. The even
    grid alone missed every request that prefills and ends between two of its points (10 s of 2 ms steps put 156
    steps between points: a queue of short requests was never seen alive, and a full engine forecast no overload).
    From its decode start on a request holds at least its whole prompt, and requests alive together are all alive
    at the latest of their starts, so the starts show every request, and every group held at once, at least at
    its prompt's size. Starts do not depend on the sampled futures, so one set of points serves them all; more
    than `points` are thinned evenly by rank (a dense stretch of the queue keeps its share), which bounds the points
    at twice the grid's. Still unseen: the tokens a request decodes (and the one prompt being prefilled computes)
    after the last point before an end, at most the grid's spacing (1/32 of the window by default).
    """
    grid = np.rint(np.linspace(0, horizon_steps, min(horizon_steps, points) + 1)).astype(np.int64)
    starts = np.unique(starts[(starts > 0) & (starts < horizon_steps)])
    if len(starts) > points:
        starts = starts[np.rint(np.linspace(0, len(starts) - 1, points)).astype(np.int64)]
    return np.union1d(grid, starts)


def _first_crossing(usage: np.ndarray, points: np.ndarray, level: float) -> np.ndarray:
    """Per sample, the step at which usage first reaches `level` (linear between points), inf if never."""
    hit = usage >= level
    crossed = hit.any(axis=0)
    j = np.argmax(hit, axis=0)
    prev = np.maximum(j - 1, 0)
    cols = np.arange(usage.shape[1])
    u0, u1 = usage[prev, cols], usage[j, cols]
    k0, k1 = points[prev].astype(np.float64), points[j].astype(np.float64)
    rise = np.where(u1 > u0, u1 - u0, 1.0)
    frac = np.clip((level - u0) / rise, 0.0, 1.0)
    steps = np.where(j == 0, 0.0, k0 + frac * (k1 - k0))
    return np.where(crossed, steps, np.inf)


def forecast_usage(
    requests: Sequence[RequestLoad],
    total_blocks: int,
    block_size: int,
    horizon_seconds: float,
    decode_step_seconds: float,
    prefill_tokens_per_second: float,
    lengths: OutputLengthModel,
    n_samples: int = 256,
    seed: int = 0,
    grid_points: int = 32,
    pinned_blocks: float = 0.0,
) -> Forecast:
    """Forecast device KV usage over the next `horizon_seconds` from the requests the engine holds.

    Time advances in decode steps (horizon_seconds / decode_step_seconds, at least one); the engine passes the time
    per output token of a decoding request (its step time over the tokens a step outputs per request, more than one
    with speculative decoding), so a request's growth of one token per step holds. Pending prefill is computed
    first, in the order of `requests`, at `prefill_tokens_per_second`; a request starts decoding when its prompt is
    done and then grows one token per step until its sampled remaining output is spent, when it releases all its
    blocks. Each of `n_samples` futures is evaluated at the same steps: `grid_points` + 1 spanning [0, horizon] and up
    to `grid_points` requests' decode starts (`_points`); `usage_quantiles` are quantiles over futures of their usage
    at the horizon, `peak_quantiles` of each one's peak over the points (which the horizon's value misses when
    requests grow and end inside the window). The look-ahead window is the horizon: `overload_probability` is the
    share of futures whose usage passes OVERLOAD_USAGE at some point of it, and `seconds_to_exhaustion` is the
    median over futures of the first time demand reaches `total_blocks` (interpolated between points), math.inf
    when fewer than half the futures get there within the horizon. `pinned_blocks` are held outside any request (a
    handoff's handle, a peer's fetch) for the whole window: counted in every future, as the usage gauge counts
    them. Deterministic for a given seed.
    """
    if total_blocks <= 0 or block_size <= 0 or n_samples <= 0 or grid_points <= 0:
        raise ValueError("total_blocks, block_size, n_samples and grid_points must be positive")
    if decode_step_seconds <= 0 or prefill_tokens_per_second <= 0 or horizon_seconds < 0:
        raise ValueError("step time and prefill rate must be positive, the horizon non-negative")
    if not requests:
        usage = pinned_blocks / total_blocks
        return Forecast(horizon_seconds, dict.fromkeys(FORECAST_LEVELS, usage), float(usage > OVERLOAD_USAGE),
                        0.0 if pinned_blocks >= total_blocks else math.inf, dict.fromkeys(FORECAST_LEVELS, usage))

    horizon_steps = max(1, math.floor(horizon_seconds / decode_step_seconds + 1e-9))
    beyond = min(horizon_steps + 1, _MAX_TOKENS // 2)  # any step past the window: later is the same to us

    context = np.array([r.context_tokens for r in requests], dtype=np.int64)
    pending = np.minimum(np.array([r.pending_prefill_tokens for r in requests], dtype=np.int64), context)
    generated = np.array([r.generated_tokens for r in requests], dtype=np.int64)
    max_tokens = np.array([r.max_tokens for r in requests], dtype=np.int64)

    # Prefill, in order: the step each request's decoding starts, and the tokens it has computed by each point.
    prefill_per_step = prefill_tokens_per_second * decode_step_seconds
    done_by = np.cumsum(pending)
    start = np.where(pending > 0, np.minimum(np.ceil(done_by / prefill_per_step), beyond), 0)
    start = start.astype(np.int64)
    points = _points(horizon_steps, grid_points, start)
    computed = np.clip(points[:, None] * prefill_per_step - (done_by - pending), 0, pending).astype(np.int64)

    # While a request lives, its size does not depend on the sampled future: only its end does.
    decoded = np.maximum(points[:, None] - start, 0)
    tokens = context - pending + computed + decoded
    blocks = (-(-tokens // block_size)).astype(np.float32)  # (points, requests), while alive

    rng = np.random.default_rng(seed)
    remaining = np.empty((n_samples, len(requests)), dtype=np.int32)
    workloads = [r.workload for r in requests]
    for workload in dict.fromkeys(workloads):  # first-seen order keeps the random stream reproducible
        cols = np.array([i for i, w in enumerate(workloads) if w == workload])
        remaining[:, cols] = lengths.sample_remaining(workload, generated[cols], max_tokens[cols], rng, n_samples)
    np.minimum(remaining, beyond, out=remaining)
    remaining += start.astype(np.int32)
    end = np.maximum(remaining, 1, out=remaining)  # first step without the request; it holds its blocks now

    # 32-bit sums of whole blocks are exact below 2**24 blocks and faster than 64-bit ones; with them and the steps
    # as Python ints (a numpy int64 copied `end` to 64 bits at every point) this costs less than the grid alone did.
    held = np.empty((len(points), n_samples), dtype=np.float32)
    alive = np.empty(end.shape, dtype=np.float32)  # reused: one (samples, requests) mask per point
    for p, step in enumerate(points.tolist()):
        np.greater(end, step, out=alive)
        np.dot(alive, blocks[p], out=held[p])
    held = held.astype(np.float64) + pinned_blocks
    usage = held / total_blocks  # (points, samples)

    qs = [_LEVEL_Q[level] for level in FORECAST_LEVELS]
    quantiles = {level: float(v) for level, v in zip(FORECAST_LEVELS, np.quantile(usage[-1], qs), strict=True)}
    # Each future's peak within the window: requests that grow and finish inside it peak in its middle, and the
    # horizon's value sees them gone (0 where 130 %).
    peaks = {level: float(v) for level, v in zip(FORECAST_LEVELS, np.quantile(usage.max(axis=0), qs), strict=True)}
    overload = float((usage > OVERLOAD_USAGE).any(axis=0).mean())
    crossing = np.sort(_first_crossing(held, points, float(total_blocks)))
    exhaustion = float(crossing[(n_samples - 1) // 2]) * decode_step_seconds
    return Forecast(horizon_seconds, quantiles, overload, exhaustion, peaks)
