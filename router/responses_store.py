"""Stored responses (the Responses API's `store`): what a continuation, a GET or a DELETE reads back.

With a database (the pool's: SQLite locally, PostgreSQL by URL) every router replica reads what any other stored,
for `ttl` seconds (OpenAI keeps responses 30 days). Without one, each replica keeps its newest responses in memory,
so a continuation must come back to the same replica. Both scope every read by tenant: another tenant's id is
not found, as an unknown one. Synchronous: the router calls the database store in a worker thread.

A response keeps only the chat messages its turn adds (router/responses.turn_messages) and a link to the response
it continues; a continuation's history is the chain's messages read back root first, so a conversation of n turns
stores each turn once, not n times. Responses linked this way form a tree (a conversation and its branches) that
lives and expires as one: saving a turn extends its root's expiry, which every member reads. A deleted response
that others continue from stays as a hidden part of their history until the last of them goes (in memory it
counts against the store's capacity; evicted, its messages move into the responses continuing from it).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import (
    BigInteger,
    Select,
    String,
    Text,
    Update,
    bindparam,
    delete,
    exists,
    func,
    literal,
    select,
    update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, aliased, mapped_column

from kvmesh.router.batches import FILE_TTL_SECONDS
from kvmesh.router.store import create_tables, make_engine

RESPONSES_TABLE = "kvmesh_responses"
_ID_LEN, _TENANT_LEN = 64, 64
RESPONSES_TTL_SECONDS = FILE_TTL_SECONDS  # OpenAI keeps a stored response as long as a file: 30 days
RESPONSES_MEMORY_ITEMS = 10_000  # per replica, without a database
# expired conversations are removed this long after they expire (they are hidden at once): a replica extending one
# just as it expires, or with a clock behind another's, never loses part of it to another replica's sweep
SWEEP_GRACE_SECONDS = 3600
# The most links a history read follows: far past any real conversation (every turn adds tokens to a context the
# model bounds), it only ends the query on a loop that hand-edited rows could make (the chain then reads as cut).
MAX_CHAIN_LINKS = 100_000
Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class StoredResponse:
    """A response as clients read it back: the object, and its input items."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]

    @property
    def previous_id(self) -> str | None:
        return self.response.get("previous_response_id")


class ResponseStore(Protocol):
    not_found_hint: str  # said after "not found": what else may explain it

    def save(self, tenant: str, stored: StoredResponse, earlier: Sequence[dict[str, Any]],
             added: Sequence[dict[str, Any]]) -> None:
        """Store a response whose turn added `added` to the history `earlier` read from its previous response
        (kept whole only when that response was removed while this turn ran)."""

    def get(self, tenant: str, response_id: str) -> StoredResponse | None: ...

    def history(self, tenant: str, response_id: str) -> Messages | None:
        """The messages a continuation of the response starts with, the earlier turns' first; None: not found."""

    def delete(self, tenant: str, response_id: str) -> bool: ...

    def close(self) -> None: ...


class _Base(DeclarativeBase):
    pass


class ResponseRow(_Base):
    __tablename__ = RESPONSES_TABLE

    id: Mapped[str] = mapped_column(String(_ID_LEN), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(_TENANT_LEN))  # auth.tenant_hash
    # a root's is its conversation's expiry (extended as turns are added); a member's is when it was saved + ttl
    expires_at: Mapped[int] = mapped_column(BigInteger, index=True)
    response: Mapped[str] = mapped_column(Text)  # JSON, as the fields of StoredResponse
    input_items: Mapped[str] = mapped_column(Text)
    # "" on rows this version writes, so an older router fails to read them (a 503) rather than continue from
    # part of a conversation; an older router's rows keep their whole history here and no `messages`
    history: Mapped[str] = mapped_column(Text)
    # the columns below are NULL on an older router's rows (store.create_tables adds them)
    messages: Mapped[str | None] = mapped_column(Text)  # JSON: what its turn added (all of it at a root)
    previous_id: Mapped[str | None] = mapped_column(String(_ID_LEN), index=True)  # the row it continues
    root_id: Mapped[str | None] = mapped_column(String(_ID_LEN), index=True)  # its conversation's root; NULL: a root
    deleted_at: Mapped[int | None] = mapped_column(BigInteger)  # deleted, kept while others continue from it


