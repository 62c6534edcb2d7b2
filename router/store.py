"""The request log (docs/contracts.md, contract 6): one row per request, numbers only, never prompt text.

Every router replica of a pool writes to the same database: a SQLite file on one machine, PostgreSQL by URL in
Kubernetes. Whatever reads it back (an analysis, the tests) reads it through this module, so the schema has one
home. The router's edge writes through `AsyncRequestLog`, which never blocks the event loop and never lets a
database failure reach a client.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    case,
    create_engine,
    delete,
    event,
    func,
    insert,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import URL, Dialect, Engine, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    InternalError,
    NoSuchModuleError,
    OperationalError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import TypeDecorator

from kvmesh.engine.protocol import ROUTER_OUTCOMES, WORKLOAD_CLASSES

log = logging.getLogger(__name__)

TABLE_NAME = "kvmesh_requests"

# Every text column is short and bounded, so none of them can carry a prompt. The record enforces the same
# limits before a row reaches the database (SQLite would not).
MAX_LEN: dict[str, int] = {
    "pool": 63,  # a Kubernetes label value
    "tenant": 64,  # a hex digest, never the tenant's name or key
    "workload": 32,
    "route": 32,
    "outcome": 16,
    "pods": 1024,
    "model": 256,
}
SQLITE_BUSY_TIMEOUT_MS = 30_000
PRUNE_CHUNK_ROWS = 10_000  # rows a pruning transaction deletes at most
PRUNE_EVERY_SECONDS = 3600.0  # how often a router trims the log to its retention
CONNECT_TIMEOUT_SECONDS = 10
LIBPQ_DRIVERS = ("psycopg", "psycopg2")  # the drivers that take libpq's connect_timeout
# What uses the pool's database, the label of kvmesh_router_database_errors_total: the request log's writes and
# pruning, the batch runner's claims, writes and renewals, the Files and Batches API's calls, the tenant limits' sync
# (the Responses API's store counts in kvmesh_router_response_store_errors_total)
DATABASE_COMPONENTS = ("request_log", "batch_runner", "batch_api", "limit_sync")
# the driver's failures that mean the database cannot be used now (away, restarting, refusing connections, out of
# connections, its disk full or read-only), not that the statement was wrong: the caller may try again later
_UNAVAILABLE = (OperationalError, InterfaceError, InternalError, DisconnectionError, PoolTimeoutError,
                sqlite3.OperationalError, sqlite3.InterfaceError)


# SQLite reports a statement that names what the schema lacks as an OperationalError too: a bug, not an outage
_SCHEMA_FAULTS = ("no such table", "no such column", "has no column named")


def database_unavailable(exc: BaseException) -> bool:
    """Whether `exc` is the database being unavailable (a passing condition: try again later) rather than a bug."""
    return isinstance(exc, _UNAVAILABLE) and not any(fault in str(exc) for fault in _SCHEMA_FAULTS)


class UTCDateTime(TypeDecorator[datetime]):
    """Timestamps stored in UTC and read back timezone-aware on every backend (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else _utc(value)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    pass


class RequestRow(Base):
    """The table's one source of truth; `RequestRecord` mirrors it column for column (minus the id)."""

    __tablename__ = TABLE_NAME
    __table_args__ = (Index("ix_kvmesh_requests_pool_ts", "pool", "ts"), Index("ix_kvmesh_requests_ts", "ts"))

    # BIGINT on PostgreSQL (a busy pool passes 2**31 rows), INTEGER on SQLite (only that is a rowid alias).
    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True
    )
    ts: Mapped[datetime] = mapped_column(UTCDateTime())
    pool: Mapped[str] = mapped_column(String(MAX_LEN["pool"]))
    tenant: Mapped[str] = mapped_column(String(MAX_LEN["tenant"]))
    workload: Mapped[str] = mapped_column(String(MAX_LEN["workload"]))
    priority: Mapped[int] = mapped_column(Integer)
    route: Mapped[str] = mapped_column(String(MAX_LEN["route"]))
    outcome: Mapped[str] = mapped_column(String(MAX_LEN["outcome"]))
    status_code: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    predicted_cached_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    ttft_seconds: Mapped[float | None] = mapped_column(Float)
    mean_itl_seconds: Mapped[float | None] = mapped_column(Float)
    e2e_seconds: Mapped[float | None] = mapped_column(Float)
    pods: Mapped[str] = mapped_column(String(MAX_LEN["pods"]))
    retries: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(MAX_LEN["model"]))


