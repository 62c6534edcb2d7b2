"""The local-mode commands refuse bad input at once, in one line, and fail without a traceback: `kvmesh up` checks
its flags, the router's port, the files it will write and the model before it starts anything (exit status 2);
`kvmesh chat` takes the URL `kvmesh up` prints, says what it waits for, and turns a broken or odd answer into one
line; `kvmesh status --watch` outlives a failed poll. Fast: no pool starts here (tests/test_local_pool.py starts
one); the servers are small stand-ins on loopback, and the pieces of kvmesh/up.py that need a process get a
sleeping one."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

import kvmesh.status
import kvmesh.up as up
from kvmesh.cli import main
from kvmesh.engine.protocol import HOST_TIER_DIR
from kvmesh.router.config import load_router_config
from kvmesh.up import CRASHED, SERVING, Child, Engine, LocalEngines, PoolPlan, plan_from_file

from .test_up_observe import EXAMPLES

pytestmark = pytest.mark.timeout(60)  # what used to wait ten minutes fails here instead


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def signals() -> Iterator[None]:
    """`run_pool` installs its own SIGINT and SIGTERM handlers: put pytest's back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


# ------------------------------------------------------------------------------------------------------------------
# kvmesh up: bad input, refused before anything starts
# ------------------------------------------------------------------------------------------------------------------

def test_up_sim_refuses_a_pool_files_model_that_is_not_bundled(capsys: pytest.CaptureFixture[str]) -> None:
    """It used to say "give no model with --sim" to a user who gave no --model: the pool file names one."""
    code, _, err = run_cli(capsys, "up", "--sim", "-f", str(EXAMPLES / "lora.yaml"))
    assert code == 2 and err.startswith("kvmesh up: with --sim the pool file's model.source must be bundled (the "
                                        "simulated engines load no weights)") and len(err.splitlines()) == 1, err
    code, _, err = run_cli(capsys, "up", "--sim", "--model", "/models/m")
    assert code == 2 and "give no --model with --sim" in err


@pytest.mark.parametrize("port", ["0", "65536", "-1"])
def test_up_refuses_a_port_out_of_range(capsys: pytest.CaptureFixture[str], port: str) -> None:
    code, _, err = run_cli(capsys, "up", "--sim", f"--port={port}")
    assert code == 2 and err == f"kvmesh up: --port {port}: a port is a number from 1 to 65535\n"


