"""Tenant limits split between router replicas by demand (router/limit_sync.py): the split (pure), a limiter taking
its new share without handing out a burst, and replicas that share a database (a SQLite file and a real PostgreSQL)
converging on the split that gives each tenant its whole limit where its requests land."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from kvmesh.router.app import build_router
from kvmesh.router.config import RouterConfig
from kvmesh.router.limit_sync import VIRTUAL_REQUESTS, DemandRow, DemandTable, LimitSync, shares
from kvmesh.router.limits import Lease, Limiter, Refusal, TenantLimits, apportion, parse_tenants

from .conftest import make_engine
from .engines import serve_checked, serve_router
from .test_router_limits import Clock

TENANTS = {"acme": {"requests_per_minute": 60}, "globex": {"requests_per_minute": 120}}


def test_each_replica_takes_its_part_of_the_demand() -> None:
    live = {"a", "b"}
    demand = {"t": {"a": 99.0, "b": 0.0}, "light": {"a": 1.0, "b": 0.0}, "idle": {"a": 0.0, "b": 0.0}}
    split = shares(demand, live)
    assert split["t"]["a"] == pytest.approx(100 / (99 + 2 * VIRTUAL_REQUESTS)) and sum(split["t"].values()) == 1
    assert split["light"]["b"] == pytest.approx(1 / 3)  # a light tenant stays near even: b can still admit its requests
    assert split["idle"] == {"a": 0.5, "b": 0.5}  # nobody asks: even
    gone = shares({"t": {"a": 1.0, "c": 5.0}}, {"a"})  # c stopped reporting: out of the split
    assert gone["t"] == {"a": 1.0}


def test_concurrent_requests_are_apportioned_to_add_up_to_the_limit() -> None:
    """Rounding each replica's part up would let three replicas admit 6 requests of a limit of 4."""
    assert apportion(4, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}) == {"a": 2, "b": 1, "c": 1}  # a tie: by name
    assert apportion(10, {"a": 0.55, "b": 0.25, "c": 0.2}) == {"a": 6, "b": 2, "c": 2}  # .5 and .5: more demand
    assert apportion(4, {"a": 0.84, "b": 0.08, "c": 0.08}) == {"a": 4, "b": 0, "c": 0}  # barely used: no seat
    assert apportion(2, {"a": 0.4, "b": 0.35, "c": 0.25}) == {"a": 1, "b": 1, "c": 0}  # fewer seats than replicas
    for total in range(1, 30):
        fractions = {"a": 0.61, "b": 0.29, "c": 0.1}
        assert sum(apportion(total, fractions).values()) == total


def test_replicas_splitting_a_tenants_concurrency_admit_no_more_than_its_limit_together() -> None:
    table = parse_tenants({"acme": {"max_concurrent_requests": 4}})
    replicas = {name: Limiter(table) for name in "abc"}
    split = shares({"acme": {"a": 10.0, "b": 1.0, "c": 0.0}}, set(replicas))
    for name, limiter in replicas.items():
        limiter.set_shares(split, name)
    admitted = {name: sum(isinstance(limiter.take("acme", 1), Lease) for _ in range(10))
                for name, limiter in replicas.items()}
    assert admitted == {"a": 3, "b": 1, "c": 0}  # 4 in all, most where the tenant's requests arrive
    refusal = replicas["c"].take("acme", 1)
    assert isinstance(refusal, Refusal) and refusal.reason == "concurrency" and "retry-after" in refusal.headers
    assert "limit 0 (this router replica's part of 4), in flight 0" in refusal.message


def test_a_share_of_a_rate_is_at_least_one_a_minute() -> None:
    """Else its bucket never holds one request; the clamp lives in the share, the one place parts are made."""
    part = TenantLimits(requests_per_minute=30, tokens_per_minute=10_000).share(0.01)
    assert (part.requests_per_minute, part.tokens_per_minute) == (1, 100)


def test_a_limiter_takes_its_share_keeping_how_full_its_buckets_are() -> None:
    clock = Clock()
    limiter = Limiter(parse_tenants(TENANTS), clock=clock)
    for _ in range(30):  # half of acme's minute spent
        assert limiter.check("acme") is None
        lease = limiter.take("acme", 1)
        assert isinstance(lease, Lease)
    limiter.set_shares({"acme": {"a": 0.25, "b": 0.75}}, "a")
    assert limiter.limits("acme").requests_per_minute == 15
    assert limiter.headers("acme")["x-ratelimit-limit-requests"] == "15"
    assert limiter.headers("acme")["x-ratelimit-remaining-requests"] == "7"  # half of 15: no burst from the change
    limiter.set_shares({}, "a")
    assert limiter.limits("acme").requests_per_minute == 60  # back to the even split (one replica: all of it)
    assert limiter.demand == {"acme": 30.0}


