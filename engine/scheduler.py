"""Continuous batching with chunked prefill and preemption by recompute.

Every step the scheduler gives each running request the tokens it still has to compute (one for a decoding
request, a chunk for a prefilling one) within a per-step token budget, then admits waiting requests with
what is left, taking their cached prefix first. When blocks run out, the least important running request is
preempted: its blocks are released (full ones stay cached) and it recomputes later. It knows nothing of
model code.

Speculative drafts (engine/spec.py) are optional work, an input of `schedule` that the engine proposes each step,
and come last: a guess that may be rejected must never cost another request its token, its admission or its
blocks. So a step first schedules exactly what it would without speculation (every running request's required
tokens, preempting if blocks run out, then admission of waiting requests), and only then gives drafts what is
left: the remaining token budget, running requests in order, and blocks that are free now (never an evicted
prefix-cache block, never a preemption). Admission goes before drafts because a waiting request's prompt is
certain work and its time to first token is what a user waits for, while a draft is accepted only part of the
time; the cost is that while chunked prefill fills the budget, decoding requests decode one token a step as
without speculation. A request with drafts is then scheduled like a small chunk: its last token plus the drafts
that fit, which its ScheduledRequest carries (the engine rolls back the blocks of those the model rejects).

The queue policy orders admission. `fcfs`: priority, then arrival. `prefix` (SGLang's longest-prefix-match,
KVShare): priority, then the longest cached prefix, so requests that reuse what is cached go before the
cache turns over; a request that has waited `max_queue_delay` seconds goes ahead of every one that has not,
in arrival order, so a stream of cached requests cannot starve it: past the bound, only requests that
arrived before it (or have higher priority) go first, as under FCFS.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from kvmesh.engine.config import QUEUE_POLICIES
from kvmesh.engine.kv.blocks import KVCacheManager
from kvmesh.engine.kv.policy import OpeningCounter
from kvmesh.engine.protocol import eviction_class
from kvmesh.engine.request import Request, Status

# The `prefix` policy reorders only this many requests at the head of the queue (which holds the highest
# priorities and the oldest, so the overdue): every step looks up each one's cached prefix, and a queue of
# thousands would make that lookup the step's cost; the rest wait in FCFS order behind them.
PREFIX_WINDOW = 128
NO_DRAFTS: Mapping[str, Sequence[int]] = MappingProxyType({})


@dataclass(frozen=True)
class ScheduledRequest:
    """`num_new_tokens` of `request` to compute this step, starting at its `num_computed_tokens`."""

    request: Request
    num_new_tokens: int
    # unverified drafts computed after the request's last token (engine/spec.py); counted in num_new_tokens
    draft_ids: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # requests that can never fit the pool: the engine ends them with finish_reason "length"
    unservable: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


def _order(request: Request) -> tuple[int, float]:
    """Queue order: higher priority first, then earlier arrival."""
    return (-request.priority, request.arrival_time)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        queue_policy: str = "fcfs",
        max_queue_delay: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"unknown queue policy {queue_policy!r}; known: {', '.join(QUEUE_POLICIES)}")
        if max_queue_delay < 0:
            raise ValueError("max_queue_delay must be >= 0")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.queue_policy = queue_policy
        self.max_queue_delay = max_queue_delay
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.openings = OpeningCounter()
        self._eviction_class: dict[str, str] = {}  # request id -> the class its blocks are freed under

    def add(self, request: Request) -> None:
        if request.request_id not in self._eviction_class:  # arrival (a preempted request keeps its class)
            self._eviction_class[request.request_id] = self._classify(request)
        request.status = Status.WAITING
        keys = [_order(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, _order(request)), request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and release its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id, self._eviction_class.pop(request.request_id, request.workload))
        request.status = Status.FINISHED

    def _classify(self, request: Request) -> str:
        """The request's class refined by how many earlier requests opened the same way (for eviction)."""
        self.kv.find_prefix(request.request_id, request.token_ids, request.extra)  # hashes the prompt once
        seq = self.kv.seqs.get(request.request_id)
        seen = self.openings.seen(seq.hashes, self.kv.block_size) if seq is not None else None
        return request.workload if seen is None else eviction_class(request.workload, seen)

    def admission_order(self) -> list[Request]:
        """The waiting requests in the order admission tries them this step (`prefix`: the first PREFIX_WINDOW
        of the queue by priority, overdue first, then longest cached prefix, then arrival; the rest after)."""
        if self.queue_policy == "fcfs":
            return list(self.waiting)
        now = self.clock()

        def key(r: Request) -> tuple[int, bool, int, float]:
            overdue = now - r.arrival_time >= self.max_queue_delay
            cached = 0 if overdue else self.kv.find_prefix(r.request_id, r.token_ids, r.extra).capped(
                r.cache_limit).num_tokens
            return (-r.priority, not overdue, -cached, r.arrival_time)

        head, rest = self.waiting[:PREFIX_WINDOW], self.waiting[PREFIX_WINDOW:]
        return sorted(head, key=key) + rest

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id, self._eviction_class.get(request.request_id, request.workload))
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        self.add(request)

    def schedule(self, drafts: Mapping[str, Sequence[int]] = NO_DRAFTS) -> SchedulerOutput:
        """One step's plan. `drafts`: speculative tokens proposed for this step, by request id, each following a
        decoding request's last token; those that fit go in the request's ScheduledRequest.draft_ids."""
        out = SchedulerOutput()
        budget = self._schedule_running(out)
        if out.preempted or out.unservable:
            return out
        budget = self._admit(out, budget)
        self._schedule_drafts(out, budget, drafts)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> int:
        """Every running request's required tokens (one for a decoding request, a chunk for a prefilling one),
        preempting the least important when blocks run out; returns the budget left."""
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate(request.request_id, request.num_computed_tokens + n):
                victim = self.running[-1]  # the least important; never one scheduled earlier this step
                if (victim is request and len(self.running) == 1 and not out.scheduled
                        and self.kv.blocks_for(request.num_computed_tokens + n) > self.kv.pool.num_blocks):
                    self.running.remove(request)
                    out.unservable.append(request)
                    break
                # alone and still short, it would fit the whole pool: blocks held outside any request (a handoff's
                # handle, a fetch, an import) are short, so it waits for them in the queue like any preempted one
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, n))
                budget -= n
                i += 1
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in admission order with what is left; returns the budget left."""
        for request in self.admission_order():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if self.kv.blocks_for(request.num_tokens) > self.kv.pool.num_blocks:
                self.waiting.remove(request)
                out.unservable.append(request)
                continue
            hit = self.kv.find_prefix(request.request_id, request.token_ids, request.extra).capped(request.cache_limit)
            n = min(request.num_tokens - hit.num_tokens, budget)
            # Nothing running: a request takes a first chunk only if all it holds now fits. One that fits the pool
            # but not what holders outside any request (imports, promotions) leave would take a chunk, evict the
            # next one's cached blocks, preempt itself, and the next would do the same, turn about, forever; the
            # holders' own requests, queued behind, would never run to give their blocks back.
            alone_short = not self.running and not self.kv.can_allocate(request.request_id, request.num_tokens, hit)
            if alone_short or not self.kv.allocate(request.request_id, hit.num_tokens + n, hit):
                if self.running:
                    break  # it waits for blocks the running requests free; none behind it overtakes
                # nothing runs, so no request will free a block: what holds them is outside any request (handles,
                # fetches, imports), and an import is given back only when its request, maybe behind this one, runs
                continue
            self.waiting.remove(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
                request.cached_tokens = min(hit.num_tokens, len(request.prompt_ids))
                out.admitted.append(request)
            request.num_computed_tokens = hit.num_tokens
            request.status = Status.RUNNING
            keys = [_order(r) for r in self.running]
            self.running.insert(bisect.bisect_right(keys, _order(request)), request)
            out.scheduled.append(ScheduledRequest(request, n))
            budget -= n
        return budget

    def _schedule_drafts(self, out: SchedulerOutput, budget: int, drafts: Mapping[str, Sequence[int]]) -> None:
        """Add drafts to the decoding requests scheduled this step, in order, from the budget left and the free
        blocks only: a draft never evicts a cached block nor preempts anyone."""
        for j, scheduled in enumerate(out.scheduled):
            if budget <= 0:
                return
            request = scheduled.request
            proposed = drafts.get(request.request_id)
            if not proposed:
                continue
            assert scheduled.num_new_tokens == 1 and request.num_computed_tokens == request.num_tokens - 1, (
                "drafts follow a decoding request's last token only")
            room = self.kv.free_capacity(request.request_id) - request.num_tokens
            ids = proposed[: min(budget, room)]
            if not ids:
                continue
            grown = self.kv.allocate(request.request_id, request.num_tokens + len(ids))
            assert grown, "free blocks were counted"
            out.scheduled[j] = ScheduledRequest(request, 1 + len(ids), tuple(ids))
            budget -= len(ids)
