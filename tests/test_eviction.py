"""Eviction by reuse probability: the policy keeps the blocks a class reuses soon, where LRU loses them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvmesh.bench.eviction import replay
from kvmesh.bench.traces import load_mooncake
from kvmesh.cli import main
from kvmesh.engine.config import load_config
from kvmesh.engine.kv.blocks import BlockPool, KVCacheManager
from kvmesh.engine.kv.policy import BlockUse, LRUPolicy, OpeningCounter, ReuseModel, ReusePolicy, make_policy
from kvmesh.engine.protocol import eviction_class, workload_class
from kvmesh.engine.request import Request
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.scheduler import Scheduler

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def two_class_hot_hits(policy: str) -> float:
    """A synthetic two-class trace: every second a `cold` request brings 8 fresh blocks (never reused), and
    one of 4 `hot` prompts of 4 blocks comes back every 2 s (each within 8 s). 64 blocks hold the hot set
    easily, but 8 s of cold traffic alone fills them, so LRU evicts each hot prompt before its next turn.
    Returns the hot requests' block hit ratio over the second half."""
    clock = Clock()
    kv = KVCacheManager(64, BLOCK, policy=make_policy(policy, clock=clock))
    hot = [[1000 * (p + 1) + t for t in range(4 * BLOCK)] + [7] for p in range(4)]
    hits = total = 0
    for second in range(400):
        clock.now = float(second)
        cold = [100_000 + second * 8 * BLOCK + t for t in range(8 * BLOCK)] + [7]
        batch = [("cold", cold)] + ([("hot", hot[(second // 2) % 4])] if second % 2 == 0 else [])
        for name, tokens in batch:
            seq = f"{name}-{second}"
            found = kv.find_prefix(seq, tokens)
            if name == "hot" and second >= 200:
                hits += len(found.blocks)
                total += 4
            assert kv.allocate(seq, len(tokens), found)
            kv.commit(seq, tokens, len(tokens) - 1)
            kv.free(seq, name)
            kv.check_invariants()
    return hits / total


def test_reuse_policy_keeps_the_soon_reused_class_where_lru_loses_it() -> None:
    lru, reuse = two_class_hot_hits("lru"), two_class_hot_hits("reuse")
    assert lru < 0.1, f"the trace should defeat LRU (hot hit ratio {lru:.2f})"
    assert reuse > 0.9, f"the reuse policy keeps the hot class cached (hot hit ratio {reuse:.2f})"


def test_with_one_class_the_reuse_policy_evicts_exactly_like_lru() -> None:
    """No class information, no reordering: the policy can only differ from LRU where classes differ."""
    clock = Clock()
    rng = random.Random(0)
    lru, reuse = LRUPolicy(), ReusePolicy(clock)
    idle: list[int] = []
    next_id = 0
    for step in range(3000):
        clock.now = step * 0.5
        action = rng.random()
        if action < 0.5 or not idle:
            lru.add(next_id)
            reuse.add(next_id, BlockUse("same", rng.randrange(8), block_hash=rng.randrange(50)))
            idle.append(next_id)
            next_id += 1
        elif action < 0.7:
            block = idle.pop(rng.randrange(len(idle)))
            lru.remove(block)
            reuse.remove(block)
        else:
            victim = lru.pop_victim()
            assert reuse.pop_victim() == victim
            idle.remove(victim)
        assert len(lru) == len(reuse)


def test_reuse_probability_falls_with_idle_time_and_rises_with_frequent_short_reuse() -> None:
    soon, rare = ReuseModel(100), ReuseModel(100)
    for _ in range(50):
        soon.observe_idle()
        soon.observe_hit(2.0)
        rare.observe_idle()
    rare.observe_hit(300.0)
    assert soon.reuse_probability(1.0, 30.0) > soon.reuse_probability(20.0, 30.0)
    assert soon.reuse_probability(5.0, 30.0) > rare.reuse_probability(5.0, 30.0)
    assert 0.0 <= rare.reuse_probability(0.0, float("inf")) <= 1.0


def test_equal_probability_evicts_the_block_farthest_from_the_prompt_start() -> None:
    clock = Clock()
    policy = ReusePolicy(clock)
    policy.add(1, BlockUse("a", offset=0))
    policy.add(2, BlockUse("b", offset=5))  # a fresh class with the same (prior) model, same idle time
    assert policy.pop_victim() == 2


def test_scheduler_frees_blocks_under_the_class_refined_by_prefix_reuse() -> None:
    clock = Clock()
    policy = ReusePolicy(clock)
    kv = KVCacheManager(64, BLOCK, policy=policy)
    scheduler = Scheduler(kv, 4, 256, clock=clock)
    for i in range(2):
        request = Request(f"r{i}", list(range(40)), SamplingParams(max_tokens=1), workload="chat-short")
        scheduler.add(request)
        assert scheduler.schedule().scheduled
        kv.commit(request.request_id, request.token_ids, request.num_tokens)
        scheduler.remove(request)
    # r1 shared r0's first 9 blocks (its 10th ends the prompt, so it is recomputed): they are filed under r1's class
    assert len(policy.queues["chat-short/repeat"]) == 9 and len(policy.queues["chat-short/first"]) == 1
    assert set(policy.models) == {"chat-short/first", "chat-short/repeat"}


def test_workload_class_refinement_keeps_existing_callers() -> None:
    assert workload_class("chat", 10) == "chat-short"
    assert workload_class("chat", 5000, "completion-long") == "completion-long"
    assert eviction_class(workload_class("chat", 5000), 0) == "chat-long/first"
    assert eviction_class(workload_class("completion", 10), 2) == "completion-short/repeat"
    assert eviction_class(workload_class("chat", 10, "chat-long"), 9) == "chat-long/frequent"


def test_opening_counter_counts_earlier_requests_with_the_same_opening() -> None:
    counter = OpeningCounter(opening_tokens=8, capacity=2)
    assert counter.seen([1, 2, 3], 4) == 0
    assert counter.seen([1, 2, 9], 4) == 1  # same first 8 tokens (blocks 0-1), different tail
    assert counter.seen([1, 5], 4) == 0
    assert counter.seen([], 4) is None
    counter.seen([6, 6], 4)  # the capacity is 2: the oldest opening is forgotten
    assert counter.seen([1, 2], 4) == 0


def test_unknown_policy_names_are_rejected_clearly() -> None:
    with pytest.raises(ValueError, match="known"):
        make_policy("mru")
    with pytest.raises(ValueError, match="eviction_policy"):
        load_config(None, {"eviction_policy": "mru"})
    assert load_config(None, {"eviction_policy": "reuse"}).eviction_policy == "reuse"


def write_trace(path: Path, n: int) -> None:
    """A small Mooncake-format trace: conversations whose turns extend their previous prompt."""
    rng = random.Random(1)
    next_id, lines, convs = 1, [], []
    for i in range(n):
        if convs and rng.random() < 0.6:
            ids = rng.choice(convs)
        else:
            ids = [0]
            convs.append(ids)
        for _ in range(rng.randint(1, 3)):
            ids.append(next_id)
            next_id += 1
        lines.append(json.dumps({"timestamp": i * 500, "input_length": len(ids) * 512 - 10, "output_length": 5,
                                 "hash_ids": list(ids)}))
    path.write_text("\n".join(lines) + "\n")


def test_replay_counts_hits_through_the_kv_manager(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, 200)
    requests = load_mooncake(trace)
    big = replay(requests, 100_000, "lru")
    assert big.evictions == 0
    # an unbounded cache hits every block seen before except each prompt's last (partial) one
    seen: set[int] = set()
    expected = 0
    for r in requests:
        expected += sum(1 for h in r.hash_ids[:-1] if h in seen)
        seen.update(r.hash_ids[:-1])
    assert big.hit_blocks == expected
    small = {p: replay(requests, 40, p) for p in ("lru", "reuse")}
    assert all(0 < s.hit_blocks < big.hit_blocks and s.evictions > 0 for s in small.values())


def test_bench_command_prints_a_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, 100)
    out = tmp_path / "r.json"
    assert main(["bench", "eviction", "--trace", str(trace), "--sizes", "30,60", "--json", str(out)]) == 0
    assert "| 30 |" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert {(r["policy"], r["num_blocks"]) for r in results} == {(p, n) for p in ("lru", "reuse") for n in (30, 60)}
    with pytest.raises(SystemExit) as refused:  # argparse refuses it with its usage line
        main(["bench", "eviction", "--trace", str(trace), "--sizes", "x"])
    assert refused.value.code == 2


def test_engine_with_reuse_eviction_and_prefix_queue_matches_an_unconstrained_engine(tiny_dir: Path) -> None:
    """Both policies in the real engine under memory pressure: same greedy outputs as a roomy LRU/FCFS engine,
    and the evictable blocks are filed under refined classes."""
    from .conftest import make_engine

    shared = [(i * 7919) % 49000 + 100 for i in range(48)]
    prompts = [[*shared, 200 + s, 300 + s] if s % 2 else [(s * 1000 + i * 31) % 49000 + 100 for i in range(40)]
               for s in range(8)]

    def outputs(**settings: object) -> tuple[list[list[int]], BlockPool]:
        engine = make_engine(tiny_dir, **settings)
        got: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            request = Request(f"e{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            request.on_output = lambda o, rid=request.request_id: got.setdefault(rid, []).extend(o.new_token_ids)
            engine.submit(request)
        engine.run_until_idle()
        engine.kv.check_invariants()
        return [got[f"e{i}"] for i in range(len(prompts))], engine.kv.pool

    expected, _ = outputs()
    tight, pool = outputs(kv_cache_blocks=14, eviction_policy="reuse", queue_policy="prefix")
    assert tight == expected
    policy = pool.policy
    assert isinstance(policy, ReusePolicy) and pool.evictions > 0
    assert any("/" in w for w, q in policy.queues.items() if q)


def test_an_eviction_scores_one_block_per_class_not_every_block() -> None:
    clock = Clock()
    policy = ReusePolicy(clock)
    for block in range(3000):
        clock.now = block * 0.01
        policy.add(block, BlockUse(f"class-{block % 3}", block % 7, block_hash=block))
    scored = 0
    for model in policy.models.values():
        original = model.reuse_probability

        def counting(idle: float, lifetime: float, original=original) -> float:  # type: ignore[no-untyped-def]
            nonlocal scored
            scored += 1
            return original(idle, lifetime)

        model.reuse_probability = counting  # type: ignore[method-assign]
    for _ in range(100):
        policy.pop_victim()
    assert scored <= 100 * 3
    assert len(policy) == 2900
