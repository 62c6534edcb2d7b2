"""The Batch API: checking input files and ordering their requests (pure), the store shared by router replicas
(claims, leases, results kept once), the runner's handling of refusals, errors, cancellation, expiry and a takeover,
and the whole flow through a real router in front of a real engine (the tiny model) with the official client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import random
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy
import yaml

from kvmesh.router import batch_store
from kvmesh.router.app import build_router
from kvmesh.router.auth import hash_key, tenant_hash
from kvmesh.router.batch_runner import GROUP_MIN_CHARS, Answer, BatchRunner, BatchSettings, check_stored_input
from kvmesh.router.batch_store import BatchStore
from kvmesh.router.batches import (
    BATCH_PRIORITY,
    CHAT_PATH,
    COMPLETIONS_PATH,
    BatchInputError,
    BatchLine,
    check_input,
    check_metadata,
    expiry_seconds,
    jsonl,
    prefix_groups,
    request_lines,
    run_order,
    window_seconds,
)
from kvmesh.router.config import RouterConfig
from kvmesh.router.store import RequestLog

from .conftest import make_engine
from .engines import serve_checked, serve_router

TENANT = tenant_hash("default")


def line(custom_id: str, body: dict[str, Any], url: str = CHAT_PATH, method: str = "POST") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def chat(system: str, question: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 2, "temperature": 0, **extra}


# ---- the input file ---------------------------------------------------------------------------------------------


def test_a_good_file_gives_its_requests_in_file_order() -> None:
    entries = [line(f"r{i}", chat("s", f"q{i}")) for i in range(5)]
    checked = check_input(jsonl(entries) + b"\n\n", CHAT_PATH, max_requests=10)  # blank lines are skipped
    assert not checked.problems
    assert [(x.line, x.custom_id) for x in checked.lines] == [(i, f"r{i}") for i in range(5)]
    assert checked.lines[2].body == entries[2]["body"] and checked.model is None  # the requests name none
    named = check_input(jsonl([line("a", chat("s", "q")), line("b", chat("s", "q", model="m1"))]), CHAT_PATH, 10)
    assert named.model == "m1"


def test_a_file_with_any_problem_is_refused_whole_with_each_problem_and_its_line() -> None:
    text = "\n".join([
        json.dumps(line("a", chat("s", "q"))),
        json.dumps(line("a", chat("s", "q"))),  # duplicate id
        json.dumps(line("b", chat("s", "q"), url=COMPLETIONS_PATH)),  # another endpoint
        json.dumps(line("c", chat("s", "q"), method="GET")),
        json.dumps(line("d", chat("s", "q", stream=True))),
        "{not json",
        json.dumps(line("e", "a string")),  # type: ignore[arg-type]
        json.dumps([1, 2]),
        json.dumps(line("", chat("s", "q"))),
        json.dumps(line("f", chat("s", "q", stream_options={"include_usage": True}))),  # the engines' 400 at run time
        json.dumps(line("g", chat("s", "q", stream=False, stream_options={"include_usage": True}))),
        json.dumps(line("h", chat("s", "q", stream=False, stream_options=None))),  # null: as if absent, fine
    ])
    checked = check_input(text.encode(), CHAT_PATH, max_requests=10)
    assert checked.lines == []
    assert [(p.code, p.line) for p in checked.problems] == [
        ("duplicate_custom_id", 2), ("mismatched_endpoint", 3), ("invalid_method", 4), ("invalid_request", 5),
        ("invalid_json_line", 6), ("invalid_request", 7), ("invalid_json_line", 8), ("invalid_custom_id", 9),
        ("invalid_request", 10), ("invalid_request", 11)]
    assert [p.param for p in checked.problems[-2:]] == ["body.stream_options"] * 2
    assert "stream_options is only allowed with stream: true" in checked.problems[-1].message
    many = check_input(b"\n".join([b"{not json"] * 150), CHAT_PATH, max_requests=10)
    assert len(many.problems) == 101 and many.problems[-1].code == "more_problems" and "50 more" in \
        many.problems[-1].message


def test_lines_end_at_newlines_only_so_json_strings_may_hold_unicode_line_separators() -> None:
    entry = line("a", chat("s", "one\u2028two\u0085three"))
    text = json.dumps(entry, ensure_ascii=False) + "\r\n"  # raw separators, a CRLF ending
    checked = check_input(text.encode(), CHAT_PATH, max_requests=10)
    assert not checked.problems and checked.lines[0].body["messages"][1]["content"] == "one\u2028two\u0085three"


def test_an_empty_file_a_file_over_the_bound_and_one_not_utf8_are_refused() -> None:
    assert [p.code for p in check_input(b"\n \n", CHAT_PATH, 10).problems] == ["empty_file"]
    many = jsonl(line(f"r{i}", chat("s", "q")) for i in range(4))
    assert [p.code for p in check_input(many, CHAT_PATH, 3).problems] == ["too_many_requests"]
    assert [p.code for p in check_input(b"\xff\xfe", CHAT_PATH, 3).problems] == ["invalid_file_format"]
    not_utf8 = check_input(many + b"\xff\xfe\n", CHAT_PATH, 10).problems  # checked line by line: the line named
    assert [(p.code, p.line) for p in not_utf8] == [("invalid_file_format", 5)]


def test_a_file_given_in_pieces_is_checked_as_whole_even_where_a_piece_cuts_a_character() -> None:
    entries = [line(f"r{i}", chat("système", f"日本語 {i} 🙂")) for i in range(4)]
    good = b"\r\n".join(json.dumps(e, ensure_ascii=False).encode() for e in entries) + b"\r\n\n"
    bad = good + b"\xff\n" + good  # not UTF-8 on line 6
    for content in (good, bad, b"", b"\n", b"{}"):
        whole = check_input(content, CHAT_PATH, 10)
        for size in range(1, 24):  # every cut: inside a character, between "\r" and "\n", at a line's end
            pieces = [content[i:i + size] for i in range(0, len(content), size)]
            assert check_input(iter(pieces), CHAT_PATH, 10) == whole, size
            assert request_lines(iter(pieces)) == request_lines(content)
    checked = check_input([good[:3], good[3:]], CHAT_PATH, 10)
    assert [x.body for x in checked.lines] == [e["body"] for e in entries]  # "è" cut after its first byte
    assert [(p.code, p.line) for p in check_input([bad], CHAT_PATH, 10).problems] == [("invalid_file_format", 6)]


def test_the_window_and_the_metadata_are_checked() -> None:
    assert window_seconds("24h") == 86400 and window_seconds("1h") == 3600
    for bad in ("24", "0h", "2d", "169h", "", "1.5h"):
        with pytest.raises(BatchInputError, match="completion_window"):
            window_seconds(bad)
    assert check_metadata({"team": "search"}) == {"team": "search"} and check_metadata(None) is None
    for bad in ({"k": 1}, {str(i): "v" for i in range(17)}, {"k" * 65: "v"}, ["k"]):
        with pytest.raises(BatchInputError, match="metadata"):
            check_metadata(bad)


def test_a_file_lifetime_is_openais_expires_after_30_days_by_default() -> None:
    assert expiry_seconds(None, "expires_after") == 30 * 86400
    assert expiry_seconds({"anchor": "created_at", "seconds": 7200}, "expires_after") == 7200
    assert expiry_seconds({"anchor": "created_at", "seconds": "7200"}, "expires_after") == 7200  # a form's text
    for bad in ({"anchor": "created_at", "seconds": 60}, {"anchor": "created_at", "seconds": 31 * 86400},
                {"anchor": "last_active_at", "seconds": 7200}, {"seconds": 7200}, 7200):
        with pytest.raises(BatchInputError, match="output_expires_after"):
            expiry_seconds(bad, "output_expires_after")


def test_requests_sharing_a_prefix_are_sent_together_whatever_the_file_order() -> None:
    """Sorted order is the prefix trie's depth-first order: each system prompt's requests form one run, and a
    shorter shared prefix (the same opening with another ending) sits next to its longer relatives."""
    systems = ["You are a lawyer. " * 8, "You are a doctor. " * 8, "You are a doctor. " * 8 + "Be brief."]
    lines = [BatchLine(i, f"r{i}", chat(systems[i % 3], f"question {i}")) for i in range(30)]
    random.Random(7).shuffle(lines)
    ordered = run_order(lines)
    runs = [body["messages"][0]["content"] for body in (x.body for x in ordered)]
    changes = sum(1 for a, b in itertools.pairwise(runs) if a != b)
    assert changes == 2  # three runs, one per system prompt
    assert sorted(x.line for x in ordered) == list(range(30))
    # the two doctor prompts (one a prefix of the other) are adjacent runs
    assert runs.index(systems[2]) in (runs.index(systems[1]) + 10, runs.index(systems[1]) - 10)
    assert [x.line for x in run_order(lines, "file")] == list(range(30))  # batch_order: file
    # the two doctor prompts open with about 170 characters alike (the key's model and tools, then 144 of prompt)
    assert [len(g) for g in prefix_groups(ordered, min_shared_chars=100)] == [20, 10]
    assert [len(g) for g in prefix_groups(ordered, min_shared_chars=200)] == [10, 10, 10]
    assert [len(g) for g in prefix_groups(ordered, 0)] == [1] * 30


def test_requests_sharing_a_short_opening_are_not_held_back() -> None:
    lines = [BatchLine(i, f"r{i}", chat("Hi", f"question {i}")) for i in range(3)]
    assert [len(g) for g in prefix_groups(run_order(lines), GROUP_MIN_CHARS)] == [1, 1, 1]


# ---- the store --------------------------------------------------------------------------------------------------


@pytest.fixture
def store(database_url: str) -> Iterator[BatchStore]:
    """On a SQLite file and on PostgreSQL (conftest's database_url): a local pool's database and a cluster's."""
    batches = BatchStore(database_url)
    yield batches
    batches.close()


def new_batch(store: BatchStore, entries: list[dict[str, Any]], window: int = 3600, tenant: str = TENANT) -> str:
    file = store.add_file(tenant, "batch", "in.jsonl", jsonl(entries), ttl=None)
    return store.create_batch(tenant, CHAT_PATH, file["id"], "1h", window, None, None, 10**6)["id"]


def test_two_replicas_never_hold_one_batch_and_a_stopped_ones_lease_passes_on(store: BatchStore) -> None:
    batch_id = new_batch(store, [line("a", chat("s", "q"))])
    held = store.claim("replica-a", lease_seconds=60)
    assert held is not None and held.id == batch_id and held.status == "validating"
    assert store.claim("replica-b", lease_seconds=60) is None  # leased
    assert store.renew(batch_id, "replica-b", 60) is None  # not its lease
    assert store.renew(batch_id, "replica-a", -1) == "validating"  # a's lease now over: as if it stopped renewing
    assert store.claim("replica-b", lease_seconds=60) is not None
    assert store.renew(batch_id, "replica-a", 60) is None  # a learns it lost the batch
    assert not store.start(batch_id, "replica-a", 1, None)  # and cannot move it


def test_a_database_an_older_kvmesh_made_gets_the_new_columns_and_keeps_its_rows(database_url: str) -> None:
    from sqlalchemy import text

    older = BatchStore(database_url)
    kept = new_batch(older, [line("a", chat("s", "q"))])
    with older.engine.begin() as conn:  # the tables as the previous release made them
        conn.execute(text("ALTER TABLE kvmesh_files DROP COLUMN lines"))
        conn.execute(text("ALTER TABLE kvmesh_batches DROP COLUMN model"))
    older.close()
    upgraded = BatchStore(database_url)
    try:
        assert upgraded.batch(TENANT, kept)["status"] == "validating"
        new_batch(upgraded, [line("a", chat("s", "q")), line("b", chat("s", "q"))])
        assert len(upgraded.batches(TENANT, 10, None)["data"]) == 2
        BatchStore(database_url).close()  # a second replica starting on the upgraded tables alters nothing
    finally:
        upgraded.close()


def test_postgresql_stores_file_contents_uncompressed_so_a_piece_is_read_alone(database_url: str) -> None:
    """A compressed bytea is decompressed from its start for every substr: PostgreSQL keeps contents uncompressed
    (STORAGE EXTERNAL), in a new database and in one an older kvmesh made; a piece still reads back exactly."""
    if not database_url.startswith("postgresql"):
        pytest.skip("SQLite never compresses a blob")
    storage = sqlalchemy.text("SELECT attstorage FROM pg_attribute "
                              "WHERE attrelid = 'kvmesh_files'::regclass AND attname = 'content'")
    older = BatchStore(database_url)
    with older.engine.begin() as conn:
        assert conn.scalar(storage) == "e"
        conn.execute(sqlalchemy.text("ALTER TABLE kvmesh_files ALTER COLUMN content SET STORAGE EXTENDED"))
    older.close()
    upgraded = BatchStore(database_url)
    try:
        with upgraded.engine.connect() as conn:
            assert conn.scalar(storage) == "e"
        content = b"lorem ipsum " * 300_000  # 3.6 MB that compress well: stored as they are
        file = upgraded.add_file(TENANT, "batch", "in.jsonl", content, ttl=None)
        with upgraded.engine.connect() as conn:
            stored = conn.scalar(sqlalchemy.text("SELECT pg_column_size(content) FROM kvmesh_files"))
        assert stored >= len(content)
        pieces = upgraded.file_pieces(TENANT, file["id"])
        assert pieces is not None and b"".join(pieces[1]) == content
    finally:
        upgraded.close()


def test_files_uploaded_before_lines_were_counted_weigh_on_the_enqueued_limit(database_url: str) -> None:
    from sqlalchemy import text

    def upload(store: BatchStore, requests: int) -> str:
        entries = [line(f"r{i}", chat("s", f"q{i}")) for i in range(requests)]
        return store.add_file(TENANT, "batch", "in.jsonl", jsonl(entries) + b"\n", ttl=None)["id"]  # a blank line

    def create(store: BatchStore, file_id: str) -> str:
        return store.create_batch(TENANT, CHAT_PATH, file_id, "1h", 3600, None, None, max_enqueued=10)["id"]

    older = BatchStore(database_url)
    running, waiting, small = upload(older, 3), upload(older, 6), upload(older, 5)  # 4, 7 and 6 lines
    create(older, running)  # enqueued before the upgrade
    with older.engine.begin() as conn:  # the table as the release before `lines` made it
        conn.execute(text("ALTER TABLE kvmesh_files DROP COLUMN lines"))
    older.close()
    upgraded = BatchStore(database_url)  # `lines` comes back as 0 in every row
    try:
        with pytest.raises(BatchInputError, match=r"hold 4 requests .* 7 lines; the limit is 10"):
            create(upgraded, waiting)
        create(upgraded, small)  # 4 + 6: not past 10
        with upgraded.engine.connect() as conn:
            counted = dict(conn.execute(sqlalchemy.select(batch_store.FileRow.id, batch_store.FileRow.lines)).all())
        assert [counted[f] for f in (running, waiting, small)] == [4, 7, 6]  # stored: counted once
    finally:
        upgraded.close()


def test_replicas_racing_for_a_batch_agree_on_one_winner(store: BatchStore) -> None:
    new_batch(store, [line("a", chat("s", "q"))])
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        claims = list(pool.map(lambda i: store.claim(f"replica-{i}", lease_seconds=60), range(6)))
    assert sum(c is not None for c in claims) == 1


def test_each_request_is_recorded_once_and_only_by_the_replica_running_the_batch(store: BatchStore) -> None:
    from kvmesh.router.batches import LineResult

    batch_id = new_batch(store, [line("a", chat("s", "q")), line("b", chat("s", "q"))])
    ok = {"id": "x", "usage": {"prompt_tokens": 10, "completion_tokens": 2,
                               "prompt_tokens_details": {"cached_tokens": 8}}}
    assert store.claim("replica-a", lease_seconds=60) is not None
    assert store.add_results(batch_id, "replica-a", [LineResult(0, "a", 200, ok, "x")])
    assert not store.add_results(batch_id, "replica-b", [LineResult(1, "b", 200, ok, "w")])  # not its batch
    assert store.add_results(batch_id, "replica-a", [LineResult(0, "a", 200, ok, "y"),
                                                     LineResult(1, "b", 400, {"error": {}}, "z")])
    assert store.answered_lines(batch_id) == {0, 1}
    assert [r.request_id for r in store.results(batch_id)] == ["x", "z"]
    shown = store.batch(TENANT, batch_id)
    assert shown is not None
    assert shown["request_counts"] == {"total": 0, "completed": 1, "failed": 1}
    assert shown["usage"]["input_tokens"] == 10 and shown["usage"]["input_tokens_details"]["cached_tokens"] == 8


def test_a_tenant_sees_only_its_own_files_and_batches(store: BatchStore) -> None:
    batch_id = new_batch(store, [line("a", chat("s", "q"))])
    other = tenant_hash("other")
    assert store.batch(other, batch_id) is None and store.cancel(other, batch_id) is None
    assert store.files(other, None, 20, None)["data"] == []
    file_id = store.files(TENANT, None, 20, None)["data"][0]["id"]
    assert store.file_pieces(other, file_id) is None and not store.delete_file(other, file_id)  # a 404, no more
    spare = store.add_file(TENANT, "batch", "spare.jsonl", b"{}", ttl=None)["id"]
    assert not store.delete_file(other, spare)
    assert store.delete_file(TENANT, spare) and store.file(TENANT, spare) is None


def test_an_expired_file_is_gone_for_clients_at_once_and_from_the_database_at_the_sweep(store: BatchStore) -> None:
    kept = store.add_file(TENANT, "batch", "kept.jsonl", b"{}", ttl=3600)
    gone = store.add_file(TENANT, "batch", "gone.jsonl", b"{}", ttl=-1)
    assert kept["expires_at"] == kept["created_at"] + 3600
    assert store.file(TENANT, gone["id"]) is None and store.file_pieces(TENANT, gone["id"]) is None
    assert [f["id"] for f in store.files(TENANT, None, 20, None)["data"]] == [kept["id"]]
    assert store.delete_expired() == 1 and store.delete_expired() == 0
    assert store.file(TENANT, kept["id"]) is not None


def test_list_pages_run_newest_first_from_a_cursor(store: BatchStore) -> None:
    ids = [new_batch(store, [line("a", chat("s", "q"))]) for _ in range(5)]
    first = store.batches(TENANT, 2, None)
    assert [b["id"] for b in first["data"]] == ids[::-1][:2] and first["has_more"]
    rest = store.batches(TENANT, 10, first["last_id"])
    assert [b["id"] for b in rest["data"]] == ids[::-1][2:] and not rest["has_more"]
    oldest = store.batches(TENANT, 2, ids[1], newest_first=False)  # order=asc
    assert [b["id"] for b in oldest["data"]] == ids[2:4] and oldest["has_more"]
    with pytest.raises(BatchInputError, match="after: no batch with id 'batch_gone'"):
        store.batches(TENANT, 2, "batch_gone")  # paging would start over and repeat itself


def test_a_running_batchs_input_cannot_be_deleted_and_outlives_its_expiry(store: BatchStore) -> None:
    file = store.add_file(TENANT, "batch", "in.jsonl", jsonl([line("a", chat("s", "q"))]), ttl=-1)  # expired
    batch_id = store.create_batch(TENANT, CHAT_PATH, file["id"], "1h", 3600, None, None, 10**6)["id"]
    with pytest.raises(BatchInputError, match=f"input of batch {batch_id}") as refused:
        store.delete_file(TENANT, file["id"])
    assert refused.value.status == 409
    assert store.delete_expired() == 0  # the sweep keeps what a running batch reads
    assert store.file_pieces(TENANT, file["id"]) is None  # gone for clients...
    assert store.file_pieces(TENANT, file["id"], expired_too=True) is not None  # ...not for the batch


def test_a_tenants_batches_enqueue_at_most_its_limit_and_an_ended_batch_frees_its_share(store: BatchStore) -> None:
    def create(tenant: str, requests: int) -> str:
        entries = [line(f"r{i}", chat("s", f"q{i}")) for i in range(requests)]
        file = store.add_file(tenant, "batch", "in.jsonl", jsonl(entries) + b"\n", ttl=None)  # a blank line too
        return store.create_batch(tenant, CHAT_PATH, file["id"], "1h", 3600, None, None, max_enqueued=10)["id"]

    first = create(TENANT, 4)
    second = create(TENANT, 4)  # 5 + 5 lines (the blank line counts): 10 is not passed
    with pytest.raises(BatchInputError, match=r"hold 10 requests .* 2 lines; the limit is 10") as refused:
        create(TENANT, 1)
    assert (refused.value.status, refused.value.code) == (429, "batch_enqueued_limit_reached")
    create("other-tenant", 9)  # each tenant has its own
    assert store.claim("replica-a", 30) is not None and store.start(first, "replica-a", 4, None)
    with pytest.raises(BatchInputError):  # an in-progress batch still holds its requests
        create(TENANT, 1)
    assert store.cancel(TENANT, second) is not None  # cancelling: no longer enqueued
    create(TENANT, 4)


def test_a_download_is_read_from_the_database_in_bounded_pieces(store: BatchStore,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_store, "PIECE_BYTES", 1000)
    content = jsonl([line(f"r{i}", chat("s" * 50, f"q{i}")) for i in range(60)])
    file = store.add_file(TENANT, "batch", "in.jsonl", content, ttl=None)
    stored = store.file_pieces(TENANT, file["id"])
    assert stored is not None and stored[0] == len(content)
    pieces = list(stored[1])
    assert b"".join(pieces) == content and len(pieces) == -(-len(content) // 1000)
    assert all(len(piece) <= 1000 for piece in pieces)
    assert store.file_pieces("other-tenant", file["id"]) is None


def test_the_runner_checks_an_input_a_piece_at_a_time_never_holding_the_file_whole(
        store: BatchStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_store, "PIECE_BYTES", 2**16)
    padding = " " * 20_000  # JSON may end in blanks: bytes the file has and its parsed requests do not
    content = b"".join(json.dumps(line(f"r{i}", chat("s", f"q{i} é🙂"))).encode() + padding.encode() + b"\n"
                       for i in range(200))
    file = store.add_file(TENANT, "batch", "in.jsonl", content, ttl=None)
    store.create_batch(TENANT, CHAT_PATH, file["id"], "1h", 3600, None, None, 10**6)
    claimed = store.claim("replica-a", 60)
    assert claimed is not None
    tracemalloc.start()
    try:
        checked = check_stored_input(store, claimed, 1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert checked is not None and not checked.problems and len(checked.lines) == 200
    assert checked.lines[7].body == chat("s", "q7 é🙂")
    assert peak < len(content) / 4, (peak, len(content))  # a few pieces and the requests, not the 4 MB file


def test_an_input_cut_mid_character_by_the_pieces_reads_back_whole(store: BatchStore,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_store, "PIECE_BYTES", 7)  # cuts "日本語" and "🙂" in most lines
    entries = [line(f"r{i}", chat("s", f"日本語 {i} 🙂")) for i in range(30)]
    batch_id = new_batch(store, entries)
    claimed = store.claim("replica-a", 60)
    assert claimed is not None and claimed.id == batch_id
    checked = check_stored_input(store, claimed, 1000)
    assert checked is not None and [x.body for x in checked.lines] == [e["body"] for e in entries]


def test_a_file_deleted_while_it_is_read_ends_short_and_its_check_finds_no_file(
        store: BatchStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_store, "PIECE_BYTES", 100)
    new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(10)])
    claimed = store.claim("replica-a", 60)
    assert claimed is not None
    reading = store.file_pieces

    def deleted_after_a_piece(tenant: str, file_id: str, expired_too: bool = False) -> Any:
        stored = reading(tenant, file_id, expired_too)
        assert stored is not None
        size, pieces = stored

        def cut() -> Iterator[bytes]:
            yield next(pieces)
            with store.engine.begin() as conn:  # under the API's rule (a running batch's file is kept): by hand
                conn.execute(sqlalchemy.delete(batch_store.FileRow).where(batch_store.FileRow.id == file_id))
            yield from pieces

        return size, cut()

    monkeypatch.setattr(store, "file_pieces", deleted_after_a_piece)
    assert check_stored_input(store, claimed, 1000) is None  # not a batch of the lines read before it went


# ---- the runner, over a scripted pool ---------------------------------------------------------------------------
# The pool's answers are scripted here: a real pool cannot be made to refuse, fail or hang on cue. The end-to-end
# tests below run batches through a real router and engine.


class Counters:
    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.ended: list[str] = []
        self.held = 0

    def request(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def finished(self, status: str) -> None:
        self.ended.append(status)

    def running(self, delta: int) -> None:
        self.held += delta


FAST = BatchSettings(concurrency=2, flush_seconds=0.05, lease_seconds=5, poll_seconds=0.05)


def served(body: dict[str, Any]) -> Answer:
    return Answer(200, {"id": "cmpl-" + body["messages"][1]["content"],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 2}})


def recording_sender() -> tuple[list[str], Callable[[str, str, dict[str, Any]], Awaitable[Answer]]]:
    """A send that answers at once and records each request's question, in the order sent."""
    sent: list[str] = []

    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        sent.append(body["messages"][1]["content"])
        return served(body)

    return sent, send


async def run_claimed(runner: BatchRunner, store: BatchStore) -> None:
    claimed = await asyncio.to_thread(store.claim, runner.owner, runner.settings.lease_seconds)
    assert claimed is not None
    await runner.run(claimed)


def output_of(store: BatchStore, batch_id: str) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    batch = store.batch(TENANT, batch_id)
    assert batch is not None

    def lines(file_id: str | None) -> list[dict[str, Any]]:
        stored = store.file_pieces(TENANT, file_id) if file_id else None
        return [json.loads(x) for x in b"".join(stored[1] if stored else []).splitlines()]

    return batch, lines(batch["output_file_id"]), lines(batch["error_file_id"])


def test_refusals_are_sent_again_server_errors_retried_and_other_answers_final(store: BatchStore) -> None:
    calls: dict[str, int] = {}

    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        question = body["messages"][1]["content"]
        calls[question] = calls.get(question, 0) + 1
        if question == "shed" and calls[question] < 3:
            return Answer(429, {"error": {"message": "overloaded"}}, retry_after=0.01)
        if question == "broken":
            return Answer(502, {"error": {"message": "pod broke off", "code": None}})
        if question == "bad":
            return Answer(400, {"error": {"message": "messages: invalid", "code": None}})
        if question == "huge":  # over the tenant's whole minute of tokens: no Retry-After, waiting cannot help
            return Answer(429, {"error": {"message": "Request too large", "code": "rate_limit_exceeded"}})
        return served(body)

    batch_id = new_batch(store, [line(q, chat("s", q)) for q in ("ok", "shed", "broken", "bad", "huge")])
    counters = Counters()
    runner = BatchRunner(store, send, lambda pseudonym: "default", counters, FAST)
    asyncio.run(run_claimed(runner, store))
    batch, output, errors = output_of(store, batch_id)
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
    assert {x["custom_id"] for x in output} == {"ok", "shed"}
    assert {x["custom_id"]: x["response"]["status_code"] for x in errors} == {"broken": 502, "bad": 400, "huge": 429}
    assert all(x["error"] is None for x in errors)  # as OpenAI's: `error` only for a request with no HTTP answer
    assert calls == {"ok": 1, "shed": 3, "broken": FAST.server_error_attempts, "bad": 1, "huge": 1}
    assert counters.requests == {"ok": 2, "failed": 3, "retried": 2 + FAST.server_error_attempts - 1}
    assert counters.ended == ["completed"] and batch["usage"]["input_tokens"] == 10
    assert store.answered_lines(batch_id) == set()  # the answers moved into the files; the counts stay frozen


@pytest.mark.parametrize("order", ["prefix", "file"])
def test_a_prefix_run_is_sent_after_its_first_request_is_answered(store: BatchStore, order: str) -> None:
    """The first request of each run of a long shared prefix goes alone; the rest follow its answer (the prefix is
    cached then), while another run's first goes meanwhile. In file order nothing waits."""
    long_a, long_b = "A" * GROUP_MIN_CHARS, "B" * GROUP_MIN_CHARS
    entries = [line(f"{tag}{i}", chat(system, f"{tag}{i}")) for i in range(4) for tag, system in
               (("a", long_a), ("b", long_b), ("s", "short"))]
    events: list[tuple[str, str]] = []

    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        question = body["messages"][1]["content"]
        events.append(("sent", question))
        await asyncio.sleep(0.02)
        events.append(("answered", question))
        return served(body)

    batch_id = new_batch(store, entries)
    settings = BatchSettings(concurrency=4, flush_seconds=0.05, lease_seconds=5, order=order)
    asyncio.run(run_claimed(BatchRunner(store, send, lambda pseudonym: "default", Counters(), settings), store))
    batch = store.batch(TENANT, batch_id)
    assert batch is not None and batch["request_counts"]["completed"] == 12
    if order == "prefix":
        for tag in ("a", "b"):
            first = events.index(("answered", f"{tag}0"))
            assert min(events.index(("sent", f"{tag}{i}")) for i in (1, 2, 3)) > first, events
        assert events.index(("sent", "b0")) < events.index(("answered", "a0"))  # another run's first meanwhile
    else:  # in file order a1 is among the first four sent, before a0's answer
        assert events.index(("sent", "a1")) < events.index(("answered", "a0")), events


def test_batches_take_turns_so_a_long_one_does_not_hold_the_replica(store: BatchStore) -> None:
    sent: list[str] = []

    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        sent.append(body["messages"][1]["content"])
        await asyncio.sleep(0.01)
        return served(body)

    long = new_batch(store, [line(f"a{i}", chat("s", f"a{i}")) for i in range(40)])
    short = new_batch(store, [line(f"b{i}", chat("s", f"b{i}")) for i in range(3)])
    counters = Counters()
    settings = BatchSettings(concurrency=1, flush_seconds=0.02, lease_seconds=5, poll_seconds=0.02, turn_seconds=0.05)

    async def scenario() -> None:
        runner = asyncio.create_task(BatchRunner(store, send, lambda pseudonym: "default", counters,
                                                 settings).serve_forever())
        while len(counters.ended) < 2:
            await asyncio.sleep(0.02)
        runner.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert counters.ended == ["completed", "completed"]
    assert max(sent.index(f"b{i}") for i in range(3)) < sent.index("a39")  # the short one ran in the long one's time
    assert sorted(sent) == sorted([f"a{i}" for i in range(40)] + ["b0", "b1", "b2"])  # each request sent once
    for batch_id, total in ((long, 40), (short, 3)):
        batch = store.batch(TENANT, batch_id)
        assert batch is not None and batch["request_counts"] == {"total": total, "completed": total, "failed": 0}


def test_a_cancelled_batch_stops_sending_and_lists_what_it_never_ran(store: BatchStore) -> None:
    started = asyncio.Event()
    sent: list[str] = []

    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        sent.append(body["messages"][1]["content"])
        if len(sent) == 2:
            started.set()
            await asyncio.sleep(3600)  # the pool holds this one until the batch stops
        return served(body)

    batch_id = new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(6)])
    counters = Counters()

    async def scenario() -> None:
        runner = BatchRunner(store, send, lambda pseudonym: "default", counters,
                             BatchSettings(concurrency=1, flush_seconds=0.05, lease_seconds=5))
        run = asyncio.create_task(run_claimed(runner, store))
        await started.wait()
        assert (await asyncio.to_thread(store.cancel, TENANT, batch_id))["status"] == "cancelling"
        await run

    asyncio.run(scenario())
    batch, output, errors = output_of(store, batch_id)
    assert batch["status"] == "cancelled" and batch["cancelled_at"] is not None
    assert [x["custom_id"] for x in output] == ["r0"]
    assert {x["custom_id"] for x in errors} == {f"r{i}" for i in range(1, 6)}
    assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
    assert batch["request_counts"] == {"total": 6, "completed": 1, "failed": 5}
    assert counters.ended == ["cancelled"]