def _added(row_messages: str | None, row_history: str) -> Messages:
    """A row's part of the history: its own messages, or an older router's whole history."""
    return json.loads(row_history if row_messages is None else row_messages)


def _find() -> Select[Any]:
    """The response (`rid`, `owner`) if visible at `now`: not deleted, its conversation not expired."""
    root = aliased(ResponseRow)
    return select(ResponseRow.id).outerjoin(root, root.id == ResponseRow.root_id).where(
        ResponseRow.id == bindparam("rid"), ResponseRow.tenant == bindparam("owner"),
        ResponseRow.deleted_at.is_(None), func.coalesce(root.expires_at, ResponseRow.expires_at) >= bindparam("now"))


def _chain() -> Select[Any]:
    """The rows from the response (`rid`, `owner`) up its links to its root, the root first."""
    link = select(ResponseRow.id, ResponseRow.previous_id, ResponseRow.messages, ResponseRow.history,
                  ResponseRow.deleted_at, ResponseRow.expires_at, literal(0).label("depth")).where(
        ResponseRow.id == bindparam("rid"), ResponseRow.tenant == bindparam("owner")).cte(
        "chain", recursive=True)
    up = aliased(ResponseRow)
    chain = link.union_all(select(up.id, up.previous_id, up.messages, up.history, up.deleted_at, up.expires_at,
                                  link.c.depth + 1).where(up.id == link.c.previous_id,
                                                          up.tenant == bindparam("owner"),
                                                          link.c.depth < MAX_CHAIN_LINKS))
    return select(chain).order_by(chain.c.depth.desc())


def _hold(expires_at: Any) -> Update:
    """Write the root of the response's (`rid`, `owner`) conversation unexpired at `now`, which holds it
    (PostgreSQL's row lock, SQLite's one writer) until the transaction ends; its expiry set to `until`."""
    root_of = select(func.coalesce(ResponseRow.root_id, ResponseRow.id)).where(
        ResponseRow.id == bindparam("rid"), ResponseRow.tenant == bindparam("owner")).scalar_subquery()
    return update(ResponseRow).where(
        ResponseRow.id == func.coalesce(root_of, bindparam("rid")), ResponseRow.tenant == bindparam("owner"),
        ResponseRow.expires_at >= bindparam("now")).values(expires_at=expires_at)


# built once: building a statement costs more than SQLite takes to run it
_FIND, _CHAIN = _find(), _chain()
_HOLD, _EXTEND = _hold(ResponseRow.expires_at), _hold(bindparam("until"))
_PARENT = select(ResponseRow.root_id).where(ResponseRow.id == bindparam("rid"),
                                            ResponseRow.tenant == bindparam("owner"))
_EXPIRED_ROOTS = (ResponseRow.root_id.is_(None), ResponseRow.expires_at < bindparam("cutoff"))
_SWEEP_MEMBERS = delete(ResponseRow).where(ResponseRow.root_id.in_(select(ResponseRow.id).where(*_EXPIRED_ROOTS)))
_SWEEP_ROOTS = delete(ResponseRow).where(*_EXPIRED_ROOTS)


