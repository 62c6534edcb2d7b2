"""The global prefix index: which pods (and tiers) hold each block hash, built from every pod's KV event stream.

Pods are bits of an integer: each block hash maps to one bitset per tier, so a lookup narrows the set of pods
still matching with one `&` whatever the pool's size, and a run of blocks with the same holders (most of a
shared prefix) is one step. Each pod also keeps its own hash sets, so clearing a tier, replacing a pod from a
snapshot or dropping it touches only that pod's blocks. Pure and without I/O: pods.py feeds it batches and
snapshots, the request path asks it for matches.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from kvmesh.engine.protocol import TIERS, KVBlocksSnapshot, KVEvent, KVEventBatch

_TIER_INDEX = {tier: i for i, tier in enumerate(TIERS)}  # device first: lower index = better tier
_NOT_HELD = [0] * (len(TIERS) + 1)  # per tier, then any tier
_NOBODY = (0,) * (len(TIERS) + 1)  # a walk state with no pod in any tier column, nor in the provisional one


class PrefixMatch(NamedTuple):
    """How much of a request's prefix one pod holds (a named tuple: one is built per pod on every request)."""

    blocks: int  # consecutive leading blocks held
    by_tier: dict[str, int]  # how many of those blocks are best served from each tier (every tier present)
    provisional: int  # how many of them are only provisional (counted under "device": the pod computes them)


class _Walk:
    """One match walk: the pods still matching, and per column (each tier, then "only provisional") when each
    pod entered it and how many blocks it spent there. State changes only where some pod's best tier or
    membership changes, so the work is per change, not per block and pod."""

    def __init__(self, alive: int) -> None:
        self.alive = alive
        self.state: Sequence[int] = _NOBODY
        self.opened: list[dict[int, int]] = [{} for _ in _NOBODY]  # column -> pod bit index -> start block
        self.counts: list[dict[int, int]] = [{} for _ in _NOBODY]  # column -> pod bit index -> blocks

    def step(self, tiers: list[int], provisional: int, pos: int) -> bool:
        """Block `pos` is held by the pods of the tier bitsets `tiers` (the last: any tier), and only
        provisionally by those of `provisional`. False when no pod matches any more."""
        held_anywhere = tiers[-1]
        alive = self.alive
        provisional &= alive & ~held_anywhere
        alive &= held_anywhere | provisional
        self.alive = alive
        if not alive:
            return False
        best = []
        covered = 0
        for mask in tiers[:-1]:
            best.append(mask & alive & ~covered)
            covered |= mask
        best[0] |= provisional
        best.append(provisional)
        self.switch(best, pos)
        return True

    def switch(self, state: Sequence[int], pos: int) -> None:
        """From block `pos` on, column k holds the pods of bitset state[k]."""
        for k, after in enumerate(state):
            before = self.state[k]
            if before == after:
                continue
            counts, opened = self.counts[k], self.opened[k]
            left = before & ~after  # the set bits, lowest first, inline: this is the walk's inner loop
            while left:
                low = left & -left
                index = low.bit_length() - 1
                counts[index] = counts.get(index, 0) + pos - opened.pop(index)
                left ^= low
            joined = after & ~before
            while joined:
                low = joined & -joined
                opened[low.bit_length() - 1] = pos
                joined ^= low
        self.state = state


