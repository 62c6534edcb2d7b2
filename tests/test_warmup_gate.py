"""The engine's warm-up gate (engine/server.py, issue 5): with `warmup_grace_seconds` set, a new pod's /health says
"warming" (503) after its model loads, so Kubernetes keeps it out of Services and routers out of their candidate
sets, until its first warm-up ends (copied, or failed), the operator says there is nothing to copy, or the grace
runs out; it serves its other endpoints, and completions, throughout. Engines over the tiny random model, served
in this process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.config import load_config
from kvmesh.engine.metrics import EngineMetrics, EngineState
from kvmesh.engine.protocol import (
    DRAIN_PATH,
    GATE_REASONS,
    HEALTH_WARMING,
    KV_CONFIG_PATH,
    KV_HOT_PATH,
    KV_WARM_PATH,
    READY_PATH,
    Metric,
)
from kvmesh.engine.server import EngineHolder, WarmupGate, create_app
from kvmesh.processes import free_port

from .conftest import make_engine
from .engines import serve_engine
from .test_kv_transfer import complete, tokens


def opened(http: TestClient) -> dict[str, float]:
    """The gate's counter per reason, from /metrics."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == f"{Metric.WARMUP_GATE_OPENED}_total":
                out[s.labels["reason"]] = s.value
    return out


@contextmanager
def engine_app(tiny_dir: Path, grace: float) -> Iterator[TestClient]:
    """A started tiny engine with this grace behind its HTTP app (in-process client)."""
    engine = make_engine(tiny_dir, kv_cache_blocks=64, warmup_grace_seconds=grace)
    engine.start()
    try:
        with TestClient(create_app(EngineHolder(engine))) as http:
            yield http
    finally:
        engine.stop()
        engine.kv.check_invariants()


def test_the_grace_is_a_checked_engine_setting() -> None:
    assert load_config(None, {"warmup_grace_seconds": 2.5}).warmup_grace_seconds == 2.5
    assert load_config(None).warmup_grace_seconds == 0, "off unless asked for: a lone engine serves at once"
    with pytest.raises(ValueError, match="warmup_grace_seconds"):
        load_config(None, {"warmup_grace_seconds": -1})


def test_the_gate_opens_once_and_at_the_end_of_its_grace_by_itself() -> None:
    now = [100.0]
    metrics = EngineMetrics("m", EngineState)
    registry = metrics.registry
    gate = WarmupGate(30.0, metrics.warmup_gate_opened, clock=lambda: now[0])
    assert gate.closed() and gate.seconds_left() == 30.0
    now[0] = 129.9
    assert gate.closed()
    now[0] = 130.0
    assert not gate.closed() and gate.reason == "grace_expired"
    gate.open("warmed")  # a warm-up that ends after the grace changes nothing
    assert gate.reason == "grace_expired"
    counts = {r: registry.get_sample_value(f"{Metric.WARMUP_GATE_OPENED}_total", {"reason": r}) for r in GATE_REASONS}
    assert counts == {"warmed": 0, "warm_failed": 0, "nothing_to_copy": 0, "grace_expired": 1}
    assert not WarmupGate(0.0, metrics.warmup_gate_opened).closed(), "grace 0: no gate"


def test_without_a_grace_health_is_ok_at_once(tiny_dir: Path) -> None:
    with engine_app(tiny_dir, 0.0) as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert opened(http) == dict.fromkeys(GATE_REASONS, 0.0), "every reason exported at 0 from the start"


def test_a_warming_pod_is_unready_serves_everything_else_and_opens_when_warmed(tiny_dir: Path) -> None:
    peer = make_engine(tiny_dir, kv_cache_blocks=64)
    with serve_engine(peer) as source, engine_app(tiny_dir, 600.0) as fresh:
        health = fresh.get("/health")
        assert health.status_code == 503 and health.json()["status"] == HEALTH_WARMING
        assert KV_WARM_PATH in health.json()["message"] and 0 < health.json()["seconds_left"] <= 600
        assert fresh.get(KV_CONFIG_PATH).status_code == 200 and fresh.get("/metrics").status_code == 200
        direct = fresh.post("/v1/completions", json={"prompt": tokens(5, 20), "max_tokens": 2})
        assert direct.status_code == 200, "the gate is about readiness, not about refusing work"
        assert fresh.get("/health").status_code == 503

        hot = tokens(41, 70)
        for _ in range(3):
            complete(source, prompt=hot, max_tokens=1, temperature=0)
        chains = [c["hashes"] for c in httpx.get(source + KV_HOT_PATH).json()["chains"]]
        warmed = fresh.post(KV_WARM_PATH, json={"source": source, "chains": chains})
        assert warmed.status_code == 200 and warmed.json()["blocks_pulled"] == 4 and warmed.json()["failed"] == 0
        assert fresh.get("/health").json() == {"status": "ok"}
        assert opened(fresh) == {"warmed": 1, "warm_failed": 0, "nothing_to_copy": 0, "grace_expired": 0}


def test_a_failed_warm_up_opens_the_gate_too(tiny_dir: Path) -> None:
    with engine_app(tiny_dir, 600.0) as http:
        answer = http.post(KV_WARM_PATH, json={"source": f"http://127.0.0.1:{free_port()}", "chains": [[1, 2]]})
        assert answer.status_code == 200 and answer.json()["failed"] == 1
        assert http.get("/health").status_code == 200, "a pod whose warm-up failed computes its prefixes itself"
        assert opened(http)["warm_failed"] == 1


def test_nothing_to_copy_opens_it_at_once_and_draining_still_wins(tiny_dir: Path) -> None:
    with engine_app(tiny_dir, 600.0) as http:
        assert http.post(KV_WARM_PATH, json={"source": "http://peer:1", "chains": []}).status_code == 400, \
            "an empty warm-up is a client's mistake, not the way to open"
        assert http.get("/health").json()["status"] == HEALTH_WARMING
        assert http.post(READY_PATH).json() == {"warming": False, "opened": "nothing_to_copy"}
        assert http.post(READY_PATH).json()["opened"] == "nothing_to_copy", "idempotent"
        assert http.get("/health").status_code == 200
        assert opened(http) == {"warmed": 0, "warm_failed": 0, "nothing_to_copy": 1, "grace_expired": 0}
    with engine_app(tiny_dir, 600.0) as http:
        http.post(DRAIN_PATH)
        assert http.get("/health").json()["status"] == "draining"


def test_a_pod_nobody_warms_opens_when_its_grace_runs_out(tiny_dir: Path) -> None:
    """Its timer opens it: /health is not asked until the metric says so (a pod nobody probes still counts)."""
    with engine_app(tiny_dir, 0.5) as http:
        deadline = time.monotonic() + 30
        while opened(http)["grace_expired"] == 0:
            assert time.monotonic() < deadline, "the grace never ran out"
            time.sleep(0.05)
        assert opened(http) == {"warmed": 0, "warm_failed": 0, "nothing_to_copy": 0, "grace_expired": 1}
        assert http.get("/health").status_code == 200