def test_a_batch_cancelled_before_it_started_counts_every_request_as_failed(store: BatchStore) -> None:
    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        raise AssertionError("a cancelled batch sends nothing")

    batch_id = new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(4)])
    store.cancel(TENANT, batch_id)
    asyncio.run(run_claimed(BatchRunner(store, send, lambda pseudonym: "default", Counters(), FAST), store))
    batch, output, errors = output_of(store, batch_id)
    assert batch["status"] == "cancelled" and output == [] and len(errors) == 4
    assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 4}


def test_a_passing_database_fault_loses_no_answer(store: BatchStore) -> None:
    """One renewal mid-run fails (a dropped connection): the run goes on and every answer is written."""
    faults = iter([None, RuntimeError("connection reset")])  # the first renewal, before any request is sent, passes
    renew = store.renew

    def flaky_renew(batch_id: str, owner: str, lease_seconds: float) -> str | None:
        if (fault := next(faults, None)) is not None:
            raise fault
        return renew(batch_id, owner, lease_seconds)

    store.renew = flaky_renew  # type: ignore[method-assign]

    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        await asyncio.sleep(0.01)
        return served(body)

    batch_id = new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(20)])
    settings = BatchSettings(concurrency=2, flush_seconds=0.02, lease_seconds=5, poll_seconds=0.02)
    asyncio.run(run_claimed(BatchRunner(store, send, lambda pseudonym: "default", Counters(), settings), store))
    batch, output, _ = output_of(store, batch_id)
    assert next(faults, None) is None  # the fault happened
    assert batch["status"] == "completed" and len(output) == 20


