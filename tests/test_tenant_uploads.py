"""Tenants sharing a router's upload slots (batch_max_concurrent_uploads): one tenant uploading slowly on every
slot made every other tenant's upload a 429 until one of its own ended, and its next upload could take that slot
again. The next free slot now goes to the waiting tenant that reads the fewest uploads. A keyed router with a
database in front of a loopback stub pod; the slow uploads are raw sockets holding back their body's end."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from kvmesh.router import batch_api
from kvmesh.router.app import Router
from kvmesh.router.batch_api import UploadSlots

from .test_router_broken_reply import routed, stub_pod
from .test_router_tenant_guards import KEYS, keys_file, upload
from .waiting import wait_for

BODY = (b"--kvmesh\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--kvmesh\r\n"
        b"content-disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\r\n{}\n\r\n--kvmesh--\r\n")
HELD_BACK = 20  # bytes of BODY a slow upload sends before it is told to finish


@contextmanager
def slow_upload(url: str, tenant: str) -> Iterator[Callable[[], bytes]]:
    """An upload whose headers and first bytes are sent, the rest when the yielded call sends them (it returns
    the answer's first bytes)."""
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/files HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEYS[tenant].encode()
                     + b"\r\ncontent-type: multipart/form-data; boundary=kvmesh\r\ncontent-length: %d\r\n\r\n"
                     % len(BODY) + BODY[:HELD_BACK])

        def finish() -> bytes:
            sock.sendall(BODY[HELD_BACK:])
            return sock.recv(65536)

        yield finish


@pytest.fixture
def two_slots(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Router]]:
    """A keyed router reading at most 2 uploads at once; an upload waits up to 30 s for a slot."""
    monkeypatch.setattr(batch_api, "UPLOAD_WAIT_SECONDS", 30.0)
    with stub_pod(tiny_dir) as pod, routed(tiny_dir, [pod.url], api_keys_file=str(keys_file(tmp_path)),
                                           database_url=f"sqlite:///{tmp_path / 'pool.db'}",
                                           batch_max_concurrent_uploads=2) as served:
        yield served


def test_a_tenant_uploading_slowly_on_every_slot_does_not_keep_another_tenant_out(
        two_slots: tuple[str, Router]) -> None:
    """acme holds both slots with slow uploads and queues a third; globex's upload, queued after it, gets the first
    slot acme frees (globex reads none, acme one), and acme's third the next. Before: globex's upload was a 429
    `too_many_uploads` at once, whatever acme held."""
    url, router = two_slots
    with slow_upload(url, "acme") as first, slow_upload(url, "acme") as second, ThreadPoolExecutor(1) as client:
        wait_for(lambda: router.uploads.held == 2)
        with slow_upload(url, "acme") as third:
            wait_for(lambda: router.uploads.waiting == 1)
            globex: Future[httpx.Response] = client.submit(upload, url, "globex", b"{}\n")
            wait_for(lambda: router.uploads.waiting == 2)
            assert first().startswith(b"HTTP/1.1 200")
            # served at once (in arrival order acme's third, slow too, would hold the slot the whole 30 s wait)
            assert globex.result(timeout=10).status_code == 200
            wait_for(lambda: router.uploads.waiting == 0 and router.uploads.held == 2)  # acme's third: globex's slot
            assert third().startswith(b"HTTP/1.1 200")
        assert second().startswith(b"HTTP/1.1 200")
    wait_for(lambda: router.uploads.held == 0)


def test_a_tenant_alone_uses_every_slot_and_past_them_waits_then_gets_a_429(
        two_slots: tuple[str, Router], monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone, acme reads 2 uploads at once; a third waits UPLOAD_WAIT_SECONDS and is then told to retry (429
    `too_many_uploads`, Retry-After 1), and its tenant's place is not kept."""
    url, router = two_slots
    monkeypatch.setattr(batch_api, "UPLOAD_WAIT_SECONDS", 0.3)
    with slow_upload(url, "acme") as first, slow_upload(url, "acme") as second:
        wait_for(lambda: router.uploads.held == 2)
        refused = upload(url, "acme", b"{}\n")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_uploads"
        assert refused.headers["retry-after"] == "1" and router.uploads.waiting == 0
        assert first().startswith(b"HTTP/1.1 200") and second().startswith(b"HTTP/1.1 200")
    assert upload(url, "globex", b"{}\n").status_code == 200


def test_a_waiting_upload_whose_client_leaves_gives_back_its_place_and_any_slot_handed_to_it() -> None:
    """A client that leaves while its upload waits (its task cancelled) holds nothing afterwards, even when a slot
    was handed to it in the same turn of the loop."""
    async def scenario() -> None:
        slots = UploadSlots(1)
        assert await slots.acquire("acme", 1)
        waiting = asyncio.create_task(slots.acquire("globex", 10))
        await asyncio.sleep(0)
        assert slots.waiting == 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert slots.waiting == 0 and slots.held == 1
        handed = asyncio.create_task(slots.acquire("globex", 10))
        await asyncio.sleep(0)
        slots.release("acme")  # handed to globex's waiter...
        handed.cancel()  # ...which is cancelled before it runs again
        await asyncio.gather(handed, return_exceptions=True)
        assert slots.held == 0 and slots.waiting == 0
        assert await slots.acquire("initech", 0)

    asyncio.run(scenario())


def test_slots_are_handed_to_the_tenant_holding_fewest_then_in_arrival_order() -> None:
    async def scenario() -> None:
        slots = UploadSlots(2)
        assert await slots.acquire("acme", 0) and await slots.acquire("acme", 0)
        order: list[str] = []

        async def wait(tenant: str) -> None:
            assert await slots.acquire(tenant, 10)
            order.append(tenant)

        tasks = [asyncio.create_task(wait(t)) for t in ("acme", "globex", "initech")]
        await asyncio.sleep(0)
        slots.release("acme")  # acme 1, the others 0: globex, the earlier of the two
        slots.release("acme")  # acme 0, globex 1, initech 0: acme arrived first
        for _ in range(100):  # a woken waiter runs a few turns of the loop later
            await asyncio.sleep(0)
        assert order == ["globex", "acme"] and slots.waiting == 1
        slots.release("globex")
        await asyncio.gather(*tasks)
        assert order == ["globex", "acme", "initech"]

    asyncio.run(scenario())
