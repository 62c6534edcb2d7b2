"""The decode step's cost, fitted by each engine over its own steps (engine/step_cost.py) and read by the operator
to size decode pods for the inter-token latency objective: the fit recovers a known line, says nothing it cannot
know, keeps slopes non-negative and follows a change; the engine feeds it exactly its decode-only steps and
exports what it fitted, which the operator reads back."""

from __future__ import annotations

import random

import pytest

from kvmesh.engine.engine import Engine
from kvmesh.engine.protocol import BlockExtra, DecodeStepCost, read_decode_step_cost, read_engine_metrics
from kvmesh.engine.request import Request
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.step_cost import MIN_STEPS, DecodeStepFit
from kvmesh.operator.forecast import parse_pod

TRUE = DecodeStepCost(base=0.012, per_sequence=0.0008, per_kv_token=2e-7)


def fitted(samples: list[tuple[int, int, float]], memory_steps: float = 4096) -> DecodeStepCost | None:
    fit = DecodeStepFit(memory_steps)
    for batch, kv, seconds in samples:
        fit.add(batch, kv, seconds)
    return fit.cost()


def noisy_steps(cost: DecodeStepCost, n: int, seed: int = 0) -> list[tuple[int, int, float]]:
    rng = random.Random(seed)
    steps = []
    for _ in range(n):
        lengths = [rng.randint(50, 3000) for _ in range(rng.randint(1, 48))]
        steps.append((len(lengths), sum(lengths), cost.seconds(len(lengths), sum(lengths)) * rng.gauss(1, 0.02)))
    return steps


def test_the_fit_recovers_a_known_step_cost_from_noisy_steps() -> None:
    cost = fitted(noisy_steps(TRUE, 3000))
    assert cost is not None
    assert cost.base == pytest.approx(TRUE.base, rel=0.05)
    assert cost.per_sequence == pytest.approx(TRUE.per_sequence, rel=0.05)
    assert cost.per_kv_token == pytest.approx(TRUE.per_kv_token, rel=0.05)


def test_no_cost_until_the_batch_has_varied_over_enough_steps() -> None:
    """One batch size shows a step time, not a slope; a few steps are too few to trust."""
    assert fitted([(8, 8000, 0.02)] * 500) is None
    few = noisy_steps(TRUE, int(MIN_STEPS) - 1)
    assert fitted(few) is None and fitted(few + noisy_steps(TRUE, 40, seed=1)) is not None


def test_slopes_are_never_negative() -> None:
    """Steps that got faster as the batch grew (another process left the CPU) promise no free sequence."""
    steps = [(b, 1000 * b, 0.05 - 0.001 * b) for b in range(1, 20)] * 4
    cost = fitted(steps)
    assert cost is None or (cost.per_sequence >= 0 and cost.per_kv_token >= 0)


def test_collinear_batches_and_kv_still_predict_along_the_line_they_ran() -> None:
    """Every sequence 500 tokens long: the split between the two slopes is arbitrary, the predictions are not."""
    steps = [(b, 500 * b, TRUE.seconds(b, 500 * b)) for b in range(1, 33)] * 2
    cost = fitted(steps)
    assert cost is not None
    for batch in (1, 16, 64):
        assert cost.seconds(batch, 500 * batch) == pytest.approx(TRUE.seconds(batch, 500 * batch), rel=1e-3)


def test_the_fit_forgets_a_cost_that_changed() -> None:
    """A pod whose steps got twice as dear (a noisy neighbour, a longer context mix) is read as it is now."""
    dearer = DecodeStepCost(2 * TRUE.base, 2 * TRUE.per_sequence, 2 * TRUE.per_kv_token)
    cost = fitted(noisy_steps(TRUE, 2000) + noisy_steps(dearer, 2000, seed=2), memory_steps=256)
    assert cost is not None and cost.seconds(32, 32_000) == pytest.approx(dearer.seconds(32, 32_000), rel=0.05)


def test_the_largest_batch_within_an_objective() -> None:
    cost = DecodeStepCost(base=0.01, per_sequence=0.001, per_kv_token=1e-6)
    # each sequence attending to 1,000 tokens costs 2 ms: (30 ms - 10 ms) / 2 ms = 10 sequences
    assert cost.largest_batch(0.030, 1000) == 10 and cost.seconds(10, 10_000) == pytest.approx(0.030)
    assert cost.largest_batch(0.0299, 1000) == 9
    assert cost.largest_batch(0.005, 1000) == 1  # unreachable: one sequence is the best a pod can do
    with pytest.raises(ValueError, match="must cost something"):
        DecodeStepCost(0.01, 0.0, 0.0).largest_batch(0.03, 1000)


def test_the_engine_fits_its_decode_only_steps_and_exports_the_cost(tiny_engine: Engine) -> None:
    """Eight requests of different lengths: the batch shrinks from 8 to 1 as they finish. The fit is fed each step
    that only decodes, with its batch and the KV tokens the batch attends to, and no step with a prompt in it."""
    recorded: list[tuple[int, int, float]] = []

    class Recording(DecodeStepFit):
        def add(self, batch: int, kv_tokens: int, seconds: float) -> None:
            recorded.append((batch, kv_tokens, seconds))
            super().add(batch, kv_tokens, seconds)

    tiny_engine.step_cost = Recording()
    prompt_len = 20
    for i in range(8):
        params = SamplingParams(max_tokens=4 + 4 * i, temperature=0.0, ignore_eos=True)
        tiny_engine.submit(Request(f"step-cost-{i}", [100 + i * 13 + j for j in range(prompt_len)], params,
                                   extra=BlockExtra()))
    tiny_engine.run_until_idle()
    assert {b for b, _, _ in recorded} == set(range(1, 9))
    assert all(seconds > 0 for _, _, seconds in recorded)
    # a decode step of b sequences attends to each one's prompt and its outputs so far, this step's included
    for batch, kv, _ in recorded:
        assert prompt_len * batch < kv <= (prompt_len + 32) * batch
    # what the engine exports is what it fitted, and the operator reads it back
    tiny_engine.step_cost = DecodeStepFit()
    for batch in range(1, 17):
        for kv in (500 * batch, 500 * batch + 99, 500 * batch + 250):
            tiny_engine.step_cost.add(batch, kv, TRUE.seconds(batch, kv))
    tiny_engine._publish_state()
    text = tiny_engine.metrics.render().decode()
    exported = read_decode_step_cost(read_engine_metrics(text).values)
    assert exported == tiny_engine.step_cost.cost() and exported is not None
    assert exported.seconds(8, 4000) == pytest.approx(TRUE.seconds(8, 4000), rel=1e-3)
    assert parse_pod("engine-0", "decode", text).observation.decode_step_cost == exported
    tiny_engine.step_cost = DecodeStepFit()
    tiny_engine._publish_state()
    assert read_decode_step_cost(read_engine_metrics(tiny_engine.metrics.render().decode()).values) is None
