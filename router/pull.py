"""When the chosen pod should pull a prefix from a peer instead of recomputing it (Mooncake).

The picker may choose a pod that lacks part of the prompt's prefix (another pod holding more of it is busy, or
near its KV limit). If a healthy peer holds more leading blocks, moving the extra blocks (their bytes over the
measured transfer bandwidth, plus a fixed setup cost) can be cheaper than computing them (their tokens over the
chosen pod's prefill speed). Then the router asks the chosen pod to pull them first; the pulled copy is also
how a hot prefix spreads to more pods. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh.router.index import PrefixMatch
from kvmesh.router.picker import PickerConfig, PodState, RequestInfo


@dataclass(frozen=True)
class PullPolicy:
    bytes_per_second: float = 150e6  # measured pod-to-pod pull speed (docs/benchmarks.md, KV transfer)
    setup_seconds: float = 0.02  # a request to the peer and back, before the first byte
    min_blocks: int = 2  # fewer extra blocks are not worth a transfer


@dataclass(frozen=True)
class PullPlan:
    source: PodState
    tokens: int  # the prefix to fetch, in tokens (whole blocks)
    seconds_saved: float  # estimated recompute time minus estimated transfer time


def plan_pull(
    chosen: PodState,
    request: RequestInfo,
    pods: Sequence[PodState],
    matches: Mapping[str, PrefixMatch],
    block_bytes: int,
    picker: PickerConfig,
    policy: PullPolicy = PullPolicy(),
) -> PullPlan | None:
    """The peer to pull from and how much, or None when recomputing is as cheap (or nothing is to gain)."""
    if block_bytes <= 0:
        return None
    have = matches[chosen.name].blocks if chosen.name in matches else 0
    # the engine computes at least the prompt's last token, so the last full block is never taken from a cache
    usable = (request.prompt_tokens - 1) // chosen.block_size
    best: PullPlan | None = None
    for peer in sorted(pods, key=lambda p: p.name):
        if peer.name == chosen.name or not peer.healthy or peer.stale or peer.name not in matches:
            continue
        extra = min(matches[peer.name].blocks - matches[peer.name].provisional, usable) - have
        if extra < policy.min_blocks:
            continue
        speed = chosen.prefill_tokens_per_second or picker.default_prefill_tokens_per_second
        recompute = extra * chosen.block_size / speed
        transfer = policy.setup_seconds + extra * block_bytes / policy.bytes_per_second
        if transfer < recompute and (best is None or recompute - transfer > best.seconds_saved):
            best = PullPlan(peer, (have + extra) * chosen.block_size, recompute - transfer)
    return best
