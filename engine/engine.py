"""The engine: ties the scheduler, KV manager, model runner, sampler and tokenizer, and runs the step loop.

Requests arrive from any thread (`submit`, `abort`); a single engine thread owns all state and runs steps.
Outputs leave through each request's `on_output` callback, called from the engine thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import sys
import threading
import time
import traceback
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvmesh.engine.config import MIB, EngineConfig
from kvmesh.engine.events import EventLog
from kvmesh.engine.forecast import Forecast, OutputLengthModel, RequestLoad, forecast_usage
from kvmesh.engine.kv.blocks import HotChain, KVCacheManager
from kvmesh.engine.kv.costs import PROFILES
from kvmesh.engine.kv.policy import make_policy
from kvmesh.engine.kv.tiers import LOWER_TIERS, KVTiers, Promotion, TierSettings
from kvmesh.engine.kv.transfer import Layout, encode_frame
from kvmesh.engine.kvcache import KVLayout
from kvmesh.engine.metrics import EngineMetrics, EngineState
from kvmesh.engine.model import loader
from kvmesh.engine.model.llama import Llama
from kvmesh.engine.model.lora import (
    LoadedLora,
    LoraAdapter,
    LoraConflict,
    LoraError,
    LoraRegistry,
    read_adapter,
)
from kvmesh.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvmesh.engine.openai_types import MODEL_NOT_FOUND
from kvmesh.engine.protocol import HOST_TIER_DIR, HashAlgo, KVConfig, KVEvent, sendable_length
from kvmesh.engine.request import Request, RequestOutput, Status
from kvmesh.engine.runner import ModelRunner, StepInput
from kvmesh.engine.sampling import SampleResult, prompt_vocabulary, sample, token_logprobs
from kvmesh.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from kvmesh.engine.spec import SpecConfig, TokenHistory, Verdict, accept, propose
from kvmesh.engine.step_cost import DecodeStepFit
from kvmesh.engine.structured import Masks, StructuredError, StructuredOutputs

log = logging.getLogger("kvmesh.engine")
T = TypeVar("T")
TRANSIENT_PINS = ("handle:", "send:")  # holders for another pod: a handoff's handle, a fetch being sent
PIN_PREFIXES = (*TRANSIENT_PINS, "import:", "promote:")  # block holders that are not requests
EMA = 0.2  # weight of the newest sample in the moving averages
MIN_IDLE_WAIT_SECONDS = 0.05  # the idle loop's shortest wait


def _cpu_flags() -> set[str] | None:
    """This x86 CPU's feature flags from /proc/cpuinfo; None where they cannot be read (another OS or
    architecture)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in info.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """The serving dtype. `auto`: bf16 on CUDA; on a CPU, bf16 where it has bf16 matrix units and fp32 where it
    has none (there fp32 products are several times faster); elsewhere the faster of the two, measured as the
    best of several interleaved trials (a single timing on a busy machine once chose the slow one). bf16 serving
    on a CPU keeps the residual stream, the norms, the vocabulary product and attention in fp32; on CUDA only the
    logits are cast to fp32 (model/llama.py, docs/architecture.md "Serving dtype")."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    flags = _cpu_flags()
    if flags is not None:  # bf16 matrix instructions: AVX512-BF16 or AMX
        return torch.bfloat16 if flags & {"avx512_bf16", "amx_bf16"} else torch.float32
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    operands = {dtype: (torch.randn(32, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)) for dtype in best}
    for _ in range(5):
        for dtype, (a, w) in operands.items():
            torch.nn.functional.linear(a, w)
            start = time.perf_counter()
            for _ in range(10):
                torch.nn.functional.linear(a, w)
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    return min(best, key=best.__getitem__)


def pick_attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the torch attention path reads the context and the queries in: the serving dtype on CUDA; on a
    CPU fp32, except bf16 with AMX. Without AMX SDPA's CPU kernel ran one query a sequence 5 to 10x slower in
    bf16 than in fp32 (torch 2.13, AVX512-BF16 EPYC), while with AMX its bf16 kernel is the faster one (decode
    steps 8 % faster at batch 32, a 1,024-token prefill 1.3x; Xeon with AMX, docs/architecture.md "Serving
    dtype")."""
    if device.type != "cpu":
        return dtype
    flags = _cpu_flags()
    amx = flags is not None and "amx_bf16" in flags
    return torch.bfloat16 if dtype == torch.bfloat16 and amx else torch.float32


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: loader.ModelConfig
    tokenizer: Tokenizer
    model: Llama
    dtype: torch.dtype
    weights_fingerprint: str = ""  # loader.weights_fingerprint; "" for a simulated model (kvmesh sim-engine)


# Whom load_model tells how far it is (the server's load-progress gauge): set in the loading thread's context by
# whoever loads, since the loader callables between them (kvmesh serve's `lambda: Engine(config)`) take no arguments.
LOAD_PROGRESS: ContextVar[loader.ProgressCallback] = ContextVar("kvmesh_load_progress", default=loader.no_progress)


def load_model(config: EngineConfig) -> LoadedModel:
    """Read the model, telling LOAD_PROGRESS the share (0..1) of its weights read so far.

    A GGUF converted at this start is read twice, converted and then loaded: each pass is half of the share. One
    series that only rises to 1 whatever the stages lets an operator read a flat one as a stuck load; a stage
    label would split a pod's load into series that each stop, and converting happens only at a first start.
    """
    report = LOAD_PROGRESS.get()
    converted = False

    def converting(fraction: float) -> None:
        nonlocal converted
        converted = True
        report(fraction / 2)

    def loading(fraction: float) -> None:
        report((1 + fraction) / 2 if converted else fraction)

    model_dir = loader.resolve_model_dir(config.model, on_progress=converting)
    model_config = loader.load_config(model_dir)
    device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available() else
                          "cpu" if config.device == "auto" else config.device)
    dtype = pick_dtype(config.dtype, device)
    digests: dict[str, str] = {}
    weights = loader.load_weights(model_dir, dtype, loading, digests)
    model = Llama(model_config, weights, device, config.quantization, config.max_loras, config.max_lora_rank,
                  pick_attention_dtype(dtype, device))
    name = config.served_model_name or model_config.name
    return LoadedModel(name, model_config, Tokenizer.from_dir(model_dir), model, dtype,
                       loader.weights_fingerprint(model_config, digests, config.quantization))


def _asked_logprobs(r: Request, samples: SampleResult, row: int) -> tuple[float | None, list[tuple[int, float]] | None]:
    """Row `row`'s logprob and alternatives if its request asked for them: a step computes them for every row once
    one row wants them, and a request that did not ask must not get them (its answer's shape would depend on what
    else shared its steps)."""
    if not r.params.logprobs or samples.logprobs is None:
        return None, None
    return samples.logprobs[row], samples.top_logprobs[row] if samples.top_logprobs is not None else None