class DatabaseResponses:
    """Responses in the pool's database, shared by its replicas; expired conversations are swept as new responses
    are saved. Every change to a conversation first writes its root row, so changes to one conversation take turns
    (PostgreSQL's row lock, SQLite's one writer): a turn saved while its previous response is deleted either links
    to it, which keeps it, or finds it gone and keeps its history whole."""

    not_found_hint = ""

    def __init__(self, url: str, ttl: int) -> None:
        self.engine, self.ttl = make_engine(url), ttl
        create_tables(self.engine, _Base.metadata)

    def save(self, tenant: str, stored: StoredResponse, earlier: Sequence[dict[str, Any]],
             added: Sequence[dict[str, Any]]) -> None:
        now = int(time.time())
        row = ResponseRow(id=stored.response["id"], tenant=tenant, expires_at=now + self.ttl,
                          response=json.dumps(stored.response), input_items=json.dumps(stored.input_items),
                          history="", messages=json.dumps([*earlier, *added]))
        with Session(self.engine) as session, session.begin():
            expired = {"cutoff": now - SWEEP_GRACE_SECONDS}
            session.execute(_SWEEP_MEMBERS, expired)
            session.execute(_SWEEP_ROOTS, expired)
            where = {"rid": stored.previous_id, "owner": tenant, "now": now, "until": row.expires_at}
            if stored.previous_id is not None and session.execute(_EXTEND, where).rowcount:
                parent = session.execute(_PARENT, where).one_or_none()
                if parent is not None:  # else deleted while this turn ran: this row keeps the history whole
                    row.previous_id, row.root_id = stored.previous_id, parent.root_id or stored.previous_id
                    row.messages = json.dumps(added)
            session.add(row)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with Session(self.engine) as session:
            found = session.execute(_FIND.add_columns(ResponseRow.response, ResponseRow.input_items), {
                "rid": response_id, "owner": tenant, "now": int(time.time())}).one_or_none()
        return None if found is None else StoredResponse(json.loads(found.response), json.loads(found.input_items))

    def history(self, tenant: str, response_id: str) -> Messages | None:
        """One query: the chain from the response up to its root (a recursive CTE), each row's part in turn."""
        with Session(self.engine) as session:
            rows = session.execute(_CHAIN, {"rid": response_id, "owner": tenant}).all()
        if not rows:
            return None
        root, leaf = rows[0], rows[-1]
        if leaf.deleted_at is not None or root.previous_id is not None or root.expires_at < time.time():
            return None  # deleted, its chain cut (by an older router's sweep), or expired
        return [message for row in rows for message in _added(row.messages, row.history)]

    def delete(self, tenant: str, response_id: str) -> bool:
        """Hide the response; remove it, and the hidden responses above it that it alone continued from, unless a
        response continues from it."""
        now = int(time.time())
        with Session(self.engine) as session, session.begin():
            where = {"rid": response_id, "owner": tenant, "now": now}
            if not session.execute(_HOLD, where).rowcount or session.execute(_FIND, where).first() is None:
                return False
            session.execute(update(ResponseRow).where(ResponseRow.id == response_id).values(deleted_at=now))
            child = aliased(ResponseRow)
            doomed: str | None = response_id
            while doomed is not None:
                row = session.execute(select(ResponseRow.previous_id).where(
                    ResponseRow.id == doomed, ResponseRow.deleted_at.is_not(None),
                    ~exists().where(child.previous_id == ResponseRow.id))).one_or_none()
                if row is None:
                    break
                session.execute(delete(ResponseRow).where(ResponseRow.id == doomed))
                doomed = row.previous_id
            return True

    def close(self) -> None:
        self.engine.dispose()


@dataclass(eq=False)
class _Conversation:
    """Responses linked by continuation in memory: they live and expire as one, and leave the store oldest first."""

    key: str  # its first response's id: its place in its tenant's order
    expires_at: float
    members: dict[str, None] = field(default_factory=dict)  # oldest first: a response's ancestors come before it


@dataclass(eq=False)
class _Held:
    """One response in memory: a visible one, or a hidden part of the responses that continue from it."""

    tenant: str
    stored: StoredResponse | None  # None once hidden: it only lends its messages to others' histories
    added: Messages  # what its turn added (at a response with no previous one, all of its history)
    previous: str | None  # the response it continues
    conversation: _Conversation
    children: set[str] = field(default_factory=set)  # the responses that continue from it