def test_a_replica_that_stops_hands_its_batch_on_at_once_keeping_its_answers(store: BatchStore) -> None:
    sent: list[str] = []

    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        sent.append(body["messages"][1]["content"])
        if len(sent) > 3:
            await asyncio.sleep(3600)  # the rest hang until the replica stops
        return served(body)

    batch_id = new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(8)])
    settings = BatchSettings(concurrency=1, flush_seconds=0.02, lease_seconds=60, poll_seconds=0.02)

    async def scenario() -> None:
        runner = asyncio.create_task(BatchRunner(store, send, lambda pseudonym: "default", Counters(), settings,
                                                 owner="stopping").serve_forever())
        while len(sent) < 4:
            await asyncio.sleep(0.02)
        runner.cancel()  # the router's shutdown
        with contextlib.suppress(asyncio.CancelledError):
            await runner

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert store.answered_lines(batch_id) == {0, 1, 2}  # what was answered is kept
    taken = store.claim("next-replica", lease_seconds=60)  # no 60 s lease to wait out
    assert taken is not None and taken.id == batch_id and taken.status == "in_progress"


def test_a_batch_past_its_window_expires_with_its_requests_in_the_error_file(store: BatchStore) -> None:
    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        raise AssertionError("an expired batch sends nothing")

    batch_id = new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(3)], window=0)
    asyncio.run(run_claimed(BatchRunner(store, send, lambda pseudonym: "default", Counters(), FAST), store))
    batch, output, errors = output_of(store, batch_id)
    assert batch["status"] == "expired" and batch["output_file_id"] is None and output == []
    assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [(f"r{i}", "batch_expired") for i in range(3)]


