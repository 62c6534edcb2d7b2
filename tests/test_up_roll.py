"""`kvmesh up -f pool.yaml` applies an edit of what its processes started with as the operator's rollout does:
changed engine settings replace the engines one at a time (a new engine started, warmed and routed to before an
old one drains), so clients see no failure; changed router settings restart the router on its port after the
engines, its open streams finishing on the old one. Simulated engines (`--sim`); what an edit may change, and how,
is pure and tested first, and so is the scaler's view of a roll (an engine rolled in counts in no replica)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from kvmesh.engine.config import EngineConfig, load_config
from kvmesh.engine.protocol import OperatorMetric
from kvmesh.operator.crd import parse_pool
from kvmesh.operator.local import Restarts, ignored_locally, restarts
from kvmesh.processes import free_port, launch
from kvmesh.up import (
    DRAINING,
    SERVING,
    STARTING,
    STOPPING,
    LocalEngines,
    _router_section,
    _ScalingWatch,
    _settings_problem,
    _write_engine_files,
    _write_router_file,
    plan_from_file,
)

from .engines import Load, stop_up
from .test_up_observe import EXAMPLES, engine
from .test_up_scaling import engine_urls, operator_url, pool_headers, sample, wait_for
from .test_up_stop import events


def pool(**spec: object) -> object:
    base = {"model": {"source": "bundled"}, "replicas": {"both": {"min": 1, "max": 1}}}
    return parse_pool({"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "p"},
                       "spec": {**base, **spec}})


def test_engine_settings_roll_the_engines_router_settings_restart_it_what_all_share_is_refused() -> None:
    before = pool()
    mixed = pool(engine={"maxNumSeqs": 7}, router={"settings": {"retries": 1}}, scaling={"warmupGraceSeconds": 5},
                 replicas={"both": {"min": 1, "max": 3}})
    assert restarts(before, mixed) == Restarts(  # type: ignore[arg-type]
        engines=("engine.yaml max_num_seqs",), gate=("engine-scaled.yaml warmup_grace_seconds",),
        router=("router.yaml retries",), refused=())
    assert ignored_locally(before, mixed) == []  # type: ignore[arg-type]  # engine.settings feeds the engines
    assert restarts(before, pool(scaling={"horizonSeconds": 600})).engines == (  # type: ignore[arg-type]
        "engine.yaml forecast_horizon_seconds",)
    assert restarts(before, pool(scaling={"slo": {"ttftSeconds": 0.5}})).router == (  # type: ignore[arg-type]
        "router.yaml ttft_slo_seconds",)
    # the model, the KV hashing and the mode: every process must share them, so no process changes them alone
    for edited, refused in ((pool(model={"source": "/models/other"}), "engines model"),
                            (pool(engine={"blockSize": 32}), "router.yaml block_size"),
                            (pool(mode="disaggregated", replicas={"prefill": {"min": 1, "max": 1},
                                                                   "decode": {"min": 1, "max": 1}}), "engines roles")):
        assert refused in restarts(before, edited).refused, refused  # type: ignore[arg-type]


def test_a_surge_counts_in_no_replica_and_goes_with_the_old_engine_the_scaler_removes(
        sleeper: subprocess.Popen[bytes], tmp_path: Path) -> None:
    engines = LocalEngines(plan_from_file(EXAMPLES / "aggregated.yaml"), [], tmp_path, None)
    engines.engines = [engine(f"engine-{i}", sleeper, tmp_path) for i in range(2)]
    surge = engine("engine-2", sleeper, tmp_path, STARTING)
    surge.replaces = "engine-0"
    engines.engines.append(surge)
    assert engines.replicas() == {"both": 2}  # the scaler sees the pool it asked for, not one more
    engines.scale("both", 2)
    assert [e.state for e in engines.engines] == [SERVING, SERVING, STARTING]
    engines.scale("both", 1, {"engine-0": 0, "engine-1": 10})  # engine-0 is the coldest: it goes, and its surge
    assert [(e.child.name, e.state) for e in engines.engines] == [
        ("engine-0", DRAINING), ("engine-1", SERVING), ("engine-2", STOPPING)]
    assert engines.replicas() == {"both": 1} and engines.surges() == []


def test_a_rolled_in_engine_that_exits_stops_the_roll_and_the_old_engines_serve_on(
        sleeper: subprocess.Popen[bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engines = LocalEngines(plan_from_file(EXAMPLES / "aggregated.yaml"), [], tmp_path, None)
    engines.engines = [engine(f"engine-{i}", sleeper, tmp_path) for i in range(2)]
    engines.roll(["engine.yaml max_num_seqs"], [])
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])  # a new engine that could not start
    failed.wait()
    surge = engine("engine-2", failed, tmp_path, STARTING)
    surge.replaces = "engine-0"
    engines.engines.append(surge)
    assert engines.unexpected_exit() is None  # not a failure of the pool: only of the roll
    with httpx.Client() as client:
        engines.progress(client)
    assert [(e.child.name, e.state) for e in engines.engines] == [("engine-0", SERVING), ("engine-1", SERVING)]
    assert not engines.rolling and engines.unexpected_exit() is None
    assert "engine-2, rolled in for engine-0, exited with 3; the roll stops, the old engines serve on" in \
        capsys.readouterr().err
    with httpx.Client() as client:
        engines.progress(client)  # and no new engine is rolled in for them
    assert len(engines.engines) == 2


def test_the_settings_check_reads_the_settings_as_a_started_process_reads_its_file() -> None:
    """An engine reads its settings from its file, which keeps a null: the check must refuse what that engine would
    (the loaders' override dicts drop None as "flag not given", so checked as overrides this edit would pass)."""
    router = {"pods": ["http://127.0.0.1:1"]}
    assert load_config(None, {"max_num_seqs": None}).max_num_seqs == EngineConfig.max_num_seqs  # dropped
    assert (_settings_problem({"max_num_seqs": None}, router) or "").startswith("the engine's: ")
    assert _settings_problem({"max_num_seqs": 7}, router) is None


def test_a_failed_roll_puts_back_the_settings_new_engines_start_from(
        sleeper: subprocess.Popen[bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rolled-in engine can die of settings the check passed (a model that does not fit, a port taken...): the
    engines the scaler starts next must not start from the files that failed, and the next edit is compared with
    what the engines run."""
    pool_file, workdir = tmp_path / "pool.yaml", tmp_path / "work"
    workdir.mkdir()
    write_pool(pool_file, engines=1, blocks=64, rate=60)
    plan = plan_from_file(pool_file)
    engines = LocalEngines(plan, [], workdir, None)
    engines.engines = [engine("engine-0", sleeper, tmp_path)]
    _write_engine_files(workdir, plan.engine, plan.pool)  # as run_pool writes them (a simulated pool: no defaults)
    _write_router_file(workdir, _router_section(workdir, plan.name, plan.router, engines.pods_file))
    watch = _ScalingWatch(plan, engines)
    files = [workdir / "engine.yaml", workdir / "engine-scaled.yaml", workdir / "router.yaml"]

    def blocks_in_files() -> list[int]:
        return [yaml.safe_load(f.read_text())["engine"]["kv_cache_blocks"] for f in files[:2]]

    try:
        watch.follow_file()  # the first poll: the pool as started, no edit
        before = [f.read_text() for f in files]
        write_pool(pool_file, engines=1, blocks=96, rate=120)
        watch.follow_file()
        assert blocks_in_files() == [96, 96] and engines.rolling and engines.router_changes
        failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])  # the new engine, dead at start
        failed.wait()
        surge = engine("engine-1", failed, tmp_path, STARTING)
        surge.replaces, surge.generation = "engine-0", engines.generation
        engines.engines.append(surge)
        with httpx.Client() as client:
            engines.progress(client)
        assert [f.read_text() for f in files] == before and blocks_in_files() == [64, 64]
        assert not engines.rolling and not engines.router_changes  # nor is the router restarted for the edit
        assert "the pool runs on its spec from before the roll" in capsys.readouterr().err
        write_pool(pool_file, engines=1, blocks=96, rate=120)  # saved again: tried again, against what runs
        watch.follow_file()
        assert blocks_in_files() == [96, 96] and engines.rolling == {"engine.yaml kv_cache_blocks"}
    finally:
        watch.close()


POOL = """
apiVersion: kvmesh.io/v1alpha1
kind: InferencePool
metadata: {{name: roll}}
spec:
  model: {{source: bundled}}
  engine: {{settings: {{kv_cache_blocks: {blocks}}}}}
  router: {{settings: {{tenants: {{default: {{requests_per_minute: {rate}}}}}}}}}
  replicas:
    both: {{min: {engines}, max: {engines}}}
  scaling: {{intervalSeconds: {interval}}}
"""


def write_pool(path: Path, engines: int, blocks: int, rate: int, interval: int = 1) -> None:
    """Saved as editors save: a new file renamed over the old one."""
    partial = path.with_suffix(".partial")
    partial.write_text(POOL.format(engines=engines, blocks=blocks, rate=rate, interval=interval))
    os.replace(partial, path)


def start(tmp_path: Path, engines: int, blocks: int, rate: int) -> tuple[object, str, Path, Path, Path]:
    pool_file, port = tmp_path / "pool.yaml", free_port()
    ready, targets, log = tmp_path / "ready", tmp_path / "targets.json", tmp_path / "up.log"
    write_pool(pool_file, engines, blocks, rate)
    proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "-f", str(pool_file), "--sim", "--port", str(port),
                   "--ready-file", str(ready), "--targets-file", str(targets)], log)
    wait_for(ready.exists, "the pool to be ready", proc, log)  # type: ignore[arg-type]
    return proc, f"http://127.0.0.1:{port}", pool_file, targets, log


def blocks(engine: str, log: Path) -> int:
    return httpx.get(engine + "/v1/kv/config", headers=pool_headers(log), timeout=10).json()["num_device_blocks"]


def answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
        return True
    except httpx.TransportError:
        return False


PROMPT = list(range(1, 41))  # shared by every request: a prefix the engines reuse, so a new one has one to copy


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_engine_setting_edit_rolls_the_engines_one_at_a_time_under_load(tmp_path: Path) -> None:
    proc, url, pool_file, targets, log = start(tmp_path, engines=2, blocks=64, rate=60000)
    try:
        old = engine_urls(targets)
        assert sorted(old) == ["engine-0", "engine-1"] and {blocks(u, log) for u in old.values()} == {64}
        load = Load(url, lambda worker, n: PROMPT)
        try:
            wait_for(lambda: load.sent >= 6, "requests before the edit", proc, log)  # type: ignore[arg-type]
            write_pool(pool_file, engines=2, blocks=96, rate=60000, interval=2)  # and a live part: the interval
            wait_for(lambda: "engines rolled" in log.read_text(), "the roll to end", proc, log)  # type: ignore
            sent_during_roll = load.sent
        finally:
            load.stop()
        out = log.read_text()
        assert "changed: following it (replicas both 2..2; adapters none; rolling the engines for engine.yaml " \
               "kv_cache_blocks)" in out, out
        assert sample(operator_url(targets), OperatorMetric.EVALUATION_INTERVAL, pool="roll") == 2  # the live part
        assert load.failed == [] and sent_during_roll > 6, (load.failed, out[-3000:])
        assert "rolling engine-0 -> engine-2 (both; settings changed: engine.yaml kv_cache_blocks)" in out, out
        assert "rolling engine-1 -> engine-3 (both; settings changed: engine.yaml kv_cache_blocks)" in out, out
        # one at a time: the second starts only after the first new one is routed to and its old one drains
        assert out.index("rolling engine-0") < out.index("draining engine-0") < out.index("rolling engine-1"), out
        assert any("warm-up:" in line and "engine-2" in line for line in out.splitlines()), out  # from a peer
        wait_for(lambda: sorted(engine_urls(targets)) == ["engine-2", "engine-3"], "the pods file to hold only the "
                 "new engines", proc, log)  # type: ignore[arg-type]
        assert all(blocks(u, log) == 96 for u in engine_urls(targets).values())
        wait_for(lambda: not any(answers(u) for u in old.values()), "the old engines to stop", proc, log)  # type: ignore
        pods = json.loads((tmp_path / "targets.json").read_text())
        assert len([t for t in pods if t["labels"].get("role") == "both"]) == 2  # the replica count kept
        assert proc.poll() is None  # type: ignore[attr-defined]
    finally:
        stop_up(proc, log)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_router_setting_edit_restarts_the_router_on_its_port_after_the_engines(tmp_path: Path) -> None:
    proc, url, pool_file, targets, log = start(tmp_path, engines=1, blocks=64, rate=6000)
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 400, "stream": True}  # about 20 s: it outlasts the engines' roll
    try:
        reply = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=60)
        assert reply.headers["x-ratelimit-limit-requests"] == "6000"
        tokens, done = 0, False
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            assert stream.status_code == 200
            for event in events(stream.iter_lines()):
                if event == "[DONE]":
                    done = True
                    break
                assert "error" not in event, event
                tokens += len(event["choices"])
                if tokens == 5:  # engines and router at once: the engines first
                    write_pool(pool_file, engines=1, blocks=96, rate=12000)
                    wait_for(lambda: "restarting the router" in log.read_text(), "the router restart", proc,
                             log)  # type: ignore[arg-type]
        assert done and tokens == body["max_tokens"], (tokens, log.read_text()[-3000:])  # it ran to its end
        for line in ("router restarted", "engine-0 stopped"):
            wait_for(lambda line=line: line in log.read_text(), line, proc, log)  # type: ignore[misc, arg-type]
        out = log.read_text()
        assert out.index("engines rolled") < out.index("restarting the router on port"), out
        # the old engine stopped only once the stream was done (its drain waits for it), after the router restarted:
        # so the stream was open on the old router when it got its signal, and still ran to its end
        assert out.index("restarting the router on port") < out.index("engine-0 stopped"), out
        assert "settings changed: router.yaml tenants" in out, out
        reply = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=60)
        assert reply.status_code == 200 and reply.headers["x-ratelimit-limit-requests"] == "12000"
        assert [blocks(u, log) for u in engine_urls(targets).values()] == [96]
        wait_for(lambda: "the previous router exited (0)" in log.read_text(), "the old router to exit", proc,
                 log)  # type: ignore[arg-type]
    finally:
        stop_up(proc, log)  # type: ignore[arg-type]
