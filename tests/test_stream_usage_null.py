"""A stream's `usage` key as OpenAI's API sends it: with `stream_options.include_usage`, every chunk carries it, null
until the last, which has the counts (typed clients in other languages declare the field and may refuse a chunk
without it); without, no chunk has the key. From the engine directly and through the router, which asks every
engine for the usage itself (its request log) and must neither hide the nulls from a client that asked nor show
them to one that did not: also where it writes chunks of its own or stitches pods' streams (a prefill hop's
first token, a one-token answer, a stream moved to another pod)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvmesh.engine.engine import Engine

from .engines import serve_checked
from .test_router_broken_reply import (
    LONG_PROMPT,
    SSE_HEAD,
    json_reply,
    prefill_answer,
    routed,
    sse,
    stub_pod,
    text_chunk,
)

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MAX_TOKENS = 4
# the client's stream_options: include_usage true, false, or none at all
ASKED = {"asked": {"include_usage": True}, "declined": {"include_usage": False}, "unset": None}


@pytest.fixture(scope="module")
def urls(tiny_engine: Engine, tiny_dir: Path) -> Iterator[dict[str, str]]:
    """The tiny engine's URL and a router's in front of it."""
    with serve_checked(tiny_engine) as engine, routed(tiny_dir, [engine]) as (router, _):
        yield {"engine": engine, "router": router}


def request(kind: str, options: dict[str, bool] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "Tell me a story"}]
    else:
        body["prompt"] = "Once upon a time"
    if options is not None:
        body["stream_options"] = options
    return body


def streamed(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's chunks as the client reads them, after checking it ends with [DONE]."""
    with httpx.stream("POST", url + path, json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def assert_usage_keys(chunks: list[dict[str, Any]], asked: bool, completion_tokens: int) -> None:
    """Asked: the key on every chunk, null but on the last (no choices, the counts); else on none."""
    if not asked:
        assert [c for c in chunks if "usage" in c] == []
        return
    *before, last = chunks
    assert before and [c for c in before if "usage" not in c or c["usage"] is not None] == []
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == completion_tokens


@pytest.mark.parametrize("options", ASKED.values(), ids=ASKED.keys())
@pytest.mark.parametrize("kind", PATHS)
@pytest.mark.parametrize("target", ["engine", "router"])
def test_every_chunk_carries_usage_exactly_when_asked(urls: dict[str, str], target: str, kind: str,
                                                      options: dict[str, bool] | None) -> None:
    chunks = streamed(urls[target], PATHS[kind], request(kind, options))
    assert_usage_keys(chunks, options == ASKED["asked"], MAX_TOKENS)


@pytest.mark.parametrize("asked", [True, False])
@pytest.mark.parametrize("target", ["engine", "router"])
def test_the_openai_client_reads_the_usage_key_as_sent(urls: dict[str, str], target: str, asked: bool) -> None:
    """The field set on each parsed chunk (the openai client reads a missing key and a null alike, stricter
    clients do not)."""
    client = openai.OpenAI(base_url=urls[target] + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    options = {"stream_options": {"include_usage": True}} if asked else {}
    chats = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, extra_body={"ignore_eos": True}, **options))  # type: ignore[call-overload]
    texts = list(client.completions.create(model=model, prompt="Hi", max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}, **options))
    for chunks in (chats, texts):
        assert_usage_keys([c.model_dump(exclude_unset=True) for c in chunks], asked, MAX_TOKENS)


def engine_chunk(chunk: dict[str, Any], body: dict[str, Any], nulls: bool) -> dict[str, Any]:
    """A chunk as an engine writes it for `body`: with nulls, `"usage": null` when the stream asked for the usage
    (the router always asks); without, none (an engine of another make, or before it sent them)."""
    if nulls and (body.get("stream_options") or {}).get("include_usage"):
        return {**chunk, "usage": None}
    return chunk


