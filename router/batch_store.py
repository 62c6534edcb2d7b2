"""Files, batches and their results in the pool's database (the request log's: SQLite locally, PostgreSQL by URL).

Every router replica of a pool shares the database, so a batch created through one replica is read, cancelled
and run through any other; a replica runs a batch while it holds the batch's lease, renewed as it works, so a
replica that dies hands its batches to another, which skips the requests already answered. Unlike the request
log these tables hold what clients sent (input files) and what the pool answered: a tenant's own data, read back
only with the same tenant's key and deleted on request. Synchronous: the router calls it in a worker thread.
"""

from __future__ import annotations

import io
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from sqlalchemy import (
    BigInteger,
    Engine,
    Float,
    Integer,
    LargeBinary,
    String,
    Text,
    case,
    delete,
    func,
    select,
    text,
    update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kvmesh.router.batches import (
    ACTIVE_STATUSES,
    CANCELLABLE_STATUSES,
    ENQUEUED_STATUSES,
    FINAL_STATUSES,
    OUTPUT_PURPOSE,
    BatchInputError,
    FileQuota,
    LineProblem,
    LineResult,
    enqueued_limit_error,
    list_page,
    new_id,
    request_lines,
)
from kvmesh.router.store import create_tables, make_engine

FILES_TABLE, BATCHES_TABLE, RESULTS_TABLE = "kvmesh_files", "kvmesh_batches", "kvmesh_batch_results"
_ID_LEN, _TENANT_LEN = 64, 64
PIECE_BYTES = 2**20  # a download's piece, read from the database and sent at a time
# the timestamps of a batch object, each set once when the batch enters that state
_STAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
           "cancelled_at")


class _Base(DeclarativeBase):
    pass


def _seq() -> Mapped[int]:
    """An insertion counter: list pages in creation order, stable among rows created in the same second."""
    return mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True)


class FileRow(_Base):
    __tablename__ = FILES_TABLE

    seq: Mapped[int] = _seq()
    id: Mapped[str] = mapped_column(String(_ID_LEN), unique=True)
    tenant: Mapped[str] = mapped_column(String(_TENANT_LEN), index=True)  # auth.tenant_hash
    purpose: Mapped[str] = mapped_column(String(16))
    filename: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(BigInteger)
    lines: Mapped[int] = mapped_column(Integer, default=0)  # batches.request_lines: what a batch of it enqueues
    created_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int | None] = mapped_column(BigInteger, index=True)  # None: kept until deleted
    content: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)  # read only for a download or a run


class BatchRow(_Base):
    __tablename__ = BATCHES_TABLE

    seq: Mapped[int] = _seq()
    id: Mapped[str] = mapped_column(String(_ID_LEN), unique=True)
    tenant: Mapped[str] = mapped_column(String(_TENANT_LEN), index=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(256))  # the input's requests' model, known once checked
    input_file_id: Mapped[str] = mapped_column(String(_ID_LEN))
    completion_window: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(16), index=True)
    created_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int] = mapped_column(BigInteger)
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger)
    finalizing_at: Mapped[int | None] = mapped_column(BigInteger)
    completed_at: Mapped[int | None] = mapped_column(BigInteger)
    failed_at: Mapped[int | None] = mapped_column(BigInteger)
    expired_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelling_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelled_at: Mapped[int | None] = mapped_column(BigInteger)
    output_file_id: Mapped[str | None] = mapped_column(String(_ID_LEN))
    error_file_id: Mapped[str | None] = mapped_column(String(_ID_LEN))
    total: Mapped[int] = mapped_column(Integer, default=0)
    # an ended batch's counts and usage, frozen when its answers move into its files (its results rows go then)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    errors: Mapped[str | None] = mapped_column(Text)  # JSON: the input file's problems, when it was refused
    batch_metadata: Mapped[str | None] = mapped_column(Text)  # JSON
    output_ttl: Mapped[int | None] = mapped_column(BigInteger)  # the output and error files' lifetime, seconds
    owner: Mapped[str | None] = mapped_column(String(128))  # the replica running it, while its lease lasts
    lease_until: Mapped[float] = mapped_column(Float, default=0.0)
    claimed_at: Mapped[float] = mapped_column(Float, default=0.0)  # when a replica last took it: least recent first


