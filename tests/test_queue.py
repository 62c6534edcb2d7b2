"""The cache-aware queue: cached prefixes first, and the aging bound that keeps it from starving anyone.

The scheduler and KV manager are the engine's own; the model is replaced by kvmesh.bench.queue's cost model on
a simulated clock (the ordering is what is tested, and a real model adds nothing to it)."""

from __future__ import annotations

import pytest

from kvmesh.bench.queue import Arrival, Machine, Workload, compare, simulate
from kvmesh.engine.config import load_config
from kvmesh.engine.kv.blocks import KVCacheManager
from kvmesh.engine.request import Request
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.scheduler import PREFIX_WINDOW, Scheduler

HOT = tuple(range(1, 1025))
SLOTS = Machine(max_num_seqs=2)


def hot_stream_with_one_cold(seconds: float = 3.0) -> list[Arrival]:
    """Requests sharing a cached prefix arrive faster than two slots serve them; one cold request among them."""
    arrivals = [Arrival(i * 0.01, (*HOT, 10**6 + i)) for i in range(int(seconds / 0.01))]
    arrivals.insert(5, Arrival(0.045, tuple(range(5000, 5000 + 1100))))
    return arrivals


def cold_wait(arrivals: list[Arrival], policy: str, max_queue_delay: float) -> float:
    requests, _ = simulate(arrivals, policy, max_queue_delay, SLOTS)
    cold = next(r for r in requests if r.prompt_ids[0] == 5000)
    return cold.first_scheduled_time - cold.arrival_time  # type: ignore[operator]


def test_aging_bound_admits_a_passed_over_request_within_the_bound() -> None:
    arrivals = hot_stream_with_one_cold()
    unbounded = cold_wait(arrivals, "prefix", max_queue_delay=1e9)
    assert unbounded > 1.5, "without the bound the cold request waits behind the whole hot stream"
    bound = 0.5
    bounded = cold_wait(arrivals, "prefix", max_queue_delay=bound)
    step = SLOTS.step_seconds + SLOTS.token_seconds * SLOTS.max_num_batched_tokens  # the longest possible step
    assert bounded <= bound + 2 * step
    assert cold_wait(arrivals, "fcfs", max_queue_delay=bound) <= bounded  # FCFS admits it in arrival order


def prefix_queue_with_hot_prefix_cached() -> Scheduler:
    """A one-slot prefix queue whose KV cache holds the first 512 tokens of HOT (a request computed them)."""
    kv = KVCacheManager(256, 16)
    scheduler = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=4096, queue_policy="prefix", clock=lambda: 0.0)
    warm = Request("warm", [*HOT[:512], 1], SamplingParams(max_tokens=1), arrival_time=0.0)
    scheduler.add(warm)
    scheduler.schedule()
    kv.commit("warm", warm.token_ids, warm.num_tokens)
    scheduler.remove(warm)
    return scheduler


def test_prefix_queue_serves_cached_prefixes_first() -> None:
    scheduler = prefix_queue_with_hot_prefix_cached()
    cold = Request("cold", list(range(7000, 7600)), SamplingParams(max_tokens=1), arrival_time=0.0)
    hot = Request("hot", [*HOT[:512], 2, 3], SamplingParams(max_tokens=1), arrival_time=0.0)
    scheduler.add(cold)
    scheduler.add(hot)  # arrived later (same time, added after): FCFS would take cold first
    assert [r.request_id for r in scheduler.admission_order()] == ["hot", "cold"]
    assert [s.request.request_id for s in scheduler.schedule().scheduled] == ["hot"]


def test_prefix_queue_reorders_only_the_head_of_a_long_queue() -> None:
    """Past PREFIX_WINDOW requests the queue stays FCFS: a cached prefix at the tail waits its turn, so each step's
    ordering costs at most PREFIX_WINDOW prefix lookups however long the queue grows."""
    scheduler = prefix_queue_with_hot_prefix_cached()
    for i in range(PREFIX_WINDOW):
        scheduler.add(Request(f"cold-{i}", [9000 + i] * 20, SamplingParams(max_tokens=1), arrival_time=0.0))
    scheduler.add(Request("hot-in-head", [*HOT[:512], 2], SamplingParams(max_tokens=1), arrival_time=0.0))
    order = [r.request_id for r in scheduler.admission_order()]
    assert order[0] == "cold-0" and order[-1] == "hot-in-head", "the hot request is past the window: FCFS"
    scheduler.remove(scheduler.waiting[0])  # one cold request leaves: the hot one is now inside the window
    assert scheduler.admission_order()[0].request_id == "hot-in-head"


def test_prefix_queue_beats_fcfs_on_a_shared_prefix_workload_within_its_bound() -> None:
    bound = 2.0
    fcfs, prefix = compare(Workload(requests=300, rate=20.0), Machine(), max_queue_delay=bound)
    assert prefix.ttft_mean < fcfs.ttft_mean and prefix.ttft_p99 < fcfs.ttft_p99
    assert prefix.cached_fraction > fcfs.cached_fraction
    assert prefix.extra_wait_max <= bound


def test_queue_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="queue_policy"):
        load_config(None, {"queue_policy": "lifo"})
    with pytest.raises(ValueError, match="max_queue_delay_seconds"):
        load_config(None, {"max_queue_delay_seconds": -1})
    with pytest.raises(ValueError, match="unknown queue policy"):
        Scheduler(KVCacheManager(4, 16), 1, 16, queue_policy="lifo")
