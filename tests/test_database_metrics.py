"""The pool's database failing shows in a router's /metrics: kvmesh_router_database_errors_total{component} (at 0
from the start for every component, so an alert sees a first failure) and kvmesh_router_request_log_dropped_total.

The failures are injected (tests/test_batch_outage.Outage: every statement on an engine raises OperationalError
while it is on), as a database that went away makes the driver do; see that module's docstring for why."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from kvmesh.engine.protocol import RouterMetric
from kvmesh.router import limit_sync
from kvmesh.router.app import build_router, create_router_app
from kvmesh.router.config import RouterConfig
from kvmesh.router.limit_sync import DemandTable, LimitSync
from kvmesh.router.limits import Limiter, parse_tenants
from kvmesh.router.store import DATABASE_COMPONENTS, AsyncRequestLog, RequestLog, database_unavailable

from .test_batch_outage import Outage
from .test_router_store import rec

ERRORS, DROPPED = RouterMetric.DATABASE_ERRORS + "_total", RouterMetric.REQUEST_LOG_DROPPED + "_total"


def errors_by_component(text: str) -> dict[str, float]:
    return {c: float(v) for c, v in re.findall(rf'^{ERRORS}{{component="(\w+)"}} (\S+)$', text, re.M)}


def test_the_request_log_reports_each_failed_write_and_the_records_it_dropped(tmp_path: Path) -> None:
    store = RequestLog(f"sqlite:///{tmp_path / 'log.db'}")
    outage = Outage(store.engine)
    failed: list[int] = []
    buffered = AsyncRequestLog(store, batch_size=5, interval=0.05, on_error=lambda: failed.append(0),
                               on_dropped=failed.append)
    outage.on = True
    for _ in range(7):
        buffered.submit(rec())
    buffered.flush()
    assert failed.count(0) == 2 and sum(failed) == 7  # two failed writes (5 and 2 records), 7 records dropped
    outage.on = False
    buffered.submit(rec())
    buffered.flush()
    assert buffered.written == 1 and failed.count(0) == 2
    buffered.close()
    store.close()


def test_a_failed_demand_sync_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = DemandTable(f"sqlite:///{tmp_path / 'pool.db'}")
    outage = Outage(table.engine)
    outage.on = True
    failed: list[str] = []
    sync = LimitSync(table, Limiter(parse_tenants({"acme": {"requests_per_minute": 60}})), "replica-a",
                     lambda: failed.append("limit_sync"))
    monkeypatch.setattr(limit_sync, "SYNC_SECONDS", 0.01)

    async def scenario() -> None:
        task = asyncio.create_task(sync.run(lambda: ["acme"], lambda: False))
        while len(failed) < 2:  # the loop goes on after a failure: the shares in force stay
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    table.close()


def test_a_routers_metrics_count_database_failures_by_component(tmp_path: Path, bundled_dir: Path) -> None:
    """Every component's series is there at 0 from the start; the Files and Batches API's 503s, the request log's
    failed writes, the batch runner's failed claims and the limit split's failed reports count under their own."""
    router = build_router(RouterConfig(pods=["http://127.0.0.1:9"], database_url=f"sqlite:///{tmp_path / 'pool.db'}"),
                          bundled_dir)
    start = generate_latest(router.metrics.registry).decode()
    assert errors_by_component(start) == {c: 0.0 for c in DATABASE_COMPONENTS}
    assert f"\n{DROPPED} 0.0\n" in start
    assert router.batches is not None and router.log is not None
    assert router.limit_sync is not None
    outages = [Outage(engine) for engine in (router.batches.engine, router.log.log.engine,
                                             router.limit_sync.table.engine)]
    with TestClient(create_router_app(router)) as http:
        for outage in outages:
            outage.on = True
        answer = http.get("/v1/batches")
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "database_unavailable"
        router.log.submit(rec())
        router.log.flush()
        deadline = time.monotonic() + 30
        while min(errors_by_component(text := http.get("/metrics").text).values()) == 0:  # the sync: every 2 s
            assert time.monotonic() < deadline, errors_by_component(text)
            time.sleep(0.1)
        for outage in outages:
            outage.on = False
    counted = errors_by_component(text)  # the request log's pruning may fail too, and the 503 be logged
    assert counted["batch_api"] == 1 and min(counted.values()) >= 1
    dropped = re.search(rf"^{DROPPED} (\S+)$", text, re.M)
    assert dropped is not None and float(dropped.group(1)) >= 1


def test_a_statement_the_schema_cannot_run_is_a_bug_not_an_outage(tmp_path: Path) -> None:
    """SQLite reports a missing table as an OperationalError, as it does a full disk: it must surface as the bug it
    is (a 500 with its traceback), not as a 503 saying the database is away."""
    engine = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with engine.connect() as connection, pytest.raises(OperationalError) as missing:
        connection.execute(text("SELECT * FROM no_such_table_here"))
    assert not database_unavailable(missing.value)
    assert database_unavailable(OperationalError("SELECT 1", {}, sqlite3.OperationalError("database or disk is full")))
