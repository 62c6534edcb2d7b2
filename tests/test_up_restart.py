"""`kvmesh up` survives a crashed child as a Deployment does: an engine or the router that exits unasked is
restarted on its port after a back-off (1 s doubling to 60 s, started over after 10 minutes of running:
kvmesh/up.py `CrashBackOff`) while the router serves on from the other engines; the restarted engine finds its
host KV tier (the file in /dev/shm that `kvmesh up` names by its run and the engine, removed when the pool
stops). A child stopped on purpose (drained, scaled in, rolled out) is never restarted, and a child that dies
before the pool is first ready stops `kvmesh up`. The policy and
the state machine are tested first, on records of engines whose processes are only polled; then a real pool of two
tiny engines is killed into (one pool for the module)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

import kvmesh.up as up
from kvmesh.engine.protocol import HOST_TIER_DIR, KV_BLOCKS_PATH, Metric
from kvmesh.processes import free_port, launch
from kvmesh.up import (
    CRASHED,
    SERVING,
    STARTING,
    Child,
    CrashBackOff,
    LocalEngines,
    plan_from_file,
)

from .engines import stop_up
from .test_up_observe import EXAMPLES, engine
from .test_up_scaling import engine_urls, pool_headers, sample, wait_for


def test_the_back_off_doubles_from_a_second_to_a_minute_and_starts_over_after_ten_minutes_of_running() -> None:
    backoff = CrashBackOff(started=0.0)
    delays, now = [], 0.0
    for _ in range(9):
        now += 5.0  # each life ends 5 s after it started
        delays.append(backoff.crashed(now))
        assert backoff.due == now + delays[-1]
        now = backoff.due
        backoff.restarted(now)
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert backoff.restarts == 9 and backoff.due is None
    assert backoff.crashed(now + 599.0) == 60  # not quite 10 minutes: still a crash loop
    backoff.restarted(now + 660.0)
    assert backoff.crashed(now + 660.0 + 600.0) == 1  # ran 10 minutes: a new count
    backoff.restarted(now + 1261.0)
    assert backoff.crashed(now + 1262.0) == 2


def exited(code: int = 3) -> subprocess.Popen[bytes]:
    """A child process that has exited with `code` (a crash, as its parent sees it)."""
    proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    proc.wait()
    return proc


def pods_file_urls(engines: LocalEngines) -> list[str]:
    return [pod["url"] for pod in json.loads(engines.pods_file.read_text())["pods"]]


def test_a_crashed_engine_leaves_the_pods_file_and_starts_again_with_its_command_line_after_its_back_off(
        sleeper: subprocess.Popen[bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engines = LocalEngines(plan_from_file(EXAMPLES / "aggregated.yaml"), [], tmp_path, None)
    crashed = engine("engine-1", exited(), tmp_path)
    crashed.child.args = ["--version"]  # restarted, it runs `kvmesh --version`: a real process that exits at once
    crashed.child.log.write_text("loading\nout of memory\n")
    engines.engines = [engine("engine-0", sleeper, tmp_path), crashed]
    engines.generation = 4  # a roll under way
    now = time.monotonic()
    assert engines._restart_crashed(now) is True  # it served: the pods file changes
    engines.publish()
    assert crashed.state == CRASHED and pods_file_urls(engines) == ["http://engine-0"]
    assert engines.replicas() == {"both": 2}  # it comes back: the scaler adds no engine for it
    said = capsys.readouterr().err
    assert "engine-1 exited with 3 unasked (both, serving); the router serves on from the others; restart 1 in 1 s " \
           "on http://engine-1:" in said and "out of memory" in said

    dead = crashed.child.process
    engines._restart_crashed(now + 0.9)
    assert crashed.state == CRASHED and crashed.child.process is dead  # still backing off
    engines._restart_crashed(now + 1.0)
    assert crashed.state == STARTING and crashed.child.process is not dead
    assert crashed.child.process.args[-1] == "--version" and crashed.child.backoff.restarts == 1
    assert crashed.generation == 4  # it reads the engine files as they are now: nothing to roll
    assert "engine-1 restarting (restart 1) on http://engine-1" in capsys.readouterr().err
    crashed.child.process.wait(timeout=60)
    assert crashed.child.log.read_text().startswith("loading\nout of memory\n")  # appended, not replaced
    assert "kvmesh" in crashed.child.tail()

    engines._restart_crashed(now + 2.0)  # it crashed again: twice the delay
    assert crashed.state == CRASHED and "restart 2 in 2 s" in capsys.readouterr().err


def test_a_child_stopped_or_leaving_on_purpose_is_never_restarted(
        sleeper: subprocess.Popen[bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engines = LocalEngines(plan_from_file(EXAMPLES / "aggregated.yaml"), [], tmp_path, None)
    draining = engine("engine-1", exited(1), tmp_path)
    engines.engines = [engine("engine-0", sleeper, tmp_path), draining]
    engines._retire(draining)  # a scale-in: it drains, and dies before `progress` stops it
    with httpx.Client() as client:
        engines.progress(client)
        assert [e.child.name for e in engines.engines] == ["engine-0"]
        assert "engine-1 exited with 1 while draining: not restarted" in capsys.readouterr().err

        # a crashed engine is the first the scaler removes (as a ReplicaSet removes a pod not ready first), and
        # it is not restarted then
        crashed = engine("engine-2", exited(), tmp_path)
        engines.engines.append(crashed)
        engines.progress(client)
        assert crashed.state == CRASHED
        engines.scale("both", 1, {"engine-0": 0, "engine-2": 10})
        assert [(e.child.name, e.state) for e in engines.engines] == [("engine-0", SERVING)]
        assert "engine-2 (both), crashed, is not restarted: it leaves the pool" in capsys.readouterr().err


def test_a_crashed_engine_a_roll_replaces_is_retired_and_the_roll_goes_on(
        sleeper: subprocess.Popen[bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    engines = LocalEngines(plan_from_file(EXAMPLES / "aggregated.yaml"), [], tmp_path, None)
    engines.engines = [engine("engine-0", exited(), tmp_path)]
    engines.roll(["engine.yaml max_num_seqs"], [])
    surge = engine("engine-1", sleeper, tmp_path)  # rolled in for engine-0, serving
    surge.replaces, surge.generation = "engine-0", engines.generation
    engines.engines.append(surge)
    engines.router = Child("router", "http://router", sleeper, tmp_path / "router.log")
    monkeypatch.setattr(up, "_routed", lambda client, url: [surge.child.url])  # the router routes to the surge
    with httpx.Client() as client:
        engines.progress(client)  # engine-0 crashed, and its surge is routed: it takes engine-0's place
    assert [(e.child.name, e.state) for e in engines.engines] == [("engine-1", SERVING)]
    assert not engines.rolling and surge.replaces is None
    assert "engines rolled: every engine runs the new settings" in capsys.readouterr().err


def test_a_crashed_router_restarts_on_its_port_before_any_restart_for_its_settings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engines = LocalEngines(plan_from_file(EXAMPLES / "aggregated.yaml"), [], tmp_path, None)
    router = Child("router", "http://127.0.0.1:1", exited(), tmp_path / "router.log", ["--version"])
    engines.router, engines.router_changes = router, {"router.yaml retries"}
    now = time.monotonic()
    engines._restart_crashed(now)
    assert router.waiting and "router exited with 3 unasked; clients cannot connect until it is back; restart 1 in " \
                              "1 s on http://127.0.0.1:1" in capsys.readouterr().err
    with httpx.Client() as client:
        engines._restart_router(client)  # the edit's restart waits for the crashed one's
    assert engines.router is router and not engines.old_routers
    engines._restart_crashed(now + 1.0)
    assert engines.router is router and not router.waiting and engines.router_starting
    assert router.process.args[-1] == "--version" and router.backoff.restarts == 1
    router.process.wait(timeout=60)


# ------------------------------------------------------------------------------------------------------------------
# A real pool: two tiny engines with a host KV tier, killed into
# ------------------------------------------------------------------------------------------------------------------

POOL = """
apiVersion: kvmesh.io/v1alpha1
kind: InferencePool
metadata: {{name: crashy}}
spec:
  model: {{source: {model}, dtype: float32}}
  engine: {{kvCacheMemoryMiB: 16, hostTierMiB: 16}}
  replicas:
    both: {{min: 2, max: 2}}
