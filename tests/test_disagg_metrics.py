"""A disaggregated pool's engine metrics add up to what its clients saw (docs/metrics.md, "One request, several
pods"): a prefill and a decode engine process over the tiny model behind the router, requests sent through the
handoff and whole, then both pods' counters summed against the answers' usage."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.protocol import Metric, VllmMetric
from kvmesh.router.app import build_router
from kvmesh.router.config import RouterConfig

from .engines import serve_router, tiny_engines

pytestmark = pytest.mark.slow

HOP_MIN_TOKENS = 32  # prompts of at least this many uncached tokens go through the prefill pod


@pytest.fixture(scope="module")
def pool(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The URLs of the prefill pod, the decode pod and the router."""
    with tiny_engines(tiny_dir, tmp_path_factory.mktemp("disagg-metrics"), ("prefill", "decode")) as procs:
        prefill, decode = procs
        router = build_router(RouterConfig(pods=list(procs), scrape_interval_seconds=0.1,
                                           prefill_hop_min_tokens=HOP_MIN_TOKENS), tiny_dir)
        with serve_router(router) as url:
            for _ in range(100):  # the router knows both roles
                if len(httpx.get(url + "/health").json()["pods"]) == 2:
                    break
                threading.Event().wait(0.1)
            yield {"prefill": prefill, "decode": decode, "router": url}


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 48000 + 200 for i in range(n)]


def scrape(url: str) -> dict[str, float]:
    """A pod's samples by name, summed over their labels (buckets left out)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if not s.name.endswith("_bucket"):
                values[s.name] = values.get(s.name, 0.0) + s.value
    return values


def send(router: str, body: dict, stream: bool) -> tuple[str, dict]:
    """One request through the router: the pods that served it and the usage its client read."""
    if not stream:
        reply = httpx.post(router + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.headers["x-kvmesh-pod"], reply.json()["usage"]
    with httpx.stream("POST", router + "/v1/completions", timeout=60,
                      json=body | {"stream": True, "stream_options": {"include_usage": True}}) as reply:
        assert reply.status_code == 200
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    return reply.headers["x-kvmesh-pod"], chunks[-1]["usage"]


def test_the_pool_s_counters_add_up_to_the_answers(pool: dict[str, str]) -> None:
    """Handed-off requests (streamed or not), a repeated prompt and short prompts served whole: summed over both
    pods, the requests started and ended, the prompt tokens looked up, the prefix-cache hits and the generated
    tokens are what the clients were answered, each once; the decode pod counts the prompts it continued apart.
    Before: a handed-off request's TTFT and end-to-end time were observed on both pods and its pulled blocks
    counted as the decode pod's prefix-cache hits, though its client was answered the prefill pod's cached_tokens."""
    pods = (pool["prefill"], pool["decode"])
    before = {url: scrape(url) for url in pods}
    bodies = [({"prompt": tokens(seed, 90), "max_tokens": 6, "temperature": 0}, seed == 4) for seed in range(1, 5)]
    bodies.append(({"prompt": tokens(1, 90), "max_tokens": 4, "temperature": 0}, False))  # mostly cached now
    bodies += [({"prompt": tokens(seed, 8), "max_tokens": 3, "temperature": 0}, False) for seed in (7, 8)]
    answers = [send(pool["router"], body, stream) for body, stream in bodies]
    handed_off = [usage for served, usage in answers if served == f"{pool['prefill']},{pool['decode']}"]
    assert len(handed_off) == 4, [served for served, _ in answers]
    grew = {url: {name: value - before[url].get(name, 0.0) for name, value in scrape(url).items()} for url in pods}

    def pool_sum(name: str) -> float:
        return sum(grew[url].get(name, 0.0) for url in pods)

    usages = [usage for _, usage in answers]
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0  # the repeated prompt found its blocks
    assert pool_sum(f"{VllmMetric.TTFT}_count") == len(answers)
    assert pool_sum(f"{VllmMetric.E2E}_count") == len(answers)
    assert pool_sum(f"{VllmMetric.REQUEST_GENERATION_TOKENS}_count") == len(answers)
    assert pool_sum(f"{VllmMetric.PREFIX_QUERIES}_total") == prompt == pool_sum(f"{Metric.PREFIX_QUERY_TOKENS}_total")
    assert pool_sum(f"{VllmMetric.PREFIX_HITS}_total") == cached == pool_sum(f"{Metric.PREFIX_HIT_TOKENS}_total")
    assert pool_sum(f"{VllmMetric.GENERATION_TOKENS}_total") == sum(u["completion_tokens"] for u in usages)
    # the prompts admitted per pod (what each holds), less those a pod continued, are the prompts sent, once
    continued = grew[pool["decode"]][f"{Metric.CONTINUED_PROMPT_TOKENS}_total"]
    assert continued == sum(u["prompt_tokens"] for u in handed_off)
    assert pool_sum(f"{VllmMetric.PROMPT_TOKENS}_total") - continued == prompt
    # the decode pod pulled every full block of each handed-off prompt (90 tokens: 5 blocks of 16)
    assert grew[pool["decode"]][f"{Metric.CONTINUED_CACHED_TOKENS}_total"] == 80 * len(handed_off)
    assert grew[pool["prefill"]][f"{Metric.CONTINUED_PROMPT_TOKENS}_total"] == 0
    # a pod's own first tokens only: the prefill pod's for the handed-off requests, the decode pod's for the rest
    assert grew[pool["prefill"]][f"{VllmMetric.TTFT}_count"] == len(handed_off)
    assert grew[pool["decode"]][f"{VllmMetric.E2E}_count"] == len(answers)
