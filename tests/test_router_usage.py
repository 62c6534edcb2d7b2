"""A pod's usage object as every reader in the router takes it (router/usage.py): a pod of another make may send
null counts, negative ones, details of the wrong shape or no object at all. Once only the request's end read it
safely; a Responses answer, a disaggregated merge, a batch line's count and the request's trace still raised after
the pod had answered (a 500 for a served request, a lost log row)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.engine.tracing import ROUTER_SERVICE, setup_tracing
from kvmesh.router.app import merge_usage
from kvmesh.router.batches import LineResult
from kvmesh.router.picker import RequestInfo
from kvmesh.router.responses import response_object
from kvmesh.router.tracing import request_span

ODD = [
    {"prompt_tokens": None, "completion_tokens": None, "total_tokens": None,
     "prompt_tokens_details": {"cached_tokens": None}},
    ["not", "an", "object"],
    {"prompt_tokens": -3, "completion_tokens": True, "prompt_tokens_details": [3]},
    None,
]
IDS = ["nulls", "a-list", "negative-bool-list-details", "none"]


def chat(usage: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "m", "usage": usage,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}


@pytest.mark.parametrize("usage", ODD, ids=IDS)
def test_every_reader_takes_usage_of_any_shape_as_zeros(usage: Any) -> None:
    answered = response_object("resp_1", {"input": "hi"}, chat(usage), 0)["usage"]
    assert (answered["input_tokens"], answered["output_tokens"]) == (0, 0)
    assert answered["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    assert merge_usage({"prompt_tokens": 7}, usage if isinstance(usage, dict) else {})["total_tokens"] == 7
    assert LineResult(1, "a", 200, chat(usage), "r").usage() == (0, 0, 0)
    spans = InMemorySpanExporter()
    span = request_span(setup_tracing(ROUTER_SERVICE, None, exporter=spans), {}, time.time_ns(), True,
                        RequestInfo("m", 3, (1, 2, 3)), "acme", "chat-short")
    assert span is not None
    span.end("ok", 200, "aggregated", ["pod-a"], usage)
    (ended,) = spans.get_finished_spans()
    assert ended.attributes is not None and ended.attributes.get("kvmesh.cached_tokens", 0) == 0


def test_whole_counts_are_read_as_they_are() -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16, "prompt_tokens_details":
             {"cached_tokens": 8}}
    answered = response_object("resp_1", {"input": "hi"}, chat(usage), 0)["usage"]
    assert (answered["input_tokens"], answered["output_tokens"], answered["total_tokens"]) == (12, 4, 16)
    assert answered["input_tokens_details"] == {"cached_tokens": 8, "cache_write_tokens": 4}
    assert LineResult(1, "a", 200, chat(usage), "r").usage() == (12, 8, 4)
    assert merge_usage({"prompt_tokens": 12}, {"completion_tokens": 4})["total_tokens"] == 16