def test_up_refuses_a_port_something_listens_on(capsys: pytest.CaptureFixture[str]) -> None:
    """Another `kvmesh up` (or any server) holds it: its health checks would have found that one's router."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_cli(capsys, "up", "--sim", "--port", str(port))
    assert code == 2 and not out
    assert err.startswith(f"kvmesh up: the router's port {port} on 127.0.0.1 cannot be used (") and "--port" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("flag", ["--ready-file", "--targets-file"])
def test_up_refuses_a_file_it_could_not_write(capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str) -> None:
    missing = tmp_path / "no-such-folder" / "file"
    port = str(free_loopback_port())
    code, _, err = run_cli(capsys, "up", "--sim", "--port", port, flag, str(missing))
    assert code == 2 and err == f"kvmesh up: {flag} {missing}: there is no folder {missing.parent}\n"
    code, _, err = run_cli(capsys, "up", "--sim", "--port", port, flag, str(tmp_path))
    assert code == 2 and err == f"kvmesh up: {flag} {tmp_path}: is a folder\n"


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_up_refuses_engines_for_a_disaggregated_pool(capsys: pytest.CaptureFixture[str]) -> None:
    """Its engines are two roles' replicas: `--engines 1` used to start one prefill engine and no decode one, and
    `--engines 3` to fail with an IndexError."""
    for n in ("1", "3"):
        code, _, err = run_cli(capsys, "up", "-f", str(EXAMPLES / "disaggregated.yaml"), "--engines", n)
        assert code == 2 and err.startswith("kvmesh up: --engines does not apply to a disaggregated pool")
        assert "spec.replicas" in err and len(err.splitlines()) == 1


def test_up_keeps_engines_within_the_pool_files_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    low, high = plan_from_file(EXAMPLES / "aggregated.yaml").pool.bounds("both")
    for n in (low - 1, high + 1):
        code, _, err = run_cli(capsys, "up", "-f", str(EXAMPLES / "aggregated.yaml"), "--engines", str(n))
        assert code == 2 and f"--engines {n} is outside" in err and f"({low}..{high})" in err


def test_up_says_in_one_line_that_a_model_cannot_be_found(
        capsys: pytest.CaptureFixture[str], signals: None, tmp_path: Path) -> None:
    """No traceback: a missing file, a folder without config.json, a pool file whose model.source is missing."""
    empty = tmp_path / "empty"
    empty.mkdir()
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferencePool",
                                    "metadata": {"name": "gone"}, "spec": {"model": {"source": "/nonexistent/m"}}}))
    port = str(free_loopback_port())
    for args, said in ((["--model", "/nonexistent/m.gguf"], "model '/nonexistent/m.gguf' not found"),
                       (["--model", str(empty)], f"model directory {empty} has no config.json"),
                       (["-f", str(pool)], "model '/nonexistent/m' not found")):
        code, _, err = run_cli(capsys, "up", "--port", port, *args)
        assert code == 2 and err.splitlines()[-1].startswith(f"kvmesh up: {said}"), err


def test_up_says_interrupted_at_a_ctrl_c_while_the_model_is_prepared(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, signals: None, tmp_path: Path) -> None:
    def converting(model: str | None) -> Path:
        raise KeyboardInterrupt  # as the Ctrl-C handler `run_pool` installs raises it

    monkeypatch.setattr(up, "resolve_model_dir", converting)
    monkeypatch.setattr(up.tempfile, "tempdir", str(tmp_path))  # where a work folder would be made
    assert up.run_pool(PoolPlan(), free_loopback_port()) == up.INTERRUPTED == 130
    assert capsys.readouterr().err.splitlines()[-1] == "kvmesh up: interrupted"
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------------------------
# kvmesh/up.py's pieces: the router's file, tier files, liveness, whose router answers
# ------------------------------------------------------------------------------------------------------------------

def test_a_local_routers_file_turns_the_tenants_limit_sync_off(tmp_path: Path) -> None:
    """One router: the sync would only write its demand to SQLite every few seconds, idle or not."""
    section = up._router_section(tmp_path, "local", {"rate_limit_sync": True}, tmp_path / "pods.json")
    path = up._write_router_file(tmp_path, section)
    config = load_router_config(path)
    assert config.rate_limit_sync is False and config.database_url == f"sqlite:///{tmp_path / up.LOCAL_DATABASE}"


def test_engines_get_kv_tier_files_of_their_own_run_which_go_when_the_pool_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Named by the run and the engine (a restart runs the same command line: the same files), not by a random
    port that no later run will reuse; removed when the engine leaves, or the pool stops."""
    disk_dir = tmp_path / "cache"
    monkeypatch.setattr(up, "DISK_TIER_DIR", disk_dir)
    workdir = tmp_path / "kvmesh-local-abc123"
    workdir.mkdir()
    engines = LocalEngines(PoolPlan(engines=2), ["--version"], workdir, None)  # `kvmesh --version`: exits at once
    started = [engines.start("both") for _ in range(2)]
    for engine in started:
        engine.child.process.wait(timeout=60)
    host, disk = engines.tier_paths("engine-1")
    assert host == Path(HOST_TIER_DIR, "kvmesh-local-abc123-engine-1-host.kv")
    assert disk == disk_dir / "kvmesh-local-abc123-engine-1-disk.kv"
    args = started[1].child.args
    assert args[args.index("--kv-host-path") + 1] == str(host) and args[args.index("--kv-disk-path") + 1] == str(disk)
    disk_dir.mkdir()
    other = disk_dir / "kvmesh-local-other-engine-1-disk.kv"  # another run's
    files = [*engines.tier_paths("engine-0"), host, disk, other]
    try:
        for path in files:
            path.write_bytes(b"kv")
        engines.remove_tier_files("engine-0")
        assert [p.exists() for p in files] == [False, False, True, True, True]
        engines.remove_tier_files()
        assert [p.exists() for p in files] == [False, False, False, False, True]
    finally:
        for path in files:
            path.unlink(missing_ok=True)
    # simulated engines too (a pool file's hostTierMiB gives them a host tier): not the port-named default file,
    # which no stop removed and a later run's engine on the same port opened
    sim_flags = LocalEngines(PoolPlan(sim="cpu-smollm"), [], workdir, None)._tier_flags("engine-0")
    assert sim_flags == ["--kv-host-path", str(files[0]), "--kv-disk-path", str(files[1])]
    from kvmesh.bench.sim_engine import ENGINE_FLAGS

    assert {"kv_host_path", "kv_disk_path"} <= set(ENGINE_FLAGS)  # `kvmesh sim-engine` takes them


