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

from kvmesh.router.app import build_router
from kvmesh.router.config import RouterConfig

from .conftest import make_engine
from .engines import serve_engine, serve_router

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool(tiny_dir: Path) -> Iterator[dict[str, str]]:
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
        yield {**urls, "router": url}


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 48000 + 200 for i in range(n)]


def failed_transfers(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('kvmesh_kv_transfers_total{kind="handoff",outcome="failed"}'):
            return float(line.split()[-1])
    return 0.0


def test_the_handoff_goes_to_the_decode_pod_of_the_prefill_pods_format(pool: dict[str, str]) -> None:
    for seed in range(6):  # distinct prompts: nothing cached decides, only the format
        body = {"prompt": tokens(seed, 80), "max_tokens": 4, "temperature": 0}
        reply = httpx.post(pool["router"] + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-kvmesh-pod"] == f"{pool['prefill']},{pool['decode-int8']}"
    assert failed_transfers(pool["decode-int8"]) == 0
