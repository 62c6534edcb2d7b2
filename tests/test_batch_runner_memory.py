"""What a replica's batch runner keeps of a batch's parsed input file: only while the batch is paused between turns
(its next turn reuses it, not reading and parsing the file again). However a batch ends (completed, cancelled,
expired, failed, its run raising) the runner lets go of it: parsed requests weigh several times their file (up to
~440 MiB for a 100 MiB file) and may be a deleted file's, so keeping them was a leak and a retention problem.

The store is the real one on SQLite and the runner is real; the pool is an instant scripted `send`: what the runner
keeps does not depend on what the pool answers, and a real engine would only make each batch slower."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmesh.router import batch_runner
from kvmesh.router.batch_runner import Answer, BatchRunner, BatchSettings
from kvmesh.router.batch_store import BatchStore, ClaimedBatch
from kvmesh.router.batches import CheckedInput

from .test_batch import FAST, TENANT, Counters, chat, line, new_batch, run_claimed, served


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BatchStore]:
    batches = BatchStore(f"sqlite:///{tmp_path / 'pool.db'}")
    yield batches
    batches.close()


async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
    return served(body)


def broken(pseudonym: str) -> str:
    raise RuntimeError("a bug in the runner")


def cancelled_batch(store: BatchStore) -> str:
    batch_id = new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(3)])
    store.cancel(TENANT, batch_id)
    return batch_id


# how each ending is made: the batch, and the tenant_of the runner is given
ENDINGS: dict[str, tuple[Callable[[BatchStore], str], Callable[[str], str | None], str | None]] = {
    "completed": (lambda s: new_batch(s, [line(f"r{i}", chat("s", f"q{i}")) for i in range(3)]),
                  lambda p: "default", "completed"),
    "cancelled": (cancelled_batch, lambda p: "default", "cancelled"),
    "expired": (lambda s: new_batch(s, [line(f"r{i}", chat("s", f"q{i}")) for i in range(3)], window=0),
                lambda p: "default", "expired"),
    "failed": (lambda s: new_batch(s, [line("r0", chat("s", "q0"))]), lambda p: None, "failed"),
    "raised": (lambda s: new_batch(s, [line("r0", chat("s", "q0"))]), broken, None),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_batch_that_ended_leaves_no_parsed_input_in_the_runner(store: BatchStore, ending: str) -> None:
    make, tenant_of, status = ENDINGS[ending]
    batch_id = make(store)
    runner = BatchRunner(store, send, tenant_of, Counters(), FAST)
    if status is None:  # the run raised: serve_forever counts it and runs the batch again later
        with pytest.raises(RuntimeError, match="a bug in the runner"):
            asyncio.run(run_claimed(runner, store))
    else:
        asyncio.run(run_claimed(runner, store))
        batch = store.batch(TENANT, batch_id)
        assert batch is not None and batch["status"] == status
    assert runner._checked == {}


def test_a_batch_taking_turns_is_parsed_once_and_let_go_when_it_completes(
        store: BatchStore, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str] = []
    check = batch_runner.check_stored_input

    def counted(store: BatchStore, batch: ClaimedBatch, max_requests: int) -> CheckedInput | None:
        parsed.append(batch.id)
        return check(store, batch, max_requests)

    monkeypatch.setattr(batch_runner, "check_stored_input", counted)

    async def slow_send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        await asyncio.sleep(0.01)  # a turn of 0.05 s ends before the long batch's 40 requests are answered
        return served(body)

    long = new_batch(store, [line(f"a{i}", chat("s", f"a{i}")) for i in range(40)])
    short = new_batch(store, [line(f"b{i}", chat("s", f"b{i}")) for i in range(3)])
    counters = Counters()
    runner = BatchRunner(store, slow_send, lambda p: "default", counters,
                         BatchSettings(concurrency=1, flush_seconds=0.02, lease_seconds=5, poll_seconds=0.02,
                                       turn_seconds=0.05))
    turns: list[str] = []
    held_between_turns: list[bool] = []
    run = runner.run

    async def watched(batch: ClaimedBatch) -> None:
        turns.append(batch.id)
        await run(batch)
        held_between_turns.append(batch.id in runner._checked)

    runner.run = watched  # type: ignore[method-assign]

    async def scenario() -> None:
        task = asyncio.create_task(runner.serve_forever())
        while len(counters.ended) < 2:
            await asyncio.sleep(0.02)
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert counters.ended == ["completed", "completed"]
    assert turns.count(long) >= 2  # it yielded to the short one at least once
    assert parsed.count(long) == 1 and parsed.count(short) == 1  # its later turns reused the parsed input
    last = {batch_id: i for i, batch_id in enumerate(turns)}
    assert held_between_turns == [i != last[b] for i, b in enumerate(turns)]  # kept after a yielded turn, not its last
    assert runner._checked == {}
