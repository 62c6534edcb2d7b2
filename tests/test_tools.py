"""Tool calling (engine/tools.py) on /v1/chat/completions. The tiny random model writes garbage unless
constrained, so every named or required call whose arguments validate here was made so by the tool_choice's
constraint. "auto" depends on the model writing Hermes <tool_call> blocks, which the tiny model never does: its
parser and stream are tested on given text, and the server's auto wiring on RequestOutputs fed to it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from kvmesh.engine import engine as engine_module
from kvmesh.engine.model.tokenizer import Tokenizer
from kvmesh.engine.model.tool_prompt import HERMES_SYSTEM, prompt_messages
from kvmesh.engine.openai_types import ChatRequest, finish_apart
from kvmesh.engine.request import RequestOutput
from kvmesh.engine.server import _Completions
from kvmesh.engine.tools import (
    ArrayScanner,
    ToolStream,
    merge_tool_deltas,
    parse_hermes,
    tool_constraint,
    tool_message,
)
from kvmesh.router.app import build_router, create_router_app
from kvmesh.router.config import RouterConfig

from .conftest import make_engine
from .engines import serve_checked, serve_engine

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
NAMES = set(SCHEMAS)
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


# ---- the parsers ---------------------------------------------------------------------------------------------


def test_hermes_parser_finds_several_calls_and_keeps_text_before() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    calls = parse_hermes(text, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    message, reason = tool_message("auto", text, NAMES, "stop")
    assert message["content"] == "Let me check." and len(message["tool_calls"]) == 2 and reason == "tool_calls"


def test_hermes_parser_drops_malformed_and_undeclared_calls() -> None:
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    undeclared = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    for text in ("plain answer", bad, undeclared):  # no valid call: the text is the content, as written
        assert parse_hermes(text, NAMES) == []
        assert tool_message("auto", text, NAMES, "stop") == ({"role": "assistant", "content": text}, "stop")
    text = bad + undeclared + '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'  # EOS before the tag
    assert [c.name for c in parse_hermes(text, NAMES)] == ["add"]
    message, _ = tool_message("auto", text, NAMES, "stop")
    assert message["content"] is None and [c["function"]["name"] for c in message["tool_calls"]] == ["add"]


def test_required_parser_takes_complete_objects_of_a_cut_array() -> None:
    whole = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "R'
    message, reason = tool_message("required", whole, NAMES, "length")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["add"] and reason == "length"
    braces = '[{"name": "add", "arguments": {"a": 1, "b": 2}, "x": "}{\\"]"}]'  # braces and quotes in strings
    assert len(ArrayScanner().feed(braces)) == 1


def test_tool_constraints_follow_each_tools_schema() -> None:
    required = tool_constraint("required", TOOLS, None, parallel=True)
    assert required is not None and required.param == "tool_choice"
    jsonschema.validate([{"name": "add", "arguments": {"a": 1, "b": 2}},
                         {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}], required.spec)
    with pytest.raises(jsonschema.ValidationError):  # add's name with get_weather's arguments
        jsonschema.validate([{"name": "add", "arguments": {"city": "Oslo", "unit": "c"}}], required.spec)
    single = tool_constraint("required", TOOLS, None, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "arguments": {"a": 1, "b": 2}}] * 2, single.spec)
    bare = [{"type": "function", "function": {"name": "ping"}}]
    assert tool_constraint("named", bare, "ping", parallel=True).spec == {"type": "object"}  # any object
    assert tool_constraint("auto", TOOLS, None, parallel=True) is None


def _feed(stream: ToolStream, pieces: list[str], finish: str = "stop") -> tuple[str, list[dict], str | None]:
    content, calls = "", []
    for piece in pieces:
        delta = stream.feed(piece)
        content += delta.content
        calls += delta.tool_calls
    last, reason = stream.finish(finish)
    return content + last.content, calls + last.tool_calls, reason


def test_auto_stream_holds_back_a_marker_split_across_chunks() -> None:
    stream = ToolStream("auto", NAMES)
    assert stream.feed("Checking <to").content == "Checking "  # "<to" may start <tool_call>: held
    assert stream.feed("ol_").content == ""
    assert stream.feed('call>{"name": "add", "arguments": {"a": 1, "b": 2}}').content == ""
    content, calls, reason = _feed(stream, ["</tool_call>"])
    assert content == "" and reason == "tool_calls"
    assert calls == [{"index": 0, "id": calls[0]["id"], "type": "function",
                      "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]


def test_auto_stream_flushes_held_text_that_is_no_call() -> None:
    content, calls, reason = _feed(ToolStream("auto", NAMES), ["a <tool", "box> b <tool_call>{oops"])
    assert (content, calls, reason) == ("a <toolbox> b <tool_call>{oops", [], "stop")


def test_required_stream_sends_each_call_once_its_object_closes() -> None:
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "X", ' \
           '"unit": "f"}}]'
    stream = ToolStream("required", NAMES)
    sent = [stream.feed(ch).tool_calls for ch in text]
    opened_at = [i for i, calls in enumerate(sent) if calls]
    assert opened_at == [text.index("}}") + 1, len(text) - 2]  # right at each object's closing brace
    _, _, reason = _feed(stream, [])
    assert [c["index"] for s in sent for c in s] == [0, 1] and reason == "tool_calls"


def test_named_stream_opens_the_call_then_streams_arguments() -> None:
    stream = ToolStream("named", NAMES, "add")
    first, second = stream.feed('{"a": '), stream.feed("1}")
    assert first.tool_calls[0]["function"] == {"name": "add", "arguments": '{"a": '}
    assert first.tool_calls[0]["id"].startswith("call_") and first.tool_calls[0]["type"] == "function"
    assert second.tool_calls == [{"index": 0, "function": {"arguments": "1}"}}]
    assert stream.finish("length")[1] == "length"  # cut by max_tokens: the client sees length, not tool_calls


def test_tool_message_shapes() -> None:
    message, reason = tool_message("named", '{"a": 1, "b": 2}', NAMES, "stop", "add")
    assert message["content"] is None and reason == "tool_calls"
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert tool_message("auto", "hello", NAMES, "stop") == ({"role": "assistant", "content": "hello"}, "stop")
    message, reason = tool_message("required", "[{", NAMES, "length")
    assert message == {"role": "assistant", "content": "[{"} and reason == "length"
    assert _feed(ToolStream("required", NAMES), ["[", "{"], "length") == ("[{", [], "length")  # streamed alike


def _same_answer(mode: str, text: str, pieces: list[str], finish: str, name: str | None = None) -> dict:
    """The whole answer of `text` and its stream cut into `pieces` say the same: finish_reason, the calls (name
    and arguments, in order), and the content (beside calls, the whole answer's is trimmed, None when empty)."""
    assert "".join(pieces) == text
    message, reason = tool_message(mode, text, NAMES, finish, name)
    content, deltas, streamed_reason = _feed(ToolStream(mode, NAMES, name), pieces, finish)
    calls = merge_tool_deltas(deltas)
    assert streamed_reason == reason
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert message["content"] == ((content.strip() or None) if calls else content)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    return message


def test_a_long_tool_call_answer_parses_whole_and_streamed_alike() -> None:
    """A few hundred KB of arguments (a document passed to a tool) in every mode, streamed in small pieces; the
    parsers keep the text as pieces, so this is linear (it took seconds when each character was appended)."""
    document = ("Line with \"quotes\", {braces} and [brackets] \\ " * 6000)[:300_000]
    arguments = {"city": document, "unit": "c"}
    call = json.dumps({"name": "get_weather", "arguments": arguments})
    texts = {"named": json.dumps(arguments), "required": f"[{call}]",
             "auto": f"Looking it up.\n<tool_call>\n{call}\n</tool_call>"}
    for mode, text in texts.items():
        name = "get_weather" if mode == "named" else None
        message = _same_answer(mode, text, [text[i: i + 5] for i in range(0, len(text), 5)], "stop", name)
        (parsed,) = message["tool_calls"]
        assert json.loads(parsed["function"]["arguments"]) == arguments
    assert _same_answer("auto", texts["auto"], [texts["auto"]], "stop")["content"] == "Looking it up."


# pieces of answers in every mode: Hermes blocks (valid, malformed, undeclared), array syntax, markers cut apart,
# quotes, backslashes and braces inside strings
ADD_CALL = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
TRICKY_CALL = '{"name": "get_weather", "arguments": {"city": "a\\"}{[\\\\", "unit": "c"}}'  # city: a"}{[\
TEXT_ARGUMENTS_CALL = '{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}'  # arguments as JSON text
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "_call>", "<", "[", "]", ",", "{", "}", '"', "\\", "\n", " ",
             "Sure. ", ADD_CALL, TRICKY_CALL, TEXT_ARGUMENTS_CALL, '{"name": "rm_rf", "arguments": {}}']


