"""Stored responses (the Responses API's `store`): what a continuation, a GET or a DELETE reads back.

With a database (the pool's: SQLite locally, PostgreSQL by URL) every router replica reads what any other stored,
for `ttl` seconds (OpenAI keeps responses 30 days). Without one, each replica keeps its newest responses in memory,
so a continuation must come back to the same replica. Both scope every read by tenant: another tenant's id is
not found, as an unknown one. Synchronous: the router calls the database store in a worker thread.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import BigInteger, String, Text, delete, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kvmesh.router.batches import FILE_TTL_SECONDS
from kvmesh.router.store import create_tables, make_engine

RESPONSES_TABLE = "kvmesh_responses"
_ID_LEN, _TENANT_LEN = 64, 64
RESPONSES_TTL_SECONDS = FILE_TTL_SECONDS  # OpenAI keeps a stored response as long as a file: 30 days
RESPONSES_MEMORY_ITEMS = 10_000  # per replica, without a database


@dataclass(frozen=True)
class StoredResponse:
    """A response as stored: the object clients read, its input items, and the chat messages a continuation of it
    starts with (router/responses.history_after)."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]


class ResponseStore(Protocol):
    not_found_hint: str  # said after "not found": what else may explain it

    def save(self, tenant: str, stored: StoredResponse) -> None: ...

    def get(self, tenant: str, response_id: str) -> StoredResponse | None: ...

    def delete(self, tenant: str, response_id: str) -> bool: ...

    def close(self) -> None: ...


class _Base(DeclarativeBase):
    pass


class ResponseRow(_Base):
    __tablename__ = RESPONSES_TABLE

    id: Mapped[str] = mapped_column(String(_ID_LEN), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(_TENANT_LEN))  # auth.tenant_hash
    expires_at: Mapped[int] = mapped_column(BigInteger, index=True)
    response: Mapped[str] = mapped_column(Text)  # JSON, as the three fields of StoredResponse
    input_items: Mapped[str] = mapped_column(Text)
    history: Mapped[str] = mapped_column(Text)


class DatabaseResponses:
    """Responses in the pool's database, shared by its replicas; expired rows are swept as new ones are saved."""

    not_found_hint = ""

    def __init__(self, url: str, ttl: int) -> None:
        self.engine, self.ttl = make_engine(url), ttl
        create_tables(self.engine, _Base.metadata)

    def save(self, tenant: str, stored: StoredResponse) -> None:
        now = int(time.time())
        row = ResponseRow(id=stored.response["id"], tenant=tenant, expires_at=now + self.ttl,
                          response=json.dumps(stored.response), input_items=json.dumps(stored.input_items),
                          history=json.dumps(stored.history))
        with Session(self.engine) as session, session.begin():
            session.execute(delete(ResponseRow).where(ResponseRow.expires_at < now))
            session.add(row)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with Session(self.engine) as session:
            row = session.scalar(select(ResponseRow).where(
                ResponseRow.id == response_id, ResponseRow.tenant == tenant,
                ResponseRow.expires_at >= int(time.time())))
            if row is None:
                return None
            return StoredResponse(json.loads(row.response), json.loads(row.input_items), json.loads(row.history))

    def delete(self, tenant: str, response_id: str) -> bool:
        with Session(self.engine) as session, session.begin():
            result = session.execute(delete(ResponseRow).where(ResponseRow.id == response_id,
                                                               ResponseRow.tenant == tenant))
            return bool(result.rowcount)

    def close(self) -> None:
        self.engine.dispose()


class MemoryResponses:
    """A replica's newest `capacity` responses in memory (no database): the oldest goes first."""

    not_found_hint = (" This router keeps stored responses in its own memory (the pool has no database): behind "
                      "several router replicas, a response stored by another is not found here; give the pool a "
                      "database (spec.store) so that they share them.")

    def __init__(self, capacity: int, ttl: int) -> None:
        self.capacity, self.ttl = capacity, ttl
        self._items: OrderedDict[str, tuple[str, float, StoredResponse]] = OrderedDict()
        self._lock = threading.Lock()

    def save(self, tenant: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[stored.response["id"]] = (tenant, time.time() + self.ttl, stored)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            held = self._items.get(response_id)
        if held is None or held[0] != tenant or held[1] < time.time():
            return None
        return held[2]

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            held = self._items.get(response_id)
            if held is None or held[0] != tenant:
                return False
            del self._items[response_id]
            return True

    def close(self) -> None:
        pass


def open_store(database_url: str | None, ttl: int, memory_capacity: int) -> ResponseStore:
    """The pool's database when it has one, else this replica's memory."""
    return DatabaseResponses(database_url, ttl) if database_url else MemoryResponses(memory_capacity, ttl)
