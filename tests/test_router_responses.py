"""The Responses API translation (router/responses.py): requests become chat requests, completions become responses."""

from __future__ import annotations

import pytest
from openai.types.responses import Response

from router.responses import ResponsesError, chat_request, history_after, response_object


def test_string_input_with_instructions_and_sampling() -> None:
    chat = chat_request({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 7,
                         "temperature": 0.5, "top_p": 0.9})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}],
                    "max_tokens": 7, "temperature": 0.5, "top_p": 0.9}


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


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"model": "m"}, "input"),
])
def test_unsupported_requests_name_their_param(body: dict, param: str) -> None:
    with pytest.raises(ResponsesError) as caught:
        chat_request(body)
    assert caught.value.param == param


def test_response_object_parses_with_the_openai_client_types() -> None:
    completion = {"model": "m", "choices": [{"message": {"role": "assistant", "content": "hello"}}],
                  "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 8}}}
    parsed = Response.model_validate(response_object("resp_1", {"model": "m", "input": "hi"}, completion))
    assert parsed.output_text == "hello"
    assert parsed.usage is not None and parsed.usage.input_tokens_details.cached_tokens == 8


def test_a_continuation_drops_instructions_and_appends_the_answer() -> None:
    body = {"model": "m", "input": "q1", "instructions": "sys"}
    chat = chat_request(body)
    completion = {"choices": [{"message": {"role": "assistant", "content": "a1", "tool_calls": None}}]}
    history = history_after(body, chat, completion)
    assert history == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    assert chat_request({"model": "m", "input": "q2"}, history)["messages"][:2] == history
