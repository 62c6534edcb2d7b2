"""Crash and restart with a warm cache: a restarted engine finds its host tier (shared memory) and its disk
tier, verifies what it loads, drops damaged blocks with a log line and a metric, and announces what it kept
under its new boot id; a killed `kvmesh serve` process comes back with its host tier."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvmesh.engine.engine import Engine
from kvmesh.engine.model.tokenizer import Tokenizer
from kvmesh.engine.protocol import BlockExtra, KVEvent, block_hashes
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.sampling import SamplingParams
from kvmesh.processes import free_port, spawn, stop, wait_healthy

from .conftest import make_engine
from .test_kv_tiers import chain, metric, prompt, run, run_cold, tiered
from .test_kv_weights import reweighted
from .test_lora import write_adapter


def test_a_restarted_engine_serves_from_its_host_and_disk_tiers(tiny_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(20, 100)
    first = tiered(tiny_dir, tmp_path)
    run(first, tokens)
    run(first, tokens)  # hit again: on disk too
    old_boot = first.events.boot_id
    first.close()

    second = tiered(tiny_dir, tmp_path)
    hashes = chain(second, tokens)
    assert second.events.boot_id != old_boot
    assert metric(second, "kvmesh_kv_tier_recovered_blocks_total", tier="host") == len(hashes)
    assert metric(second, "kvmesh_kv_tier_recovered_blocks_total", tier="disk") == len(hashes)
    second.events.flush()
    (batch,) = second.events.read(0)
    announced = {(e.tier, e.block_hashes[0]) for e in batch.events if e.kind == "stored"}
    assert announced == {(tier, h) for tier in ("host", "disk") for h in hashes}
    snapshot = second.events.snapshot()
    assert set(snapshot.blocks["host"]) == set(hashes) == set(snapshot.blocks["disk"])
    assert not snapshot.blocks["device"]

    expected, _ = run_cold(tiny_dir, [*tokens, 1, 2])
    before = second.runner.computed_tokens
    out, final = run(second, [*tokens, 1, 2])
    assert out == expected
    assert final.cached_by_tier["host"] == 96  # host first: the faster tier
    assert second.runner.computed_tokens - before == 102 - 96 + 7
    second.close()


def test_damaged_blocks_are_dropped_with_a_log_line_and_a_metric(
    tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = prompt(21, 100)
    first = tiered(tiny_dir, tmp_path, disk_blocks=0)
    run(first, tokens)
    hashes = chain(first, tokens)
    host = first.tiers.tiers["host"]  # type: ignore[union-attr]
    third_slot = host.find(hashes[2])
    assert third_slot is not None
    first.close()
    # flip one byte of the third block's KV in the file, as a crash mid-copy or a bad page would
    data = np.memmap(tmp_path / "host.kv", np.uint8, "r+")
    offset = data.size - host.store.num_slots * host.store.block_bytes + third_slot * host.store.block_bytes
    data[offset + 100] ^= 0xFF
    data.flush()
    del data

    with caplog.at_level(logging.WARNING, logger="kvmesh.engine.tiers"):
        second = tiered(tiny_dir, tmp_path, disk_blocks=0)
    assert any("dropped 1 damaged" in r.getMessage() for r in caplog.records)
    assert metric(second, "kvmesh_kv_evictions_total", tier="host", reason="damaged") == 1
    assert metric(second, "kvmesh_kv_tier_recovered_blocks_total", tier="host") == len(hashes) - 1
    second.events.flush()
    assert hashes[2] not in second.events.snapshot().blocks["host"]
    expected, _ = run_cold(tiny_dir, tokens)
    out, final = run(second, tokens)
    assert out == expected
    assert final.cached_by_tier["host"] == 32  # the prefix stops at the damaged block: it is recomputed
    second.close()


def test_a_file_of_another_layout_starts_empty(
    tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = tiered(tiny_dir, tmp_path, disk_blocks=0)
    run(first, prompt(22, 60))
    first.close()
    with caplog.at_level(logging.WARNING, logger="kvmesh.engine.tiers"):
        second = tiered(tiny_dir, tmp_path, disk_blocks=0, block_size=32)
    assert any("another model, layout or size" in r.getMessage() for r in caplog.records)
    assert metric(second, "kvmesh_kv_tier_recovered_blocks_total", tier="host") == 0
    assert second.tiers is not None and second.tiers.counts()["host"][1] == 0
    second.close()


def test_a_restart_on_other_weights_under_the_same_name_starts_its_tiers_empty(
    tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pod whose weights changed but not its name (a new checkpoint in the same directory, or served under the
    same --served-model-name) must not read the old weights' KV back from its host and disk tier files."""
    other = reweighted(tiny_dir, tmp_path / "other")
    tokens = prompt(23, 100)
    first = tiered(tiny_dir, tmp_path, served_model_name="chat")
    run(first, tokens)
    run(first, tokens)  # on disk too
    first.close()
    with caplog.at_level(logging.WARNING, logger="kvmesh.engine.tiers"):
        second = tiered(other, tmp_path, served_model_name="chat")
    assert second.model_name == first.model_name and second.kv_config.hashing() == first.kv_config.hashing()
    assert any("another model, layout or size" in r.getMessage() for r in caplog.records)
    assert metric(second, "kvmesh_kv_tier_recovered_blocks_total", tier="host") == 0
    assert metric(second, "kvmesh_kv_tier_recovered_blocks_total", tier="disk") == 0
    expected, _ = run_cold(other, tokens)
    out, final = run(second, tokens)
    assert final.cached_by_tier == {"host": 0, "disk": 0}
    assert out == expected
    second.close()


