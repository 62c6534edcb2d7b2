"""End to end: Debian's Prometheus scrapes a local pool (`kvmesh up -f pool.yaml`: two engine processes over the
tiny model, a router process, and the operator's scaler inside `kvmesh up` with its own /metrics; the targets from
`--targets-file`) while a short load runs; then every dashboard query, the operator's panels included, returns
data through Prometheus' HTTP API, the alert rules load and evaluate, and `promtool check metrics` finds nothing
on any component's /metrics but the colons of vLLM's compatibility names.

`kvmesh up` labels its targets as the chart's PodMonitor labels pods in Kubernetes (namespace, pool, role, pod),
and the operator's as its ServiceMonitor does (namespace, pod), so the dashboards' queries run here exactly as
they do in a cluster."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from kvmesh.engine.protocol import OperatorMetric
from kvmesh.processes import free_port, launch, stop, wait_healthy

from .promql import DASHBOARDS, RULES, Query, check_metrics, dashboard_queries, variable_queries

pytestmark = pytest.mark.slow

SCRAPE_SECONDS = 2  # and the scrape timeout: generous, for a loaded machine
REQUESTS = 24
DATA_DEADLINE_SECONDS = 120  # how long the queries may take to see the load (a loaded 2-core machine is slow)
CONSTRAINED_EVERY = 4  # every 4th request of the load is a structured output (a choice), for the structured panels

# Two engines that stay two (the scaler decides every second, but within fixed bounds: no engine comes or goes
# while the queries run), with the engines' forecast horizon the dashboards' default.
POOL = """
apiVersion: kvmesh.io/v1alpha1
kind: InferencePool
metadata: {{name: e2e}}
spec:
  model: {{source: {model}}}
  replicas: {{both: {{min: 2, max: 2}}}}
  scaling: {{intervalSeconds: 1, horizonSeconds: 10, podStartupSeconds: 5}}
