"""The Responses API translation (router/responses.py): requests become chat requests, completions become responses."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter
from sqlalchemy import create_engine, inspect
from sqlalchemy import text as sql

from kvmesh.router.app import build_router, create_router_app
from kvmesh.router.auth import tenant_hash
from kvmesh.router.config import RouterConfig
from kvmesh.router.limits import Limiter
from kvmesh.router.responses import (
    ResponsesError,
    chat_request,
    input_items,
    response_object,
    response_shell,
    turn_messages,
)
from kvmesh.router.responses_api import Responses, items_page, response_routes
from kvmesh.router.responses_store import (
    RESPONSES_TABLE,
    SWEEP_GRACE_SECONDS,
    DatabaseResponses,
    MemoryResponses,
    ResponseRow,
    ResponseStore,
    StoredResponse,
)
from kvmesh.router.responses_stream import ResponseEvents


def test_string_input_with_instructions_and_sampling() -> None:
    chat = chat_request({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 7,
                         "temperature": 0.5, "top_p": 0.9, "seed": 3, "ignore_eos": True, "service_tier": "auto"})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}],
                    "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "ignore_eos": True}


def test_fields_at_their_default_are_accepted() -> None:
    for truncation in ("disabled", None):
        chat = chat_request({"model": "m", "input": "x", "truncation": truncation, "background": False,
                             "include": []})
        assert chat["messages"] == [{"role": "user", "content": "x"}]


def test_a_replayed_answer_with_calls_is_one_assistant_message_as_stored() -> None:
    """A client sending a response's output back itself (store: false) gets the prompt a stored continuation
    would: the answer's text and its calls in one assistant message."""
    completion = {"choices": [{"message": {"role": "assistant", "content": "let me see", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}}]}
    body = {"model": "m", "input": "q"}
    stored = turn_messages(body, completion)
    output = response_object("resp_1", body, completion, 0)["output"]
    replayed = [{"role": "user", "content": "q"}, *({k: v for k, v in item.items() if k != "id"}
                                                    for item in output)]
    assert chat_request({"model": "m", "input": replayed})["messages"] == stored


def test_history_comes_before_new_input_so_the_prefix_is_shared() -> None:
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chat = chat_request({"model": "m", "input": [{"role": "developer", "content": [
        {"type": "input_text", "text": "c"}]}]}, history)
    assert chat["messages"] == [*history, {"role": "system", "content": "c"}]


def test_function_call_items_become_tool_messages() -> None:
    chat = chat_request({"model": "m", "tools": [{"type": "function", "name": "f", "parameters": {}}],
                         "tool_choice": {"type": "function", "name": "f"}, "input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"}]})
    assert chat["messages"][0]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert chat["messages"][1] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}


def test_text_parts_are_joined_as_the_chat_path_joins_them() -> None:
    """The same conversation is the same prompt, sent to /v1/responses or to /v1/chat/completions (whose text parts
    the engine joins with newlines)."""
    chat = chat_request({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]})
    assert chat["messages"] == [{"role": "user", "content": "a\nb"}]


def test_a_function_call_output_of_text_parts_is_their_text() -> None:
    """The openai client types a function_call_output's output as a string or a list of input parts: the model
    reads the parts' text (it read a Python repr of the list), and the listed item holds it."""
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": [
        {"type": "input_text", "text": "21"}, {"type": "input_text", "text": "more"}]}
    assert chat_request({"model": "m", "input": [call, output]})["messages"][1] == {
        "role": "tool", "tool_call_id": "c1", "content": "21\nmore"}
    listed = input_items({"input": [call, output]}, "resp_1")[1]
    assert listed["output"] == "21\nmore"
    TypeAdapter(ResponseItem).validate_python(listed)
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA=="}
    for refused, param in (([{"type": "input_text", "text": "x"}, image], "input[1].output[1]"),
                           (42, "input[1].output")):
        with pytest.raises(ResponsesError) as caught:
            chat_request({"model": "m", "input": [call, {**output, "output": refused}]})
        assert caught.value.param == param


