"""Tenant limits shared by the router replicas of a pool, split by where each tenant's requests arrive.

Each replica enforces a share of every tenant's limits (router/limits.py). Without a shared database the split is
even (`rate_limit_replicas`), which is exact only when a load balancer spreads each tenant's requests evenly; a
tenant whose connections stick to one replica gets 1/N of its limit. With the pool's database (`database_url`)
the replicas tell each other every SYNC_SECONDS how many requests of each tenant they were asked, and each takes a
share of the tenant's limits in proportion to its part of that demand, so together they allow the tenant its whole
limits wherever its requests land (within a few seconds of a shift). Every replica counts VIRTUAL_REQUESTS more than
it was asked, so a light tenant's limits stay near an even split and a replica a tenant has not used yet can still
admit its first requests, while a heavy tenant's follow its demand. Rates divide; a concurrent-request limit is
whole, so the replicas apportion it by largest remainder (limits.apportion): their parts add up to the limit
exactly (as they read the same reports), a seat left over going to the larger remainder, then to the replica with
more demand. The price of never admitting more than the limit: a replica whose part is no seat (one the tenant has
barely used, or a limit smaller than the replicas) refuses the tenant's requests with a 429 and Retry-After until
its demand, which the refused requests count in, earns it a seat at a later period. A tenant whose limit is below
the number of replicas its requests reach evenly stays refused on some of them: give it connections that stay on
one replica, or a limit of at least the replicas. A replica that stops reporting drops out of the split after
STALE_SECONDS; one that stops (draining) leaves it at its next period. A tenant's Batch API requests, whose
buckets are their own (limits.Limiter.batch), are reported and split apart from its interactive ones: a batch runs
on the replica that holds it, and must not draw the tenant's interactive limits there. The split is pure
(`shares`, `apportion`); the table and the loop are the edges.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping

from sqlalchemy import Float, String, delete, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kvmesh.router.auth import tenant_hash
from kvmesh.router.limits import Limiter
from kvmesh.router.store import create_tables, make_engine

log = logging.getLogger(__name__)

DEMAND_TABLE = "kvmesh_limit_demand"
SYNC_SECONDS = 2.0  # how often a replica reports its demand and reads the others'
STALE_SECONDS = 3 * SYNC_SECONDS  # a replica not heard from for this long is out of the split
VIRTUAL_REQUESTS = 1.0  # added to each replica's demand per period: the split of a tenant nobody asks is even
SMOOTHING = 0.5  # each report's demand: this much of the last interval's requests, the rest the previous report's
LOG_EVERY_SECONDS = 60.0  # a failed sync's traceback is logged at most this often
BATCH_SUFFIX = ":batch"  # a tenant's Batch API demand is reported under its pseudonym and this (never hex)


class _Base(DeclarativeBase):
    pass


class DemandRow(_Base):
    __tablename__ = DEMAND_TABLE

    replica: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)  # auth.tenant_hash (+ BATCH_SUFFIX): no names
    requests: Mapped[float] = mapped_column(Float)  # smoothed requests asked for per interval
    updated: Mapped[float] = mapped_column(Float)  # wall-clock time of the report


def shares(demand: Mapping[str, Mapping[str, float]], replicas: set[str]) -> dict[str, dict[str, float]]:
    """Each live replica's fraction of each tenant's limits (`demand[tenant][replica]`): in proportion to its demand
    for the tenant plus VIRTUAL_REQUESTS. The fractions of one tenant add up to 1."""
    out = {}
    for tenant, by_replica in demand.items():
        total = sum(by_replica.get(r, 0.0) for r in replicas) + VIRTUAL_REQUESTS * len(replicas)
        out[tenant] = {r: (by_replica.get(r, 0.0) + VIRTUAL_REQUESTS) / total for r in replicas}
    return out


class DemandTable:
    """The replicas' reports in the pool's database (the request log's and the Batch API's)."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        create_tables(self.engine, _Base.metadata)

    def report(self, replica: str, demand: Mapping[str, float]) -> tuple[dict[str, dict[str, float]], set[str]]:
        """Replace this replica's rows with `demand` (by tenant pseudonym) and read every live replica's: (demand
        by tenant and replica, the live replicas)."""
        now = time.time()
        with Session(self.engine) as session, session.begin():
            session.execute(delete(DemandRow).where(DemandRow.replica == replica))
            session.execute(delete(DemandRow).where(DemandRow.updated < now - 10 * STALE_SECONDS))  # long gone
            session.add_all(DemandRow(replica=replica, tenant=t, requests=v, updated=now)
                            for t, v in demand.items())  # every tenant, asked or not: it is live
        with Session(self.engine) as session:
            rows = session.scalars(select(DemandRow).where(DemandRow.updated >= now - STALE_SECONDS)).all()
        live = {row.replica for row in rows}
        by_tenant: dict[str, dict[str, float]] = {}
        for row in rows:
            by_tenant.setdefault(row.tenant, {})[row.replica] = row.requests
        return by_tenant, live

    def leave(self, replica: str) -> None:
        """Drop a stopping replica's reports, so the others take its part of the split at their next period."""
        with Session(self.engine) as session, session.begin():
            session.execute(delete(DemandRow).where(DemandRow.replica == replica))

    def close(self) -> None:
        self.engine.dispose()


