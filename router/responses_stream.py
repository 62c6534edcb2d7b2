"""A chat completion stream as the Responses API's semantic events (pure: chunks in, events out).

The router asks its pod for a chat stream with usage and turns each chunk into the events the Responses API
clients read: the response created, its message item and text part opened, the text deltas as they come, then
everything closed and the whole response last. The engine streams each tool call whole once it is parsed, so each is
one function_call item with one arguments delta, emitted when the stream ends.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.router.responses import message_id, response_object, response_shell


def sse(event: Mapping[str, Any]) -> str:
    """One event as a server-sent event, named by its type as OpenAI's stream names them."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


@dataclass
class ResponseEvents:
    """One response stream's state: what the client has been told, and the chat answer gathered so far."""

    response_id: str
    body: Mapping[str, Any]
    created_at: int
    sequence: int = 0
    text: str = ""
    message_open: bool = False
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # by the chat stream's call index
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    result: dict[str, Any] | None = None  # the final response object, once the stream ended well

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> Iterator[dict[str, Any]]:
        for kind in ("response.created", "response.in_progress"):
            yield self._event(kind, response=response_shell(self.response_id, self.body, self.created_at))

    def _text_part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def _message(self, status: str) -> dict[str, Any]:
        content = [self._text_part()] if status != "in_progress" else []
        return {"type": "message", "id": message_id(self.response_id), "role": "assistant", "status": status,
                "content": content}

    def on_chunk(self, chunk: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of one chat chunk (text deltas; tool calls and usage are only gathered)."""
        self.model = chunk.get("model") or self.model
        if chunk.get("usage"):
            self.usage = dict(chunk["usage"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            for call in delta.get("tool_calls") or []:
                held = self.tool_calls.setdefault(call.get("index", len(self.tool_calls)),
                                                  {"id": None, "name": "", "arguments": ""})
                held["id"] = call.get("id") or held["id"]
                function = call.get("function") or {}
                held["name"] += function.get("name") or ""
                held["arguments"] += function.get("arguments") or ""
            if delta.get("content"):
                if not self.message_open:
                    self.message_open = True
                    yield self._event("response.output_item.added", output_index=0, item=self._message("in_progress"))
                    yield self._event("response.content_part.added", item_id=message_id(self.response_id),
                                      output_index=0, content_index=0, part=self._text_part())
                self.text += delta["content"]
                yield self._event("response.output_text.delta", item_id=message_id(self.response_id),
                                  output_index=0, content_index=0, delta=delta["content"], logprobs=[])
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def completion(self) -> dict[str, Any]:
        """The chat completion the stream added up to (what a stored response's continuation starts from)."""
        calls = [{"id": call["id"] or f"call_{self.response_id}_{index}", "type": "function",
                  "function": {"name": call["name"], "arguments": call["arguments"]}}
                 for index, call in sorted(self.tool_calls.items())]
        message: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if calls:
            message["tool_calls"] = calls
        return {"model": self.model, "usage": self.usage,
                "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}]}

    def finish(self) -> Iterator[dict[str, Any]]:
        """The closing events: the text and each tool call done, then the whole response."""
        response = response_object(self.response_id, self.body, self.completion(), self.created_at)
        index = 0
        if self.message_open:
            item_id, status = message_id(self.response_id), response["output"][0]["status"]
            yield self._event("response.output_text.done", item_id=item_id, output_index=0, content_index=0,
                              text=self.text, logprobs=[])
            yield self._event("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                              part=self._text_part())
            yield self._event("response.output_item.done", output_index=0, item=self._message(status))
            index = 1
        for item in response["output"][index:]:
            yield self._event("response.output_item.added", output_index=index,
                              item={**item, "arguments": "", "status": "in_progress"})
            yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=item["arguments"])
            yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"])
            yield self._event("response.output_item.done", output_index=index, item=item)
            index += 1
        self.result = response
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=response)

    def fail(self, error: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """The stream's end when the pool could not finish the answer (`error`: OpenAI's error object)."""
        response = response_shell(self.response_id, self.body, self.created_at, "failed")
        response["error"] = {"code": "server_error", "message": str(error.get("message") or "the answer failed")}
        yield self._event("response.failed", response=response)