def test_two_engines_cannot_share_a_tier_file(tiny_dir: Path, tmp_path: Path) -> None:
    first = tiered(tiny_dir, tmp_path, disk_blocks=0)
    with pytest.raises(RuntimeError, match="in use by another engine"):
        tiered(tiny_dir, tmp_path, disk_blocks=0)
    first.close()


def _serve(tiny_dir: Path, port: int, shm: Path, log: Path) -> subprocess.Popen[bytes]:
    return spawn(["serve", "--model", str(tiny_dir), "--port", str(port), "--dtype", "float32", "--threads", "1",
                  "--kv-cache-memory-mib", "4", "--kv-host-memory-mib", "1", "--kv-host-path", str(shm),
                  "--kv-tier-cost-profile", "cpu", "--log-level", "warning"], log)


def _complete(url: str, text: str) -> dict:
    body = {"prompt": text, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.slow
def test_a_killed_engine_process_restarts_with_its_host_tier(tiny_dir: Path, tmp_path: Path) -> None:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    host_file = shm / f"kvmesh-test-{os.getpid()}-{free_port()}.kv"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "engine.log"
    text = " ".join(f"word{i}" for i in range(120))
    proc = _serve(tiny_dir, port, host_file, log)
    try:
        wait_healthy(url, proc, log=log)
        cold = _complete(url, text)
        prompt_tokens = cold["usage"]["prompt_tokens"]
        deadline = time.monotonic() + 30
        while len(httpx.get(f"{url}/v1/kv/blocks").json()["blocks"]["host"]) < prompt_tokens // 16:
            assert time.monotonic() < deadline, "the host tier never received the prompt's blocks"
            time.sleep(0.1)
        old_boot = httpx.get(f"{url}/v1/kv/config").json()["boot_id"]
        proc.kill()  # SIGKILL: no shutdown code runs
        proc.wait(timeout=30)

        proc = _serve(tiny_dir, port, host_file, log)
        wait_healthy(url, proc, log=log)
        snapshot = httpx.get(f"{url}/v1/kv/blocks").json()
        assert snapshot["boot_id"] != old_boot
        assert len(snapshot["blocks"]["host"]) >= (prompt_tokens - 1) // 16
        # a peer asking for the first half of the prompt's blocks gets them from the host tier (loaded to device)
        ids = Tokenizer.from_dir(tiny_dir).encode(text)
        hashes = block_hashes(ids[: (len(ids) - 1) // 16 * 16])
        half = len(hashes) // 2
        fetched = httpx.post(f"{url}/v1/kv/fetch", json={"block_hashes": hashes[:half]}, timeout=60)
        assert fetched.status_code == 200 and int(fetched.headers["x-kvmesh-blocks"]) == half > 0
        warm = _complete(url, text)
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        by_source = warm["usage"]["prompt_tokens_details"]["kvmesh_cached_by_source"]
        assert by_source == {"device": half * 16, "host": (len(hashes) - half) * 16, "disk": 0, "peer": 0}
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == len(hashes) * 16
        assert len(hashes) == (prompt_tokens - 1) // 16
        events = httpx.get(f"{url}/metrics").text
        assert 'kvmesh_kv_tier_recovered_blocks_total{tier="host"}' in events
    finally:
        stop([proc])
        host_file.unlink(missing_ok=True)


def test_events_of_a_recovered_block_carry_parent_and_tier(tiny_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(23, 50)
    first = tiered(tiny_dir, tmp_path, host_blocks=0)
    run(first, tokens)
    run(first, tokens)
    first.close()
    second = tiered(tiny_dir, tmp_path, host_blocks=0)
    second.events.flush()
    hashes = chain(second, tokens)
    stored = [e for b in second.events.read(0) for e in b.events]
    by_hash = {e.block_hashes[0]: e for e in stored}
    assert by_hash[hashes[1]] == KVEvent("stored", (hashes[1],), tier="disk", parent_hash=hashes[0], token_count=16)
    second.close()


def test_a_restarted_engine_serves_new_weights_under_a_name_without_the_old_weights_kept_blocks(
    tiny_dir: Path, tmp_path: Path,
) -> None:
    """The tiers outlive the process, and an adapter's blocks in them are hashed with its weights: a restarted
    engine loading other weights under the name finds none of the old weights' blocks (a hit of 0, the answer a
    tierless engine with the new weights gives), and the old weights, loaded back, find theirs."""
    first_weights = write_adapter(tmp_path / "v1", seed=1)
    other_weights = write_adapter(tmp_path / "v2", seed=2)
    tokens = prompt(22, 100)

    def serve(engine: Engine, weights: Path) -> tuple[list[int], RequestOutput]:
        if "sql" in engine.loras.loaded:
            engine.remove_lora("sql")
        engine.add_lora(engine.read_lora("sql", str(weights)))
        outputs: list[RequestOutput] = []
        request = Request(f"sql-{len(tokens)}-{weights.name}", list(tokens), SamplingParams(max_tokens=8,
                          temperature=0.0, ignore_eos=True), extra=BlockExtra(lora="sql"))
        request.on_output = outputs.append
        engine.submit(request)
        engine.run_until_idle()
        return [t for o in outputs for t in o.new_token_ids], outputs[-1]

    first = tiered(tiny_dir, tmp_path)
    old_answer, _ = serve(first, first_weights)
    first.close()

    second = tiered(tiny_dir, tmp_path)
    assert metric(second, "kvmesh_kv_tier_recovered_blocks_total", tier="host") == 6  # the old weights' blocks
    answer, final = serve(second, other_weights)
    assert final.cached_tokens == 0
    fresh = make_engine(tiny_dir, kv_cache_blocks=64)
    assert answer == serve(fresh, other_weights)[0] != old_answer
    again, final = serve(second, first_weights)
    assert (again, final.cached_by_tier["host"]) == (old_answer, 96)
    second.close()
