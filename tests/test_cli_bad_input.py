"""Bad input to the servers' commands is one line that names it and a non-zero exit, never a traceback (review 190:
each case below printed one, or listened on another port than asked, or hung)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes import config as kube_config

from kvmesh.cli import main
from kvmesh.processes import free_port


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], rc: int = 2) -> str:
    """Run `kvmesh argv` in this process: its exit status is `rc` and it says one line, no traceback."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's refusal
        code = exc.code
    err = capsys.readouterr().err
    assert code == rc, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(("url", "said"), [
    ("notaurl", "the database URL cannot be read: it should look like sqlite:///PATH or postgresql://"),
    ("mysql://user:secret@127.0.0.1/db", "database URL mysql://user:***@127.0.0.1/db: no driver for 'mysql'"),
    ("postgresql://user:secret@127.0.0.1:1/db", "database postgresql://user:***@127.0.0.1:1/db cannot be used"),
    ("sqlite:////nonexistent/folder/pool.db", "database sqlite:////nonexistent/folder/pool.db cannot be used"),
])
def test_a_database_the_router_cannot_use_is_named_with_its_password_hidden(
        tiny_dir: Path, capsys: pytest.CaptureFixture[str], url: str, said: str) -> None:
    line = refused(capsys, ["router", "--model", str(tiny_dir), "--pod", "http://127.0.0.1:1", "--database-url", url])
    assert line.startswith("kvmesh router: ") and said in line and "secret" not in line


def test_settings_files_that_are_not_yaml_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "pool.yaml"
    bad.write_text("engine:\n  port: [1,\n")
    for program in ("serve", "router"):
        assert f"{bad} is not YAML: " in refused(capsys, [program, "--config", str(bad)])


@pytest.mark.parametrize("argv", [
    ["serve", "--log-level", "warn"], ["router", "--log-level", "verbose"], ["serve", "--port", "99999"],
    ["router", "--port", "0"], ["gateway", "--port", "70000"], ["operator", "--metrics-port", "99999"],
])
def test_a_log_level_or_port_that_cannot_be_is_refused_by_the_parser(
        capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert "invalid choice" in (line := refused(capsys, argv)) or "is not a TCP port (1-65535)" in line


@pytest.mark.parametrize(("setting", "said"), [
    ("port: 99999", "port 99999 is not a TCP port"), ("max_model_len: 1", "max_model_len must be at least 2"),
    ("threads: 0", "threads must be at least 1"), ("forecast_interval_seconds: -1", "must be >= 0"),
])
def test_engine_settings_out_of_range_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], setting: str, said: str) -> None:
    (config := tmp_path / "engine.yaml").write_text(f"engine:\n  {setting}\n")
    assert said in refused(capsys, ["serve", "--config", str(config)])


def test_a_router_that_would_scrape_without_pause_is_refused(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    (config := tmp_path / "router.yaml").write_text("router:\n  pods: [http://127.0.0.1:1]\n"
                                                    "  scrape_interval_seconds: 0\n")
    assert "scrape_interval_seconds must be positive" in refused(capsys, ["router", "--config", str(config)])


def test_a_taken_port_is_said_before_the_model_loads(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The load thread was inside torch when the server gave up on the port: the process aborted (SIGABRT)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused(capsys, ["serve", "--model", str(tiny_dir), "--host", "127.0.0.1", "--port", str(port)])
    assert line.startswith(f"kvmesh serve: cannot listen on 127.0.0.1:{port}: ")


def test_a_kubeconfig_that_cannot_be_used_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (garbage := tmp_path / "kubeconfig").write_text("clusters: [\n")
    for argv in (["operator", "--kubeconfig", str(garbage)],
                 ["operator", "--kubeconfig", str(garbage), "--leader-elect"],
                 ["gateway", "--kubernetes", "--kubeconfig", str(garbage)],
                 ["operator", "--kubeconfig", str(tmp_path)]):
        assert f"kubeconfig {argv[2] if argv[0] == 'operator' else garbage} cannot be used" in refused(capsys, argv)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "absent"))
    assert "pass --kubeconfig FILE or set KUBECONFIG" in refused(capsys, ["operator"])


