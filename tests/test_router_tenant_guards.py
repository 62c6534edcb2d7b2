"""What a tenant cannot take for itself: a priority above its ceiling (the engines' queues and the router's shedding
obey the header), a workload class it was not trusted to name, a tokens-per-minute limit passed with a list of
prompts, the pool's database and memory through uploads, and the router's CPU through /tokenize (the pool's
engines and load through /kvmesh/pool: tests/test_tenant_pool_status.py). A keyed router in front of loopback stub
pods (tests/test_router_broken_reply.py) or the tiny engine in-process; the limits are per minute, so nothing here
waits for a bucket to refill."""

from __future__ import annotations

import asyncio
import io
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from kvmesh.engine.protocol import MAX_PRIORITY, PRIORITY_HEADER, WORKLOAD_HEADER
from kvmesh.router import batch_api
from kvmesh.router.app import Router, build_router
from kvmesh.router.auth import hash_key
from kvmesh.router.batch_store import PIECE_BYTES, BatchStore
from kvmesh.router.batches import BATCH_PRIORITY, BatchInputError, FileQuota
from kvmesh.router.config import RouterConfig
from kvmesh.router.limits import parse_tenants

from .conftest import make_engine
from .engines import serve_checked, serve_router
from .test_router_broken_reply import routed, stub_pod

KEYS = {"acme": "sk-acme-1", "globex": "sk-globex-2", "initech": "sk-initech-3"}
TENANTS = {"acme": {"max_priority": 5, "trust_workload_header": True}, "initech": {"max_priority": -5}}


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


def keys_file(folder: Path) -> Path:
    path = folder / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [{"tenant": t, "key_sha256": hash_key(k)} for t, k in KEYS.items()]}))
    return path


def recording(router: Router) -> list[dict[str, str]]:
    """The headers of every call the router makes to a pod, as the pod receives them."""
    sent: list[dict[str, str]] = []
    post = router.upstream.post

    async def recorded(url: str, body: dict[str, Any], headers: dict[str, str], *rest: Any) -> Any:
        sent.append(dict(headers))
        return await post(url, body, headers, *rest)

    router.upstream.post = recorded  # type: ignore[method-assign]
    return sent


# ---- priority and workload class ---------------------------------------------------------------------------------


def test_a_clients_priority_is_lowered_to_its_tenants_ceiling_and_the_engine_gets_that(tiny_dir: Path,
                                                                                     tmp_path: Path) -> None:
    """A client's 2147483647 jumped every queue (9.6 s to 1.2 s while another tenant's requests waited): now the
    header sent to the engine is the priority admission settled, whatever the client said; below the ceiling it
    is the client's, and a lower one (a client yielding) always is."""
    with stub_pod(tiny_dir) as pod, routed(tiny_dir, [pod.url], api_keys_file=str(keys_file(tmp_path)),
                                           tenants=TENANTS) as (url, router):
        sent = recording(router)
        for tenant, asked, got in (("globex", str(MAX_PRIORITY), "0"), ("acme", str(MAX_PRIORITY), "5"),
                                   ("acme", "3", "3"), ("globex", "-7", "-7"), ("initech", "0", "-5"),
                                   ("globex", None, "0")):
            headers = auth(tenant) | ({PRIORITY_HEADER: asked} if asked is not None else {})
            reply = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1}, headers=headers,
                               timeout=30)
            assert reply.status_code == 200, reply.text
            assert sent[-1][PRIORITY_HEADER] == got, (tenant, asked)
        # a batch's requests (priority -1) stay under a ceiling of 0, and go lower under a lower one
        for tenant, got in (("globex", BATCH_PRIORITY), ("initech", -5)):
            admitted = asyncio.run(router.admit(b'{"prompt": "hi"}', {PRIORITY_HEADER: str(BATCH_PRIORITY)},
                                                chat=False, tenant=tenant, batch=True))
            assert admitted.trace.info.priority == got
            assert admitted.trace.lease is not None
            admitted.trace.lease.close()
        # a tenant not trusted with it cannot name its class; a trusted one can; the engine gets the class used
        for tenant, got in (("globex", "completion-short"), ("acme", "chat-long")):
            httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=30,
                       headers=auth(tenant) | {WORKLOAD_HEADER: "chat-long"})
            assert sent[-1][WORKLOAD_HEADER] == got


