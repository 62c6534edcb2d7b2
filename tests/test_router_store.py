"""The request log: round trips, several writers on one SQLite file, summary arithmetic, a background writer
that survives a broken database, and a schema with nowhere to put a prompt."""

from __future__ import annotations

import logging
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import Float, Integer, String, inspect, text

from kvmesh.engine.protocol import WORKLOAD_CLASSES
from kvmesh.router.auth import tenant_hash
from kvmesh.router.store import (
    MAX_LEN,
    RECORD_FIELDS,
    TABLE_NAME,
    AsyncRequestLog,
    RequestLog,
    RequestRecord,
    RequestRow,
)

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


def rec(**kw: object) -> RequestRecord:
    fields: dict[str, object] = {
        "pool": "pool-a",
        "tenant": tenant_hash("acme"),
        "workload": WORKLOAD_CLASSES[0],
        "route": "aggregated",
        "outcome": "ok",
        "status_code": 200,
        "prompt_tokens": 100,
        "cached_tokens": 40,
        "predicted_cached_tokens": 32,
        "output_tokens": 10,
        "ttft_seconds": 0.1,
        "mean_itl_seconds": 0.01,
        "e2e_seconds": 0.2,
        "pods": "engine-0",
        "model": "smollm2",
        "ts": T0,
    }
    fields.update(kw)
    return RequestRecord(**fields)  # type: ignore[arg-type]


@pytest.fixture
def db_url(database_url: str) -> str:
    """Each test on a SQLite file and on PostgreSQL (conftest's database_url)."""
    return database_url


@pytest.fixture
def store(db_url: str):
    log = RequestLog(db_url)
    yield log
    log.close()


def test_round_trip_keeps_every_field(store: RequestLog) -> None:
    records = [
        rec(),
        rec(
            ts=T0 + timedelta(seconds=1),
            outcome="error",
            status_code=502,
            priority=-3,
            ttft_seconds=None,
            mean_itl_seconds=None,
            e2e_seconds=None,
            pods="p-0,d-1",
            route="disaggregated",
            retries=2,
        ),
    ]
    store.write(records)
    store.write([])
    got = store.recent()
    assert got == records  # dataclass equality: every field, timestamps aware and in UTC
    assert all(r.ts.tzinfo is not None and r.ts.utcoffset() == timedelta(0) for r in got)


def test_sqlite_file_is_in_wal_mode(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'requests.db'}"
    store = RequestLog(db_url)
    with store.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() >= 1000
    # A second process (here: a plain sqlite3 connection) sees WAL persisted in the file.
    with sqlite3.connect(db_url.removeprefix("sqlite:///")) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_recent_filters_orders_and_limits(store: RequestLog) -> None:
    store.write([rec(ts=T0 + timedelta(seconds=i), pool="a" if i % 2 else "b", output_tokens=i) for i in range(10)])
    assert [r.output_tokens for r in store.recent()] == list(range(10))  # oldest first
    assert [r.output_tokens for r in store.recent(limit=3)] == [7, 8, 9]  # the latest three
    assert [r.output_tokens for r in store.recent(pool="a")] == [1, 3, 5, 7, 9]
    since = T0 + timedelta(seconds=6)
    assert [r.output_tokens for r in store.recent(since=since, pool="b")] == [6, 8]
    # Another zone for `since` means the same instant.
    since_tokyo = since.astimezone(ZoneInfo("Asia/Tokyo"))
    assert [r.output_tokens for r in store.recent(since=since_tokyo)] == [6, 7, 8, 9]
    with pytest.raises(ValueError, match="timezone-aware"):
        store.recent(since=datetime(2025, 1, 1))