def _utc(ts: datetime) -> datetime:
    """Naive datetimes are refused: a local `datetime.now()` would silently shift every row by the UTC offset."""
    if ts.tzinfo is None:
        raise ValueError(f"timestamps must be timezone-aware (UTC), got naive {ts!r}")
    return ts.astimezone(UTC)


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """One request as the router saw it; validated here so a bad row fails where it is made, not in a batch."""

    pool: str
    tenant: str  # auth.tenant_hash(tenant), never the raw tenant or key
    workload: str  # a protocol.WORKLOAD_CLASSES value
    route: str
    outcome: str
    status_code: int
    priority: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0
    output_tokens: int = 0
    ttft_seconds: float | None = None
    mean_itl_seconds: float | None = None
    e2e_seconds: float | None = None
    pods: str = ""  # chosen pod names joined by ","
    retries: int = 0
    model: str = ""
    ts: datetime = field(default_factory=_now)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ts", _utc(self.ts))
        if len(self.pods) > MAX_LEN["pods"]:
            # Informational and unbounded in principle (retries add pods): clip rather than lose the row.
            object.__setattr__(self, "pods", self.pods[: MAX_LEN["pods"]])
        for name, limit in MAX_LEN.items():
            value = getattr(self, name)
            if len(value) > limit:
                raise ValueError(f"RequestRecord.{name} is {len(value)} characters, over its limit of {limit}")
        if self.outcome not in ROUTER_OUTCOMES:
            raise ValueError(f"RequestRecord.outcome must be one of {ROUTER_OUTCOMES}, got {self.outcome!r}")
        for name in ("prompt_tokens", "cached_tokens", "predicted_cached_tokens", "output_tokens", "retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"RequestRecord.{name} must be >= 0, got {getattr(self, name)}")


RECORD_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(RequestRecord))


def _is_sqlite_memory(url: URL) -> bool:
    return url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"


DATABASE_URL_FORMS = "sqlite:///PATH or postgresql://USER:PASSWORD@HOST:PORT/DATABASE"


def make_engine(url: str) -> Engine:
    """SQLite gets WAL and a busy timeout so router processes on one machine can share a file. ValueError, naming
    the URL with its password hidden, for a URL that cannot be read or whose driver is not installed."""
    try:
        parsed = make_url(url)
    except ArgumentError:  # the text is not echoed: it may hold a password
        raise ValueError(f"the database URL cannot be read: it should look like {DATABASE_URL_FORMS}") from None
    try:
        return _make_engine(parsed)
    except (NoSuchModuleError, ImportError) as exc:
        raise ValueError(f"database URL {parsed.render_as_string(hide_password=True)}: no driver for "
                         f"{parsed.drivername!r} here ({exc}); use {DATABASE_URL_FORMS}") from None