@settings(max_examples=300, deadline=None)
@given(mode=st.sampled_from(["auto", "required", "named"]), finish=st.sampled_from(["stop", "length"]),
       parts=st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=12), data=st.data())
def test_whole_and_streamed_answers_agree_however_the_text_is_cut(mode: str, finish: str, parts: list[str],
                                                                  data: st.DataObject) -> None:
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    name = "add" if mode == "named" else None
    _same_answer(mode, text, pieces, finish, name)
    _same_answer(mode, text, list(text), finish, name)  # one character at a time


def test_an_empty_piece_after_a_backslash_keeps_the_escape() -> None:
    """A stream's piece may be empty (hypothesis found it): the backslash ending the piece before it still escapes
    the first character of the piece after."""
    text = f"{TEXT_ARGUMENTS_CALL}{{{ADD_CALL}"
    cut = TEXT_ARGUMENTS_CALL.index("\\") + 1
    _same_answer("required", text, [text[:cut], "", text[cut:]], "stop")


def test_answers_built_from_the_fragments_hold_calls() -> None:
    """The property's fragments make answers with calls, not only text: spot checks of what it compares."""
    required = f"[{ADD_CALL}, {TRICKY_CALL}]"
    cut = TRICKY_CALL.index("\\") + 1  # a piece ends with the backslash that escapes the next one's quote
    pieces = ["[", ADD_CALL[:9], ADD_CALL[9:] + ", " + TRICKY_CALL[:cut], TRICKY_CALL[cut:], "]"]
    message = _same_answer("required", required, pieces, "stop")
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"a": 1, "b": 2}, {"city": 'a"}{[\\', "unit": "c"}]
    text = f"Sure. <tool_call>{TRICKY_CALL}</tool_call><tool_call>{TEXT_ARGUMENTS_CALL}</tool_call>"
    message = _same_answer("auto", text, [text[:8], text[8:30], text[30:]], "stop")
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"city": 'a"}{[\\', "unit": "c"}, {"a": 3, "b": 4}]

