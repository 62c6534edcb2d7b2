"""Host and disk KV tiers over the tiny model: byte-identical moves, chunked copies, promotion before prefill
(same output as a cold run, only the uncached tokens computed), load-or-recompute by cost profile,
write-through-selective to disk, capacity eviction and tier-tagged events. Each test counts what the runner
computed or reads the tiers' own bytes, so a stand-in cannot pass."""

from __future__ import annotations

import errno
import itertools
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine
from kvmesh.engine.kv.costs import PROFILES, CostProfile
from kvmesh.engine.kv.tiers import Costs, TierSpaceError, plan_load
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.sampling import SamplingParams

from .conftest import make_engine

_ids = itertools.count()
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x K/V x tokens x kv heads x head dim x fp32


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 1000 + i * 7919) % 49000 + 100 for i in range(n)]


def run(engine: Engine, tokens: list[int], max_tokens: int = 8) -> tuple[list[int], RequestOutput]:
    """One greedy request to the end; (output ids, final output)."""
    outputs: list[RequestOutput] = []
    request = Request(f"t-{next(_ids)}", list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      ignore_eos=True))
    request.on_output = outputs.append
    engine.submit(request)
    engine.run_until_idle()
    engine.kv.check_invariants()
    assert engine.tiers is not None
    engine.tiers.check_invariants()
    return [t for o in outputs for t in o.new_token_ids], outputs[-1]


