"""`kvmesh up` running for days: a crash line shows what that life of the process wrote, not every earlier crash's
error again; the work folder (logs, files, the router's request log) lives in the state folder, out of reach of /tmp
cleaners; and a run that was killed leaves no dead targets in its Prometheus targets file once the next run starts,
whether or not that one writes targets."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh import __version__
from kvmesh.processes import TAIL_BYTES, free_port, launch, tail
from kvmesh.up import LOCAL_DATABASE, STATE_DIR_ENV, WORKDIR_PREFIX, Child, PoolPlan, startup_problem, state_dir

from .engines import stop_up
from .test_up_scaling import wait_for


def test_a_crash_line_shows_only_what_the_restarted_process_wrote(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Each crash line repeated the log's last 20 lines, so a crash loop showed the earlier crashes' errors again
    under every new one."""
    log = tmp_path / "engine-0.log"
    log.write_text("Traceback (most recent call last):\nMemoryError: the first life's error\n")
    first = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    first.wait()
    child = Child("engine-0", "http://127.0.0.1:21010", first, log, ["--version"])  # restarted: `kvmesh --version`
    child.crashed(0.0, "")
    assert "the first life's error" in capsys.readouterr().err
    for life in range(2):
        child.respawn(float(life))
        child.process.wait(timeout=60)
        child.crashed(float(life), "")
        said = capsys.readouterr().err
        assert "the first life's error" not in said, said
        assert said.count(f"kvmesh {__version__}") == 1, said  # this life's own line, once
    assert log.read_text().count(f"kvmesh {__version__}") == 2  # the log keeps every life


def test_a_tail_reads_a_bounded_end_of_the_log(tmp_path: Path) -> None:
    log = tmp_path / "engine-0.log"
    log.write_text("x" * 50 + "\n" + ("y" * 999 + "\n") * 1000)  # a megabyte from one life
    end = tail(log, 20, start=0)
    assert end.splitlines() == ["y" * 999] * (TAIL_BYTES // 1000)  # whole lines only, from the last TAIL_BYTES
    assert len(end) < TAIL_BYTES
    assert tail(log, 20, start=log.stat().st_size) == ""  # this life wrote nothing yet


def test_the_state_folder_is_the_xdg_one_unless_kvmesh_state_dir_says_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    assert state_dir() == tmp_path / "home" / ".local" / "state" / "kvmesh"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")  # not absolute: the XDG spec says to ignore it
    assert state_dir() == tmp_path / "home" / ".local" / "state" / "kvmesh"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state_dir() == tmp_path / "xdg" / "kvmesh"
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "mine"))
    assert state_dir() == tmp_path / "mine"


def test_a_state_folder_that_cannot_be_made_is_refused_before_anything_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    problem = startup_problem(PoolPlan(), free_port(), state=blocker / "state")
    assert problem is not None and problem.startswith(f"the state folder {blocker / 'state'} (--state-dir) cannot"), \
        problem
    made = tmp_path / "new" / "state"
    assert startup_problem(PoolPlan(), free_port(), state=made) is None and made.is_dir()  # a first run makes it


def _start(folder: Path, name: str, env: dict[str, str], *flags: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """A `kvmesh up` of one simulated engine; its process, log and ready file."""
    ready, log = folder / f"{name}.ready", folder / f"{name}.log"
    proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "--sim", "--engines", "1", "--port", str(free_port()),
                   "--ready-file", str(ready), *flags], log, env=env)
    return proc, log, ready


def _workdir(log: Path) -> Path:
    (folder,) = re.findall(r"\(logs in (\S+)\)", log.read_text())
    return Path(folder)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_work_folder_and_its_request_log_live_in_the_state_folder_not_in_tmp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In /tmp, a cleaner aging files out (systemd-tmpfiles: 10 days) took a running pool's engine.yaml and token,
    and the next crash of an engine became a crash loop; its logs and request log went too."""
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    temp, state = tmp_path / "tmp", tmp_path / "state"
    temp.mkdir()
    proc, log, ready = _start(tmp_path, "up", {"TMPDIR": str(temp), "XDG_STATE_HOME": str(state)})
    try:
        wait_for(ready.exists, "the pool to be ready", proc, log, timeout=60)
        workdir = _workdir(log)
        assert workdir.parent == state / "kvmesh" and workdir.name.startswith(WORKDIR_PREFIX)
        assert (workdir / LOCAL_DATABASE).exists()  # the router's request log, beside the logs
        assert not [p for p in temp.iterdir() if p.name.startswith(WORKDIR_PREFIX)]
    finally:
        stop_up(proc, log)
    assert not workdir.exists()  # a clean stop removes it, as before


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_run_after_a_killed_one_empties_its_targets_file_without_being_given_it(tmp_path: Path) -> None:
    """A killed run's targets file listed its dead processes until a run with the same --targets-file was ready;
    a run without the flag never fixed it, and Prometheus fired KvmeshEngineDown for a pool nobody ran."""
    targets = tmp_path / "targets.json"
    env = {"TMPDIR": str(tmp_path), STATE_DIR_ENV: str(tmp_path / "state")}
    killed, killed_log, killed_ready = _start(tmp_path, "killed", env, "--targets-file", str(targets))
    try:
        wait_for(killed_ready.exists, "the first pool to be ready", killed, killed_log, timeout=60)
        assert len(json.loads(targets.read_text())) == 2  # its engine and its router
    finally:
        killed.send_signal(signal.SIGKILL)  # no clean-up: its children go (PDEATHSIG), its files stay
        killed.wait()
    proc, log, ready = _start(tmp_path, "next", env)
    try:
        wait_for(ready.exists, "the next pool to be ready", proc, log, timeout=60)
        assert json.loads(targets.read_text()) == [], log.read_text()[-3000:]
        assert f"emptied the targets file {targets} of a killed run" in log.read_text()
        assert not _workdir(killed_log).exists()
    finally:
        stop_up(proc, log)