def test_a_stopped_pool_empties_its_targets_file_unless_another_run_wrote_it(
        sleeper: subprocess.Popen[bytes], tmp_path: Path) -> None:
    """Left as it was, it listed dead processes: Prometheus's KvmeshEngineDown fired for a pool stopped on purpose.
    `[]` (not a removed file) drops the targets in every Prometheus version."""
    targets, workdir = tmp_path / "targets.json", tmp_path / "work"
    workdir.mkdir()
    engines = LocalEngines(PoolPlan(engines=1), [], workdir, str(targets))
    engines.router = Child("router", "http://127.0.0.1:8123", sleeper, tmp_path / "router.log")
    engine = Engine(Child("engine-0", "http://127.0.0.1:8124", sleeper, tmp_path / "engine.log"), "both", SERVING)
    engines.engines = [engine]
    engines.publish()
    assert "127.0.0.1:8123" in targets.read_text()
    up._clean_up(workdir, engines, None, "http://127.0.0.1:8123/v1", keep=True)
    assert json.loads(targets.read_text()) == []
    other = [{"targets": ["127.0.0.1:9999"], "labels": {"pod": "router"}}]  # another run's, written since
    targets.write_text(json.dumps(other))
    up._clean_up(workdir, engines, None, "http://127.0.0.1:8123/v1", keep=True)
    assert json.loads(targets.read_text()) == other


