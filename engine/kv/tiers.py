"""KV tiers below the device: host memory (a file in /dev/shm) and disk, moved by a copy thread in chunks.

Why this shape (LMCache, SGLang HiCache, FailSafe):
- Write-through to host: every block the device registers is copied to the host tier by the copy thread soon
  after, so evicting it from the device later costs nothing and loses nothing: the block is demoted by dropping
  its device copy. The disk gets only blocks that were hit again (write-through-selective), so it is not filled
  with blocks nobody reuses.
- Promotion before prefill: a request whose prefix continues in a lower tier waits out of the scheduler's queue
  while the copy thread loads those blocks into device blocks reserved for it (prefetch while it waits); the
  engine decides per request how much of that prefix is cheaper to load than to recompute (`plan_load`).
- Moves go in chunks of many blocks, all layers each (the block-first layout makes a block one run of memory):
  N blocks take ceil(N / chunk) copies, not N x layers.
- Both tiers are slot files: a header page, one record per slot, then the slots' bytes, mapped into memory. A
  record is written after its bytes, with their size and checksum, so a process killed mid-copy leaves a record
  that fails its check at the next start and is dropped. The host file lives in /dev/shm, so a restarted
  process finds it; the disk file survives a full restart.

Ownership: the engine thread owns every index here (which slot holds which hash, pins, LRU order); the copy
thread only moves bytes of blocks and slots pinned for it, and writes their records.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import json
import logging
import math
import mmap
import os
import queue
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

from kvmesh.engine.kernels import gather_blocks, scatter_blocks
from kvmesh.engine.kv.blocks import KVCacheManager, ResidencySampling
from kvmesh.engine.kv.costs import CostProfile
from kvmesh.engine.protocol import KVEvent

if TYPE_CHECKING:
    from kvmesh.engine.metrics import EngineMetrics

log = logging.getLogger("kvmesh.engine.tiers")

LOWER_TIERS: tuple[str, ...] = ("host", "disk")  # fastest first
MAGIC = b"KVMESHT1"
PAGE = 4096
READY = 1
RECORD = np.dtype([("hash", "<u8"), ("parent", "<u8"), ("checksum", "<u8"), ("nbytes", "<u8"), ("tokens", "<u4"),
                   ("state", "<u4")])
FLUSH_SECONDS = 5.0  # the copy thread syncs a dirty disk file at most this often
BANDWIDTH_EMA = 0.3


# ---------------------------------------------------------------------------------------------------------
# Load or recompute
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Costs:
    """Resolved numbers for one decision. A zero prefill speed (not yet measured) means recompute is unknown,
    and loading wins."""

    prefill_tokens_per_second: float
    bandwidth: dict[str, float]
    setup_seconds: dict[str, float]

    def load_seconds(self, tiers: Sequence[str], block_bytes: int) -> float:
        used = set(tiers)
        return sum(self.setup_seconds.get(t, 0.0) for t in used) + sum(
            block_bytes / self.bandwidth.get(t, math.inf) for t in tiers
        )

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_second if self.prefill_tokens_per_second > 0 else math.inf


def plan_load(tiers: Sequence[str], block_tokens: int, block_bytes: int, costs: Costs) -> int:
    """How many leading blocks of a prefix held in lower tiers (`tiers[i]` holds block i) to load; the rest is
    recomputed. Picks the count that saves the most time over recomputing (0: recompute all of it)."""
    best, best_saving = 0, 0.0
    for k in range(1, len(tiers) + 1):
        saving = costs.recompute_seconds(k * block_tokens) - costs.load_seconds(tiers[:k], block_bytes)
        if saving > best_saving or (math.isinf(saving) and saving > 0):
            best, best_saving = k, saving
    return best


# ---------------------------------------------------------------------------------------------------------
# Storage: a slot file
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredBlock:
    slot: int
    block_hash: int
    parent: int
    tokens: int


class TierSpaceError(RuntimeError):
    """A tier file that its filesystem has no room for: refused at start (mapped unreserved, it would crash the
    process with SIGBUS at the first write into a page the filesystem cannot give)."""


# what to change when a tier's file does not fit, by tier
_ROOM_HINTS = {
    "host": "lower --kv-host-memory-mib or give {dir} more room{shm}",
    "disk": "lower --kv-disk-mib or free space on {dir}",
}
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_NO_RESERVE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # a filesystem that cannot reserve


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


class SlotFile:
    """A tier's bytes: a file of fixed-size slots, mapped into memory, locked against a second engine. Its whole
    size is reserved on the filesystem at start (`_reserve`)."""

    def __init__(self, path: Path, num_slots: int, block_bytes: int, fingerprint: str, tier: str = "host") -> None:
        if num_slots < 1:
            raise ValueError(f"{path}: a tier needs room for at least one block")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        data_offset = -(-(PAGE + num_slots * RECORD.itemsize) // PAGE) * PAGE
        size = data_offset + num_slots * block_bytes
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise RuntimeError(f"KV tier file {path} is in use by another engine; give each its own path") from None
        meta = json.dumps({"fingerprint": fingerprint, "num_slots": num_slots, "block_bytes": block_bytes}).encode()
        header = MAGIC + struct.pack("<I", len(meta)) + meta
        if len(header) > PAGE:
            raise ValueError("tier fingerprint too long")
        existing = os.pread(self._fd, len(header), 0)
        self.fresh = existing != header or os.fstat(self._fd).st_size != size
        if self.fresh:
            if existing.startswith(MAGIC):
                log.warning("KV tier file %s was written for another model, layout or size: starting it empty "
                            "(a model's name, weights, block hashing and KV layout all count)", path)
            os.ftruncate(self._fd, 0)
            os.ftruncate(self._fd, size)  # zeroes: every record empty
            os.pwrite(self._fd, header, 0)
        self._reserve(size, tier)
        self._map = mmap.mmap(self._fd, size)
        self.records = np.frombuffer(self._map, RECORD, num_slots, PAGE)
        self._bytes = np.frombuffer(self._map, np.uint8, num_slots * block_bytes, data_offset).reshape(
            num_slots, block_bytes
        )
        self.data = torch.from_numpy(self._bytes)  # [slots, block_bytes] uint8, shares the mapping
        self.dirty = False

    def _reserve(self, size: int, tier: str) -> None:
        """Allocate the file's whole size now. ftruncate makes a sparse file: mapped, its pages are allocated at
        first write, and one the filesystem has no room for (a /dev/shm smaller than the host tier, a full disk)
        kills the process with SIGBUS long after start. A filesystem that cannot reserve is only warned about."""
        if not hasattr(os, "posix_fallocate"):  # not on macOS: nothing to reserve with
            return
        held = os.fstat(self._fd).st_blocks * 512
        vfs = os.fstatvfs(self._fd)
        free = vfs.f_bavail * vfs.f_frsize + held  # what this file may take: the filesystem's free space and its own
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            if exc.errno in _NO_RESERVE:
                log.warning("KV %s tier file %s: the filesystem cannot reserve its %s MiB (%s); if it runs out of room "
                            "the engine dies of SIGBUS", tier, self.path, _mib(size), exc.strerror)
                return
            if self.fresh:
                os.ftruncate(self._fd, 0)  # give back what was allocated before the filesystem ran out
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
            if exc.errno not in _NO_ROOM:
                raise
            where = self.path.parent
            hint = _ROOM_HINTS.get(tier, "make the tier smaller or give {dir} more room{shm}").format(
                dir=where, shm=" (docker run --shm-size)" if str(where.resolve()).startswith("/dev/shm") else "")
            raise TierSpaceError(f"the {tier} KV tier needs {_mib(size)} MiB at {self.path}; only {_mib(free)} MiB "
                                 f"free: {hint}") from None

    def checksum(self, slot: int) -> int:
        return xxhash.xxh3_64_intdigest(self._bytes[slot])

    def write_record(self, block: StoredBlock) -> None:
        """After the slot's bytes are in place: make it valid (state last, so a torn record stays invalid)."""
        rec = self.records[block.slot]
        rec["state"] = 0
        rec["hash"], rec["parent"], rec["tokens"] = block.block_hash, block.parent, block.tokens
        rec["nbytes"], rec["checksum"] = self.block_bytes, self.checksum(block.slot)
        rec["state"] = READY
        self.dirty = True

    def clear_record(self, slot: int) -> None:
        self.records[slot]["state"] = 0
        self.dirty = True

    def recover(self) -> tuple[list[StoredBlock], list[int]]:
        """(valid blocks, damaged slots) of a file written by an earlier process. Damaged: a wrong size or a
        checksum that does not match its bytes (a copy cut short, a flipped byte); their records are cleared."""
        valid: list[StoredBlock] = []
        damaged: list[int] = []
        seen: set[int] = set()
        for slot in np.flatnonzero(self.records["state"] == READY).tolist():
            rec = self.records[slot]
            block_hash = int(rec["hash"])
            if int(rec["nbytes"]) != self.block_bytes or int(rec["checksum"]) != self.checksum(slot):
                damaged.append(slot)
                self.clear_record(slot)
            elif block_hash in seen:
                self.clear_record(slot)
            else:
                seen.add(block_hash)
                valid.append(StoredBlock(slot, block_hash, int(rec["parent"]), int(rec["tokens"])))
        return valid, damaged

    def flush(self) -> None:
        if self.dirty:
            self.dirty = False
            self._map.flush()

    def close(self) -> None:
        """Sync and unlock; the mapping stays valid for tensors still referring to it."""
        if self._fd < 0:
            return
        self.flush()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1


