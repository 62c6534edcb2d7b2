"""`kvmesh sim-engine`: the engine with its model replaced by a latency model, for many pods on one machine.

Everything but the forward pass is the real engine: the HTTP API, scheduler, KV manager (what is cached and
evicted), metrics, KV events, forecast, KV transfer and LoRA adapters (loaded and unloaded, listed, hashed and
counted as the engine does; their weights are not applied). Only the model runner differs (through the engine's
`make_runner` hook): it sleeps as long as the latency model says a step takes and answers deterministic tokens,
with no weights and a KV tensor of a few bytes a block. So the router and operator can be tested against dozens of
pods, and a benchmark against a simulated pool exercises the same code paths and contracts as a real one.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.processes import LOG_LEVELS

if TYPE_CHECKING:  # torch and the engine load on use: `kvmesh --help` builds this command's parser
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.runner import StepInput


@dataclass(frozen=True)
class LatencyModel:
    """How long a step takes. A prefill token costs the same whatever is cached before it (the cached part is
    skipped, which is the point); a decode step reads the weights once, then each sequence and its context."""

    prefill_seconds_per_token: float
    decode_step_seconds: float  # a decode step of one sequence with no context: reading the weights
    decode_seconds_per_seq: float
    decode_seconds_per_context_token: float  # reading a token's KV in attention
    transfer_bytes_per_second: float  # serving KV blocks to a peer

    def __post_init__(self) -> None:
        if min(dataclasses.astuple(self)) < 0 or self.transfer_bytes_per_second <= 0:
            raise ValueError(f"latency model parameters must be non-negative (bandwidth positive): {self}")

    def step_seconds(self, seqs: list[StepInput]) -> float:
        """The modelled time of one engine step over `seqs`."""
        prefill = sum(len(s.token_ids) for s in seqs if not _is_decode(s))
        decodes = [s for s in seqs if _is_decode(s)]
        seconds = prefill * self.prefill_seconds_per_token
        if decodes:
            context = sum(s.num_computed + 1 for s in decodes)
            seconds += (self.decode_step_seconds + self.decode_seconds_per_seq * len(decodes)
                        + self.decode_seconds_per_context_token * context)
        return seconds


def _is_decode(s: StepInput) -> bool:
    """One new token after a computed context (a prefill chunk of one token is rare and costs the same)."""
    return len(s.token_ids) == 1 and s.num_computed > 0


@dataclass(frozen=True)
class Profile:
    """A simulated model and machine: the latency model, the model's KV shape (which sets block bytes and, with
    the memory budget, the number of blocks) and its context length."""

    name: str
    latency: LatencyModel
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # of the KV cache, as torch names it
    max_model_len: int
    kv_cache_memory_mib: int


# cpu-smollm: the bundled SmolLM2-135M on this project's 2-core CPU, fp32 (docs/benchmarks.md, "Engine"): a cold
# 2,000-token prompt takes 5.03 s (2.5 ms a token); a decode step takes 50 ms at batch 1 (19.9 tok/s) and 203 ms
# at batch 32 and context 150, 23 % of it attention; raw KV fetches between engines ran at 450 to 780 MB/s.
# h100-8b: a Llama-3-8B-shaped model in bf16 on one H100: about 10,000 prefill tokens/s, 10 ms to read 16 GB of
# weights per step, 128 KiB of KV per token read at about 3 TB/s, 60 GiB of KV, a 25 GB/s (RDMA) link.
PROFILES: dict[str, Profile] = {
    "cpu-smollm": Profile("cpu-smollm", LatencyModel(2.5e-3, 0.045, 0.0035, 1e-5, 600e6),
                          num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", max_model_len=8192,
                          kv_cache_memory_mib=512),
    "h100-8b": Profile("h100-8b", LatencyModel(1e-4, 0.010, 1e-4, 4e-8, 25e9),
                       num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", max_model_len=131072,
                       kv_cache_memory_mib=60 * 1024),
}


def served_name(profile: Profile, configured: str | None = None) -> str:
    """The model id a simulated engine of `profile` serves: the one configured (`served_model_name`, a pool
    file's `model.name`), else `sim-<profile>` (`kvmesh up --sim` says which)."""
    return configured or f"sim-{profile.name}"


def sim_config(profile: Profile, config_file: str | None, flags: dict[str, object]) -> EngineConfig:
    """Engine settings from the file and flags; a KV budget left at the engine's default becomes the profile's
    (an H100 holds far more KV than a laptop engine's default)."""
    from kvmesh.engine.config import EngineConfig, load_config

    config = load_config(config_file, flags)
    if config.kv_cache_memory_mib == EngineConfig.kv_cache_memory_mib:
        config.kv_cache_memory_mib = profile.kv_cache_memory_mib
    return config


# ---- CLI ---------------------------------------------------------------------------------------------------------

ENGINE_FLAGS = ("served_model_name", "host", "port", "block_size", "kv_cache_memory_mib", "kv_cache_blocks",
                "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_cache", "eviction_policy",
                "hash_algo", "role", "lora_modules", "max_loras", "max_lora_rank", "kv_host_path", "kv_disk_path")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim-engine", help="a simulated engine: the engine's API, KV manager, metrics and events, "
                                          "answering after a latency model instead of running a model")
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu-smollm",
                   help="simulated model and machine (default cpu-smollm: the bundled model on 2 CPU cores)")
    p.add_argument("--config", help="YAML file with an `engine` section (flags override it)")
    p.add_argument("--served-model-name")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--kv-cache-memory-mib", type=int, help="simulated device KV budget (default: the profile's)")
    p.add_argument("--kv-cache-blocks", type=int, help="an exact number of KV blocks instead of a memory budget")
    p.add_argument("--kv-host-path", help="the host tier's file (default /dev/shm/kvmesh-kv-host-<port>.kv)")
    p.add_argument("--kv-disk-path", help="the disk tier's file (default ~/.cache/kvmesh/kv-disk-<port>.kv)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--no-prefix-cache", dest="enable_prefix_cache", action="store_const", const=False)
    p.add_argument("--eviction-policy")
    p.add_argument("--hash-algo", choices=["xxh3_64", "sha256_cbor_64bit"])
    p.add_argument("--role", choices=["prefill", "decode", "both"])
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="LoRA adapters served from the start (PEFT directories: their config and weights file are "
                        "checked, the weights not applied); more load at run time via POST /v1/load_lora_adapter")
    p.add_argument("--max-loras", type=int, help="adapters loaded at once (default: the engine's)")
    p.add_argument("--max-lora-rank", type=int, help="the largest adapter rank loaded (default: the engine's)")
    p.add_argument("--prefill-ms-per-token", type=float, help="override the profile's prefill time per token")
    p.add_argument("--decode-step-ms", type=float, help="override the profile's decode step time at batch 1")
    p.add_argument("--decode-ms-per-seq", type=float, help="override the decode time added per sequence")
    p.add_argument("--transfer-gbps", type=float, help="override the KV link bandwidth, GB/s")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS)


