"""`kvmesh up -f pool.yaml` carries out the scaler's decisions locally: under load a simulated pool grows to its
maximum (a new engine process is warmed from the serving one, then joins the router's pods and serves), and once
the load stops it drains and stops one engine (the colder cache, as the operator chooses), without taking that
deliberate exit for a failure. The local operator's /metrics (listed in the targets file as the chart lists the
operator's) record each decision."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.internal_token import INTERNAL_TOKEN_HEADER
from kvmesh.engine.protocol import Metric, OperatorMetric
from kvmesh.processes import free_port, launch

from .engines import Load, stop_up

pytestmark = pytest.mark.slow

# Tiny simulated engines (8 MiB of KV: a few requests fill one), evaluated every second over a 5 s horizon; a
# scale-down waits for 3 s of agreeing recommendations.
POOL = """
apiVersion: kvmesh.io/v1alpha1
kind: InferencePool
metadata: {name: grow}
spec:
  model: {source: bundled}
  engine: {kvCacheMemoryMiB: 8}
  replicas:
    both: {min: 1, max: 2}
  scaling: {horizonSeconds: 5, podStartupSeconds: 1, intervalSeconds: 1, scaleDownStabilizationSeconds: 3}
"""


def wait_for(check: Callable[[], bool], what: str, proc: subprocess.Popen[bytes], log: Path,
             timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, f"kvmesh up exited while waiting for {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def engine_urls(targets: Path) -> dict[str, str]:
    """Pod name -> URL of the engines in the Prometheus targets file (kept equal to the router's pods file)."""
    if not targets.exists():
        return {}
    return {t["labels"]["pod"]: "http://" + t["targets"][0] for t in json.loads(targets.read_text())
            if t["labels"].get("role", "router") != "router"}


def pool_headers(log: Path) -> dict[str, str]:
    """The pool's internal token as a request header, read from the work folder `kvmesh up` names in its `log`:
    what a test calling the pool's engines directly sends (they refuse other callers but /health and /metrics)."""
    from kvmesh.up import INTERNAL_TOKEN_FILE

    (workdir,) = re.findall(r"\(logs in (\S+)\)", log.read_text())
    return {INTERNAL_TOKEN_HEADER: (Path(workdir) / INTERNAL_TOKEN_FILE).read_text().strip()}


def operator_url(targets: Path) -> str:
    """The local operator's /metrics target: labelled like the chart's operator target (KvmeshOperatorDown selects
    it by its component), without pool or role."""
    (operator,) = [t for t in json.loads(targets.read_text()) if t["labels"].get("pod") == "operator"]
    assert operator["labels"] == {"namespace": "local", "pod": "operator", "component": "operator"}
    return "http://" + operator["targets"][0]


def sample(url: str, name: str, **labels: str) -> float | None:
    """The value of the one series `name` with `labels` (among others) on `url`/metrics; None when it does not
    exist (a series exported at 0 exists)."""
    values = [s.value for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
              for s in family.samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(values) <= 1, (name, labels, values)
    return values[0] if values else None


SHARED = list(range(500, 532))


def varied(worker: int, n: int) -> list[int]:
    """A shared prefix of two blocks (the pool's hot chain) and a long tail of its own."""
    return SHARED + [1000 + (worker * 7919 + n * 104729 + i) % 30000 for i in range(60)]


DECISIONS = f"{OperatorMetric.SCALING_DECISIONS}_total"
POOL_SERIES = {"pool_namespace": "local", "pool": "grow", "role": "both"}


def test_kvmesh_up_grows_under_load_and_shrinks_after(tmp_path: Path) -> None:
    (tmp_path / "pool.yaml").write_text(POOL)
    port, ready, targets, log = free_port(), tmp_path / "ready", tmp_path / "targets.json", tmp_path / "up.log"
    proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "-f", str(tmp_path / "pool.yaml"), "--sim", "--port",
                   str(port), "--ready-file", str(ready), "--targets-file", str(targets)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(ready.exists, "the pool to be ready", proc, log)
        assert list(engine_urls(targets)) == ["engine-0"]
        operator = operator_url(targets)
        # every series exists from the start: no decision yet, one replica wanted
        assert sample(operator, OperatorMetric.DESIRED_REPLICAS, **POOL_SERIES) == 1
        assert sample(operator, DECISIONS, **POOL_SERIES, direction="up") == 0

        load = Load(url, varied, threads=8, max_tokens=30)
        try:
            wait_for(lambda: "engine-1" in engine_urls(targets), "a second engine under load", proc, log)
            new = engine_urls(targets)["engine-1"]
            wait_for(lambda: new in load.served, "the new engine to serve a request", proc, log)
        finally:
            load.stop()
        assert "scaler: both: 1 -> 2" in log.read_text()
        assert sample(operator, DECISIONS, **POOL_SERIES, direction="up") == 1
        assert sample(operator, OperatorMetric.DESIRED_REPLICAS, **POOL_SERIES) == 2
        # engine-1 was warmed from engine-0 before it joined the router's pods: its warm-up gate opened because
        # the warm-up ended (not its grace), and it pulled blocks it never computed: every hot chain starts with
        # the shared prefix, which engine-0 always holds (a chain's tail may be evicted before it is pulled, so
        # a warm-up may end partial: `warm_failed`, the operator's WarmupFailed)
        assert "warm-up: " in log.read_text() and "engine-1 from engine-0" in log.read_text()
        gate = f"{Metric.WARMUP_GATE_OPENED}_total"
        assert (sample(new, gate, reason="warmed") or 0) + (sample(new, gate, reason="warm_failed") or 0) == 1
        assert (sample(new, f"{Metric.KV_TRANSFERS}_total", kind="warm", outcome="ok") or 0) >= 1

        wait_for(lambda: re.search(r"engine-[01] stopped", log.read_text()) is not None,
                 "the idle pool to drain and stop an engine", proc, log)
        (kept,) = engine_urls(targets)
        assert f"draining {({'engine-0', 'engine-1'} - {kept}).pop()}" in log.read_text()
        assert sample(operator, DECISIONS, **POOL_SERIES, direction="down") == 1
        assert sample(operator, OperatorMetric.DESIRED_REPLICAS, **POOL_SERIES) == 1
        assert proc.poll() is None  # a deliberate stop is no failure: the pool runs on
        reply = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200 and reply.headers["x-kvmesh-pod"] == engine_urls(targets)[kept]
    finally:
        stop_up(proc, log)
