"""Engine configuration: defaults, the `engine` section of a YAML config file, and flag overrides.

The operator mounts a ConfigMap holding the `engine` section of an InferencePool spec; `kvmesh serve --config
FILE` reads it, and flags given on the command line win over the file (docs/contracts.md, contract 0).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.engine.body_deadline import DEFAULT_BODY_READ_TIMEOUT_SECONDS, check_body_read_timeout
from kvmesh.engine.protocol import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HASH_ROOT,
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    DEFAULT_MAX_NUM_SEQS,
    KV_CACHE_DTYPES,
    LORA_NAME_PATTERN,
    QUANTIZATIONS,
    ROLES,
    HashAlgo,
)
from kvmesh.engine.typed_fields import check_port, check_types, read_settings_file

MIB = 1 << 20
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")  # see engine/attention.py
QUEUE_POLICIES: tuple[str, ...] = ("fcfs", "prefix")  # see engine/scheduler.py
# vLLM's logprobs_mode values: what a request's logprobs report (engine/sampling.py's sample and token_logprobs)
DEFAULT_LOGPROBS_MODE = "raw_logprobs"
LOGPROBS_MODES: tuple[str, ...] = (DEFAULT_LOGPROBS_MODE, "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class EngineConfig:
    """Everything `kvmesh serve` can be told. Field names are the YAML keys (with dashes or underscores)."""

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"  # auto: bf16 on CUDA and on CPUs with bf16 units, else fp32 (engine.pick_dtype)
    device: str = "auto"
    quantization: str = "none"  # or int8: int8 weights, dynamic int8 activations (CPU; about 2x faster)
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE  # or int8: 1.9x the blocks of bf16 in a budget (engine/kvcache.py)
    kv_cache_memory_mib: int = 512  # modest: several engines share one machine in tests and local clusters
    kv_cache_blocks: int | None = None  # an exact block count instead of a memory budget (tests, simulators)
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_cache: bool = True
    eviction_policy: str = "lru"  # or reuse: by reuse probability per workload class (engine/kv/policy.py)
    queue_policy: str = "fcfs"  # or prefix: longest cached prefix first (engine/scheduler.py)
    max_queue_delay_seconds: float = 5.0  # prefix queue: a request waiting this long goes first, in arrival order
    hash_algo: str = HashAlgo.XXH3.value
    hash_root: int = DEFAULT_HASH_ROOT
    role: str = "both"
    forecast_horizon_seconds: float = 10.0
    forecast_interval_seconds: float = 0.5
    kv_events_buffer: int = 10000  # event batches kept for resuming readers
    handoff_ttl_seconds: float = 30.0  # how long a prefill's KV stays pinned for its decode pod
    transfer_timeout_seconds: float = 10.0  # a pull slower than this is abandoned: the request recomputes
    transfer_frame_blocks: int = 8  # blocks per frame served to a peer: measured best here (docs/benchmarks.md)
    kv_host_memory_mib: float = 0  # host KV tier (engine/kv/tiers.py), a file in shared memory; 0: off
    kv_host_path: str | None = None  # None: /dev/shm/kvmesh-kv-host-<port>.kv (a restarted process finds it)
    kv_disk_mib: float = 0  # disk KV tier: only blocks hit again are written (write-through-selective); 0: off
    kv_disk_path: str | None = None  # None: ~/.cache/kvmesh/kv-disk-<port>.kv (survives a full restart)
    kv_tier_chunk_blocks: int = 16  # blocks per copy between tiers: where MB/s flattens here (docs/benchmarks.md)
    kv_tier_cost_profile: str = "measured"  # load-or-recompute costs: measured, or gpu (engine/kv/tiers.py)
    threads: int | None = None  # torch intra-op threads; None: torch's default
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU (engine/attention.py, docs/kernels.md)
    # > 0: after the model loads, /health says "warming" (503) until the first warm-up (POST /v1/kv/warm) ends,
    # POST /v1/admin/ready, or this many seconds, so a new pod joins Services and routers warm (issue 5)
    warmup_grace_seconds: float = 0.0
    # a request's whole body must arrive within this long, or it is answered 408 and closed (engine/body_deadline.py)
    body_read_timeout_seconds: float = DEFAULT_BODY_READ_TIMEOUT_SECONDS
    # a step running longer than this is a stalled engine: /health and /livez say "stalled" (503); 0: never
    stall_timeout_seconds: float = 60.0
    # LoRA adapters served at start, name -> PEFT directory (more load at run time: POST /v1/load_lora_adapter)
    lora_modules: dict[str, str] = dataclasses.field(default_factory=dict)
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK  # adapters of a larger rank are refused
    max_loras: int = DEFAULT_MAX_LORAS  # adapters loaded at once: the slots model/lora.py allocates at the first load
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP traces URL (engine/tracing.py); None: the OTEL_* env
    # speculative decoding, vLLM's shape: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    # "prompt_lookup_max": b}, a mapping or its JSON text (engine/spec.py); None: off
    speculative_config: dict[str, Any] | str | None = None
    # what logprobs report, vLLM's setting: raw_* the model's own distribution, processed_* the one sampled from
    # (after a constraint's mask, logit_bias, penalties, min_tokens, temperature, min_p, top_k and top_p); *_logprobs
    # log-probabilities, *_logits the logits themselves. Prompt logprobs (echo) pass no sampler: raw and processed
    # report the same there
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE

    def validate(self) -> None:
        check_types(self, "engine")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory_mib < 1:
            raise ValueError("kv_cache_memory_mib must be at least 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        check_port(self.port)
        if self.max_model_len is not None and self.max_model_len < 2:  # a prompt token and one to generate
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.forecast_interval_seconds < 0:
            raise ValueError(f"forecast_interval_seconds must be >= 0 (0: at every step), got "
                             f"{self.forecast_interval_seconds}")
        if self.role not in ROLES or self.role == "router":
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.max_lora_rank < 1 or self.max_loras < 1:
            raise ValueError(f"max_lora_rank and max_loras must be at least 1, got {self.max_lora_rank}, "
                             f"{self.max_loras}")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"{len(self.lora_modules)} lora_modules but max_loras is {self.max_loras}")
        if self.otlp_traces_endpoint:
            from kvmesh.engine.tracing import check_endpoint

            check_endpoint(self.otlp_traces_endpoint)
        if self.warmup_grace_seconds < 0:
            raise ValueError(f"warmup_grace_seconds must be >= 0, got {self.warmup_grace_seconds}")
        check_body_read_timeout(self.body_read_timeout_seconds)
        if self.stall_timeout_seconds < 0:
            raise ValueError(f"stall_timeout_seconds must be >= 0 (0: off), got {self.stall_timeout_seconds}")
        if self.kv_host_memory_mib < 0 or self.kv_disk_mib < 0 or self.kv_tier_chunk_blocks < 1:
            raise ValueError("kv_host_memory_mib and kv_disk_mib must be >= 0, kv_tier_chunk_blocks >= 1")
        from kvmesh.engine.kv.costs import PROFILES

        if self.kv_tier_cost_profile not in PROFILES:
            raise ValueError(f"kv_tier_cost_profile must be one of {', '.join(PROFILES)}, "
                             f"got {self.kv_tier_cost_profile!r}")
        from kvmesh.engine.kv.policy import POLICIES

        if self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(POLICIES)}, got {self.eviction_policy!r}")
        if self.queue_policy not in QUEUE_POLICIES or self.max_queue_delay_seconds < 0:
            raise ValueError(f"queue_policy must be one of {', '.join(QUEUE_POLICIES)} and max_queue_delay_seconds "
                             f">= 0, got {self.queue_policy!r}, {self.max_queue_delay_seconds}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        HashAlgo(self.hash_algo)
        from kvmesh.engine.spec import SpecConfig

        SpecConfig.parse(self.speculative_config)


def _normalize(raw: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in names:
            raise ValueError(f"unknown engine setting {key!r}; known: {', '.join(sorted(names))}")
        out[name] = value
    return out


def parse_lora_modules(value: Any) -> dict[str, str]:
    """`lora_modules` as a mapping of name to directory, from a mapping or from vLLM's list of `name=path`
    strings (the CLI's `--lora-modules a=/x b=/y`; a YAML list works too)."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list | tuple):
        items = []
        for entry in value:
            name, sep, path = str(entry).partition("=")
            if not sep:
                raise ValueError(f"lora_modules entry {entry!r} is not name=path")
            items.append((name, path))
    else:
        raise ValueError(f"lora_modules must be a mapping of name to path or a list of name=path, got {value!r}")
    out: dict[str, str] = {}
    for name, path in items:
        if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
            raise ValueError(f"lora_modules: name and path must be non-empty strings, got {name!r}: {path!r}")
        name, path = name.strip(), path.strip()
        if not re.fullmatch(LORA_NAME_PATTERN, name):
            raise ValueError(f"lora_modules: {name!r} is not an adapter name (letters, digits and . _ / : -, "
                             f"starting with a letter or digit, at most 128)")
        if name in out:
            raise ValueError(f"lora_modules names {name!r} twice")
        out[name] = path
    return out


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> EngineConfig:
    """Defaults, then the file's `engine` section (or the whole file if it has none), then `overrides`
    (flags the user gave; None values mean "not given")."""
    values: dict[str, Any] = {}
    if path is not None:
        data = read_settings_file(path) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping with an `engine` section")
        section = data.get("engine", data)
        if not isinstance(section, dict):
            raise ValueError(f"{path}: the `engine` section must be a mapping")
        values.update(_normalize(section))
    values.update(_normalize({k: v for k, v in (overrides or {}).items() if v is not None}))
    if "lora_modules" in values:
        values["lora_modules"] = parse_lora_modules(values["lora_modules"])
    config = EngineConfig(**values)
    config.validate()
    return config
