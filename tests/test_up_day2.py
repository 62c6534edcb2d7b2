"""`kvmesh up` on the second day: what a killed run leaves (its work folder, its engines' KV tier files, its targets
in the Prometheus targets file it wrote) goes at the next start, never a live run's; closing the terminal (SIGHUP)
stops the pool as SIGTERM does, cleaning up; a crashed engine whose port was taken meanwhile restarts on another."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from kvmesh import cli, up
from kvmesh.processes import free_port, launch, wait_healthy, write_json_atomically
from kvmesh.router.app import Drain, RouterServer, build_router, create_router_app
from kvmesh.router.config import RouterConfig
from kvmesh.up import (
    CRASHED,
    STATE_DIR_ENV,
    TARGETS_RECORD,
    UP_PID_FILE,
    Child,
    Engine,
    LocalEngines,
    PoolPlan,
    ready_message,
    remove_leftovers,
)


def _run(temp: Path, tiers: Path, name: str, pid: int | None) -> Path:
    """A fake run's work folder (with a pid file naming `pid`, if any) and a host tier file of its engine."""
    workdir = temp / f"kvmesh-local-{name}"
    workdir.mkdir()
    (workdir / "router.log").write_text("log")
    if pid is not None:
        (workdir / UP_PID_FILE).write_text(str(pid))
    (tiers / f"{workdir.name}-engine-0-host.kv").write_bytes(b"\0" * 16)
    return workdir


def test_a_killed_runs_leftovers_go_and_a_live_or_kept_runs_stay(tmp_path: Path) -> None:
    temp, tiers = tmp_path / "tmp", tmp_path / "shm"
    temp.mkdir()
    tiers.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now
    killed = _run(temp, tiers, "killed", gone.pid)
    live = _run(temp, tiers, "live", os.getpid())
    kept = _run(temp, tiers, "kept", None)  # stopped with --keep-logs: no pid file
    assert remove_leftovers(temp, [tiers]) == [killed]
    assert not killed.exists() and live.exists() and kept.exists()
    left = sorted(p.name for p in tiers.iterdir())
    assert left == sorted(f"{run.name}-engine-0-host.kv" for run in (live, kept))


def test_a_killed_runs_targets_are_emptied_at_the_next_start_unless_another_run_wrote_the_file_since(
        tmp_path: Path) -> None:
    """A killed run's targets file listed its dead processes until a run started with the same --targets-file
    was ready (Prometheus fired KvmeshEngineDown meanwhile, and for good if no run wrote it again)."""
    temp, tiers = tmp_path / "state", tmp_path / "shm"
    temp.mkdir()
    tiers.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    files = {}
    for name, router, pid in (("killed", "127.0.0.1:21001", gone.pid), ("rewritten", "127.0.0.1:21002", gone.pid),
                              ("live", "127.0.0.1:21003", os.getpid())):
        workdir = _run(temp, tiers, name, pid)
        files[name] = tmp_path / f"{name}-targets.json"
        (workdir / TARGETS_RECORD).write_text(json.dumps({"path": str(files[name]), "router": router}))
        files[name].write_text(json.dumps([{"targets": [router], "labels": {"pod": "router"}}]))
    since = [{"targets": ["127.0.0.1:21999"], "labels": {"pod": "router"}}]  # another run's, written since
    files["rewritten"].write_text(json.dumps(since))
    remove_leftovers(temp, [tiers])
    assert json.loads(files["killed"].read_text()) == []
    assert json.loads(files["rewritten"].read_text()) == since
    assert "127.0.0.1:21003" in files["live"].read_text()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sighup_stops_the_pool_and_cleans_up(tmp_path: Path) -> None:
    temp, ready, log = tmp_path / "state", tmp_path / "ready", tmp_path / "up.log"
    temp.mkdir()
    env = {STATE_DIR_ENV: str(temp)}  # its work folder goes there, where the test looks for it
    # as from a terminal's shell: SIGHUP at its default (a test run under nohup ignores it, and so would its child,
    # which then rightly keeps running when SIGHUP comes)
    kept = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "--sim", "--engines", "1", "--port",
                       str(free_port()), "--ready-file", str(ready)], log, env=env)
    finally:
        signal.signal(signal.SIGHUP, kept)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert [p.name for p in temp.iterdir() if p.name.startswith("kvmesh-")], "no work folder while it runs"
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not ready.exists()
    assert not [p for p in temp.iterdir() if p.name.startswith("kvmesh-")], log.read_text()[-3000:]


