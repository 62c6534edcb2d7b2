"""Components of two releases in one pool, as during a rolling upgrade: every message between kvmesh's own
components is read leniently, so a field the next release adds is left unread by this one, not refused.
- engine <- router / operator: a `kv_transfer` or a POST /v1/kv/warm body with a field this engine does not know
  is taken (it was a 400: every handoff, pull or warm-up failed until the roll ended);
- router <- engine: /v1/kv/config, the KV event stream and the /v1/kv/blocks snapshot of a newer engine, each with
  fields this router does not know, are read and indexed (the snapshot was refused, so the pod was never indexed).
Client-facing OpenAI bodies are not concerned: their unknown fields stay as OpenAI-compatible servers treat them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from kvmesh.engine.openai_types import ChatRequest, CompletionRequest, KVTransfer, WarmRequest
from kvmesh.engine.protocol import (
    KV_BLOCKS_PATH,
    KV_CONFIG_PATH,
    KV_EVENTS_PATH,
    MODELS_PATH,
    KVBlocksSnapshot,
    KVConfig,
    KVEvent,
    KVEventBatch,
)
from kvmesh.router.index import PrefixIndex
from kvmesh.router.pods import PodSet

from .waiting import eventually

NEXT = {"kvmesh_next_release_field": {"anything": [1, 2]}}  # what a later release may add to any message
TRANSFERS: list[dict[str, Any]] = [
    {"mode": "prefill"},
    {"mode": "decode", "source": "http://10.0.0.7:8000", "handle": "h-1", "first_token": 42},
    {"mode": "pull", "source": "http://10.0.0.7:8000", "tokens": 64},
]


@pytest.mark.parametrize("transfer", TRANSFERS, ids=lambda t: t["mode"])
def test_an_engine_takes_a_newer_routers_kv_transfer(transfer: dict[str, Any]) -> None:
    newer = {**transfer, **NEXT}
    assert KVTransfer.model_validate(newer) == KVTransfer.model_validate(transfer)
    chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "kv_transfer": newer})
    completion = CompletionRequest.model_validate({"prompt": "hi", "kv_transfer": newer})
    assert chat.kv_transfer == completion.kv_transfer == KVTransfer.model_validate(transfer)


def test_a_kv_transfer_still_needs_what_its_mode_needs() -> None:
    """Leniency is for fields added, not for a message this engine cannot act on."""
    for wrong in ({"mode": "decode", "source": "http://10.0.0.7:8000", **NEXT}, {"mode": "migrate", **NEXT}):
        with pytest.raises(ValueError):
            KVTransfer.model_validate(wrong)


def test_an_engine_takes_a_newer_operators_warm_up() -> None:
    body = {"source": "http://10.0.0.7:8000", "chains": [[1, 2, 3]]}
    assert WarmRequest.model_validate({**body, **NEXT}) == WarmRequest.model_validate(body)


def test_a_router_reads_a_newer_engines_config_and_snapshot() -> None:
    config = KVConfig("tiny", 16, "xxh3_64", 7, "tok", 128, "boot-1", weights_fingerprint="abc")
    assert KVConfig.from_json({**config.to_json(), **NEXT}) == config
    snapshot = KVBlocksSnapshot("boot-1", 3, {"device": [1, 2]})
    assert KVBlocksSnapshot.from_json({"boot_id": "boot-1", "seq": 3, "blocks": {"device": [1, 2]}, **NEXT}) == snapshot


EXPECTED = KVConfig("tiny", 16, "xxh3_64", 7, "tok", 0, "")
BOOT = "boot-next"


def next_release_engine(request: httpx.Request) -> httpx.Response:
    """An engine of the next release as this router's scrapes and event stream meet it: every answer says more
    than this release's would. Its stream starts with a reset (the router resyncs from /v1/kv/blocks), then
    stores one more block with an event of a kind and a tier this release does not know beside it."""
    path = request.url.path
    if path == "/health":
        return httpx.Response(200, json={"status": "ok", **NEXT})
    if path == KV_CONFIG_PATH:
        config = KVConfig(**{**EXPECTED.to_json(), "num_device_blocks": 128, "boot_id": BOOT})
        return httpx.Response(200, json={**config.to_json(), **NEXT})
    if path == MODELS_PATH:
        return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny", "object": "model", **NEXT}]})
    if path == "/metrics":
        return httpx.Response(200, text="")
    if path == KV_BLOCKS_PATH:
        return httpx.Response(200, json={"boot_id": BOOT, "seq": 5, "blocks": {"device": [11, 12], "host": [13]},
                                         **NEXT})
    if path == KV_EVENTS_PATH:
        reset = {**KVEventBatch(BOOT, 1, reset=True).to_json(), **NEXT}
        stored = KVEventBatch(BOOT, 6, (KVEvent("stored", (14,), "device", 12, 16),)).to_json()
        stored["events"][0].update(NEXT)
        stored["events"].append({"type": "pinned", "block_hashes": [11], "tier": "device", **NEXT})
        stored["events"].append({"type": "stored", "block_hashes": [15], "tier": "remote", **NEXT})
        lines = "".join(json.dumps(batch) + "\n" for batch in (reset, {**stored, **NEXT}))
        return httpx.Response(200, text=lines)
    return httpx.Response(404)


def test_a_router_indexes_a_newer_engine() -> None:
    async def main() -> None:
        pods = PodSet(["http://next-engine"], EXPECTED, PrefixIndex(), scrape_interval=0.05, stale_after=5.0)
        pods._client = httpx.AsyncClient(transport=httpx.MockTransport(next_release_engine))  # no server needed
        await pods.start()
        try:
            await eventually(lambda: pods.index.resume_point("http://next-engine") == (BOOT, 6), "indexed")
            (state,) = pods.snapshot()
            assert state.healthy and pods.kv_config_of("http://next-engine").boot_id == BOOT
            assert pods.index.held_blocks("http://next-engine") == {"device": 3, "host": 1, "disk": 0}
        finally:
            await pods.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
