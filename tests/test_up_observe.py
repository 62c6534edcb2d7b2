"""`kvmesh up -f` observes and shrinks its engines as the cluster operator does its pods: all engines' /metrics
scraped at once with the operator's helper (a slow engine delays no other's observation, and the tick waits at
most the scrape's bound), and a scale-down drains the engines the operator would have Kubernetes remove: not yet
serving first, then the coldest cache (operator/scale_in.py). The scrapers here are functions standing in for
engines whose answer the test must hold back at will, which a real engine cannot be made to do."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from kvmesh.engine.protocol import VllmMetric
from kvmesh.operator.engines import scrape_all
from kvmesh.operator.local import LocalOperator, LocalPod
from kvmesh.operator.scale_in import Candidate, removal_order
from kvmesh.up import DRAINING, SERVING, STARTING, Child, Engine, LocalEngines, observe_engines, plan_from_file

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"
METRICS = f"{VllmMetric.KV_USAGE} 0.5\n"


def engine(name: str, process: subprocess.Popen[bytes], tmp_path: Path, state: str = SERVING) -> Engine:
    return Engine(Child(name, f"http://{name}", process, tmp_path / f"{name}.log"), "both", state)


def test_engines_are_scraped_at_once_so_a_slow_one_delays_no_other(
        sleeper: subprocess.Popen[bytes], tmp_path: Path) -> None:
    """engine-0's answer waits until engine-1 has been asked: scraped one after the other, engine-0 would never
    answer in time and be left out."""
    asked_fast = threading.Event()

    def scrape(url: str) -> str:
        if url.startswith("http://engine-0"):
            if not asked_fast.wait(timeout=10):
                raise TimeoutError("engine-1 was not asked while engine-0 was being scraped")
        else:
            asked_fast.set()
        return METRICS

    pods = observe_engines([engine("engine-0", sleeper, tmp_path), engine("engine-1", sleeper, tmp_path, STARTING)],
                           scrape)
    assert [(p.name, p.ready, p.metrics) for p in pods] == [("engine-0", True, METRICS), ("engine-1", False, METRICS)]


def test_the_scrape_ends_within_its_bound_without_the_engine_that_does_not_answer() -> None:
    release, returned = threading.Event(), threading.Event()

    def scrape(url: str) -> str:
        if "hung" in url:
            release.wait(timeout=60)
            returned.set()
        return METRICS

    try:
        texts = scrape_all({"hung": "http://hung/metrics", "ok": "http://ok/metrics"}, scrape, timeout=2.0)
        assert not returned.is_set()  # the hung engine's call is still running: the tick did not wait for it
        assert texts["ok"] == METRICS and isinstance(texts["hung"], TimeoutError)
    finally:
        release.set()
    assert scrape_all({}, scrape) == {}


def test_a_failed_scrape_is_reported_for_that_engine_only() -> None:
    def scrape(url: str) -> str:
        if "down" in url:
            raise ConnectionError("refused")
        return METRICS

    texts = scrape_all({"down": "http://down/metrics", "ok": "http://ok/metrics"}, scrape)
    assert texts["ok"] == METRICS and isinstance(texts["down"], ConnectionError)


def test_removal_follows_a_replica_set_not_ready_then_cheapest_then_newest() -> None:
    newest_first = [Candidate("e3", True), Candidate("e2", False), Candidate("e1", True), Candidate("e0", True)]
    assert removal_order(newest_first, {"e3": 2, "e1": 0, "e0": 1}) == ["e2", "e1", "e0", "e3"]
    # no costs (no tick observed them): the newest ready one goes first, as the newest pod does in Kubernetes
    assert removal_order(newest_first, {}) == ["e2", "e3", "e1", "e0"]


def hits(name: str, cached_tokens: float, running: int = 0) -> LocalPod:
    """An engine's /metrics with its prefix-cache hits so far (a counter) and its running requests."""
    text = "\n".join([f"{VllmMetric.KV_USAGE} 0.1", f"{VllmMetric.RUNNING} {running}",
                      f'{VllmMetric.CACHE_CONFIG}{{block_size="16",num_gpu_blocks="1000"}} 1',
                      f"# TYPE {VllmMetric.PREFIX_HITS} counter", f"{VllmMetric.PREFIX_HITS}_total {cached_tokens}",
                      ""])
    return LocalPod(name, "both", f"http://{name}", text, True)


def test_a_local_scale_down_drains_the_coldest_cache_not_the_newest_engine(
        sleeper: subprocess.Popen[bytes], tmp_path: Path) -> None:
    plan = plan_from_file(EXAMPLES / "aggregated.yaml")
    operator = LocalOperator(plan.pool)
    operator.decide(0.0, [hits("engine-0", 0), hits("engine-1", 0), hits("engine-2", 0)], {"both": 3})
    # since then engine-0 served 900 cached tokens, engine-1 (the middle one) none, engine-2 (the newest) 300
    tick = operator.decide(10.0, [hits("engine-0", 900), hits("engine-1", 0, running=1), hits("engine-2", 300)],
                           {"both": 3})
    assert sorted(tick.deletion_costs, key=tick.deletion_costs.__getitem__) == ["engine-1", "engine-2", "engine-0"]

    engines = LocalEngines(plan, [], tmp_path, None)
    engines.engines = [engine(f"engine-{i}", sleeper, tmp_path) for i in range(3)]
    engines.scale("both", 2, tick.deletion_costs)
    assert [(e.child.name, e.state) for e in engines.engines] == [
        ("engine-0", SERVING), ("engine-1", DRAINING), ("engine-2", SERVING)]
    assert "engine-1" not in (tmp_path / "pods.json").read_text()  # out of the router's pods at once
    engines.scale("both", 1, tick.deletion_costs)
    assert [e.state for e in engines.engines] == [SERVING, DRAINING, DRAINING]