# ---------------------------------------------------------------------------------------------------------
# Accounting for one tier (engine thread)
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Slot:
    block_hash: int
    parent: int
    tokens: int
    pins: int = 0  # copies in flight that read or write it
    ready: bool = False  # its bytes and record are written
    stored_at: float = 0.0  # residency times (sampled blocks)
    idle_since: float = 0.0


class TierIndex(ResidencySampling):
    """Which slot holds which block, and the order to evict them: least recently written or hit first."""

    def __init__(self, name: str, store: SlotFile, emit: Callable[[KVEvent], None]) -> None:
        self.name = name
        self.store = store
        self._emit = emit
        self.slots: dict[int, Slot] = {}
        self.by_hash: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # ready, unpinned slots
        self.free = list(range(store.num_slots - 1, -1, -1))
        self.evicted = 0

    def find(self, block_hash: int) -> int | None:
        """The slot holding `block_hash`, written or being written (a later read is queued behind the write)."""
        return self.by_hash.get(block_hash)

    def touch(self, slot: int) -> None:
        """A request uses the block (it is loaded to the device): most recently used, and a reuse gap."""
        if slot in self.lru:
            self.lru.move_to_end(slot)
        s = self.slots[slot]
        self._observe_reuse(s.block_hash, s.idle_since)
        s.idle_since = time.monotonic()

    def reserve(self, block_hash: int, parent: int, tokens: int) -> int | None:
        """A pinned slot for a block about to be written, evicting the least recently used if full; None when
        every slot is pinned."""
        if self.free:
            slot = self.free.pop()
        elif self.lru:
            slot, _ = self.lru.popitem(last=False)
            victim = self.slots[slot]
            self._observe_eviction(victim.block_hash, victim.stored_at, victim.idle_since)
            self._forget(slot)
            self.evicted += 1
        else:
            return None
        self.store.clear_record(slot)
        self.slots[slot] = Slot(block_hash, parent, tokens, pins=1)
        self.by_hash[block_hash] = slot
        return slot

    def adopt(self, block: StoredBlock) -> None:
        """A block recovered from an earlier process's file."""
        self.free.remove(block.slot)
        now = time.monotonic()  # its age in the earlier process is not known: residency counts from now
        self.slots[block.slot] = Slot(block.block_hash, block.parent, block.tokens, ready=True, stored_at=now,
                                      idle_since=now)
        self.by_hash[block.block_hash] = block.slot
        self.lru[block.slot] = None

    def written(self, slot: int) -> None:
        s = self.slots[slot]
        s.ready = True
        s.stored_at = s.idle_since = time.monotonic()
        self.announce(slot)
        self.unpin(slot)

    def pin(self, slot: int) -> None:
        self.slots[slot].pins += 1
        self.lru.pop(slot, None)

    def unpin(self, slot: int) -> None:
        s = self.slots[slot]
        s.pins -= 1
        assert s.pins >= 0, f"{self.name} slot {slot} unpinned twice"
        if s.pins == 0 and s.ready:
            self.lru[slot] = None

    def discard(self, slot: int) -> None:
        """A write that failed: the slot holds nothing."""
        self.unpin(slot)
        self._forget(slot)
        self.free.append(slot)

    def announce(self, slot: int) -> None:
        s = self.slots[slot]
        self._emit(KVEvent("stored", (s.block_hash,), tier=self.name, parent_hash=s.parent, token_count=s.tokens))

    def _forget(self, slot: int) -> None:
        s = self.slots.pop(slot)
        del self.by_hash[s.block_hash]
        if s.ready:
            self._emit(KVEvent("removed", (s.block_hash,), tier=self.name))

    def counts(self) -> tuple[int, int, int]:
        """(used: pinned by copies in flight, evictable, free); they sum to the slots."""
        evictable, free = len(self.lru), len(self.free)
        return self.store.num_slots - evictable - free, evictable, free

    def check_invariants(self) -> None:
        assert len(self.slots) + len(self.free) == self.store.num_slots
        assert set(self.by_hash.values()) == set(self.slots)
        for slot, s in self.slots.items():
            assert (slot in self.lru) == (s.ready and s.pins == 0), f"{self.name} slot {slot} misplaced"