def _make_engine(parsed: URL) -> Engine:
    if parsed.get_backend_name() != "sqlite":
        # pre_ping: connections through Kubernetes Services and poolers are cut while idle. A connect timeout: a
        # database that does not answer fails the call in seconds, not after the kernel's TCP retries (minutes).
        timeout = {"connect_timeout": CONNECT_TIMEOUT_SECONDS} if parsed.get_driver_name() in LIBPQ_DRIVERS else {}
        return create_engine(parsed, pool_pre_ping=True, connect_args=timeout)
    if _is_sqlite_memory(parsed):
        # One shared connection, or every pooled connection would see its own empty database.
        engine = create_engine(parsed, poolclass=StaticPool, connect_args={"check_same_thread": False, "timeout": 30})
    else:
        engine = create_engine(parsed, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer, nor it them
            cursor.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; WAL stays consistent
        finally:
            cursor.close()

    return engine


def create_tables(engine: Engine, metadata: MetaData) -> None:
    """Create `metadata`'s tables where missing and add the columns and indexes a newer kvmesh declares to tables an
    older one made (a pool's database outlives upgrades; `create_all` never alters a table). Replicas starting together
    race: the loser of a create or an ALTER carries on once what it wanted exists. ValueError, naming the database
    (its password hidden), when it cannot be reached or opened: a process that starts without its database stops
    with that one line (a pod restarts until the database is up)."""
    for attempt in range(2):
        try:
            metadata.create_all(engine)
            _add_missing_columns(engine, metadata)
            _add_missing_indexes(engine, metadata)
            return
        except DBAPIError as exc:
            if attempt:
                raise ValueError(f"database {engine.url.render_as_string(hide_password=True)} cannot be used: "
                                 f"{str(exc.orig or exc).strip().splitlines()[0]}") from None


def _add_missing_columns(engine: Engine, metadata: MetaData) -> None:
    """ALTER TABLE ADD COLUMN for each declared column an existing table lacks, nullable, with the column's
    scalar default (if any) filling the rows already there."""
    inspector = inspect(engine)
    for table in metadata.sorted_tables:
        present = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in present:
                continue
            kind = column.type.compile(dialect=engine.dialect)
            default = column.default.arg if column.default is not None and column.default.is_scalar else None
            clause = "" if default is None else f" DEFAULT {int(default) if isinstance(default, bool) else default!r}"
            with engine.begin() as conn:
                conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}{clause}'))
            log.info("added column %s.%s to a table an older kvmesh made", table.name, column.name)


def _add_missing_indexes(engine: Engine, metadata: MetaData) -> None:
    """CREATE INDEX for each declared index an existing table lacks: a column added in place comes without the
    index a new table would have (the stored responses' chain lookups would scan the whole table)."""
    inspector = inspect(engine)
    for table in metadata.sorted_tables:
        present = {i["name"] for i in inspector.get_indexes(table.name)}
        for index in table.indexes:
            if index.name not in present:
                index.create(engine)
                log.info("added index %s to a table an older kvmesh made", index.name)


