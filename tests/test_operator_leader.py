"""Operator high availability: the election's pure decision (operator/leader.py `decide`), and whole `kvmesh operator
--leader-elect` processes against kmock's KubernetesEmulator, which stores Leases like any resource but has no PUT
and no resourceVersion check: `LeaseCluster` adds both, as an API server answers them (a PUT whose
resourceVersion is not the stored one gets 409), so two candidates racing for one lease meet the real rule."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
from kubernetes.client import Configuration
from prometheus_client import CollectorRegistry

from kvmesh.engine.protocol import OperatorMetric
from kvmesh.operator import leader
from kvmesh.operator.leader import (
    EXIT_LOST,
    LEASE_API_VERSION,
    RELEASED_LEASE_SECONDS,
    Action,
    Election,
    Elector,
    LeadershipLost,
    LeaseApi,
    LeaseConflict,
    LeaseError,
    LeaseRecord,
    Seen,
    Timing,
    decide,
    released,
    run_elected,
    serve_health,
)
from kvmesh.operator.metrics import LeaderMetrics
from kvmesh.operator.rbac import LEADER_ELECTION
from kvmesh.processes import free_port
from kvmesh.router.discovery import kube_configuration

from .test_operator import (
    NS,
    POOLS,
    Cluster,
    _versions,
    eventually,
    pool_body,
    serve_operator_resources,
    write_kubeconfig,
)

ME, OTHER = "operator-a_1", "operator-b_2"
T0, T1 = "2026-01-01T00:00:00.000000Z", "2026-01-01T00:00:09.000000Z"


def held(holder: str = OTHER, transitions: int = 3, renewed: str = T0, version: str = "7") -> LeaseRecord:
    return LeaseRecord(holder, 15, transitions, T0, renewed, version)


# ---- the decision --------------------------------------------------------------------------------------------------


def test_no_lease_is_created_as_the_first_holder() -> None:
    step = decide(None, None, ME, False, 100.0, T1, 15)
    assert step.action == Action.ACQUIRE
    assert step.write == LeaseRecord(ME, 15, 0, T1, T1, "")  # no resourceVersion: a create


def test_a_held_lease_is_waited_for_until_it_has_not_changed_for_its_duration() -> None:
    first = decide(held(), None, ME, False, 100.0, T1, 15)
    assert (first.action, first.write) == (Action.WAIT, None)
    assert first.seen == Seen(held(), 100.0)
    assert decide(held(), first.seen, ME, False, 114.9, T1, 15).action == Action.WAIT
    taken = decide(held(), first.seen, ME, False, 115.0, T1, 15)
    assert taken.action == Action.ACQUIRE
    # the transition is counted, the acquire time is the new holder's, the PUT is conditional on the lease read
    assert taken.write == LeaseRecord(ME, 15, 4, T1, T1, "7")


def test_a_holder_that_renews_is_never_taken_over() -> None:
    seen = decide(held(), None, ME, False, 100.0, T1, 15).seen
    renewed = held(renewed=T1, version="8")
    step = decide(renewed, seen, ME, False, 114.0, T1, 15)
    assert step.action == Action.WAIT and step.seen == Seen(renewed, 114.0)  # its clock starts again
    assert decide(renewed, step.seen, ME, False, 128.9, T1, 15).action == Action.WAIT
    assert decide(renewed, step.seen, ME, False, 129.0, T1, 15).action == Action.ACQUIRE


def test_the_holders_clock_is_not_trusted() -> None:
    """A renewTime far in the past (the holder's clock behind this one's) is no reason to take a lease this
    candidate just saw change; one far in the future (a clock ahead) is no reason to wait once the lease stands
    still for its duration. As client-go: only this candidate's own observation time counts."""
    stale_looking = held(renewed="2001-01-01T00:00:00.000000Z")
    assert decide(stale_looking, None, ME, False, 100.0, T1, 15).action == Action.WAIT
    future = held(renewed="2099-01-01T00:00:00.000000Z")
    seen = decide(future, None, ME, False, 100.0, T1, 15).seen
    assert decide(future, seen, ME, False, 115.0, T1, 15).action == Action.ACQUIRE