def test_a_replica_taking_a_batch_over_sends_only_what_was_not_answered(store: BatchStore) -> None:
    from kvmesh.router.batches import LineResult

    sent, send = recording_sender()

    batch_id = new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(5)])
    first = store.claim("replica-a", 60)
    assert first is not None and store.start(batch_id, "replica-a", 5, "m")
    store.add_results(batch_id, "replica-a", [LineResult(i, f"r{i}", 200, {"id": f"a{i}"}, f"a{i}") for i in (0, 3)])
    store.renew(batch_id, "replica-a", -1)  # replica-a died: its lease runs out
    asyncio.run(run_claimed(BatchRunner(store, send, lambda pseudonym: "default", Counters(), FAST,
                                        owner="replica-b"), store))
    batch, output, errors = output_of(store, batch_id)
    assert sorted(sent) == ["q1", "q2", "q4"]
    assert batch["status"] == "completed" and errors == []
    assert [x["custom_id"] for x in output] == [f"r{i}" for i in range(5)]  # once each, in file order


def test_a_replica_whose_lease_ran_out_while_it_prepared_the_batch_sends_nothing(store: BatchStore) -> None:
    """Reading and checking a large input file may outlast the lease, and another replica take the batch meanwhile:
    the first one, its preparation done, sends none of the requests the new holder sends too."""
    sent, send = recording_sender()

    batch_id = new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(5)])
    first = store.claim("replica-a", 60)
    assert first is not None and store.start(batch_id, "replica-a", 5, "m")
    store.renew(batch_id, "replica-a", -1)  # replica-a's lease ran out while it prepared
    taken = store.claim("replica-b", 60)
    assert taken is not None and taken.id == batch_id
    runner = BatchRunner(store, send, lambda pseudonym: "default", Counters(), FAST, owner="replica-a")
    asyncio.run(runner.run(dataclasses.replace(first, status="in_progress")))
    assert sent == []
    assert store.renew(batch_id, "replica-b", 60) == "in_progress"  # replica-b holds it still


