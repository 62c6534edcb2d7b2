"""OpenAI's Responses API through a real router in front of two real engine processes (the tiny model), called
with the official openai client: answers, streams, stored continuations on the pod holding their prefix, tool
calls, structured output, tenants kept apart, and clear errors."""

from __future__ import annotations

import io
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from kvmesh.router.app import Router, build_router
from kvmesh.router.auth import hash_key
from kvmesh.router.batches import RESPONSES_PATH
from kvmesh.router.config import RouterConfig
from kvmesh.router.responses_store import RESPONSES_TABLE, DatabaseResponses

from .engines import serve_router, tiny_engines
from .test_router_disconnect import wait_nothing_in_flight

pytestmark = pytest.mark.slow

ACME_KEY, GLOBEX_KEY = "sk-acme-responses-1", "sk-globex-responses-2"
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's folder: engine logs, the keys file and the pool's database, pool.db."""
    return tmp_path_factory.mktemp("responses")


@pytest.fixture(scope="module")
def served(tiny_dir: Path, work: Path) -> Iterator[tuple[str, Router]]:
    keys = work / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"tenant": "acme", "key_sha256": hash_key(ACME_KEY)},
                                             {"tenant": "globex", "key_sha256": hash_key(GLOBEX_KEY)}]}))
    with tiny_engines(tiny_dir, work) as procs:
        router = build_router(RouterConfig(pods=list(procs), scrape_interval_seconds=0.1, api_keys_file=str(keys),
                                           database_url=f"sqlite:///{work / 'pool.db'}"), tiny_dir)
        with serve_router(router) as url:
            yield url, router


@pytest.fixture(scope="module")
def router_url(served: tuple[str, Router]) -> str:
    return served[0]


def client(url: str, key: str = ACME_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def model(router_url: str) -> str:
    return client(router_url).models.list().data[0].id


def test_a_continuation_reads_the_stored_turn_and_hits_its_cached_prefix(router_url: str, model: str) -> None:
    acme = client(router_url)
    first = acme.responses.with_raw_response.create(
        model=model, input="Tell me about the sea and the ships that sail on it.", instructions="Answer briefly.",
        max_output_tokens=8, temperature=0, metadata={"case": "continuation"})
    turn = first.parse()
    assert turn.status in ("completed", "incomplete") and turn.output_text
    assert turn.metadata == {"case": "continuation"} and turn.usage is not None and turn.usage.output_tokens > 0
    assert acme.responses.retrieve(turn.id).output_text == turn.output_text
    (item,) = acme.responses.input_items.list(turn.id).data
    assert item.type == "message" and item.content[0].text.startswith("Tell me about the sea")

    second = acme.responses.with_raw_response.create(
        model=model, input="And the harbours?", instructions="Answer briefly.", previous_response_id=turn.id,
        max_output_tokens=4, temperature=0)
    follow = second.parse()
    assert follow.previous_response_id == turn.id
    # the earlier turn is the prompt's prefix: the router sends it to the pod that served it, which has it cached
    assert second.headers["x-kvmesh-pod"] == first.headers["x-kvmesh-pod"]
    assert follow.usage is not None and follow.usage.input_tokens_details.cached_tokens >= 16
    assert follow.usage.input_tokens > turn.usage.input_tokens

    deleted = acme.responses.delete(turn.id)  # the client returns None for a 200 here
    assert deleted is None
    with pytest.raises(openai.NotFoundError):
        acme.responses.retrieve(turn.id)
    with pytest.raises(openai.NotFoundError) as caught:
        acme.responses.create(model=model, input="x", previous_response_id=turn.id, max_output_tokens=1)
    assert caught.value.body["param"] == "previous_response_id"


def test_a_stream_carries_the_same_answer_as_events(router_url: str, model: str) -> None:
    acme = client(router_url)
    whole = acme.responses.create(model=model, input="Count the waves.", max_output_tokens=8, temperature=0,
                                  store=False)
    events = list(acme.responses.create(model=model, input="Count the waves.", max_output_tokens=8, temperature=0,
                                        stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text and events[-1].response.output_text == text
    streamed = events[-1].response
    assert acme.responses.retrieve(streamed.id).output_text == text  # a stream's answer is stored too
    with pytest.raises(openai.NotFoundError):  # store: false was not
        acme.responses.retrieve(whole.id)


def test_a_forced_tool_call_and_its_output_continue_the_turn(router_url: str, model: str) -> None:
    acme = client(router_url)
    turn = acme.responses.create(model=model, input="Weather in Paris? " * 4, tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    (call,) = [item for item in turn.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    streamed = list(acme.responses.create(model=model, input="Weather in Paris? " * 4, tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=40, stream=True))
    done = [event for event in streamed if event.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and set(json.loads(done[0].arguments)) == {"city"}
    answer = acme.responses.create(model=model, previous_response_id=turn.id, tools=[WEATHER], max_output_tokens=4,
                                   input=[{"type": "function_call_output", "call_id": call.call_id,
                                           "output": "sunny"}])
    assert answer.status in ("completed", "incomplete")


def test_text_format_json_schema_gives_json_that_follows_it(router_url: str, model: str) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    answer = client(router_url).responses.create(
        model=model, input="A number, please.", max_output_tokens=30,
        text={"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}})
    assert set(json.loads(answer.output_text)) == {"n"}


def test_another_tenant_cannot_read_or_continue_a_response(router_url: str, model: str) -> None:
    mine = client(router_url).responses.create(model=model, input="private", max_output_tokens=2)
    globex = client(router_url, GLOBEX_KEY)
    with pytest.raises(openai.NotFoundError):
        globex.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        globex.responses.create(model=model, input="x", previous_response_id=mine.id, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        globex.responses.delete(mine.id)
    with pytest.raises(openai.AuthenticationError):
        client(router_url, "sk-wrong").responses.create(model=model, input="x")
    assert client(router_url).responses.retrieve(mine.id).id == mine.id


def test_bad_requests_get_a_400_that_names_the_field(router_url: str, model: str) -> None:
    acme = client(router_url)
    with pytest.raises(openai.BadRequestError) as caught:
        acme.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
    assert caught.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as caught:
        acme.responses.create(model=model, input="x", reasoning={"effort": "low"})
    assert caught.value.body["param"] == "reasoning"
    with pytest.raises(openai.BadRequestError):  # the chat path's own check, passed through
        acme.responses.create(model=model, input="x", temperature=9)
    with pytest.raises(openai.NotFoundError):
        acme.responses.create(model="no-such-model", input="x")
    raw = httpx.post(router_url + "/v1/responses", content=b"{not json", timeout=30,
                     headers={"authorization": f"Bearer {ACME_KEY}", "content-type": "application/json"})
    assert raw.status_code == 400 and "malformed JSON" in raw.json()["error"]["message"]
    huge = httpx.post(router_url + "/v1/responses", content=b"x" * (33 << 20), timeout=60,
                      headers={"authorization": f"Bearer {ACME_KEY}", "content-type": "application/json"})
    assert huge.status_code == 413 and "exceeds 32 MiB" in huge.json()["error"]["message"]
    page = httpx.get(router_url + "/v1/responses/resp_x/input_items", timeout=30,
                     headers={"authorization": f"Bearer {ACME_KEY}"})
    assert page.status_code == 404


def test_a_batch_of_response_requests_runs_with_their_instructions_cached(router_url: str, model: str) -> None:
    """`/v1/responses` as a batch's endpoint: each line answered as a response object (usage counted into the
    batch's), one refused line in the error file, and a line continuing a stored response reading it."""
    acme = client(router_url)
    earlier = acme.responses.create(model=model, input="Remember the word: harbour.", max_output_tokens=2)
    instructions = "You answer questions about the sea in one word. " * 8
    bodies = {f"q{i}": {"model": model, "instructions": instructions, "input": f"question {i}",
                        "max_output_tokens": 3, "ignore_eos": True} for i in range(4)}
    bodies["continued"] = {"model": model, "input": "Which word?", "previous_response_id": earlier.id,
                           "max_output_tokens": 3, "ignore_eos": True}
    bodies["refused"] = {"model": model, "input": "x", "reasoning": {"effort": "high"}}
    lines = [json.dumps({"custom_id": key, "method": "POST", "url": RESPONSES_PATH, "body": body})
             for key, body in bodies.items()]
    uploaded = acme.files.create(file=("responses.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = acme.batches.create(input_file_id=uploaded.id, endpoint=RESPONSES_PATH, completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.1)
        batch = acme.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 1)
    output = {x["custom_id"]: x["response"] for x in map(json.loads, acme.files.content(
        batch.output_file_id).text.splitlines())}
    assert set(output) == {*(f"q{i}" for i in range(4)), "continued"}
    for answer in output.values():
        assert answer["status_code"] == 200 and answer["body"]["object"] == "response"
        assert answer["body"]["usage"]["output_tokens"] == 3
    assert output["continued"]["body"]["previous_response_id"] == earlier.id
    assert output["continued"]["body"]["usage"]["input_tokens"] > earlier.usage.input_tokens
    assert batch.usage.output_tokens == 15
    # prefix order sent the first question alone and the rest after it: the instructions were found cached
    assert batch.usage.input_tokens_details.cached_tokens >= 3 * 16
    (error,) = map(json.loads, acme.files.content(batch.error_file_id).text.splitlines())
    assert error["custom_id"] == "refused" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "reasoning"


def test_a_store_that_fails_costs_the_stored_copy_never_the_answer(router_url: str, model: str, work: Path) -> None:
    """The pool's database loses the responses table (a real SQLite fault): answers still come, reads of stored
    responses get a 503 that says why, and nothing is left broken once the table is back."""
    acme = client(router_url)
    kept = acme.responses.create(model=model, input="kept", max_output_tokens=2)
    with sqlite3.connect(work / "pool.db") as db:
        db.execute(f"DROP TABLE {RESPONSES_TABLE}")
    try:
        answered = acme.responses.create(model=model, input="still answered", max_output_tokens=2)
        assert answered.status in ("completed", "incomplete") and answered.usage is not None
        for call in (lambda: acme.responses.retrieve(kept.id), lambda: acme.responses.delete(kept.id),
                     lambda: acme.responses.create(model=model, input="x", previous_response_id=kept.id)):
            with pytest.raises(openai.InternalServerError) as caught:
                call()
            assert caught.value.status_code == 503 and caught.value.body["code"] == "store_unavailable"
        metrics = httpx.get(router_url + "/metrics", timeout=30).text  # what KvmeshResponseStoreFailing reads
        for operation, failed in (("read", 2), ("write", 2)):  # a GET and a continuation; the save and the DELETE
            assert f'kvmesh_router_response_store_errors_total{{operation="{operation}"}} {failed}.0' in metrics
    finally:
        DatabaseResponses(f"sqlite:///{work / 'pool.db'}", ttl=60).close()  # the table made again, empty
    with pytest.raises(openai.NotFoundError):  # its copy was lost with the table; the answer was not
        acme.responses.retrieve(answered.id)


def test_a_slow_store_holds_neither_the_pod_nor_the_tenants_slot(served: tuple[str, Router], model: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's stored copy is written after its relay ended: while the write waits, no pod and no tenant slot
    count the request, and the client's closing events wait for the copy (a continuation sent on
    response.completed finds it)."""
    url, router = served
    store, writing, release = router.responses, threading.Event(), threading.Event()
    save = store.save

    def slow_save(*args: object) -> None:
        writing.set()
        release.wait(30)
        save(*args)

    monkeypatch.setattr(store, "save", slow_save)
    events: list = []
    stream = threading.Thread(target=lambda: events.extend(client(url).responses.create(
        model=model, input="slow store", max_output_tokens=4, stream=True)))
    stream.start()
    try:
        assert writing.wait(30), "the stored copy was never written"
        wait_nothing_in_flight(router)
        assert not router.limits.inflight
        assert not any(event.type == "response.completed" for event in events)
    finally:
        release.set()
        stream.join(30)
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert client(url).responses.retrieve(events[-1].response.id).id == events[-1].response.id


def test_a_client_leaving_a_stream_frees_its_pod_and_slot(served: tuple[str, Router], model: str) -> None:
    url, router = served
    with httpx.stream("POST", url + "/v1/responses", timeout=60, headers={"authorization": f"Bearer {ACME_KEY}"},
                      json={"model": model, "input": "a long one", "max_output_tokens": 300, "ignore_eos": True,
                            "stream": True}) as reply:
        deltas = 0
        for line in reply.iter_lines():
            deltas += '"response.output_text.delta"' in line
            if deltas == 3:
                break  # the client leaves mid-answer
    wait_nothing_in_flight(router)
    for _ in range(200):
        if not router.limits.inflight:
            break
        time.sleep(0.025)
    assert not router.limits.inflight