def test_the_own_lease_is_renewed_keeping_its_acquire_time_and_transitions() -> None:
    mine = held(ME, transitions=4)
    step = decide(mine, None, ME, True, 100.0, T1, 20)
    assert step.action == Action.RENEW
    assert step.write == LeaseRecord(ME, 20, 4, T0, T1, "7")


def test_its_own_lease_found_while_standing_by_is_taken_up() -> None:
    """This candidate's create or take landed but its answer was lost (a timeout): the lease names it. It must lead
    now; renewing it as a standby would keep every candidate, itself included, from leading."""
    step = decide(held(ME, transitions=4), None, ME, False, 100.0, T1, 15)
    assert step.action == Action.ACQUIRE
    assert step.write == LeaseRecord(ME, 15, 4, T0, T1, "7")  # the transition was counted by the write that landed


def test_a_leader_that_sees_another_holder_lost_it() -> None:
    """Even where the other's lease would look expired: someone wrote over this leader's lease, so it stops."""
    seen = Seen(held(), 0.0)
    step = decide(held(), seen, ME, True, 1000.0, T1, 15)
    assert (step.action, step.write) == (Action.LOST, None)


def test_a_released_lease_is_taken_at_once() -> None:
    free = released(held(ME, transitions=2), T1)
    assert (free.holder, free.lease_seconds, free.transitions) == ("", RELEASED_LEASE_SECONDS, 2)
    step = decide(free, None, OTHER, False, 100.0, T1, 15)  # seen this instant for the first time
    assert step.action == Action.ACQUIRE and step.write is not None
    assert (step.write.holder, step.write.transitions) == (OTHER, 3)


def test_the_lease_api_is_the_one_the_operators_role_grants() -> None:
    assert LEASE_API_VERSION.split("/")[0] == LEADER_ELECTION.group and LEADER_ELECTION.resource == "leases"


def test_the_lease_body_round_trips() -> None:
    record = held()
    body = record.body("ns", "kvmesh-operator")
    assert body["apiVersion"] == "coordination.k8s.io/v1" and body["metadata"]["resourceVersion"] == "7"
    assert LeaseRecord.parse(body) == record


@pytest.mark.parametrize("timing", [Timing(15, 2.0, 2.0), Timing(12, 10.0, 2.0), Timing(15, 10.0, 0.0),
                                    Timing(0, 0.5, 0.1)])
def test_durations_that_let_two_leaders_overlap_are_refused(timing: Timing) -> None:
    with pytest.raises(ValueError):
        timing.check()
    Timing().check()  # client-go's defaults pass


# ---- one candidate against a lease in memory, on its own clock -----------------------------------------------------