# ---- the prompt -----------------------------------------------------------------------------------------------

HISTORY = [
    {"role": "system", "content": "Be brief."},
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
]


def test_hermes_fallback_renders_tools_calls_and_results(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    assert not tok.template_uses_tools  # SmolLM2's bundled template: the fallback applies
    prompt = tok.apply_chat_template(prompt_messages(HISTORY, TOOLS, False))
    assert prompt.count("<|im_start|>system") == 1 and "Be brief.\n\n" + HERMES_SYSTEM.split("{")[0] in prompt
    assert json.dumps(TOOLS[0]) in prompt and json.dumps(TOOLS[1]) in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"c"}}\n</tool_call><|im_end|>') in prompt
    assert "<|im_start|>user\n<tool_response>\n21 C, sunny\n</tool_response><|im_end|>" in prompt


def test_a_template_that_reads_tools_gets_them(tiny_dir: Path) -> None:
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}CALL {{ c.function.arguments.city }}{% endfor %}\n{% endfor %}")
    tok = Tokenizer((tiny_dir / "tokenizer.json").read_text(), template, {}, [])
    assert tok.template_uses_tools
    mentions = "{# no tools here #}You are a helper with tools.{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not Tokenizer((tiny_dir / "tokenizer.json").read_text(), mentions, {}, []).template_uses_tools
    prompt = tok.apply_chat_template(prompt_messages(HISTORY, TOOLS, True), tools=TOOLS)
    assert prompt.startswith("TOOLS:get_weather;add;") and "assistant:CALL Paris" in prompt  # arguments as object
    assert "tool:21 C, sunny" in prompt and "<tools>" not in prompt