def usage_chunk(completion_tokens: int) -> dict[str, Any]:
    return {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub", "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens,
                      "total_tokens": 3 + completion_tokens, "prompt_tokens_details": {"cached_tokens": 0}}}


NULLS = {"engine-nulls": True, "no-nulls": False}


@pytest.mark.parametrize("nulls", NULLS.values(), ids=NULLS.keys())
@pytest.mark.parametrize("asked", [True, False])
def test_a_stream_moved_to_another_pod_keeps_the_usage_keys(tiny_dir: Path, asked: bool, nulls: bool) -> None:
    """The first pod sends a token and breaks off; the other goes on: the client's stream is one stream."""
    first_served: list[bool] = []

    async def first_breaks_then_other_finishes(body: dict, writer: asyncio.StreamWriter) -> bool:
        if not first_served:
            first_served.append(True)
            first = text_chunk(0, " a")
            first["choices"][0]["token_ids"] = [7]
            writer.write(SSE_HEAD + sse(engine_chunk(first, body, nulls)))
            await writer.drain()
            return False  # closed mid-stream
        last = text_chunk(0, " b", "length")
        last["choices"][0]["token_ids"] = [8]
        writer.write(SSE_HEAD + sse(engine_chunk(last, body, nulls)) + sse(usage_chunk(1)) + sse("[DONE]")
                     + b"0\r\n\r\n")
        await writer.drain()
        return True

    with (stub_pod(tiny_dir, answer=first_breaks_then_other_finishes) as a,
          stub_pod(tiny_dir, answer=first_breaks_then_other_finishes) as b,
          routed(tiny_dir, [a.url, b.url]) as (url, _)):
        body = {"prompt": "Hi", "max_tokens": 2, "stream": True,
                **({"stream_options": {"include_usage": True}} if asked else {})}
        chunks = streamed(url, PATHS["completions"], body)
    assert [c["choices"][0]["text"] for c in chunks if c["choices"]] == [" a", " b"]
    assert_usage_keys(chunks, asked, 1)


@pytest.mark.parametrize("max_tokens", [1, 3], ids=["prefill-answers-whole", "decode-goes-on"])
@pytest.mark.parametrize("nulls", NULLS.values(), ids=NULLS.keys())
@pytest.mark.parametrize("asked", [True, False])
def test_a_disaggregated_stream_keeps_the_usage_keys(tiny_dir: Path, asked: bool, nulls: bool,
                                                     max_tokens: int) -> None:
    """The router writes the prefill pod's token as the first chunk (or, for one token, the whole stream) and
    relays the decode pod's rest."""
    async def hands_off(body: dict, writer: asyncio.StreamWriter) -> bool:
        writer.write(json_reply(prefill_answer(body)))
        await writer.drain()
        return True

    async def decodes(body: dict, writer: asyncio.StreamWriter) -> bool:
        last = text_chunk(0, " z", "length")
        writer.write(SSE_HEAD + sse(engine_chunk(text_chunk(0, " y"), body, nulls))
                     + sse(engine_chunk(last, body, nulls)) + sse(usage_chunk(max_tokens)) + sse("[DONE]")
                     + b"0\r\n\r\n")
        await writer.drain()
        return True

    with (stub_pod(tiny_dir, answer=hands_off, role="prefill") as prefill,
          stub_pod(tiny_dir, answer=decodes, role="decode") as decode,
          routed(tiny_dir, [prefill.url, decode.url], prefill_hop_min_tokens=32) as (url, _)):
        body = {"prompt": LONG_PROMPT, "max_tokens": max_tokens, "stream": True,
                **({"stream_options": {"include_usage": True}} if asked else {})}
        chunks = streamed(url, PATHS["completions"], body)
        assert prefill.bodies and len(decode.bodies) == (max_tokens > 1)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts == ([" x"] if max_tokens == 1 else [" x", " y", " z"])
    assert_usage_keys(chunks, asked, max_tokens)