def test_a_serving_engine_that_stops_answering_is_killed_and_restarted_by_the_back_off(
        sleeper: subprocess.Popen[bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A hung process (kill -STOP, a deadlock) never exits: only its silence tells. Nothing listens on its port."""
    engines = LocalEngines(PoolPlan(engines=1), [], tmp_path, None)
    port = free_loopback_port()
    hung = Engine(Child("engine-0", f"http://127.0.0.1:{port}", sleeper, tmp_path / "engine-0.log"), "both", SERVING)
    engines.engines = [hung]
    now = time.monotonic()
    with httpx.Client() as client:
        engines._check_liveness(client, now)  # never answered: still loading, as far as liveness knows
        assert sleeper.poll() is None and hung.answered is None
        hung.answered, hung.probed = now - engines.liveness_seconds - 1, 0.0
        engines._check_liveness(client, now)
    assert sleeper.poll() is not None
    assert "kvmesh up: engine-0 has not been alive on /livez for " in capsys.readouterr().err
    engines._restart_crashed(now)
    assert hung.state == CRASHED and hung.child.waiting


class Answers(BaseHTTPRequestHandler):
    """A stand-in server: `route(method, path)` gives (status, body bytes), or None to drop the connection."""

    route: Callable[[str, str], tuple[int, bytes] | None] = staticmethod(lambda method, path: (404, b""))

    def do_GET(self) -> None:
        self._reply("GET")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self._reply("POST")

    def _reply(self, method: str) -> None:
        answer = type(self).route(method, self.path)
        if answer is None:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        status, body = answer
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def serve(route: Callable[[str, str], tuple[int, bytes] | None]) -> Iterator[str]:
    handler = type("Handler", (Answers,), {"route": staticmethod(route)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_pool_is_ready_only_when_its_own_router_routes_to_its_engines(
        sleeper: subprocess.Popen[bytes], tmp_path: Path) -> None:
    """Another pool's router on the port answers /health with as many pods, none of them this pool's."""
    health = json.dumps({"status": "ok", "pods": ["http://127.0.0.1:1", "http://127.0.0.1:2"]}).encode()
    for url in serve(lambda method, path: (200, health)):
        engines = LocalEngines(PoolPlan(engines=2), [], tmp_path, None)
        engines.engines = [Engine(Child(f"engine-{i}", f"http://127.0.0.1:{3 + i}", sleeper, tmp_path / "log"),
                                  "both", SERVING) for i in range(2)]
        engines.router = Child("router", url, sleeper, tmp_path / "router.log")
        with httpx.Client() as client, pytest.raises(TimeoutError):
            up._wait_routed(client, engines, timeout=1.0)


def test_startup_problem_is_none_for_a_pool_that_can_start(tmp_path: Path) -> None:
    assert up.startup_problem(PoolPlan(), free_loopback_port(), str(tmp_path / "r"), str(tmp_path / "t")) is None


# ------------------------------------------------------------------------------------------------------------------
# kvmesh chat
# ------------------------------------------------------------------------------------------------------------------

COMPLETION = json.dumps({"choices": [{"message": {"content": "Paris"}}], "usage": {
    "prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}).encode()


def healthy_then(post: Callable[[], tuple[int, bytes] | None]) -> Callable[[str, str], tuple[int, bytes] | None]:
    """A server with /health at its root (as a router or engine has) and `post` answering the question."""
    def route(method: str, path: str) -> tuple[int, bytes] | None:
        if method == "GET":
            return (200, b'{"status": "ok"}') if path == "/health" else (404, b"")
        return post() if path == "/v1/chat/completions" else (404, b"")
    return route


def test_chat_takes_the_endpoint_kvmesh_up_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvmesh up` prints http://127.0.0.1:PORT/v1 (an OpenAI client's base URL): /v1/health is no path."""
    for url in serve(healthy_then(lambda: (200, COMPLETION))):
        for given in (url + "/v1", url + "/v1/", url + "/"):
            code, out, err = run_cli(capsys, "chat", "--url", given, "--wait", "5", "capital of France?")
            assert code == 0 and out == "Paris\n", err


def test_chat_refuses_a_url_without_a_scheme_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "chat", "--url", "127.0.0.1:8080", "hi")
    assert code == 2 and err == "kvmesh chat: --url 127.0.0.1:8080: give the scheme too, e.g. http://127.0.0.1:8080\n"


def test_chat_fails_at_once_where_health_is_not_found(capsys: pytest.CaptureFixture[str]) -> None:
    for url in serve(lambda method, path: (404, b"not found")):
        code, _, err = run_cli(capsys, "chat", "--url", url, "hi")  # the default --wait: ten minutes
    assert code == 1 and err.startswith(f"kvmesh chat: {url}/health answered 404") and len(err.splitlines()) == 1


def test_chat_says_what_it_waits_for(capsys: pytest.CaptureFixture[str]) -> None:
    for url in serve(lambda method, path: (503, b"starting")):
        code, _, err = run_cli(capsys, "chat", "--url", url, "--wait", str(up_quiet() + 1), "hi")
    assert code == 1
    assert err.splitlines() == [f"kvmesh chat: waiting for {url} to become healthy (/health answers 503; up to "
                                f"{up_quiet() + 1:.0f} s) ...",
                                f"kvmesh chat: {url} did not become healthy in {up_quiet() + 1:.0f} s"]


def up_quiet() -> float:
    from kvmesh.cli import CHAT_QUIET_SECONDS

    return CHAT_QUIET_SECONDS


@pytest.mark.parametrize(("answer", "said"), [
    (None, "did not answer the question"),  # the connection breaks during the request
    ((200, b"<html>a proxy's page</html>"), "the answer is not a chat completion: \"<html>"),
    ((200, b'{"choices": []}'), "the answer is not a chat completion"),
])
def test_chat_says_in_one_line_what_went_wrong_with_the_answer(
        capsys: pytest.CaptureFixture[str], answer: tuple[int, bytes] | None, said: str) -> None:
    for url in serve(healthy_then(lambda: answer)):
        code, out, err = run_cli(capsys, "chat", "--url", url, "--wait", "5", "hi")
    assert code == 1 and not out and len(err.splitlines()) == 1, err
    assert err.startswith("kvmesh chat: ") and said in err


# ------------------------------------------------------------------------------------------------------------------
# kvmesh status --watch
# ------------------------------------------------------------------------------------------------------------------

def test_status_watch_says_a_failed_poll_and_polls_again(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A router restarting (or a pool not up yet) is a moment in a watch, not its end."""
    answers = iter([(503, b"draining"), (200, b"not json"),
                    (200, json.dumps({"pods": [], "index": {"blocks": 0}}).encode())])
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt  # the user's Ctrl-C, after the third poll

    monkeypatch.setattr(kvmesh.status.time, "sleep", sleep)
    for url in serve(lambda method, path: next(answers)):
        code, out, err = run_cli(capsys, "status", "--url", url, "--watch", "2")
    assert code == 0 and sleeps == [2.0, 2.0, 2.0]
    assert "answered HTTP 503" in err and "is not JSON" in err
    assert "0 pods, 0 healthy; 0 distinct blocks indexed" in out
    code, _, err = run_cli(capsys, "status", "--url", f"http://127.0.0.1:{free_loopback_port()}")
    assert code == 1 and "did not answer" in err  # without --watch: one poll, its failure the exit status


def test_status_says_an_engine_is_no_router_and_takes_the_v1_url_kvmesh_up_prints(
        capsys: pytest.CaptureFixture[str]) -> None:
    """An engine of a pool answers 401 internal_token_required: it used to be told to set $KVMESH_API_KEY. And
    http://127.0.0.1:PORT/v1 (what `kvmesh up` prints) used to answer 404."""
    refused = json.dumps({"error": {"message": "this engine serves only its pool", "type": "authentication_error",
                                    "code": "internal_token_required"}}).encode()
    for url in serve(lambda method, path: (401, refused)):
        code, _, err = run_cli(capsys, "status", "--url", url)
    assert code == 1 and "is a pool's engine, not a router" in err and "--url the router's URL" in err, err
    assert "KVMESH_API_KEY" not in err
    keys = json.dumps({"error": {"message": "no key", "code": "invalid_api_key"}}).encode()
    for url in serve(lambda method, path: (401, keys)):  # a router with API keys: still told to set one
        code, _, err = run_cli(capsys, "status", "--url", url)
    assert code == 1 and "set $KVMESH_API_KEY" in err
    doc = json.dumps({"pods": [], "index": {"blocks": 0}}).encode()
    for url in serve(lambda method, path: (200, doc) if path == "/kvmesh/pool" else (404, b"")):
        for given in (url + "/v1", url + "/v1/", url + "/"):
            code, out, err = run_cli(capsys, "status", "--url", given)
            assert code == 0 and "0 pods, 0 healthy" in out, err
    code, _, err = run_cli(capsys, "status", "--url", "127.0.0.1:8080")
    assert code == 2 and "give the scheme too" in err
