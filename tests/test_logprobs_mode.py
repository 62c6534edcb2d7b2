"""The engine's logprobs_mode (vLLM's): raw_* report the model's distribution, processed_* the one sampled from;
*_logprobs log-probabilities, *_logits logits. Checked against references computed here with torch alone: on
random logits through the sampler, and through the HTTP API (completions and chat, streamed or not) against the
tiny model's logits from transformers."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvmesh.engine.config import LOGPROBS_MODES, EngineConfig
from kvmesh.engine.protocol import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, TOKENIZE_PATH
from kvmesh.engine.sampling import SamplingParams, sample, token_logprobs

from .conftest import make_engine
from .engines import serve_engine

FLOOR = -9999.0  # vLLM's OpenAI server's stand-in for -inf, which JSON cannot carry
VOCAB = 64


def reference_row(logits: torch.Tensor, p: SamplingParams, generated: list[int], output_index: int,
                  stop_ids: set[int], mode: str) -> torch.Tensor:
    """One row as `mode` reports it, computed step by step from the definitions: the bias, penalties, allowed ids and
    min_tokens, then (unless greedy by temperature) temperature, min_p, top_k and top_p."""
    x = logits.clone().double()
    if mode.startswith("processed"):
        for token, bias in p.logit_bias.items():
            x[token] += bias
        for token in set(generated):
            x[token] -= p.presence_penalty + p.frequency_penalty * generated.count(token)
        if p.allowed_token_ids:
            x[[t for t in range(len(x)) if t not in p.allowed_token_ids]] = -math.inf
        if output_index < p.min_tokens:
            x[sorted(stop_ids | set(p.stop_token_ids))] = -math.inf
        if p.temperature >= 1e-5:
            x = x / p.temperature
            probs = torch.softmax(x, -1)
            if p.min_p:
                x[probs < p.min_p * probs.max()] = -math.inf
            if p.top_k > 0:
                x[x < torch.sort(x, descending=True).values[p.top_k - 1]] = -math.inf
            if p.top_p < 1.0:
                probs = torch.softmax(x, -1)
                order = torch.argsort(probs, descending=True).tolist()
                mass = 0.0
                for token in order:
                    if mass >= p.top_p:
                        x[token] = -math.inf
                    mass += float(probs[token])
    return torch.log_softmax(x, -1) if mode.endswith("logprobs") else x


ROWS = [
    SamplingParams(temperature=0.0, logprobs=True, top_logprobs=6, logit_bias={3: 4.0}),
    SamplingParams(temperature=0.7, top_k=5, seed=1, logprobs=True, top_logprobs=6, presence_penalty=1.5,
                   frequency_penalty=0.5),
    SamplingParams(temperature=1.3, top_p=0.6, min_p=0.05, seed=2, logprobs=True, top_logprobs=6),
    SamplingParams(temperature=0.9, seed=3, logprobs=True, top_logprobs=6, allowed_token_ids=[1, 5, 9, 20],
                   min_tokens=2, stop_token_ids=[5]),
    SamplingParams(temperature=1.1, top_k=1, logprobs=True, top_logprobs=6),
]
GENERATED = [[], [7, 7, 2], [4], [], [8]]


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_the_sampler_reports_what_each_mode_names(mode: str) -> None:
    logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(7)) * 3
    result = sample(logits, ROWS, [0, 3, 1, 0, 1], frozenset({2}), GENERATED, logprobs_mode=mode)
    assert result.logprobs is not None and result.top_logprobs is not None
    for row, p in enumerate(ROWS):
        expected = reference_row(logits[row], p, GENERATED[row], [0, 3, 1, 0, 1][row], {2}, mode).clamp(min=FLOOR)
        token = result.token_ids[row]
        assert result.logprobs[row] == pytest.approx(float(expected[token]), abs=1e-4)
        values = [v for _, v in result.top_logprobs[row]]
        assert values == pytest.approx(torch.sort(expected, descending=True).values[:6].tolist(), abs=1e-4)
        for tid, value in result.top_logprobs[row]:
            assert value == pytest.approx(float(expected[tid]), abs=1e-4)
    if mode == "processed_logprobs":  # the sampled token is always one the filters kept
        assert all(v > FLOOR for v in result.logprobs)
        assert result.top_logprobs[1][5][1] == FLOOR  # top_k 5: the sixth is filtered out


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_prompt_logprobs_are_the_models_logprobs_or_logits(mode: str) -> None:
    """A prompt passes no sampler, so raw and processed agree: log-probabilities, or the logits themselves."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    expected = logits if mode.endswith("logits") else torch.log_softmax(logits, -1)
    chosen, tops = token_logprobs(logits, [5, 6, 7, 8], 2, mode)
    assert chosen == pytest.approx(expected.gather(1, torch.tensor([[5], [6], [7], [8]])).squeeze(1).tolist())
    assert [v for row in tops for _, v in row] == pytest.approx(torch.topk(expected, 2).values.flatten().tolist())