class RequestLog:
    """Synchronous access to one pool's request log; safe to share between threads."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        create_tables(self.engine, Base.metadata)

    def write(self, records: Sequence[RequestRecord]) -> None:
        """Insert a batch in one transaction (one executemany round trip)."""
        if not records:
            return
        with Session(self.engine) as session, session.begin():
            session.execute(insert(RequestRow), [asdict(r) for r in records])

    def prune(self, before: datetime, chunk: int = PRUNE_CHUNK_ROWS) -> int:
        """Delete the rows older than `before`, `chunk` at a time (each its own transaction: a long log is trimmed
        without one long lock on the table); returns how many went."""
        removed = 0
        while True:
            with Session(self.engine) as session, session.begin():
                oldest = select(RequestRow.id).where(RequestRow.ts < _utc(before)).limit(chunk)
                count = session.execute(delete(RequestRow).where(RequestRow.id.in_(oldest))).rowcount or 0
            removed += count
            if count < chunk:
                return removed

    def _where(self, since: datetime | None, pool: str | None) -> list[ColumnElement[bool]]:
        clauses: list[ColumnElement[bool]] = []
        if since is not None:
            clauses.append(RequestRow.ts >= _utc(since))
        if pool is not None:
            clauses.append(RequestRow.pool == pool)
        return clauses

    def recent(self, since: datetime | None = None, pool: str | None = None, limit: int = 10000) -> list[RequestRecord]:
        """The latest `limit` records at or after `since`, oldest first (the order a forecast replays them in)."""
        query = (
            select(RequestRow)
            .where(*self._where(since, pool))
            .order_by(RequestRow.ts.desc(), RequestRow.id.desc())
            .limit(limit)
        )
        with Session(self.engine) as session:
            rows = session.scalars(query).all()
            records = [RequestRecord(**{name: getattr(row, name) for name in RECORD_FIELDS}) for row in rows]
        records.reverse()
        return records

    def summary(self, since: datetime | None = None, pool: str | None = None) -> dict[str, Any]:
        """Aggregates computed in the database, so reading a day of traffic moves a few numbers, not rows.

        Token totals and hit ratios count only requests that completed ("ok"): a shed request's prompt never
        reached a cache and would drag the ratio down. Latency means are over the rows that recorded them.
        """
        where = self._where(since, pool)
        ok = RequestRow.outcome == "ok"

        def ok_sum(column: Any) -> Any:
            return func.coalesce(func.sum(case((ok, column), else_=0)), 0)

        totals = select(
            func.count(),
            ok_sum(RequestRow.prompt_tokens),
            ok_sum(RequestRow.cached_tokens),
            ok_sum(RequestRow.predicted_cached_tokens),
            ok_sum(RequestRow.output_tokens),
            func.avg(RequestRow.ttft_seconds),
            func.avg(RequestRow.mean_itl_seconds),
            func.avg(RequestRow.e2e_seconds),
            func.coalesce(func.sum(RequestRow.retries), 0),
            func.min(RequestRow.ts),
            func.max(RequestRow.ts),
        ).where(*where)
        by_outcome = select(RequestRow.outcome, func.count()).where(*where).group_by(RequestRow.outcome)
        by_workload = select(RequestRow.workload, func.count()).where(*where).group_by(RequestRow.workload)
        by_route = select(RequestRow.route, func.count()).where(*where).group_by(RequestRow.route)
        with Session(self.engine) as session:
            row = session.execute(totals).one()
            outcomes = {name: 0 for name in ROUTER_OUTCOMES} | {k: int(v) for k, v in session.execute(by_outcome)}
            workloads = {name: 0 for name in WORKLOAD_CLASSES}
            workloads |= {k: int(v) for k, v in session.execute(by_workload)}
            routes = {k: int(v) for k, v in session.execute(by_route)}
        count, prompt, cached, predicted, output, ttft, itl, e2e, retries, first, last = row
        prompt, cached, predicted = int(prompt), int(cached), int(predicted)
        return {
            "requests": int(count),
            "outcomes": outcomes,
            "workloads": workloads,
            "routes": routes,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "predicted_cached_tokens": predicted,
            "output_tokens": int(output),
            "hit_ratio": cached / prompt if prompt else None,
            "predicted_hit_ratio": predicted / prompt if prompt else None,
            "mean_ttft_seconds": None if ttft is None else float(ttft),
            "mean_itl_seconds": None if itl is None else float(itl),
            "mean_e2e_seconds": None if e2e is None else float(e2e),
            "retries": int(retries),
            "first_ts": first,
            "last_ts": last,
        }

    def close(self) -> None:
        self.engine.dispose()


class AsyncRequestLog:
    """Buffers records and writes them from a background thread in batches (every N records or T seconds).

    The FastAPI edge must never wait on the database, and a database outage must never fail a request: a
    failed batch is logged, counted in `errors`, and dropped (`dropped` counts its records), because a
    telemetry buffer that grows while the database is away would take the router down with it. The buffer is
    bounded by `max_pending` for the same reason; flush() on shutdown. `on_error()` is called for each failed write
    or pruning and `on_dropped(n)` for each `n` records dropped (the router's metrics), from any thread.
    """

    def __init__(
        self, log: RequestLog, batch_size: int = 100, interval: float = 1.0, max_pending: int = 100_000,
        retention_seconds: float | None = None, prune_every: float = PRUNE_EVERY_SECONDS,
        on_error: Callable[[], None] = lambda: None, on_dropped: Callable[[int], None] = lambda n: None,
    ) -> None:
        if batch_size < 1 or interval <= 0 or max_pending < batch_size:
            raise ValueError("need batch_size >= 1, interval > 0 and max_pending >= batch_size")
        self.log = log
        self.retention_seconds = retention_seconds  # rows older than this are deleted, every `prune_every` s
        self.prune_every = prune_every
        self.pruned = 0  # rows deleted for the retention
        self._pruned_at = -math.inf
        self.batch_size = batch_size
        self.interval = interval
        self.max_pending = max_pending
        self.on_error, self.on_dropped = on_error, on_dropped
        self.errors = 0  # failed batch writes
        self.dropped = 0  # records lost to failed writes, a full buffer, or submission after close
        self.written = 0
        self._buffer: deque[RequestRecord] = deque()
        self._cond = threading.Condition()
        self._submitted = 0  # sequence numbers: flush() waits until _done reaches what was submitted before it
        self._done = 0
        self._flush_wanted = False
        self._closed = False
        self._last_error_log = -math.inf
        self._thread = threading.Thread(target=self._run, name="kvmesh-request-log", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._submitted - self._done

    def submit(self, record: RequestRecord) -> None:
        """Queue one record; O(1), never blocks on I/O, never raises."""
        with self._cond:
            if self._closed:
                self.dropped += 1
                self.on_dropped(1)
                return
            if len(self._buffer) >= self.max_pending:
                self._buffer.popleft()
                self.dropped += 1
                self.on_dropped(1)
                self._done += 1
            self._buffer.append(record)
            self._submitted += 1
            if len(self._buffer) >= self.batch_size:
                self._cond.notify_all()

    def flush(self, timeout: float = 5.0) -> None:
        """Write everything submitted so far, waiting up to `timeout` seconds."""
        with self._cond:
            target = self._submitted
            self._flush_wanted = True
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._done >= target or not self._thread.is_alive(), timeout):
                log.warning("request log flush timed out with %d records pending", self._submitted - self._done)

    def close(self, timeout: float = 5.0) -> None:
        """Flush and stop the writer thread; the RequestLog stays open (its owner closes it)."""
        with self._cond:
            if self._closed:
                return
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _take(self) -> list[RequestRecord]:
        """Called with the lock held: wait until a batch is due (full, flushed, closing, or the interval passed)."""
        self._cond.wait_for(
            lambda: self._closed or self._flush_wanted or len(self._buffer) >= self.batch_size, self.interval
        )
        batch = [self._buffer.popleft() for _ in range(min(len(self._buffer), self.batch_size))]
        if not self._buffer:
            self._flush_wanted = False
        return batch

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed and not self._buffer:
                    return
                batch = self._take()
            self._maybe_prune()
            if not batch:
                continue
            ok = self._write(batch)
            with self._cond:
                self._done += len(batch)
                if ok:
                    self.written += len(batch)
                else:
                    self.errors += 1
                    self.dropped += len(batch)
                self._cond.notify_all()
            if not ok:
                self.on_error()
                self.on_dropped(len(batch))

    def _maybe_prune(self) -> None:
        """Trim the log to its retention, from the writer's thread, at most every `prune_every` seconds (every
        replica does; deleting what another already deleted costs a query). A failure is logged, never raised."""
        now = time.monotonic()
        if self.retention_seconds is None or now - self._pruned_at < self.prune_every:
            return
        self._pruned_at = now
        try:
            self.pruned += self.log.prune(_now() - timedelta(seconds=self.retention_seconds))
        except Exception:
            self.on_error()
            log.exception("request log pruning failed; it is tried again in %.0f s", self.prune_every)

    def _write(self, batch: list[RequestRecord]) -> bool:
        try:
            self.log.write(batch)
            return True
        except Exception:  # any failure, driver or ours: the router keeps serving
            now = time.monotonic()
            if now - self._last_error_log >= 60.0:  # an outage would otherwise log once per interval
                self._last_error_log = now
                log.exception(
                    "request log write failed, %d records dropped (failed batches: %d)", len(batch), self.errors + 1
                )
            return False
