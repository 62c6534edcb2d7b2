"""The Batch API while the pool's database is away: the runner keeps the answers it computed and runs no request
twice, the Files and Batches API answers 503 `database_unavailable` with Retry-After (never a bare 500), and the
failures are counted in kvmesh_router_database_errors_total.

The outage is injected, not staged: a hook on the store's sqlalchemy engine raises OperationalError from every
statement while it is on, as a stopped PostgreSQL (or a full or read-only SQLite disk) makes the driver do. Every
path the store has (the runner's writes, renewals and claims, the API's reads and uploads) meets it alike, on SQLite
and PostgreSQL, and it ends at a known moment, which a real server stopped and started could not promise a test."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event
from sqlalchemy.exc import OperationalError

from kvmesh.router.batch_api import batch_routes
from kvmesh.router.batch_runner import Answer, BatchRunner, BatchSettings
from kvmesh.router.batch_store import BatchStore
from kvmesh.router.batches import jsonl
from kvmesh.router.store import CONNECT_TIMEOUT_SECONDS

from .test_batch import TENANT, Counters, chat, line, new_batch, output_of, served


class Outage:
    """While `on`, every statement on `engine` fails as a database that went away (see the module's docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.on = False
        self.refused = 0  # statements refused while on
        event.listen(engine, "before_cursor_execute", self._statement)

    def _statement(self, conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        if self.on:
            self.refused += 1
            raise OperationalError(statement, params, Exception("connection refused (an injected outage)"))


@pytest.fixture
def store(database_url: str) -> Iterator[BatchStore]:
    batches = BatchStore(database_url)
    yield batches
    batches.close()


def test_an_outage_mid_batch_runs_each_request_once_and_writes_every_answer_when_the_database_is_back(
        store: BatchStore) -> None:
    """Two replicas; the database goes away for three leases while one of them runs a batch. The runner stops
    sending once its writes have failed for a few flush periods, keeps the answers it could not write, and writes them
    when the database is back, before the other replica may take the batch over: no request is sent twice, and the
    output file holds every answer once."""
    outage = Outage(store.engine)
    sent: collections.Counter[str] = collections.Counter()
    during: list[str] = []  # requests sent while the database was away

    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        question = body["messages"][1]["content"]
        sent[question] += 1
        if outage.on:
            during.append(question)
        if sum(sent.values()) == 10:
            outage.on = True  # mid-batch, with requests in flight
        await asyncio.sleep(0.03)
        return served(body)

    total = 60
    batch_id = new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(total)])
    settings = BatchSettings(concurrency=4, flush_seconds=0.05, lease_seconds=1.0, poll_seconds=0.05)
    counters = [Counters(), Counters()]
    failures = [0, 0]

    def failed(replica: int) -> None:
        failures[replica] += 1

    async def scenario() -> None:
        runners = [BatchRunner(store, send, lambda pseudonym: "default", counters[i], settings, owner=f"replica-{i}",
                               database_failed=lambda i=i: failed(i)) for i in range(2)]
        first = asyncio.create_task(runners[0].serve_forever())
        while not sent:
            await asyncio.sleep(0.01)
        second = asyncio.create_task(runners[1].serve_forever())  # idle: the batch is held by the first
        while not outage.on:
            await asyncio.sleep(0.01)
        await asyncio.sleep(3 * settings.lease_seconds)  # every lease runs out meanwhile
        outage.on = False
        while not counters[0].ended + counters[1].ended:
            await asyncio.sleep(0.02)
        for task in (first, second):
            task.cancel()
        await asyncio.gather(first, second, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert outage.refused > 0
    assert {q: n for q, n in sent.items() if n > 1} == {}  # no request ran twice
    assert len(sent) == total
    assert len(during) < total - 10  # sending paused: not the whole rest of the batch while nothing could be written
    batch, output, errors = output_of(store, batch_id)
    assert batch["status"] == "completed" and errors == []
    assert [x["custom_id"] for x in output] == [f"r{i}" for i in range(total)]
    assert batch["request_counts"] == {"total": total, "completed": total, "failed": 0}
    assert failures[0] > 0  # the replica running the batch counted its failed writes


def test_the_last_answers_of_a_batch_wait_for_the_database_rather_than_being_sent_again(store: BatchStore) -> None:
    """The database goes away as the last request is answered: the run's last write fails. Its answers are kept and
    written once the database is back, and the batch completes without sending any request again."""
    outage = Outage(store.engine)
    sent: collections.Counter[str] = collections.Counter()
    total = 6

    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        question = body["messages"][1]["content"]
        sent[question] += 1
        if sum(sent.values()) == total:
            outage.on = True
        return served(body)

    batch_id = new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(total)])
    settings = BatchSettings(concurrency=1, flush_seconds=0.5, lease_seconds=30, poll_seconds=0.05)
    counters = Counters()

    async def scenario() -> None:
        task = asyncio.create_task(BatchRunner(store, send, lambda pseudonym: "default", counters, settings)
                                   .serve_forever())
        while not outage.on:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        outage.on = False
        while not counters.ended:
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert outage.refused > 0 and dict(sent) == {f"q{i}": 1 for i in range(total)}
    batch, output, _ = output_of(store, batch_id)
    assert batch["status"] == "completed" and len(output) == total


