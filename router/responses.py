"""OpenAI Responses API <-> chat completions, as pure functions.

The router serves /v1/responses by turning a response request into a chat request that takes its ordinary routing
path; a continuation (previous_response_id) is rebuilt as the earlier turns' messages first, so it shares their
token prefix and the prefix-aware choice sends it to the pod that holds it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

UNSUPPORTED_FIELDS = ("background", "reasoning", "include", "prompt", "conversation", "truncation")
ROLES = ("user", "system", "developer", "assistant")


class ResponsesError(ValueError):
    """A request the translation cannot serve; `param` names the field, as OpenAI's error body does."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _text_of(content: Any, param: str) -> str:
    """A message's content as one string: a string, or a list of input_text/output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesError("content must be a string or a list of text parts", param)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") not in ("input_text", "output_text"):
            raise ResponsesError("only input_text and output_text content parts are supported", f"{param}[{i}]")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def input_messages(items: str | Sequence[Any]) -> list[dict[str, Any]]:
    """A response request's `input` as chat messages (function calls become assistant tool_calls)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise ResponsesError("an input item must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise ResponsesError(f"role must be one of {', '.join(ROLES)}", f"{param}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content", ""), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": str(item.get("output", ""))})
        else:
            raise ResponsesError(f"input items of type {kind!r} are not supported", f"{param}.type")
    return messages


def chat_request(body: Mapping[str, Any], history: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The chat completion request for a response request; `history` holds the earlier turns' messages."""
    for name in UNSUPPORTED_FIELDS:
        if body.get(name):
            raise ResponsesError(f"{name} is not supported by this server", name)
    if "input" not in body:
        raise ResponsesError("input is required", "input")
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": str(body["instructions"])})
    messages += [*history, *input_messages(body["input"])]
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("user", "user")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    tools = []
    for i, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ResponsesError("only function tools are supported", f"tools[{i}].type")
        tools.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}})
    if tools:
        chat["tools"] = tools
        choice = body.get("tool_choice")
        if isinstance(choice, Mapping):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif choice is not None:
            chat["tool_choice"] = choice
    return chat


def response_object(response_id: str, body: Mapping[str, Any], completion: Mapping[str, Any]) -> dict[str, Any]:
    """The Responses API object for a finished chat completion."""
    message = completion["choices"][0]["message"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append({"type": "message", "id": f"msg_{response_id}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = completion.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    prompt = usage.get("prompt_tokens", 0)
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "completed",
        "model": completion.get("model", body.get("model")), "output": output,
        "instructions": body.get("instructions"), "previous_response_id": body.get("previous_response_id"),
        "metadata": body.get("metadata") or {}, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"), "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"), "parallel_tool_calls": True, "error": None,
        "incomplete_details": None, "store": body.get("store", True), "user": body.get("user"),
        "usage": {"input_tokens": prompt, "output_tokens": usage.get("completion_tokens", 0),
                  "total_tokens": usage.get("total_tokens", 0), "input_tokens_details": {"cached_tokens": cached,
                                                                        "cache_write_tokens": prompt - cached},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


def history_after(body: Mapping[str, Any], chat: Mapping[str, Any],
                  completion: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The messages a continuation of this turn starts with: its input and its answer, without its instructions
    (OpenAI does not carry instructions over), in the order the turn's prompt had them."""
    messages = list(chat["messages"])
    if body.get("instructions"):
        messages = messages[1:]
    answer = dict(completion["choices"][0]["message"])
    return [*messages, {key: answer[key] for key in ("role", "content", "tool_calls") if answer.get(key) is not None}]
