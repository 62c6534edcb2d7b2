"""What a new user's first hour with the CLI ran into (review 309), each now one line and a clear exit: a token
file that cannot be read, a mistyped flag, a closed pipe, an API key for chat, a bench against nothing, --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvmesh.cli import main
from kvmesh.engine.internal_token import INTERNAL_TOKEN_FILE_ENV
from kvmesh.processes import free_port

pytestmark = pytest.mark.timeout(60)


def _kvmesh(*argv: str, env: dict[str, str] | None = None, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *argv], capture_output=True, text=True, timeout=50,
                          env={**os.environ, **(env or {})}, **kwargs)  # type: ignore[call-overload]


@pytest.mark.parametrize("program", [["serve"], ["sim-engine"], ["router", "--pod", "http://127.0.0.1:1"]],
                         ids=lambda argv: argv[0])
def test_a_token_file_that_cannot_be_read_is_one_line_naming_the_variable(program: list[str]) -> None:
    done = _kvmesh(*program, "--port", str(free_port()), env={INTERNAL_TOKEN_FILE_ENV: "/nonexistent/token"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(f"kvmesh {program[0]}: ${INTERNAL_TOKEN_FILE_ENV}: ") and "/nonexistent/token" in \
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


Answer = Callable[[BaseHTTPRequestHandler], tuple[int, dict[str, object]]]


@pytest.fixture
def stub() -> Iterator[Callable[[Answer], str]]:
    """A loopback HTTP server answering every GET and POST with what the test's function returns; its URL."""
    servers: list[ThreadingHTTPServer] = []

    def serve(answer: Answer) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.answer()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.answer()

            def answer(self) -> None:
                code, doc = answer(self)
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def test_status_json_into_a_closed_pipe_ends_quietly(stub: Callable[[Answer], str]) -> None:
    """`kvmesh status --json | head -c 100`: a BrokenPipeError traceback before. The document is far larger than a
    pipe's buffer, so the write meets the closed pipe whatever the timing."""
    url = stub(lambda _: (200, {"pods": [{"name": f"pod-{i}"} for i in range(50_000)]}))
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "status", "--json", "--url", url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert len(proc.stdout.read(100)) == 100
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=30) == 0 and err == "", err


CHAT_ANSWER = {"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}


@pytest.mark.parametrize(("flag", "env", "sent"), [([], "from-env", "from-env"),
                                                   (["--api-key", "from-flag"], "from-env", "from-flag")])
def test_chat_sends_the_api_key(flag: list[str], env: str, sent: str, stub: Callable[[Answer], str],
                                monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvmesh chat` had no way to send one: a router with API keys answered it 401."""
    seen: list[str | None] = []

    def answer(request: BaseHTTPRequestHandler) -> tuple[int, dict[str, object]]:
        if request.command == "POST":
            seen.append(request.headers.get("authorization"))
        return 200, CHAT_ANSWER

    monkeypatch.setenv("KVMESH_API_KEY", env)
    assert main(["chat", "--url", stub(answer), "--wait", "5", *flag, "hello"]) == 0
    assert seen == [f"Bearer {sent}"] and capsys.readouterr().out == "hi\n"


def test_status_says_a_refused_key_needs_read_pool_status(stub: Callable[[Answer], str],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    url = stub(lambda _: (403, {"error": {"code": "pool_status_not_allowed", "message": "no"}}))
    assert main(["status", "--url", url, "--api-key", "k"]) == 1
    err = capsys.readouterr().err
    assert "read_pool_status: true" in err and "docs/router.md" in err and "is it a kvmesh router" not in err, err


@pytest.mark.parametrize("command", ["chat", "status"])
def test_chat_and_status_help_name_the_key_variable(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "KVMESH_API_KEY" in out and "--api-key" in out, out


@pytest.mark.parametrize(("url", "code", "said"), [
    ("127.0.0.1:1", 2, "kvmesh bench serve: --url 127.0.0.1:1: give the scheme too, e.g. http://127.0.0.1:1"),
    ("http://127.0.0.1:{closed}", 1, "kvmesh bench serve: no request to http://127.0.0.1:{closed} succeeded (2 sent): "
                                     "ConnectError"),
])
def test_bench_serve_against_nothing_fails_in_one_line(url: str, code: int, said: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """It printed a table of nan (and exited 1 only for the closed port)."""
    closed = free_port()
    assert main(["bench", "serve", "--url", url.format(closed=closed), "--num-requests", "2"]) == code
    out, err = capsys.readouterr()
    assert out == "" and said.format(closed=closed) in err and "nan" not in err, (out, err)


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes


def test_help_says_defaults_and_what_serves_flags_do(capsys: pytest.CaptureFixture[str]) -> None:
    serve = _help(capsys, "serve")
    for said in ("--dtype {auto,float32,bfloat16,float16} weights'", "--block-size BLOCK_SIZE tokens per KV",
                 "--max-num-seqs MAX_NUM_SEQS sequences batched", "--role {prefill,decode,both} disaggregated",
                 "--served-model-name SERVED_MODEL_NAME the name clients", "(default: info)"):
        assert said in serve, said
    chat = _help(capsys, "chat")
    assert "(default: 64)" in chat and "(default: 600.0)" in chat, chat
    assert "(default: None)" not in serve + chat
    bench = _help(capsys, "bench", "engine")  # a benchmark's flags, those without help text too
    assert "--prompt-tokens PROMPT_TOKENS default: 128" in bench and "--rounds ROUNDS" in bench, bench


def test_chat_refuses_max_tokens_0_in_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["chat", "--max-tokens", "0", "hi"])
    assert exited.value.code == 2 and "--max-tokens: expected a whole number >= 1" in capsys.readouterr().err
