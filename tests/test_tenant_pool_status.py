"""What one tenant's key reads of the pool on a shared router: `/kvmesh/pool` names every engine and its live
load (the other tenants' traffic), so with API keys only a tenant trusted with it (`read_pool_status: true`, an
operator's) reads it; `/metrics` stays open to the scrapers (Prometheus, the operator), which send no key. A keyed
router in front of a loopback stub pod (tests/test_router_broken_reply.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh.cli import main
from kvmesh.router.app import Router
from kvmesh.router.limits import parse_tenants
from kvmesh.router.pool_status import POOL_STATUS_PATH, POOL_STATUS_REFUSED_CODE

from .test_router_broken_reply import routed, stub_pod
from .test_router_tenant_guards import KEYS, auth, keys_file


@pytest.fixture
def shared(tiny_dir: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, Router]]:
    """A router with three tenants' keys and the `tenants` config the test is parametrized with."""
    tenants: dict[str, Any] = request.param
    with stub_pod(tiny_dir) as pod, routed(tiny_dir, [pod.url], api_keys_file=str(keys_file(tmp_path)),
                                           tenants=tenants) as served:
        yield served


@pytest.mark.parametrize("shared", [{"initech": {"read_pool_status": True}}], indirect=True)
def test_only_a_tenant_trusted_with_it_reads_the_pool_document(shared: tuple[str, Router],
                                                                capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Any tenant's key read every engine's address, running, waiting and KV use: now a stranger gets the 401, a
    tenant's key a 403 saying what the operator sets, and the operator's tenant (initech here) the document, which
    `kvmesh status` prints with its key in $KVMESH_API_KEY."""
    url, _ = shared
    stranger = httpx.get(url + POOL_STATUS_PATH, timeout=30)
    assert stranger.status_code == 401 and stranger.json()["error"]["code"] == "invalid_api_key"
    for tenant in ("acme", "globex"):
        refused = httpx.get(url + POOL_STATUS_PATH, headers=auth(tenant), timeout=30)
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == POOL_STATUS_REFUSED_CODE and "read_pool_status: true" in error["message"]
        assert "pods" not in refused.json()
    assert httpx.get(url + POOL_STATUS_PATH, headers=auth("initech"), timeout=30).json()["pods"]
    monkeypatch.delenv("KVMESH_API_KEY", raising=False)
    assert main(["status", "--url", url]) == 1 and "KVMESH_API_KEY" in capsys.readouterr().err
    monkeypatch.setenv("KVMESH_API_KEY", KEYS["globex"])
    assert main(["status", "--url", url]) == 1 and "read_pool_status" in capsys.readouterr().err
    monkeypatch.setenv("KVMESH_API_KEY", KEYS["initech"])
    assert main(["status", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pods"]
    # the scrapers send no key: /metrics stays open (the operator's scale-from-zero reads it, Prometheus scrapes it)
    scraped = httpx.get(url + "/metrics", timeout=30)
    assert scraped.status_code == 200 and "kvmesh_router_requests_total" in scraped.text


@pytest.mark.parametrize("shared", [{"default": {"read_pool_status": True}, "globex": {"read_pool_status": False}}],
                         indirect=True)
def test_the_default_entry_lets_every_key_read_it_as_before_but_the_tenants_it_names_otherwise(
        shared: tuple[str, Router]) -> None:
    """A pool whose tenants trust one another keeps the old behaviour with one line; an entry still overrides it."""
    url, _ = shared
    for tenant, status in (("acme", 200), ("initech", 200), ("globex", 403)):
        assert httpx.get(url + POOL_STATUS_PATH, headers=auth(tenant), timeout=30).status_code == status, tenant


def test_without_api_keys_everyone_reads_the_pool_document(tiny_dir: Path) -> None:
    """Without keys every client is the one tenant `default`: nobody to keep it from (kvmesh up's local pool)."""
    with stub_pod(tiny_dir) as pod, routed(tiny_dir, [pod.url]) as (url, _):
        assert httpx.get(url + POOL_STATUS_PATH, timeout=30).json()["pods"]


def test_a_bad_read_pool_status_is_refused_with_what_to_fix() -> None:
    with pytest.raises(ValueError, match="read_pool_status must be true or false"):
        parse_tenants({"ops": {"read_pool_status": "yes"}})
