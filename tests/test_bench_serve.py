"""`kvmesh bench serve`: its datasets, arrival processes and report, and runs against simulated engines (the
engine's own server and KV manager with a latency model), alone and as a local cluster behind the router."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvmesh.bench.serve import (
    SLO,
    RequestResult,
    Stats,
    arrival_times,
    base_url,
    random_requests,
    run_load,
    shared_prefix_requests,
    split_shared,
    summarize,
    trace_requests,
)
from kvmesh.bench.sim_engine import PROFILES, LatencyModel
from kvmesh.bench.sim_runner import SimEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.processes import free_port

from .engines import serve_engine

QUICK = LatencyModel(1e-5, 1e-3, 0.0, 0.0, 1e12)  # fast, but a step still takes a little time


def test_shared_prefix_dataset_shares_exactly_the_system_prompt() -> None:
    requests = shared_prefix_requests(3, 4, 40, 10, 8, seed=1)
    assert len(requests) == 12 and all(len(r.prompt) == 50 and r.max_tokens == 8 for r in requests)
    by_group: dict[int, list[list[int]]] = {}
    for r in requests:
        by_group.setdefault(r.group, []).append(r.prompt)
    assert sorted(by_group) == [0, 1, 2]
    systems = {tuple(p[:40]) for prompts in by_group.values() for p in prompts}
    assert len(systems) == 3  # one system prompt per group
    assert all(len({tuple(p[40:]) for p in prompts}) == 4 for prompts in by_group.values())  # questions differ
    assert [r.group for r in requests] != sorted(r.group for r in requests)  # groups interleave
    assert shared_prefix_requests(3, 4, 40, 10, 8, seed=1) == requests  # seeded
    assert split_shared(2000, 0.25) == (500, 1500) and split_shared(2000, 1.0) == (2000, 0)
    with pytest.raises(ValueError):
        split_shared(2000, 1.5)


def test_random_prompts_share_nothing_and_stay_in_the_vocabulary() -> None:
    requests = random_requests(20, 64, 4, seed=2, vocab=1000)
    assert len({tuple(r.prompt[:16]) for r in requests}) == 20
    assert all(100 <= t < 1000 for r in requests for t in r.prompt)


def test_arrivals_all_at_once_poisson_or_bursty() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5
    poisson = np.diff(arrival_times(4000, rate=10.0, seed=3))
    bursty = np.diff(arrival_times(4000, rate=10.0, burstiness=0.25, seed=3))
    assert poisson.mean() == pytest.approx(0.1, rel=0.1) and bursty.mean() == pytest.approx(0.1, rel=0.1)
    # coefficient of variation: 1 for a Poisson process, 1/sqrt(shape) = 2 for gamma gaps of shape 0.25
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)
    with pytest.raises(ValueError):
        arrival_times(3, rate=0.0)


def test_stats_match_numpy_percentiles() -> None:
    values = [0.3, 0.1, 0.7, 0.2, 1.5, 0.9, 0.05]
    s = Stats.of(values)
    assert s.mean == pytest.approx(statistics.mean(values))
    assert [s.p50, s.p90, s.p99] == pytest.approx(list(np.percentile(values, [50, 90, 99])))
    assert math.isnan(Stats.of([]).p99)


def test_report_hit_ratio_goodput_tpot_and_errors() -> None:
    results = [
        RequestResult(True, 100, 11, cached_tokens=64, ttft=0.2, e2e=1.2, itl=[0.1] * 10),
        RequestResult(True, 100, 11, cached_tokens=0, ttft=0.9, e2e=1.9, itl=[0.1] * 10),
        RequestResult(True, 50, 1, cached_tokens=32, ttft=0.1, e2e=0.1),
        RequestResult(False, 80, error="HTTP 400: too long"),
    ]
    assert results[0].tpot == pytest.approx(0.1) and results[2].tpot is None
    report = summarize(results, seconds=2.0, slo=SLO(ttft=0.5, tpot=0.15))
    assert report.completed == 3 and report.failed == 1
    assert report.hit_ratio == pytest.approx(96 / 250)  # failed requests count in neither sum
    assert report.goodput == pytest.approx(2 / 2.0) and report.slo_attainment == pytest.approx(2 / 4)
    assert report.request_throughput == pytest.approx(1.5) and report.output_throughput == pytest.approx(11.5)
    assert report.errors == {"HTTP 400: too long": 1}
    assert report.itl.mean == pytest.approx(0.1) and report.tpot.p50 == pytest.approx(0.1)
    assert summarize(results, 2.0).goodput is None


def test_trace_replay_keeps_shared_prefixes_when_scaled(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [7, 8, 9]},
        {"timestamp": 500, "input_length": 1500, "output_length": 80, "hash_ids": [7, 8, 10]},
        {"timestamp": 1500, "input_length": 300, "output_length": 4, "hash_ids": [11]},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests, cut = trace_requests(trace, None, length_scale=0.25, vocab=5000)
    assert cut == 0
    assert [len(r.prompt) for r in requests] == [275, 375, 75]  # 128-token blocks, lengths scaled
    assert [r.max_tokens for r in requests] == [10, 20, 1]
    assert [r.arrival for r in requests] == [0.0, 0.5, 1.5]
    assert requests[0].prompt[:256] == requests[1].prompt[:256]  # ids 7, 8: the same two blocks
    assert requests[0].prompt[256:275] != requests[1].prompt[256:275]
    fitted, cut = trace_requests(trace, 2, length_scale=1.0, max_model_len=1024, vocab=5000)
    assert cut == 2 and all(len(r.prompt) + r.max_tokens <= 1024 for r in fitted)
    assert fitted[0].prompt[:512] == fitted[1].prompt[:512]  # cutting keeps the leading (shared) blocks


def test_hit_ratio_of_a_hand_made_shared_prefix_load_on_a_simulated_engine() -> None:
    """Two groups of three prompts, a 64-token (four-block) system prompt and a 20-token question, one at a time:
    the first prompt of each group finds nothing cached, the two others find exactly the system prompt."""
    requests = shared_prefix_requests(2, 3, 64, 20, 5, seed=4, vocab=32000, shuffle=False)
    engine = SimEngine(EngineConfig(kv_cache_blocks=256), PROFILES["cpu-smollm"], QUICK)
    with serve_engine(engine) as url:
        results, seconds = asyncio.run(run_load(url + "/v1/", requests, concurrency=1, progress=False))
    assert [r.error for r in results] == [None] * 6
    assert [r.cached_tokens for r in results] == [0, 64, 64, 0, 64, 64]
    report = summarize(results, seconds)
    assert report.hit_ratio == pytest.approx(4 * 64 / (6 * 84))
    assert report.completion_tokens == 30 and report.prompt_tokens == 6 * 84
    assert all(0 < r.ttft <= r.e2e and 0 < len(r.itl) <= 4 for r in results)


def test_errors_and_time_bound_are_reported_not_raised() -> None:
    engine = SimEngine(EngineConfig(kv_cache_blocks=256, max_model_len=128), PROFILES["cpu-smollm"], QUICK)
    too_long = random_requests(2, 200, 4, seed=5)
    fine = random_requests(3, 20, 4, seed=6)
    with serve_engine(engine) as url:
        results, _ = asyncio.run(run_load(url, too_long + fine, concurrency=2, progress=False))
        timed = [dataclasses.replace(r, arrival=at) for r, at in zip(fine, (0.0, 0.0, 60.0), strict=True)]
        bounded, _ = asyncio.run(run_load(url, timed, duration=30.0, progress=False))
    assert [r.ok for r in results] == [False, False, True, True, True]
    assert "HTTP 400" in (results[0].error or "") and "context length" in (results[0].error or "")
    assert len(bounded) == 2 and all(r.ok for r in bounded)  # the one due after the time bound is never sent
    unreachable, _ = asyncio.run(run_load(f"http://127.0.0.1:{free_port()}", fine[:1], progress=False))
    assert not unreachable[0].ok and "ConnectError" in (unreachable[0].error or "")


def test_base_url_accepts_what_openai_clients_are_given() -> None:
    assert base_url("http://h:1/v1/") == base_url("http://h:1/v1") == base_url("http://h:1/") == "http://h:1"


@pytest.mark.slow
def test_bench_serve_against_a_simulated_cluster(tmp_path: Path) -> None:
    """`kvmesh up --sim` (three simulated engines behind the real router), then `kvmesh bench serve` on it: every
    request answered, and prefix-aware routing finds each group's system prompt cached."""
    ready = tmp_path / "ready"
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "up", "--sim", "--engines", "3", "--port", str(port),
                           "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert up.poll() is None, up.stderr.read().decode() if up.stderr else ""
            assert time.monotonic() < deadline, "the simulated pool did not become ready"
            time.sleep(0.2)
        out = tmp_path / "report.json"
        bench = subprocess.run([sys.executable, "-m", "kvmesh.cli", "bench", "serve", "--url", ready.read_text(),
                                "--dataset", "shared-prefix", "--groups", "3", "--system-tokens", "160",
                                "--question-tokens", "24", "--output-tokens", "4", "--num-requests", "18",
                                "--concurrency", "3", "--rate", "20", "--json", str(out)],
                               capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stderr
        assert "TTFT" in bench.stdout and "hit ratio" in bench.stdout
        report = json.loads(out.read_text())["report"]
        assert report["completed"] == 18 and report["failed"] == 0
        assert report["prompt_tokens"] == 18 * 184 and report["completion_tokens"] == 18 * 4
        # at best 15 of 18 requests find their 160-token system prompt; the router may spread a group at first
        assert 0 < report["cached_tokens"] <= 15 * 160
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C: no SIGTERM settle time (the router's 5 s for Kubernetes)
        up.wait(timeout=60)