def test_a_batch_cancelled_while_its_file_was_checked_sends_nothing(store: BatchStore) -> None:
    """The client cancels while the replica reads and checks the input: the run sends no request (it used to send
    for a flush period, each answer charged and written) and the batch ends cancelled, every request unrun."""
    sent, send = recording_sender()

    batch_id = new_batch(store, [line(f"r{i}", chat("s", f"q{i}")) for i in range(5)])
    claimed = store.claim("replica-a", 60)
    assert claimed is not None and store.start(batch_id, "replica-a", 5, "m")
    store.cancel(TENANT, batch_id)
    runner = BatchRunner(store, send, lambda pseudonym: "default", Counters(), FAST, owner="replica-a")
    asyncio.run(runner.run(dataclasses.replace(claimed, status="in_progress")))
    batch, output, errors = output_of(store, batch_id)
    assert sent == [] and output == []
    assert batch["status"] == "cancelled" and batch["request_counts"] == {"total": 5, "completed": 0, "failed": 5}
    assert [x["error"]["code"] for x in errors] == ["batch_cancelled"] * 5


def test_a_batch_the_runner_keeps_failing_on_is_failed_not_retried_forever(store: BatchStore) -> None:
    calls: list[str] = []

    def broken_tenant_of(pseudonym: str) -> str:
        calls.append(pseudonym)
        raise RuntimeError("a bug in the runner")

    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        raise AssertionError("nothing is sent")

    batch_id = new_batch(store, [line("a", chat("s", "q"))])
    counters = Counters()

    async def scenario() -> None:
        runner = asyncio.create_task(BatchRunner(store, send, broken_tenant_of, counters, FAST).serve_forever())
        while not counters.ended:
            await asyncio.sleep(0.02)
        runner.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    batch = store.batch(TENANT, batch_id)
    assert batch is not None and batch["status"] == "failed" and len(calls) == 3
    assert batch["errors"]["data"][0]["code"] == "runner_error" and "a bug in the runner" in str(batch["errors"])
    assert store.claim("another", 60) is None  # nothing left to take up