class Clock:
    """A monotonic clock the test moves: the API's slowness, with no waiting."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class MemoryLeaseApi(LeaseApi):
    """One Lease with the API server's rules (a create of an existing lease or a PUT of a changed one: 409). Each
    write's answer takes `write_seconds` of the clock; `lost_answers` writes are stored and then time out; while
    `reads_fail`, each read times out after a second."""

    def __init__(self, clock: Clock) -> None:  # no client: nothing leaves the process
        self.namespace, self.name, self.clock = NS, "kvmesh-operator", clock
        self.stored: LeaseRecord | None = None
        self.versions = itertools.count(1)
        self.write_seconds, self.lost_answers, self.reads_fail = 0.0, 0, False

    def read(self) -> LeaseRecord | None:
        if self.reads_fail:
            self.clock.now += 1.0
            raise LeaseError("GET: read timed out")
        return self.stored

    def write(self, record: LeaseRecord) -> LeaseRecord:
        if record.resource_version != (self.stored.resource_version if self.stored else ""):
            raise LeaseConflict("changed since it was read")
        self.stored = replace(record, resource_version=str(next(self.versions)))
        self.clock.now += self.write_seconds
        if self.lost_answers:
            self.lost_answers -= 1
            raise LeaseError("PUT: read timed out")
        return self.stored


FAST_RETRY = Timing(15, 10.0, 0.001)  # client-go's lease and renew deadline; a retry that costs the test no time


def memory_elector() -> tuple[Elector, MemoryLeaseApi, CollectorRegistry]:
    clock, registry = Clock(), CollectorRegistry()
    api = MemoryLeaseApi(clock)
    return Elector(api, ME, FAST_RETRY, LeaderMetrics(registry), clock=clock), api, registry


def test_an_acquire_whose_answer_was_lost_leads_at_the_next_round() -> None:
    elector, api, registry = memory_elector()
    api.lost_answers = 1

    async def main() -> None:
        with pytest.raises(LeaseError):
            await elector._round()
        assert api.stored is not None and api.stored.holder == ME and not elector.leading
        assert await elector._round() == Action.ACQUIRE

    asyncio.run(main())
    assert elector.leading and registry.get_sample_value(OperatorMetric.LEADER) == 1
    assert api.stored is not None and api.stored.transitions == 0  # created once: no transition


def test_a_lease_written_past_the_renew_deadline_does_not_start_the_leader() -> None:
    """The API server stored the lease as soon as the write arrived; a standby that saw it then may take it a lease
    duration later, before this candidate's term, counted from the slow answer, would end."""
    elector, api, registry = memory_elector()
    api.write_seconds = 10.0

    async def main() -> None:
        with pytest.raises(LeaseError, match="past the renew deadline"):
            await elector._round()
        assert not elector.leading and registry.get_sample_value(OperatorMetric.LEADER) == 0
        api.write_seconds = 0.0
        assert await elector._round() == Action.ACQUIRE  # its own lease, taken up at once

    asyncio.run(main())
    assert elector.leading


def test_the_renew_deadline_counts_from_when_the_last_write_was_sent() -> None:
    """Acquired with a write sent at 0 s and answered at 6 s, then no renewal gets through: the leader stops at
    10 s (sent + renew deadline), not 16 s (answered + renew deadline), which a standby's 15 s lease overtakes."""
    elector, api, _ = memory_elector()
    api.write_seconds = 6.0

    async def main() -> None:
        assert await elector._round() == Action.ACQUIRE
        api.reads_fail = True
        with pytest.raises(LeadershipLost, match="not renewed"):
            await elector.hold()

    asyncio.run(main())
    assert api.clock.now == 10.0 and not elector.leading


def test_release_after_a_renewal_that_landed_late_still_frees_the_lease() -> None:
    """SIGTERM cancels a renewal on its way; its write lands, so the lease moved past the one this leader last
    saw written. The release's conditional PUT gets 409: it reads the lease, still its own, and releases that."""
    elector, api, _ = memory_elector()

    async def main() -> None:
        assert await elector._round() == Action.ACQUIRE
        assert api.stored is not None
        api.write(replace(api.stored, renewed=T1))  # the cancelled renewal, landed
        await elector.release()

    asyncio.run(main())
    assert api.stored is not None and api.stored.holder == "" and not elector.leading