def fit_context(max_model_len: int, kv_tokens: int) -> int:
    """The context a request may take: at most what the KV cache holds. One sequence of a longer context could
    never be served whole (it would end cut short at the cache's size, as if by `max_tokens`), so the engine
    advertises what it can finish, in /v1/models and /tokenize, and refuses longer requests with a 400, where
    vLLM refuses to start."""
    if kv_tokens < max_model_len:
        log.warning("the KV cache holds %d tokens, fewer than the model's context of %d: serving a context of %d "
                    "tokens (raise kv_cache_memory_mib for more)", kv_tokens, max_model_len, kv_tokens)
    return min(max_model_len, kv_tokens)


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        config.validate()
        self.config = config
        loaded = loaded or load_model(config)
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.dtype = loaded.dtype
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        m = loaded.config
        self.kv_layout = KVLayout(m.num_layers, config.block_size, m.num_kv_heads, m.head_dim, loaded.dtype,
                                  config.kv_cache_dtype)
        num_blocks = config.kv_cache_blocks or max(1, config.kv_cache_memory_mib * MIB // self.kv_layout.block_bytes())
        self.max_model_len = fit_context(self.max_model_len, num_blocks * config.block_size)
        self.events = EventLog(config.kv_events_buffer)
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            HashAlgo(config.hash_algo),
            config.hash_root,
            make_policy(config.eviction_policy),
            on_event=self._on_kv_event,
            enable_prefix_cache=config.enable_prefix_cache,
        )
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.queue_policy,
                                   config.max_queue_delay_seconds)
        self.runner = self.make_runner(loaded, num_blocks)
        self.loras = LoraRegistry(config.max_loras)  # changed on the engine thread, read by the HTTP edge
        self.lengths = OutputLengthModel()
        self.state = EngineState(kv=self.kv.stats(), max_loras=config.max_loras)
        self.spec = SpecConfig.parse(config.speculative_config)
        self._histories: dict[str, TokenHistory] = {}  # speculating requests' tokens, for the n-gram lookup
        self.metrics = EngineMetrics(self.model_name, lambda: self.state, config.kv_cache_dtype,
                                     self.kv_layout.stored_format,
                                     self.spec.num_speculative_tokens if self.spec is not None else 0,
                                     loaded.weights_fingerprint)
        self.structured = StructuredOutputs(self.tokenizer, loaded.config.vocab_size,
                                            self.metrics.structured_mask_seconds, self.metrics.structured_masks)
        self.kv_config = KVConfig(
            model=self.model_name,
            block_size=config.block_size,
            hash_algo=config.hash_algo,
            hash_root=config.hash_root,
            tokenizer_fingerprint=self.tokenizer.fingerprint,
            num_device_blocks=num_blocks,
            boot_id=self.events.boot_id,
            role=config.role,
            block_bytes=self.kv_layout.block_bytes(),
            kv_cache_dtype=config.kv_cache_dtype,
            kv_format=self.kv_layout.stored_format,
            weights_fingerprint=loaded.weights_fingerprint,
        )
        self.requests: dict[str, Request] = {}
        self.draining = False
        self.step_started: float | None = None  # when the step now running began (monotonic); None between steps
        self.prefill_tps = 0.0
        self.decode_step_s = 0.0
        self.step_cost = DecodeStepFit()  # what a decode step costs by batch and KV read (engine/step_cost.py)
        # output tokens per decoding request per decode step (moving average): 1 without speculative decoding
        self.tokens_per_decode_step = 0.0
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_forecast = 0.0
        self.forecast: Forecast | None = None
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self.handles: dict[str, float] = {}  # handoff handle -> monotonic expiry; blocks held as "handle:<id>"
        self._stored: list[KVEvent] = []  # device blocks registered this step: written through to the host tier
        self._staged: dict[str, Request] = {}  # waiting out of the queue while their prefix is promoted
        # keys of loads for a peer's fetch still copying into their blocks: True once released by the sender,
        # whose blocks are freed only when the copy lands (freed earlier, another request could get them and the
        # copy's hashes would be registered over that request's KV)
        self._sending: dict[str, bool] = {}
        self._promotion_keys: dict[str, str] = {}  # request -> holder of its promoted prefix until it runs
        self._swapped: set[str] = set()  # preempted requests whose blocks come back from the host tier
        self._tier_tokens: dict[str, dict[str, int]] = {}  # request -> prompt tokens promoted, by tier
        # requests another pod started (they arrived with output: a handoff's decode, a migrated stream) -> the output
        # tokens they arrived with: that pod counted their prompt lookup and first token (docs/metrics.md)
        self._continued: dict[str, int] = {}
        self.tiers = self._make_tiers(self.kv_layout.block_bytes())
        for name, path in config.lora_modules.items():
            try:
                self.add_lora(self.read_lora(name, path))
            except LoraError as exc:  # one bad adapter must not keep the base model and the others from serving
                # (under the operator a pod that died here would crash-loop; its adapter sync reports the refusal)
                log.error("LoRA adapter %r not loaded: %s", name, exc)
        self.kv.pool.on_residency = lambda kind, s: self.metrics.residency[kind].labels("device").observe(s)

    def _make_tiers(self, block_bytes: int) -> KVTiers | None:
        """The host and disk tiers the configuration asks for (docs/engine.md, "KV tiers"), or None."""
        c = self.config
        settings = TierSettings(
            host_blocks=int(c.kv_host_memory_mib * MIB // block_bytes),
            host_path=Path(c.kv_host_path or f"{HOST_TIER_DIR}/kvmesh-kv-host-{c.port}.kv"),
            disk_blocks=int(c.kv_disk_mib * MIB // block_bytes),
            disk_path=Path(c.kv_disk_path or Path.home() / ".cache" / "kvmesh" / f"kv-disk-{c.port}.kv"),
            chunk_blocks=c.kv_tier_chunk_blocks,
            profile=PROFILES[c.kv_tier_cost_profile],
        )
        if not settings.enabled:
            return None
        k = self.kv_config
        # blocks written under another model (name or weights: new weights under the same name), hashing or layout
        # must not be read back as this one's
        fingerprint = json.dumps([k.model, k.weights_fingerprint, *k.hashing(), list(self.runner.kv_cache.shape[1:]),
                                  str(self.runner.kv_cache.dtype)])
        return KVTiers(settings, self.kv, self.runner.kv_cache, fingerprint, self.events.record, self._wake.set,
                       lambda: self.prefill_tps, self.metrics)

    def make_runner(self, loaded: LoadedModel, num_blocks: int) -> ModelRunner:
        """The model runner. The engine simulator (kvmesh sim-engine) overrides it with one that sleeps per a
        latency model, so it serves with the engine's own scheduler, KV manager, metrics and events."""
        return ModelRunner(loaded.model, num_blocks, self.kv_layout, loaded.model.device, self.config.attention_backend)

    # ---- from any thread ---------------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request; its outputs arrive through `request.on_output`."""
        self._inbox.append(request)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks at the next step boundary (a client went away)."""
        self._aborts.append(request_id)
        self._wake.set()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the engine thread at the next step boundary (KV state is the engine thread's alone)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.append((fn, future))
        self._wake.set()
        return future

    def start(self) -> None:
        self.warmup()
        self._thread = threading.Thread(target=self._loop, name="kvmesh-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def close(self) -> None:
        """Stop, then finish the tier copies in flight and release the tier files (a restart reopens them)."""
        self.stop()
        if self.tiers is not None:
            self.tiers.close()
            self.events.flush()

    # ---- engine thread -----------------------------------------------------------------------------------

    def warmup(self) -> None:
        """Run the model once so the first request does not pay for lazy initialisation."""
        self.runner.run([StepInput([0], 0, [0] * min(8, self.config.block_size), True)])
        self.runner.computed_tokens = 0
        self.runner.steps = 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._run_commands()
            if not self._has_work():
                # idle: wakes for a request, or to forecast (0, forecasting at every step, must not spin a core)
                self._wake.wait(timeout=max(self.config.forecast_interval_seconds, MIN_IDLE_WAIT_SECONDS))
                self._wake.clear()
                self._run_commands()
                self._expire_handles()
                self._tier_tick()
                self._maybe_forecast()
                self._publish_state()
                continue
            try:
                self.step_started = time.monotonic()
                try:
                    out = self.step()
                finally:
                    self.step_started = None
                if not (out.scheduled or out.preempted or out.unservable):
                    # queued requests wait for blocks held outside any request: a release comes as a command,
                    # which wakes the loop, and a handle expires at its time; until then nothing can change
                    self._wake.wait(timeout=self._until_next_expiry())
                    self._wake.clear()
            except Exception:  # a bug in one step must not kill the server: fail what was running
                log.exception("engine step failed")
                for request in list(self.scheduler.running):
                    self._finish(request, "error", error="internal error while computing this request")

    def stalled_for(self) -> float | None:
        """How long the step now running has run, once past stall_timeout_seconds (a device call that never
        returns, a deadlock); None while steps progress. Read by /health and /livez from the server's thread."""
        started, limit = self.step_started, self.config.stall_timeout_seconds
        if started is None or limit <= 0 or (running := time.monotonic() - started) <= limit:
            return None
        return running

    def step_stack(self) -> str:
        """Where the engine thread is now: logged once per stalled step, so the pod log says what it hangs in."""
        frame = sys._current_frames().get(self._thread.ident) if self._thread and self._thread.ident else None
        return "".join(traceback.format_stack(frame)) if frame is not None else "(the engine thread is not running)"

    def _run_commands(self) -> None:
        while self._commands:
            fn, future = self._commands.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # the caller gets it; the engine goes on
                    future.set_exception(exc)
        self.events.flush()

    # ---- KV transfer: these run on the engine thread, through `call` ---------------------------------------

    def pin_for_send(self, hashes: list[int], handle: str | None) -> tuple[str, list[int]]:
        """Hold the longest cached run of `hashes` for a peer's fetch; (release key, block ids)."""
        if handle is not None and self.handles.get(handle, 0.0) < time.monotonic():
            raise LookupError(f"unknown or expired KV handle {handle!r}")
        key = f"send:{uuid.uuid4().hex}"
        return key, self.kv.pin_cached(key, hashes)

    def promote_for_send(self, key: str, hashes: list[int], have: int) -> concurrent.futures.Future[list[int]] | None:
        """Load the blocks of `hashes` after the first `have` (held under `key` already) that the lower tiers
        hold into device blocks held under `key` too: a peer's fetch is served from every tier. The future gives
        their ids once loaded (none if the copy failed); None when no tier holds the next block or no room."""
        if self.tiers is None:
            return None
        rest = hashes[have:]
        where = self.tiers.locate(rest)
        if not where or len(where) > self.kv.pool.num_available:
            return None
        ids = self.kv.allocate_unregistered(key, len(where))
        assert ids is not None
        loaded: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
        parent = hashes[have - 1] if have else None
        self.tiers.promote(Promotion(None, key, ids, rest[: len(where)], parent, {},
                                     on_done=lambda ok: loaded.set_result(ids if ok else [])), where)
        self._sending[key] = False
        return loaded

    def release(self, key: str) -> None:
        """Give back the blocks held under `key` (a fetch whose load is still copying: once it lands)."""
        if key in self._sending:
            self._sending[key] = True
            return
        self.kv.free(key)

    # ---- LoRA adapters (model/lora.py; docs/engine.md "LoRA adapters") ------------------------------------------

    def read_lora(self, name: str, path: str) -> LoraAdapter:
        """Read and check a PEFT adapter directory (any thread but the engine's: it reads files). Other weights
        than a name served before are fine: blocks are hashed with the weights' fingerprint. Raises LoraError."""
        if name == self.model_name:
            raise LoraError(f"{name!r} is the base model's name; give the adapter another one")
        return self.read_adapter_files(name, path)

    def read_adapter_files(self, name: str, path: str) -> LoraAdapter:
        """The adapter's files, checked against this model. The engine simulator overrides it: it runs the same
        file and key checks (model/lora.read_adapter_tensors) but not the shapes and layers, which fit the real
        model, not the simulated one, and it applies no tensor."""
        return read_adapter(name, path, self.model_config, self.config.max_lora_rank, self.dtype)

    def add_lora(self, adapter: LoraAdapter, inplace: bool = False) -> LoadedLora:
        """Serve `adapter` under its name: a free slot, filled in place (engine thread). With `inplace` a name already
        loaded takes the new weights (`_update_lora`); otherwise it is refused. Raises LoraError."""
        if inplace and adapter.name in self.loras.loaded:
            return self._update_lora(adapter)
        entry = self.loras.add(adapter)
        try:
            self.runner.model.lora.write(entry.slot, adapter)
        except BaseException:  # out of memory allocating the slots, say: the name must not point at a half slot
            self.loras.remove(entry.name)
            self.runner.model.lora.clear(entry.slot)
            raise
        self.state = dataclasses.replace(self.state, loras_loaded=len(self.loras.loaded))  # scraped at once
        log.info("LoRA adapter %r loaded from %s (rank %d, slot %d)", entry.name, entry.path, entry.rank, entry.slot)
        return entry

    def _update_lora(self, adapter: LoraAdapter) -> LoadedLora:
        """New weights under a loaded name, with no moment the name is not served: requests queued from now on run
        with them, those queued before keep the slot (and fingerprint) they were bound to until they end, when a
        retired slot is freed (`_finish`). Same weights: only the path changes. Weights a retired slot of the name
        still holds (an update undone while the earlier weights' requests run) are served from that slot again, with
        no write and no slot taken. Raises LoraConflict when the old weights are in use and no slot is free for the
        new ones."""
        current = self.loras.loaded[adapter.name]
        if current.fingerprint == adapter.fingerprint:
            return self.loras.repath(adapter.name, adapter.path)
        in_use = self._lora_slot_in_use(current.slot)
        update = self.loras.update(adapter, in_use)
        entry, old = update.new, update.old
        if not update.revived:
            try:
                self.runner.model.lora.write(entry.slot, adapter)
            except BaseException:
                self.runner.model.lora.clear(entry.slot)
                if entry.slot != old.slot:  # the earlier weights are intact in their slot: serve them on
                    self.loras.revert(update)
                else:  # they were being overwritten: the name has no whole weights left
                    self.loras.remove(entry.name)
                    self.state = dataclasses.replace(self.state, loras_loaded=len(self.loras.loaded))
                raise
        if entry.slot != old.slot and not in_use:
            self.runner.model.lora.clear(old.slot)
        log.info("LoRA adapter %r updated in place from %s (rank %d, slot %d%s; its earlier weights in slot %d %s)",
                 entry.name, entry.path, entry.rank, entry.slot, ", which still held them" if update.revived else "",
                 old.slot, "serve their running requests" if in_use else "are gone")
        return entry

    def _lora_slot_in_use(self, slot: int) -> bool:
        """Whether a queued or running request is bound to the adapter weights in `slot`."""
        return any(r.lora_slot == slot for r in self.requests.values())

    def check_lora_invariants(self) -> None:
        """The adapter slots' bookkeeping agrees with the requests bound to them (LoraRegistry.check_invariants)."""
        self.loras.check_invariants(Counter(r.lora_slot for r in self.requests.values() if r.lora_slot is not None))

    def remove_lora(self, name: str) -> LoadedLora:
        """Stop serving an adapter no request uses (engine thread). Its cached blocks are left to age out: no
        request can reach them until the same weights are loaded again (they are hashed with the weights).
        Raises LoraNotFound, or LoraConflict while requests of it run or wait (on any of its weights)."""
        busy = sum(r.extra.lora == name for r in (*self.requests.values(), *self._inbox))
        if busy and name in self.loras.loaded:
            raise LoraConflict(f"LoRA adapter {name!r} has {busy} running or queued requests; unload it when they "
                               f"finish")
        entry = self.loras.remove(name)
        self.runner.model.lora.clear(entry.slot)
        self.state = dataclasses.replace(self.state, loras_loaded=len(self.loras.loaded))
        log.info("LoRA adapter %r unloaded (slot %d)", name, entry.slot)
        return entry

    def drop_handle(self, handle: str) -> None:
        """A handoff's blocks were delivered: unpin them now rather than at expiry (they stay cached)."""
        if self.handles.pop(handle, None) is not None:
            self.kv.free(f"handle:{handle}")

    def cached_run(self, hashes: list[int]) -> int:
        """How many leading `hashes` this engine already holds (a pull fetches only the rest)."""
        for i, block_hash in enumerate(hashes):
            if self.kv.pool.lookup(block_hash) is None:
                return i
        return len(hashes)

    def hot_chains(self, limit: int) -> list[HotChain]:
        return self.kv.hot_chains(limit)

    def reserve_import(self, key: str, n: int) -> list[int] | None:
        return self.kv.allocate_unregistered(key, n)

    def finish_import(self, block_ids: list[int], hashes: list[int], parent: int | None) -> int:
        """Make pulled blocks findable (and announce them as `stored` events)."""
        return self.kv.register_filled(block_ids, hashes, parent)

    # ---- KV transfer: these touch only pinned or reserved blocks, so any thread may run them ---------------

    @property
    def vocab_size(self) -> int:
        """The token ids a request may name (stop ids, logit_bias, resumed outputs): those both the tokenizer and
        the model's logits cover (a tokenizer's added tokens may lie past the model's vocabulary)."""
        return min(self.tokenizer.vocab_size, self.model_config.vocab_size)

    @property
    def frame_layout(self) -> Layout:
        """What a KV frame's blocks must look like to be written here (a peer in another format, or whose blocks
        other weights computed, is refused)."""
        return Layout.of(self.runner.kv_cache, self.kv_config.weights_fingerprint)

    def read_frame(self, block_ids: list[int], hashes: list[int]) -> bytes:
        """A frame of pinned blocks for a peer (a cached full block never changes while pinned)."""
        return encode_frame(self.runner.kv_cache, block_ids, hashes, self.kv_config.weights_fingerprint)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Fill reserved blocks with a peer's KV: one copy for all of them."""
        self.runner.kv_cache.index_copy_(0, torch.tensor(block_ids, device=self.runner.device),
                                         data.to(self.runner.device))

    def _until_next_expiry(self) -> float:
        """Seconds until the next handle expires, at most a forecast interval (the forecast goes on meanwhile)."""
        soonest = min(self.handles.values(), default=math.inf) - time.monotonic()
        return max(MIN_IDLE_WAIT_SECONDS, min(soonest, self.config.forecast_interval_seconds))

    def _expire_handles(self) -> None:
        now = time.monotonic()
        for handle, expires in list(self.handles.items()):
            if expires < now:
                del self.handles[handle]
                self.kv.free(f"handle:{handle}")
                self.metrics.handles_expired.inc()

    def _on_kv_event(self, event: KVEvent) -> None:
        self.events.record(event)
        if event.kind == "removed":
            self.metrics.evictions.labels(event.tier, "capacity").inc(len(event.block_hashes))
        elif event.kind == "stored" and self.tiers is not None:
            self._stored.append(event)

    # ---- KV tiers: promotion before prefill, write-through, swap ------------------------------------------

    def _has_work(self) -> bool:
        """Something to compute now. Requests waiting for a promotion are not: the copy thread wakes the loop
        (`_wake`) when their blocks land, so the loop sleeps on that event instead of blocking on the copy."""
        return bool(self._inbox or self._aborts or self.scheduler.has_work())

    def _tier_tick(self) -> None:
        """Finish the tier copies done, queue the requests whose prefix arrived, write new blocks through."""
        if self.tiers is None:
            return
        for promotion in self.tiers.take_finished():
            self._promoted(promotion)
        if self._stored:
            self.tiers.write_through(self._stored)
            self._stored = []
        self.events.flush()

    def _enqueue(self, request: Request) -> None:
        """Queue a request, after loading the part of its prefix that lower tiers hold when loading it beats
        recomputing it (the copy runs while the request waits out of the queue)."""
        if not self._promote(request):
            self.scheduler.add(request)

    def _promote(self, request: Request) -> bool:
        """Start loading `request`'s prefix from the lower tiers; False when nothing is worth loading."""
        if self.tiers is None or not self.kv.enable_prefix_cache or request.cache_limit is not None:
            return False  # (a request reading its prompt's logprobs computes every position anyway)
        rid = request.request_id
        hit = self.kv.find_prefix(rid, request.token_ids, request.extra)
        chain = self.kv.prefix_hashes(rid, request.token_ids, request.extra)
        rest = chain[len(hit.blocks):]
        where, k = self.tiers.plan(rest)
        if where and request.first_scheduled_time is None:
            self.metrics.tier_decisions.labels("load" if k else "recompute").inc()
        needed = self.kv.blocks_for(request.num_tokens) - len(hit.blocks)  # promoted now, computed at admission
        if k == 0 or needed > self.kv.pool.num_available - sum(b.ref_count == 0 for b in hit.blocks):
            return False
        key = f"promote:{rid}"
        self.kv.pin_cached(key, chain[: len(hit.blocks)])  # the device part of the prefix stays while it loads
        ids = self.kv.allocate_unregistered(key, k)
        assert ids is not None, "the pool had room a moment ago"
        tokens = {tier: where[:k].count(tier) * self.config.block_size for tier in LOWER_TIERS}
        parent = chain[len(hit.blocks) - 1] if hit.blocks else None
        self.tiers.promote(Promotion(rid, key, ids, rest[:k], parent, tokens), where[:k])
        self._staged[rid] = request
        request.expected_cached_tokens = (len(hit.blocks) + k) * self.config.block_size
        return True

    def _promoted(self, p: Promotion) -> None:
        if p.ok:
            self.kv.register_filled(p.block_ids, p.hashes, p.parent)
        if p.on_done is not None:  # loaded for a peer's fetch: the sender releases the blocks when sent
            p.on_done(p.ok)
            if self._sending.pop(p.key, False):  # the sender gave up (timed out, its peer left) while it loaded
                self.kv.free(p.key)
            return
        request = self._staged.pop(p.request_id or "", None)
        if request is None or not p.ok:  # aborted meanwhile (the blocks stay cached), or the copy failed
            self.kv.free(p.key)
            if request is not None:
                self.scheduler.add(request)
            return
        if request.first_scheduled_time is None:
            self._tier_tokens[request.request_id] = p.tokens_by_tier
        self._promotion_keys[request.request_id] = p.key
        self.scheduler.add(request)

    def _release_promotions(self) -> None:
        """A request that runs holds its prefix itself: the promotion's hold on it goes."""
        for rid, key in list(self._promotion_keys.items()):
            request = self.requests.get(rid)
            if request is None or request.status is not Status.WAITING:
                self.kv.free(key)
                del self._promotion_keys[rid]

    def _preemption_mode(self, request: Request) -> str:
        """Swap if loading the preempted request's blocks back from the host tier (where write-through has
        put them) will beat recomputing them, by the same costs as promotion; else recompute."""
        if self.tiers is None or "host" not in self.tiers.tiers or not self.kv.enable_prefix_cache \
                or request.cache_limit is not None:  # one reading its prompt's logprobs is never loaded back
            return "recompute"
        chain = self.kv.prefix_hashes(request.request_id, request.token_ids, request.extra)
        if self.tiers.plan(chain)[1] == 0:
            return "recompute"
        self._swapped.add(request.request_id)
        return "swap"

    def _swap_in(self) -> None:
        """Swapped requests whose blocks have left the device load them back while they wait."""
        for rid in list(self._swapped):
            request = self.requests.get(rid)
            if request is None or request.status is not Status.WAITING or rid in self._staged:
                self._swapped.discard(rid)
                continue
            if request in self.scheduler.waiting and self._promote(request):
                self.scheduler.waiting.remove(request)
                self._swapped.discard(rid)

    def _take_inbox(self) -> None:
        while self._inbox:
            request = self._inbox.popleft()
            self.requests[request.request_id] = request
            if request.output_ids:
                self._continued[request.request_id] = len(request.output_ids)
            if request.extra.lora is not None:
                adapter = self.loras.loaded.get(request.extra.lora)
                if adapter is None:
                    self._finish(request, "error", error=f"LoRA adapter {request.extra.lora!r} was unloaded before "
                                                         f"this request started", error_code=MODEL_NOT_FOUND)
                    continue
                # bound for good to the weights loaded now (new weights may have been loaded under the name since the
                # HTTP edge read it, or may be while it runs): it runs with them and its blocks are hashed with them,
                # so no other weights' cached blocks can match
                request.lora_slot = adapter.slot
                request.extra = dataclasses.replace(request.extra, lora_fingerprint=adapter.fingerprint)
            try:
                request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_ids,
                                                             request.params.skip_special_tokens)
                if request.output_ids:  # the client has their text, but for a tail a stop string may still take
                    request.text = request.detokenizer.step(request.output_ids)
                    request.emitted_text = request.text[: sendable_length(request.text, 0, request.params.stop,
                                                                          request.params.include_stop_str_in_output)]
                if request.guide is not None and request.guide.finished:  # resumed after its complete output
                    self._finish(request, "stop")  # as the first pod ended it, without a step for an EOS
                    continue
                request.expected_cached_tokens = self.kv.find_prefix(request.request_id, request.token_ids,
                                                                     request.extra).capped(request.cache_limit).num_tokens
                self._enqueue(request)
            except Exception:  # a bug queuing one request must end it with an error, not leave its client waiting
                log.exception("could not queue request %s", request.request_id)
                self._finish(request, "error", error="internal error while queuing this request")
        while self._aborts:
            request_id = self._aborts.popleft()
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, "abort")
            elif any(r.request_id == request_id for r in self._inbox):
                self._aborts.append(request_id)  # submitted after the inbox was read: abort it next step
                break

    def step(self) -> SchedulerOutput:
        """One scheduling decision and one model step."""
        started = time.perf_counter()
        self._run_commands()
        self._expire_handles()
        self._take_inbox()
        self._tier_tick()
        self._swap_in()
        out = self.scheduler.schedule(self._propose_drafts())
        for request in out.unservable:
            self._finish(request, "length", error="the request does not fit in this engine's KV cache")
        if out.preempted:
            self.metrics.preemptions.labels(self.model_name).inc(len(out.preempted))
            for request in out.preempted:
                self.metrics.preemptions_by_mode.labels(self._preemption_mode(request)).inc()
        for request in out.admitted:
            self._on_admitted(request)
        self._release_promotions()
        if out.scheduled:
            decode = _decode_shape(out)
            self._run(out)
            if decode is not None:  # the whole step, as its sequences wait between tokens
                self.step_cost.add(*decode, time.perf_counter() - started)
        self._publish()
        return out

    def _on_admitted(self, request: Request) -> None:
        m = self.metrics
        prompt = len(request.prompt_ids)
        promoted = self._tier_tokens.pop(request.request_id, {})
        left = request.cached_tokens
        for tier in LOWER_TIERS:  # a promoted prefix is part of the hit (unless a shorter one was taken)
            request.cached_by_tier[tier] = min(promoted.get(tier, 0), left)
            left -= request.cached_by_tier[tier]
        if self.tiers is not None and request.num_computed_tokens:
            chain = self.kv.prefix_hashes(request.request_id, request.token_ids, request.extra)
            self.tiers.on_hit(chain, request.num_computed_tokens // self.config.block_size, self.config.hash_root)
        if request.request_id in self._continued:
            # the pod that started it looked its prompt up and answered the client its cached_tokens: counted here
            # too, a handoff's pulled blocks read as hits of a cache that served no client (docs/metrics.md)
            m.continued_prompt_tokens.inc(prompt)
            m.continued_cached_tokens.inc(request.cached_tokens)
        else:
            m.prefix_queries.labels(self.model_name).inc(prompt)
            m.prefix_hits.labels(self.model_name).inc(request.cached_tokens)
            m.query_tokens.inc(prompt)
            for tier in LOWER_TIERS:
                m.hit_tokens.labels(tier).inc(request.cached_by_tier[tier])
            m.hit_tokens.labels("device").inc(left)
            m.hit_length.observe(request.cached_tokens)
            if prompt < self.config.block_size:
                m.short_queries.inc()
        m.prompt_tokens.labels(self.model_name).inc(prompt)  # per pod: the operator sizes a role by what it holds
        m.queue_time.observe(time.monotonic() - request.arrival_time)
        if request.import_key is not None:  # the request now holds the pulled blocks itself
            request.peer_tokens = min(request.peer_tokens, request.cached_tokens)
            self.kv.free(request.import_key)
            request.import_key = None

    def _propose_drafts(self) -> dict[str, list[int]]:
        """Speculative decoding: n-gram drafts, by request id, for each decoding request that may speculate (every
        one but those with a structured-output constraint, whose matcher would have to run ahead of verification),
        never more than its max_tokens or the context can take. The scheduler gives them only what is left of the
        step; they are this step's alone (a draft not scheduled is proposed afresh next step)."""
        spec = self.spec
        drafts: dict[str, list[int]] = {}
        if spec is None:
            return drafts
        for r in self.scheduler.running:
            k = min(spec.num_speculative_tokens, r.remaining_tokens - 1, self.max_model_len - r.num_tokens - 1)
            if r.guide is not None or r.num_computed_tokens != r.num_tokens - 1 or k < 1:
                continue
            history = self._histories.setdefault(r.request_id, TokenHistory())
            history.sync(r.prompt_ids, r.output_ids)
            if proposed := propose(history.tokens, k, spec.prompt_lookup_min, spec.prompt_lookup_max):
                drafts[r.request_id] = proposed
        return drafts

    def _run(self, out: SchedulerOutput) -> None:
        inputs, prompt_rows, samples = [], [], []
        for s in out.scheduled:
            r = s.request
            start = r.num_computed_tokens
            known = s.num_new_tokens - len(s.draft_ids)
            # positions whose logits give prompt logprobs (echo): all of the chunk's from the first, the last included
            reads = r.prompt_logprob_positions(start, start + known)
            prompt_rows.append(reads)
            samples.append(start + known == r.num_tokens)  # the step reaches the request's last token
            inputs.append(
                StepInput(
                    self.kv.block_ids(r.request_id),
                    start,
                    r.token_slice(start, start + known) + list(s.draft_ids),
                    wants_logits=samples[-1] or bool(reads),
                    lora_slot=r.lora_slot,
                    num_logits=start + known - reads.start if reads else 1 + len(s.draft_ids),
                    # greedy over logits the sampler changes, and prompt logprobs: exact ones (model/head.py
                    # approximates away from the top)
                    exact_logits=bool(reads) or (r.params.greedy and (
                        r.guide is not None or r.params.adjusts_logits or r.num_generated < r.params.min_tokens)),
                )
            )
        result = self.runner.run(inputs)
        rows = sum(i.num_logits for i in inputs if i.wants_logits)
        if result.logits.shape[0] != rows:
            raise RuntimeError(f"{type(self.runner).__name__} returned {result.logits.shape[0]} logits rows for "
                               f"{rows} positions that want them (StepInput.num_logits rows per sequence)")
        sampling, logits, prompt_only = self._split_logits(out, inputs, prompt_rows, samples, result.logits)
        prefill_tokens = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens - len(s.draft_ids) > 1)
        generated_before = sum(s.request.num_generated for s in sampling)
        if prefill_tokens:
            self.prefill_tps = _ema(self.prefill_tps, prefill_tokens / result.seconds)
        else:
            self.decode_step_s = _ema(self.decode_step_s, result.seconds)
        self.metrics.batch_size.observe(len(out.scheduled))
        self.metrics.steps.inc()
        self.metrics.computed_tokens.inc(result.num_tokens)
        for s in out.scheduled:  # drafts' KV is not counted (nor committed) until they are accepted
            r = s.request
            r.num_computed_tokens += s.num_new_tokens - len(s.draft_ids)
            self._commit(r)
        for r in prompt_only:  # max_tokens 0 (echo): the prompt's logprobs were the answer
            self._finish(r, "length")
        if not sampling:
            return
        # one row per position that wants logits: a request with k drafts has k + 1, each sampled as if the drafts
        # before it were already output (its output index, min_tokens and penalties see them)
        guides, params, indices, generated, prompts = [], [], [], [], []
        for s in sampling:
            r = s.request
            penalized = bool(r.params.presence_penalty or r.params.frequency_penalty or r.params.penalizes_repeats)
            if r.params.penalizes_repeats and r.prompt_vocabulary is None:
                r.prompt_vocabulary = prompt_vocabulary(r.prompt_ids)
            for i in range(len(s.draft_ids) + 1):
                guides.append(r.guide)
                params.append(r.params)
                indices.append(r.num_generated + i)
                # the tokens penalties count (copied only for a request that has penalties and drafts before)
                generated.append(r.output_ids + list(s.draft_ids[:i]) if i and penalized else r.output_ids)
                prompts.append(r.prompt_vocabulary)
        masks = self.structured.masks(guides)  # None, at no cost, when nothing is constrained
        samples = sample(logits, params, indices, self.tokenizer.eos_token_ids, generated, masks, prompts,
                         self.config.logprobs_mode)
        now = time.monotonic()
        row = 0
        for s in sampling:
            r, first = s.request, row
            row += len(s.draft_ids) + 1
            if s.draft_ids:
                self._append_verified(s, accept(s.draft_ids, samples.token_ids[first:row]), samples, first, now)
                continue
            if r.guide is not None and (failed := self._guide_failed(r, samples.token_ids[first], masks, first)):
                self._finish(r, "error", error=f"structured output failed: {failed}")
                continue
            logprob, top = _asked_logprobs(r, samples, first)
            self._observe_output_step(r, now)
            self._append_token(r, samples.token_ids[first], logprob, top)
        if not prefill_tokens:
            made = sum(s.request.num_generated for s in sampling) - generated_before
            self.tokens_per_decode_step = _ema(self.tokens_per_decode_step, made / len(sampling))

    def _split_logits(self, out: SchedulerOutput, inputs: list[StepInput], prompt_rows: list[range],
                      samples: list[bool], logits: torch.Tensor
                      ) -> tuple[list[ScheduledRequest], torch.Tensor, list[Request]]:
        """Read the prompt logprobs rows of a step's logits into their requests; return the scheduled requests that
        sample, their rows (the logits themselves when no request read its prompt), and the requests whose prompt
        ended with max_tokens 0 (nothing to sample)."""
        sampling, kept, prompt_only = [], [], []
        row = 0
        for s, i, reads, last in zip(out.scheduled, inputs, prompt_rows, samples, strict=True):
            if not i.wants_logits:
                continue
            r, own = s.request, logits[row : row + i.num_logits]
            row += i.num_logits
            if reads:
                record = r.prompt_logprobs
                assert record is not None and reads.start == record.positions_done, "prompt rows read in order"
                lps, tops = token_logprobs(own[: len(reads)], r.prompt_ids[reads.start + 1 : reads.stop + 1],
                                           r.params.prompt_logprobs or 0, self.config.logprobs_mode)
                record.logprobs += lps
                record.top_logprobs += tops
            if last:
                if r.params.max_tokens == 0:
                    prompt_only.append(r)
                    continue
                sampling.append(s)
                kept.append(own[own.shape[0] - 1 - len(s.draft_ids):])
        if not any(prompt_rows):
            return sampling, logits, prompt_only
        return sampling, torch.cat(kept) if kept else logits[:0], prompt_only

    def _commit(self, r: Request) -> None:
        """Register the blocks a request's computed tokens filled in the prefix cache (building its token list only
        when one did: at 32k tokens a copy costs about 50 us)."""
        if self.kv.fills_block(r.request_id, r.num_computed_tokens):
            self.kv.commit(r.request_id, r.token_ids, r.num_computed_tokens, r.extra)

    def _append_verified(self, s: ScheduledRequest, verdict: Verdict, samples: SampleResult, first: int,
                         now: float) -> None:
        """Append a draft run's accepted tokens and the model's own token after them, one at a time (a stop string,
        a stop token or max_tokens may end the request inside the run: the tokens after it are dropped). The KV
        of rejected drafts is rolled back, and each accepted token's KV is counted only as the token is appended;
        a block it fills is committed to the prefix cache then, before a stop later in the run can end the
        request (so only verified tokens are ever committed, and no committed block is lost)."""
        r, m = s.request, self.metrics
        m.spec_drafts.labels(self.model_name).inc()
        m.spec_draft_tokens.labels(self.model_name).inc(len(s.draft_ids))
        m.spec_accepted_tokens.labels(self.model_name).inc(verdict.num_accepted)
        for position in range(verdict.num_accepted):
            m.spec_accepted_per_pos.labels(self.model_name, str(position)).inc()
        self.kv.truncate(r.request_id, r.num_computed_tokens + verdict.num_accepted)
        self._observe_output_step(r, now)
        for i, token in enumerate(verdict.token_ids):
            if i:  # the token before this one was an accepted draft: its KV was computed this step
                r.num_computed_tokens += 1
                self._commit(r)
            logprob, top = _asked_logprobs(r, samples, first + i)
            self._append_token(r, token, logprob, top)
            if r.status is Status.FINISHED:
                return

    @staticmethod
    def _guide_failed(r: Request, token: int, masks: Masks | None, row: int) -> str | None:
        """Feed a constrained request's sampled token to its matcher; why it failed (a limit hit computing the mask,
        a refused token), or None. A failure ends that request alone."""
        assert masks is not None and r.guide is not None
        if row in masks.failed:
            return masks.failed[row]
        try:
            r.guide.consume([token])
        except StructuredError as exc:
            return str(exc)
        return None

    def _observe_output_step(self, r: Request, now: float) -> None:
        """Latency, once per request per step that outputs tokens: time to first token at its first, then
        vllm:inter_token_latency_seconds as the time since its previous output step (as vLLM observes it), so a
        step that outputs a run of verified drafts is one gap, not one gap and near-zero ones. A request another pod
        started had its first token there: its first step here is the gap since it arrived, an inter-token one."""
        m = self.metrics
        if r.first_token_time is None:
            r.first_token_time = now
            if r.request_id in self._continued:
                m.itl.labels(self.model_name).observe(now - r.arrival_time)
            else:
                m.ttft.labels(self.model_name).observe(now - r.arrival_time)
                if r.first_scheduled_time is not None:
                    m.prefill_time.observe(now - r.first_scheduled_time)
        elif r.last_token_time is not None:
            m.itl.labels(self.model_name).observe(now - r.last_token_time)
        r.last_token_time = now

    def _append_token(self, r: Request, token: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        m = self.metrics
        r.output_ids.append(token)
        m.generation_tokens.labels(self.model_name).inc()
        p = r.params
        finish = None
        is_stop_token = (token in self.tokenizer.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        before = len(r.text)
        if is_stop_token:
            finish = "stop"
            if p.include_stop_str_in_output:  # vLLM's: the stop token's text too (none for a skipped special one)
                r.text += r.detokenizer.step([token])
            r.text += r.detokenizer.flush()  # the output ends here: nothing will complete a held-back character
        else:
            r.text += r.detokenizer.step([token])
        sendable = len(r.text)
        # A stop string ends the output only in a token after the first min_tokens, as a stop token does (those are
        # masked for the first min_tokens), and only where it ends in this token's text: one completed within the
        # first min_tokens stays in the output (vLLM's rule), though it may be held back yet. The earliest match
        # wins; with include_stop_str_in_output the output ends after it instead of before. A tail that could begin
        # a stop string is held back unless that flag is set (protocol.sendable_length: a pod resuming the request
        # and the router sending a disaggregated first token split the text the same way).
        stops = p.stop if r.num_generated > p.min_tokens else []
        hits = [(at, at + len(stop)) for stop in stops
                if (at := r.text.find(stop, max(0, before - len(stop) + 1))) >= 0]
        if hits:
            start, end = min(hits)
            r.text = r.text[: end if p.include_stop_str_in_output else start]
            sendable = len(r.text)
            finish = "stop"
        if finish is None and r.guide is not None and r.guide.finished:  # complete: only EOS could follow
            finish = "stop"
            r.text += r.detokenizer.flush()
            sendable = len(r.text)
        if finish is None:
            if r.num_generated >= p.max_tokens or r.num_tokens >= self.max_model_len:
                finish = "length"
                if r.handoff_ttl is None:  # a prefill for another pod leaves a half character to the pod going on
                    r.text += r.detokenizer.flush()  # a half character no later token will complete
                sendable = len(r.text)
            else:
                sendable = sendable_length(r.text, len(r.emitted_text), p.stop, p.include_stop_str_in_output)
        delta = r.text[len(r.emitted_text) : sendable]
        r.emitted_text += delta
        if finish is None:
            self._emit(r, RequestOutput(r.request_id, [token], delta, _one(logprob), _one(top)))
        else:
            self._finish(r, finish, last=([token], delta, logprob, top))

    def _finish(
        self,
        r: Request,
        reason: str,
        error: str | None = None,
        last: tuple[list[int], str, float | None, list[tuple[int, float]] | None] | None = None,
        error_code: str | None = None,
    ) -> None:
        if r.status is Status.FINISHED:
            return
        if r.import_key is not None:
            self.kv.free(r.import_key)
        self._staged.pop(r.request_id, None)  # its promotion still lands; its blocks stay cached
        self._tier_tokens.pop(r.request_id, None)
        self._swapped.discard(r.request_id)
        self._histories.pop(r.request_id, None)
        resumed = self._continued.pop(r.request_id, None)  # output tokens it arrived with; None: it started here
        handoff = None
        # a handoff keeps the request's blocks; one finished as it arrived (a constraint already complete) has none
        kept = r.handoff_ttl is not None and r.request_id in self.kv.seqs
        if kept and reason in ("stop", "length") and error is None:
            handle = uuid.uuid4().hex
            self.kv.rename(r.request_id, f"handle:{handle}")  # the blocks outlive the request, until pulled
            self.handles[handle] = time.monotonic() + r.handoff_ttl
            handoff = {"handle": handle, "expires_at": time.time() + r.handoff_ttl,
                       "num_blocks": len(self.kv.seqs[f"handle:{handle}"].blocks)}
        self.scheduler.remove(r)
        self.requests.pop(r.request_id, None)
        slot = r.lora_slot
        if slot is not None and slot in self.loras.retired and not self._lora_slot_in_use(slot):
            self.runner.model.lora.clear(slot)  # the last request on an adapter's earlier weights ended
            self.loras.release(slot)
        r.finish_reason = reason
        now = time.monotonic()
        m = self.metrics
        m.requests.labels(reason if reason in ("stop", "length", "abort") else "error").inc()
        if reason in ("stop", "length") and error is None:
            self.lengths.observe(r.workload, r.num_generated)
        # a prefill handed off at its length goes on on a decode pod, where the client's request ends and is timed
        if reason in ("stop", "length") and error is None and not (handoff is not None and reason == "length"):
            m.e2e.labels(self.model_name).observe(now - r.arrival_time)
            m.request_generation_tokens.labels(self.model_name).observe(r.num_generated)
            # decoding began at its first token, or for a request continued here (its first token sent by the pod
            # that started it) at its arrival
            decoding_since = r.first_token_time if resumed is None else r.arrival_time
            if decoding_since is not None:
                m.decode_time.observe(now - decoding_since)
                after_first = r.num_generated - (1 if resumed is None else resumed)
                if after_first > 0:
                    m.tpot.observe((now - decoding_since) / after_first)
        tokens, text, logprob, top = last or ([], "", None, None)
        self._emit(
            r,
            RequestOutput(
                r.request_id,
                tokens,
                text,
                _one(logprob),
                _one(top),
                finish_reason=reason,
                error=error,
                error_code=error_code,
                prompt_tokens=len(r.prompt_ids),
                cached_tokens=r.cached_tokens,
                completion_tokens=r.num_generated,
                peer_tokens=r.peer_tokens,
                cached_by_tier=dict(r.cached_by_tier),
                kv_transfer=handoff,
            ),
        )

    def _emit(self, r: Request, output: RequestOutput) -> None:
        record = r.prompt_logprobs
        if record is not None and not record.sent and record.positions_done == len(r.prompt_ids) - 1:
            output.prompt_logprobs, record.sent = record, True  # with the first output after the whole prompt
        if r.on_output is not None:
            try:
                r.on_output(output)
            except Exception:  # a broken consumer loses its own stream, nothing else
                log.exception("output callback of %s failed", r.request_id)

    def _publish(self) -> None:
        self._tier_tick()
        self.events.flush()
        self._maybe_forecast()
        self._publish_state()

    def _publish_state(self) -> None:
        waiting = (*self.scheduler.waiting, *self._staged.values())
        pending = sum(self._pending_prefill(r) for r in (*waiting, *self.scheduler.running))
        self.state = EngineState(
            running=len(self.scheduler.running),
            waiting=len(waiting),
            kv=self.kv.stats(),
            pending_prefill_tokens=pending,
            prefill_tokens_per_second=self.prefill_tps,
            decode_step_seconds=self.decode_step_s,
            decode_step_cost=self.step_cost.cost(),
            forecast=self.forecast,
            events_seq=self.events.seq,
            draining=self.draining,
            pinned_blocks=sum(len(s.blocks) for k, s in self.kv.seqs.items() if k.startswith(PIN_PREFIXES)),
            tiers=self.tiers.counts() if self.tiers is not None else {},
            lora_running=_adapters(self.scheduler.running),
            lora_waiting=_adapters(waiting),
            loras_loaded=len(self.loras.loaded),
            max_loras=self.config.max_loras,
            lora_updated=time.time(),
        )

    def _pending_prefill(self, r: Request) -> int:
        """Prompt tokens still to compute: a waiting request's uncached part (estimated at arrival), a running
        one's unfinished prefill, nothing for a decoding one."""
        if r.status is Status.WAITING:
            return max(r.num_tokens - max(r.num_computed_tokens, r.expected_cached_tokens), 0)
        return r.num_tokens - r.num_computed_tokens if r.is_prefilling else 0

    def _held_tokens(self, r: Request) -> int:
        """Tokens of KV a request holds alone: a block shared by k requests counts 1/k for each."""
        blocks = self.kv.seqs.get(r.request_id)
        if blocks is None or not blocks.blocks:
            return r.num_tokens
        shared = sum(1 - 1 / b.ref_count for b in blocks.blocks if b.ref_count > 1)
        return max(int(r.num_tokens - shared * self.config.block_size), 1)

    def _maybe_forecast(self) -> None:
        now = time.monotonic()
        if now - self._last_forecast < self.config.forecast_interval_seconds:
            return
        self._last_forecast = now
        loads = [
            RequestLoad(
                context_tokens=self._held_tokens(r),
                generated_tokens=r.num_generated,
                max_tokens=r.params.max_tokens,
                workload=r.workload,
                pending_prefill_tokens=min(self._pending_prefill(r), self._held_tokens(r)),
            )
            for r in (*self.scheduler.running, *self.scheduler.waiting, *self._staged.values())
        ]
        self.forecast = forecast_usage(
            loads,
            self.kv.pool.num_blocks,
            self.config.block_size,
            self.config.forecast_horizon_seconds,
            # the time a request takes per output token: a step outputs several under speculative decoding
            (self.decode_step_s or 0.05) / (self.tokens_per_decode_step or 1.0),
            self.prefill_tps or 1000.0,
            self.lengths,
            pinned_blocks=self._pinned_share(),
        )
        self.state = dataclasses.replace(self.state, forecast=self.forecast)

    def _pinned_share(self) -> float:
        """Blocks that handles and peers' fetches hold, a block shared with k holders counted 1/k (the requests
        sharing it count the rest). Imports and promotions are not: they hold a queued request's prefix, which
        that request's load counts."""
        return sum(1 / b.ref_count for key, seq in self.kv.seqs.items() if key.startswith(TRANSIENT_PINS)
                   for b in seq.blocks)

    # ---- synchronous use (tests, benchmarks) ---------------------------------------------------------------

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Step in the calling thread until every queued request finished. Not with `start()`."""
        for _ in range(max_steps):
            if not self._has_work():
                if self._staged:  # nothing to compute until a promotion lands
                    self.tiers.wait()  # type: ignore[union-attr]
                    self._tier_tick()
                    continue
                if self.tiers is not None and (self.tiers.busy or self._stored):
                    self.tiers.drain()  # settle the copies too, so the state a test reads is final
                    self._tier_tick()
                    continue
                return
            self.step()
        raise RuntimeError("requests still pending after max_steps")


def _decode_shape(out: SchedulerOutput) -> tuple[int, int] | None:
    """(sequences, KV tokens they attend to) of a step that only decodes; None when a prompt chunk is in it."""
    if any(s.num_new_tokens - len(s.draft_ids) > 1 for s in out.scheduled):
        return None
    return len(out.scheduled), sum(s.request.num_computed_tokens + s.num_new_tokens for s in out.scheduled)


def _ema(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - EMA) * old + EMA * new


def _adapters(requests: Iterable[Request]) -> tuple[str, ...]:
    """The LoRA adapters these requests run with, each once, sorted."""
    return tuple(sorted({r.extra.lora for r in requests if r.extra.lora is not None}))


def _one(value):
    return None if value is None else [value]
