"""Tools in a chat prompt. A template that reads `tools` gets them as HF's apply_chat_template passes them; for
one that does not (SmolLM2's), the widely used Hermes format: the function signatures in the system message, an
assistant's calls as <tool_call> text, a tool's result as a user message in <tool_response> tags.

Torch-free and applied by the tokenizer (`Tokenizer.encode_chat`), so the router tokenizes, and hashes, the very
prompt the engine computes. engine/tools.py parses the calls a model writes back.
"""

from __future__ import annotations

import json
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

HERMES_SYSTEM = (
    "You can call functions to answer. The functions you may call are described as JSON Schema inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, write one JSON object per call, with its name and arguments, inside "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n"
    "</tool_call>"
)


def arguments_value(arguments: Any) -> Any:
    """Arguments as an object when they are JSON text (templates render them with tojson), else as given (free
    text, or JSON nested deeper than Python's recursion limit lets it be read)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return arguments
    return arguments


def _calls_text(calls: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                       "arguments": arguments_value(c["function"].get("arguments"))})
        + f"\n{CALL_CLOSE}" for c in calls)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content or ""


def prompt_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template_uses_tools: bool) -> list[dict[str, Any]]:
    """The messages to render. A template that reads `tools` gets them as they are (tool_calls' arguments as
    objects, as HF templates expect); for one that does not, the Hermes fallback: the function signatures in
    the system message, an assistant's calls as <tool_call> text, a tool's result as a user message in
    <tool_response> tags."""
    if template_uses_tools:
        return [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                        "arguments": arguments_value(c["function"].get("arguments"))}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            text = _text(m.get("content"))
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + _calls_text(m["tool_calls"])})
        else:
            out.append(m)
    if tools:
        listing = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": _text(out[0].get("content")) + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out