class ResultRow(_Base):
    __tablename__ = RESULTS_TABLE

    batch_id: Mapped[str] = mapped_column(String(_ID_LEN), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(512))
    status_code: Mapped[int] = mapped_column(Integer)
    body: Mapped[str] = mapped_column(Text)  # JSON
    request_id: Mapped[str] = mapped_column(String(64))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)


@dataclass(frozen=True)
class ClaimedBatch:
    """A batch this replica holds the lease of: what running it needs."""

    id: str
    tenant: str  # tenant_hash
    endpoint: str
    input_file_id: str
    status: str
    expires_at: int
    output_ttl: int | None


def _file_json(row: FileRow) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": row.created_at,
            "filename": row.filename, "purpose": row.purpose, "status": "processed", "expires_at": row.expires_at,
            "status_details": None}


def _result_row(batch_id: str, result: LineResult) -> ResultRow:
    prompt, cached, output = result.usage()
    return ResultRow(batch_id=batch_id, line=result.line, custom_id=result.custom_id, status_code=result.status_code,
                     body=json.dumps(result.body), request_id=result.request_id[:_ID_LEN], prompt_tokens=prompt,
                     cached_tokens=cached, completion_tokens=output)


def _page(session: Session, table: type[FileRow] | type[BatchRow], query: Any, tenant: str, limit: int,
          after: str | None, newest_first: bool) -> tuple[list[Any], bool]:
    """A list page of `query`'s rows after the tenant's row `after` (OpenAI's cursor), and whether more follow;
    BatchInputError for a cursor that names no row of the tenant (paging would start over and repeat itself)."""
    if after is not None:
        cursor = session.scalar(select(table.seq).where(table.id == after, table.tenant == tenant))
        if cursor is None:
            kind = "file" if table is FileRow else "batch"
            raise BatchInputError(f"after: no {kind} with id '{after}' (deleted or expired?)", "after")
        query = query.where(table.seq < cursor if newest_first else table.seq > cursor)
    order = table.seq.desc() if newest_first else table.seq.asc()
    rows = session.scalars(query.order_by(order).limit(limit + 1)).all()
    return list(rows[:limit]), len(rows) > limit


def _reading(file_id: str) -> tuple[Any, ...]:
    """The batches still running over the file."""
    return BatchRow.input_file_id == file_id, BatchRow.status.in_(ACTIVE_STATUSES)


def _free(owner: str | None) -> Any:
    """A batch no replica holds (its lease ended), or held by `owner` itself."""
    free = BatchRow.owner.is_(None) | (BatchRow.lease_until < time.time())
    return free if owner is None else free | (BatchRow.owner == owner)


def _visible(tenant: str) -> tuple[Any, ...]:
    """A tenant's files that have not expired (an expired one is gone for clients before the sweep removes it)."""
    return FileRow.tenant == tenant, (FileRow.expires_at.is_(None)) | (FileRow.expires_at >= int(time.time()))


def _contents_uncompressed(engine: Engine) -> None:
    """PostgreSQL compresses a large bytea value (TOAST), and substr on a compressed value decompresses it from its
    start up to the piece asked for, so reading a file in pieces cost the square of its size: 4.7 s to read a
    113 MiB input in 1 MiB pieces. Stored uncompressed (STORAGE EXTERNAL, which PostgreSQL's docs recommend for
    substring access to wide bytea columns), a piece reads only its own chunks: 0.7 s. A file then takes its
    size on disk, as in SQLite, which never compresses. Files stored before keep their compression."""
    if engine.dialect.name != "postgresql":
        return
    with engine.begin() as conn:
        storage = conn.scalar(text("SELECT attstorage FROM pg_attribute WHERE attrelid = CAST(:table AS regclass) "
                                   "AND attname = 'content'"), {"table": FILES_TABLE})
        if storage != "e":
            conn.execute(text(f"ALTER TABLE {FILES_TABLE} ALTER COLUMN content SET STORAGE EXTERNAL"))


