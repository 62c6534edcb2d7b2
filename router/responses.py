"""OpenAI Responses API <-> chat completions, as pure functions.

The router serves /v1/responses by turning a response request into a chat request that takes its ordinary routing
path; a continuation (previous_response_id) is rebuilt as the earlier turns' messages first, so it shares their
token prefix and the prefix-aware choice sends it to the pod that holds it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.engine.model.tokenizer import TEXT_PARTS_SEPARATOR
from kvmesh.engine.openai_types import DEFAULT_VERBOSITY
from kvmesh.router.batches import BatchInputError, check_metadata
from kvmesh.router.usage import cached_tokens, usage_count

UNSUPPORTED_FIELDS = ("background", "reasoning", "include", "prompt", "conversation")
ROLES = ("user", "system", "developer", "assistant")
RESPONSE_ID_PREFIX = "resp_"
# The longest id a request may name (`user`, an input item's `id` or `call_id`, tool_choice's function): a stored
# response keeps these, and no token is charged for them. OpenAI documents no bound for these (64 characters for
# safety_identifier, which replaces `user`); 256 holds any id a client makes.
MAX_ID_CHARS = 256
ITEM_STATUSES = ("in_progress", "completed", "incomplete")
TOOL_CHOICES = ("none", "auto", "required")
TOOL_FIELDS = ("name", "description", "parameters", "strict")  # a function tool's, as the chat request has them
SCHEMA_FIELDS = ("name", "schema", "strict", "description")  # text.format's of type json_schema
# the chat path's own sampling fields (beyond OpenAI's), taken as they are: the engine checks them
SAMPLING_EXTENSIONS = ("top_k", "min_p", "seed", "stop", "ignore_eos", "min_tokens", "presence_penalty",
                       "frequency_penalty", "logit_bias", "repetition_penalty", "chat_template_kwargs")


# The chat request's fields that carry a response request's field of another name: an error the chat path finds in
# one names the field the client sent (`param` and the message alike).
CHAT_TO_RESPONSE_FIELDS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}
# a chat field as an error names it, with a message's index (which counts the instructions and earlier turns first,
# not the client's input items: dropped)
_CHAT_FIELD = re.compile(rf"\b({'|'.join(CHAT_TO_RESPONSE_FIELDS)})\b(?:\.\d+\b)?")


def response_error(error: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI error object of the chat path (its `error` member) as a response request's client reads it: the
    translated fields under the names the client sent (`max_output_tokens: 0` is refused naming max_output_tokens,
    not max_tokens)."""
    renamed = dict(error)
    param = error.get("param")
    if isinstance(param, str) and (found := _CHAT_FIELD.match(param)) is not None:
        renamed["param"] = CHAT_TO_RESPONSE_FIELDS[found.group(1)] + param[found.end():]
    if isinstance(error.get("message"), str):
        renamed["message"] = _CHAT_FIELD.sub(lambda m: CHAT_TO_RESPONSE_FIELDS[m.group(1)], error["message"])
    return renamed


class ResponsesError(ValueError):
    """A request the translation cannot serve; `param` names the field, as OpenAI's error body does."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _text_of(content: Any, param: str) -> str:
    """A message's content (or a function call's output) as one string: a string, or a list of
    input_text/output_text parts joined as the chat path joins a message's text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesError(f"{param} must be a string or a list of text parts", param)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") not in ("input_text", "output_text"):
            raise ResponsesError("only input_text and output_text content parts are supported", f"{param}[{i}]")
        texts.append(str(part.get("text", "")))
    return TEXT_PARTS_SEPARATOR.join(texts)


def _check_id(value: Any, param: str) -> None:
    """An id the request names, kept as sent: a string of at most MAX_ID_CHARS (or absent)."""
    if value is not None and (not isinstance(value, str) or len(value) > MAX_ID_CHARS):
        raise ResponsesError(f"{param} must be a string of at most {MAX_ID_CHARS} characters", param)


def _check_item(item: Mapping[str, Any], param: str) -> None:
    """The fields of an input item that a stored response keeps but its prompt does not hold: bounded."""
    _check_id(item.get("id"), f"{param}.id")
    _check_id(item.get("call_id"), f"{param}.call_id")
    if item.get("status") is not None and item["status"] not in ITEM_STATUSES:
        raise ResponsesError(f"status must be one of {', '.join(ITEM_STATUSES)}", f"{param}.status")