def test_a_batch_on_one_replica_does_not_draw_the_tenants_interactive_limits_there(database_url: str) -> None:
    """acme's interactive requests reach replica a, its batch runs on b: a keeps nearly all of the interactive
    limit and b takes nearly all of the batch's (reported apart), instead of the batch's demand moving the
    interactive limit to b."""
    table = DemandTable(database_url)
    limits = parse_tenants(TENANTS)
    a, b = Limiter(limits, batch_share=0.5), Limiter(limits, batch_share=0.5)
    sync_a, sync_b = LimitSync(table, a, "a"), LimitSync(table, b, "b")

    async def traffic() -> None:
        for _ in range(8):
            for _ in range(5):
                a.check("acme")
            for _ in range(100):
                b.batch.check("acme")
            await sync_a.sync(["acme"])
            await sync_b.sync(["acme"])

    asyncio.run(traffic())
    interactive = a.limits("acme").requests_per_minute, b.limits("acme").requests_per_minute
    batch = a.batch.limits("acme").requests_per_minute, b.batch.limits("acme").requests_per_minute
    assert interactive[0] > 50 and sum(interactive) == pytest.approx(60)  # 6 of 7 parts of 60, not 6 of 107
    assert batch[1] > 29 and batch[0] == 1  # a's part, 0.3 a minute, raised to one (a bucket holds one request)
    table.close()


def test_replicas_sharing_a_database_split_a_tenants_limit_where_its_requests_land(database_url: str) -> None:
    """acme's requests all reach replica a, globex's are spread evenly: a ends up enforcing nearly all of acme's
    limit (not half, as an even split would), globex's is split in two, and together they allow the whole (each
    reads the other's previous report, so a steady demand converges over a few periods)."""
    rounds = 8
    table = DemandTable(database_url)
    table_tenants = parse_tenants(TENANTS)
    a, b = Limiter(table_tenants), Limiter(table_tenants)
    sync_a, sync_b = LimitSync(table, a, "a"), LimitSync(table, b, "b")

    async def traffic() -> None:
        for _ in range(rounds):
            for _ in range(20):
                a.check("acme")
                a.check("globex")
                b.check("globex")
            await sync_a.sync(["acme", "globex"])
            await sync_b.sync(["acme", "globex"])

    asyncio.run(traffic())
    acme_a, acme_b = a.limits("acme").requests_per_minute, b.limits("acme").requests_per_minute
    assert acme_a == pytest.approx(60 * 0.95, rel=0.01)  # about 57 of 60, not 30
    assert acme_a + acme_b == pytest.approx(60)
    globex = [limiter.limits("globex").requests_per_minute for limiter in (a, b)]
    assert globex == pytest.approx([60, 60], rel=0.02)
    with Session(table.engine) as session:  # the table names tenants by pseudonym only
        assert not {"acme", "globex"} & set(session.scalars(select(DemandRow.tenant)))
    table.close()


@pytest.mark.slow
def test_a_router_with_a_database_reports_its_demand(tmp_path: Path, tiny_dir: Path) -> None:
    database = f"sqlite:///{tmp_path / 'pool.db'}"
    with serve_checked(make_engine(tiny_dir, kv_cache_blocks=64, max_model_len=256)) as engine_url:
        router = build_router(RouterConfig(pods=[engine_url], scrape_interval_seconds=0.1, database_url=database,
                                           tenants=TENANTS), tiny_dir)
        assert router.limit_sync is not None
        with serve_router(router) as url:
            assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200
            table, deadline = DemandTable(database), time.monotonic() + 30
            with Session(table.engine) as session:
                while not session.scalars(select(DemandRow.replica)).all():  # the first report: one period in
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
        with Session(table.engine) as session:  # a router that stops leaves the split at once
            assert session.scalars(select(DemandRow.replica)).all() == []
        table.close()
    off = build_router(RouterConfig(pods=["http://127.0.0.1:9"], database_url=database, rate_limit_sync=False),
                       tiny_dir)
    assert off.limit_sync is None