def test_a_candidate_failing_outside_the_lease_api_never_starts_kopf(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error acquire does not retry ends the candidate; the operator must not start as if it had the lease."""

    class BrokenLeaseApi(MemoryLeaseApi):
        def __init__(self, *_: Any) -> None:
            super().__init__(Clock())

        def read(self) -> LeaseRecord | None:
            raise RuntimeError("not a LeaseError")

    monkeypatch.setattr(leader, "LeaseApi", BrokenLeaseApi)
    started: list[bool] = []

    async def operate(_: asyncio.Event) -> None:
        started.append(True)

    with pytest.raises(RuntimeError, match="not a LeaseError"):
        asyncio.run(run_elected(Election(NS, me=ME, timing=FAST_RETRY), Configuration(), operate,
                                LeaderMetrics(CollectorRegistry()), None))
    assert started == []


@pytest.fixture()
def plain_http_url() -> Iterator[str]:
    """An HTTP server that a TLS client cannot shake hands with."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_tls_failure_is_a_lease_error_that_the_election_retries(plain_http_url: str) -> None:
    """The client wraps a TLS failure in its ApiException (status 0): it must fail one round, not the candidate."""
    configuration = Configuration(host=plain_http_url)
    configuration.verify_ssl = False
    with pytest.raises(LeaseError):
        LeaseApi(configuration, NS, "kvmesh-operator", 5.0).read()


# ---- against the emulator ------------------------------------------------------------------------------------------


LEASES = "coordination.k8s.io/v1/leases"
LEASE_PATH = f"/apis/{LEASES}/namespaces/{NS}/leases"


class LeaseCluster(Cluster):
    """The emulator plus what leader election relies on: PUT replaces a Lease only if the request's
    resourceVersion is the stored one (else 409), checked and written under the emulator's lock. `lease_outage`
    answers 503 to every Lease request, an API server a leader cannot reach."""

    lease_outage = False

    async def _handle(self, request: Any) -> Any:
        if request.resource is None or request.resource.plural != "leases":
            return await super()._handle(request)
        if self.lease_outage:
            return await self._render_error(unavailable())
        if request.method != kmock.method.PUT:
            return await super()._handle(request)
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                return await self._render_error(kmock.KubernetesObjectNotFoundError())
            stored = self.objects[key].raw["metadata"]["resourceVersion"]
            if request.data["metadata"].get("resourceVersion") != stored:
                return await self._render_error(conflict())
            request.data["metadata"]["resourceVersion"] = str(next(_versions))
            self.objects[key].patch(request.data)  # every field of a Lease's spec is written: a replace
            return aiohttp.web.json_response(dict(self.objects[key].raw))


def conflict() -> kmock.KubernetesError:
    """The API server's 409. kmock's errors are attrs classes: a subclass's class attributes would lose to the
    constructor's defaults (500), so the status goes in as an argument."""
    return kmock.KubernetesError(status=409, reason="Conflict", message="the object has been modified")


def unavailable() -> kmock.KubernetesError:
    return kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="the API server is unavailable")


@dataclass
class Api:
    k8s: LeaseCluster
    kubeconfig: Path

    def lease(self) -> LeaseRecord | None:
        for (resource, namespace, name), obj in self.k8s.objects.items():
            if resource.plural == "leases" and namespace == NS and name == "kvmesh-operator" and not obj.deleted:
                return LeaseRecord.parse(obj.raw)
        return None

    def holder(self) -> str:
        lease = self.lease()
        return lease.holder if lease else ""

    def pool(self) -> dict[str, Any]:
        for (resource, namespace, name), obj in self.k8s.objects.items():
            if resource.plural == "inferencepools" and namespace == NS and name == "chat" and not obj.deleted:
                return dict(obj.raw)
        return {}

    def lease_verbs(self) -> set[str]:
        """What the operators asked of Leases, as RBAC verbs."""
        verbs = {kmock.method.GET: "get", kmock.method.POST: "create", kmock.method.PUT: "update"}
        return {verbs.get(r.method, str(r.method)) for r in self.k8s
                if r.resource is not None and r.resource.plural == "leases"}

    def creates(self, plural: str, name: str) -> int:
        """The operators' POSTs of this object (one per reconcile of a pool: later ones answer 409)."""
        return sum(1 for r in self.k8s if r.method == kmock.method.POST and r.resource is not None
                   and r.resource.plural == plural and (r.data or {}).get("metadata", {}).get("name") == name
                   and not r.headers.get("User-Agent", "").startswith("kmock/"))


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path) -> AsyncIterator[Api]:
    async with LeaseCluster() as k8s, kmock.Server(k8s) as server:
        serve_operator_resources(k8s)
        k8s.resources[LEASES] = {"kind": "Lease", "namespaced": True, "verbs": ["get", "create", "update"]}
        yield Api(k8s, write_kubeconfig(tmp_path / "kubeconfig", str(server.url)))