def test_a_mode_that_does_not_exist_is_refused() -> None:
    with pytest.raises(ValueError, match="logprobs_mode must be one of raw_logprobs, raw_logits"):
        EngineConfig(logprobs_mode="processed").validate()


# ---- through the HTTP API, against transformers' logits of the tiny model -----------------------------------------

API_MODES = ["processed_logprobs", "processed_logits", "raw_logits"]  # raw_logprobs: the default, tested elsewhere
SAMPLING = {"temperature": 0.8, "top_k": 4, "seed": 11, "presence_penalty": 0.5, "logit_bias": {"17": 3.0},
            "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
TOP = 5


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=API_MODES)
def served(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[tuple[str, str]]:
    with serve_engine(make_engine(tiny_dir, kv_cache_blocks=64, logprobs_mode=request.param)) as url:
        yield url, request.param


def expected_steps(model: Any, prompt: list[int], output: list[int], mode: str) -> list[torch.Tensor]:
    """Each generated position as `mode` reports it, from transformers' logits of the tokens before it."""
    p = SamplingParams(**{k: v for k, v in SAMPLING.items() if k not in ("max_tokens", "return_token_ids")
                          } | {"logit_bias": {17: 3.0}})  # type: ignore[arg-type]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return [reference_row(logits[i], p, output[:i], i, set(), mode).clamp(min=FLOOR) for i in range(len(output))]


def _events(reply: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in reply.text.splitlines()
            if line.startswith("data: {")]


def completion_values(url: str, stream: bool) -> tuple[list[int], list[float], list[float]]:
    """The tokens, their reported values and each position's best alternative, from /v1/completions."""
    body = {"prompt": PROMPT, "logprobs": TOP, "stream": stream, **SAMPLING}
    reply = httpx.post(url + COMPLETIONS_PATH, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choices = [e["choices"][0] for e in _events(reply)] if stream else [reply.json()["choices"][0]]
    tokens = [t for c in choices for t in c.get("token_ids") or []]
    logprobs = [c["logprobs"] for c in choices if c.get("logprobs")]
    values = [v for lp in logprobs for v in lp["token_logprobs"]]
    best = [max(top.values()) for lp in logprobs for top in lp["top_logprobs"]]
    return tokens, values, best


def chat_values(url: str, stream: bool) -> tuple[list[int], list[float], list[list[float]]]:
    """The tokens, their reported values and each position's alternatives' values, from /v1/chat/completions."""
    body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": TOP, "stream": stream, **SAMPLING}
    reply = httpx.post(url + CHAT_COMPLETIONS_PATH, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choices = [e["choices"][0] for e in _events(reply)] if stream else [reply.json()["choices"][0]]
    tokens = [t for c in choices for t in c.get("token_ids") or []]
    content = [item for c in choices if c.get("logprobs") for item in c["logprobs"]["content"]]
    return tokens, [i["logprob"] for i in content], [[t["logprob"] for t in i["top_logprobs"]] for i in content]


PROMPT = [101, 2204, 9000, 311, 47, 1500, 808]
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_report_the_mode_s_values(served: tuple[str, str], model: Any, stream: bool) -> None:
    url, mode = served
    tokens, values, best = completion_values(url, stream)
    expected = expected_steps(model, PROMPT, tokens, mode)
    assert len(tokens) == SAMPLING["max_tokens"] == len(values) == len(best)
    assert values == pytest.approx([float(e[t]) for e, t in zip(expected, tokens, strict=True)], abs=2e-3)
    assert best == pytest.approx([float(e.max()) for e in expected], abs=2e-3)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reports_the_mode_s_values(served: tuple[str, str], model: Any, stream: bool) -> None:
    url, mode = served
    prompt = httpx.post(url + TOKENIZE_PATH, json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    tokens, values, tops = chat_values(url, stream)
    expected = expected_steps(model, prompt, tokens, mode)
    assert len(tokens) == SAMPLING["max_tokens"] == len(values) == len(tops)
    assert values == pytest.approx([float(e[t]) for e, t in zip(expected, tokens, strict=True)], abs=2e-3)
    for top, e in zip(tops, expected, strict=True):
        assert top == pytest.approx(torch.sort(e, descending=True).values[:TOP].tolist(), abs=2e-3)
    if mode.startswith("processed"):  # top_k 4: the fifth alternative was filtered out, reported as vLLM does
        assert all(top[TOP - 1] == FLOOR for top in tops)


def test_echoed_prompt_logprobs_follow_the_mode(served: tuple[str, str], model: Any) -> None:
    """echo's prompt positions pass no sampler: the model's log-probabilities, or its logits in a *_logits mode."""
    url, mode = served
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0.0}
    reply = httpx.post(url + COMPLETIONS_PATH, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    values = reply.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(PROMPT)]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, :-1].float()
    reported = logits if mode.endswith("logits") else torch.log_softmax(logits, -1)
    assert values == pytest.approx(reported.gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1).tolist(), abs=2e-3)
