"""vLLM's request fields beyond OpenAI's, sent to an engine and to a router in front of it (one in-process tiny
engine for the module, greedy): those honoured change the answer as vLLM's do, streamed or not; those not honoured
are a 400 naming the field, never accepted and ignored (review 209)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh.engine.openai_types import REFUSED_CHAT_FIELDS, REFUSED_FIELDS, CompletionRequest
from kvmesh.router.app import build_router
from kvmesh.router.config import RouterConfig

from .test_openai_params import CHAT, COMPLETIONS, HI, pool

__all__ = ["pool"]  # the fixture: one engine and a router in front of it
pytestmark = pytest.mark.slow

# the tiny model's greedy answer to PROMPT begins " Earth", "statistics", " magnitude" (ids 2591, 33848, 10684)
PROMPT = "hello world"
GREEDY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
IM_START = 1  # a special token of the bundled tokenizer, "<|im_start|>"


def complete(url: str, body: dict[str, Any], stream: bool) -> tuple[str, list[int], dict[str, Any]]:
    """A completion's text, token ids and usage; streamed, the deltas joined (a delta only ever adds text)."""
    body = {**body, "return_token_ids": True}
    if not stream:
        reply = httpx.post(url + COMPLETIONS, json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        return answer["choices"][0]["text"], answer["choices"][0]["token_ids"], answer["usage"]
    text, ids, usage = "", [], {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                text += choice["text"]
                ids += choice.get("token_ids") or []
            usage = chunk.get("usage") or usage
    return text, ids, usage


def refusal(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    reply = httpx.post(url + path, json=body, timeout=30)
    return reply.status_code, reply.json().get("error") or {}


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_token(pool: dict[str, str],
                                                                              stream: bool) -> None:
    """vLLM's answer ends after the stop string ("statistics mag" spans two tokens) or with the stop token's text;
    without the flag both are cut."""
    for url in pool.values():
        stop = {**GREEDY, "stop": "statistics mag"}
        assert complete(url, stop, stream)[0] == " Earth"
        assert complete(url, {**stop, "include_stop_str_in_output": True}, stream)[0] == " Earthstatistics mag"
        by_token = {**GREEDY, "stop_token_ids": [33848]}
        assert complete(url, by_token, stream)[0] == " Earth"
        assert complete(url, {**by_token, "include_stop_str_in_output": True}, stream)[0] == " Earthstatistics"


@pytest.mark.parametrize("stream", [False, True])
def test_allowed_token_ids_are_the_only_tokens_sampled(pool: dict[str, str], stream: bool) -> None:
    """Greedy or sampled, and whatever logit_bias favours outside the set."""
    allowed = [504, 2365]
    for url in pool.values():
        for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}, {"logit_bias": {"2591": 100}}):
            _, ids, _ = complete(url, {**GREEDY, **extra, "allowed_token_ids": allowed}, stream)
            assert len(ids) == 8 and set(ids) <= set(allowed), (url, extra, ids)


@pytest.mark.parametrize(("path", "body", "says"), [
    (COMPLETIONS, {**GREEDY, "allowed_token_ids": [99_999_999]}, "outside the vocabulary"),
    (COMPLETIONS, {**GREEDY, "allowed_token_ids": []}, "at least 1"),
    # only a stop token, which min_tokens forbids: nothing could be sampled
    (COMPLETIONS, {**GREEDY, "allowed_token_ids": [504], "stop_token_ids": [504], "min_tokens": 2}, "min_tokens"),
    (COMPLETIONS, {**GREEDY, "allowed_token_ids": [504], "response_format": {"type": "json_object"}},
     "response_format"),
    (CHAT, {"messages": HI, "allowed_token_ids": [504], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "tool_choice"),
])
def test_allowed_token_ids_that_cannot_be_honoured_are_refused(pool: dict[str, str], path: str,
                                                              body: dict[str, Any], says: str) -> None:
    for url in pool.values():
        status, error = refusal(url, path, body)
        assert (status, error.get("param")) == (400, "allowed_token_ids"), (url, error)
        assert says in error["message"], (url, error)


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_writes_special_tokens_text(pool: dict[str, str], stream: bool) -> None:
    for url in pool.values():
        favoured = {**GREEDY, "max_tokens": 2, "logit_bias": {str(IM_START): 100}}
        text, ids, _ = complete(url, favoured, stream)
        assert (text, ids) == ("", [IM_START, IM_START])
        assert complete(url, {**favoured, "skip_special_tokens": False}, stream)[0] == "<|im_start|><|im_start|>"


@pytest.mark.parametrize("stream", [False, True])
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(pool: dict[str, str], stream: bool) -> None:
    """As vLLM: the answer and the usage are those of the prompt's last N tokens."""
    prompt = [28120, 905, 29856, 2753]  # "hello world foo bar"
    for url in pool.values():
        tail_text, tail_ids, _ = complete(url, {**GREEDY, "prompt": prompt[-2:]}, stream)
        text, ids, usage = complete(url, {**GREEDY, "prompt": prompt, "truncate_prompt_tokens": 2}, stream)
        assert (text, ids, usage["prompt_tokens"]) == (tail_text, tail_ids, 2)
        text, _, usage = complete(url, {**GREEDY, "prompt": "hello world foo bar", "truncate_prompt_tokens": 2},
                                  stream)
        assert (text, usage["prompt_tokens"]) == (tail_text, 2)


def test_truncate_prompt_tokens_of_0_is_refused(pool: dict[str, str]) -> None:
    for url in pool.values():
        status, error = refusal(url, COMPLETIONS, {**GREEDY, "truncate_prompt_tokens": 0})
        assert (status, error.get("param")) == (400, "truncate_prompt_tokens"), (url, error)


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(pool: dict[str, str]) -> None:
    """The chat template's assistant opening is not in the prompt: its tokens are those /tokenize counts so."""
    for url in pool.values():
        for opened in (True, False):
            reply = httpx.post(url + CHAT, json={"messages": HI, "max_tokens": 1, "add_generation_prompt": opened},
                               timeout=30)
            assert reply.status_code == 200, reply.text
            counted = httpx.post(url + "/tokenize", json={"messages": HI, "add_generation_prompt": opened},
                                 timeout=30).json()["count"]
            assert reply.json()["usage"]["prompt_tokens"] == counted, (url, opened)


# a value other than the neutral one for each field refused: every one in the lists must be here
UNSUPPORTED = {"bad_words": ["acies"], "prompt_logprobs": 1, "use_beam_search": True, "length_penalty": 0.5,
               "logits_processors": ["mine"], "vllm_xargs": {"a": 1}, "return_tokens_as_token_ids": True,
               "prompt_embeds": "AAAA", "echo": True, "continue_final_message": True,
               "documents": [{"text": "x"}], "chat_template": "{{ messages }}", "add_special_tokens": True}


@pytest.mark.parametrize(("path", "name"), [(p, n) for p in (CHAT, COMPLETIONS) for n in REFUSED_FIELDS]
                         + [(CHAT, n) for n in REFUSED_CHAT_FIELDS])
def test_a_field_not_honoured_is_refused_naming_it(pool: dict[str, str], path: str, name: str) -> None:
    body: dict[str, Any] = {"messages": HI} if path == CHAT else {"prompt": PROMPT}
    for url in pool.values():
        status, error = refusal(url, path, {**body, "max_tokens": 1, name: UNSUPPORTED[name]})
        assert (status, error.get("param")) == (400, name), (url, error)
        assert error["message"].startswith(f"{name}: ") and "not supported" in error["message"], (url, error)
        neutral = REFUSED_FIELDS.get(name, REFUSED_CHAT_FIELDS.get(name))[0]
        assert httpx.post(url + path, json={**body, "max_tokens": 1, name: neutral}, timeout=30).status_code == 200


def test_the_router_hashes_the_prompt_the_engine_computes(tiny_dir: Path) -> None:
    """Prefix-aware routing matches the engines' blocks only if the router hashes what they compute: the prompt's
    last `truncate_prompt_tokens`, and a text without the tokenizer's special tokens when asked (it hashed the
    whole prompt as tokenized by default, so such requests never matched a pod's cache)."""
    router = build_router(RouterConfig(pods=[]), tiny_dir)
    ids = list(range(300, 340))
    whole = router.request_info(CompletionRequest(prompt=ids), 0)
    kept = router.request_info(CompletionRequest(prompt=ids, truncate_prompt_tokens=20), 0)
    assert (whole.prompt_tokens, kept.prompt_tokens) == (40, 20)
    assert kept.block_hashes == router.request_info(CompletionRequest(prompt=ids[-20:]), 0).block_hashes
    text = "hello world " * 8
    plain = router.request_info(CompletionRequest(prompt=text, add_special_tokens=False), 0)
    assert plain.prompt_tokens == len(router.tokenizer.encode(text, add_special_tokens=False))