def test_a_batch_whose_file_fails_its_check_or_whose_tenant_lost_its_key_fails(store: BatchStore) -> None:
    async def send(tenant: str, path: str, body: dict[str, Any]) -> Answer:
        raise AssertionError("nothing is sent")

    bad = new_batch(store, [line("a", chat("s", "q"), url=COMPLETIONS_PATH)])
    asyncio.run(run_claimed(BatchRunner(store, send, lambda pseudonym: "default", Counters(), FAST), store))
    batch = store.batch(TENANT, bad)
    assert batch is not None and batch["status"] == "failed"
    assert [(e["code"], e["line"]) for e in batch["errors"]["data"]] == [("mismatched_endpoint", 1)]
    revoked = new_batch(store, [line("a", chat("s", "q"))])
    asyncio.run(run_claimed(BatchRunner(store, send, lambda pseudonym: None, Counters(), FAST), store))
    batch = store.batch(TENANT, revoked)
    assert batch is not None and batch["status"] == "failed"
    assert batch["errors"]["data"][0]["code"] == "tenant_revoked"


# ---- through a real router and engine ---------------------------------------------------------------------------

KEYS = {"acme": "sk-acme-1", "globex": "sk-globex-1"}


@pytest.fixture(scope="module")
def engine_url(tiny_dir: Path) -> Iterator[str]:
    with serve_checked(make_engine(tiny_dir, kv_cache_blocks=256, max_model_len=512)) as url:
        yield url