@dataclass
class Candidate:
    name: str
    process: asyncio.subprocess.Process
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


async def candidate(api: Api, name: str, lease_seconds: int, tmp_path: Path, renew_deadline: float) -> Candidate:
    """`kvmesh operator --leader-elect` as the chart runs it (POD_NAME, POD_NAMESPACE), with short durations."""
    log = tmp_path / f"{name}.log"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvmesh.cli", "operator", "--kubeconfig", str(api.kubeconfig), "-n", NS,
        "--leader-elect", f"--leader-elect-lease-duration={lease_seconds}",
        f"--leader-elect-renew-deadline={renew_deadline:g}", "--leader-elect-retry-period=0.25", "--tick-seconds=0.5",
        env={**os.environ, "POD_NAME": name, "POD_NAMESPACE": NS}, stdout=log.open("wb"),
        stderr=subprocess.STDOUT)
    return Candidate(name, process, log)


async def exit_code(c: Candidate, seconds: float = 20.0) -> int:
    try:
        return await asyncio.wait_for(c.process.wait(), seconds)
    except TimeoutError:
        raise AssertionError(f"{c.name} did not exit:\n{c.output()[-3000:]}") from None


@contextlib.asynccontextmanager
async def candidates(api: Api, lease_seconds: int, tmp_path: Path,
                     renew_deadline: float = 1.5) -> AsyncIterator[tuple[Candidate, Candidate]]:
    """A, which leads, then B beside it; both killed at the end, whatever happened."""
    a = await candidate(api, "operator-a", lease_seconds, tmp_path, renew_deadline)
    b: Candidate | None = None
    try:
        await eventually(lambda: api.holder().startswith("operator-a_"), 60)
        b = await candidate(api, "operator-b", lease_seconds, tmp_path, renew_deadline)
        await eventually(lambda: "is a candidate" in b.output(), 60)  # type: ignore[union-attr]
        yield a, b
    except AssertionError:
        print(a.output()[-3000:], b.output()[-3000:] if b else "", sep="\n----\n")
        raise
    finally:
        for c in (a, b):
            if c is not None and c.process.returncode is None:
                c.process.kill()
                await c.process.wait()


def run(main: Any, seconds: float = 150.0) -> None:
    asyncio.run(asyncio.wait_for(main(), seconds))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_one_replica_reconciles_and_a_graceful_stop_hands_over_at_once(tmp_path: Path) -> None:
    """The lease lasts 60 s: B takes over within the test's 20 s only because A released it when it stopped. The
    renew deadline is client-go's 10 s: the emulator answers slower as its request log grows, and on a loaded machine
    a renewal of B's took over 1.5 s, so B rightly gave up leading."""

    async def main() -> None:
        async with cluster(tmp_path) as api, candidates(api, 60, tmp_path, renew_deadline=10) as (a, b):
            await api.k8s.post(POOLS, json=pool_body())
            await eventually(lambda: api.pool().get("status", {}).get("observedGeneration") == 1)
            await eventually(lambda: "is a candidate" in b.output())
            # Each reconcile of the pool creates its Deployments (create-then-patch): the standby made none.
            assert api.creates("deployments", "chat-both") == 1
            assert api.holder().startswith("operator-a_") and "leads" not in b.output()

            a.process.send_signal(signal.SIGTERM)
            assert await exit_code(a) == 0
            await eventually(lambda: api.holder().startswith("operator-b_"), 20)
            lease = api.lease()
            assert lease is not None and lease.transitions == 1

            # B reconciles now: a change to the pool is applied.
            await api.k8s.patch(f"{POOLS}/chat", json={"spec": {"router": {"replicas": 3}}})
            await eventually(lambda: api.pool()["status"]["observedGeneration"] == 2, 30)
            assert b.process.returncode is None
            assert api.lease_verbs() == set(LEADER_ELECTION.verbs)  # what the chart's Role grants, all of it used

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_dead_leaders_lease_is_taken_and_a_leader_that_cannot_renew_exits(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path) as api, candidates(api, 2, tmp_path) as (a, b):
            a.process.kill()  # no release: B waits out the 2 s lease
            await exit_code(a)
            await eventually(lambda: api.holder().startswith("operator-b_"), 30)
            await api.k8s.post(POOLS, json=pool_body())
            await eventually(lambda: api.pool().get("status", {}).get("observedGeneration") == 1)

            api.k8s.lease_outage = True  # B cannot renew: past its 1.5 s renew deadline it exits
            assert await exit_code(b) == EXIT_LOST
            assert "leadership lost" in b.output()

    run(main)