class BatchStore:
    """One pool's files and batches; safe to share between threads (each call its own session)."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        create_tables(self.engine, _Base.metadata)
        _contents_uncompressed(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def ping(self) -> None:
        """A round trip to the database: raises while it is away (the batch runner's check before it claims again)."""
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    # -- files

    def add_file(self, tenant: str, purpose: str, filename: str, content: bytes | BinaryIO, ttl: int | None,
                 quota: FileQuota | None = None, size: int | None = None) -> dict[str, Any]:
        """Store a file: `content` its bytes, or a binary file of `size` bytes read from its start (an upload
        spooled to disk). Within `quota` of the tenant's stored files (BatchInputError 400 past it, nothing stored),
        checked in the transaction that adds the file, after the row is written: SQLite's writers take turns, so
        concurrent uploads never pass it together there (on PostgreSQL two at the same instant may, by one file
        each). On SQLite the content goes into the row a piece at a time (incremental blob I/O), so an upload is
        never held whole in memory; elsewhere it is read once, whole, for the insert."""
        source = io.BytesIO(content) if isinstance(content, bytes) else content
        size = len(content) if isinstance(content, bytes) else size
        assert size is not None, "a file object needs its size"
        now = int(time.time())
        row = FileRow(id=new_id("file-"), tenant=tenant, purpose=purpose, filename=filename[:255], bytes=size,
                      lines=0, created_at=now, expires_at=None if ttl is None else now + ttl, content=b"")
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            session.add(row)
            session.flush()  # the write lock first (SQLite), then the tenant's usage, this file included
            if quota is not None:
                files, stored = session.execute(select(func.count(), func.coalesce(func.sum(FileRow.bytes), 0))
                                                .where(*_visible(tenant), FileRow.id != row.id)).one()
                quota.check(int(files), int(stored), size)
            if self.engine.dialect.name == "sqlite":
                row.lines = self._write_pieces(session, row.seq, source, size)
            else:
                whole = source.read()
                row.lines = request_lines(whole)
                session.execute(update(FileRow).where(FileRow.seq == row.seq).values(content=whole)
                                .execution_options(synchronize_session=False))
        return _file_json(row)

    @staticmethod
    def _write_pieces(session: Session, seq: int, source: BinaryIO, size: int) -> int:
        """Write `size` bytes of `source` into the SQLite row `seq`'s content, PIECE_BYTES at a time, in the
        session's transaction; the content's lines (request_lines)."""
        session.execute(update(FileRow).where(FileRow.seq == seq).values(content=func.zeroblob(size))
                        .execution_options(synchronize_session=False))
        raw: Any = session.connection().connection.dbapi_connection  # the sqlite3 module's connection

        def pieces() -> Iterator[bytes]:
            with raw.blobopen(FILES_TABLE, "content", seq) as blob:
                left = size
                while left > 0:
                    piece = source.read(min(PIECE_BYTES, left))
                    if not piece:
                        raise ValueError(f"the upload ended {left} bytes short of its {size}")
                    blob.write(piece)
                    left -= len(piece)
                    yield piece

        return request_lines(pieces())

    def file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        with Session(self.engine) as session:
            row = session.scalar(select(FileRow).where(FileRow.id == file_id, *_visible(tenant)))
            return None if row is None else _file_json(row)

    def file_pieces(self, tenant: str, file_id: str,
                    expired_too: bool = False) -> tuple[int, Iterator[bytes]] | None:
        """A visible file's size and its content in pieces of PIECE_BYTES, each read on its own from the database,
        so a download or a check holds one piece, not the file; None for a file the tenant cannot see. A file
        deleted meanwhile ends short. `expired_too`: also one past its expiry not yet swept (a running batch's
        input, which the sweep keeps)."""
        owned = (FileRow.tenant == tenant,) if expired_too else _visible(tenant)
        with Session(self.engine) as session:
            found = session.execute(select(FileRow.bytes, FileRow.seq).where(FileRow.id == file_id, *owned)).first()
        return None if found is None else (found.bytes, self._pieces(file_id, found.bytes, found.seq))

    def _pieces(self, file_id: str, size: int, seq: int) -> Iterator[bytes]:
        for start in range(0, size, PIECE_BYTES):
            piece = self._piece(file_id, seq, start)
            if not piece:
                return
            yield piece

    def _piece(self, file_id: str, seq: int, start: int) -> bytes | None:
        """PIECE_BYTES of a file's content from `start`, None once the file is gone. SQLite's substr reads the whole
        value for each piece (a 100 MiB file read into memory 100 times over), so there the piece is read through
        its incremental blob I/O, by rowid (seq), which reads only that piece's pages."""
        if self.engine.dialect.name == "sqlite":
            with self.engine.connect() as conn:
                raw: Any = conn.connection.dbapi_connection  # the sqlite3 module's connection
                try:
                    with raw.blobopen(FILES_TABLE, "content", seq, readonly=True) as blob:
                        blob.seek(start)
                        return blob.read(PIECE_BYTES)
                except sqlite3.OperationalError:  # no such row: deleted
                    return None
        with Session(self.engine) as session:
            piece = session.scalar(select(func.substr(FileRow.content, start + 1, PIECE_BYTES, type_=LargeBinary))
                                   .where(FileRow.id == file_id))
        return None if piece is None else bytes(piece)

    def files(self, tenant: str, purpose: str | None, limit: int, after: str | None,
              newest_first: bool = True) -> dict[str, Any]:
        """The tenant's files, a page of `limit` after the file `after`."""
        query = select(FileRow).where(*_visible(tenant))
        if purpose is not None:
            query = query.where(FileRow.purpose == purpose)
        with Session(self.engine) as session:
            rows, more = _page(session, FileRow, query, tenant, limit, after, newest_first)
            return list_page([_file_json(r) for r in rows], more)

    def delete_file(self, tenant: str, file_id: str) -> bool:
        """Remove a file; BatchInputError when a batch still running reads it (cancel the batch first)."""
        with Session(self.engine) as session, session.begin():
            reader = session.scalar(select(BatchRow.id).where(*_reading(file_id), BatchRow.tenant == tenant).limit(1))
            if reader is not None:
                raise BatchInputError(f"the file {file_id} is the input of batch {reader}, which is still running: "
                                      f"cancel it or wait for it to end", "file_id", status=409)
            gone = session.execute(delete(FileRow).where(FileRow.id == file_id, *_visible(tenant)))
            return gone.rowcount == 1

    def delete_expired(self) -> int:
        """Remove the files past their expiry (already invisible to clients) that no running batch reads; how
        many went."""
        running = select(BatchRow.input_file_id).where(BatchRow.status.in_(ACTIVE_STATUSES))
        with Session(self.engine) as session, session.begin():
            return session.execute(delete(FileRow).where(FileRow.expires_at < int(time.time()),
                                                         FileRow.id.not_in(running))).rowcount

    # -- batches, as the API sees them

    def create_batch(self, tenant: str, endpoint: str, input_file_id: str, completion_window: str,
                     window_seconds: int, metadata: dict[str, str] | None, output_ttl: int | None,
                     max_enqueued: int) -> dict[str, Any]:
        """A new batch, unless its input's lines and the tenant's enqueued requests pass `max_enqueued` (a 429;
        two replicas creating at the same instant may both pass, by one file at most each)."""
        now = int(time.time())
        row = BatchRow(id=new_id("batch_"), tenant=tenant, endpoint=endpoint, input_file_id=input_file_id,
                       completion_window=completion_window, status="validating", created_at=now,
                       expires_at=now + window_seconds, total=0, lease_until=0.0, output_ttl=output_ttl,
                       batch_metadata=None if metadata is None else json.dumps(metadata))
        self._count_lines(tenant, input_file_id)
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            adding = session.scalar(select(FileRow.lines).where(FileRow.id == input_file_id)) or 0
            enqueued = int(session.scalar(
                select(func.coalesce(func.sum(FileRow.lines), 0)).join(BatchRow, BatchRow.input_file_id == FileRow.id)
                .where(BatchRow.tenant == tenant, BatchRow.status.in_(ENQUEUED_STATUSES))) or 0)
            if enqueued + adding > max_enqueued:
                raise enqueued_limit_error(enqueued, adding, max_enqueued)
            session.add(row)
        return self._batch_json(row)

    def _count_lines(self, tenant: str, input_file_id: str) -> None:
        """Files uploaded before kvmesh_files.lines existed hold 0 there (the column's default), so they would count
        nothing toward the enqueued limit: the new batch's input and those of the tenant's enqueued batches, if not
        empty, are counted, a piece at a time, and the count stored (once: a counted file keeps its count)."""
        enqueued = select(BatchRow.input_file_id).where(BatchRow.tenant == tenant,
                                                        BatchRow.status.in_(ENQUEUED_STATUSES))
        with Session(self.engine) as session:
            uncounted = session.execute(select(FileRow.id, FileRow.bytes, FileRow.seq).where(
                FileRow.tenant == tenant, FileRow.lines == 0, FileRow.bytes > 0,
                (FileRow.id == input_file_id) | FileRow.id.in_(enqueued))).all()
        for file_id, size, seq in uncounted:
            lines = request_lines(self._pieces(file_id, size, seq))
            with Session(self.engine) as session, session.begin():
                session.execute(update(FileRow).where(FileRow.id == file_id).values(lines=lines))

    def batch(self, tenant: str, batch_id: str) -> dict[str, Any] | None:
        with Session(self.engine) as session:
            row = session.scalar(select(BatchRow).where(BatchRow.id == batch_id, BatchRow.tenant == tenant))
            return None if row is None else self._batch_json(row, session)

    def batches(self, tenant: str, limit: int, after: str | None, newest_first: bool = True) -> dict[str, Any]:
        """The tenant's batches, a page of `limit` after the batch `after`."""
        query = select(BatchRow).where(BatchRow.tenant == tenant)
        with Session(self.engine) as session:
            rows, more = _page(session, BatchRow, query, tenant, limit, after, newest_first)
            return list_page([self._batch_json(r, session) for r in rows], more)

    def cancel(self, tenant: str, batch_id: str) -> dict[str, Any] | None:
        """Ask the batch to stop: `cancelling` until its runner has written what was answered (then `cancelled`).
        A batch already past running is answered as it is."""
        with Session(self.engine) as session, session.begin():
            session.execute(update(BatchRow)
                            .where(BatchRow.id == batch_id, BatchRow.tenant == tenant,
                                   BatchRow.status.in_(CANCELLABLE_STATUSES))
                            .values(status="cancelling", cancelling_at=int(time.time())))
        return self.batch(tenant, batch_id)

    def _batch_json(self, row: BatchRow, session: Session | None = None) -> dict[str, Any]:
        """OpenAI's batch object: a running batch's counts and usage read from its results so far, an ended one's
        as frozen when it ended."""
        completed, failed = row.completed or 0, row.failed or 0
        prompt, cached, output = row.prompt_tokens or 0, row.cached_tokens or 0, row.completion_tokens or 0
        if session is not None and row.status in ACTIVE_STATUSES:
            (completed, failed), (prompt, cached, output) = self._progress(session, row.id)
        errors = None if row.errors is None else {"object": "list", "data": json.loads(row.errors)}
        return {
            "id": row.id, "object": "batch", "endpoint": row.endpoint, "model": row.model, "errors": errors,
            "input_file_id": row.input_file_id, "completion_window": row.completion_window, "status": row.status,
            "output_file_id": row.output_file_id, "error_file_id": row.error_file_id,
            "created_at": row.created_at, "expires_at": row.expires_at,
            **{stamp: getattr(row, stamp) for stamp in _STAMPS},
            # total: the requests of the input file; an expired or cancelled batch counts the ones it never ran
            # as failed, as its error file lists them
            "request_counts": {"total": row.total, "completed": completed, "failed": failed},
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt + output},
            "metadata": None if row.batch_metadata is None else json.loads(row.batch_metadata),
        }

    @staticmethod
    def _progress(session: Session, batch_id: str) -> tuple[tuple[int, int], tuple[int, int, int]]:
        row = session.execute(
            select(func.count(), func.coalesce(func.sum(case((ResultRow.status_code == 200, 1), else_=0)), 0),
                   func.coalesce(func.sum(ResultRow.prompt_tokens), 0),
                   func.coalesce(func.sum(ResultRow.cached_tokens), 0),
                   func.coalesce(func.sum(ResultRow.completion_tokens), 0))
            .where(ResultRow.batch_id == batch_id)
        ).one()
        answered, served, prompt, cached, output = (int(v) for v in row)
        return (served, answered - served), (prompt, cached, output)

    # -- batches, as a runner sees them

    def claim(self, owner: str, lease_seconds: float) -> ClaimedBatch | None:
        """The active batch whose lease is free, expired or already ours that was taken least recently (a new
        one first, then round robin: batches share the replicas in turns), now leased to `owner`; the
        conditional update makes two replicas racing for one batch agree on a single winner."""
        now = time.time()
        with Session(self.engine) as session:
            candidates = session.scalars(select(BatchRow.id).where(BatchRow.status.in_(ACTIVE_STATUSES), _free(owner))
                                         .order_by(BatchRow.claimed_at, BatchRow.seq).limit(8)).all()
        for batch_id in candidates:
            with Session(self.engine) as session, session.begin():
                won = session.execute(update(BatchRow).where(BatchRow.id == batch_id, _free(owner),
                                                             BatchRow.status.in_(ACTIVE_STATUSES))
                                      .values(owner=owner, lease_until=now + lease_seconds,
                                              claimed_at=now)).rowcount == 1
                if won:
                    row = session.scalars(select(BatchRow).where(BatchRow.id == batch_id)).one()
                    return ClaimedBatch(row.id, row.tenant, row.endpoint, row.input_file_id, row.status,
                                        row.expires_at, row.output_ttl)
        return None

    def others_waiting(self, batch_id: str) -> bool:
        """Whether another active batch waits for a replica (its lease free): then a running one yields its turn."""
        with Session(self.engine) as session:
            waiting = select(BatchRow.id).where(BatchRow.status.in_(ACTIVE_STATUSES), BatchRow.id != batch_id,
                                                _free(None))
            return session.scalar(waiting.limit(1)) is not None

    def renew(self, batch_id: str, owner: str, lease_seconds: float) -> str | None:
        """Extend our lease; the batch's status (a client may have cancelled it), or None when the lease is lost."""
        with Session(self.engine) as session, session.begin():
            held = session.execute(update(BatchRow).where(BatchRow.id == batch_id, BatchRow.owner == owner)
                                   .values(lease_until=time.time() + lease_seconds)).rowcount == 1
            return session.scalar(select(BatchRow.status).where(BatchRow.id == batch_id)) if held else None

    def start(self, batch_id: str, owner: str, total: int, model: str | None) -> bool:
        """validating -> in_progress once its file passed, with its requests' model; False if the lease or the
        state moved meanwhile."""
        return self._move(batch_id, owner, ("validating",), "in_progress", total=total, model=model)

    def fail(self, batch_id: str, owner: str, problems: Sequence[LineProblem]) -> bool:
        """-> failed, with the problems as the batch's `errors` (its input file's, its tenant's key revoked, or the
        runner's repeated failure); answers it had are dropped, as a failed batch has no files."""
        failed = self._move(batch_id, owner, ACTIVE_STATUSES, "failed",
                            errors=json.dumps([p.as_json() for p in problems]))
        if failed:
            with Session(self.engine) as session, session.begin():
                session.execute(delete(ResultRow).where(ResultRow.batch_id == batch_id))
        return failed

    def finalizing(self, batch_id: str, owner: str) -> bool:
        return self._move(batch_id, owner, ("in_progress",), "finalizing")

    def _move(self, batch_id: str, owner: str, sources: tuple[str, ...], status: str, **values: Any) -> bool:
        """Our batch from one of `sources` to `status` (stamped); an ended batch's lease is given up."""
        stamp = f"{status}_at"
        if status in FINAL_STATUSES:
            values.update(owner=None, lease_until=0.0)
        with Session(self.engine) as session, session.begin():
            return session.execute(
                update(BatchRow).where(BatchRow.id == batch_id, BatchRow.owner == owner,
                                       BatchRow.status.in_(sources))
                .values(status=status, **({stamp: int(time.time())} if stamp in _STAMPS else {}), **values)
            ).rowcount == 1

    def answered_lines(self, batch_id: str) -> set[int]:
        with Session(self.engine) as session:
            return set(session.scalars(select(ResultRow.line).where(ResultRow.batch_id == batch_id)))

    def add_results(self, batch_id: str, owner: str, results: Sequence[LineResult]) -> bool:
        """Record answered requests in one transaction, while `owner` still runs the batch (a replica that lost it,
        or a write arriving after the batch ended, adds nothing: False); a request already recorded is kept, not
        doubled."""
        with Session(self.engine) as session, session.begin():
            held = session.scalar(select(BatchRow.id).where(BatchRow.id == batch_id, BatchRow.owner == owner,
                                                            BatchRow.status.in_(ACTIVE_STATUSES))
                                  .with_for_update())  # serialized with finish(), which drops the rows
            if held is None:
                return False
            lines = [r.line for r in results]
            known = set(session.scalars(select(ResultRow.line).where(ResultRow.batch_id == batch_id,
                                                                     ResultRow.line.in_(lines))))
            fresh = {r.line: r for r in results if r.line not in known}  # one per line, the first
            session.add_all(_result_row(batch_id, r) for r in fresh.values())
        return True

    def results(self, batch_id: str) -> list[LineResult]:
        with Session(self.engine) as session:
            rows = session.scalars(select(ResultRow).where(ResultRow.batch_id == batch_id)
                                   .order_by(ResultRow.line)).all()
            return [LineResult(r.line, r.custom_id, r.status_code, json.loads(r.body), r.request_id) for r in rows]

    def finish(self, batch: ClaimedBatch, owner: str, status: str, output: bytes, errors: bytes, total: int,
               unrun: int) -> bool:
        """Write the output and error files (each only when it has lines), freeze the batch's counts and usage, drop
        its results rows (the files hold them now) and end it in `status`, in one transaction: a client sees the
        final status with its files or neither. `total`: the input's requests (also for a batch cancelled before it
        started); `unrun`: those never sent (cancelled or expired), counted as failed."""
        now = int(time.time())
        files = {name: FileRow(id=new_id("file-"), tenant=batch.tenant, purpose=OUTPUT_PURPOSE,
                               filename=f"{batch.id}_{name}.jsonl", bytes=len(content), created_at=now,
                               expires_at=None if batch.output_ttl is None else now + batch.output_ttl,
                               content=content)
                 for name, content in (("output", output), ("error", errors)) if content}
        with Session(self.engine) as session, session.begin():
            (completed, failed), (prompt, cached, output_tokens) = self._progress(session, batch.id)
            moved = session.execute(
                update(BatchRow).where(BatchRow.id == batch.id, BatchRow.owner == owner,
                                       BatchRow.status.in_(ACTIVE_STATUSES))
                .values(status=status, **{f"{status}_at": now}, owner=None, lease_until=0.0, total=total,
                        output_file_id=files["output"].id if "output" in files else None,
                        error_file_id=files["error"].id if "error" in files else None,
                        completed=completed, failed=failed + unrun, prompt_tokens=prompt, cached_tokens=cached,
                        completion_tokens=output_tokens)
            ).rowcount == 1
            if moved:
                session.add_all(files.values())
                session.execute(delete(ResultRow).where(ResultRow.batch_id == batch.id))
        return moved

    def release(self, batch_id: str, owner: str) -> None:
        """Give the lease up (a replica shutting down) so another replica takes the batch at once."""
        with Session(self.engine) as session, session.begin():
            session.execute(update(BatchRow).where(BatchRow.id == batch_id, BatchRow.owner == owner)
                            .values(owner=None, lease_until=0.0))