"""


@dataclass
class Pool:
    proc: subprocess.Popen[bytes]
    log: Path
    url: str
    engines: dict[str, str]  # name -> URL, as the pool started

    def said(self, text: str) -> bool:
        return text in self.log.read_text()

    def wait_said(self, text: str, timeout: float = 120.0) -> None:
        wait_for(lambda: self.said(text), repr(text), self.proc, self.log, timeout)

    def kill(self, url: str) -> None:
        """SIGKILL the child listening on `url`'s port (an engine's or the router's)."""
        port = url.rsplit(":", 1)[1]
        (child,) = [c for c in psutil.Process(self.proc.pid).children() if port in c.cmdline()]
        child.kill()

    def tier_files(self) -> list[Path]:
        """The KV tier files of this run's engines (`LocalEngines.tier_paths`: named by the run's work folder)."""
        (workdir,) = re.findall(r"\(logs in (\S+)\)", self.log.read_text())
        return [p for folder in (Path(HOST_TIER_DIR), up.DISK_TIER_DIR) for p in folder.glob(f"{Path(workdir).name}-*")]

    def headers(self) -> dict[str, str]:
        """The pool's internal token, for calls to its engines (`pool_headers`)."""
        return pool_headers(self.log)

    def routed(self) -> list[str]:
        try:
            return httpx.get(self.url + "/health", timeout=5).json()["pods"]
        except (httpx.TransportError, ValueError):
            return []


