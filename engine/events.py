"""The KV event log (docs/contracts.md, contract 2): numbered batches under a boot id, kept for resuming readers.

The log also keeps the set of cached block hashes per tier, applied from the same events under the same
lock, so the /v1/kv/blocks snapshot is exactly the state after batch `seq` and a reader can switch from the
snapshot to the stream without a gap.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable

from kvmesh.engine.protocol import TIERS, KVBlocksSnapshot, KVEvent, KVEventBatch

log = logging.getLogger("kvmesh.engine.events")


class EventLog:
    def __init__(self, capacity: int = 10000) -> None:
        self.boot_id = uuid.uuid4().hex
        self._batches: deque[KVEventBatch] = deque(maxlen=capacity)
        self._pending: list[KVEvent] = []
        self._seq = 0
        self._blocks: dict[str, set[int]] = {tier: set() for tier in TIERS}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    @property
    def seq(self) -> int:
        return self._seq

    def record(self, event: KVEvent) -> None:
        """Collect an event of the current step (engine thread); `flush` publishes them as one batch."""
        self._pending.append(event)

    def flush(self) -> None:
        """Publish the events recorded since the last flush as one numbered batch."""
        if not self._pending:
            return
        events, self._pending = tuple(self._pending), []
        with self._lock:
            self._seq += 1
            self._batches.append(KVEventBatch(self.boot_id, self._seq, events))
            for event in events:
                self._apply(event)
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:  # a reader's closed loop must not fail the engine's step
                log.exception("KV event listener failed")

    def _apply(self, event: KVEvent) -> None:
        tiers = TIERS if event.tier is None else (event.tier,)
        if event.kind == "stored":
            self._blocks[tiers[0]].update(event.block_hashes)
        elif event.kind == "removed":
            for tier in tiers:
                self._blocks[tier].difference_update(event.block_hashes)
        else:
            for tier in tiers:
                self._blocks[tier].clear()

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener` (from the engine thread) after each published batch; returns the unsubscriber."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def read(self, after: int, boot_id: str | None = None) -> list[KVEventBatch]:
        """Batches with seq > `after`. When the reader's boot id is another one, or batches it missed are no
        longer kept, the answer is a single reset batch: forget this pod and read the snapshot."""
        with self._lock:
            oldest = self._batches[0].seq if self._batches else self._seq + 1
            if (boot_id is not None and boot_id != self.boot_id) or after > self._seq or after + 1 < oldest:
                return [KVEventBatch(self.boot_id, self._seq, reset=True)]
            return [b for b in self._batches if b.seq > after]

    def snapshot(self) -> KVBlocksSnapshot:
        with self._lock:
            return KVBlocksSnapshot(self.boot_id, self._seq, {t: sorted(h) for t, h in self._blocks.items()})
