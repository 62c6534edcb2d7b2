"""The global prefix index, built from KV event batches and snapshots (contract 2): pure, no processes."""

from __future__ import annotations

import random
import time

from kvmesh.engine.protocol import TIERS, KVBlocksSnapshot, KVEvent, KVEventBatch, block_hashes
from kvmesh.router.index import PrefixIndex, PrefixMatch

BOOT = "boot-a"
PROMPT = block_hashes(list(range(16 * 8)))  # eight chained blocks


def stored(hashes: list[int], tier: str | None = "device") -> KVEvent:
    return KVEvent("stored", tuple(hashes), tier, parent_hash=None, token_count=16 * len(hashes))


def removed(hashes: list[int], tier: str | None = "device") -> KVEvent:
    return KVEvent("removed", tuple(hashes), tier)


def cleared(tier: str | None = None) -> KVEvent:
    return KVEvent("cleared", (), tier)


def feed(index: PrefixIndex, pod: str, *events: KVEvent, boot: str = BOOT) -> bool:
    """Apply the events as the pod's next batch."""
    _, last = index.resume_point(pod)
    return index.apply(pod, KVEventBatch(boot, last + 1, tuple(events)))


def blocks(index: PrefixIndex, hashes: list[int] = PROMPT, now: float | None = None) -> dict[str, int]:
    return {pod: m.blocks for pod, m in index.match(hashes, now=now).items()}


def test_stored_removed_and_cleared_per_tier() -> None:
    index = PrefixIndex()
    assert feed(index, "a", stored(PROMPT[:6]))
    assert feed(index, "b", stored(PROMPT[:3]), stored(PROMPT[3:5], "host"))
    assert index.size() == 6
    assert index.pods() == ["a", "b"]
    assert index.match(PROMPT) == {
        "a": PrefixMatch(6, {"device": 6, "host": 0, "disk": 0}, 0),
        "b": PrefixMatch(5, {"device": 3, "host": 2, "disk": 0}, 0),
    }

    assert feed(index, "a", removed(PROMPT[2:3]))
    assert blocks(index) == {"a": 2, "b": 5}
    assert feed(index, "b", cleared("host"))
    assert blocks(index) == {"a": 2, "b": 3}
    assert feed(index, "b", removed(PROMPT[:1], tier=None))  # no tier: gone from every tier
    assert blocks(index) == {"a": 2}
    assert feed(index, "a", cleared())
    assert blocks(index) == {}
    assert index.size() == 2  # b still holds blocks 1 and 2, which match nothing without block 0


def test_a_block_moving_between_tiers_is_best_served_from_where_it_is() -> None:
    index = PrefixIndex()
    feed(index, "a", stored(PROMPT[:4]))
    feed(index, "a", stored(PROMPT[2:4], "disk"), removed(PROMPT[2:4], "device"))  # offloaded to disk
    assert index.match(PROMPT)["a"].by_tier == {"device": 2, "host": 0, "disk": 2}
    feed(index, "a", stored(PROMPT[3:4], "host"))  # a copy on host too: host is better than disk
    assert index.match(PROMPT)["a"].by_tier == {"device": 2, "host": 1, "disk": 1}
    feed(index, "a", stored(PROMPT[:4], tier=None))  # an untiered store is a device store, as in the engine
    assert index.match(PROMPT)["a"].by_tier == {"device": 4, "host": 0, "disk": 0}


def test_unknown_tier_is_skipped_not_fatal() -> None:
    index = PrefixIndex()
    assert feed(index, "a", stored(PROMPT[:2], "remote"), stored(PROMPT[:1]))
    assert blocks(index) == {"a": 1}


def test_only_consecutive_leading_blocks_count() -> None:
    index = PrefixIndex()
    feed(index, "a", stored([PROMPT[0], PROMPT[1], PROMPT[3], PROMPT[4], PROMPT[5]]))  # a hole at block 2
    feed(index, "b", stored(PROMPT[1:]))  # everything but the first block
    assert blocks(index) == {"a": 2}
    assert index.match([]) == {}
    assert index.match(PROMPT, pods=["b", "nobody"]) == {}
    assert blocks(index, PROMPT[:1]) == {"a": 1}