def latency_from_args(profile: Profile, args: argparse.Namespace) -> LatencyModel:
    base = profile.latency
    changes: dict[str, float] = {}
    if args.prefill_ms_per_token is not None:
        changes["prefill_seconds_per_token"] = args.prefill_ms_per_token / 1e3
    if args.decode_step_ms is not None:
        changes["decode_step_seconds"] = args.decode_step_ms / 1e3
    if args.decode_ms_per_seq is not None:
        changes["decode_seconds_per_seq"] = args.decode_ms_per_seq / 1e3
    if args.transfer_gbps is not None:
        changes["transfer_bytes_per_second"] = args.transfer_gbps * 1e9
    return dataclasses.replace(base, **changes)


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from kvmesh.bench.sim_runner import SimEngine
    from kvmesh.engine.internal_token import InternalToken
    from kvmesh.engine.server import EngineHolder, create_app

    profile = PROFILES[args.profile]
    try:
        latency = latency_from_args(profile, args)
        config = sim_config(profile, args.config, {name: getattr(args, name) for name in ENGINE_FLAGS})
        token = InternalToken.from_env()  # before the engine loads: a bad file is one line, not a traceback
    except (OSError, ValueError) as exc:
        print(f"kvmesh sim-engine: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the simulator computes nothing worth a second thread; many share the machine
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    holder = EngineHolder(loader=lambda: SimEngine(config, profile, latency))
    holder.load_in_background()
    uvicorn.run(create_app(holder, token=token), host=config.host, port=config.port, log_level=args.log_level)
    if holder.engine is not None:
        holder.engine.stop()
    return 0