def samples(engine: Engine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(engine.metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(engine: Engine, name: str, **labels: str) -> float:
    return samples(engine)[(name, tuple(sorted(labels.items())))]


def tiered(tiny_dir: Path, tmp: Path, host_blocks: int = 128, disk_blocks: int = 128, **overrides: object) -> Engine:
    """An engine with a host tier of `host_blocks` and a disk tier of `disk_blocks` (0: off) in `tmp`, deciding
    load-or-recompute by the fixed CPU profile."""
    settings: dict[str, object] = {
        "kv_cache_blocks": 64,
        "kv_host_memory_mib": host_blocks * TINY_BLOCK_BYTES / (1 << 20),
        "kv_host_path": str(tmp / "host.kv"),
        "kv_disk_mib": disk_blocks * TINY_BLOCK_BYTES / (1 << 20),
        "kv_disk_path": str(tmp / "disk.kv"),
        "kv_tier_cost_profile": "cpu",  # fixed costs under which loading always wins: no dependence on timing
    }
    settings.update(overrides)
    engine = make_engine(tiny_dir, **settings)
    assert engine.tiers is not None
    return engine


def device_bytes(engine: Engine, block_hash: int) -> torch.Tensor:
    block = engine.kv.pool.lookup(block_hash)
    assert block is not None
    return engine.runner.kv_cache[block.block_id].view(torch.uint8).flatten().clone()


def tier_bytes(engine: Engine, tier: str, block_hash: int) -> torch.Tensor:
    assert engine.tiers is not None
    index = engine.tiers.tiers[tier]
    slot = index.find(block_hash)
    assert slot is not None and index.slots[slot].ready, f"{tier} lacks the block"
    return index.store.data[slot].clone()


def chain(engine: Engine, tokens: list[int]) -> list[int]:
    key = f"probe-{next(_ids)}"
    hashes = engine.kv.prefix_hashes(key, tokens)
    engine.kv.seqs.pop(key)
    return hashes


# ---- the decision, pure ---------------------------------------------------------------------------------


def test_plan_load_picks_what_is_cheaper_to_load() -> None:
    gpu = PROFILES["gpu"]
    costs = Costs(gpu.prefill_tokens_per_second or 0, gpu.bandwidth, gpu.setup_seconds)
    block = 2 << 20  # an 8B-class model's 16-token block
    # recomputing 16 tokens (0.8 ms) beats a 2 ms host setup; 16 blocks do not
    assert plan_load(["host"], 16, block, costs) == 0
    assert plan_load(["host"] * 16, 16, block, costs) == 16
    # disk has a 10 ms setup: a short disk run is recomputed even behind a long host run
    assert plan_load(["host"] * 16 + ["disk"] * 2, 16, block, costs) == 16
    # unmeasured prefill speed: loading wins
    assert plan_load(["disk"] * 3, 16, block, Costs(0.0, {}, {})) == 3
    # a CPU: memory copies at GB/s against a few hundred tokens a second
    assert plan_load(["host", "disk"], 16, block, Costs(300.0, {"host": 5e9, "disk": 1e9}, {})) == 2


# ---- moves ----------------------------------------------------------------------------------------------


def test_blocks_come_back_byte_identical_after_every_move(tiny_dir: Path, tmp_path: Path) -> None:
    engine = tiered(tiny_dir, tmp_path)
    tokens = prompt(1, 100)
    run(engine, tokens)
    run(engine, tokens)  # a hit: write-through-selective copies the blocks to disk too
    hashes = chain(engine, tokens)
    original = {h: device_bytes(engine, h) for h in hashes}
    for h in hashes:
        assert torch.equal(tier_bytes(engine, "host", h), original[h])  # device -> host
        assert torch.equal(tier_bytes(engine, "disk", h), original[h])  # host -> disk
    engine.kv.pool.clear()
    run(engine, tokens)  # host -> device
    assert all(torch.equal(device_bytes(engine, h), original[h]) for h in hashes)
    engine.close()
    disk_only = tiered(tiny_dir, tmp_path, host_blocks=0)
    run(disk_only, tokens)  # disk -> device, after a restart
    assert metric(disk_only, "kvmesh_kv_tier_moved_blocks_total", move="disk_to_device") == len(hashes)
    assert all(torch.equal(device_bytes(disk_only, h), original[h]) for h in hashes)
    disk_only.close()


def test_n_blocks_move_in_ceil_n_over_chunk_copies(tiny_dir: Path, tmp_path: Path) -> None:
    engine = tiered(tiny_dir, tmp_path, disk_blocks=0, kv_tier_chunk_blocks=4)
    tokens = prompt(2, 170)  # 10 full blocks, all registered by one prefill step
    run(engine, tokens, max_tokens=2)
    assert metric(engine, "kvmesh_kv_tier_moved_blocks_total", move="device_to_host") == 10
    assert metric(engine, "kvmesh_kv_tier_copies_total", move="device_to_host") == math.ceil(10 / 4)
    engine.kv.pool.clear()
    before = engine.tiers.copier.copies  # type: ignore[union-attr]
    run(engine, tokens, max_tokens=2)
    assert metric(engine, "kvmesh_kv_tier_moved_blocks_total", move="host_to_device") == 10
    assert engine.tiers.copier.copies - before == math.ceil(10 / 4)  # type: ignore[union-attr]
    # not one copy per block and layer
    assert metric(engine, "kvmesh_kv_tier_copies_total", move="host_to_device") < 10 * 2
    engine.close()


# ---- promotion before prefill -----------------------------------------------------------------------------


def test_a_request_served_from_the_host_tier_matches_a_cold_one(tiny_dir: Path, tmp_path: Path) -> None:
    cold_tokens, cold = run_cold(tiny_dir, [*prompt(3, 100), 7, 8])
    engine = tiered(tiny_dir, tmp_path, disk_blocks=0)
    run(engine, prompt(3, 100))
    engine.kv.pool.clear()  # the device forgets: only the host tier holds the prefix
    before = engine.runner.computed_tokens
    tokens, final = run(engine, [*prompt(3, 100), 7, 8])
    assert tokens == cold_tokens
    assert final.cached_tokens == 96 and final.cached_by_tier == {"host": 96, "disk": 0}
    # only the 6 uncached prompt tokens, then one per output token after the first
    assert engine.runner.computed_tokens - before == 102 - 96 + 7
    assert metric(engine, "kvmesh_prefix_cache_hit_tokens_total", tier="host") == 96
    assert metric(engine, "kvmesh_kv_tier_load_decisions_total", decision="load") == 1
    assert cold.cached_tokens == 0
    engine.close()


def test_a_request_served_from_the_disk_tier_matches_a_cold_one(tiny_dir: Path, tmp_path: Path) -> None:
    cold_tokens, _ = run_cold(tiny_dir, [*prompt(4, 80), 9])
    engine = tiered(tiny_dir, tmp_path, host_blocks=0)
    run(engine, prompt(4, 80))
    assert engine.tiers is not None and engine.tiers.counts()["disk"][1] == 0  # never hit: not on disk
    run(engine, prompt(4, 80))  # hit again: now written to disk
    assert engine.tiers.counts()["disk"][1] == 4
    engine.kv.pool.clear()
    before = engine.runner.computed_tokens
    tokens, final = run(engine, [*prompt(4, 80), 9])
    assert tokens == cold_tokens
    assert final.cached_by_tier == {"host": 0, "disk": 64} and final.cached_tokens == 64
    assert engine.runner.computed_tokens - before == 81 - 64 + 7
    engine.close()


def run_cold(tiny_dir: Path, tokens: list[int]) -> tuple[list[int], RequestOutput]:
    engine = make_engine(tiny_dir, enable_prefix_cache=False)
    outputs: list[RequestOutput] = []
    request = Request(f"cold-{next(_ids)}", tokens, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    request.on_output = outputs.append
    engine.submit(request)
    engine.run_until_idle()
    return [t for o in outputs for t in o.new_token_ids], outputs[-1]


def test_a_gpu_profile_recomputes_short_prefixes_and_loads_long_ones(tiny_dir: Path, tmp_path: Path) -> None:
    engine = tiered(tiny_dir, tmp_path, disk_blocks=0, kv_tier_cost_profile="gpu")
    short, long = prompt(5, 40), prompt(6, 330)  # 2 and 20 full blocks
    run(engine, short)
    run(engine, long)
    engine.kv.pool.clear()
    before = engine.runner.computed_tokens
    _, final = run(engine, short, max_tokens=1)
    # 2 blocks: 1.6 ms to recompute at 20k tokens/s against a 2 ms host setup: recomputed
    assert final.cached_tokens == 0 and engine.runner.computed_tokens - before == 40
    assert metric(engine, "kvmesh_kv_tier_load_decisions_total", decision="recompute") == 1
    before = engine.runner.computed_tokens
    _, final = run(engine, long, max_tokens=1)
    assert final.cached_by_tier["host"] == 320 and engine.runner.computed_tokens - before == 10
    assert metric(engine, "kvmesh_kv_tier_load_decisions_total", decision="load") == 1
    engine.close()


def test_a_profile_where_recompute_always_wins_loads_nothing(tiny_dir: Path, tmp_path: Path) -> None:
    engine = tiered(tiny_dir, tmp_path, disk_blocks=0)
    assert engine.tiers is not None
    engine.tiers.profile = CostProfile(prefill_tokens_per_second=1e12)
    run(engine, prompt(7, 100))
    engine.kv.pool.clear()
    before = engine.runner.computed_tokens
    _, final = run(engine, prompt(7, 100), max_tokens=1)
    assert final.cached_tokens == 0 and engine.runner.computed_tokens - before == 100
    engine.close()


# ---- capacity, events, metrics ------------------------------------------------------------------------------


def test_a_full_host_tier_evicts_least_recent_and_says_so(tiny_dir: Path, tmp_path: Path) -> None:
    engine = tiered(tiny_dir, tmp_path, host_blocks=8, disk_blocks=0)
    first, second = prompt(8, 100), prompt(9, 100)  # 6 blocks each, 12 for 8 slots
    run(engine, first)
    run(engine, second)
    assert metric(engine, "kvmesh_kv_evictions_total", tier="host", reason="capacity") == 4
    snapshot = engine.events.snapshot()
    assert set(snapshot.blocks["host"]) == {h for h in chain(engine, first)[4:] + chain(engine, second)}
    assert set(snapshot.blocks["device"]) >= set(chain(engine, first))  # the device still holds both
    states = {s: metric(engine, "kvmesh_kv_blocks", tier="host", state=s) for s in ("used", "evictable", "free")}
    assert states == {"used": 0, "evictable": 8, "free": 0}
    engine.close()


def test_a_move_is_stored_in_the_new_tier_and_removed_from_the_old(tiny_dir: Path, tmp_path: Path) -> None:
    engine = tiered(tiny_dir, tmp_path, disk_blocks=0, kv_cache_blocks=8)
    tokens = prompt(10, 100)  # 6 blocks of 8 device blocks
    run(engine, tokens, max_tokens=1)
    hashes = chain(engine, tokens)
    after = engine.events.seq
    run(engine, prompt(11, 100), max_tokens=1)  # pushes the first prompt's blocks off the device
    events = [e for b in engine.events.read(after) for e in b.events]
    removed_device = {h for e in events if e.kind == "removed" and e.tier == "device" for h in e.block_hashes}
    assert removed_device & set(hashes)
    snapshot = engine.events.snapshot()
    assert set(hashes) <= set(snapshot.blocks["host"])
    assert not set(snapshot.blocks["device"]) & removed_device
    engine.close()


def test_bad_tier_settings_are_refused_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="kv_tier_cost_profile must be one of measured, gpu, cpu"):
        EngineConfig(kv_tier_cost_profile="fast").validate()
    with pytest.raises(ValueError, match="kv_host_memory_mib and kv_disk_mib must be >= 0"):
        EngineConfig(kv_disk_mib=-1).validate()
    with pytest.raises(ValueError, match="kv_tier_chunk_blocks >= 1"):
        EngineConfig(kv_tier_chunk_blocks=0).validate()


def test_a_tier_the_filesystem_has_no_room_for_is_refused_at_start(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier file larger than its filesystem's free space (a /dev/shm smaller than the host tier) used to start
    fine, sparse, and kill the engine with SIGBUS at a later write; its space is now reserved at start. A small
    filesystem needs root (or a user namespace: the next test, where the machine allows one) to mount, so here
    os.posix_fallocate reports a full filesystem, as it does on one."""
    def full_at(call: int):  # the filesystem is full from the `call`-th reservation on
        calls: list[int] = []

        def fallocate(fd: int, offset: int, length: int) -> None:
            calls.append(length)
            if len(calls) >= call:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fallocate

    monkeypatch.setattr(os, "posix_fallocate", full_at(1))
    with pytest.raises(TierSpaceError, match=r"^the host KV tier needs 1\.0 MiB at .*/host\.kv; only [\d.,]+ MiB free: "
                                             r"lower --kv-host-memory-mib or give .* more room"):
        tiered(tiny_dir, tmp_path, disk_blocks=0)
    assert (tmp_path / "host.kv").stat().st_size == 0  # what it took is given back
    monkeypatch.setattr(os, "posix_fallocate", full_at(2))  # room for the host tier, not for the disk tier
    with pytest.raises(TierSpaceError, match=r"^the disk KV tier needs 1\.0 MiB at .*/disk\.kv; .*lower --kv-disk-mib"):
        tiered(tiny_dir, tmp_path)
    monkeypatch.undo()
    tiered(tiny_dir, tmp_path).close()  # the failed starts left neither file locked


def test_a_tier_larger_than_its_tmpfs_is_refused_at_start_not_by_sigbus(tmp_path: Path) -> None:
    """The real thing where the machine lets an unprivileged user mount a tmpfs in a user namespace: a 4 MiB host
    tier on a 1 MiB tmpfs, every slot then written (before the fix: SIGBUS)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.decode().strip()}")
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from kvmesh.engine.kv.tiers import SlotFile, TierSpaceError\n"
        "try:\n"
        "    tier = SlotFile(Path(sys.argv[1]) / 'host.kv', 512, 8192, 'test', 'host')\n"
        "except TierSpaceError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n"
        "tier.data[:] = 1\n"
        "print('wrote every slot')\n"
    )
    mount_and_run = 'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$2" -c "$3" "$1"'
    done = subprocess.run(["unshare", "-rm", "sh", "-c", mount_and_run, "sh", str(mnt), sys.executable, script],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr)
    assert done.stdout.startswith("the host KV tier needs 4.0 MiB at "), done.stdout
    assert "only 1.0 MiB free: lower --kv-host-memory-mib" in done.stdout


def test_a_peer_fetch_is_served_from_the_host_tier(tiny_dir: Path, tmp_path: Path) -> None:
    from kvmesh.engine.kv.transfer import Layout

    engine = tiered(tiny_dir, tmp_path, disk_blocks=0)
    tokens = prompt(12, 100)
    run(engine, tokens)
    hashes = chain(engine, tokens)
    original = {h: tier_bytes(engine, "host", h) for h in hashes}
    engine.kv.pool.clear()
    key, ids = engine.pin_for_send(hashes, None)
    assert ids == []  # the device holds none of them now
    loading = engine.promote_for_send(key, hashes, 0)
    assert loading is not None
    engine.run_until_idle()  # the copy lands
    ids = loading.result(timeout=10)
    assert len(ids) == len(hashes)
    frame = engine.read_frame(ids, hashes)
    data = frame[frame.index(b"\n") + 1 :]
    size = Layout.of(engine.runner.kv_cache).block_bytes
    for i, h in enumerate(hashes):
        assert data[i * size : (i + 1) * size] == original[h].numpy().tobytes()
    engine.release(key)
    engine.kv.check_invariants()
    assert engine.kv.stats().used == 0
    engine.close()


def test_a_fetch_released_while_its_load_copies_keeps_its_blocks_until_the_copy_lands(tiny_dir: Path,
                                                                                       tmp_path: Path) -> None:
    """The sender gives up (its peer left, the transfer timed out) while host blocks are still copying into device
    blocks for it: those blocks must not go to another request before the copy lands, or the copy's hashes would
    name that request's KV and every later hit on the prefix would decode from the wrong keys and values."""
    engine = tiered(tiny_dir, tmp_path, disk_blocks=0, kv_cache_blocks=16)
    tokens = prompt(12, 100)
    cold, _ = run(engine, tokens)
    hashes = chain(engine, tokens)
    engine.kv.pool.clear()  # the host tier alone holds the prefix
    key, _ = engine.pin_for_send(hashes, None)
    assert engine.promote_for_send(key, hashes, 0) is not None
    loading = set(engine.kv.block_ids(key))
    engine.release(key)  # at once, as kv_fetch does when it is cancelled
    other = Request(f"t-{next(_ids)}", prompt(7, 90), SamplingParams(max_tokens=3, temperature=0.0,
                                                                     ignore_eos=True))
    engine.submit(other)
    engine.step()  # the other request is admitted while the copy may still run
    assert not loading & set(engine.kv.block_ids(other.request_id))
    engine.run_until_idle()
    engine.tiers.drain()
    engine.step()
    engine.kv.check_invariants()
    again, final = run(engine, tokens)
    assert final.cached_tokens > 0  # served from the blocks the copy filled ...
    assert again[:len(cold)] == cold  # ... and they hold this prefix's KV
    assert engine.kv.stats().used == 0
    engine.close()


def test_residency_is_observed_for_the_sampled_blocks_of_every_tier(tiny_dir: Path, tmp_path: Path) -> None:
    from kvmesh.engine.protocol import RESIDENCY_SAMPLE

    engine = tiered(tiny_dir, tmp_path, host_blocks=8, disk_blocks=0, kv_cache_blocks=8)
    for seed in range(30, 46):  # 6 blocks each: both tiers evict again and again
        run(engine, prompt(seed, 100), max_tokens=1)
    seed = next(s for s in range(100, 400) if any(h % RESIDENCY_SAMPLE == 0 for h in chain(engine, prompt(s, 100))))
    run(engine, prompt(seed, 100), max_tokens=1)
    run(engine, prompt(seed, 100), max_tokens=1)  # a device hit on a sampled block
    events = [e for b in engine.events.read(0) for e in b.events]
    for tier in ("device", "host"):
        evicted = [h for e in events if e.kind == "removed" and e.tier == tier for h in e.block_hashes]
        sampled = sum(h % RESIDENCY_SAMPLE == 0 for h in evicted)
        assert sampled > 0
        assert metric(engine, "kvmesh_kv_block_lifetime_seconds_count", tier=tier) == sampled
        assert metric(engine, "kvmesh_kv_block_idle_before_evict_seconds_count", tier=tier) == sampled
    reused = sum(h % RESIDENCY_SAMPLE == 0 for h in chain(engine, prompt(seed, 100)))
    assert reused > 0
    assert metric(engine, "kvmesh_kv_block_reuse_gap_seconds_count", tier="device") == reused
    engine.close()


def test_running_requests_keep_decoding_while_a_prefix_loads(tiny_dir: Path, tmp_path: Path) -> None:
    """The copy runs on the copy thread: held back here by a gate (the one stand-in: a real copy is too fast
    to watch), the engine keeps stepping the running request and the loading one waits out of the queue."""
    engine = tiered(tiny_dir, tmp_path, disk_blocks=0)
    assert engine.tiers is not None
    tokens = prompt(13, 100)
    run(engine, tokens)
    engine.kv.pool.clear()
    copier = engine.tiers.copier
    gate = threading.Event()
    execute = copier._execute
    copier._execute = lambda job: (gate.wait(30), execute(job))  # type: ignore[method-assign]

    running: list[RequestOutput] = []
    long = Request("long", prompt(14, 20), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
                   on_output=running.append)
    engine.submit(long)
    engine.step()
    waiting: list[RequestOutput] = []
    loaded = Request("loaded", [*tokens, 5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                     on_output=waiting.append)
    engine.submit(loaded)
    for _ in range(5):
        engine.step()
    assert len(running) >= 5 and not waiting  # decoding went on while the prefix was still loading
    assert engine.state.waiting == 1 and loaded.status.value == "waiting"
    gate.set()
    engine.run_until_idle()
    assert waiting[-1].cached_by_tier["host"] == 96 and len(running) == 50
    engine.close()
