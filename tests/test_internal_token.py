"""The pool's internal token (engine/internal_token.py): an engine started with one serves only callers that send
it, and everything inside the pool sends it: the router's proxy and scrapes, a decode engine pulling KV from a
prefill engine, the ext_proc picker's header mutation for a Gateway."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine import internal_token
from kvmesh.engine.internal_token import (
    INTERNAL_TOKEN_FILE_ENV,
    INTERNAL_TOKEN_HEADER,
    TOKEN_REFUSED_CODE,
    InternalToken,
    new_token,
    write_token_file,
)
from kvmesh.engine.protocol import Metric, VllmMetric
from kvmesh.router.app import Router, build_router
from kvmesh.router.config import RouterConfig

from .conftest import make_engine
from .engines import serve_engine, serve_router

pytestmark = pytest.mark.slow


def test_the_token_is_read_again_when_its_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotated Secret reaches a running pod: the kubelet replaces the mounted file in place."""
    monkeypatch.setattr(internal_token, "RECHECK_SECONDS", 0.0)
    path = tmp_path / "token"
    first, second = new_token(), new_token()
    write_token_file(path, first)
    assert path.stat().st_mode & 0o777 == 0o600
    token = InternalToken(path)
    assert token.headers() == {INTERNAL_TOKEN_HEADER: first}
    assert token.admits("/v1/models", first) and not token.admits("/v1/models", second)
    assert not token.admits("/v1/models", None)
    assert token.admits("/health", None) and token.admits("/metrics", None)
    replacement = tmp_path / "token.new"  # as the kubelet does it: a new file renamed over the old one
    write_token_file(replacement, second)
    replacement.replace(path)
    assert token.admits("/v1/models", second) and not token.admits("/v1/models", first)
    path.unlink()  # gone for a moment: the last good token holds
    assert token.value() == second


def test_a_missing_or_short_token_file_is_an_error_at_start(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        InternalToken(tmp_path / "absent")
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16"):
        InternalToken(tmp_path / "short")
    assert not InternalToken.from_env({}).enabled
    with pytest.raises(ValueError, match=r"^\$KVMESH_INTERNAL_TOKEN_FILE: .*absent"):  # what the programs print
        InternalToken.from_env({"KVMESH_INTERNAL_TOKEN_FILE": str(tmp_path / "absent")})
    assert InternalToken(None).headers() == {} and InternalToken(None).admits("/v1/kv/fetch", None)


def test_a_token_held_in_memory_is_sent_and_asked_as_one_from_a_file() -> None:
    """The cluster operator holds each pool's token as read from its Secret: the same header, never in a repr."""
    held = InternalToken.fixed("m" * 43)
    assert held.enabled and held.headers() == {INTERNAL_TOKEN_HEADER: "m" * 43}
    assert held.admits("/v1/kv/fetch", "m" * 43) and not held.admits("/v1/kv/fetch", "x" * 43)
    assert "m" * 43 not in repr(held)


@pytest.fixture(scope="module")
def pool(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Router, str]]:
    """A prefill and a decode engine in this process, both asking for one token, and a router given the token's
    file as a pod is (the environment variable): the pod URLs, the Router and the token."""
    path = tmp_path_factory.mktemp("token") / "token"
    write_token_file(path, new_token())
    token = InternalToken(path)
    with pytest.MonkeyPatch.context() as patch, \
            serve_engine(make_engine(tiny_dir, role="prefill", kv_cache_blocks=128), token=token) as prefill, \
            serve_engine(make_engine(tiny_dir, role="decode", kv_cache_blocks=128), token=token) as decode:
        patch.setenv(INTERNAL_TOKEN_FILE_ENV, str(path))
        router = build_router(RouterConfig(pods=[prefill, decode], scrape_interval_seconds=0.1,
                                           prefill_hop_min_tokens=32), tiny_dir)
        with serve_router(router) as url:
            for _ in range(100):  # both pods scraped (their /v1/kv/config needs the token)
                if len(httpx.get(url + "/health").json()["pods"]) == 2:
                    break
                threading.Event().wait(0.1)
            yield {"prefill": prefill, "decode": decode, "router": url}, router, token.value() or ""


