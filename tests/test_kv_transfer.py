"""Moving KV between two real engine processes (the tiny model): prefill/decode handoff, prefix pull, the
fallback to recompute, handle expiry; and the wire format against damaged frames."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.kv.transfer import Layout, TransferError, encode_frame, pull_blocks
from kvmesh.processes import free_port

from .engines import tiny_engines

pytestmark = pytest.mark.slow


def metric(url: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


@pytest.fixture(scope="module")
def pods(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    with tiny_engines(tiny_dir, tmp_path_factory.mktemp("transfer"), ("prefill", "decode")) as procs:
        prefill, decode = procs
        yield prefill, decode


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 48000 + 200 for i in range(n)]


def complete(url: str, **body: object) -> dict:
    reply = httpx.post(url + "/v1/completions", json={"return_token_ids": True, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def handoff(prefill: str, decode: str, prompt: list[int], **sampling: object) -> tuple[list[int], dict, dict]:
    first = complete(prefill, prompt=prompt, max_tokens=20, kv_transfer={"mode": "prefill"}, **sampling)
    (token,) = first["choices"][0]["token_ids"]
    ticket = first["kv_transfer"]
    assert ticket["num_blocks"] == -(-len(prompt) // 16) and ticket["expires_at"] > time.time()
    rest = complete(decode, prompt=prompt, max_tokens=20, **sampling,
                    kv_transfer={"mode": "decode", "source": prefill, "handle": ticket["handle"],
                                 "first_token": token})
    return [token, *rest["choices"][0]["token_ids"]], first, rest


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_handoff_gives_the_one_engine_answer_and_moves_the_prompt(pods: tuple[str, str], sampling: dict) -> None:
    prefill, decode = pods
    prompt = tokens(1 + len(sampling), 100)
    received = metric(decode, "kvmesh_kv_transfer_bytes_total", direction="received")
    computed = metric(decode, "kvmesh_computed_tokens_total")
    ids, _, rest = handoff(prefill, decode, prompt, **sampling)
    reference = complete(prefill, prompt=prompt, max_tokens=20, **sampling)["choices"][0]["token_ids"]
    assert ids == reference
    assert metric(decode, "kvmesh_kv_transfer_bytes_total", direction="received") > received
    details = rest["usage"]["prompt_tokens_details"]
    assert details["kvmesh_cached_by_source"]["peer"] == 96 == details["cached_tokens"]
    # the decode pod computed the prompt's partial last block (4 tokens) and the 19 tokens after the first
    assert metric(decode, "kvmesh_computed_tokens_total") - computed == (100 - 96) + 19


def test_a_broken_transfer_falls_back_to_recompute(pods: tuple[str, str]) -> None:
    prefill, decode = pods
    prompt = tokens(20, 80)
    failed = metric(decode, "kvmesh_kv_transfers_total", kind="handoff", outcome="failed")
    first = complete(prefill, prompt=prompt, max_tokens=10, temperature=0, kv_transfer={"mode": "prefill"})
    (token,) = first["choices"][0]["token_ids"]
    nowhere = f"http://127.0.0.1:{free_port()}"
    rest = complete(decode, prompt=prompt, max_tokens=10, temperature=0,
                    kv_transfer={"mode": "decode", "source": nowhere, "handle": "x", "first_token": token})
    assert rest["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed the whole prompt
    reference = complete(prefill, prompt=prompt, max_tokens=10, temperature=0)["choices"][0]["token_ids"]
    assert [token, *rest["choices"][0]["token_ids"]] == reference
    assert metric(decode, "kvmesh_kv_transfers_total", kind="handoff", outcome="failed") == failed + 1


def test_an_unknown_handle_is_refused_and_recomputed(pods: tuple[str, str]) -> None:
    prefill, decode = pods
    refused = httpx.post(prefill + "/v1/kv/fetch", json={"block_hashes": [1, 2], "handle": "no-such-handle"})
    assert refused.status_code == 410 and refused.json()["error"]["code"] == "handle_expired"
    prompt = tokens(30, 40)
    rest = complete(decode, prompt=prompt, max_tokens=3, temperature=0,
                    kv_transfer={"mode": "decode", "source": prefill, "handle": "no-such-handle", "first_token": 5})
    assert rest["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_pull_computes_only_the_tail_and_announces_the_blocks(pods: tuple[str, str]) -> None:
    prefill, decode = pods
    prompt = tokens(40, 130)
    complete(prefill, prompt=prompt, max_tokens=1)  # the source now holds 8 full blocks of it
    computed = metric(decode, "kvmesh_computed_tokens_total")
    out = complete(decode, prompt=[*prompt, 7, 7], max_tokens=1,
                   kv_transfer={"mode": "pull", "source": prefill, "tokens": 128})
    assert out["usage"]["prompt_tokens_details"]["kvmesh_cached_by_source"]["peer"] == 128
    assert metric(decode, "kvmesh_computed_tokens_total") - computed == 132 - 128
    announced = set(httpx.get(decode + "/v1/kv/blocks").json()["blocks"]["device"])
    source = set(httpx.get(prefill + "/v1/kv/blocks").json()["blocks"]["device"])
    assert len(announced & source) >= 8


def test_handles_expire_and_free_their_blocks(pods: tuple[str, str]) -> None:
    prefill, _ = pods
    expired = metric(prefill, "kvmesh_kv_handles_expired_total")
    first = complete(prefill, prompt=tokens(50, 64), max_tokens=4, kv_transfer={"mode": "prefill", "ttl_seconds": 0.3})
    held = metric(prefill, "kvmesh_kv_blocks_pinned")
    assert first["kv_transfer"]["num_blocks"] == 4 and held >= 4
    deadline = time.monotonic() + 15  # expiry runs when the engine loop wakes: poll, a busy machine is slow
    while metric(prefill, "kvmesh_kv_handles_expired_total") < expired + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    refused = httpx.post(prefill + "/v1/kv/fetch", json={"block_hashes": [1], "handle": first["kv_transfer"]["handle"]})
    assert refused.status_code == 410
    assert metric(prefill, "kvmesh_kv_handles_expired_total") >= expired + 1
    assert metric(prefill, "kvmesh_kv_blocks_pinned") <= held - 4  # (other tests' handles may expire too)


def test_concurrent_handoffs_do_not_mix_blocks(pods: tuple[str, str]) -> None:
    prefill, decode = pods
    prompts = [tokens(60 + k, 70 + 16 * k) for k in range(4)]
    with ThreadPoolExecutor(4) as pool:
        handed = list(pool.map(lambda p: handoff(prefill, decode, p, temperature=0)[0], prompts))
    for prompt, ids in zip(prompts, handed, strict=True):
        assert ids == complete(decode, prompt=prompt, max_tokens=20, temperature=0)["choices"][0]["token_ids"]


def test_damaged_frames_are_refused() -> None:
    """The wire format alone, against a peer stand-in (httpx.MockTransport) that flips a byte or lies."""
    cache = torch.randn(4, 2, 2, 16, 2, 8)
    layout = Layout.of(cache)
    frame = encode_frame(cache, [1, 3], [11, 33])

    def serve(body: bytes) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(200, content=body)))

    async def pull(body: bytes, hashes: list[int], want: Layout = layout):
        async with serve(body) as client:
            return await pull_blocks(client, "http://peer", hashes, want)

    good = asyncio.run(pull(frame, [11, 33]))
    assert good.hashes == [11, 33] and torch.equal(good.data, cache[[1, 3]])
    damaged = bytearray(frame)
    damaged[-5] ^= 0xFF
    with pytest.raises(TransferError, match="checksum"):
        asyncio.run(pull(bytes(damaged), [11, 33]))
    with pytest.raises(TransferError, match="out of order"):
        asyncio.run(pull(frame, [33, 11]))
    with pytest.raises(TransferError, match="layout"):
        asyncio.run(pull(frame, [11, 33], Layout((2, 2, 16, 2, 4), "float32")))
    with pytest.raises(TransferError, match="mid-frame"):
        asyncio.run(pull(frame[:-10], [11, 33]))
