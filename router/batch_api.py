"""The Batch API's HTTP edge: OpenAI's `/v1/files` and `/v1/batches`, as the official clients call them.

Every call needs the tenant's API key (with auth on) and sees only that tenant's files and batches: another
tenant's id is a 404, as an unknown one. The store calls run in a worker thread; nothing here runs a batch
(router/batch_runner.py does, in every replica). A call the pool's database cannot serve now is a 503
`database_unavailable` with Retry-After, as the Responses API answers for its store, never a bare 500.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.datastructures import UploadFile

from kvmesh.engine.openai_types import error_body, read_json
from kvmesh.engine.protocol import RouterMetric
from kvmesh.router.asgi import RouteError, error_response
from kvmesh.router.auth import tenant_hash, unauthorized_body
from kvmesh.router.batch_store import BatchStore
from kvmesh.router.batches import (
    BATCH_ENDPOINTS,
    BATCH_REQUEST_OUTCOMES,
    FINAL_STATUSES,
    MAX_CONCURRENT_UPLOADS,
    UPLOAD_PURPOSE,
    UPLOAD_WAIT_SECONDS,
    BatchInputError,
    FileQuota,
    check_metadata,
    expiry_seconds,
    whole_number,
    window_seconds,
)
from kvmesh.router.limits import Lease
from kvmesh.router.store import database_unavailable

log = logging.getLogger(__name__)

MAX_PAGE = 100  # OpenAI's bound on a page of batches
MAX_FILES_PAGE = 10_000  # and on a page of files (also its default)
CREATE_BODY_BYTES = 64 * 1024  # POST /v1/batches: two ids, a window, an expiry and metadata (under 10 KiB)
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # a multipart body's boundaries and fields beside the file itself
UNAVAILABLE_RETRY_AFTER_SECONDS = 5  # a call made while the pool's database is away: retried after this
UNAVAILABLE = ("the Files and Batches API cannot reach the pool's database now (it is unavailable); your files and "
               "batches are kept: retry later")
LOG_EVERY_SECONDS = 60.0  # an outage fails every call: its traceback is logged once a minute, not once per call
NO_STORE = ("the Batch API keeps files and batches in the pool's database, and this router has none: set "
            "database_url (a pool's spec.store.databaseUrl)")


class BatchMetrics:
    """The batch runner's counters (router/batch_runner.BatchCounters) on the router's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(RouterMetric.BATCH_REQUESTS, "Requests of batches sent by this replica, by outcome.",
                                ["outcome"], registry=registry)
        for outcome in BATCH_REQUEST_OUTCOMES:
            self.requests.labels(outcome)
        self.batches = Counter(RouterMetric.BATCHES, "Batches this replica ended, by final status.", ["status"],
                               registry=registry)
        for status in FINAL_STATUSES:
            self.batches.labels(status)
        self.held = Gauge(RouterMetric.BATCHES_RUNNING, "Batches this replica runs now.", registry=registry)

    def request(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def finished(self, status: str) -> None:
        self.batches.labels(status).inc()

    def running(self, delta: int) -> None:
        self.held.inc(delta)


class UploadSlots:
    """The uploads one replica reads at once, shared by its tenants as the grammar checkers are (engine/constraint.py
    `_FairSlots`): a free slot goes to the waiting upload whose tenant reads the fewest now (the earliest among
    equals), so a tenant alone may use every slot, yet one uploading slowly on all of them makes another wait only
    until the first of its uploads ends, never behind its queued ones. One event loop: no lock."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = count
        self._held: Tally[str] = Tally()
        self._waiting: list[tuple[int, str, asyncio.Future[None]]] = []  # (arrival, tenant, told when given one)
        self._arrivals = itertools.count()

    @property
    def held(self) -> int:
        return self.count - self._free

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, tenant: str, timeout: float) -> bool:
        """Whether a slot was taken for `tenant` within `timeout` seconds (the caller releases it)."""
        if self._free and not self._waiting:
            self._give(tenant)
            return True
        told = asyncio.get_running_loop().create_future()
        waiter = (next(self._arrivals), tenant, told)
        self._waiting.append(waiter)
        try:
            await asyncio.wait({told}, timeout=timeout)
        except BaseException:  # the client left: a slot given meanwhile goes back, else the place in line
            self._leave(waiter)
            raise
        if told.done():
            return True
        self._waiting.remove(waiter)
        return False

    def release(self, tenant: str) -> None:
        self._free += 1
        self._held[tenant] -= 1
        if not self._held[tenant]:
            del self._held[tenant]
        self._hand_over()

    def _give(self, tenant: str) -> None:
        self._free -= 1
        self._held[tenant] += 1

    def _hand_over(self) -> None:
        """Free slots to the waiters whose tenants hold the fewest."""
        while self._free and self._waiting:
            waiter = min(self._waiting, key=lambda w: (self._held[w[1]], w[0]))
            self._waiting.remove(waiter)
            self._give(waiter[1])
            waiter[2].set_result(None)

    def _leave(self, waiter: tuple[int, str, asyncio.Future[None]]) -> None:
        if waiter[2].done():
            self.release(waiter[1])
        else:
            self._waiting.remove(waiter)
            waiter[2].cancel()


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def batch_routes(store: BatchStore | None, tenant_for: Callable[[str | None], str | None],
                 max_file_bytes: int, max_enqueued_requests: int,
                 admit: Callable[[str, int | None, bool], Lease] | None = None, quota: FileQuota | None = None,
                 uploads: UploadSlots | None = None,
                 database_failed: Callable[[], None] = lambda: None) -> APIRouter:
    """The endpoints; `tenant_for(authorization header)` is the tenant of a valid key (None: refused); a tenant's
    batches enqueue at most `max_enqueued_requests` (batch_max_enqueued_requests). `admit(tenant, None, request)`
    takes a concurrency slot of the tenant's limits for each call, and one of its requests for each call that
    writes or reads content (an upload, a download, creating, cancelling, deleting): Router.admit_call, RouteError
    429 over them. The Files and Batches API is the tenant's traffic like any other, an upload its heaviest; reading
    a batch's or a file's object, or a list, which clients poll (as OpenAI's docs show), takes no request, so
    polling a batch never spends the tenant's quota. The tenant's stored files are held within `quota`, and this
    replica reads at most `uploads.count` uploads at once (default MAX_CONCURRENT_UPLOADS), fairly shared by its
    tenants (UploadSlots): one waits up to UPLOAD_WAIT_SECONDS for a slot, then is told to retry. A call the
    database cannot serve now (away, restarting, its disk full) is a 503 `database_unavailable` with Retry-After,
    counted by `database_failed()` (kvmesh_router_database_errors_total{component="batch_api"})."""
    api = APIRouter()
    slots = uploads if uploads is not None else UploadSlots(MAX_CONCURRENT_UPLOADS)
    logged = [-LOG_EVERY_SECONDS]  # when a failure's traceback was last logged

    def admitted(http: HttpRequest, request: bool = True) -> tuple[BatchStore, str, Lease | None] | Response:
        """The store, the caller's tenant pseudonym and its hold on the tenant's limits (closed by the caller when
        the call ends), or the answer to a call that cannot go on (401 without a valid key, 501 without a
        database, 429 over the tenant's limits)."""
        tenant = tenant_for(http.headers.get("authorization"))
        if tenant is None:
            return JSONResponse(unauthorized_body(), status_code=401)
        if store is None:
            return _error(501, NO_STORE, code="batches_disabled")
        try:
            lease = admit(tenant, None, request) if admit is not None else None
        except RouteError as exc:
            return error_response(exc)
        return store, tenant_hash(tenant), lease

    async def call(http: HttpRequest, work: Callable[[BatchStore, str], Any],
                   caller: tuple[BatchStore, str, Lease | None] | None = None, request: bool = True) -> Response:
        """Authenticate and admit (unless `caller` was; `request`: taking one of the tenant's requests), then run
        `work(store, tenant pseudonym)` in a thread: a Response, or JSON to answer. The lease is closed when the
        work is done."""
        if caller is None:
            got = admitted(http, request)
            if isinstance(got, Response):
                return got
            caller = got
        s, tenant, lease = caller
        try:
            result = await asyncio.to_thread(work, s, tenant)
        except BatchInputError as exc:
            return _error(exc.status, str(exc), exc.param, exc.code)
        except Exception as exc:
            if not database_unavailable(exc):
                raise
            database_failed()
            if time.monotonic() - logged[0] >= LOG_EVERY_SECONDS:
                logged[0] = time.monotonic()
                log.exception("the Files and Batches API: the pool's database failed; calls get 503 until it is "
                              "back (logged at most once a minute; kvmesh_router_database_errors_total counts each)")
            return JSONResponse(error_body(UNAVAILABLE, "server_error", code="database_unavailable"), status_code=503,
                                headers={"retry-after": str(UNAVAILABLE_RETRY_AFTER_SECONDS)})
        finally:
            if lease is not None:
                lease.close()
        response = result if isinstance(result, Response) else JSONResponse(result)
        if lease is not None:
            response.headers.update(lease.headers)
        return response

    def found(value: Any, kind: str, item_id: str, param: str | None = None) -> Any:
        return value if value is not None else _error(404, f"No {kind} found with id '{item_id}'.", param,
                                                      code="not_found")

    def page(http: HttpRequest, most: int, default: int) -> tuple[int, str | None, bool]:
        """OpenAI's list parameters: `limit` (1 to `most`), the cursor `after`, and whether `order` is newest
        first (desc, the default)."""
        limit = whole_number(http.query_params.get("limit", str(default)))
        order = http.query_params.get("order", "desc")
        if limit is None or not 1 <= limit <= most:
            raise BatchInputError(f"limit must be a whole number from 1 to {most}", "limit")
        if order not in ("asc", "desc"):
            raise BatchInputError(f"order must be asc or desc, not {order!r}", "order")
        return limit, http.query_params.get("after"), order == "desc"

    @api.post("/v1/files")
    async def upload(http: HttpRequest) -> Response:
        if isinstance(caller := admitted(http), Response):  # before reading a byte of the body
            return caller
        tenant, lease = caller[1], caller[2]
        # each upload holds up to max_file_bytes on disk and a piece of it in memory; its body is not read (nor its
        # body_read_timeout_seconds started) while it waits for a slot
        if not await slots.acquire(tenant, UPLOAD_WAIT_SECONDS):
            if lease is not None:
                lease.close()
            return JSONResponse(error_body(f"this router replica is reading {slots.held} uploads already, its most "
                                           f"(batch_max_concurrent_uploads), and none came free for this one within "
                                           f"{UPLOAD_WAIT_SECONDS:g} s; retry in a moment", "rate_limit_error",
                                           code="too_many_uploads"), status_code=429, headers={"retry-after": "1"})
        try:
            return await _upload(http, caller)
        finally:
            slots.release(tenant)
            if lease is not None:
                lease.close()  # once more does nothing: `call` closes it after storing

    async def _upload(http: HttpRequest, caller: tuple[BatchStore, str, Lease | None]) -> Response:
        size = whole_number(http.headers.get("content-length", ""))
        if size is None:  # the bound holds before the body is read, so its size must be said
            return _error(411, "an upload needs a Content-Length header")
        if size > max_file_bytes + MULTIPART_OVERHEAD_BYTES:
            return _error(413, f"the file is over this pool's limit of {max_file_bytes} bytes", "file")
        try:  # the file part is spooled to a temporary file past 1 MiB (starlette), never held whole in memory
            form = await http.form(max_files=1, max_fields=8)
        except Exception as exc:  # not multipart, or a malformed one: the client's mistake
            return _error(400, f"upload a file as multipart/form-data with fields `file` and `purpose`: {exc}")
        try:
            return await _uploaded(http, form, caller)
        finally:
            await form.close()

    async def _uploaded(http: HttpRequest, form: Any, caller: tuple[BatchStore, str, Lease | None]) -> Response:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            return _error(400, "the form has no file field `file`", "file")
        if purpose != UPLOAD_PURPOSE:
            return _error(400, f"purpose must be '{UPLOAD_PURPOSE}': this server keeps files for batches",
                          "purpose")
        if upload.size is None or upload.size > max_file_bytes:
            return _error(413, f"the file is over this pool's limit of {max_file_bytes} bytes", "file")
        name, size, spooled = upload.filename or "upload.jsonl", upload.size, upload.file
        fields = {key.removeprefix("expires_after[").removesuffix("]"): value for key, value in form.items()
                  if key.startswith("expires_after[")}

        def add(s: BatchStore, tenant: str) -> Any:
            ttl = expiry_seconds(fields or None, "expires_after")
            spooled.seek(0)
            return s.add_file(tenant, UPLOAD_PURPOSE, name, spooled, ttl, quota, size)

        return await call(http, add, caller)

    @api.get("/v1/files")
    async def list_files(http: HttpRequest) -> Response:
        purpose = http.query_params.get("purpose")
        return await call(http, lambda s, tenant: s.files(tenant, purpose, *page(http, MAX_FILES_PAGE,
                                                                                  MAX_FILES_PAGE)), request=False)

    @api.get("/v1/files/{file_id}")
    async def get_file(http: HttpRequest, file_id: str) -> Response:
        return await call(http, lambda s, tenant: found(s.file(tenant, file_id), "file", file_id), request=False)

    @api.get("/v1/files/{file_id}/content")
    async def file_content(http: HttpRequest, file_id: str) -> Response:
        def read(s: BatchStore, tenant: str) -> Any:
            stored = s.file_pieces(tenant, file_id)
            if stored is None:
                return found(None, "file", file_id)
            size, pieces = stored  # starlette iterates the pieces in a thread: each a database read
            return StreamingResponse(pieces, media_type="application/jsonl", headers={"content-length": str(size)})

        return await call(http, read)

    @api.delete("/v1/files/{file_id}")
    async def delete_file(http: HttpRequest, file_id: str) -> Response:
        return await call(http, lambda s, tenant: found(
            {"id": file_id, "object": "file", "deleted": True} if s.delete_file(tenant, file_id) else None,
            "file", file_id))

    @api.post("/v1/batches")
    async def create(http: HttpRequest) -> Response:
        if isinstance(caller := admitted(http), Response):  # before reading a byte of the body
            return caller
        try:
            body = await _creation_body(http)
        except BatchInputError as exc:
            if caller[2] is not None:
                caller[2].close()
            return _error(exc.status, str(exc), exc.param, exc.code)

        def create_batch(s: BatchStore, tenant: str) -> Any:
            endpoint, file_id = body.get("endpoint"), body.get("input_file_id")
            if endpoint not in BATCH_ENDPOINTS:
                raise BatchInputError(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}; got {endpoint!r}",
                                      "endpoint")
            window = body.get("completion_window", "24h")
            seconds, metadata = window_seconds(window), check_metadata(body.get("metadata"))
            output_ttl = expiry_seconds(body.get("output_expires_after"), "output_expires_after")
            source = s.file(tenant, file_id) if isinstance(file_id, str) else None
            if source is None:
                return found(None, "file", file_id, "input_file_id")
            if source["purpose"] != UPLOAD_PURPOSE:
                raise BatchInputError(f"the file {file_id} has purpose '{source['purpose']}', not "
                                      f"'{UPLOAD_PURPOSE}'", "input_file_id")
            return s.create_batch(tenant, endpoint, file_id, window, seconds, metadata, output_ttl,
                                  max_enqueued_requests)

        return await call(http, create_batch, caller)

    @api.get("/v1/batches")
    async def list_batches(http: HttpRequest) -> Response:
        return await call(http, lambda s, tenant: s.batches(tenant, *page(http, MAX_PAGE, 20)), request=False)

    @api.get("/v1/batches/{batch_id}")
    async def get_batch(http: HttpRequest, batch_id: str) -> Response:
        return await call(http, lambda s, tenant: found(s.batch(tenant, batch_id), "batch", batch_id),
                          request=False)

    @api.post("/v1/batches/{batch_id}/cancel")
    async def cancel(http: HttpRequest, batch_id: str) -> Response:
        return await call(http, lambda s, tenant: found(s.cancel(tenant, batch_id), "batch", batch_id))

    return api


async def _creation_body(http: HttpRequest) -> dict[str, Any]:
    """POST /v1/batches' body, bounded as it comes (a chunked body says no length); BatchInputError 413, 400."""
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > CREATE_BODY_BYTES:
            raise BatchInputError(f"a batch's creation body is at most {CREATE_BODY_BYTES >> 10} KiB", status=413)
        chunks.append(chunk)
    try:
        body = read_json(b"".join(chunks))
    except ValueError as exc:
        raise BatchInputError(str(exc)) from None
    if not isinstance(body, dict):
        raise BatchInputError("the body must be a JSON object")
    return body


def tenants_by_pseudonym(tenants: Callable[[], Iterable[str]]) -> Callable[[str], str | None]:
    """tenant pseudonym -> tenant name, over the tenants that have a key now (`tenants()`, read at each call: a
    rotated keys file adds and removes them)."""
    def tenant_of(pseudonym: str) -> str | None:
        return next((t for t in tenants() if tenant_hash(t) == pseudonym), None)

    return tenant_of

