"""Runs batches: each router replica claims one batch at a time from the pool's database and sends its requests
through its own routing, at a low priority, so a batch fills the pool's idle capacity and is shed first when
interactive traffic needs the pods.

A request refused for load or for its tenant's limits (a 429 with Retry-After, a 503) waits and is sent again:
overload delays a batch, it never fails one. A 429 without Retry-After (a prompt over the tenant's whole minute of
tokens: waiting cannot help) is final. A server error is retried a few times; any other answer is final and goes to the
batch's error file. Requests are sent in prefix order (router/batches.run_order), so each run of requests sharing
a prompt prefix is served from the first one's cached blocks. Batches take turns: after TURN_SECONDS a replica
hands its batch on when another waits (the requests in flight finish first), so one tenant's long batch never
holds every replica while another's waits. Answers are written as they come (every FLUSH_SECONDS), so a replica
that dies loses at most a second of them and the replica that takes the batch over skips what was answered.

While the pool's database is away the answers cannot be written: a run whose writes have failed for PAUSE_FLUSHES
flush periods sends no new request (those in flight finish) until a write succeeds, and keeps the answers it could not
write in memory, writing them once the database is back, also those of a run that ended meanwhile. An outage thus
costs its time and no answer (a replica that dies during it loses the couple of seconds' answers before the pause).
The lease is not given up for an outage: renewing it when the database is back tells whether another replica took
the batch meanwhile (one the database was reachable from), and a replica that saw the outage waits a connection
attempt's timeout plus CLAIM_GRACE_FLUSHES flush periods before claiming (claim_grace_seconds), so the replica
running a batch, whose renewal may still be waiting on a connection begun during the outage, writes its answers and
renews first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.exc import DBAPIError

from kvmesh.router.batch_store import BatchStore, ClaimedBatch
from kvmesh.router.batches import (
    ACTIVE_STATUSES,
    BATCH_ORDERS,
    PREFIX_ORDER,
    BatchLine,
    CheckedInput,
    LineProblem,
    LineResult,
    check_input,
    jsonl,
    new_id,
    prefix_groups,
    run_order,
    unrun_line,
)
from kvmesh.router.store import CONNECT_TIMEOUT_SECONDS, database_unavailable

log = logging.getLogger(__name__)

LEASE_SECONDS = 30.0  # a replica that stops renewing for this long hands its batch to another
FLUSH_SECONDS = 1.0  # answers are written, the lease renewed and the status read this often
POLL_SECONDS = 1.0  # how often an idle replica looks for a batch to run
SWEEP_SECONDS = 60.0  # how often a replica removes expired files
MAX_CRASHES = 3  # runs of one batch in a row that raise before the batch is failed
CHECKED_KEPT = 4  # parsed input files a replica keeps, of batches paused between turns (another may take one on)
TURN_SECONDS = 60.0  # a replica runs a batch this long, then hands it on if another batch waits (round robin)
YIELDED = "yielded"  # _run_lines' status when the batch's turn ended with requests left
# requests whose prompts open with this many characters alike (about 64 tokens) wait for the first of them
GROUP_MIN_CHARS = 256
MAX_WAIT_SECONDS = 10.0  # a refused request waits its Retry-After, but no longer than this, before it is sent again
SERVER_ERROR_BACKOFF_SECONDS = 1.0
PAUSE_FLUSHES = 2  # writes failing for this many flush periods: the run sends no new request until one succeeds
CLAIM_GRACE_FLUSHES = 3  # after the database failed, a claim waits a connection attempt and this many flush periods
LOG_EVERY_SECONDS = 60.0  # a database failure's traceback is logged at most this often (each is counted)


class Dispatch:
    """Which request of a batch goes next: the first of each prefix run alone, and the rest of its run once it was
    answered (the run's prefix is cached then, so they compute only their own tokens; sent together they would
    each compute the prefix), other runs' requests meanwhile."""

    def __init__(self, groups: list[list[BatchLine]]) -> None:
        self.unstarted = deque(groups)
        self.open: deque[BatchLine] = deque()  # followers whose run's first was answered
        self.following: dict[int, list[BatchLine]] = {}  # line of a run's first, in flight -> its followers
        self.in_flight = 0

    def ready(self) -> bool:
        return bool(self.open or self.unstarted)

    def busy(self) -> bool:
        """Requests are in flight whose answer may open more."""
        return self.in_flight > 0

    def left(self) -> int:
        return len(self.open) + sum(len(g) for g in self.unstarted) + sum(len(f) for f in self.following.values())

    def take(self) -> BatchLine | None:
        """The next request to send, or None when nothing is ready (then nothing is in flight either)."""
        if self.open:
            line = self.open.popleft()
        elif self.unstarted:
            first, *followers = self.unstarted.popleft()
            self.following[first.line] = followers
            line = first
        else:
            return None
        self.in_flight += 1
        return line

    def answered(self, line: BatchLine) -> None:
        """`line` has its final answer (or the batch stopped): its followers, if it led a run, may go."""
        self.in_flight -= 1
        self.open.extend(self.following.pop(line.line, []))