# ---- through the HTTP server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(tiny_dir: Path) -> Iterator[str]:
    with serve_checked(make_engine(tiny_dir, kv_cache_blocks=256, max_model_len=1024)) as url:
        yield url


def post(url: str, **body: object) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, **body}, timeout=120)


def _valid_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_named_tool_choice_answers_a_valid_call(url: str) -> None:
    reply = post(url, tool_choice=NAMED, max_tokens=60, seed=3, n=2)
    assert reply.status_code == 200, reply.text
    for choice in reply.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        _valid_calls([call])


def test_required_tool_choice_answers_valid_calls(url: str) -> None:
    for parallel in (False, True):
        reply = post(url, tool_choice="required", parallel_tool_calls=parallel, max_tokens=120, seed=11)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        _valid_calls(choice["message"]["tool_calls"])
        if not parallel:
            assert len(choice["message"]["tool_calls"]) == 1


def test_auto_and_none_show_tools_but_give_plain_content(url: str) -> None:
    bare = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 5}, timeout=60).json()
    for choice in ("auto", "none"):
        reply = post(url, tool_choice=choice, max_tokens=5, seed=1).json()
        assert reply["usage"]["prompt_tokens"] > bare["usage"]["prompt_tokens"] + 50  # the Hermes listing
        message = reply["choices"][0]["message"]
        assert isinstance(message["content"], str) and "tool_calls" not in message
        assert reply["choices"][0]["finish_reason"] == "length"
    whole = post(url, max_tokens=40, seed=6).json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "messages": ASK, "tools": TOOLS, "max_tokens": 40, "seed": 6, "stream": True}) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole  # held text flushed
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_history_with_tool_calls_and_results_is_accepted(url: str) -> None:
    reply = post(url, messages=HISTORY, max_tokens=3)
    assert reply.status_code == 200, reply.text


def test_required_cut_by_max_tokens_says_length(url: str) -> None:
    choice = post(url, tool_choice="required", max_tokens=4, seed=2).json()["choices"][0]
    assert choice["finish_reason"] == "length"  # the client gets the partial text as content, no tool_calls
    assert choice["message"]["content"].startswith("[") and "tool_calls" not in choice["message"]


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"tools": None, "tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope', which is not"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                               "minProperties": "x"}}}]},
     "tools", "minProperties"),
    ({"response_format": {"type": "json_object"}}, "tools", "cannot be combined with response_format"),
    ({"structured_outputs": {"regex": "a"}}, "tools", "cannot be combined with structured_outputs"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]}, "messages", "function"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "abc"}]}, "messages", "tool_calls"),
])
def test_bad_tool_requests_are_400s_from_engine_and_router(url: str, tiny_dir: Path, body: dict, param: str,
                                                           message: str) -> None:
    full = {"messages": ASK, "tools": TOOLS, **body}
    with TestClient(create_router_app(build_router(RouterConfig(pods=[]), tiny_dir))) as router:
        replies = [httpx.post(url + "/v1/chat/completions", json=full, timeout=60),
                   router.post("/v1/chat/completions", json=full)]
    for reply in replies:
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
    assert replies[0].json()["error"]["param"] == param