def input_messages(items: Any) -> list[dict[str, Any]]:
    """A response request's `input` as chat messages. Function calls become the tool_calls of the assistant
    message they follow (one message, as the answer that made them is stored), so a client that sends a
    response's output back itself builds the prompt a stored continuation would."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ResponsesError("input must be a string or a list of input items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise ResponsesError("an input item must be an object", param)
        _check_item(item, param)
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
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text_of(item.get("output", ""), f"{param}.output")})
        else:
            raise ResponsesError(f"input items of type {kind!r} are not supported", f"{param}.type")
    return messages


def chat_request(body: Mapping[str, Any], history: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The chat completion request for a response request; `history` holds the earlier turns' messages."""
    for name in UNSUPPORTED_FIELDS:
        if body.get(name):
            raise ResponsesError(f"{name} is not supported by this server", name)
    if body.get("truncation") not in (None, "disabled"):  # "auto" would drop earlier turns to fit the context
        raise ResponsesError("truncation must be 'disabled': a prompt over the context is refused, not cut",
                             "truncation")
    if "input" not in body:
        raise ResponsesError("input is required", "input")
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": str(body["instructions"])})
    messages += [*history, *input_messages(body["input"])]
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    try:
        check_metadata(body.get("metadata"))
    except BatchInputError as exc:
        raise ResponsesError(str(exc), "metadata") from None
    for flag in ("store", "stream"):
        if not isinstance(body.get(flag, False), bool):
            raise ResponsesError(f"{flag} must be true or false", flag)
    _check_id(body.get("user"), "user")
    if (response_format := _response_format(text_config(body.get("text")))) is not None:
        chat["response_format"] = response_format
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("user", "user"), ("parallel_tool_calls", "parallel_tool_calls"),
                         *((name, name) for name in SAMPLING_EXTENSIONS)):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    choice = tool_choice(body.get("tool_choice"))
    if tools := function_tools(body.get("tools")):
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
                         for tool in tools]
        if isinstance(choice, Mapping):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif choice is not None:
            chat["tool_choice"] = choice
    return chat


def function_tools(tools: Any) -> list[dict[str, Any]]:
    """A request's `tools`, each with the fields a function tool has (TOOL_FIELDS: what the prompt holds), as a
    response echoes them."""
    if not isinstance(tools or [], list):
        raise ResponsesError("tools must be a list", "tools")
    known = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ResponsesError("only function tools are supported", f"tools[{i}].type")
        known.append({"type": "function", **{key: tool[key] for key in TOOL_FIELDS if key in tool}})
    return known


def tool_choice(choice: Any) -> str | dict[str, str] | None:
    """A request's `tool_choice` as a response echoes it: one of TOOL_CHOICES, a function by name, or None."""
    if choice is None or choice in TOOL_CHOICES:
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str) \
            and len(choice["name"]) <= MAX_ID_CHARS:
        return {"type": "function", "name": choice["name"]}
    raise ResponsesError(f"tool_choice must be {', '.join(TOOL_CHOICES)} or a function by name (at most "
                         f"{MAX_ID_CHARS} characters)", "tool_choice")


def text_config(text: Any) -> dict[str, Any] | None:
    """A request's `text` as a response echoes it: its `format` with the fields of its type (no `format`: text),
    and its `verbosity` if sent (None: `text` not sent)."""
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise ResponsesError("text must be an object", "text")
    verbosity = text.get("verbosity")
    if verbosity not in (None, DEFAULT_VERBOSITY):  # would change what the answer holds, which is not done here
        raise ResponsesError(f"text.verbosity other than {DEFAULT_VERBOSITY!r} is not supported: the answer is not "
                             "steered to a length (set max_output_tokens or say so in the instructions)",
                             "text.verbosity")
    echoed = {"verbosity": verbosity} if verbosity is not None else {}
    form = text.get("format")
    kind = form.get("type") if isinstance(form, Mapping) else None
    if form is not None and kind not in ("text", "json_object", "json_schema"):
        raise ResponsesError("text.format must be an object whose type is text, json_object or json_schema",
                             "text.format")
    if kind != "json_schema":
        return {"format": {"type": kind or "text"}, **echoed}
    if not isinstance(form.get("schema"), Mapping):
        raise ResponsesError("text.format.schema must be a JSON schema object", "text.format.schema")
    return {"format": {"type": kind, **{key: form[key] for key in SCHEMA_FIELDS if key in form}}, **echoed}


