"""A disaggregated pool in the middle of a rolling change of kvCacheDtype: an int8 prefill pod, and one decode pod
of each format (in-process tiny engines). The router hands the prefill's KV only to the decode pod that can
read it, so every handoff succeeds instead of failing its transfer and recomputing the prompt."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from kvmesh.engine.protocol import Metric
from kvmesh.router.app import Router, build_router
from kvmesh.router.config import RouterConfig

from .conftest import make_engine
from .engines import serve_engine, serve_router
from .test_kv_transfer import metric

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[tuple[dict[str, str], Router]]:
    with ExitStack() as stack:
        urls = {name: stack.enter_context(serve_engine(make_engine(tiny_dir, role=role, kv_cache_dtype=fmt)))
                for name, role, fmt in (("prefill", "prefill", "int8"), ("decode-int8", "decode", "int8"),
                                        ("decode-auto", "decode", "auto"))}
        router = build_router(RouterConfig(pods=list(urls.values()), scrape_interval_seconds=0.1,
                                           prefill_hop_min_tokens=32), tiny_dir)
        url = stack.enter_context(serve_router(router))
        for _ in range(100):  # the router has read all three pods' configs
            if len(httpx.get(url + "/health").json()["pods"]) == 3:
                break
            threading.Event().wait(0.1)
        yield {**urls, "router": url}, router


@pytest.fixture(scope="module")
def pool(served: tuple[dict[str, str], Router]) -> dict[str, str]:
    return served[0]


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 48000 + 200 for i in range(n)]


def failed_transfers(url: str) -> float:
    """The pod's failed handoffs; the series exists from the start (pre-created), so its absence fails."""
    return metric(url, f"{Metric.KV_TRANSFERS}_total", kind="handoff", outcome="failed")


def test_the_handoff_goes_to_the_decode_pod_of_the_prefill_pods_format(pool: dict[str, str]) -> None:
    for seed in range(6):  # distinct prompts: nothing cached decides, only the format
        body = {"prompt": tokens(seed, 80), "max_tokens": 4, "temperature": 0}
        reply = httpx.post(pool["router"] + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-kvmesh-pod"] == f"{pool['prefill']},{pool['decode-int8']}"
    assert failed_transfers(pool["decode-int8"]) == 0


def test_with_no_decode_pod_of_its_format_left_the_prompt_is_recomputed_without_a_handoff(
    served: tuple[dict[str, str], Router],
) -> None:
    """The int8 decode pod drains: the other-format pod continues after the prefill's first token, computing the
    prompt itself, and is never asked to pull KV it would have to refuse."""
    pool, router = served
    body = {"prompt": tokens(40, 80), "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    router.pods.mark_draining(pool["decode-int8"])
    try:
        reply = httpx.post(pool["router"] + "/v1/completions", json=body, timeout=60)
    finally:
        router.pods.mark_draining(pool["decode-int8"], False)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvmesh-pod"] == f"{pool['prefill']},{pool['decode-auto']}"
    assert failed_transfers(pool["decode-auto"]) == 0  # no handoff was tried
    first, *rest = reply.json()["choices"][0]["token_ids"]  # the prefill pod's token, then the decode pod's
    alone = httpx.post(pool["decode-auto"] + "/v1/completions", json={**body, "resume_output_ids": [first]},
                       timeout=60).json()
    assert rest == alone["choices"][0]["token_ids"]  # what that pod computes from the prompt and the first token
