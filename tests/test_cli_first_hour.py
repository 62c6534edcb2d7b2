"""What a new user's first hour with the CLI ran into (review 309), each now one line and a clear exit: a token
file that cannot be read, a mistyped flag, a closed pipe, an API key for chat, a bench against nothing, --help."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmesh.cli import main
from kvmesh.engine.internal_token import INTERNAL_TOKEN_FILE_ENV
from kvmesh.processes import free_port

pytestmark = pytest.mark.timeout(60)


def _kvmesh(*argv: str, env: dict[str, str] | None = None, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *argv], capture_output=True, text=True, timeout=50,
                          env={**os.environ, **(env or {})}, **kwargs)  # type: ignore[call-overload]


def test_a_token_file_that_cannot_be_read_is_one_line_naming_the_variable() -> None:
    done = _kvmesh("serve", "--port", str(free_port()), env={INTERNAL_TOKEN_FILE_ENV: "/nonexistent/token"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(f"kvmesh serve: ${INTERNAL_TOKEN_FILE_ENV}: ") and "/nonexistent/token" in \
        done.stderr and len(done.stderr.splitlines()) == 1, done.stderr[-2000:]


@pytest.mark.parametrize(("argv", "said"), [
    (["up", "--prot", "1"], "kvmesh up: error: unrecognized arguments: --prot 1 (did you mean --port?)"),
    (["status", "--jsn"], "kvmesh status: error: unrecognized arguments: --jsn (did you mean --json?)"),
    (["bench", "serve", "--concurency=3"],
     "kvmesh bench serve: error: unrecognized arguments: --concurency=3 (did you mean --concurrency?)"),
])
def test_a_mistyped_flag_is_said_by_its_subcommand_with_the_closest_flag(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.splitlines()[-1] == said, err
    assert err.startswith(f"usage: {said.split(': error')[0]} "), err  # the subcommand's usage, not kvmesh's
