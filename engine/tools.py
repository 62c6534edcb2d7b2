"""OpenAI tool calling: the constraint a `tool_choice` implies, and the parsers that turn generated text into
`tool_calls` (whole, or streamed). The prompt (tools shown to the model) is engine/model/tool_prompt.py's, which
the tokenizer applies, so the router hashes the very prompt the engine computes.

Pure functions and small classes, no HTTP: engine/openai_types.py validates the request fields,
engine/server.py picks the constraint and renders the answers with what is here.
- named tool_choice: the output is constrained to that function's parameters (JSON schema): it IS the arguments;
- "required": the output is constrained to a JSON array of {"name", "arguments"} objects, one schema per tool;
- "auto": free text; Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks are parsed
  out of it afterwards (so it works only with models that write that format);
- "none": tools are shown in the prompt, the output is plain content.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvmesh.engine.constraint import Constraint
from kvmesh.engine.model.tool_prompt import CALL_OPEN, arguments_value

_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a function declared without parameters takes any object


@dataclass(frozen=True)
class ToolCall:
    """One call to a declared function; `arguments` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict[str, Any]:
        """The streamed chunk that opens this call (with all of its arguments)."""
        return {"index": index, **self.to_json()}


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's `function.parameters` schema, or any object when it declares none."""
    return tool["function"].get("parameters") or ANY_OBJECT


def named_constraint(tool: dict[str, Any]) -> Constraint:
    """tool_choice {"function": {"name"}}: the output is that function's arguments."""
    return Constraint("json_schema", parameters(tool), "tool_choice")


def required_constraint(tools: list[dict[str, Any]], parallel: bool) -> Constraint:
    """tool_choice "required": a JSON array of calls (exactly one unless `parallel`), each call's arguments
    following its own function's schema (anyOf, one branch per tool)."""
    branches = [{"type": "object",
                 "properties": {"name": {"const": t["function"]["name"]}, "arguments": parameters(t)},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": branches}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return Constraint("json_schema", schema, "tool_choice")


def tool_constraint(mode: str | None, tools: list[dict[str, Any]], name: str | None,
                    parallel: bool) -> Constraint | None:
    """The output constraint of a request's tool_choice (`mode` as ChatRequest.tool_mode): None for auto/none."""
    if mode == "required":
        return required_constraint(tools, parallel)
    if mode == "named":
        return named_constraint(next(t for t in tools if t["function"]["name"] == name))
    return None


# ---- parsing --------------------------------------------------------------------------------------------------


def _call(value: Any, names: set[str]) -> ToolCall | None:
    """A {"name", "arguments"} object naming a declared function, as a ToolCall; None otherwise: a model may write
    anything there (a name that is a list, arguments nested deeper than Python's recursion limit)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    arguments = arguments_value(value.get("arguments", {}))
    try:
        return ToolCall(value["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None
    except RecursionError:  # read back, but too deep to write again
        return None


def parse_hermes(text: str, names: set[str]) -> list[ToolCall]:
    """tool_choice "auto": the valid calls in `text`'s <tool_call> blocks (a last block may lack its closing tag:
    EOS came first). Blocks that are not JSON or name an undeclared function are dropped; the content beside the
    calls is the ToolStream's to cut (the text before the first block)."""
    calls = []
    for block in _CALL_BLOCK.findall(text):
        try:
            call = _call(json.loads(block), names)
        except (json.JSONDecodeError, RecursionError):
            call = None
        if call is not None:
            calls.append(call)
    return calls


_SIGNIFICANT = re.compile(r'[\[\]{}"\\]')  # the characters that change a JSON scanner's state


class ArrayScanner:
    """The top-level objects of a JSON array, each returned once its closing brace arrives (streamed text).
    Linear in the text however it is cut: it jumps from one structural character to the next and keeps only the
    open object's pieces, joined once when it closes (a long answer's arguments are never copied per piece)."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False  # the last piece ended inside a string with a backslash: the next character is escaped
        self._object: list[str] | None = None  # the open top-level object's text, piece by piece

    def feed(self, text: str) -> list[Any]:
        if not text:  # an empty piece changes nothing (and must not drop an escape carried to the next one)
            return []
        done = []
        start = 0 if self._object is not None else -1  # where the open object's text begins in `text`
        skip = 0 if self._escaped else -1  # the position of an escaped character, which changes nothing
        self._escaped = False
        for match in _SIGNIFICANT.finditer(text):
            i, ch = match.start(), match.group()
            if i == skip:
                continue
            if self._in_string:
                if ch == "\\":
                    skip = i + 1
                    self._escaped = skip == len(text)
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if ch == "{" and self._depth == 2:
                    start, self._object = i, []
            else:
                self._depth -= 1
                if ch == "}" and self._depth == 1 and self._object is not None:
                    self._object.append(text[start: i + 1])
                    with contextlib.suppress(json.JSONDecodeError, RecursionError):  # the constraint makes this rare
                        done.append(json.loads("".join(self._object)))
                    start, self._object = -1, None
        if self._object is not None:
            self._object.append(text[start:])
        return done


@dataclass
class ToolDelta:
    """What one streamed step adds to a choice: content text and tool_calls deltas (either may be empty)."""

    content: str
    tool_calls: list[dict[str, Any]]


def _longest_marker_prefix(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of <tool_call> (it may become one)."""
    for k in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-k:]):
            return k
    return 0