def test_without_api_keys_every_client_keeps_its_priority_unless_the_config_sets_a_ceiling(tiny_dir: Path) -> None:
    """Without keys every client is the one tenant `default`: nobody to protect from whom, so the header is taken as
    before; `max_priority` on the default entry caps it still."""
    free = build_router(RouterConfig(pods=[]), tiny_dir)
    assert free.priority_ceiling("default") == MAX_PRIORITY and free.trusts_workload("default")
    capped = build_router(RouterConfig(pods=[], tenants={"default": {"max_priority": 2}}), tiny_dir)
    admitted = asyncio.run(capped.admit(b'{"prompt": "hi"}', {PRIORITY_HEADER: "9"}, chat=False))
    assert admitted.trace.info.priority == 2


@pytest.mark.parametrize(("entry", "message"), [
    ({"max_priority": 1.5}, "max_priority must be a whole number"),
    ({"max_priority": 2**31}, "max_priority must be a whole number"),
    ({"trust_workload_header": "yes"}, "trust_workload_header must be true or false"),
])
def test_bad_ceilings_are_refused_with_what_to_fix(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tenants({"acme": entry})
    assert parse_tenants({"acme": {"max_priority": None}}).of("acme").max_priority == MAX_PRIORITY  # null: none


# ---- the Files and Batches API ----------------------------------------------------------------------------------


@pytest.fixture
def batch_router(tiny_dir: Path, tmp_path: Path) -> Iterator[tuple[str, Router]]:
    """A keyed router with a database; the default tenant entry allows 4 requests a minute and 2 stored files."""
    with stub_pod(tiny_dir) as pod, routed(tiny_dir, [pod.url], api_keys_file=str(keys_file(tmp_path)),
                                           database_url=f"sqlite:///{tmp_path / 'pool.db'}",
                                           tenants={"default": {"requests_per_minute": 4}},
                                           batch_max_stored_files=2, batch_max_stored_bytes=10_000,
                                           batch_max_concurrent_uploads=1) as served:
        yield served


def upload(url: str, tenant: str, content: bytes) -> httpx.Response:
    return httpx.post(url + "/v1/files", headers=auth(tenant), files={"file": ("in.jsonl", content)},
                      data={"purpose": "batch"}, timeout=30)


def test_uploads_are_held_within_the_tenants_request_limit_and_file_quota(
        batch_router: tuple[str, Router]) -> None:
    """40 uploads of 3 MiB in 2.2 s grew the database by 156 MiB: every Files and Batches call now takes one of the
    tenant's requests, and a tenant's stored files stay within its quota (a 400 that says how to make room)."""
    url, _ = batch_router
    first = upload(url, "acme", b"{}\n")
    assert first.status_code == 200 and first.headers["x-ratelimit-remaining-requests"] == "3"
    assert upload(url, "acme", b"{}\n" * 10).status_code == 200
    third = upload(url, "acme", b"{}\n")  # a third file: past batch_max_stored_files
    assert third.status_code == 400, third.text
    error = third.json()["error"]
    assert error["code"] == "file_storage_limit_reached" and "2 files" in error["message"]
    assert upload(url, "globex", b"x" * 9_000).status_code == 200  # another tenant's quota is its own...
    too_big = upload(url, "globex", b"x" * 1_001)  # ...and its bytes too: 9,000 + 1,001 over 10,000
    assert too_big.status_code == 400 and "10000 bytes" in too_big.json()["error"]["message"]
    for _ in range(5):  # reading objects and lists, what clients poll, takes none of the tenant's requests
        assert httpx.get(url + f"/v1/files/{first.json()['id']}", headers=auth("acme"), timeout=30).status_code == 200
        assert httpx.get(url + "/v1/batches", headers=auth("acme"), timeout=30).status_code == 200
    deleted = httpx.delete(url + f"/v1/files/{first.json()['id']}", headers=auth("acme"), timeout=30)
    assert deleted.status_code == 200 and deleted.headers["x-ratelimit-remaining-requests"] == "0"  # the 4th
    refused = upload(url, "acme", b"{}\n")  # room for it now, but not in this minute's requests
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1


def test_an_upload_past_the_replicas_concurrent_uploads_is_a_429(batch_router: tuple[str, Router],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Four 95 MiB uploads at once took the router from 424 to 1,282 MiB: a replica reads at most
    batch_max_concurrent_uploads at once (here 1); the next, once it waited UPLOAD_WAIT_SECONDS for a slot, is told
    to come back, and the first still lands (tests/test_tenant_uploads.py: who gets a slot that comes free)."""
    monkeypatch.setattr(batch_api, "UPLOAD_WAIT_SECONDS", 0.05)
    url, _ = batch_router
    boundary = b"kvmesh"
    body = (b"--kvmesh\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--kvmesh\r\n"
            b"content-disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\r\n{}\n\r\n--kvmesh--\r\n")
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as slow:
        slow.sendall(b"POST /v1/files HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEYS["acme"].encode()
                     + b"\r\ncontent-type: multipart/form-data; boundary=" + boundary
                     + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body[:20])  # the rest still to come
        for _ in range(200):  # until the router reads the first (a bounded poll, not a timing)
            second = upload(url, "globex", b"{}\n")
            if second.status_code == 429:
                break
        assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_uploads"
        assert second.headers["retry-after"] == "1"
        slow.sendall(body[20:])
        answer = slow.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert upload(url, "globex", b"{}\n").status_code == 200  # the slot came back


def test_an_upload_goes_into_sqlite_a_piece_at_a_time(tmp_path: Path) -> None:
    """An upload is a file spooled to disk: the store reads it a piece at a time into the row (incremental blob
    I/O), never whole, and counts its lines on the way; the quota is checked in the same transaction."""
    store = BatchStore(f"sqlite:///{tmp_path / 'pool.db'}")
    content = b'{"custom_id": "x"}\n' * (3 * PIECE_BYTES // 19)
    reads: list[int] = []

    class Spooled(io.BytesIO):
        def read(self, size: int | None = -1) -> bytes:
            reads.append(-1 if size is None else size)
            return super().read(size)

    stored = store.add_file("t", "batch", "in.jsonl", Spooled(content), None, FileQuota(), len(content))
    assert reads and all(0 < size <= PIECE_BYTES for size in reads)
    assert stored["bytes"] == len(content)
    size, pieces = store.file_pieces("t", stored["id"])  # type: ignore[misc]
    assert size == len(content) and b"".join(pieces) == content
    with pytest.raises(BatchInputError, match="File storage limit reached"):
        store.add_file("t", "batch", "more.jsonl", b"{}", None, FileQuota(files=1))
    assert len(store.files("t", None, 10, None)["data"]) == 1  # the refused one left nothing
    store.close()


# ---- several prompts, /tokenize, /kvmesh/pool --------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_url(tiny_dir: Path) -> Iterator[str]:
    with serve_checked(make_engine(tiny_dir, kv_cache_blocks=256, max_model_len=512)) as url:
        yield url


@pytest.fixture
def keyed(engine_url: str, tiny_dir: Path, tmp_path: Path) -> Iterator[tuple[str, Router]]:
    """A keyed router in front of the tiny engine: acme 3 requests and 100 tokens a minute."""
    router = build_router(RouterConfig(pods=[engine_url], scrape_interval_seconds=0.1,
                                       api_keys_file=str(keys_file(tmp_path)),
                                       tenants={"acme": {"requests_per_minute": 3, "tokens_per_minute": 100}}),
                          tiny_dir)
    with serve_router(router) as url:
        yield url, router


def test_every_prompt_of_a_list_is_charged_at_admission(keyed: tuple[str, Router]) -> None:
    """40 prompts of 1,000 tokens passed a 2,000-token-a-minute limit: only the first was counted at admission.
    Each prompt is counted now (a short first one hides nothing)."""
    url, _ = keyed
    prompts = [list(range(100, 102))] + [list(range(200, 240))] * 3  # 2 + 120 tokens: over the 100 a minute
    refused = httpx.post(url + "/v1/completions", json={"prompt": prompts, "max_tokens": 1}, headers=auth("acme"),
                         timeout=30)
    assert refused.status_code == 429, refused.text
    assert "requested 122" in refused.json()["error"]["message"] and "retry-after" not in refused.headers
    texts = ["hello", "one two three four five six seven"]
    served = httpx.post(url + "/v1/completions", json={"prompt": texts, "max_tokens": 1}, headers=auth("acme"),
                        timeout=30)
    assert served.status_code == 200
    prompt_tokens = served.json()["usage"]["prompt_tokens"]
    assert served.headers["x-ratelimit-remaining-tokens"] == str(100 - prompt_tokens)


def test_one_tenants_text_never_tokenizes_from_anothers_pieces(keyed: tuple[str, Router]) -> None:
    """The router's piece cache is kept per tenant: a text another tenant sent came back several times faster (2.1
    against 7.4 ms for 20 KB), so any key could tell whether anyone had sent a document. A tenant's own next
    request still reuses its pieces."""
    url, router = keyed
    cache = router.tokenizer.token_cache
    assert cache is not None
    document = "alpha beta gamma delta " * 300  # 6.9 KB: pieces of about 2 KiB

    def send(tenant: str, path: str, body: dict[str, object]) -> None:
        reply = httpx.post(url + path, json=body, headers=auth(tenant), timeout=30)
        assert reply.status_code == 200, reply.text

    send("globex", "/tokenize", {"prompt": document})
    hits = cache.hits
    send("initech", "/tokenize", {"prompt": document})
    assert cache.hits == hits  # none of globex's pieces
    send("globex", "/v1/completions", {"prompt": document[:2500], "max_tokens": 1})
    assert cache.hits > hits  # its own
    prompt = "delta gamma beta alpha " * 100  # new pieces: two, within the 512-token context
    send("globex", "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    hits = cache.hits
    send("initech", "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert cache.hits == hits


def test_tokenize_is_limited_charged_and_bounded(keyed: tuple[str, Router]) -> None:
    """An 18 MiB prompt took 68 s of the router's CPU and answered 10.8 M ids, with no limit: /tokenize takes one of
    the tenant's requests, charges the tokens it counted, and refuses a body past 4 x max_model_len tokens' worth
    (6 bytes each) before tokenizing it, or a count past 4 x max_model_len."""
    url, _ = keyed
    counted = httpx.post(url + "/tokenize", json={"prompt": "Once upon a time"}, headers=auth("acme"), timeout=30)
    assert counted.status_code == 200 and counted.headers["x-ratelimit-remaining-requests"] == "2"
    after = httpx.post(url + "/detokenize", json={"tokens": [100, 101]}, headers=auth("acme"), timeout=30)
    assert after.status_code == 200
    # at admission: the tokens the first call counted are charged, and this call's one
    assert after.headers["x-ratelimit-remaining-tokens"] == str(100 - counted.json()["count"] - 1)
    huge = httpx.post(url + "/tokenize", json={"prompt": "word " * 3000}, headers=auth("globex"), timeout=30)
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded"
    assert "12288 bytes" in huge.json()["error"]["message"]  # 6 x 4 x 512
    many = httpx.post(url + "/detokenize", json={"tokens": [7] * 2049}, headers=auth("globex"), timeout=30)
    assert many.status_code == 400 and "2048" in many.json()["error"]["message"]
    assert httpx.post(url + "/tokenize", json={"prompt": "hi"}, headers=auth("acme"), timeout=30).status_code == 200
    refused = httpx.post(url + "/tokenize", json={"prompt": "hi"}, headers=auth("acme"), timeout=30)  # the 4th
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