def test_a_stale_ready_file_goes_before_anything_else(tmp_path: Path) -> None:
    """Removed first thing, before `kvmesh up` loads its modules (seconds, during which a script waiting on the file
    took a killed run's pool for this one): here the run is refused at its first check and the file is gone."""
    ready = tmp_path / "ready"
    ready.write_text("http://127.0.0.1:19299/v1")  # a killed run's
    assert cli.main(["up", "--sim", "--port", "0", "--ready-file", str(ready)]) == 2
    assert not ready.exists()


def test_an_engine_whose_port_was_taken_restarts_on_a_free_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crashed engine whose port another process took while it was down would crash-loop on it for good."""
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    started: list[list[str]] = []
    monkeypatch.setattr(up, "spawn", lambda args, log, **kw: started.append(list(args)) or exited)
    engines = LocalEngines(PoolPlan(), ["sim-engine"], tmp_path, None)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        child = Child("engine-0", f"http://127.0.0.1:{taken}", exited, tmp_path / "engine-0.log",
                      ["sim-engine", "--port", str(taken)])
        child.backoff.due = 0.0
        engines.engines.append(Engine(child, "both", state=CRASHED))
        engines._restart_crashed(time.monotonic())
    port = int(started[0][started[0].index("--port") + 1])
    assert port != taken and child.url == f"http://127.0.0.1:{port}"


@pytest.mark.slow
def test_a_request_held_at_zero_engines_gets_a_503_at_once_when_the_router_stops(tiny_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """A Ctrl-C while the router held a request for a pool at zero engines: the client waited out the drain (~26 s)
    and got uvicorn's plain-text 500; it gets the JSON 503 no_pod with Retry-After at once."""
    pods_file = tmp_path / "pods.json"
    write_json_atomically(pods_file, {"pods": []})
    router = build_router(RouterConfig(pods_file=str(pods_file), scrape_interval_seconds=0.1,
                                       hold_without_pods_seconds=120), tiny_dir)
    port, drain = free_port(), Drain()
    server = RouterServer(uvicorn.Config(create_router_app(router, drain), host="127.0.0.1", port=port,
                                         log_level="warning", timeout_graceful_shutdown=30), drain)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=30)
        replies: list[httpx.Response] = []
        client = threading.Thread(target=lambda: replies.append(httpx.post(
            url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)), daemon=True)
        client.start()
        deadline = time.monotonic() + 10
        while router.pod_wait is not None and router.pod_wait.held == 0:
            assert time.monotonic() < deadline, "the request was not held"
            time.sleep(0.05)
        stopped = time.monotonic()
        server.handle_exit(signal.SIGINT, None)  # as at a Ctrl-C
        client.join(timeout=60)
        assert time.monotonic() - stopped < 5
        assert replies[0].status_code == 503, replies[0].text
        assert replies[0].json()["error"]["code"] == "no_pod"
        assert int(replies[0].headers["retry-after"]) > 0
    finally:
        server.should_exit = True
        thread.join(timeout=40)


def test_the_ready_line_says_how_to_try_and_stop_the_pool() -> None:
    one = ready_message("x", 1, "http://127.0.0.1:19201/v1")
    assert one.splitlines()[0] == "kvmesh up: pool 'x' ready: 1 engine behind http://127.0.0.1:19201/v1"
    assert "kvmesh chat --url http://127.0.0.1:19201 " in one and "curl http://127.0.0.1:19201/v1/models" in one
    assert "Ctrl-C stops" in one
    assert "ready: 2 engines behind" in ready_message("x", 2, "http://127.0.0.1:19201/v1")
