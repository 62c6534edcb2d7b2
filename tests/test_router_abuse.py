"""What a tenant with a key could once make the router do beyond its limits, each found by a review and each once
possible: tokenize prompts no context could hold, and prompts past its concurrency and requests per minute; store
bytes it was never charged for in a response; push another tenant's stored responses out of a replica's memory;
read and delete stored responses with no limit at all. A keyed router in front of the tiny engine in-process, its
limiter's clock injected: nothing here waits for a bucket to refill."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvmesh.engine.openai_types import MAX_SEQUENCES_PER_REQUEST
from kvmesh.router.app import Router
from kvmesh.router.config import INLINE_TOKENIZE_BYTES
from kvmesh.router.limits import Limiter, parse_tenants
from kvmesh.router.responses import MAX_ID_CHARS
from kvmesh.router.responses_store import MemoryResponses, StoredResponse
from kvmesh.router.tokenize_api import body_bound

from .engines import KEYED_POOL_CONTEXT, keyed_pool
from .test_router_limits import Clock

KEYS = {"acme": "sk-acme-abuse", "globex": "sk-globex-abuse"}
# acme: one request at a time, 3 a minute, 100 tokens a minute; globex: unlimited
TENANTS = {"acme": {"requests_per_minute": 3, "tokens_per_minute": 100, "max_concurrent_requests": 1}}


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def pool(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Router]]:
    with keyed_pool(tiny_dir, tmp_path_factory.mktemp("abuse"), KEYS, TENANTS) as served:
        yield served


@pytest.fixture
def served(pool: tuple[str, Router]) -> tuple[str, Router]:
    """The module's router with fresh buckets on a clock that never moves."""
    url, router = pool
    router.limits = Limiter(parse_tenants(TENANTS), clock=Clock())
    return url, router


def complete(url: str, tenant: str, body: dict[str, Any] | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + "/v1/completions", content=body, timeout=60,
                          headers={**auth(tenant), "content-type": "application/json"})
    return httpx.post(url + "/v1/completions", json={"max_tokens": 1, **body}, headers=auth(tenant), timeout=60)