def test_duplicates_are_ignored_and_gaps_boot_changes_and_resets_ask_for_a_resync() -> None:
    index = PrefixIndex()
    assert index.resume_point("a") == (None, 0)
    assert index.apply("a", KVEventBatch(BOOT, 1, (stored(PROMPT[:2]),)))
    assert index.apply("a", KVEventBatch(BOOT, 2, (stored(PROMPT[2:3]),)))
    assert index.resume_point("a") == (BOOT, 2)

    assert index.apply("a", KVEventBatch(BOOT, 2, (removed(PROMPT[:3]),)))  # a repeat: ignored
    assert index.apply("a", KVEventBatch(BOOT, 1, (removed(PROMPT[:3]),)))
    assert blocks(index) == {"a": 3}

    assert not index.apply("a", KVEventBatch(BOOT, 4, (removed(PROMPT[:3]),)))  # batch 3 is missing
    assert not index.apply("a", KVEventBatch("boot-b", 3, (removed(PROMPT[:3]),)))  # the pod restarted
    assert not index.apply("a", KVEventBatch(BOOT, 3, (removed(PROMPT[:3]),), reset=True))
    assert blocks(index) == {"a": 3}  # nothing of the refused batches was applied
    assert index.resume_point("a") == (BOOT, 2)

    assert not index.apply("b", KVEventBatch(BOOT, 5, (stored(PROMPT),)))  # a first batch after a gap
    assert blocks(index) == {"a": 3}


def test_a_snapshot_replaces_what_was_known_and_sets_the_resume_point() -> None:
    index = PrefixIndex()
    feed(index, "a", stored(PROMPT[:5]))
    feed(index, "b", stored(PROMPT[:2]))
    index.add_provisional("a", PROMPT, now=0.0, ttl=10.0)
    assert not index.apply("a", KVEventBatch("boot-b", 1, (), reset=True))

    index.load_snapshot("a", KVBlocksSnapshot("boot-b", 7, {"device": PROMPT[:1], "host": PROMPT[1:3], "disk": []}))
    assert index.resume_point("a") == ("boot-b", 7)
    assert index.match(PROMPT, now=1.0)["a"] == PrefixMatch(3, {"device": 1, "host": 2, "disk": 0}, 0)
    assert index.size() == 3

    assert index.apply("a", KVEventBatch("boot-b", 7, (cleared(),)))  # already in the snapshot
    assert index.apply("a", KVEventBatch("boot-b", 8, (stored(PROMPT[3:4]),)))  # resumes after it
    assert blocks(index) == {"a": 4, "b": 2}


def test_provisional_entries_are_found_then_expire() -> None:
    index = PrefixIndex()
    feed(index, "a", stored(PROMPT[:2]))
    index.add_provisional("a", PROMPT[:6], now=100.0, ttl=5.0)
    index.add_provisional("b", PROMPT[:4], now=100.0, ttl=5.0)  # a pod with no events yet

    assert index.match(PROMPT, now=101.0) == {
        "a": PrefixMatch(6, {"device": 6, "host": 0, "disk": 0}, 4),
        "b": PrefixMatch(4, {"device": 4, "host": 0, "disk": 0}, 4),
    }
    assert blocks(index, now=None) == {"a": 2}  # without a clock, only what events said
    assert blocks(index, now=105.0) == {"a": 2}  # expired

    index.add_provisional("b", PROMPT[:1], now=200.0, ttl=5.0)  # expiring the old entries on the way
    assert index._provisional == {PROMPT[0]: {"b": 205.0}}


def test_a_renewed_provisional_entry_outlives_the_first_decision() -> None:
    index = PrefixIndex()
    index.add_provisional("a", PROMPT[:3], now=0.0, ttl=5.0)
    index.add_provisional("a", PROMPT[:3], now=4.0, ttl=5.0)
    index.add_provisional("b", [], now=6.0, ttl=5.0)  # sweeps the first decision's heap entry
    assert blocks(index, now=8.0) == {"a": 3}


