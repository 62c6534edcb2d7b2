"""A local pool from start to stop, as a user runs it (one pool of simulated engines for the module, so the suite
stays fast): `kvmesh chat` takes the endpoint `kvmesh up` prints, a second `kvmesh up` on the same port is refused
at once, a hung engine is killed and restarted (liveness), its engines (the restarted one too) answer only callers
holding the pool's internal token while the router serves on (`kvmesh bench serve` sends it from
$KVMESH_INTERNAL_TOKEN_FILE; `kvmesh status` says an engine is no router), and a Ctrl-C leaves nothing behind: no
ready file, no work folder, no host-tier file, no targets (the targets file says `[]`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from kvmesh.cli import main
from kvmesh.engine.internal_token import INTERNAL_TOKEN_FILE_ENV, INTERNAL_TOKEN_HEADER
from kvmesh.engine.protocol import HOST_TIER_DIR
from kvmesh.processes import free_port, launch
from kvmesh.up import INTERNAL_TOKEN_FILE, LIVENESS_ENV

from .test_up_scaling import engine_urls, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@dataclass
class Pool:
    proc: subprocess.Popen[bytes]
    log: Path
    port: int
    ready: Path
    targets: Path

    def said(self) -> str:
        return self.log.read_text()

    def workdir(self) -> Path:
        (folder,) = re.findall(r"\(logs in (\S+)\)", self.said())
        return Path(folder)

    def host_tier_files(self) -> list[Path]:
        """This run's engines' host-tier files (`LocalEngines.tier_paths`: named by the run's work folder)."""
        return sorted(Path(HOST_TIER_DIR).glob(f"{self.workdir().name}-*"))


# One simulated engine with a host KV tier (hostTierMiB): the pool file's model is the bundled one, as --sim needs
POOL = """
apiVersion: kvmesh.io/v1alpha1
kind: InferencePool
metadata: {name: local}
spec:
  model: {source: bundled}
  engine: {hostTierMiB: 8}
  replicas:
    both: {min: 1, max: 1}
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    folder = tmp_path_factory.mktemp("local-pool")
    ready, targets, log, port = folder / "ready", folder / "targets.json", folder / "up.log", free_port()
    pool_file = folder / "pool.yaml"
    pool_file.write_text(POOL)
    os.environ[LIVENESS_ENV] = "3"  # a hung engine goes after 3 s, not 30
    try:
        proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "--sim", "-f", str(pool_file), "--port", str(port),
                       "--ready-file", str(ready), "--targets-file", str(targets)], log)
    finally:
        del os.environ[LIVENESS_ENV]
    try:
        wait_for(ready.exists, "the pool to be ready", proc, log, timeout=180)
        yield Pool(proc, log, port, ready, targets)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_chat_takes_the_endpoint_kvmesh_up_wrote(pool: Pool, capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = pool.ready.read_text()
    assert endpoint == f"http://127.0.0.1:{pool.port}/v1"
    assert main(["chat", "--url", endpoint, "--max-tokens", "4", "--wait", "60", "hello"]) == 0
    assert "completion tokens" in capsys.readouterr().err
    # the model it serves is said as the simulated engines serve it (it used to say the bundled model's name)
    assert "kvmesh up: simulated engines (cpu-smollm) serve model sim-cpu-smollm" in pool.said()
    assert [m["id"] for m in httpx.get(endpoint + "/models", timeout=10).json()["data"]] == ["sim-cpu-smollm"]


def test_status_takes_the_endpoint_and_says_an_engine_is_no_router(pool: Pool,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`kvmesh status --url` of the endpoint `kvmesh up` prints (it used to answer 404 for /v1), and of an engine
    (it used to say to set $KVMESH_API_KEY for the engine's 401 internal_token_required)."""
    assert main(["status", "--url", pool.ready.read_text()]) == 0
    assert "1 pods, 1 healthy" in capsys.readouterr().out
    (url,) = engine_urls(pool.targets).values()
    assert main(["status", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "is a pool's engine, not a router" in err and "KVMESH_API_KEY" not in err, err


def test_the_simulated_engine_keeps_its_host_tier_in_this_runs_file(pool: Pool) -> None:
    """Named by the run, not by the port (/dev/shm/kvmesh-kv-host-<port>.kv): that one no stop removed, and a later
    run's engine on the same port opened it."""
    (url,) = engine_urls(pool.targets).values()
    port = url.rsplit(":", 1)[1]
    assert [p.name for p in pool.host_tier_files()] == [f"{pool.workdir().name}-engine-0-host.kv"]
    assert not Path(HOST_TIER_DIR, f"kvmesh-kv-host-{port}.kv").exists()


def test_a_second_kvmesh_up_on_the_same_port_is_refused_at_once(pool: Pool, capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    """It used to say "ready" (its health checks reached this pool's router) while its own router crash-looped."""
    ready = tmp_path / "ready"
    assert main(["up", "--sim", "--port", str(pool.port), "--ready-file", str(ready)]) == 2
    assert f"the router's port {pool.port} on 127.0.0.1 cannot be used" in capsys.readouterr().err
    assert not ready.exists() and pool.ready.exists()


def test_a_hung_engine_is_killed_and_restarted(pool: Pool) -> None:
    (url,) = engine_urls(pool.targets).values()
    port = url.rsplit(":", 1)[1]
    (engine,) = [c for c in psutil.Process(pool.proc.pid).children() if port in c.cmdline()]
    engine.send_signal(signal.SIGSTOP)  # alive, silent: exits never
    wait_for(lambda: "engine-0 has not been alive on /livez" in pool.said(), "the liveness kill", pool.proc, pool.log)
    wait_for(lambda: "engine-0 serving (restarts: 1)" in pool.said(), "the restarted engine", pool.proc, pool.log)
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE


def test_the_engines_answer_only_the_pool_and_the_router_serves_on(pool: Pool) -> None:
    """After the restart above (a restarted engine gets the token as its first start did): a request to the engine
    without the pool's token is refused (401), its /health and /metrics stay open, and the router, which sends
    the token, serves. The token is this run's, in its work folder, readable by its owner only."""
    (url,) = engine_urls(pool.targets).values()
    token_file = pool.workdir() / INTERNAL_TOKEN_FILE
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
    assert httpx.post(url + "/v1/completions", json=body, headers={INTERNAL_TOKEN_HEADER: "x" * 43},
                      timeout=30).status_code == 401
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    assert httpx.post(url + "/v1/completions", json=body, headers={INTERNAL_TOKEN_HEADER: token},
                      timeout=30).status_code == 200
    router = f"http://127.0.0.1:{pool.port}"
    wait_for(lambda: httpx.post(router + "/v1/completions", json=body, timeout=30).status_code == 200,
             "the router to answer", pool.proc, pool.log)


def test_bench_serve_measures_an_engine_of_the_pool_with_its_token(
        pool: Pool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/bench.md: `KVMESH_INTERNAL_TOKEN_FILE=<workdir>/internal-token kvmesh bench serve --url ENGINE`.
    Without the token every request is refused (401): nothing completes."""
    (url,) = engine_urls(pool.targets).values()
    argv = ["bench", "serve", "--url", url, "--dataset", "random", "--num-requests", "3", "--input-tokens", "16",
            "--output-tokens", "2", "--concurrency", "1"]
    monkeypatch.delenv(INTERNAL_TOKEN_FILE_ENV, raising=False)
    assert main(argv) == 1
    monkeypatch.setenv(INTERNAL_TOKEN_FILE_ENV, str(pool.workdir() / INTERNAL_TOKEN_FILE))
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    monkeypatch.setenv(INTERNAL_TOKEN_FILE_ENV, str(pool.workdir() / "no-such-file"))
    assert main(argv) == 2 and f"kvmesh bench serve: ${INTERNAL_TOKEN_FILE_ENV}:" in capsys.readouterr().err


def test_ctrl_c_leaves_no_ready_file_and_no_work_folder(pool: Pool) -> None:
    """The module's last use of the pool: it stops it. Nothing of the run is left: no work folder, no host-tier
    file, and the targets file lists nothing (Prometheus drops the targets: no KvmeshEngineDown for a stopped
    pool)."""
    workdir = pool.workdir()
    assert workdir.is_dir() and (workdir / "router.log").exists()
    assert pool.host_tier_files()
    assert json.loads(pool.targets.read_text())
    pool.proc.send_signal(signal.SIGINT)
    assert pool.proc.wait(timeout=120) == 0, pool.said()[-3000:]
    assert not pool.ready.exists() and not workdir.exists(), pool.said()[-3000:]
    assert "logs kept in" not in pool.said()
    assert not pool.host_tier_files()
    assert json.loads(pool.targets.read_text()) == []