def test_the_router_hashes_the_prompt_with_its_tools_as_the_engine_caches_it(url: str, tiny_dir: Path) -> None:
    """Prefix-aware routing for agents (long, repeated tool lists): the router tokenizes a tool request with the
    tools shown as the engine shows them, so its block hashes are the ones the engine caches."""
    body = {"messages": HISTORY, "tools": TOOLS, "max_tokens": 1}
    assert post(url, **body).status_code == 200
    info = build_router(RouterConfig(pods=[]), tiny_dir).request_info(ChatRequest.model_validate(body), 0)
    cached = set(httpx.get(url + "/v1/kv/blocks", timeout=30).json()["blocks"]["device"])
    assert len(info.block_hashes) >= 8 and set(info.block_hashes) <= cached


def test_openai_client_parses_calls_whole_and_streamed(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    whole = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=60, seed=5)
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    for choice, max_tokens in ((NAMED, 60), ("required", 120)):
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                    max_tokens=max_tokens, seed=5, stream=True):
            delta = chunk.choices[0].delta
            for piece in delta.tool_calls or []:
                entry = calls.setdefault(piece.index, {"id": piece.id, "type": piece.type, "function": {
                    "name": piece.function.name, "arguments": ""}})
                entry["function"]["arguments"] += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        _valid_calls(list(calls.values()))
        if choice == NAMED:  # the same seed: the stream adds up to the whole answer's arguments
            assert calls[0]["function"]["arguments"] == call.function.arguments


def test_server_streams_auto_content_then_calls() -> None:
    """The server's chunk rewriting for auto, fed outputs directly (no model here writes Hermes calls)."""
    stream = ToolStream("auto", NAMES)
    pieces = ["Sure. <tool", '_call>{"name": "add", ', '"arguments": {"a": 1, "b": 2}}</tool_call>']
    chunks = []
    for i, piece in enumerate(pieces):
        choice = {"index": 0, "delta": {"content": piece, **({"role": "assistant"} if i == 0 else {})},
                  "finish_reason": None}
        out = RequestOutput("r", [1], piece, finish_reason="stop" if i == len(pieces) - 1 else None)
        _Completions._tool_delta(choice, stream, out)
        chunks.append(choice)
    assert chunks[0]["delta"] == {"role": "assistant", "content": "Sure. "}
    assert chunks[1]["delta"] == {}
    assert chunks[2]["finish_reason"] == "tool_calls"
    assert chunks[2]["delta"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}


def _arguments_done(events: Iterator[object]) -> set[int]:
    return {e.index for e in events if e.type == "tool_calls.function.arguments.done"}  # type: ignore[attr-defined]


def test_the_openai_stream_helper_closes_every_streamed_call(url: str) -> None:
    """The client's stream helper (ChatCompletionStreamState) closes a call on the chunk after the one that
    delivered it: a last call sent beside finish_reason never got its arguments.done."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    # seeds 4 and 9 with parallel calls: the last call closes on the answer's last token
    for choice, parallel, seed in ((NAMED, True, 5), ("required", False, 5), ("required", True, 4),
                                   ("required", True, 9)):
        with client.beta.chat.completions.stream(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                 parallel_tool_calls=parallel, max_tokens=120, seed=seed) as stream:
            done = _arguments_done(iter(stream))
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls" and final.message.tool_calls
        assert done == set(range(len(final.message.tool_calls)))
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120, "seed": 4, "stream": True,
            "return_token_ids": True}) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    last = chunks[-1]["choices"][0]  # OpenAI's last chunk of a choice: nothing but its finish_reason
    assert last == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls", "token_ids": []}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_the_openai_stream_helper_closes_auto_calls() -> None:
    """auto sends its calls at the end: every one of them in the chunk before the finishing one."""
    stream = ToolStream("auto", NAMES)
    pieces = ["Sure. ", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>']
    state = ChatCompletionStreamState(input_tools=TOOLS)
    events = []
    for i, piece in enumerate(pieces):
        choice = {"index": 0, "delta": {"content": piece, **({"role": "assistant"} if i == 0 else {})},
                  "finish_reason": None, "logprobs": None}
        out = RequestOutput("r", [1], piece, finish_reason="stop" if i == len(pieces) - 1 else None)
        _Completions._tool_delta(choice, stream, out)
        for part in finish_apart(choice):
            chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [part]}
            events += state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Sure. "
    assert [c.function.name for c in final.message.tool_calls] == ["add", "get_weather"]
    assert _arguments_done(iter(events)) == {0, 1}


TWO_CALLS = ('Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>')
SCRIPTED_SEED = 424242  # the rows sampled under this seed write TWO_CALLS


@pytest.fixture()
def two_calls_model(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model writes TWO_CALLS (as Qwen and Hermes models write parallel calls) for requests seeded
    SCRIPTED_SEED: its sampler is steered to the script's tokens, then EOS; the server, parser and stream are
    the real ones. A steered sampler, because no model small enough for CI writes Hermes calls."""
    tok = Tokenizer.from_dir(tiny_dir)
    script, eos = tok.encode(TWO_CALLS), min(tok.eos_token_ids)
    real = engine_module.sample

    def scripted(logits: torch.Tensor, params: list, indices: list[int], *args: object, **kwargs: object) -> object:
        logits = logits.clone()
        for row, (p, i) in enumerate(zip(params, indices, strict=True)):
            if p.seed == SCRIPTED_SEED:
                logits[row] = -1e9
                logits[row, script[i] if i < len(script) else eos] = 1e9
        return real(logits, params, indices, *args, **kwargs)

    monkeypatch.setattr(engine_module, "sample", scripted)