# ---------------------------------------------------------------------------------------------------------
# The copy thread
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """Blocks of one move: src[src_index[i]] -> dst[dst_index[i]]; records written for a file destination."""

    move: str  # e.g. device_to_host
    src: torch.Tensor  # [n, block_bytes] uint8
    src_index: list[int]
    dst: torch.Tensor
    dst_index: list[int]
    dst_file: SlotFile | None = None
    records: tuple[StoredBlock, ...] = ()


@dataclass
class Job:
    """One unit of work for the copy thread; the engine finishes it (pins, indexes, events) when polled."""

    segments: list[Segment]
    written: list[tuple[TierIndex, int]] = field(default_factory=list)  # slots that become ready
    read: list[tuple[TierIndex, int]] = field(default_factory=list)  # slots to unpin
    device_reads: list[int] = field(default_factory=list)  # device blocks the copy reads
    promotion: Promotion | None = None
    failed: bool = False
    copies: dict[str, int] = field(default_factory=dict)  # per move
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class Promotion:
    """Blocks loaded into reserved device blocks for a waiting request; registered when the job is done."""

    request_id: str | None  # None: a load for a peer's fetch
    key: str  # holder of the reserved device blocks (and the request's device prefix) until it is admitted
    block_ids: list[int]
    hashes: list[int]
    parent: int | None
    tokens_by_tier: dict[str, int]
    on_done: Callable[[bool], None] | None = None  # for a load not for a request (a peer's fetch)
    ok: bool = True