class MemoryResponses:
    """A replica's newest `capacity` responses in memory (no database), hidden ones that others continue from
    counted: past it, the oldest response of the least recently continued conversation of the tenant holding the
    most goes (the tenant that saved the last one among those tied), so a tenant filling the store evicts its own
    responses, never another's while it holds more, and a conversation still going keeps its turns longest. The
    messages of a response that goes move into the responses continuing from it, so a conversation longer than the
    store goes on. Each response holds its turn's messages; the oldest held of a conversation also those before it,
    at most a context window (truncation is refused)."""

    not_found_hint = (" This router keeps stored responses in its own memory (the pool has no database): behind "
                      "several router replicas, a response stored by another is not found here; give the pool a "
                      "database (spec.store) so that they share them.")

    def __init__(self, capacity: int, ttl: int) -> None:
        self.capacity, self.ttl = capacity, ttl
        self._held: dict[str, _Held] = {}
        # per tenant holding any: its conversations, least recently continued first, and how many responses it holds
        self._conversations: dict[str, OrderedDict[str, _Conversation]] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def _find(self, tenant: str, response_id: str) -> _Held | None:
        held = self._held.get(response_id)
        if held is None or held.tenant != tenant or held.stored is None:
            return None
        return held if held.conversation.expires_at >= time.time() else None

    def save(self, tenant: str, stored: StoredResponse, earlier: Sequence[dict[str, Any]],
             added: Sequence[dict[str, Any]]) -> None:
        response_id, now = stored.response["id"], time.time()
        with self._lock:
            conversations = self._conversations.setdefault(tenant, OrderedDict())
            parent = self._held.get(stored.previous_id or "")
            if parent is not None and parent.tenant == tenant and parent.conversation.expires_at >= now:
                parent.children.add(response_id)
                conversations.move_to_end(parent.conversation.key)
                held = _Held(tenant, stored, list(added), stored.previous_id, parent.conversation)
            else:
                conversation = conversations[response_id] = _Conversation(response_id, now)
                held = _Held(tenant, stored, [*earlier, *added], None, conversation)
            held.conversation.expires_at = now + self.ttl
            held.conversation.members[response_id] = None
            self._held[response_id] = held
            self._counts[tenant] = self._counts.get(tenant, 0) + 1
            while len(self._held) > self.capacity:
                most = max(self._counts, key=lambda t: (self._counts[t], t == tenant))
                oldest = next(iter(self._conversations[most].values()))
                self._drop(next(iter(oldest.members)))

    def _drop(self, response_id: str) -> None:
        """Remove a response; those continuing from it start with its history (theirs then holds it)."""
        held = self._held.pop(response_id)
        for child_id in held.children:
            child = self._held[child_id]
            child.added, child.previous = [*held.added, *child.added], None
        if held.previous is not None:
            self._held[held.previous].children.discard(response_id)
        conversation, tenant = held.conversation, held.tenant
        del conversation.members[response_id]
        if not conversation.members:
            del self._conversations[tenant][conversation.key]
        self._counts[tenant] -= 1
        if not self._counts[tenant]:
            del self._counts[tenant], self._conversations[tenant]

    def _hide(self, response_id: str) -> None:
        """Hide a response; drop it, and the hidden ones above it it alone continued from, unless one continues
        from it."""
        held: _Held | None = self._held[response_id]
        held.stored = None  # type: ignore[union-attr]
        while held is not None and held.stored is None and not held.children:
            previous = held.previous
            self._drop(response_id)
            response_id, held = previous or "", self._held.get(previous or "")

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            held = self._find(tenant, response_id)
            return None if held is None else held.stored

    def history(self, tenant: str, response_id: str) -> Messages | None:
        with self._lock:
            held = self._find(tenant, response_id)
            parts = []
            while held is not None:
                parts.append(held.added)
                held = self._held.get(held.previous or "")
        return [message for part in reversed(parts) for message in part] if parts else None

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            if self._find(tenant, response_id) is None:
                return False
            self._hide(response_id)
            return True

    def close(self) -> None:
        pass


def open_store(database_url: str | None, ttl: int, memory_capacity: int) -> ResponseStore:
    """The pool's database when it has one, else this replica's memory."""
    return DatabaseResponses(database_url, ttl) if database_url else MemoryResponses(memory_capacity, ttl)