class PrefixIndex:
    """Block hash -> the pods (and tiers) holding it; fed by each pod's event batches; pure, no I/O."""

    def __init__(self) -> None:
        self._masks: dict[int, list[int]] = {}  # hash -> per tier, then in any tier: bitsets of pods holding it
        self._held: dict[str, list[set[int]]] = {}  # pod -> per tier, its hashes (to clear or drop a pod)
        self._bits: dict[str, int] = {}  # pod -> its bit index
        self._names: dict[int, str] = {}
        self._streams: dict[str, tuple[str | None, int]] = {}  # pod -> (boot id, last seq applied)
        self._provisional: dict[int, dict[str, float]] = {}  # hash -> pod -> expires at
        self._provisional_pods: dict[int, int] = {}  # hash -> bitset of the pods in _provisional[hash]
        self._expiry: list[tuple[float, int, str, tuple[int, ...]]] = []  # heap of provisional decisions
        self._tick = itertools.count()  # orders equal expiry times in the heap

    # ---- feeding ---------------------------------------------------------------------------------------------

    def apply(self, pod: str, batch: KVEventBatch) -> bool:
        """Apply one batch of `pod`'s stream; False (nothing applied) when the pod must be resynced from a
        snapshot: a reset, another boot id, or a gap in the sequence. Repeated batches are ignored."""
        boot_id, last = self.resume_point(pod)
        if batch.reset or (boot_id is not None and batch.boot_id != boot_id):
            return False
        if batch.seq <= last:
            return True
        if batch.seq != last + 1:
            return False
        self._bit(pod)
        for event in batch.events:
            self._apply_event(pod, event)
        self._streams[pod] = (batch.boot_id, batch.seq)
        return True

    def load_snapshot(self, pod: str, snapshot: KVBlocksSnapshot) -> None:
        """Replace everything known of `pod` (provisional entries too) with its /v1/kv/blocks snapshot."""
        self._forget_blocks(pod)
        self._drop_provisional(pod)
        bit = 1 << self._bit(pod)
        held = self._held[pod]
        for name, hashes in snapshot.blocks.items():
            for tier in _tier_indices(name):
                self._store(bit, held, tier, hashes)
        self._streams[pod] = (snapshot.boot_id, snapshot.seq)

    def add_provisional(self, pod: str, block_hashes: Sequence[int], now: float, ttl: float) -> float:
        """Record the router's own decision to send these blocks to `pod`, trusted until `now + ttl` or until
        the pod's events confirm (stored) or contradict (removed) it: back-to-back requests then find the
        prefix before its events arrive. Returns the expiry, which names this decision to `drop_provisional`."""
        self._expire(now)
        expires = now + ttl
        bit = 1 << self._bit(pod)
        for h in block_hashes:
            self._provisional.setdefault(h, {})[pod] = expires
            self._provisional_pods[h] = self._provisional_pods.get(h, 0) | bit
        heapq.heappush(self._expiry, (expires, next(self._tick), pod, tuple(block_hashes)))
        return expires

    def drop_provisional(self, pod: str, block_hashes: Iterable[int], expires: float) -> None:
        """Withdraw the decision `add_provisional` recorded with expiry `expires`: the pod refused the request
        or failed before taking it, so it will not compute these blocks, and leaving them would credit it with
        a prefix it lacks (steering more traffic to a pod that refuses). Entries a later decision renewed stay
        (that request may be computing them); confirmed blocks are not touched."""
        if pod not in self._bits:
            return
        self._unprovision(pod, [h for h in block_hashes if self._provisional.get(h, {}).get(pod) == expires])

    def remove_pod(self, pod: str) -> None:
        """Forget a pod that left the pool; its bit is free for the next one."""
        if pod not in self._bits:
            return
        self._forget_blocks(pod)
        self._drop_provisional(pod)
        del self._held[pod]
        del self._names[self._bits.pop(pod)]
        self._streams.pop(pod, None)

    # ---- reading ---------------------------------------------------------------------------------------------

    def resume_point(self, pod: str) -> tuple[str | None, int]:
        """(boot id, last seq) to reconnect with ?after=&boot_id=; (None, 0) for a pod never read."""
        return self._streams.get(pod, (None, 0))

    def size(self) -> int:
        """Distinct block hashes held by any pod (provisional entries not counted)."""
        return len(self._masks)

    def held_blocks(self, pod: str) -> dict[str, int]:
        """Blocks `pod` holds per tier (TIERS) as its events and snapshots told (provisional entries not counted)."""
        held = self._held.get(pod)
        return {tier: len(held[i]) if held else 0 for i, tier in enumerate(TIERS)}

    def pods(self) -> list[str]:
        """The pods the index knows, from events, a snapshot or a provisional entry."""
        return sorted(self._bits)

    def match(
        self, block_hashes: Sequence[int], pods: Iterable[str] | None = None, now: float | None = None
    ) -> dict[str, PrefixMatch]:
        """Per pod holding at least the first block: its consecutive leading blocks of `block_hashes` and their
        best tiers. Provisional entries count when unexpired at `now` (with `now` None, only confirmed blocks);
        those expired by `now` are dropped on the way (`now` only moves forward: the router's monotonic clock).

        One walk over the hashes, narrowing a bitset of the pods still matching and stopping when it is empty;
        pods are counted per run of blocks with the same holders, not per block.
        """
        if now is not None:
            self._expire(now)
        walk = _Walk(self._mask_of(self._bits if pods is None else pods))
        walk.switch(_NOBODY, self._walk(walk, block_hashes, self._provisional_pods if now is not None else {}))
        *tiers_counts, provisional_counts = walk.counts
        by_pod: dict[int, dict[str, int]] = {}  # pod bit index -> blocks per tier, every tier present
        for tier, column in zip(TIERS, tiers_counts, strict=True):
            for index, blocks in column.items():
                by_tier = by_pod.get(index)
                if by_tier is None:
                    by_tier = by_pod[index] = dict.fromkeys(TIERS, 0)
                by_tier[tier] = blocks
        names = self._names
        return {names[index]: PrefixMatch(sum(by_tier.values()), by_tier, provisional_counts.get(index, 0))
                for index, by_tier in by_pod.items()}

    # ---- internals -------------------------------------------------------------------------------------------

    def _walk(self, walk: _Walk, block_hashes: Sequence[int], provisional: Mapping[int, int]) -> int:
        """Feed `walk` the holders of each block; returns the number of blocks walked before no pod matched.

        Consecutive blocks of a prefix usually have the same holders: those runs are found by C-level
        iteration (groupby over the bitset lists) and stepped once. Only where a pod still matching lacks a
        block is each block's entry in `provisional` (hash -> bitset of pods) read."""
        pos = 0
        for held, run in itertools.groupby(map(self._masks.get, block_hashes)):
            length = len(list(run))
            tiers = held or _NOT_HELD
            lacking = walk.alive & ~tiers[-1]  # pods still matching that lack these blocks: guessed ones?
            if lacking and provisional and provisional.get(block_hashes[pos], 0) & lacking:
                at = pos
                for extra, guessed in itertools.groupby(map(provisional.get, block_hashes[pos : pos + length])):
                    if not walk.step(tiers, extra or 0, at):
                        return at
                    if not walk.alive & ~tiers[-1]:  # only holders left: the rest of the run changes nothing
                        break
                    at += len(list(guessed))
            elif not walk.step(tiers, 0, pos):
                return pos
            pos += length
        return pos

    def _bit(self, pod: str) -> int:
        """The pod's bit index, assigning the lowest free one to a new pod."""
        if pod not in self._bits:
            index = next(i for i in itertools.count() if i not in self._names)
            self._bits[pod] = index
            self._names[index] = pod
            self._held[pod] = [set() for _ in TIERS]
        return self._bits[pod]

    def _mask_of(self, pods: Iterable[str]) -> int:
        mask = 0
        for pod in pods:
            if pod in self._bits:
                mask |= 1 << self._bits[pod]
        return mask

    def _apply_event(self, pod: str, event: KVEvent) -> None:
        bit = 1 << self._bits[pod]
        held = self._held[pod]
        if event.kind == "stored":
            for tier in _tier_indices(event.tier or TIERS[0]):  # an untiered store is device, as in the engine
                self._store(bit, held, tier, event.block_hashes)
            self._unprovision(pod, event.block_hashes)
        elif event.kind == "removed":
            for tier in _tier_indices(event.tier):
                self._unstore(bit, held, tier, event.block_hashes)
            self._unprovision(pod, event.block_hashes)
        elif event.kind == "cleared":
            for tier in _tier_indices(event.tier):
                self._unstore(bit, held, tier, list(held[tier]))
            if event.tier in (None, TIERS[0]):  # provisional blocks are device blocks
                self._drop_provisional(pod)

    def _store(self, bit: int, held: list[set[int]], tier: int, hashes: Iterable[int]) -> None:
        for h in hashes:
            masks = self._masks.get(h)
            if masks is None:
                masks = self._masks[h] = [0] * (len(TIERS) + 1)
            masks[tier] |= bit
            masks[-1] |= bit
            held[tier].add(h)

    def _unstore(self, bit: int, held: list[set[int]], tier: int, hashes: Iterable[int]) -> None:
        for h in hashes:
            masks = self._masks.get(h)
            if masks is None:
                continue
            masks[tier] &= ~bit
            held[tier].discard(h)
            if not any(m & bit for m in masks[:-1]):
                masks[-1] &= ~bit
            if not masks[-1]:
                del self._masks[h]

    def _forget_blocks(self, pod: str) -> None:
        if pod not in self._bits:
            return
        bit = 1 << self._bits[pod]
        held = self._held[pod]
        for tier in range(len(TIERS)):
            self._unstore(bit, held, tier, list(held[tier]))

    def _unprovision(self, pod: str, hashes: Iterable[int]) -> None:
        for h in hashes:
            holders = self._provisional.get(h)
            if holders is None or holders.pop(pod, None) is None:
                continue
            if holders:
                self._provisional_pods[h] &= ~(1 << self._bits[pod])
            else:
                del self._provisional[h], self._provisional_pods[h]

    def _drop_provisional(self, pod: str) -> None:
        """Forget every provisional entry of `pod` (rare: a cleared cache, a snapshot, a pod leaving)."""
        self._unprovision(pod, [h for h, holders in self._provisional.items() if pod in holders])

    def _expire(self, now: float) -> None:
        """Drop provisional entries past their time, oldest decisions first (bounds the memory they take)."""
        while self._expiry and self._expiry[0][0] <= now:
            _, _, pod, hashes = heapq.heappop(self._expiry)
            for h in hashes:
                holders = self._provisional.get(h)
                # A later decision may have renewed the entry: only an entry that is itself expired goes.
                expires = None if holders is None else holders.get(pod)
                if expires is not None and expires <= now:
                    self._unprovision(pod, (h,))


def _tier_indices(tier: str | None) -> list[int]:
    """The tiers an event names: all for None; none for a tier this router does not know (a newer engine's),
    which is skipped rather than failing the pod's whole stream."""
    if tier is None:
        return list(range(len(TIERS)))
    return [_TIER_INDEX[tier]] if tier in _TIER_INDEX else []