def test_a_refused_decision_is_withdrawn_and_only_it() -> None:
    """A pod that refused the request (429, 503, no connection) will not compute its blocks: its commit's entries
    go at once, not after the TTL, so they do not steer the next requests to it. Entries a later decision renewed
    (that request may be computing them), other pods' entries and confirmed blocks stay."""
    index = PrefixIndex()
    assert feed(index, "a", stored(PROMPT[:2]))
    refused = index.add_provisional("a", PROMPT[:6], now=0.0, ttl=5.0)
    index.add_provisional("b", PROMPT[:6], now=0.0, ttl=5.0)
    assert blocks(index, now=1.0) == {"a": 6, "b": 6}
    index.drop_provisional("a", PROMPT[:6], refused)
    assert blocks(index, now=1.0) == {"a": 2, "b": 6}  # a's confirmed blocks stay
    assert index.match(PROMPT, now=1.0)["a"].provisional == 0

    first = index.add_provisional("a", PROMPT[:4], now=2.0, ttl=5.0)
    index.add_provisional("a", PROMPT[:3], now=3.0, ttl=5.0)  # a later request renews three of them
    index.drop_provisional("a", PROMPT[:4], first)
    assert blocks(index, now=3.5)["a"] == 3
    index.drop_provisional("c", PROMPT, 0.0)  # a pod the index never knew: nothing to do
    assert blocks(index, now=8.5) == {"a": 2}  # the rest expire as before


def test_provisional_entries_are_confirmed_or_dropped_by_events() -> None:
    index = PrefixIndex()
    index.add_provisional("a", PROMPT[:4], now=0.0, ttl=5.0)
    feed(index, "a", stored(PROMPT[:2]))  # confirmed: real now, and past the ttl too
    assert index.match(PROMPT, now=1.0)["a"].provisional == 2
    assert blocks(index, now=9.0) == {"a": 2}

    index.add_provisional("a", PROMPT[:4], now=10.0, ttl=5.0)
    feed(index, "a", removed(PROMPT[2:3]))  # the pod says it does not hold block 2
    assert blocks(index, now=11.0) == {"a": 2}

    index.add_provisional("a", PROMPT[:4], now=20.0, ttl=5.0)
    feed(index, "a", cleared("device"))
    assert blocks(index, now=21.0) == {}


def test_match_is_limited_to_the_pods_asked_about() -> None:
    index = PrefixIndex()
    for pod in ("a", "b", "c"):
        feed(index, pod, stored(PROMPT))
    assert sorted(index.match(PROMPT, pods=["a", "c"])) == ["a", "c"]


def test_remove_pod_forgets_it_and_frees_its_bit() -> None:
    index = PrefixIndex()
    feed(index, "a", stored(PROMPT[:3]))
    feed(index, "b", stored(PROMPT[:5]))
    index.add_provisional("a", PROMPT, now=0.0, ttl=10.0)
    index.remove_pod("a")
    index.remove_pod("never-seen")
    assert index.pods() == ["b"]
    assert index.resume_point("a") == (None, 0)
    assert blocks(index, now=1.0) == {"b": 5}

    feed(index, "c", stored(PROMPT[:1]))  # takes a's bit: nothing of a may show through
    assert blocks(index, now=1.0) == {"b": 5, "c": 1}
    index.remove_pod("b")
    index.remove_pod("c")
    assert index.size() == 0