@pytest.mark.usefixtures("two_calls_model")
def test_auto_without_parallel_tool_calls_keeps_the_first_call(url: str) -> None:
    """parallel_tool_calls false: one call, whole or streamed, as OpenAI answers (agents that act on one call a
    step rely on it); the default keeps both."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id

    def ask(**kwargs: object) -> object:
        return client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, seed=SCRIPTED_SEED,
                                              max_tokens=200, **kwargs)

    both = ask().choices[0]
    assert [c.function.name for c in both.message.tool_calls] == ["add", "get_weather"]
    one = ask(parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and one.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in one.message.tool_calls] == [
        ("add", {"a": 1, "b": 2})]
    streamed = [call for chunk in ask(parallel_tool_calls=False, stream=True) for choice in chunk.choices
                for call in choice.delta.tool_calls or []]
    assert {call.index for call in streamed} == {0} and streamed[0].function.name == "add"


def test_named_tool_choice_across_a_prefill_decode_handoff(tiny_dir: Path, url: str) -> None:
    """The decode pod rebuilds the tool constraint from the request and continues as one pod would have."""
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 60, "seed": 8,
            "return_token_ids": True}
    reference = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    first = httpx.post(url + "/v1/chat/completions", json={**body, "kv_transfer": {"mode": "prefill"}},
                       timeout=60).json()
    (token,) = first["choices"][0]["token_ids"]
    with serve_engine(make_engine(tiny_dir, kv_cache_blocks=128, max_model_len=1024)) as decode:
        rest = httpx.post(decode + "/v1/chat/completions", json={**body, "kv_transfer": {
            "mode": "decode", "source": url, "handle": first["kv_transfer"]["handle"], "first_token": token}},
            timeout=60)
    assert rest.status_code == 200, rest.text
    choice = rest.json()["choices"][0]
    assert [token, *choice["token_ids"]] == reference["token_ids"] and choice["finish_reason"] == "tool_calls"
    arguments = first["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] + \
        choice["message"]["tool_calls"][0]["function"]["arguments"]
    assert arguments == reference["message"]["tool_calls"][0]["function"]["arguments"]
    jsonschema.validate(json.loads(arguments), WEATHER)


@pytest.mark.slow
def test_bundled_model_calls_a_named_tool(bundled_dir: Path) -> None:
    engine = make_engine(bundled_dir, kv_cache_blocks=128, max_model_len=2048)
    with serve_engine(engine) as served:
        reply = httpx.post(served + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
            "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 60, "temperature": 0.0})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    _valid_calls(choice["message"]["tool_calls"])
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