def test_the_files_and_batches_api_answers_503_with_retry_after_while_the_database_is_away(
        store: BatchStore) -> None:
    """Every call that needs the database, an upload included, is a 503 with Retry-After and an OpenAI error that
    says so (code database_unavailable), counted; the same calls work again once it is back."""
    outage = Outage(store.engine)
    failures: list[str] = []
    app = FastAPI()
    app.include_router(batch_routes(store, lambda header: "default", 10**6, 10**6,
                                    database_failed=lambda: failures.append("batch_api")))
    batch_id = new_batch(store, [line("a", chat("s", "q"))])
    upload = {"files": {"file": ("in.jsonl", jsonl([line("a", chat("s", "q"))]))}, "data": {"purpose": "batch"}}
    with TestClient(app, raise_server_exceptions=False) as http:
        outage.on = True
        answers = [http.get("/v1/batches"), http.get(f"/v1/batches/{batch_id}"), http.get("/v1/files"),
                   http.post(f"/v1/batches/{batch_id}/cancel"), http.post("/v1/files", **upload),
                   http.post("/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h"})]
        for answer in answers:
            assert answer.status_code == 503, answer.text
            assert answer.headers["content-type"] == "application/json"
            assert int(answer.headers["retry-after"]) > 0
            error = answer.json()["error"]
            assert error["code"] == "database_unavailable" and error["type"] == "server_error"
            assert "database" in error["message"]
        assert failures == ["batch_api"] * len(answers)
        outage.on = False
        assert http.get(f"/v1/batches/{batch_id}").json()["id"] == batch_id
        assert http.post("/v1/files", **upload).status_code == 200
    assert store.batch(TENANT, batch_id) is not None


def test_a_replica_that_saw_the_database_fail_waits_out_a_connection_attempt_before_claiming(
        store: BatchStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder's renewal may have begun during the outage and be waiting on its connection (up to the connect
    timeout): an idle replica claiming sooner took the batch over and sent its requests in flight again. An idle
    runner meets an outage; once the database is back, it waits at least a connection attempt and two flushes
    before it claims (its waits recorded, and shortened: nothing here waits them out)."""
    outage, settings, slept = Outage(store.engine), BatchSettings(flush_seconds=0.5, poll_seconds=0.05), []
    real_sleep = asyncio.sleep

    async def recorded(delay: float, *args: Any) -> Any:
        slept.append(delay)
        return await real_sleep(min(delay, 0.01), *args)

    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        return served(body)

    async def scenario() -> None:
        task = asyncio.create_task(BatchRunner(store, send, lambda pseudonym: "default", Counters(), settings)
                                   .serve_forever())
        outage.on = True
        while not outage.refused:
            await real_sleep(0.01)
        outage.on = False
        while not slept or max(slept) <= settings.poll_seconds:
            await real_sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    monkeypatch.setattr(asyncio, "sleep", recorded)
    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert max(slept) >= CONNECT_TIMEOUT_SECONDS + 2 * settings.flush_seconds