def test_64_pods_and_500_blocks() -> None:
    """The decision-latency case of the targets (an 8,000-token prompt, 64 pods); timing is printed, not
    asserted, since CI machines vary."""
    rng = random.Random(0)
    prompt = block_hashes([rng.randrange(50000) for _ in range(8000)])
    assert len(prompt) == 500
    index = PrefixIndex()
    expected = {}
    for i in range(64):
        pod = f"pod-{i:02d}"
        held = 500 if i % 4 == 0 else rng.randrange(1, 500)
        tier = TIERS[i % 3]
        feed(index, pod, stored(prompt[:held], tier), stored([rng.getrandbits(64) for _ in range(2000)]))
        expected[pod] = PrefixMatch(held, {t: held if t == tier else 0 for t in TIERS}, 0)
    index.add_provisional("pod-01", prompt, now=0.0, ttl=60.0)  # pod-01 holds a prefix on host, then guesses
    on_host = expected["pod-01"].blocks
    expected["pod-01"] = PrefixMatch(500, {"device": 500 - on_host, "host": on_host, "disk": 0}, 500 - on_host)

    assert index.match(prompt, now=1.0) == expected
    runs = []
    for _ in range(200):
        start = time.perf_counter()
        index.match(prompt, now=1.0)
        runs.append(time.perf_counter() - start)
    runs.sort()
    print(f"\nmatch, 64 pods x 500 blocks: p50 {runs[100] * 1e3:.3f} ms, p99 {runs[197] * 1e3:.3f} ms")


def test_match_agrees_with_a_plain_model_of_the_events() -> None:
    """Random streams against a per-pod set model: tiers, holes, moves, clears, provisional entries, and pods
    leaving the pool (their bit then goes to the next pod to arrive)."""
    rng = random.Random(1)
    trunk = list(range(16 * 6))
    prompts = [block_hashes(trunk + [rng.randrange(1000) for _ in range(16 * 10)]) for _ in range(3)]
    pods = ["a", "b", "c", "d"]
    index = PrefixIndex()
    real: dict[str, dict[str, set[int]]] = {p: {t: set() for t in TIERS} for p in pods}
    guessed: dict[str, dict[int, float]] = {p: {} for p in pods}
    now = 0.0
    for _ in range(600):
        pod, prompt = rng.choice(pods), rng.choice(prompts)
        start = rng.randrange(len(prompt))
        hashes = prompt[start : rng.randrange(start, len(prompt)) + 1]
        tier = rng.choice([*TIERS, None])
        op = rng.choice(["stored", "stored", "removed", "cleared", "guess", "guess", *(["leave"] if rng.random() < 0.1
                                                                                       else [])])
        now += rng.random()
        if op == "leave":
            index.remove_pod(pod)
            real[pod] = {t: set() for t in TIERS}
            guessed[pod] = {}
            continue
        if op == "guess":
            ttl = rng.uniform(0.5, 4.0)
            index.add_provisional(pod, hashes, now, ttl)
            guessed[pod].update(dict.fromkeys(hashes, now + ttl))
            continue
        event = {"stored": stored, "removed": removed}[op](hashes, tier) if op != "cleared" else cleared(tier)
        assert feed(index, pod, event)
        tiers = TIERS if tier is None else (tier,)
        if op == "stored":
            real[pod][tier or "device"].update(hashes)
        for t in tiers:
            if op == "removed":
                real[pod][t].difference_update(hashes)
            elif op == "cleared":
                real[pod][t].clear()
        if op == "cleared" and tier in (None, "device"):
            guessed[pod].clear()
        elif op != "cleared":
            for h in hashes:
                guessed[pod].pop(h, None)

        for prompt in prompts:
            expected = {}
            for p in pods:
                by_tier, only_guessed = dict.fromkeys(TIERS, 0), 0
                for h in prompt:
                    tiers_held = [t for t in TIERS if h in real[p][t]]
                    if tiers_held:
                        by_tier[tiers_held[0]] += 1
                    elif guessed[p].get(h, 0.0) > now:
                        by_tier["device"] += 1
                        only_guessed += 1
                    else:
                        break
                if sum(by_tier.values()):
                    expected[p] = PrefixMatch(sum(by_tier.values()), by_tier, only_guessed)
            assert index.match(prompt, now=now) == expected
    assert index.size() == len(set().union(*(s for tiers in real.values() for s in tiers.values())))
