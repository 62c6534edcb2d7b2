"""A proxy in the environment (HTTP_PROXY, as a laptop behind a company proxy or a cluster that injects one has)
does not come between kvmesh's programs: a router finds its engines, and a decode pod pulls KV from a prefill pod,
while the proxy the variables name does not even listen."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from kvmesh.engine.protocol import Metric
from kvmesh.operator.pod_client import close_pod_client, pod_client
from kvmesh.processes import free_port, spawn, stop, wait_healthy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A prefill pod, a decode pod and a router, processes started with a proxy nobody listens on; this test
    process has none (its own calls go straight)."""
    where = tmp_path_factory.mktemp("proxy")
    dead_proxy = f"http://127.0.0.1:{free_port()}"
    env = {name: dead_proxy for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")}
    urls = {name: f"http://127.0.0.1:{free_port()}" for name in ("prefill", "decode", "router")}
    config = where / "router.yaml"
    config.write_text(yaml.safe_dump({"router": {"scrape_interval_seconds": 0.1, "prefill_hop_min_tokens": 32}}))
    procs = {role: spawn(["serve", "--model", str(tiny_dir), "--port", urls[role].rsplit(":", 1)[1], "--dtype",
                          "float32", "--threads", "1", "--kv-cache-memory-mib", "16", "--log-level", "warning",
                          "--role", role], where / f"{role}.log", env=env) for role in ("prefill", "decode")}
    try:
        for role, proc in procs.items():
            wait_healthy(urls[role], proc, log=where / f"{role}.log")
        procs["router"] = spawn(["router", "--model", str(tiny_dir), "--pod", urls["prefill"], "--pod",
                                 urls["decode"], "--port", urls["router"].rsplit(":", 1)[1], "--config", str(config),
                                 "--log-level", "warning"], where / "router.log", env=env)
        wait_healthy(urls["router"], procs["router"], timeout=60, log=where / "router.log")  # it found a pod
        yield urls
    finally:
        stop(procs.values())


def transfers(url: str, outcome: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = rf'^{Metric.KV_TRANSFERS}_total{{[^}}]*outcome="{outcome}"[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, flags=re.M))


def test_the_router_finds_both_pods_and_the_decode_pod_pulls_from_the_prefill_pod(pool: dict[str, str]) -> None:
    health = httpx.get(pool["router"] + "/health", timeout=10).json()
    assert sorted(health["pods"]) == sorted([pool["prefill"], pool["decode"]])
    prompt = [(i * 104729) % 48000 + 200 for i in range(90)]
    reply = httpx.post(pool["router"] + "/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvmesh-pod"] == f"{pool['prefill']},{pool['decode']}"  # split: prefill, then decode
    assert transfers(pool["decode"], "ok") >= 1 and transfers(pool["decode"], "failed") == 0


def test_the_operator_reaches_pods_past_the_proxy(pool: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")
    close_pod_client()  # the next call makes the operator's client anew, under this environment
    try:
        assert pod_client().get(pool["decode"] + "/metrics", timeout=10).status_code == 200
    finally:
        close_pod_client()
