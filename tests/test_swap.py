"""Preemption by swap or by recompute, chosen by the same costs as promotion: both give the outputs of an
unconstrained run, and the metrics say which mode ran."""

from __future__ import annotations

from pathlib import Path

from kvmesh.engine.engine import Engine
from kvmesh.engine.kv.costs import CostProfile

from .conftest import make_engine
from .test_kv_tiers import metric, prompt, run, tiered


def run_all(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts at once (so they compete for blocks), greedy, 40 tokens each."""
    from kvmesh.engine.request import Request, RequestOutput
    from kvmesh.engine.sampling import SamplingParams

    outputs: list[list[RequestOutput]] = [[] for _ in prompts]
    for i, tokens in enumerate(prompts):
        request = Request(f"swap-{i}", tokens, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        request.on_output = outputs[i].append
        engine.submit(request)
    engine.run_until_idle()
    engine.kv.check_invariants()
    if engine.tiers is not None:
        engine.tiers.check_invariants()
    return [[t for o in outs for t in o.new_token_ids] for outs in outputs]


PROMPTS = [prompt(s, 40) for s in range(8)]


def test_swap_and_recompute_preemption_both_match_an_unconstrained_run(tiny_dir: Path, tmp_path: Path) -> None:
    expected = run_all(make_engine(tiny_dir), PROMPTS)

    swapping = tiered(tiny_dir, tmp_path / "swap", disk_blocks=0, kv_cache_blocks=10)
    assert swapping.tiers is not None
    swapping.tiers.profile = CostProfile(prefill_tokens_per_second=1.0)  # recomputing is slow: swap
    assert run_all(swapping, PROMPTS) == expected
    assert metric(swapping, "kvmesh_preemptions_total", mode="swap") > 0
    assert metric(swapping, "kvmesh_preemptions_total", mode="recompute") == 0
    # swapped requests found their blocks gone from the device and loaded them back from the host
    assert metric(swapping, "kvmesh_kv_tier_moved_blocks_total", move="host_to_device") > 0
    swapping.close()

    recomputing = tiered(tiny_dir, tmp_path / "recompute", disk_blocks=0, kv_cache_blocks=10)
    assert recomputing.tiers is not None
    recomputing.tiers.profile = CostProfile(prefill_tokens_per_second=1e12)  # recomputing is free
    assert run_all(recomputing, PROMPTS) == expected
    assert metric(recomputing, "kvmesh_preemptions_total", mode="recompute") > 0
    assert metric(recomputing, "kvmesh_preemptions_total", mode="swap") == 0
    assert metric(recomputing, "kvmesh_kv_tier_moved_blocks_total", move="host_to_device") == 0
    recomputing.close()


def test_without_a_host_tier_preemption_recomputes(tiny_dir: Path, tmp_path: Path) -> None:
    engine = tiered(tiny_dir, tmp_path, host_blocks=0, kv_cache_blocks=10)
    assert run_all(engine, PROMPTS[:4]) == run_all(make_engine(tiny_dir), PROMPTS[:4])
    assert metric(engine, "kvmesh_preemptions_total", mode="swap") == 0
    assert metric(engine, "kvmesh_preemptions_total", mode="recompute") > 0
    run(engine, PROMPTS[0])
    engine.close()