@dataclass(frozen=True)
class Answer:
    """What the router answered one request of a batch."""

    status: int
    body: dict[str, Any]
    retry_after: float | None = None


# (tenant name, endpoint path, request body) -> the router's answer, as a client of its HTTP edge would get it
Send = Callable[[str, str, dict[str, Any]], Awaitable[Answer]]


class BatchCounters(Protocol):
    def request(self, outcome: str) -> None: ...  # a BATCH_REQUEST_OUTCOMES value
    def finished(self, status: str) -> None: ...  # a FINAL_STATUSES value
    def running(self, delta: int) -> None: ...


@dataclass(frozen=True)
class BatchSettings:
    """How a replica runs batches (the router's `batch_*` settings)."""

    concurrency: int = 8  # requests of a batch in flight at once from one replica
    max_requests: int = 50_000  # requests per input file (OpenAI's bound)
    server_error_attempts: int = 3  # sends of a request that keeps getting a 5xx other than 503
    lease_seconds: float = LEASE_SECONDS
    flush_seconds: float = FLUSH_SECONDS
    poll_seconds: float = POLL_SECONDS
    turn_seconds: float = TURN_SECONDS
    order: str = PREFIX_ORDER  # BATCH_ORDERS: prefix (shared prefixes sent together) or file

    def claim_grace_seconds(self) -> float:
        """How long a replica that saw the database fail waits before its next claim: long enough for the holder's
        renewal, begun during the outage, to give up its connection attempt and try again."""
        return CONNECT_TIMEOUT_SECONDS + CLAIM_GRACE_FLUSHES * self.flush_seconds

    def __post_init__(self) -> None:
        if self.order not in BATCH_ORDERS:
            raise ValueError(f"batch_order must be one of {', '.join(BATCH_ORDERS)}, not {self.order!r}")
        if self.concurrency < 1 or self.max_requests < 1 or self.server_error_attempts < 1:
            raise ValueError("batch_concurrency, batch_max_requests and the attempts must be at least 1")
        if self.turn_seconds <= 0:
            raise ValueError("a batch's turn must last more than 0 s")
        if not 0 < self.flush_seconds < self.lease_seconds:
            raise ValueError("a batch's lease must outlast the time between its renewals")


class _FileGone(Exception):
    """The input file was deleted while it was read."""


def check_stored_input(store: BatchStore, batch: ClaimedBatch, max_requests: int) -> CheckedInput | None:
    """The batch's input file checked as it is read from the database, a piece at a time: a replica holds its
    parsed requests, never a second, whole copy of the file. None when the file is gone (or went while read)."""
    stored = store.file_pieces(batch.tenant, batch.input_file_id, expired_too=True)
    if stored is None:
        return None
    size, pieces = stored

    def whole() -> Iterator[bytes]:
        read = 0
        for piece in pieces:
            read += len(piece)
            yield piece
        if read < size:  # ended short: the lines read are not the file (the last one cut, others missing)
            raise _FileGone

    try:
        return check_input(whole(), batch.endpoint, max_requests)
    except _FileGone:
        return None


