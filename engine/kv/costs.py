"""What loading a prefix from a KV tier and recomputing it cost, by profile: the names the engine's
`kv_tier_cost_profile` takes. Apart from engine/kv/tiers.py (which needs torch), so a configuration can be
checked without loading torch (the operator checks the engines' files)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CostProfile:
    """What loading from a tier and recomputing cost. None means "use the engine's measurement": the prefill
    speed it observes, and the bandwidth of the tier's real copies. A GPU profile has a fixed setup time per
    load, so recomputing a short prefix beats loading it."""

    prefill_tokens_per_second: float | None = None
    bandwidth: dict[str, float] = field(default_factory=dict)  # tier -> bytes per second
    setup_seconds: dict[str, float] = field(default_factory=dict)  # tier -> fixed seconds per load


PROFILES: dict[str, CostProfile] = {
    "measured": CostProfile(),
    # an 8B-class model on one datacenter GPU: PCIe host copies, NVMe reads, each with a fixed launch/IO cost
    "gpu": CostProfile(20_000.0, {"host": 20e9, "disk": 2e9}, {"host": 0.002, "disk": 0.01}),
    # a small model on a few CPU cores: memory copies at GB/s against a few hundred tokens a second, so loading
    # wins for any prefix (fixed numbers: the decisions do not move with the machine's load)
    "cpu": CostProfile(300.0, {"host": 5e9, "disk": 1e9}, {}),
}
