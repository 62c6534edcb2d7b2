"""A router runs for months while its keys file rotates: what it holds per tenant (the 429 series, the limiter's
buckets and demand, in both lanes) is that of the tenants the file names now, not of every tenant it ever had. A
tenant whose key goes while its requests are in flight keeps its buckets until a later reload finds none. One
router over the tiny model's tokenizer (no engine: nothing here is routed), rotated by hand, then by its app's key
watcher."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest

from kvmesh.engine.protocol import LIMIT_REASONS, RouterMetric
from kvmesh.router.app import Router, build_router
from kvmesh.router.auth import tenant_hash
from kvmesh.router.config import RouterConfig
from kvmesh.router.limits import Lease

from .engines import serve_router
from .test_router_auth import write_keys

LIMITS = {"default": {"requests_per_minute": 600, "tokens_per_minute": 100_000}}  # every tenant has buckets


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Router]:
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    write_keys(keys, {"sk-acme": "acme"})
    # held without pods: its /health answers, so its app can be served with no engine behind it
    yield build_router(RouterConfig(pods=[], api_keys_file=str(keys), tenants=LIMITS, hold_without_pods_seconds=1),
                       tiny_dir)


def rotate(router: Router, keys: dict[str, str]) -> None:
    """A new keys file, taken as the app's key watcher takes it."""
    assert router.keys_file is not None
    write_keys(Path(router.keys_file.path), keys)
    assert router.reload_keys()
    router.keys_changed()


def series_tenants(router: Router) -> list[str]:
    """The tenant pseudonym of every kvmesh_router_rate_limited_total series the router exports."""
    text = generate_latest(router.metrics.registry).decode()
    return [line.split('tenant="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith(f"{RouterMetric.RATE_LIMITED}_total{{")]


def opened(router: Router, tenant: str, batch: bool = False) -> Lease:
    lease = (router.limits.batch if batch else router.limits).open(tenant)
    assert isinstance(lease, Lease)
    return lease


def test_a_keys_reload_drops_the_series_buckets_and_demand_of_the_tenants_it_no_longer_keys(router: Router) -> None:
    rotate(router, {"sk-acme": "acme", "sk-globex": "globex"})
    in_flight = opened(router, "acme")  # acme's request runs on while its key goes
    opened(router, "globex").close(spent_tokens=5)
    opened(router, "globex", batch=True).close()
    assert sorted(series_tenants(router)) == sorted([tenant_hash("acme"), tenant_hash("globex")] * len(LIMIT_REASONS))

    rotate(router, {"sk-initech": "initech"})
    assert series_tenants(router) == [tenant_hash("initech")] * len(LIMIT_REASONS)
    limits = router.limits
    assert list(limits._buckets) == ["acme"] and limits.batch._buckets == {}  # acme's request needs its buckets
    assert limits.demand == {} and limits.batch.demand == {}
    in_flight.close(spent_tokens=7)  # it ends cleanly, charging its buckets (a batch in its turn goes on under them)
    assert list(limits._buckets) == ["acme"] and limits.inflight == {}
    rotate(router, {"sk-initech": "initech", "sk-hooli": "hooli"})  # the next reload finds it ended
    assert limits._buckets == {}


def test_many_rotations_leave_the_series_and_buckets_of_the_tenant_keyed_now(router: Router) -> None:
    for i in range(1, 201):
        tenant = "tenant-" + "x" * i  # each file a different size: a rotation within the clock's tick is seen
        rotate(router, {f"sk-{i}": tenant})
        opened(router, tenant).close()
    assert series_tenants(router) == [tenant_hash(tenant)] * len(LIMIT_REASONS)
    assert list(router.limits._buckets) == [tenant] and list(router.limits.demand) == [tenant]


def revoke_globex_while_serving(router: Router) -> None:
    """Serve `router`'s app, revoke globex's key in its file and return once its key watcher has dropped globex's
    series (the bound only ends a failing test)."""
    with serve_router(router) as url:
        assert router.keys_file is not None
        write_keys(Path(router.keys_file.path), {"sk-acme": "acme"})
        gone = tenant_hash("globex")
        deadline = time.monotonic() + 60
        while gone in httpx.get(url + "/metrics", timeout=10).text:
            assert time.monotonic() < deadline, "the key watcher did not drop the revoked tenant's series"
            time.sleep(0.1)


def test_the_app_s_key_watcher_drops_a_revoked_tenant(router: Router) -> None:
    rotate(router, {"sk-acme": "acme", "sk-globex": "globex"})
    opened(router, "globex").close()  # before the app serves: the limiter is the event loop's from then on
    revoke_globex_while_serving(router)
    assert "globex" not in router.limits._buckets


def test_the_key_watcher_goes_on_after_a_reload_that_failed(router: Router, monkeypatch: pytest.MonkeyPatch) -> None:
    """One reload that raised (a bug, or prometheus-client before 0.22 refusing to remove a series it lacks) ended
    the app's key watcher for the router's life: every later rotation was ignored. It logs and reads again."""
    rotate(router, {"sk-acme": "acme", "sk-globex": "globex"})
    reload, failed = router.reload_keys, []

    def once_broken() -> bool:
        if not failed:
            failed.append(True)
            raise RuntimeError("a reload that failed")
        return reload()

    monkeypatch.setattr(router, "reload_keys", once_broken)
    revoke_globex_while_serving(router)
    assert failed