@pytest.mark.parametrize("route", ["/v1/models", "/v1/kv/blocks", "/v1/kv/config", "/tokenize"])
def test_an_engine_refuses_a_caller_without_the_token(pool: tuple[dict[str, str], Router, str], route: str) -> None:
    urls, _, token = pool
    method = "POST" if route == "/tokenize" else "GET"
    body = {"prompt": "hi"} if method == "POST" else None
    for headers in ({}, {INTERNAL_TOKEN_HEADER: "x" * len(token)}):
        refused = httpx.request(method, urls["decode"] + route, json=body, headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == TOKEN_REFUSED_CODE
        assert refused.json()["error"]["type"] == "authentication_error"
    served = httpx.request(method, urls["decode"] + route, json=body, headers={INTERNAL_TOKEN_HEADER: token})
    assert served.status_code == 200, served.text


def test_probes_and_scrapes_need_no_token(pool: tuple[dict[str, str], Router, str]) -> None:
    urls, _, _ = pool
    assert httpx.get(urls["decode"] + "/health").status_code == 200
    metrics = httpx.get(urls["decode"] + "/metrics")
    assert metrics.status_code == 200 and VllmMetric.KV_USAGE in metrics.text


def test_an_admin_call_without_the_token_changes_nothing(pool: tuple[dict[str, str], Router, str]) -> None:
    urls, _, _ = pool
    assert httpx.post(urls["decode"] + "/v1/admin/drain").status_code == 401
    assert httpx.get(urls["decode"] + "/health").status_code == 200  # still serving


def test_a_split_request_is_served_through_a_pool_that_asks_for_the_token(
        pool: tuple[dict[str, str], Router, str]) -> None:
    """The router proxies with the token, and the decode engine pulls the prefill engine's KV with it: the split
    answer equals the decode engine's own."""
    urls, _, token = pool
    before = handoffs(urls["decode"], token)
    prompt = [(i * 104729) % 48000 + 200 for i in range(90)]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    split = httpx.post(urls["router"] + "/v1/completions", json=body, timeout=60)
    assert split.status_code == 200, split.text
    assert split.headers["x-kvmesh-pod"] == f"{urls['prefill']},{urls['decode']}"
    whole = httpx.post(urls["decode"] + "/v1/completions", json=body, headers={INTERNAL_TOKEN_HEADER: token},
                       timeout=60).json()
    assert split.json()["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
    after = handoffs(urls["decode"], token)  # pulled from the prefill pod, not recomputed after a refused fetch
    assert after["ok"] == before["ok"] + 1 and after["failed"] == before["failed"]


def handoffs(url: str, token: str) -> dict[str, float]:
    """The engine's KV handoffs from a prefill pod by outcome."""
    text = httpx.get(url + "/metrics", headers={INTERNAL_TOKEN_HEADER: token}).text
    counts = {"ok": 0.0, "failed": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == Metric.KV_TRANSFERS + "_total" and sample.labels.get("kind") == "handoff":
                counts[sample.labels["outcome"]] += sample.value
    return counts


def test_the_ext_proc_picker_sets_the_token_on_what_a_gateway_forwards(
        pool: tuple[dict[str, str], Router, str]) -> None:
    from kvmesh.router.extproc import Exchange

    _, router, token = pool
    exchange = Exchange(router)
    exchange.choice = type("Choice", (), {"body": b"{}", "rewritten": False, "trace": None,
                                          "destination": "127.0.0.1:1"})()
    headers = {h.header.key: h.header.raw_value.decode() for h in exchange._mutation().header_mutation.set_headers}
    assert headers[INTERNAL_TOKEN_HEADER] == token