def counted(router: Router, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record each tokenizing of a request (Router.measure): the router's CPU a request costs."""
    calls: list[int] = []
    measure = router.measure

    def recorded(*args: Any) -> Any:
        calls.append(1)
        return measure(*args)

    monkeypatch.setattr(router, "measure", recorded)
    return calls


# ---- limits around tokenizing ------------------------------------------------------------------------------------


def test_a_prompt_no_context_could_hold_is_refused_untokenized_and_counted(served: tuple[str, Router],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A 512 KiB prompt took the router a second of CPU (a 32 MiB one a minute) before it was refused as too large
    for the tenant's tokens per minute, which it never counted against the tenant's requests per minute. Now a
    prompt past /tokenize's bound (6 bytes for each of 4 times the pool's longest max_model_len) is a 400 saying
    the bound before it is tokenized (a body past it for every prompt a completion may list, before it is parsed),
    and it counts as one of the tenant's requests, as OpenAI counts refusals."""
    url, router = served
    tokenized = counted(router, monkeypatch)
    bound = body_bound(router.models()["data"])
    assert bound == 6 * 4 * KEYED_POOL_CONTEXT
    refused = complete(url, "acme", {"prompt": "lorem ipsum " * (bound // 12 + 1)})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded" and f"exceeds {bound} bytes" in error["message"]
    assert error["param"] == "prompt" and refused.headers["x-ratelimit-remaining-requests"] == "2"
    whole = body_bound(router.models()["data"], MAX_SEQUENCES_PER_REQUEST)
    unparsed = complete(url, "acme", b'{"prompt": "x"}' + b" " * whole)
    assert unparsed.status_code == 400 and f"exceeds {whole} bytes" in unparsed.json()["error"]["message"]
    assert tokenized == [] and router.limits.inflight == {}
    after = complete(url, "acme", {"prompt": "hello"})
    assert after.status_code == 200 and after.headers["x-ratelimit-remaining-requests"] == "0"


def test_a_batch_of_prompts_each_within_the_context_is_served_past_one_prompt_s_bound(
        served: tuple[str, Router]) -> None:
    """lm-eval sends its contexts in batches: a completion listing 8 prompts of about 300 tokens each (more bytes
    together than one prompt's bound) is served, each prompt bounded on its own."""
    url, router = served
    prompts = ["hello " * 300] * 8
    assert len(str(prompts)) > body_bound(router.models()["data"])
    reply = complete(url, "globex", {"prompt": prompts})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 8


def test_a_prompt_too_large_for_the_tokens_per_minute_counts_as_a_request(served: tuple[str, Router]) -> None:
    url, router = served
    refused = complete(url, "acme", {"prompt": list(range(100, 250))})  # 150 tokens, 100 a minute
    assert refused.status_code == 429 and "Request too large" in refused.json()["error"]["message"]
    assert refused.headers["x-ratelimit-remaining-requests"] == "2"
    assert router.limits.inflight == {}  # its slot came back
    # OpenAI's client retries a 429 twice by default; told that no wait helps, it sends this one once
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS["acme"], max_retries=2)
    with pytest.raises(openai.RateLimitError, match="Request too large") as caught:
        client.completions.create(model=router.models()["data"][0]["id"], prompt=list(range(100, 250)), max_tokens=1)
    assert caught.value.response.headers["x-ratelimit-remaining-requests"] == "1"


def test_a_request_being_tokenized_holds_its_tenants_concurrency_slot(served: tuple[str, Router],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Four concurrent 1 MiB prompts of a tenant limited to one request at a time were all tokenized at once:
    the slot was taken only after tokenizing. Now it is held from the moment the request passes the limits, so
    a second request while the first is tokenized is a 429, and never tokenized."""
    url, router = served
    entered, release = threading.Event(), threading.Event()
    measure = router.measure

    def held(*args: Any) -> Any:  # the first tokenizing waits for the test; any other passes
        if not entered.is_set():
            entered.set()
            assert release.wait(60)
        return measure(*args)

    monkeypatch.setattr(router, "measure", held)
    padded = b'{"prompt": [100, 101], "max_tokens": 1}' + b" " * (INLINE_TOKENIZE_BYTES + 1)  # tokenized off the loop
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(complete, url, "acme", padded)
        assert entered.wait(60)
        try:
            second = complete(url, "acme", {"prompt": [100]})
        finally:
            release.set()
        assert first.result().status_code == 200
    assert second.status_code == 429 and "concurrent requests: limit 1" in second.json()["error"]["message"]
    assert router.limits.inflight == {}


# ---- what a stored response keeps --------------------------------------------------------------------------------


def test_a_stored_response_keeps_no_bytes_its_request_was_not_charged_for(served: tuple[str, Router]) -> None:
    """4 MiB of padding in an input item's extra key, `user`, `tool_choice` and `text` was charged 32 tokens and
    stored as 12.5 MB. Now only each item type's fields are kept, `text` as its format, and `user` and
    `tool_choice` past their shapes are 400s naming the field."""
    url, _ = served
    pad = "x" * 4096

    def create(**body: Any) -> httpx.Response:
        return httpx.post(url + "/v1/responses", headers=auth("globex"), timeout=60,
                          json={"max_output_tokens": 1, **body})

    made = create(input=[{"role": "user", "content": [{"type": "input_text", "text": "hi", "pad": pad}],
                          "pad": pad}],
                  text={"format": {"type": "text", "pad": pad}, "pad": pad}, user="u" * MAX_ID_CHARS,
                  tool_choice="auto")
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    kept = httpx.get(f"{url}/v1/responses/{rid}", headers=auth("globex"), timeout=60).text
    items = httpx.get(f"{url}/v1/responses/{rid}/input_items", headers=auth("globex"), timeout=60).json()["data"]
    assert pad not in kept and len(kept) < 4096
    assert items == [{"type": "message", "id": items[0]["id"], "status": "completed", "role": "user",
                      "content": [{"type": "input_text", "text": "hi"}]}]
    for field, body in (("user", {"user": "u" * (MAX_ID_CHARS + 1)}), ("tool_choice", {"tool_choice": pad}),
                        ("input[0].id", {"input": [{"role": "user", "content": "hi", "id": pad}]})):
        refused = create(**{"input": "hi", **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text


# ---- a replica's memory, shared by the tenants -------------------------------------------------------------------


def saved(store: MemoryResponses, tenant: str, response_id: str) -> None:
    store.save(tenant, StoredResponse({"id": response_id}, []), [], [{"role": "user", "content": response_id}])


def test_a_tenant_filling_the_memory_store_evicts_its_own_responses() -> None:
    """One oldest-first list for every tenant let a tenant push another's stored responses out: the tenant
    holding the most loses its oldest."""
    store = MemoryResponses(3, 60)
    saved(store, "victim", "resp_v1")
    for i in range(5):
        saved(store, "attacker", f"resp_a{i}")
    assert store.get("victim", "resp_v1") is not None
    assert [store.get("attacker", f"resp_a{i}") is not None for i in range(5)] == [False] * 3 + [True] * 2
    saved(store, "victim", "resp_v2")  # now even: the one that saved last loses its oldest
    assert store.get("victim", "resp_v1") is None
    assert [store.get("victim", "resp_v2") is not None, store.get("attacker", "resp_a3") is not None] == [True, True]


# ---- reads and deletes under the limits --------------------------------------------------------------------------


def test_reading_and_deleting_stored_responses_is_under_the_tenants_limits(served: tuple[str, Router],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """30 GETs of a tenant limited to 3 requests a minute were all answered, and a continuation's history was read
    before its limits were looked at. Now each read, list and delete takes one of its requests (a 429 past them),
    and a continuation over them is refused before the store is read."""
    url, router = served
    made = httpx.post(url + "/v1/responses", headers=auth("acme"), timeout=60,
                      json={"input": "hi", "max_output_tokens": 1})
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    answers = [httpx.get(f"{url}/v1/responses/{rid}", headers=auth("acme"), timeout=60),
               httpx.get(f"{url}/v1/responses/{rid}/input_items", headers=auth("acme"), timeout=60),
               httpx.delete(f"{url}/v1/responses/{rid}", headers=auth("acme"), timeout=60)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert [a.headers.get("x-ratelimit-remaining-requests") for a in answers] == ["1", "0", "0"]
    assert answers[2].headers["retry-after"] == "20"
    read: list[str] = []
    monkeypatch.setattr(router.responses, "history", lambda *args: read.append(args[1]))
    continued = httpx.post(url + "/v1/responses", headers=auth("acme"), timeout=60,
                           json={"input": "more", "previous_response_id": rid, "max_output_tokens": 1})
    assert continued.status_code == 429 and read == []
    assert router.limits.inflight == {}