@pytest.fixture(scope="module")
def pool(engine_url: str, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A keyed router with a database in front of the engine: (its URL, the database URL)."""
    folder = tmp_path_factory.mktemp("batch")
    keys = folder / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"tenant": t, "key_sha256": hash_key(k)} for t, k in KEYS.items()]}))
    database = f"sqlite:///{folder / 'pool.db'}"
    router = build_router(RouterConfig(pods=[engine_url], scrape_interval_seconds=0.1, api_keys_file=str(keys),
                                       database_url=database, batch_max_file_bytes=20_000), tiny_dir)
    with serve_router(router) as url:
        yield url, database


def client(url: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEYS[tenant], max_retries=0)


def wait_ended(api: openai.OpenAI, batch_id: str) -> Any:
    deadline = time.monotonic() + 120
    batch = api.batches.retrieve(batch_id)
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.1)
        batch = api.batches.retrieve(batch_id)
    return batch


@pytest.mark.slow
def test_the_openai_client_runs_a_batch_end_to_end(pool: tuple[str, str]) -> None:
    url, database = pool
    api = client(url, "acme")
    system = "You answer questions about the weather in one word. " * 8  # over GROUP_MIN_CHARS: one prefix run
    model = api.models.list().data[0].id
    entries = [line(f"req-{i}", chat(system, f"question {i}", max_tokens=3, model=model)) for i in range(6)]
    # the engine refuses the last: it goes to the error file
    entries.append(line("too-long", chat(system, "x", max_tokens=10**6, model=model)))
    uploaded = api.files.create(file=("questions.jsonl", jsonl(entries)), purpose="batch",
                                expires_after={"anchor": "created_at", "seconds": 7200})
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(entries))
    assert uploaded.expires_at == uploaded.created_at + 7200
    batch = api.batches.create(input_file_id=uploaded.id, endpoint=CHAT_PATH, completion_window="24h",
                               metadata={"job": "nightly"},
                               output_expires_after={"anchor": "created_at", "seconds": 3600})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"} and batch.model is None
    batch = wait_ended(api, batch.id)
    assert batch.status == "completed", batch
    assert batch.model == model  # OpenAI's batch object names the model its requests ask for
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 6, 1)
    output = [json.loads(x) for x in api.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in output) == [f"req-{i}" for i in range(6)]
    for entry in output:
        body = entry["response"]["body"]
        assert entry["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == 3
    # the run's first went alone, the others after its answer: they found the system prompt cached
    assert batch.usage.input_tokens_details.cached_tokens >= 5 * 16
    assert batch.usage.output_tokens == 18
    errors = [json.loads(x) for x in api.files.content(batch.error_file_id).text.splitlines()]
    assert [(x["custom_id"], x["response"]["status_code"]) for x in errors] == [("too-long", 400)]
    output_file = api.files.retrieve(batch.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.expires_at == output_file.created_at + 3600
    assert batch.id in [b.id for b in api.batches.list(limit=5).data]
    # every request went through the router at the batch priority, and was counted
    log, deadline = RequestLog(database), time.monotonic() + 30
    while len(rows := [r for r in log.recent() if r.prompt_tokens > 16]) < 7:  # the log writes every second
        assert time.monotonic() < deadline, rows
        time.sleep(0.2)
    assert {r.priority for r in rows} == {BATCH_PRIORITY}
    metrics = httpx.get(url + "/metrics").text
    assert 'kvmesh_router_batch_requests_total{outcome="ok"} 6.0' in metrics
    assert 'kvmesh_router_batches_total{status="completed"} 1.0' in metrics


@pytest.mark.slow
def test_a_file_with_a_problem_fails_its_batch_with_the_line_named(pool: tuple[str, str]) -> None:
    url, _ = pool
    api = client(url, "acme")
    content = jsonl([line("a", chat("s", "q")), line("a", chat("s", "q"))])
    file_id = api.files.create(file=("dup.jsonl", content), purpose="batch").id
    batch = wait_ended(api, api.batches.create(input_file_id=file_id, endpoint=CHAT_PATH,
                                               completion_window="24h").id)
    assert batch.status == "failed"
    assert [(e.code, e.line) for e in batch.errors.data] == [("duplicate_custom_id", 2)]


@pytest.mark.slow
def test_tenants_cannot_reach_each_others_batches_and_bad_calls_say_why(pool: tuple[str, str]) -> None:
    url, _ = pool
    acme, globex = client(url, "acme"), client(url, "globex")
    # a request long enough that the batch is still running when its file's deletion is asked for: with one of
    # two tokens, a loaded machine let the batch end first, and the deletion was (rightly) allowed
    long = chat("s", "q", max_tokens=400, ignore_eos=True)
    file_id = acme.files.create(file=("a.jsonl", jsonl([line("a", long)])), purpose="batch").id
    batch_id = acme.batches.create(input_file_id=file_id, endpoint=CHAT_PATH, completion_window="24h").id
    with pytest.raises(openai.ConflictError, match="still running"):
        acme.files.delete(file_id)  # the batch made over it has not ended
    with pytest.raises(openai.NotFoundError):
        globex.batches.retrieve(batch_id)
    with pytest.raises(openai.NotFoundError):
        globex.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        globex.batches.create(input_file_id=file_id, endpoint=CHAT_PATH, completion_window="24h")
    assert file_id not in [f.id for f in globex.files.list().data]
    stranger = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.batches.list()
    with pytest.raises(openai.AuthenticationError):
        stranger.files.create(file=("a.jsonl", b"{}"), purpose="batch")
    chunked = httpx.post(url + "/v1/files", headers={"Authorization": f"Bearer {KEYS['acme']}",
                                                      "content-type": "multipart/form-data; boundary=x"},
                         content=iter([b"--x--\r\n"]))  # no Content-Length: the size bound could not hold
    assert chunked.status_code == 411
    acme.batches.cancel(batch_id)
    wait_ended(acme, batch_id)
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        acme.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        acme.batches.create(input_file_id=file_id, endpoint=CHAT_PATH, completion_window="2d")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="purpose"):
        acme.files.create(file=("a.jsonl", b"{}"), purpose="assistants")
    with pytest.raises(openai.APIStatusError, match="limit of 20000 bytes") as raised:
        acme.files.create(file=("big.jsonl", b"x" * 20_001), purpose="batch")
    assert raised.value.status_code == 413
    headers = {"Authorization": f"Bearer {KEYS['acme']}"}
    assert httpx.post(url + "/v1/batches", content=b"{nope", headers=headers).status_code == 400
    assert httpx.post(url + "/v1/files", json={"purpose": "batch"}, headers=headers).status_code == 400
    assert httpx.get(url + "/v1/files?limit=0", headers=headers).status_code == 400
    assert acme.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        acme.files.retrieve(file_id)


def test_without_a_database_the_batch_api_says_what_to_set(engine_url: str, tiny_dir: Path) -> None:
    router = build_router(RouterConfig(pods=[engine_url], scrape_interval_seconds=0.1), tiny_dir)
    with serve_router(router) as url:
        answer = httpx.get(url + "/v1/batches")
    assert answer.status_code == 501 and "database_url" in answer.json()["error"]["message"]


def test_a_batch_past_the_tenants_enqueued_limit_is_a_429_naming_the_limit(engine_url: str, tiny_dir: Path,
                                                                           tmp_path: Path) -> None:
    router = build_router(RouterConfig(pods=[engine_url], scrape_interval_seconds=0.1,
                                       database_url=f"sqlite:///{tmp_path / 'pool.db'}",
                                       batch_max_enqueued_requests=2), tiny_dir)
    with serve_router(router) as url:
        api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        entries = [line(str(i), chat("s", f"q{i}")) for i in range(3)]
        file_id = api.files.create(file=("in.jsonl", jsonl(entries)), purpose="batch").id
        with pytest.raises(openai.RateLimitError) as refused:
            api.batches.create(input_file_id=file_id, endpoint=CHAT_PATH, completion_window="24h")
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "batch_enqueued_limit_reached"
    assert "2" in error["message"] and "3" in error["message"]


def test_a_batch_spends_its_tenants_batch_buckets_not_its_interactive_limits(engine_url: str, tiny_dir: Path,
                                                                            tmp_path: Path) -> None:
    """A tenant allowed 10 requests a minute runs a batch of 4: its next interactive request still finds 7 of its
    10 (the upload and the batch's creation took one each; the batch's requests took 4 of the 5 its batch buckets
    hold, where they used to spend the interactive ones; polling the batch took none)."""
    router = build_router(RouterConfig(pods=[engine_url], scrape_interval_seconds=0.1,
                                       database_url=f"sqlite:///{tmp_path / 'pool.db'}", batch_rate_share=0.5,
                                       tenants={"default": {"requests_per_minute": 10}}), tiny_dir)
    with serve_router(router) as url:
        api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        file_id = api.files.create(file=("in.jsonl", jsonl([line(str(i), chat("s", f"q{i}")) for i in range(4)])),
                                   purpose="batch").id
        batch = wait_ended(api, api.batches.create(input_file_id=file_id, endpoint=CHAT_PATH,
                                                   completion_window="24h").id)
        assert batch.status == "completed" and batch.request_counts.completed == 4
        reply = httpx.post(url + CHAT_PATH, json=chat("s", "now"))
    assert reply.status_code == 200
    assert (reply.headers["x-ratelimit-limit-requests"], reply.headers["x-ratelimit-remaining-requests"]) == ("10", "7")
    assert router.limits.batch.headers("default")["x-ratelimit-limit-requests"] == "5"