def test_kvmesh_up_says_at_once_that_a_model_could_not_load(tiny_dir: Path, tmp_path: Path) -> None:
    """Its engine stayed up saying why on /health only: `kvmesh up` waited 10 minutes saying nothing, and the
    engine's log (kubectl logs) was empty."""
    model = tmp_path / "no-weights"
    model.mkdir()
    for part in tiny_dir.iterdir():
        if part.suffix != ".safetensors":
            shutil.copy(part, model / part.name)
    up = subprocess.run([sys.executable, "-m", "kvmesh.cli", "up", "--model", str(model), "--engines", "1",
                         "--port", str(free_port())], capture_output=True, text=True, timeout=300)
    assert up.returncode == 1, up.stderr
    assert "engine-0 could not load its model:" in up.stderr
    assert "the model could not be loaded: FileNotFoundError" in up.stderr and "no *.safetensors" in up.stderr


def test_a_router_port_that_is_taken_is_said_before_anything_starts(
        tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The ext_proc port's was a 40-line traceback from the app's lifespan."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused(capsys, ["router", "--model", str(tiny_dir), "--pod", "http://127.0.0.1:1",
                                "--ext-proc-port", str(port)])
    assert line == f"kvmesh router: cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize("program", ["chat", "status"])
def test_a_url_with_a_port_that_is_no_number_is_named(capsys: pytest.CaptureFixture[str], program: str) -> None:
    argv = [program, "--url", "http://127.0.0.1:80a0"] + (["hi"] if program == "chat" else [])
    assert refused(capsys, argv) == f"kvmesh {program}: --url http://127.0.0.1:80a0: Invalid port: '80a0'"


@pytest.mark.parametrize(("argv", "said"), [
    (["gateway", "--router", "notaurl"], "kvmesh gateway: --router 'notaurl' is not an http(s) URL with a host"),
    (["gateway", "--router", "http://:8080"], "kvmesh gateway: --router 'http://:8080' is not an http(s) URL"),
    (["gateway", "--router", "http://r:80a0"], "kvmesh gateway: --router 'http://r:80a0' is not a URL: "),
    (["router", "--pod", "http://e:80a0"], "kvmesh router: pod 'http://e:80a0' is not a URL: "),
])
def test_a_router_or_pod_that_is_no_url_is_named(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                 said: str) -> None:
    """The gateway took any --router and failed every request sent to it (502); a pod's port that is no number
    failed at every scrape."""
    assert refused(capsys, argv).startswith(said)


@pytest.mark.parametrize(("pool", "said"), [
    ("kind: InferencePol\nmetadata: {name: chat}\nspec: {model: {source: bundled}}\n",
     "found 0 among its documents' kinds: InferencePol (did you mean InferencePool?)"),
    ("kind: InferencePool\nmetadata: {name: chat}\nspec:\n  model: {source: bundled}\n"
     "  engine: {settings: {max_model_len: 1}}\n", "engine.settings: max_model_len must be at least 2, got 1"),
])
def test_a_pool_file_kvmesh_up_cannot_run_is_named_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], pool: str, said: str) -> None:
    """A misspelled kind said only 'found 0'; a setting's value the engine refuses started the router and the
    engines, and failed when an engine exited."""
    path = tmp_path / "pool.yaml"
    path.write_text("apiVersion: kvmesh.io/v1alpha1\n" + pool)
    line = refused(capsys, ["up", "-f", str(path), "--port", str(free_port())])
    assert line.startswith("kvmesh up: ") and line.endswith(said)


def test_a_ctrl_c_while_a_command_loads_is_one_line(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvmesh up` sets up its own Ctrl-C handling after its modules load (a second or two): a Ctrl-C before then
    printed a KeyboardInterrupt traceback. Here the command raises it as an import interrupted would."""
    import kvmesh.cli

    def loading(_: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(kvmesh.cli, "_status", loading)
    assert refused(capsys, ["status"], rc=130) == "kvmesh: interrupted"
