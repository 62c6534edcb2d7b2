"""With a proxy in the environment (HTTP_PROXY, as on many laptops), `kvmesh up` still reaches its own children and
`kvmesh chat` and `kvmesh status` still reach a loopback router: no proxy can reach this machine's loopback. Here
the proxy is a closed port, so whatever goes through it fails (before the fix `kvmesh up` never became ready: its
health checks went to the proxy). Another host's URL still takes the proxy, as curl would."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.bench.serve import user_http_client
from kvmesh.cli import main
from kvmesh.engine.protocol import INTERNAL_HTTP_CLIENT
from kvmesh.processes import free_port, launch, stop

from .test_up_scaling import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def _closed_proxy() -> dict[str, str]:
    """Every proxy variable pointing at a loopback port nothing listens on, and no NO_PROXY to spare loopback."""
    proxy = f"http://127.0.0.1:{free_port()}"
    return {name: proxy for name in PROXY_VARIABLES}


@pytest.fixture
def proxied(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    env = _closed_proxy()
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield env


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080", "http://127.3.4.5:1/v1", "http://localhost:8080",
                                 "http://[::1]:8080", "http://LOCALHOST.:9"])
def test_loopback_urls_take_no_proxy(url: str) -> None:
    assert user_http_client(url) == INTERNAL_HTTP_CLIENT


@pytest.mark.parametrize("url", ["http://example.com:8080", "https://10.0.0.7/v1", "http://128.0.0.1:1"])
def test_other_hosts_take_the_environments_proxy(url: str) -> None:
    assert user_http_client(url) == {}


def test_up_becomes_ready_and_chat_and_status_answer_with_a_dead_proxy(
        proxied: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ready, log, port = tmp_path / "ready", tmp_path / "up.log", free_port()
    # launch passes this process's environment on: the dead proxy, no NO_PROXY
    proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "--sim", "--engines", "1", "--port", str(port),
                   "--ready-file", str(ready)], log, new_session=True)
    try:
        wait_for(ready.exists, "the pool to be ready with HTTP_PROXY set", proc, log, timeout=120)
        endpoint = ready.read_text()
        assert main(["chat", "--url", endpoint, "--max-tokens", "4", "--wait", "20", "hello"]) == 0
        assert "completion tokens" in capsys.readouterr().err
        assert main(["status", "--url", endpoint]) == 0
        assert "1 pods, 1 healthy" in capsys.readouterr().out
    finally:
        stop([proc], timeout=30)