class LimitSync:
    """One replica's side: report its smoothed demand, take its shares. The limiter is touched on the event loop
    only (it is not thread-safe); the database in a thread."""

    def __init__(self, table: DemandTable, limiter: Limiter, replica: str,
                 database_failed: Callable[[], None] = lambda: None) -> None:
        self.table, self.limiter, self.replica = table, limiter, replica
        self.database_failed = database_failed  # each failed sync (kvmesh_router_database_errors_total)
        self._logged = -math.inf  # when a failure was last logged
        self.smoothed: dict[str, float] = {}  # by report key (`_keys`)

    def _keys(self, tenants: Iterable[str]) -> dict[str, tuple[Limiter, str]]:
        """report key -> (limiter, tenant name): a tenant's interactive requests under its pseudonym, its Batch API
        requests (buckets of their own, run by whichever replica holds the batch) under the pseudonym and
        BATCH_SUFFIX, so that a batch's demand never moves the tenant's interactive limits to its replica."""
        lanes = ((self.limiter, ""), (self.limiter.batch, BATCH_SUFFIX))
        return {tenant_hash(t) + suffix: (limiter, t) for t in set(tenants) for limiter, suffix in lanes}

    async def sync(self, tenants: Iterable[str]) -> None:
        """One report, and this replica's part of the `tenants`' limits (names) set on the limiter."""
        keys = self._keys(tenants)
        asked: dict[str, float] = {}
        for limiter in (self.limiter, self.limiter.batch):
            taken, limiter.demand = limiter.demand, {}
            asked |= {key: taken[t] for key, (lane, t) in keys.items() if lane is limiter and t in taken}
        self.smoothed = {key: SMOOTHING * asked.get(key, 0.0) + (1 - SMOOTHING) * self.smoothed.get(key, 0.0)
                         for key in keys}  # a tenant whose key went is dropped
        demand, live = await asyncio.to_thread(self.table.report, self.replica, self.smoothed)
        fractions = shares(demand, live | {self.replica})  # every key reported above is in `demand`
        for limiter in (self.limiter, self.limiter.batch):
            limiter.set_shares({t: fractions[key] for key, (lane, t) in keys.items() if lane is limiter}, self.replica)

    async def run(self, tenants: Callable[[], Iterable[str]], stopping: Callable[[], bool]) -> None:
        """Sync every SYNC_SECONDS until the router drains: then leave the split (it takes no new requests; a
        replica taking over must not share a tenant's limits with it)."""
        while True:
            await asyncio.sleep(SYNC_SECONDS)
            try:
                if stopping():
                    await asyncio.to_thread(self.table.leave, self.replica)
                    return
                await self.sync(tenants())
            except Exception:  # the database away: the shares in force stay
                self.database_failed()
                if time.monotonic() - self._logged >= LOG_EVERY_SECONDS:  # an outage fails every period
                    self._logged = time.monotonic()
                    log.exception("tenant limits: could not share demand with the other replicas (logged at most "
                                  "once a minute; kvmesh_router_database_errors_total counts each)")