class ToolStream:
    """One choice's answer under a tool_choice (`mode`: "named" with the function's `name`, "required" or
    "auto"): feed each text delta, then finish once. The one parser of each mode: a whole answer is the same
    stream fed in one piece (tool_message). Named: the text is the arguments, streamed as they come; required:
    each call is sent whole once its object closes; auto: content streams until text could start <tool_call>,
    is held from there, and at the end is either calls or flushed as content. Linear in the answer: the text is
    kept as pieces, joined once at the end, and auto searches only the held tail for the marker. Without
    `parallel` (parallel_tool_calls: false) auto keeps the first call the model wrote; required's constraint
    already allows one."""

    def __init__(self, mode: str, names: set[str], name: str | None = None, parallel: bool = True) -> None:
        assert mode in ("named", "required", "auto") and (mode == "named") == (name is not None), (mode, name)
        self.mode = mode
        self.parallel = parallel
        self.names = names
        self.name = name or ""
        self.calls = 0  # tool calls sent so far
        self._pieces: list[str] = []  # the text so far
        self._sent = 0  # auto: characters of text sent as content
        self._held = ""  # auto, until the marker: the text after the sent part (a suffix that may open a call)
        self._marker = -1  # auto: where the first <tool_call> starts, once seen
        self._named: ToolCall | None = None
        self._scanner = ArrayScanner()

    def feed(self, text: str) -> ToolDelta:
        self._pieces.append(text)
        if self.mode == "required":
            calls = [c for o in self._scanner.feed(text) if (c := _call(o, self.names)) is not None]
            deltas = [c.delta(self.calls + i) for i, c in enumerate(calls)]
            self.calls += len(calls)
            return ToolDelta("", deltas)
        if self.mode == "auto":
            return ToolDelta(self._auto_content(text), [])
        if self._named is None:  # named: the first delta opens the call, later ones extend its arguments
            self._named = ToolCall(self.name, "")
            self.calls = 1
            return ToolDelta("", [{**self._named.delta(0), "function": {"name": self.name, "arguments": text}}])
        return ToolDelta("", [{"index": 0, "function": {"arguments": text}}] if text else [])

    def _auto_content(self, text: str) -> str:
        """The content `text` lets through: what comes before <tool_call>, or before a suffix that may become it."""
        if self._marker >= 0:
            return ""
        unsent = self._held + text
        at = unsent.find(CALL_OPEN)
        if at >= 0:
            self._marker = self._sent + at
        hold = at if at >= 0 else len(unsent) - _longest_marker_prefix(unsent)
        self._sent += hold
        self._held = unsent[hold:]
        return unsent[:hold]

    def finish(self, finish_reason: str | None) -> tuple[ToolDelta, str | None]:
        """The last delta (auto: held-back content, or the calls) and the choice's finish_reason: "tool_calls"
        when it ended with calls, unless max_tokens cut it ("length")."""
        delta = ToolDelta("", [])
        text = "".join(self._pieces)
        if self.mode == "auto":
            calls = parse_hermes(text, self.names)
            if not self.parallel:
                calls = calls[:1]
            end = self._marker if calls else len(text)
            delta = ToolDelta(text[self._sent: end] if end > self._sent else "",
                              [c.delta(i) for i, c in enumerate(calls)])
            self._sent, self.calls = len(text), len(calls)
        elif self.mode == "required" and not self.calls:  # cut before any call closed: the text, as unstreamed
            delta = ToolDelta(text, [])
        elif self.mode == "named" and self._named is None:  # nothing generated yet
            self._named = ToolCall(self.name, "")
            self.calls = 1
            delta = ToolDelta("", [self._named.delta(0)])
        return delta, ("tool_calls" if self.calls and finish_reason == "stop" else finish_reason)


def merge_tool_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool_calls deltas put together as a client does: the first of an index opens that call (id, type,
    name), later ones extend its arguments. The calls in index order, as a whole message lists them."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        index = delta["index"]
        if index in calls:
            calls[index]["function"]["arguments"] += delta["function"]["arguments"]
        else:
            calls[index] = {k: v for k, v in delta.items() if k != "index"} | {"function": dict(delta["function"])}
    return [calls[i] for i in sorted(calls)]


def tool_message(mode: str, text: str, names: set[str], finish_reason: str | None,
                 name: str | None = None, parallel: bool = True) -> tuple[dict[str, Any], str | None]:
    """A whole (non-streamed) answer's message and finish_reason under a tool_choice: the text fed to a ToolStream
    in one piece, its deltas merged. Content beside calls (auto's text before the first block) is trimmed, and
    None when nothing is left, as OpenAI sends a message with calls and no text."""
    stream = ToolStream(mode, names, name, parallel)
    first = stream.feed(text)
    last, reason = stream.finish(finish_reason)
    content = first.content + last.content
    calls = merge_tool_deltas(first.tool_calls + last.tool_calls)
    message: dict[str, Any] = {"role": "assistant", "content": (content.strip() or None) if calls else content}
    if calls:
        message["tool_calls"] = calls
    return message, reason