def test_text_without_format_is_text_and_only_the_default_verbosity_is_served() -> None:
    """A `text` with no `format` asks for text (it was refused naming text.format, which the client never sent);
    a verbosity other than the default would change what the answer holds, so it is refused rather than ignored."""
    for text in ({"verbosity": "medium"}, {"format": None}, {}):
        assert "response_format" not in chat_request({"model": "m", "input": "x", "text": text})
    shell = response_shell("resp_1", {"model": "m", "input": "x", "text": {"verbosity": "medium"}}, 0)
    assert shell["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
    Response.model_validate(shell)
    for verbosity in ("low", "high"):
        with pytest.raises(ResponsesError) as caught:
            chat_request({"model": "m", "input": "x", "text": {"verbosity": verbosity}})
        assert caught.value.param == "text.verbosity" and "text.format" not in str(caught.value)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": "x", "truncation": "auto"}, "truncation"),
    ({"model": "m", "input": 5}, "input"),
    ({"model": "m", "input": None}, "input"),
    ({"model": "m", "input": "x", "tools": 5}, "tools"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
])
def test_unsupported_requests_name_their_param(body: dict, param: str) -> None:
    with pytest.raises(ResponsesError) as caught:
        chat_request(body)
    assert caught.value.param == param


def test_response_object_parses_with_the_openai_client_types() -> None:
    completion = {"model": "m", "choices": [{"message": {"role": "assistant", "content": "hello"}}],
                  "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 8}}}
    parsed = Response.model_validate(response_object("resp_1", {"model": "m", "input": "hi"}, completion, 0))
    assert parsed.output_text == "hello"
    assert parsed.usage is not None and parsed.usage.input_tokens_details.cached_tokens == 8


def test_a_continuation_drops_instructions_and_appends_the_answer() -> None:
    body = {"model": "m", "input": "q1", "instructions": "sys"}
    completion = {"choices": [{"message": {"role": "assistant", "content": "a1", "tool_calls": None}}]}
    history = turn_messages(body, completion)
    assert history == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    assert chat_request({"model": "m", "input": "q2"}, history)["messages"][:2] == history


def test_text_format_becomes_the_chat_response_format() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    chat = chat_request({"model": "m", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "place", "schema": schema, "strict": True}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "place", "schema": schema,
                                                                               "strict": True}}
    assert chat_request({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}})[
        "response_format"] == {"type": "json_object"}
    assert "response_format" not in chat_request({"model": "m", "input": "x", "text": {"format": {"type": "text"}}})
    for text, param in (({"format": {"type": "yaml"}}, "text.format"),
                        ({"format": {"type": "json_schema", "name": "x"}}, "text.format.schema")):
        with pytest.raises(ResponsesError) as caught:
            chat_request({"model": "m", "input": "x", "text": text})
        assert caught.value.param == param


def test_bad_metadata_and_flags_are_refused() -> None:
    for body, param in (({"metadata": {"k": 1}}, "metadata"), ({"store": "yes"}, "store"),
                        ({"stream": 1}, "stream")):
        with pytest.raises(ResponsesError) as caught:
            chat_request({"model": "m", "input": "x", **body})
        assert caught.value.param == param


def test_an_answer_cut_by_max_output_tokens_is_incomplete() -> None:
    completion = {"choices": [{"message": {"role": "assistant", "content": "abc"}, "finish_reason": "length"}]}
    parsed = Response.model_validate(response_object("resp_1", {"model": "m", "input": "hi"}, completion, 0))
    assert parsed.status == "incomplete" and parsed.incomplete_details is not None
    assert parsed.incomplete_details.reason == "max_output_tokens"


def chat_chunks() -> list[dict]:
    """A chat stream as the engine sends it: the role, text in pieces, a whole tool call, the finish, the usage."""
    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {"id": "c", "object": "chat.completion.chunk", "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    return [chunk({"role": "assistant"}), chunk({"content": "Hel"}), chunk({"content": "lo"}),
            chunk({"tool_calls": [call]}), chunk({}, "tool_calls"),
            {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [],
             "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
                       "prompt_tokens_details": {"cached_tokens": 0}}}]