def test_two_electors_one_leader_and_the_standby_answers_its_health_probe(tmp_path: Path) -> None:
    """In one process: of two candidates that start together, one acquires (the other's write gets 409 or it
    waits), the standby's /healthz answers 200 saying so, and the metrics say who leads."""

    async def main() -> None:
        async with cluster(tmp_path) as api:
            configuration = kube_configuration(str(api.kubeconfig))
            timing = Timing(60, 1.5, 0.1)
            registries = [CollectorRegistry(), CollectorRegistry()]
            electors = [Elector(LeaseApi(configuration, NS, "kvmesh-operator", 5.0), name, timing, LeaderMetrics(r))
                        for name, r in zip((ME, OTHER), registries, strict=True)]
            tries = [asyncio.create_task(e.acquire()) for e in electors]
            done, pending = await asyncio.wait(tries, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            (winner,) = [electors[tries.index(t)] for t in done]
            (loser,) = [e for e in electors if e is not winner]
            await asyncio.sleep(0.5)  # several more rounds: the standby still waits
            assert not pending.pop().done() and api.holder() == winner.me
            assert (winner.leading, loser.leading) == (True, False)
            leading = [r.get_sample_value(OperatorMetric.LEADER) for r in registries]
            assert leading == [float(e is winner) for e in electors]
            took = registries[electors.index(winner)].get_sample_value(f"{OperatorMetric.LEADER_TRANSITIONS}_total")
            assert took == 1

            port = free_port()
            health = await serve_health(port, loser, host="127.0.0.1")
            assert health is not None
            try:
                async with aiohttp.ClientSession() as session, session.get(
                        f"http://127.0.0.1:{port}/healthz") as reply:
                    assert reply.status == 200 and json.loads(await reply.text()) == {"leader": False}
            finally:
                await health.cleanup()
                for t in tries:
                    t.cancel()

    run(main, 60)


def test_over_http_a_release_after_a_renewal_that_landed_late_still_frees_the_lease(tmp_path: Path) -> None:
    """The API server's 409 for a stale PUT reaches the release as a conflict, which it resolves by releasing the
    lease as it now stands (with a 500 in its place the lease stayed held, and the standby waited it out)."""

    async def main() -> None:
        async with cluster(tmp_path) as api:
            lease_api = LeaseApi(kube_configuration(str(api.kubeconfig)), NS, "kvmesh-operator", 5.0)
            elector = Elector(lease_api, ME, Timing(60, 1.5, 0.1), LeaderMetrics(CollectorRegistry()))
            assert await elector._round() == Action.ACQUIRE
            stale = elector.mine
            assert stale is not None
            await asyncio.to_thread(lease_api.write, replace(stale, renewed=T1))  # the cancelled renewal, landed
            with pytest.raises(LeaseConflict):
                await asyncio.to_thread(lease_api.write, replace(stale, renewed=T1))
            await elector.release()
            lease = api.lease()
            assert lease is not None and lease.holder == "" and lease.lease_seconds == RELEASED_LEASE_SECONDS

    run(main, 60)