IDLE = Job([])  # what the copy thread takes when nothing came for FLUSH_SECONDS


class Copier:
    """A thread that runs copy jobs in order. A read queued after a write of the same slot sees its bytes."""

    def __init__(self, chunk_blocks: int, on_done: Callable[[], None]) -> None:
        self.chunk_blocks = chunk_blocks
        self.copies = 0  # chunk copies made, all moves (a test counts them)
        self._on_done = on_done
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()  # None: stop
        self.done: deque[Job] = deque()
        self.files: list[SlotFile] = []  # synced when the thread is idle (the disk tier)
        self._idle = threading.Condition()
        self.in_flight = 0
        self._stage: torch.Tensor | None = None  # the copy thread's chunk buffer, reused by every copy
        self._thread = threading.Thread(target=self._run, name="kvmesh-kv-copy", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._idle:
            self.in_flight += 1
        self._jobs.put(job)

    def wait(self, timeout: float) -> None:
        """Until a job is done (or none is in flight)."""
        with self._idle:
            self._idle.wait_for(lambda: self.done or self.in_flight == 0, timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        flushed = time.monotonic()
        while True:
            try:
                job = self._jobs.get(timeout=FLUSH_SECONDS)
            except queue.Empty:
                job = IDLE
            if time.monotonic() - flushed > FLUSH_SECONDS:  # idle, or busy for long: sync the disk file
                flushed = time.monotonic()
                for f in self.files:
                    f.flush()
            if job is IDLE:
                continue
            if job is None:
                return
            try:
                self._execute(job)
            except Exception:  # a failed copy loses its blocks, never the engine: they are recomputed
                log.exception("KV tier copy failed")
                job.failed = True
            with self._idle:
                self.done.append(job)
                self.in_flight -= 1
                self._idle.notify_all()
            self._on_done()

    def _execute(self, job: Job) -> None:
        for seg in job.segments:
            start = time.perf_counter()
            if self._stage is None:
                self._stage = staging_buffer(self.chunk_blocks, seg.src.shape[1])
            copies = copy_blocks(seg.src, seg.src_index, seg.dst, seg.dst_index, self.chunk_blocks, self._stage)
            job.copies[seg.move] = job.copies.get(seg.move, 0) + copies
            self.copies += copies
            for block in seg.records:
                assert seg.dst_file is not None
                seg.dst_file.write_record(block)
            job.seconds[seg.move] = job.seconds.get(seg.move, 0.0) + time.perf_counter() - start


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """[n, block_bytes] uint8 viewed with the widest element that divides a block: CPU index copies go element
    by element, so 8-byte elements move a block about 8x faster than bytes (measured: docs/benchmarks.md)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if rows.shape[1] % dtype.itemsize == 0:
            return rows.view(dtype)
    return rows


def staging_buffer(chunk_blocks: int, block_bytes: int) -> torch.Tensor:
    """A CPU buffer for one chunk, to be reused: a fresh one per copy is mapped fresh by the allocator, and its
    page faults take longer than the copy itself on this machine."""
    return _wide(torch.zeros((chunk_blocks, block_bytes), dtype=torch.uint8))


def copy_blocks(src: torch.Tensor, src_index: Sequence[int], dst: torch.Tensor, dst_index: Sequence[int],
                chunk_blocks: int, stage: torch.Tensor | None = None) -> int:
    """Copy blocks src[src_index[i]] -> dst[dst_index[i]] between two [n, block_bytes] uint8 tensors, one chunk
    of blocks per copy; returns the copies made. On CUDA the engine's block kernels; between CPU tensors through
    `stage` (from `staging_buffer`)."""
    src, dst = _wide(src), _wide(dst)
    cpu = not (src.is_cuda or dst.is_cuda)
    if cpu and (stage is None or stage.shape[0] < chunk_blocks or stage.dtype != src.dtype
                or stage.shape[1] != src.shape[1]):
        stage = staging_buffer(chunk_blocks, src.shape[1] * src.element_size())
    copies = 0
    for i in range(0, len(src_index), chunk_blocks):
        src_ids = torch.tensor(list(src_index[i : i + chunk_blocks]), device=src.device)
        dst_ids = torch.tensor(list(dst_index[i : i + chunk_blocks]), device=dst.device)
        if cpu:
            assert stage is not None
            chunk = stage[: len(src_ids)]
            torch.index_select(src, 0, src_ids, out=chunk)
            dst.index_copy_(0, dst_ids, chunk)
        else:
            scatter_blocks(dst, dst_ids, gather_blocks(src, src_ids).to(dst.device))
        copies += 1
    if dst.is_cuda:
        torch.cuda.synchronize(dst.device)
    return copies


# ---------------------------------------------------------------------------------------------------------
# The tiers, as the engine sees them
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierSettings:
    host_blocks: int = 0  # 0: no host tier
    host_path: Path | None = None
    disk_blocks: int = 0  # 0: no disk tier
    disk_path: Path | None = None
    chunk_blocks: int = 32
    profile: CostProfile = field(default_factory=CostProfile)

    @property
    def enabled(self) -> bool:
        return self.host_blocks > 0 or self.disk_blocks > 0


class KVTiers:
    """The host and disk tiers of one engine, driven from the engine thread."""

    def __init__(
        self,
        settings: TierSettings,
        kv: KVCacheManager,
        kv_cache: torch.Tensor,
        fingerprint: str,
        emit: Callable[[KVEvent], None],
        wake: Callable[[], None],
        prefill_tokens_per_second: Callable[[], float],
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.kv = kv
        self.device = kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)  # [blocks, block_bytes]
        self.block_bytes = self.device.shape[1]
        self.block_tokens = kv.block_size
        self.profile = settings.profile
        self._prefill_tps = prefill_tokens_per_second
        self._metrics = metrics
        self.tiers: dict[str, TierIndex] = {}
        for name, blocks, path in (("host", settings.host_blocks, settings.host_path),
                                   ("disk", settings.disk_blocks, settings.disk_path)):
            if blocks > 0:
                assert path is not None, f"the {name} tier needs a path"
                try:
                    store = SlotFile(path, blocks, self.block_bytes, fingerprint, name)
                except BaseException:  # the tiers opened before it must not stay locked
                    for opened in self.tiers.values():
                        opened.store.close()
                    raise
                tier = TierIndex(name, store, emit)
                if metrics is not None:
                    tier.on_residency = lambda kind, s, name=name: metrics.residency[kind].labels(name).observe(s)
                self.tiers[name] = tier
        self.copier = Copier(settings.chunk_blocks, wake)
        self.copier.files = [t.store for name, t in self.tiers.items() if name == "disk"]
        self.bandwidth: dict[str, float] = {}  # measured load bandwidth per tier, bytes per second
        self._reading: collections.Counter[int] = collections.Counter()  # device blocks read by copies in flight
        self.finished: list[Promotion] = []  # promotions done, for the engine to take
        kv.pool.before_reuse = self.before_reuse
        for tier in self.tiers.values():
            self._recover(tier)
            self._probe(tier)

    # ---- start ------------------------------------------------------------------------------------------

    def _recover(self, tier: TierIndex) -> None:
        """Index what an earlier process left in the tier's file, announce it, drop what fails its check."""
        if tier.store.fresh:
            return
        valid, damaged = tier.store.recover()
        for block in valid:
            tier.adopt(block)
            tier.announce(block.slot)
        if damaged:
            log.warning("KV %s tier %s: dropped %d damaged blocks (wrong size or checksum)", tier.name,
                        tier.store.path, len(damaged))
        if valid:
            log.info("KV %s tier %s: recovered %d blocks", tier.name, tier.store.path, len(valid))
        if self._metrics is not None:
            self._metrics.tier_recovered.labels(tier.name).inc(len(valid))
            self._metrics.evictions.labels(tier.name, "damaged").inc(len(damaged))

    def _probe(self, tier: TierIndex) -> None:
        """A first load bandwidth, before any real load has been measured: the best of a few chunk reads into
        a scratch tensor (the first one pays for page faults and lazy initialisation)."""
        n = min(self.copier.chunk_blocks, tier.store.num_slots)
        scratch = torch.empty((n, self.block_bytes), dtype=torch.uint8, device=self.device.device)
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            copy_blocks(tier.store.data, range(n), scratch, range(n), n)
            best = min(best, time.perf_counter() - start)
        self.bandwidth[tier.name] = n * self.block_bytes / max(best, 1e-9)

    # ---- decisions --------------------------------------------------------------------------------------

    def costs(self) -> Costs:
        """The profile's numbers, measurements where it names none."""
        p = self.profile
        prefill = p.prefill_tokens_per_second if p.prefill_tokens_per_second is not None else self._prefill_tps()
        return Costs(prefill, {**self.bandwidth, **p.bandwidth}, dict(p.setup_seconds))

    def locate(self, hashes: Sequence[int]) -> list[str]:
        """The fastest lower tier holding each of `hashes`, up to the first that none holds."""
        found: list[str] = []
        for block_hash in hashes:
            for name, tier in self.tiers.items():
                if tier.find(block_hash) is not None:
                    found.append(name)
                    break
            else:
                break
        return found

    def plan(self, hashes: Sequence[int]) -> tuple[list[str], int]:
        """(where the blocks of `hashes` are, how many leading ones to load rather than recompute)."""
        where = self.locate(hashes)
        return where, plan_load(where, self.block_tokens, self.block_bytes, self.costs()) if where else 0

    # ---- moves ------------------------------------------------------------------------------------------

    def _submit(self, job: Job) -> None:
        self._reading.update(job.device_reads)
        self.copier.submit(job)

    def before_reuse(self, block_ids: Sequence[int]) -> None:
        """The device pool is about to hand out these blocks: a copy still reading one must finish first (a
        block is written through a step after it is registered, so this rarely waits)."""
        while any(self._reading[b] for b in block_ids):
            self.copier.wait(1.0)
            self.poll()

    def write_through(self, stored: Sequence[KVEvent]) -> None:
        """Copy blocks the device just registered to the host tier (device `stored` events)."""
        host = self.tiers.get("host")
        if host is None:
            return
        records: list[StoredBlock] = []
        seen: set[int] = set()
        for event in stored:
            for block_hash in event.block_hashes:
                if block_hash in seen or host.find(block_hash) is not None or self.kv.pool.lookup(block_hash) is None:
                    continue
                slot = host.reserve(block_hash, event.parent_hash or 0, event.token_count)
                if slot is None:
                    break
                seen.add(block_hash)
                records.append(StoredBlock(slot, block_hash, event.parent_hash or 0, event.token_count))
        if not records:
            return
        ids = [self._device_block(r.block_hash) for r in records]
        segment = Segment("device_to_host", self.device, ids, host.store.data, [r.slot for r in records],
                          host.store, tuple(records))
        self._submit(Job([segment], written=[(host, r.slot) for r in records], device_reads=ids))

    def _device_block(self, block_hash: int) -> int:
        block = self.kv.pool.lookup(block_hash)
        assert block is not None, "a block to copy left the device"
        return block.block_id

    def on_hit(self, chain: Sequence[int], hit_blocks: int, root: int) -> None:
        """Blocks 0..hit_blocks of a request's hash chain were reused: write those the disk lacks to it
        (write-through-selective), from the host tier where it has them, else from the device."""
        disk = self.tiers.get("disk")
        if disk is None or hit_blocks == 0:
            return
        host = self.tiers.get("host")
        from_host: list[tuple[int, StoredBlock]] = []
        from_device: list[StoredBlock] = []
        for i, block_hash in enumerate(chain[:hit_blocks]):
            if disk.find(block_hash) is not None:
                continue
            host_slot = host.find(block_hash) if host is not None else None
            if host_slot is None and self.kv.pool.lookup(block_hash) is None:
                continue
            slot = disk.reserve(block_hash, chain[i - 1] if i else root, self.block_tokens)
            if slot is None:
                break
            block = StoredBlock(slot, block_hash, chain[i - 1] if i else root, self.block_tokens)
            if host_slot is not None:
                assert host is not None
                host.pin(host_slot)
                from_host.append((host_slot, block))
            else:
                from_device.append(block)
        segments: list[Segment] = []
        job = Job(segments, written=[(disk, b.slot) for _, b in from_host] + [(disk, b.slot) for b in from_device])
        if from_host:
            assert host is not None
            segments.append(Segment("host_to_disk", host.store.data, [s for s, _ in from_host], disk.store.data,
                                    [b.slot for _, b in from_host], disk.store, tuple(b for _, b in from_host)))
            job.read = [(host, s) for s, _ in from_host]
        if from_device:
            ids = [self._device_block(b.block_hash) for b in from_device]
            job.device_reads = ids
            segments.append(Segment("device_to_disk", self.device, ids, disk.store.data,
                                    [b.slot for b in from_device], disk.store, tuple(from_device)))
        if segments:
            self._submit(job)

    def promote(self, promotion: Promotion, where: Sequence[str]) -> None:
        """Load `promotion.hashes` (held by the tiers `where`) into its reserved device blocks."""
        job = Job([], promotion=promotion)
        for name, tier in self.tiers.items():
            picked = [i for i, w in enumerate(where) if w == name]
            if not picked:
                continue
            slots = []
            for i in picked:
                slot = tier.find(promotion.hashes[i])
                assert slot is not None, "a located block left its tier before its load was queued"
                tier.pin(slot)
                tier.touch(slot)
                slots.append(slot)
            job.read += [(tier, s) for s in slots]
            job.segments.append(Segment(f"{name}_to_device", tier.store.data, slots, self.device,
                                        [promotion.block_ids[i] for i in picked]))
        self._submit(job)

    # ---- completion (engine thread) ---------------------------------------------------------------------

    def poll(self) -> None:
        """Finish the jobs the copy thread completed: slots become findable (and are announced), pins go, and
        done promotions join `finished` (their device blocks are filled unless `ok` is False)."""
        while self.copier.done:
            job = self.copier.done.popleft()
            for tier, slot in job.written:
                if job.failed:
                    tier.discard(slot)
                else:
                    tier.written(slot)
            for tier, slot in job.read:
                tier.unpin(slot)
            self._reading.subtract(job.device_reads)
            if job.promotion is not None:
                job.promotion.ok = not job.failed
                self.finished.append(job.promotion)
            self._account(job)

    def take_finished(self) -> list[Promotion]:
        self.poll()
        done, self.finished = self.finished, []
        return done

    def _account(self, job: Job) -> None:
        for seg in job.segments:
            if job.failed:
                continue
            seconds = job.seconds.get(seg.move, 0.0)
            nbytes = len(seg.src_index) * self.block_bytes
            if seg.move.endswith("_to_device") and seconds > 0:
                tier = seg.move.removesuffix("_to_device")
                old = self.bandwidth.get(tier)
                now = nbytes / seconds
                self.bandwidth[tier] = now if old is None else (1 - BANDWIDTH_EMA) * old + BANDWIDTH_EMA * now
            if self._metrics is not None:
                m = self._metrics
                m.tier_moved_blocks.labels(seg.move).inc(len(seg.src_index))
                m.tier_moved_bytes.labels(seg.move).inc(nbytes)
                m.tier_move_seconds.labels(seg.move).inc(seconds)
                m.tier_copies.labels(seg.move).inc(job.copies.get(seg.move, 0))
        if self._metrics is not None:
            for tier in self.tiers.values():
                if tier.evicted:
                    self._metrics.evictions.labels(tier.name, "capacity").inc(tier.evicted)
                    tier.evicted = 0

    @property
    def busy(self) -> bool:
        return self.copier.in_flight > 0 or bool(self.copier.done)

    def wait(self, timeout: float = 1.0) -> None:
        self.copier.wait(timeout)

    def drain(self) -> None:
        """Wait for every copy in flight and finish it (tests, shutdown)."""
        while self.busy:
            self.copier.wait(1.0)
            self.poll()

    def counts(self) -> dict[str, tuple[int, int, int]]:
        return {name: tier.counts() for name, tier in self.tiers.items()}

    def check_invariants(self) -> None:
        for tier in self.tiers.values():
            tier.check_invariants()

    def close(self) -> None:
        """Finish the copies in flight, sync the files and unlock them (a restarted engine reopens them)."""
        self.drain()
        self.copier.close()
        for tier in self.tiers.values():
            tier.store.close()