def test_a_chat_stream_becomes_response_events_the_openai_client_reads() -> None:
    events = ResponseEvents("resp_1", {"model": "m", "input": "hi"}, int(time.time()))
    raw = [*events.start()]
    for chunk in chat_chunks():
        raw += events.on_chunk(chunk)
    raw += events.finish()
    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(event) for event in raw]
    assert [event.sequence_number for event in parsed] == list(range(len(parsed)))
    kinds = [event.type for event in parsed]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(event.delta for event in parsed if event.type == "response.output_text.delta") == "Hello"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    final = parsed[-1].response
    assert final.output_text == "Hello" and final.usage is not None and final.usage.output_tokens == 4
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert json.loads(final.output[1].arguments) == {"a": 1}
    assert events.completion()["choices"][0]["message"]["tool_calls"][0]["id"] == "call_1"


def test_a_stream_no_pod_could_finish_ends_failed() -> None:
    events = ResponseEvents("resp_1", {"model": "m", "input": "hi"}, 0)
    (failed,) = events.fail({"message": "the pod failed"})
    event = TypeAdapter(ResponseStreamEvent).validate_python(failed)
    assert event.type == "response.failed" and event.response.error is not None
    assert event.response.error.message == "the pod failed"


def test_input_items_have_ids_and_page_like_openai_lists() -> None:
    items = input_items({"input": [{"role": "user", "content": "a"},
                                   {"role": "assistant", "content": "calling"},
                                   {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                   {"type": "function_call_output", "call_id": "c", "output": "4"},
                                   {"role": "user", "content": [{"type": "input_text", "text": "b"}]}]}, "resp_9")
    assert len({item["id"] for item in items}) == 5
    for item in items:  # as the openai client reads a listed item
        TypeAdapter(ResponseItem).validate_python(item)
    items = [items[0], items[3], items[4]]
    assert items[0]["content"] == [{"type": "input_text", "text": "a"}]
    newest = items_page(items, 2, None, newest_first=True)
    assert [item["id"] for item in newest["data"]] == [items[2]["id"], items[1]["id"]] and newest["has_more"]
    rest = items_page(items, 2, newest["last_id"], newest_first=True)
    assert [item["id"] for item in rest["data"]] == [items[0]["id"]] and not rest["has_more"]
    with pytest.raises(ResponsesError):
        items_page(items, 2, "item_unknown", newest_first=False)
    assert input_items({"input": "hi"}, "resp_9")[0]["content"] == [{"type": "input_text", "text": "hi"}]


def stored(response_id: str, previous: str | None = None) -> StoredResponse:
    return StoredResponse({"id": response_id, "object": "response", "previous_response_id": previous}, [{"id": "i"}])


def saved(store: ResponseStore, tenant: str, response_id: str, previous: str | None = None) -> None:
    store.save(tenant, stored(response_id, previous), [], [{"role": "user", "content": response_id}])


def stores(database_url: str, ttl: int = 60) -> list[ResponseStore]:
    return [MemoryResponses(100, ttl), DatabaseResponses(database_url, ttl)]


def rows(database_url: str) -> int:
    store = DatabaseResponses(database_url, 60)
    with store.engine.connect() as conn:
        count = conn.execute(sql(f"SELECT count(*) FROM {RESPONSES_TABLE}")).scalar_one()
    store.close()
    return count


def call(call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": f'{{"q": "{call_id}"}}'}}


# a conversation with tools: (the request, the answer's message); instructions come and go, as clients send them
TURNS: list[tuple[dict, dict]] = [
    ({"model": "m", "instructions": "sys", "input": "q0"}, {"role": "assistant", "content": None,
                                                          "tool_calls": [call("c0")]}),
    ({"model": "m", "input": [{"type": "function_call_output", "call_id": "c0", "output": "r0"}]},
     {"role": "assistant", "content": "let me see", "tool_calls": [call("c1"), call("c2")]}),
    ({"model": "m", "instructions": "other", "input": [
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "function_call_output", "call_id": "c2", "output": "r2"},
        {"role": "developer", "content": [{"type": "input_text", "text": "now answer"}]}]},
     {"role": "assistant", "content": "the answer", "tool_calls": None}),
    ({"model": "m", "instructions": "sys", "input": "thanks"}, {"role": "assistant", "content": "welcome"}),
]


def converse(store: ResponseStore, tenant: str, turns: list[tuple[dict, dict]],
             previous: str | None = None) -> list[tuple[str, list]]:
    """Each turn as the router takes it (its history read from the store, its chat request, its answer saved), with
    the history an older router stored whole for it: the turn's prompt less its instructions, plus its answer."""
    made = []
    for n, (request, message) in enumerate(turns):
        body = {**request, "previous_response_id": previous}
        history = [] if previous is None else store.history(tenant, previous)
        assert history is not None
        chat, completion, response_id = chat_request(body, history), {"choices": [{"message": message}]}, f"resp_{n}"
        response = response_object(response_id, body, completion, 0)
        store.save(tenant, StoredResponse(response, input_items(body, response_id)), history,
                   turn_messages(body, completion))
        whole = [*chat["messages"][1 if body.get("instructions") else 0:],
                 {key: value for key, value in message.items() if value is not None}]
        made.append((response_id, whole))
        previous = response_id
    return made


def test_a_chain_reads_back_the_history_stored_whole_before(database_url: str) -> None:
    """On both stores: a conversation with tool calls and changing instructions rebuilds, turn by turn, exactly
    the history an older router stored whole (so prompts, and their cached prefixes, do not change), while the
    database holds each message once."""
    for store in stores(database_url):
        made = converse(store, "t1", TURNS)
        for response_id, whole in made:
            assert store.history("t1", response_id) == whole
            assert store.get("t1", response_id) is not None
        assert made[2][1][:4] == [{"role": "user", "content": "q0"}, *made[1][1][1:4]]  # no instructions carried
        store.close()
    with DatabaseResponses(database_url, 60).engine.connect() as conn:
        kept = conn.execute(sql(f"SELECT messages FROM {RESPONSES_TABLE}")).scalars().all()
    assert sum(len(json.loads(part)) for part in kept) == len(made[-1][1])


def test_deleting_a_response_others_continue_keeps_their_history(database_url: str) -> None:
    for store in stores(database_url):
        made = converse(store, "t1", TURNS)
        assert store.delete("t1", "resp_1")
        assert store.get("t1", "resp_1") is None and store.history("t1", "resp_1") is None
        assert not store.delete("t1", "resp_1")
        for response_id, whole in (made[0], *made[2:]):
            assert store.history("t1", response_id) == whole
        # a second branch from resp_2, then the first branch's tip: resp_2 and resp_1 stay for the branch
        store.save("t1", stored("resp_branch", "resp_2"), made[2][1], [{"role": "user", "content": "b"}])
        assert store.delete("t1", "resp_3") and store.delete("t1", "resp_2")
        assert store.history("t1", "resp_branch") == [*made[2][1], {"role": "user", "content": "b"}]
        assert store.delete("t1", "resp_branch")
        assert store.history("t1", "resp_0") == made[0][1]
        store.close()
    assert rows(database_url) == 1  # resp_0 alone: the hidden ones went with the last response continuing them


def test_a_previous_response_removed_while_its_turn_ran_leaves_the_history_whole(database_url: str) -> None:
    for store in stores(database_url):
        saved(store, "t1", "resp_a")
        earlier = store.history("t1", "resp_a")
        assert earlier is not None and store.delete("t1", "resp_a")  # no one continued it yet: removed
        store.save("t1", stored("resp_b", "resp_a"), earlier, [{"role": "user", "content": "b"}])
        assert store.history("t1", "resp_b") == [*earlier, {"role": "user", "content": "b"}]
        store.close()


def test_a_conversation_expires_after_its_last_turn_and_is_swept(database_url: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    start = time.time()
    for store in stores(database_url):
        saved(store, "t1", "resp_a")
        monkeypatch.setattr(time, "time", lambda: start + 50)
        saved(store, "t1", "resp_b", "resp_a")
        monkeypatch.setattr(time, "time", lambda: start + 100)  # past resp_a's own 60 s, not its conversation's
        assert store.get("t1", "resp_a") is not None
        assert store.history("t1", "resp_b") == [{"role": "user", "content": "resp_a"},
                                                 {"role": "user", "content": "resp_b"}]
        monkeypatch.setattr(time, "time", lambda: start + 111)
        assert store.get("t1", "resp_a") is None and store.history("t1", "resp_b") is None
        assert not store.delete("t1", "resp_b")
        monkeypatch.setattr(time, "time", lambda: start + 111 + SWEEP_GRACE_SECONDS)
        saved(store, "t1", "resp_c")  # sweeps the expired conversation
        monkeypatch.undo()
        store.close()
    assert rows(database_url) == 1


def test_a_chain_never_crosses_tenants(database_url: str) -> None:
    for store in stores(database_url):
        saved(store, "t1", "resp_a")
        assert store.get("t2", "resp_a") is None and store.history("t2", "resp_a") is None
        assert not store.delete("t2", "resp_a")
        store.save("t2", stored("resp_b", "resp_a"), [], [{"role": "user", "content": "b"}])  # not linked
        assert store.history("t2", "resp_b") == [{"role": "user", "content": "b"}]
        assert store.delete("t1", "resp_a") and store.history("t2", "resp_b") is not None
        store.close()


def test_an_older_routers_rows_are_read_and_continued(database_url: str) -> None:
    """A row as an older router wrote it (the whole history, no newer columns): read, continued, deleted while its
    continuation lives, once the table is upgraded in place."""
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    engine = create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(sql(f"CREATE TABLE {RESPONSES_TABLE} (id VARCHAR(64) PRIMARY KEY, tenant VARCHAR(64) NOT "
                         "NULL, expires_at BIGINT NOT NULL, response TEXT NOT NULL, input_items TEXT NOT NULL, "
                         "history TEXT NOT NULL)"))
        old = stored("resp_old")
        conn.execute(sql(f"INSERT INTO {RESPONSES_TABLE} VALUES ('resp_old', 't1', :expires, :response, :items, "
                         ":history)"), {"expires": int(time.time()) + 60, "history": json.dumps(history),
                                        "response": json.dumps(old.response), "items": json.dumps(old.input_items)})
    engine.dispose()
    store = DatabaseResponses(database_url, 60)
    indexed = {i["name"] for i in inspect(store.engine).get_indexes(RESPONSES_TABLE)}
    assert {i.name for i in ResponseRow.__table__.indexes} <= indexed  # the chain's lookups scan no whole table
    assert store.get("t1", "resp_old") == stored("resp_old") and store.history("t1", "resp_old") == history
    store.save("t1", stored("resp_new", "resp_old"), history, [{"role": "user", "content": "more"}])
    assert store.delete("t1", "resp_old") and store.get("t1", "resp_old") is None
    assert store.history("t1", "resp_new") == [*history, {"role": "user", "content": "more"}]
    store.close()


def test_a_loop_of_hand_edited_links_ends_the_history_read(database_url: str) -> None:
    """Links only ever point at older responses, but rows edited by hand could make a loop: the read stops after
    MAX_CHAIN_LINKS links (a fraction of a second) and finds the chain cut (not found) instead of running forever."""
    store = DatabaseResponses(database_url, 60)
    saved(store, "t1", "resp_a")
    saved(store, "t1", "resp_b", "resp_a")
    assert store.history("t1", "resp_b") == [{"role": "user", "content": "resp_a"}, {"role": "user",
                                                                                   "content": "resp_b"}]
    with store.engine.begin() as conn:  # resp_a now continues resp_b, which continues resp_a
        conn.execute(sql(f"UPDATE {RESPONSES_TABLE} SET previous_id = 'resp_b' WHERE id = 'resp_a'"))
    assert store.history("t1", "resp_b") is None
    store.close()


def test_memory_store_keeps_the_newest_and_scopes_by_tenant() -> None:
    store = MemoryResponses(capacity=2, ttl=60)
    for n in range(3):
        saved(store, "t1", f"resp_{n}", f"resp_{n - 1}" if n else None)
    assert store.get("t1", "resp_0") is None and store.history("t1", "resp_0") is None  # the oldest went first
    assert store.history("t1", "resp_2") == [{"role": "user", "content": f"resp_{n}"} for n in range(3)]
    assert store.get("t1", "resp_2") == stored("resp_2", "resp_1")
    assert store.get("t2", "resp_2") is None and not store.delete("t2", "resp_2")
    assert store.delete("t1", "resp_2") and store.get("t1", "resp_2") is None
    saved(store, "t1", "resp_3")
    saved(store, "t1", "resp_4")  # evicts resp_1, which resp_0's messages had moved into when resp_2 came
    assert store.get("t1", "resp_1") is None and set(store._held) == {"resp_3", "resp_4"}


def test_memory_store_bounds_what_it_holds_hidden_responses_included() -> None:
    """The bound counts every response held, a hidden one that others continue from included (a chain of 1,000
    continuations had held 1,000 at a capacity of 10); a conversation longer than the store goes on, its evicted
    turns' messages moved into the turn after them."""
    store = MemoryResponses(capacity=10, ttl=60)
    for n in range(1000):
        saved(store, "t1", f"resp_{n}", f"resp_{n - 1}" if n else None)
        assert len(store._held) == min(n + 1, 10)
    assert store.history("t1", "resp_999") == [{"role": "user", "content": f"resp_{n}"} for n in range(1000)]
    assert store.get("t1", "resp_990") is not None and store.get("t1", "resp_989") is None
    saved(store, "t1", "resp_1000", "resp_999")
    assert len(store.history("t1", "resp_1000") or []) == 1001

    store = MemoryResponses(capacity=3, ttl=60)  # a deleted response kept for the one continuing it counts
    saved(store, "t1", "a0")
    saved(store, "t1", "a1", "a0")
    assert store.delete("t1", "a0") and set(store._held) == {"a0", "a1"}
    saved(store, "t1", "b0")
    saved(store, "t1", "c0")  # the fourth held: the hidden a0 goes, its messages into a1
    assert set(store._held) == {"a1", "b0", "c0"}
    assert store.history("t1", "a1") == [{"role": "user", "content": "a0"}, {"role": "user", "content": "a1"}]


def test_memory_store_evicts_the_least_recently_continued_conversation_first() -> None:
    """The oldest response of a conversation still going outlives a newer one of a conversation that stopped."""
    store = MemoryResponses(capacity=4, ttl=60)
    for response_id, previous in (("a0", None), ("b0", None), ("a1", "a0"), ("c0", None), ("a2", "a1")):
        saved(store, "t1", response_id, previous)
    assert store.get("t1", "b0") is None
    assert store.history("t1", "a2") == [{"role": "user", "content": f"a{n}"} for n in range(3)]
    assert all(store.get("t1", kept) is not None for kept in ("a0", "a1", "a2", "c0"))


def test_database_store_scopes_by_tenant_and_forgets_expired(database_url: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """On a SQLite file and on PostgreSQL (conftest's database_url)."""
    store = DatabaseResponses(database_url, ttl=60)
    saved(store, "t1", "resp_a")
    again = DatabaseResponses(database_url, ttl=60)  # another replica reads it
    assert again.get("t1", "resp_a") == stored("resp_a")
    assert again.get("t2", "resp_a") is None and not again.delete("t2", "resp_a")
    later = time.time() + 60 + SWEEP_GRACE_SECONDS + 1
    monkeypatch.setattr(time, "time", lambda: later)
    assert again.get("t1", "resp_a") is None  # past its ttl
    saved(again, "t1", "resp_b")  # sweeps the expired row: it is gone at the real time too
    monkeypatch.undo()
    assert store.get("t1", "resp_a") is None and store.get("t1", "resp_b") is not None
    assert store.delete("t1", "resp_b") and store.get("t1", "resp_b") is None
    store.close()
    again.close()


def unlimited_routes(store: ResponseStore, send: Any) -> APIRouter:
    """The endpoints for tenant acme under no limits (a Limiter without a table: every call a lease)."""
    limiter = Limiter()
    return response_routes(Responses(store), lambda _: "acme", send, limiter.open, limiter.take)  # type: ignore[arg-type]


def test_bodies_nested_too_deep_and_odd_digits_in_limit_are_400s_not_500s() -> None:
    """The same two inputs the Batch API refuses (deep JSON past json's recursion limit, a limit of digits int()
    takes or refuses: '²', '٣'), on the Responses API's own edge, which parsed them itself and answered 500."""
    store = MemoryResponses(10, 60)
    saved(store, tenant_hash("acme"), "resp_1")  # stored under the tenant's pseudonym, as the edge does
    app = FastAPI()

    async def never_sent(*_: object) -> None:
        raise AssertionError("a refused request sent a chat request")

    app.include_router(unlimited_routes(store, never_sent))
    with TestClient(app, raise_server_exceptions=False) as http:
        for payload in (b"[" * 5000 + b"]" * 5000, b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}", b"[]", b"7"):
            reply = http.post("/v1/responses", content=payload, headers={"content-type": "application/json"})
            assert reply.status_code == 400, (payload[:20], reply.text)
            assert reply.json()["error"]["message"]
        for limit in ("²", "٣", "9" * 30, "0", "-1"):
            page = http.get(f"/v1/responses/resp_1/input_items?limit={limit}")
            assert page.status_code == 400 and page.json()["error"]["param"] == "limit", (limit, page.text)
        assert http.get("/v1/responses/resp_1/input_items?limit=5").status_code == 200


def test_without_a_database_a_404_says_where_the_response_may_be() -> None:
    """A router without the pool's database keeps responses in its own memory: behind several replicas a
    continuation may reach one that never saw the turn, and the 404 says so and what to set."""
    app = FastAPI()

    async def never_sent(*_: object) -> None:  # no chat request is made by these calls
        raise AssertionError("a read sent a chat request")

    app.include_router(unlimited_routes(MemoryResponses(10, 60), never_sent))
    with TestClient(app) as http:
        missing = http.get("/v1/responses/resp_elsewhere")
        continued = http.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_elsewhere"})
    for reply in (missing, continued):
        assert reply.status_code == 404 and "spec.store" in reply.json()["error"]["message"]
    assert continued.json()["error"]["code"] == "previous_response_not_found"


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens: Input should be greater than or equal to 1"),
    ({"input": []}, "input", "input: List should have at least 1 item"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "thing"}}}}, "text.format",
     "text.format"),
])
def test_a_refusal_of_the_chat_path_names_the_response_field_the_client_sent(tiny_dir: Path, body: dict,
                                                                             param: str, fragment: str) -> None:
    """The translation sends max_output_tokens as max_tokens, input as messages, text.format as response_format:
    the router's checks of the chat request named fields this client never sent."""
    router = build_router(RouterConfig(pods=[]), tiny_dir)
    with TestClient(create_router_app(router)) as http:
        for stream in (False, True):
            reply = http.post("/v1/responses", json={"model": "m", "input": "x", "stream": stream, **body})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == param and fragment in error["message"], error
            assert "max_tokens" not in error["message"] and "messages" not in error["message"]
            assert "response_format" not in error["message"]