"""


@dataclass
class Pool:
    router: str
    targets_file: Path
    gateway: str  # `kvmesh gateway` in front of the router, labelled as the chart's ServiceMonitor labels it
    gateway_targets_file: Path

    def targets(self) -> list[dict]:
        return [*json.loads(self.targets_file.read_text()), *json.loads(self.gateway_targets_file.read_text())]


@pytest.fixture(scope="module")
def pool(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """`kvmesh up -f` with two engines over the tiny model, once it has written its ready and targets files."""
    logs = tmp_path_factory.mktemp("pool")
    ready, targets, pool_file = logs / "ready", logs / "targets.json", logs / "pool.yaml"
    pool_file.write_text(POOL.format(model=json.dumps(str(tiny_dir))))
    port = free_port()
    proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "-f", str(pool_file), "--port", str(port),
                   "--ready-file", str(ready), "--targets-file", str(targets)], logs / "up.log")
    procs = [proc]
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert proc.poll() is None, (logs / "up.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "kvmesh up did not get ready"
            time.sleep(0.2)
        assert sorted(t["labels"].get("role", "operator") for t in json.loads(targets.read_text())) == [
            "both", "both", "operator", "router"]
        router, gateway_port = f"http://127.0.0.1:{port}", free_port()
        gateway = launch([sys.executable, "-m", "kvmesh.cli", "gateway", "--router", router, "--port",
                          str(gateway_port), "--refresh-seconds", "1"], logs / "gateway.log")
        procs.append(gateway)
        wait_healthy(f"http://127.0.0.1:{gateway_port}", gateway, 60, logs / "gateway.log")
        gateway_targets = logs / "gateway-targets.json"
        gateway_targets.write_text(json.dumps([{"targets": [f"127.0.0.1:{gateway_port}"],
                                                "labels": {"namespace": "local", "pod": "gateway-0"}}]))
        yield Pool(router, targets, f"http://127.0.0.1:{gateway_port}", gateway_targets)
    finally:
        stop(procs)


@pytest.fixture(scope="module")
def prometheus(pool: Pool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prometheus on a free loopback port with its own config and storage (not the Debian service)."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus not found: run `make prometheus` (apt-get install prometheus)"
    workdir = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": f"{SCRAPE_SECONDS}s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "kvmesh",
                            "file_sd_configs": [{"files": [str(pool.targets_file), str(pool.gateway_targets_file)],
                                                 "refresh_interval": "5s"}]}],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = launch([binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                   f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], workdir / "prometheus.log")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _ready(url):
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "Prometheus did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        stop([proc])


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def query(prometheus: str, expr: str) -> list[dict]:
    reply = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10)
    assert reply.status_code == 200, f"{expr}: {reply.text}"
    return reply.json()["data"]["result"]


def has_data(result: list[dict]) -> bool:
    """At least one sample that is a number (a ratio over no traffic is NaN: no data to show)."""
    return any(not math.isnan(float(r["value"][1])) for r in result)


@pytest.fixture(scope="module")
def loaded(pool: Pool, prometheus: str) -> Iterator[Pool]:
    """Load through the router for as long as the module's tests run: three shared prefixes (hits), streamed and
    whole answers, some constrained to a choice, every third through the gateway, two at a time. Starts once
    Prometheus scrapes every target, so each counter rises between scrapes; returns once Prometheus has seen
    REQUESTS of them."""
    wait_for(prometheus, f"count(up == 1) == {len(pool.targets())}", "Prometheus never scraped every target")
    model = httpx.get(pool.router + "/v1/models", timeout=10).json()["data"][0]["id"]
    stopping = threading.Event()
    counter = itertools.count()

    def prompt(i: int) -> list[int]:
        shared = [300 + 97 * (i % 3) + j for j in range(64)]
        return shared + [1000 + 13 * i + j for j in range(8 + i % 5)]

    def worker() -> None:
        while not stopping.is_set():
            i = next(counter)
            body = {"model": model, "prompt": prompt(i), "max_tokens": 8, "temperature": 0, "stream": i % 2 == 0}
            if i % CONSTRAINED_EVERY == 1:
                body["structured_outputs"] = {"choice": ["yes", "no"]}
            door = pool.gateway if i % 3 == 2 else pool.router
            with httpx.stream("POST", door + "/v1/completions", json=body, timeout=120) as reply:
                assert reply.status_code == 200, reply.read()
                reply.read()
            stopping.wait(0.1)

    with ThreadPoolExecutor(2) as workers:
        running = [workers.submit(worker) for _ in range(2)]
        try:
            wait_for(prometheus, f"sum(kvmesh_router_requests_total) >= {REQUESTS}", "Prometheus never saw the load")
            yield pool
        finally:
            stopping.set()
        for future in running:
            future.result()  # a request that failed fails the module here


def wait_for(prometheus: str, expr: str, message: str) -> None:
    deadline = time.monotonic() + DATA_DEADLINE_SECONDS
    while not has_data(query(prometheus, expr)):
        assert time.monotonic() < deadline, message
        time.sleep(SCRAPE_SECONDS)


def test_every_dashboard_query_returns_data(loaded: Pool, prometheus: str) -> None:
    """Polls until each query has data (rates need two scrapes in their window, the forecast panel a horizon of
    history), then names every query that never got any. The operator's panels read `kvmesh up`'s operator; those
    of its leader election are left out while that operator elects none (one process), which is checked."""
    operator = next(t for t in loaded.targets() if "role" not in t["labels"] and t["labels"].get("pod") != "gateway-0")
    exported = httpx.get(f"http://{operator['targets'][0]}/metrics", timeout=10).text
    assert OperatorMetric.LEADER not in exported, "kvmesh up's operator elects a leader now: drop the exemption"
    queries = [q for path in DASHBOARDS for q in dashboard_queries(path) if OperatorMetric.LEADER not in q.expr]
    assert len(queries) > 40 and any(OperatorMetric.DESIRED_REPLICAS in q.expr for q in queries)
    pending: list[Query] = list(queries)
    deadline = time.monotonic() + DATA_DEADLINE_SECONDS
    while pending and time.monotonic() < deadline:
        pending = [q for q in pending if not has_data(query(prometheus, q.concrete))]
        if pending:
            time.sleep(SCRAPE_SECONDS)
    assert not pending, "no data for:\n" + "\n".join(f"{q.where}: {q.concrete}" for q in pending)


def test_the_dashboard_pickers_list_the_pool(loaded: Pool, prometheus: str) -> None:
    for path in DASHBOARDS:
        for q in variable_queries(path):
            reply = httpx.get(prometheus + "/api/v1/series", params={"match[]": q.concrete}, timeout=10)
            series = reply.json()["data"]
            assert {s["namespace"] for s in series} == {"local"}, q.where
            assert {s["pool"] for s in series} == {"e2e"}, q.where


def test_the_operator_s_series_carry_the_pool_the_pickers_list(loaded: Pool, prometheus: str) -> None:
    """The local operator's series name the pool as the engines' targets do (so the namespace and pool pickers
    select them), under their own labels: a target label `pool` or `role` would have renamed them."""
    series = query(prometheus, OperatorMetric.DESIRED_REPLICAS)
    assert [(s["metric"]["pool_namespace"], s["metric"]["pool"], s["metric"]["role"], s["value"][1])
            for s in series] == [("local", "e2e", "both", "2")]


def test_the_alert_rules_load_and_stay_quiet_on_a_healthy_pool(loaded: Pool, prometheus: str) -> None:
    deadline = time.monotonic() + DATA_DEADLINE_SECONDS
    while True:
        groups = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(not r["lastEvaluation"].startswith("0001") for r in rules):  # 0001-01-01: never
            break
        assert time.monotonic() < deadline, "the rules were never evaluated"
        time.sleep(SCRAPE_SECONDS)
    expected = {r.get("alert") or r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert {r["name"] for r in rules} == expected
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    # none firing (a scrape slower than its 1 s timeout on a loaded machine may leave one pending for a moment);
    # recording rules have no state
    assert [r["name"] for r in rules if r.get("state") == "firing"] == []


def test_promtool_finds_nothing_but_vllm_colons_on_any_component(loaded: Pool) -> None:
    for target in loaded.targets():
        text = httpx.get(f"http://{target['targets'][0]}/metrics", timeout=10).text
        assert check_metrics(text) == [], target["labels"]["pod"]