def _response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A response request's `text.format` (checked: `text_config`) as the chat request's `response_format` (None:
    free text)."""
    form = (text or {}).get("format", {})
    if form.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}
    return {"type": "json_object"} if form.get("type") == "json_object" else None


def message_id(response_id: str) -> str:
    """The id of a response's output message (the stream's items name it before the response is whole)."""
    return f"msg_{response_id.removeprefix(RESPONSE_ID_PREFIX)}"


def response_shell(response_id: str, body: Mapping[str, Any], created_at: int,
                   status: str = "in_progress") -> dict[str, Any]:
    """A response object without output or usage: what a stream's first events carry. A request's fields are
    echoed as `chat_request` checked them, with their known fields only: a stored response keeps no byte the
    request was not charged for or bounded in."""
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "model": body.get("model"), "output": [], "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"), "metadata": body.get("metadata") or {},
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"), "tools": function_tools(body.get("tools")),
        "tool_choice": tool_choice(body.get("tool_choice")) or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "error": None,
        "incomplete_details": None, "store": body.get("store", True), "user": body.get("user"),
        "text": text_config(body.get("text")) or {"format": {"type": "text"}}, "usage": None,
    }


def output_items(response_id: str, message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as the response's output items: its text, then one item per tool call."""
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append({"type": "message", "id": message_id(response_id), "role": "assistant",
                       "status": "completed",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    return output


def response_object(response_id: str, body: Mapping[str, Any], completion: Mapping[str, Any],
                    created_at: int) -> dict[str, Any]:
    """The Responses API object for a finished chat completion: completed, or incomplete when the answer ran
    into max_output_tokens."""
    choice = completion["choices"][0]
    response = response_shell(response_id, body, created_at, "completed")
    response["model"] = completion.get("model") or body.get("model")
    response["output"] = output_items(response_id, choice["message"])
    if choice.get("finish_reason") == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
        for item in response["output"]:
            item["status"] = "incomplete"
    usage = completion.get("usage")
    prompt, cached = usage_count(usage, "prompt_tokens"), cached_tokens(usage)
    response["usage"] = {
        "input_tokens": prompt, "output_tokens": usage_count(usage, "completion_tokens"),
        "total_tokens": usage_count(usage, "total_tokens"),
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
        "output_tokens_details": {"reasoning_tokens": 0}}
    return response


def input_items(body: Mapping[str, Any], response_id: str) -> list[dict[str, Any]]:
    """A request's input (checked by `chat_request`) as the items `GET /v1/responses/{id}/input_items` lists, in
    the shapes OpenAI's clients read: each with an id and a status; user, system and developer messages with
    input_text parts, assistant ones as output messages with output_text parts (a string input is one user
    message). Only the fields of each item's type are kept: what its prompt holds, and bounded ids."""
    raw = body.get("input")
    items = [{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str) else list(raw or [])
    return [_listed(item, f"item_{response_id.removeprefix(RESPONSE_ID_PREFIX)}_{i}") for i, item in
            enumerate(items)]


def _listed(item: Mapping[str, Any], default_id: str) -> dict[str, Any]:
    """One input item as listed, `default_id` its id unless it came with one."""
    kind = item.get("type", "message")
    entry = {"type": kind, "id": item.get("id") or default_id, "status": item.get("status") or "completed"}
    if kind == "function_call":
        return {**entry, "call_id": item.get("call_id"), "name": item.get("name"),
                "arguments": item.get("arguments", "")}
    if kind == "function_call_output":
        return {**entry, "call_id": item.get("call_id"), "output": _text_of(item.get("output", ""), "output")}
    part = "output_text" if item.get("role") == "assistant" else "input_text"
    content = item.get("content", "")
    parts = [{"type": part, "text": content}] if isinstance(content, str) else content
    annotations = {"annotations": []} if part == "output_text" else {}
    return {**entry, "role": item.get("role"),
            "content": [{"type": c["type"], "text": str(c.get("text", "")), **annotations} for c in parts]}


def turn_messages(body: Mapping[str, Any], completion: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The messages a turn adds to its conversation, which a continuation reads after the earlier turns': its input
    and its answer, in the order its prompt had them, without its instructions (OpenAI does not carry instructions
    over). The earlier turns' messages, then these, are exactly the turn's prompt less its instructions, plus the
    answer: what its continuation's prompt starts with."""
    answer = completion["choices"][0]["message"]
    return [*input_messages(body["input"]),
            {key: answer[key] for key in ("role", "content", "tool_calls") if answer.get(key) is not None}]
