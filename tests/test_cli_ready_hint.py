"""The ready message's `kvmesh chat` hint names kvmesh as it was run (review: with .venv/bin/kvmesh run by its path,
and the venv not on PATH, the hint said `kvmesh chat ...`, which the shell did not find)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from kvmesh.up import invoked_command, ready_message


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `kvmesh` console script run by its path, as `sys.argv[0]` says, from a plain (not -m) __main__."""
    path = tmp_path / "venv" / "bin" / "kvmesh"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(path), "up"])
    main = types.ModuleType("__main__")
    main.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", main)
    return path


def test_a_script_not_on_path_is_named_by_its_path(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    command = invoked_command()
    assert command == str(script)
    assert f"try it:  {script} chat --url http://127.0.0.1:29001 'Hello'" in ready_message(
        "x", 1, "http://127.0.0.1:29001/v1", command)


def test_the_script_path_finds_is_kvmesh(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(script.parent))
    assert invoked_command() == "kvmesh"


def test_python_dash_m_is_said_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="kvmesh.cli")  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["/somewhere/kvmesh/cli.py", "up"])
    assert invoked_command() == f"{sys.executable} -m kvmesh.cli"