@pytest.fixture(scope="module")
def pool(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    folder = tmp_path_factory.mktemp("up-restart")
    pool_file, ready, targets, log = (folder / name for name in ("pool.yaml", "ready", "targets.json", "up.log"))
    pool_file.write_text(POOL.format(model=tiny_dir))
    port = free_port()
    proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "-f", str(pool_file), "--port", str(port),
                   "--ready-file", str(ready), "--targets-file", str(targets)], log)
    started: Pool | None = None
    try:
        wait_for(ready.exists, "the pool to be ready", proc, log, timeout=300)
        started = Pool(proc, log, f"http://127.0.0.1:{port}", engine_urls(targets))
        yield started
        stop_up(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for path in started.tier_files() if started is not None else []:  # a failed test's: `kvmesh up` was killed
            path.unlink(missing_ok=True)


def answered(url: str, prompt: list[int], attempts: int = 5) -> bool:
    """Whether a completion through the router is answered 200 within `attempts` tries (a client's retries)."""
    for _ in range(attempts):
        try:
            if httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60).is_success:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return False


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_engine_comes_back_on_its_port_with_its_host_tier_while_the_router_serves_on(pool: Pool) -> None:
    victim = pool.engines["engine-1"]
    prompt = list(range(100, 180))
    reply = httpx.post(victim + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=pool.headers(),
                       timeout=60)
    assert reply.status_code == 200
    token = pool.headers()
    wait_for(lambda: len(httpx.get(victim + KV_BLOCKS_PATH, headers=token, timeout=5).json()["blocks"].get("host", []))
             > 0,
             "the host tier's write-through", pool.proc, pool.log)
    hosted = len(httpx.get(victim + KV_BLOCKS_PATH, headers=token, timeout=5).json()["blocks"]["host"])
    assert sorted(p.name.split("-", 3)[-1] for p in pool.tier_files()) == ["engine-0-host.kv", "engine-1-host.kv"]

    pool.kill(victim)
    for k in range(8):  # the router serves on from engine-0 while engine-1 is down
        assert answered(pool.url, [7, 8, 9, k]), pool.log.read_text()[-3000:]
    pool.wait_said("engine-1 exited with -9 (SIGKILL) unasked (both, serving)")
    assert pool.said("; restart 1 in 1 s on " + victim)
    pool.wait_said("engine-1 serving (restarts: 1)")
    wait_for(lambda: victim in pool.routed(), "the router to route to engine-1 again", pool.proc, pool.log)
    assert sample(victim, f"{Metric.KV_TIER_RECOVERED}_total", tier="host") == hosted  # the same file, found again
    assert pool.proc.poll() is None


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_engine_killed_again_and_again_backs_off_longer_each_time(pool: Pool) -> None:
    victim = pool.engines["engine-0"]
    pool.kill(victim)
    pool.wait_said("engine-0 restarting (restart 1)")
    pool.kill(victim)  # while it starts
    pool.wait_said("engine-0 restarting (restart 2)")
    pool.kill(victim)
    pool.wait_said("engine-0 serving (restarts: 3)")
    crashes = r"engine-0 exited with -9 \(SIGKILL\) unasked .*; restart (\d+) in (\S+) s"
    delays = re.findall(crashes, pool.log.read_text())
    assert delays == [("1", "1"), ("2", "2"), ("3", "4")]
    wait_for(lambda: set(pool.engines.values()) <= set(pool.routed()), "both engines routed", pool.proc, pool.log)
    assert answered(pool.url, [1, 2, 3])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_router_comes_back_on_its_port(pool: Pool) -> None:
    pool.kill(pool.url)
    pool.wait_said("router exited with -9 (SIGKILL) unasked; clients cannot connect until it is back; restart 1")
    pool.wait_said(f"router restarted: serving on {pool.url}")
    assert answered(pool.url, [4, 5, 6])
    assert pool.proc.poll() is None


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ctrl_c_stops_the_pool_with_an_engine_waiting_in_its_back_off(pool: Pool) -> None:
    """The module's last use of the pool: it stops it."""
    victim = pool.engines["engine-1"]
    pool.kill(victim)
    pool.wait_said("engine-1 exited with -9 (SIGKILL) unasked (both, serving); the router serves on from the others; "
                   "restart 2 in 2 s")
    pool.proc.send_signal(signal.SIGINT)
    assert pool.proc.wait(timeout=120) == 0, pool.log.read_text()[-3000:]
    assert pool.tier_files() == []  # the host tiers are caches of this run's engines: gone with them
    for url in [pool.url, *pool.engines.values()]:  # every child is gone, the one in back-off not restarted after
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_child_that_dies_before_the_pool_is_ready_stops_kvmesh_up(tmp_path: Path) -> None:
    """A model folder without a tokenizer: the router exits at start, and the engine's load fails (its /health says
    so): neither could do better on a retry, so `kvmesh up` says why (whichever it saw first), exits 1 and keeps
    its work folder (the logs say why). (A port someone holds is refused before anything starts:
    tests/test_local_cli.py.)"""
    model, log, ready = tmp_path / "model", tmp_path / "up.log", tmp_path / "ready"
    model.mkdir()
    (model / "config.json").write_text("{}")
    proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "--engines", "1", "--model", str(model), "--port",
                   str(free_port()), "--ready-file", str(ready)], log)
    try:
        assert proc.wait(timeout=180) == 1, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    said = log.read_text()
    router = "kvmesh up: router exited with 2:" in said and "has no tokenizer.json" in said
    engine = "kvmesh up: engine-0 could not load its model:" in said and "the model could not be loaded" in said
    assert router or engine, said[-3000:]
    (kept,) = re.findall(r"kvmesh up: logs kept in (\S+)", said)
    assert (Path(kept) / "router.log").exists() and not ready.exists()
    shutil.rmtree(kept)
