"""A replica's count of a batch's runs that raised (MAX_CRASHES of them in a row fail the batch) is let go once the
batch no longer needs it: when a run succeeds, when the batch is failed for it, and when it ended elsewhere. Kept
until a run here succeeded, a batch failed for its crashes, or one that crashed here and finished on another
replica, held its entry for the life of the process."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvmesh.router import batch_runner
from kvmesh.router.batch_runner import BatchRunner
from kvmesh.router.batch_store import BatchStore, ClaimedBatch

from .test_batch import FAST, TENANT, Counters, chat, line, new_batch, run_claimed
from .test_batch_runner_memory import broken, send, store
from .waiting import eventually

__all__ = ["store"]  # the fixture: a batch store on SQLite


class ClaimsOnce:
    """The store, but a replica that claims through it gets one batch and then finds none (another replica takes
    the rest)."""

    def __init__(self, store: BatchStore) -> None:
        self.store, self.claimed = store, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def claim(self, owner: str, lease_seconds: float) -> ClaimedBatch | None:
        if self.claimed:
            return None
        self.claimed = True
        return self.store.claim(owner, lease_seconds)


def test_a_batch_failed_for_its_crashes_leaves_no_count(store: BatchStore) -> None:
    batch_id = new_batch(store, [line("a", chat("s", "q"))])
    counters = Counters()
    runner = BatchRunner(store, send, broken, counters, FAST)

    async def scenario() -> None:
        task = asyncio.create_task(runner.serve_forever())
        await eventually(lambda: counters.ended)
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    batch = store.batch(TENANT, batch_id)
    assert batch is not None and batch["status"] == "failed"
    assert runner._crashes == {}


def test_a_batch_that_crashed_here_and_finished_elsewhere_leaves_no_count(
        store: BatchStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_runner, "SWEEP_SECONDS", 0.05)
    batch_id = new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(3)])
    here = BatchRunner(ClaimsOnce(store), send, broken, Counters(), FAST, owner="here")  # type: ignore[arg-type]
    elsewhere = BatchRunner(store, send, lambda pseudonym: "default", Counters(), FAST, owner="elsewhere")

    async def scenario() -> None:
        task = asyncio.create_task(here.serve_forever())
        await eventually(lambda: batch_id in here._crashes)
        await asyncio.to_thread(store.release, batch_id, "here")
        await run_claimed(elsewhere, store)
        batch = store.batch(TENANT, batch_id)
        assert batch is not None and batch["status"] == "completed"
        await eventually(lambda: not here._crashes)  # at the next sweep
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 60))