class BatchRunner:
    """One replica's batch worker: claim, check, run, write the files; `serve_forever` until cancelled."""

    def __init__(self, store: BatchStore, send: Send, tenant_of: Callable[[str], str | None],
                 counters: BatchCounters, settings: BatchSettings | None = None, owner: str | None = None,
                 database_failed: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self.database_failed = database_failed  # each failed operation (kvmesh_router_database_errors_total)
        self._outage = False  # the database failed since this replica last claimed: wait for its grace first
        self._logged = -math.inf  # when a database failure's traceback was last logged
        self.send = send
        self.tenant_of = tenant_of  # tenant pseudonym -> the tenant's name, None once it has no API key
        self.counters = counters
        self.settings = settings or BatchSettings()
        self.owner = owner or new_id("router-")
        self._checked: dict[str, CheckedInput] = {}  # the input files of batches paused between turns, newest first
        # batch id -> (its tenant pseudonym, runs in a row here that raised); dropped when a run succeeds, when the
        # batch is failed for it, or at the sweep once the batch ended (on another replica maybe) or is gone
        self._crashes: dict[str, tuple[str, int]] = {}

    async def serve_forever(self) -> None:
        swept = -math.inf
        while True:
            claimed = None
            try:
                if self._outage:  # leases that ran out while the database was away: their holders renew first
                    await asyncio.to_thread(self.store.ping)
                    self._outage = False
                    await asyncio.sleep(self.settings.claim_grace_seconds())
                if time.monotonic() - swept >= SWEEP_SECONDS:
                    swept = time.monotonic()
                    await asyncio.to_thread(self.store.delete_expired)
                    await asyncio.to_thread(self._forget_ended_crashes)
                claimed = await asyncio.to_thread(self.store.claim, self.owner, self.settings.lease_seconds)
            except Exception as exc:  # the database away: batches wait for it, interactive traffic does not notice
                self._database_fault(exc, "batch runner: could not read the batches")
            if claimed is None:
                await asyncio.sleep(self.settings.poll_seconds)
                continue
            self.counters.running(1)
            try:
                await self.run(claimed)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await asyncio.shield(asyncio.to_thread(self.store.release, claimed.id, self.owner))
                raise
            except Exception as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # stopping: a fault on the way out does not hold it
                    raise asyncio.CancelledError from exc
                if isinstance(exc, DBAPIError) or database_unavailable(exc):  # passing: tried again, not counted
                    self._database_fault(exc, f"batch runner: batch {claimed.id}: the database failed")
                    await asyncio.sleep(self.settings.poll_seconds)
                    continue
                crashes = self._crashes.get(claimed.id, (claimed.tenant, 0))[1] + 1
                self._crashes[claimed.id] = (claimed.tenant, crashes)
                log.exception("batch runner: batch %s stopped (%d time(s))", claimed.id, crashes)
                if crashes >= MAX_CRASHES:  # not a passing fault: end it rather than retry forever
                    with contextlib.suppress(Exception):
                        await self._fail(claimed, [LineProblem("runner_error", f"the batch runner failed on this "
                                                                               f"batch {MAX_CRASHES} times: {exc}")])
                        del self._crashes[claimed.id]  # failed, or no longer this replica's to fail
                await asyncio.sleep(self.settings.poll_seconds)
            else:
                self._crashes.pop(claimed.id, None)
            finally:
                self.counters.running(-1)

    def _forget_ended_crashes(self) -> None:
        """Drop the crash counts of batches that ended or are gone: one that crashed here and then finished on
        another replica never comes back to clear its count, which stayed for the life of the process."""
        for batch_id, (tenant, _) in list(self._crashes.items()):
            batch = self.store.batch(tenant, batch_id)
            if batch is None or batch["status"] not in ACTIVE_STATUSES:
                del self._crashes[batch_id]

    def _database_fault(self, exc: BaseException, message: str) -> None:
        """A failed operation on the database: counted, remembered for the next claim's grace, and logged (with its
        traceback at most once a minute: an outage fails every tick)."""
        self.database_failed()
        self._outage = True
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_SECONDS:
            self._logged = now
            log.error("%s (logged at most once a minute; kvmesh_router_database_errors_total counts each)", message,
                      exc_info=exc)
        else:
            log.debug("%s: %s", message, exc)

    async def run(self, batch: ClaimedBatch) -> None:
        """Take a claimed batch as far as it goes: checked, run, and ended with its files (or paused for its next
        turn). Its parsed input (several times the file's size in objects) leaves `_checked` while it runs and goes
        back only when its turn ends with requests left: however else the run ends (finished, failed, cancelled,
        expired, lease lost, raised), the requests of an ended batch, maybe of a deleted file, are not kept."""
        store, owner = self.store, self.owner
        checked = self._checked.pop(batch.id, None)  # a batch taking turns is read and parsed once, not at each turn
        if checked is None:
            # the bound on requests is checked once, when the batch is validated: a replica with a lower one that
            # takes the batch over runs what was accepted
            bound = self.settings.max_requests if batch.status == "validating" else sys.maxsize
            checked = await asyncio.to_thread(check_stored_input, store, batch, bound)
            if checked is None:
                await self._fail(batch, [LineProblem("missing_file", f"the input file {batch.input_file_id} was "
                                                                     "deleted before the batch ran")])
                return
        if batch.status == "validating":
            if checked.problems:
                await self._fail(batch, checked.problems)
                return
            if not await asyncio.to_thread(store.start, batch.id, owner, len(checked.lines),
                                           checked.model):
                return  # cancelled while it was checked: the next claim ends it
            batch = dataclasses.replace(batch, status="in_progress")
        tenant = self.tenant_of(batch.tenant)
        if tenant is None and batch.status == "in_progress":
            await self._fail(batch, [LineProblem("tenant_revoked", "the batch's tenant no longer has an API key")])
            return
        status = batch.status
        if status == "in_progress":
            status = "expired"
            if time.time() < batch.expires_at:
                status = await self._run_lines(batch, checked.lines, tenant or "")
            if status is None:
                return  # the lease went to another replica: it carries on
            if status == YIELDED:  # another batch's turn: this one is taken up again after it
                self._checked = {batch.id: checked, **dict(list(self._checked.items())[: CHECKED_KEPT - 1])}
                await asyncio.to_thread(store.release, batch.id, owner)
                return
        await self._finish(batch, checked.lines, status)

    async def _fail(self, batch: ClaimedBatch, problems: list[LineProblem]) -> None:
        if await asyncio.to_thread(self.store.fail, batch.id, self.owner, problems):
            self.counters.finished("failed")

    async def _run_lines(self, batch: ClaimedBatch, lines: list[BatchLine], tenant: str) -> str | None:
        """Send every request not yet answered; the status to end in (in_progress: all answered, or cancelling,
        or expired), YIELDED when its turn ended (the requests in flight finish; the rest wait for its next
        turn), or None when the lease was lost."""
        # preparing (reading and checking the file, maybe of 100 MiB) may outlast the lease: another replica that
        # took the batch meanwhile runs it, and this one sends nothing rather than requests it sends too; a batch
        # cancelled meanwhile ends with nothing sent (the keeper's first tick would stop it a flush period later)
        status = await asyncio.to_thread(self.store.renew, batch.id, self.owner, self.settings.lease_seconds)
        if status in (None, "cancelling"):
            return status
        answered = await asyncio.to_thread(self.store.answered_lines, batch.id)
        ordered = [line for line in run_order(lines, self.settings.order) if line.line not in answered]
        shared = GROUP_MIN_CHARS if self.settings.order == PREFIX_ORDER else 0
        dispatch = Dispatch(prefix_groups(ordered, shared))
        stop = asyncio.Event()  # cancel what is in flight: the batch was cancelled, expired or lost
        turn_over = asyncio.Event()  # send nothing more: another batch's turn
        paused = [False]  # send nothing new until a write succeeds: the database is away
        ended: list[str | None] = ["in_progress"]
        done: list[LineResult] = []  # answers not written yet
        changed = asyncio.Condition()  # a run's first request was answered, or the pause ended: requests may go

        def halted() -> bool:
            return stop.is_set() or turn_over.is_set()

        def may_take() -> bool:
            return halted() or (not paused[0] and (dispatch.ready() or not dispatch.busy()))

        async def worker() -> None:
            while True:
                async with changed:
                    await changed.wait_for(may_take)
                    line = None if halted() else dispatch.take()
                if line is None:
                    return
                try:
                    result = await self._attempt(batch, line, tenant, stop)
                    if result is not None:
                        done.append(result)
                finally:
                    async with changed:
                        dispatch.answered(line)
                        changed.notify_all()

        written = asyncio.Lock()  # the last flush waits for one under way, so the files miss no answer

        async def flush() -> None:
            async with written:
                taken = done[:]
                if taken:  # dropped from `done` once written: a failed write keeps them for the next flush
                    await asyncio.to_thread(self.store.add_results, batch.id, self.owner, taken)
                    del done[: len(taken)]

        async def halt(status: str | None) -> None:
            """Stop the run: cancel what is in flight, and wake the workers waiting for a run's first answer."""
            ended[0] = status
            stop.set()
            async with changed:
                changed.notify_all()

        async def pause(on: bool) -> None:
            paused[0] = on
            async with changed:
                changed.notify_all()

        async def keep_lease() -> None:
            """Every flush_seconds: write the answers, renew the lease, read the status. A database fault skips a
            tick (the answers stay for the next); once writes have failed for PAUSE_FLUSHES flush periods no new
            request is sent until a tick succeeds. The lease is kept through an outage however long: the renewal
            once the database is back says whether another replica took the batch meanwhile (then the run stops)."""
            turn_ends = time.monotonic() + self.settings.turn_seconds
            renewed = time.monotonic()
            while True:
                await asyncio.sleep(self.settings.flush_seconds)
                try:
                    await asyncio.shield(flush())  # a write under way finishes even when the keeper is cancelled
                    status = await asyncio.to_thread(self.store.renew, batch.id, self.owner,
                                                     self.settings.lease_seconds)
                    waiting = (time.monotonic() >= turn_ends and not turn_over.is_set()
                               and await asyncio.to_thread(self.store.others_waiting, batch.id))
                except Exception as exc:
                    self._database_fault(exc, f"batch runner: batch {batch.id}: the database failed; "
                                              f"{len(done)} answer(s) wait to be written")
                    if not paused[0] and time.monotonic() - renewed >= PAUSE_FLUSHES * self.settings.flush_seconds:
                        log.warning("batch runner: batch %s: nothing could be written for %.1f s; no new request is "
                                    "sent until the database is back", batch.id, time.monotonic() - renewed)
                        await pause(True)
                    continue
                renewed = time.monotonic()
                if paused[0]:
                    log.warning("batch runner: batch %s: the database is back; sending again", batch.id)
                    await pause(False)
                if status is None or status == "cancelling" or time.time() >= batch.expires_at:
                    await halt(status if status in (None, "cancelling") else "expired")
                    return
                if waiting:
                    turn_over.set()  # the workers end once their requests in flight are answered
                    async with changed:
                        changed.notify_all()
                if time.monotonic() >= turn_ends:
                    turn_ends = time.monotonic() + self.settings.turn_seconds

        keeper = asyncio.create_task(keep_lease())
        try:
            async with asyncio.TaskGroup() as workers:  # one that raises cancels the others: none runs unwatched
                for _ in range(self.settings.concurrency):
                    workers.create_task(worker())
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await keeper
            await self._last_write(batch, flush, done)
        return YIELDED if ended[0] == "in_progress" and dispatch.left() else ended[0]

    async def _last_write(self, batch: ClaimedBatch, flush: Callable[[], Awaitable[None]],
                          done: list[LineResult]) -> None:
        """Write a run's last answers, trying again every flush period while the database is away: they wait for it
        in memory rather than be sent again. Only a replica stopping gives them up (whoever runs the batch next sends
        them again)."""
        while True:
            try:
                await asyncio.shield(flush())  # a lost lease drops them: the batch's new holder sends them
                return
            except Exception as exc:
                self._database_fault(exc, f"batch runner: batch {batch.id}: its last {len(done)} answer(s) could "
                                          "not be written; trying again")
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                log.warning("batch runner: batch %s: stopping with %d answer(s) not written", batch.id, len(done))
                return
            await asyncio.sleep(self.settings.flush_seconds)

    async def _attempt(self, batch: ClaimedBatch, line: BatchLine, tenant: str,
                       stop: asyncio.Event) -> LineResult | None:
        """One request sent until it has a final answer; None when the batch stopped first."""
        server_errors = 0
        while not stop.is_set():
            try:
                answer = await self._send_unless_stopped(tenant, batch.endpoint, line.body, stop)
                if answer is None:
                    return None
            except Exception as exc:  # the router's own failure: as a 500 would be
                log.exception("batch runner: request %s of %s", line.custom_id, batch.id)
                answer = Answer(500, {"error": {"message": f"the router failed: {exc}", "type": "server_error"}})
            wait = None
            if answer.status == 503 or (answer.status == 429 and answer.retry_after is not None):
                wait = min(answer.retry_after or 1.0, MAX_WAIT_SECONDS)
            elif answer.status >= 500 and (server_errors := server_errors + 1) < self.settings.server_error_attempts:
                wait = SERVER_ERROR_BACKOFF_SECONDS * server_errors
            if wait is None:
                self.counters.request("ok" if answer.status == 200 else "failed")
                request_id = answer.body.get("id") if isinstance(answer.body.get("id"), str) else new_id("")
                return LineResult(line.line, line.custom_id, answer.status, answer.body, request_id)
            self.counters.request("retried")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
        return None

    async def _send_unless_stopped(self, tenant: str, path: str, body: dict[str, Any],
                                   stop: asyncio.Event) -> Answer | None:
        """The answer, or None when the batch stopped first: the call is cancelled then, so the engine aborts the
        request and frees its blocks (a cancelled batch's requests stop at once, not when they end)."""
        call = asyncio.ensure_future(self.send(tenant, path, body))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({call, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this task is cancelled (the router stopping): the call is never left running
            stopped.cancel()
            if not call.done():
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await call
        return None if call.cancelled() else call.result()

    async def _finish(self, batch: ClaimedBatch, lines: list[BatchLine], status: str) -> None:
        """Write the output and error files and end the batch: completed, cancelled or expired."""
        final = {"in_progress": "completed", "finalizing": "completed", "cancelling": "cancelled"}.get(status, status)
        if (final == "completed" and status != "finalizing"
                and not await asyncio.to_thread(self.store.finalizing, batch.id, self.owner)):
            return  # cancelled in the meantime: the next claim ends it so
        results = await asyncio.to_thread(self.store.results, batch.id)
        answered = {r.line for r in results}
        why = {"cancelled": ("batch_cancelled", "the batch was cancelled before this request ran"),
               "expired": ("batch_expired", "the batch's completion window ended before this request ran")}
        unrun = [unrun_line(line, *why[final]) for line in lines if line.line not in answered] if final in why else []
        output = jsonl(r.output_line() for r in results if r.ok)
        errors = jsonl([r.output_line() for r in results if not r.ok] + unrun)
        if await asyncio.to_thread(self.store.finish, batch, self.owner, final, output, errors, len(lines),
                                   len(unrun)):
            self.counters.finished(final)