def test_two_replicas_write_one_file_concurrently(db_url: str) -> None:
    """Two RequestLog instances (two router replicas) and four threads each: every row arrives."""
    replicas = [RequestLog(db_url), RequestLog(db_url)]
    threads_per, batches, batch = 4, 25, 20
    failures: list[BaseException] = []

    def writer(log: RequestLog, worker: int) -> None:
        try:
            for b in range(batches):
                log.write([rec(pods=f"w{worker}", output_tokens=b * batch + i) for i in range(batch)])
        except BaseException as e:
            failures.append(e)

    threads = [
        threading.Thread(target=writer, args=(log, r * threads_per + t))
        for r, log in enumerate(replicas)
        for t in range(threads_per)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    rows = replicas[0].recent(limit=100_000)
    assert len(rows) == 2 * threads_per * batches * batch
    per_worker: dict[str, set[int]] = {}
    for r in rows:
        per_worker.setdefault(r.pods, set()).add(r.output_tokens)
    assert all(v == set(range(batches * batch)) for v in per_worker.values()) and len(per_worker) == 8
    assert replicas[1].summary()["requests"] == len(rows)
    for log in replicas:
        log.close()


def test_summary_arithmetic(store: RequestLog) -> None:
    assert store.summary()["requests"] == 0
    assert store.summary()["hit_ratio"] is None and store.summary()["mean_ttft_seconds"] is None
    store.write(
        [
            rec(prompt_tokens=100, cached_tokens=50, predicted_cached_tokens=48, ttft_seconds=0.2),
            rec(prompt_tokens=300, cached_tokens=250, predicted_cached_tokens=256, ttft_seconds=0.4, retries=1),
            rec(workload=WORKLOAD_CLASSES[1], outcome="shed", status_code=429, prompt_tokens=1000, cached_tokens=0,
                predicted_cached_tokens=0, ttft_seconds=None, mean_itl_seconds=None, e2e_seconds=None),
            rec(outcome="client_gone", status_code=200, prompt_tokens=50, cached_tokens=0, ttft_seconds=0.6),
            rec(pool="other", prompt_tokens=7, cached_tokens=7, ttft_seconds=9.0, ts=T0 - timedelta(hours=1)),
        ]
    )  # fmt: skip
    s = store.summary(pool="pool-a")
    assert s["requests"] == 4
    assert s["outcomes"] == {"ok": 2, "error": 0, "shed": 1, "rate_limited": 0, "no_pod": 0, "client_gone": 1}
    assert s["workloads"][WORKLOAD_CLASSES[0]] == 3 and s["workloads"][WORKLOAD_CLASSES[1]] == 1
    assert set(WORKLOAD_CLASSES) <= set(s["workloads"])  # every class present, at 0 when unseen
    assert s["routes"] == {"aggregated": 4}
    # Tokens and hit ratios over completed requests only.
    assert (s["prompt_tokens"], s["cached_tokens"], s["predicted_cached_tokens"]) == (400, 300, 304)
    assert s["hit_ratio"] == pytest.approx(300 / 400)
    assert s["predicted_hit_ratio"] == pytest.approx(304 / 400)
    assert s["output_tokens"] == 20
    # Latency means over the rows that recorded one (the shed request has none).
    assert s["mean_ttft_seconds"] == pytest.approx((0.2 + 0.4 + 0.6) / 3)
    assert s["mean_e2e_seconds"] == pytest.approx(0.2)
    assert s["retries"] == 1
    assert s["first_ts"] == T0 and s["last_ts"] == T0
    everything = store.summary()
    assert everything["requests"] == 5 and everything["first_ts"] == T0 - timedelta(hours=1)
    assert store.summary(since=T0 - timedelta(minutes=1))["requests"] == 4


def test_async_log_batches_by_size_and_interval(store: RequestLog) -> None:
    writes: list[int] = []
    real_write = store.write

    def counting_write(records):  # type: ignore[no-untyped-def]
        writes.append(len(records))
        real_write(records)

    store.write = counting_write  # type: ignore[method-assign]
    buffered = AsyncRequestLog(store, batch_size=10, interval=0.2)
    for i in range(25):
        buffered.submit(rec(output_tokens=i))
    buffered.flush()
    assert buffered.pending == 0 and buffered.written == 25 and buffered.errors == 0
    assert sum(writes) == 25 and max(writes) <= 10
    assert sorted(r.output_tokens for r in store.recent()) == list(range(25))

    # A lone record goes out within the interval, without a flush.
    writes.clear()
    buffered.submit(rec(output_tokens=99))
    deadline = threading.Event()
    for _ in range(50):
        if writes:
            break
        deadline.wait(0.05)
    assert writes == [1]
    buffered.close()
    buffered.close()  # idempotent
    buffered.submit(rec())  # after close: counted, not raised
    assert buffered.dropped == 1
    assert len(store.recent()) == 26


def test_async_log_survives_a_broken_database(store: RequestLog, caplog: pytest.LogCaptureFixture) -> None:
    buffered = AsyncRequestLog(store, batch_size=5, interval=0.1)
    with store.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {TABLE_NAME}"))
    with caplog.at_level(logging.ERROR, logger="kvmesh.router.store"):
        for _ in range(12):
            buffered.submit(rec())  # never raises into the request handler
        buffered.flush()
    assert buffered.errors == 3  # batches of 5, 5, 2
    assert buffered.dropped == 12 and buffered.written == 0 and buffered.pending == 0
    assert "request log write failed" in caplog.text
    buffered.close()


def test_async_log_over_an_unreachable_file_counts_errors(tmp_path: Path) -> None:
    """The database's directory vanishes under a running router: errors are counted, submit stays silent."""
    folder = tmp_path / "gone"
    folder.mkdir()
    log = RequestLog(f"sqlite:///{folder / 'r.db'}")
    log.close()
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    buffered = AsyncRequestLog(log, batch_size=2, interval=0.05)
    buffered.submit(rec())
    buffered.submit(rec())
    buffered.flush()
    assert buffered.errors == 1 and buffered.dropped == 2
    buffered.close()
    with pytest.raises(Exception, match="unable to open"):  # the synchronous API does raise, loudly
        RequestLog(f"sqlite:///{tmp_path / 'missing' / 'r.db'}")


def test_async_log_bounds_its_buffer(store: RequestLog) -> None:
    gate = threading.Event()
    real_write = store.write

    def slow_write(records):  # type: ignore[no-untyped-def]
        gate.wait(5)
        real_write(records)

    store.write = slow_write  # type: ignore[method-assign]
    buffered = AsyncRequestLog(store, batch_size=2, interval=0.05, max_pending=4)
    for i in range(20):
        buffered.submit(rec(output_tokens=i))
    gate.set()
    buffered.close()
    assert buffered.pending == 0
    assert buffered.written + buffered.dropped == 20 and buffered.dropped >= 20 - 4 - 2


def test_schema_has_nowhere_to_put_prompt_text(store: RequestLog) -> None:
    columns = {c["name"]: c for c in inspect(store.engine).get_columns(TABLE_NAME)}
    assert set(columns) == {"id", *RECORD_FIELDS}
    assert not {"prompt", "messages", "text", "content", "body", "key", "api_key"} & set(columns)
    model_columns = {c.name: c.type for c in RequestRow.__table__.columns}
    strings = {name for name, t in model_columns.items() if isinstance(t, String)}
    assert strings == set(MAX_LEN) == {"pool", "tenant", "workload", "route", "outcome", "pods", "model"}
    for name in strings:  # bounded, short VARCHARs: no TEXT, no unbounded strings
        assert model_columns[name].length is not None and model_columns[name].length <= 1024
        assert type(model_columns[name]).__name__ in ("String", "VARCHAR")
    numeric = set(model_columns) - strings - {"ts"}
    assert all(isinstance(model_columns[n], Integer | Float) for n in numeric)


def test_record_validation() -> None:
    with pytest.raises(ValueError, match="outcome"):
        rec(outcome="teapot")
    with pytest.raises(ValueError, match="model"):
        rec(model="tell me a story " * 100)  # a prompt pasted in the wrong field is refused
    with pytest.raises(ValueError, match="timezone-aware"):
        rec(ts=datetime(2025, 1, 1))
    with pytest.raises(ValueError, match="prompt_tokens"):
        rec(prompt_tokens=-1)
    assert len(rec(pods=",".join(f"pod-{i}" for i in range(500))).pods) == MAX_LEN["pods"]
    now = RequestRecord(pool="p", tenant="t", workload="chat-short", route="retry", outcome="ok", status_code=200)
    assert abs((datetime.now(UTC) - now.ts).total_seconds()) < 5


def test_in_memory_sqlite_is_shared_across_threads() -> None:
    log = RequestLog("sqlite://")
    buffered = AsyncRequestLog(log, batch_size=3)
    for _ in range(3):
        buffered.submit(rec())
    buffered.close()
    assert buffered.errors == 0 and len(log.recent()) == 3
    log.close()


def test_the_log_keeps_its_retention_and_no_more(store: RequestLog) -> None:
    """Without pruning the log grows by every request for good (about 280 bytes each on PostgreSQL): rows older
    than the retention are deleted, a chunk at a time, by the writer's thread; younger ones stay."""
    now = datetime.now(UTC)
    store.write([rec(ts=now - timedelta(days=40), output_tokens=1), rec(ts=now - timedelta(days=31), output_tokens=2),
                 rec(ts=now - timedelta(days=2), output_tokens=3)])
    assert store.prune(now - timedelta(days=35), chunk=1) == 1
    assert sorted(r.output_tokens for r in store.recent()) == [2, 3]
    buffered = AsyncRequestLog(store, interval=0.05, retention_seconds=30 * 86400, prune_every=0.0)
    buffered.submit(rec(ts=now, output_tokens=4))
    for _ in range(100):
        if buffered.pruned:
            break
        threading.Event().wait(0.05)
    buffered.close()
    assert buffered.pruned == 1
    assert sorted(r.output_tokens for r in store.recent()) == [3, 4]
    idle = AsyncRequestLog(store)
    assert idle.retention_seconds is None  # the default keeps every row (a router's config sets 30 days)
    idle.close()
    from kvmesh.router.config import RouterConfig

    with pytest.raises(ValueError, match="request_log_retention_days"):
        RouterConfig(pods=["http://127.0.0.1:1"], request_log_retention_days=-1).validate()
