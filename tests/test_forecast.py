"""The engine's KV usage forecast: exact on known futures, bounded in memory, sane on sampled ones."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.forecast import Forecast, OutputLengthModel, RequestLoad, forecast_usage
from kvmesh.engine.protocol import FORECAST_LEVELS, OVERLOAD_USAGE, WORKLOAD_CLASSES

CLASS = WORKLOAD_CLASSES[0]


def known_lengths(length: int, workload: str = CLASS) -> OutputLengthModel:
    """A model that has only ever seen one output length, so every future is that one."""
    model = OutputLengthModel(min_observations=8)
    for _ in range(8):
        model.observe(workload, length)
    return model


def run(requests: list[RequestLoad], model: OutputLengthModel, **kw: float) -> Forecast:
    args = {
        "total_blocks": 100,
        "block_size": 16,
        "horizon_seconds": 1.0,
        "decode_step_seconds": 0.05,  # 20 steps
        "prefill_tokens_per_second": 1e6,
    }
    args.update(kw)
    return forecast_usage(requests, lengths=model, **args)  # type: ignore[arg-type]


def test_no_requests_is_an_empty_forecast() -> None:
    f = run([], OutputLengthModel())
    assert f.usage_quantiles == dict.fromkeys(FORECAST_LEVELS, 0.0)
    assert f.overload_probability == 0.0
    assert f.seconds_to_exhaustion == math.inf


def test_blocks_pinned_outside_requests_count_in_every_future() -> None:
    """A prefill pod full of handoff handles is full: its forecast says so, as its usage gauge does."""
    alone = run([], OutputLengthModel(), pinned_blocks=87.5)
    assert alone.usage_quantiles == dict.fromkeys(FORECAST_LEVELS, 0.875)
    assert alone.overload_probability == 0.0 and alone.seconds_to_exhaustion == math.inf
    full = run([], OutputLengthModel(), pinned_blocks=100)
    assert full.overload_probability == 1.0 and full.seconds_to_exhaustion == 0.0
    with_request = run([RequestLoad(100, 10, 1000, CLASS)], known_lengths(50), pinned_blocks=30)
    assert with_request.usage_quantiles == dict.fromkeys(FORECAST_LEVELS, (8 + 30) / 100)


def test_lone_request_with_known_length_is_exact() -> None:
    # 100 tokens held, 10 of 50 generated: after 20 steps it holds 120 tokens = 8 blocks of 16.
    f = run([RequestLoad(100, 10, 1000, CLASS)], known_lengths(50))
    assert f.usage_quantiles == dict.fromkeys(FORECAST_LEVELS, 8 / 100)
    assert f.overload_probability == 0.0
    assert f.seconds_to_exhaustion == math.inf
    assert f.horizon_seconds == 1.0


def test_finished_requests_free_their_blocks() -> None:
    model = known_lengths(50)
    ends = RequestLoad(100, 40, 1000, CLASS)  # 10 tokens to go: gone before step 20
    lives = RequestLoad(100, 0, 1000, CLASS)  # 50 to go: grows to 120 tokens
    now = (math.ceil(100 / 16) * 2) / 100
    f = run([ends, lives], model)
    assert f.usage_quantiles["p99"] == 8 / 100 < now
    assert f.peak_quantiles["p99"] == now  # the window's peak is now, before the first ends
    # At the step it finishes, a request holds nothing; one step earlier it holds everything.
    assert run([ends], model, horizon_seconds=0.5).usage_quantiles["p50"] == 0.0
    assert run([ends], model, horizon_seconds=0.45).usage_quantiles["p50"] == math.ceil(109 / 16) / 100


def test_the_peak_within_the_horizon_is_forecast_beside_the_horizons_value() -> None:
    """Requests that grow to fill the cache and finish within the window: the horizon's value sees none of it, the
    peak levels see it full (the reviewer's case: 0 at the horizon where each pod would need 130 %)."""
    grow = [RequestLoad(100, 0, 1000, CLASS) for _ in range(10)]  # 50 tokens each, gone at step 50 of 60
    f = run(grow, known_lengths(50), total_blocks=100, horizon_seconds=3.0)
    assert f.usage_quantiles["p50"] == 0.0
    assert f.peak_quantiles["p50"] == pytest.approx(10 * math.ceil(149 / 16) / 100)  # full at step 49
    assert f.overload_probability == 1.0
    assert run([], OutputLengthModel(), pinned_blocks=30).peak_quantiles == dict.fromkeys(FORECAST_LEVELS, 0.3)


def test_pending_prefill_arrives_first_then_decoding_starts() -> None:
    # 160 uncomputed prompt tokens at 16 tokens a step: computed by step 10, then 10 decode steps to step 20.
    queued = RequestLoad(160, 0, 1000, CLASS, pending_prefill_tokens=160)
    f = run([queued], known_lengths(100), prefill_tokens_per_second=320.0)
    assert f.usage_quantiles["p50"] == math.ceil(170 / 16) / 100
    # Behind another request's prefill, it starts later and so holds fewer tokens at the horizon.
    first = RequestLoad(80, 0, 1000, CLASS, pending_prefill_tokens=80)
    g = run([first, queued], known_lengths(100), prefill_tokens_per_second=320.0)
    assert g.usage_quantiles["p50"] == (math.ceil(95 / 16) + math.ceil(165 / 16)) / 100


def test_max_tokens_caps_growth() -> None:
    model = known_lengths(10_000)
    capped = RequestLoad(100, 0, 5, CLASS)  # ends after 5 tokens whatever its class would say
    assert run([capped], model).usage_quantiles["p99"] == 0.0
    assert run([capped], model, horizon_seconds=0.2).usage_quantiles["p50"] == math.ceil(104 / 16) / 100
    remaining = model.sample_remaining(CLASS, np.array([0, 3, 9]), np.array([5, 5, 5]), np.random.default_rng(0), 4)
    assert (remaining == np.array([5, 2, 0])).all()


def test_certain_growth_overloads_at_the_analytical_time() -> None:
    # One-token blocks: 10 requests of 50 tokens grow 10 blocks a step and fill 1000 blocks at step 50 = 0.5 s.
    requests = [RequestLoad(50, 0, 10_000, CLASS) for _ in range(10)]
    f = run(requests, known_lengths(10_000), total_blocks=1000, block_size=1, decode_step_seconds=0.01)
    assert f.overload_probability == pytest.approx(1.0)
    assert f.seconds_to_exhaustion == pytest.approx(0.5, abs=0.01)
    assert f.usage_quantiles["p50"] == pytest.approx(10 * 150 / 1000)  # demand beyond capacity shows as > 1
    # With 16-token blocks the time moves by at most a block's worth of steps.
    g = run(requests, known_lengths(10_000), total_blocks=64, block_size=16, decode_step_seconds=0.01)
    analytical = (64 * 16 / 10 - 50) * 0.01
    assert g.overload_probability == pytest.approx(1.0)
    assert abs(g.seconds_to_exhaustion - analytical) <= 16 * 0.01


def test_a_light_load_neither_overloads_nor_exhausts() -> None:
    f = run([RequestLoad(200, 0, 512, CLASS) for _ in range(3)], OutputLengthModel(), total_blocks=1000)
    assert f.overload_probability == 0.0
    assert f.seconds_to_exhaustion == math.inf
    assert max(f.usage_quantiles.values()) < OVERLOAD_USAGE


def test_quantiles_are_ordered_and_seeded() -> None:
    rng = np.random.default_rng(7)
    model = OutputLengthModel()
    for workload in WORKLOAD_CLASSES[:3]:
        for length in rng.lognormal(4.0, 1.0, 300).astype(int):
            model.observe(workload, int(length))
    requests = [
        RequestLoad(int(rng.integers(10, 400)), int(rng.integers(0, 60)), 512, WORKLOAD_CLASSES[i % 4])
        for i in range(64)
    ]
    for seed in range(5):
        f = run(requests, model, total_blocks=1200, horizon_seconds=3.0, decode_step_seconds=0.02, seed=seed)
        q = f.usage_quantiles
        assert set(q) == set(FORECAST_LEVELS)
        assert 0.0 <= q["p50"] <= q["p90"] <= q["p99"]
        assert 0.0 <= f.overload_probability <= 1.0
        assert f == run(requests, model, total_blocks=1200, horizon_seconds=3.0, decode_step_seconds=0.02, seed=seed)


@settings(max_examples=20, deadline=None)
@given(
    observed=st.lists(st.integers(0, 2000), max_size=60),
    state=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000)), min_size=1, max_size=30),
    seed=st.integers(0, 2**32 - 1),
)
def test_conditional_samples_stay_within_zero_and_the_cap(
    observed: list[int], state: list[tuple[int, int]], seed: int
) -> None:
    model = OutputLengthModel(min_observations=16)
    for length in observed:
        model.observe(CLASS, length)
    generated = np.array([g for g, _ in state])
    max_tokens = np.array([m for _, m in state])
    remaining = model.sample_remaining(CLASS, generated, max_tokens, np.random.default_rng(seed), 64)
    cap = np.maximum(max_tokens - generated, 0)
    assert remaining.shape == (64, len(state))
    assert (remaining >= 0).all()
    assert (remaining <= cap).all()
    assert (remaining[:, cap > 0] >= 1).all()  # a live request has at least its next token to go
    pool = model.pool(CLASS)
    conditioned = (generated < pool[-1]) & (cap > 0)
    totals = remaining + generated
    assert np.isin(totals[:, conditioned], np.append(pool, generated + cap)).all()


def test_length_model_memory_stays_bounded() -> None:
    model = OutputLengthModel(capacity=256)
    rng = np.random.default_rng(0)
    classes = rng.integers(0, len(WORKLOAD_CLASSES), 100_000).tolist()
    lengths = rng.integers(0, 4096, 100_000).tolist()

    def observe(lo: int, hi: int) -> None:
        for c, n in zip(classes[lo:hi], lengths[lo:hi], strict=True):
            model.observe(WORKLOAD_CLASSES[c], n)
            if n % 97 == 0:
                model.pool(WORKLOAD_CLASSES[c])  # pools are rebuilt as lengths arrive

    observe(0, 2000)
    tracemalloc.start()
    observe(2000, 100_000)
    # A class outside the bounded set can be sampled (from the prior) but is neither stored nor cached.
    rng = np.random.default_rng(1)
    for i in range(1000):
        model.sample_remaining(f"odd-{i}", np.array([3]), np.array([9]), rng, 2)
    grown, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert grown < 64 * 1024
    for c in WORKLOAD_CLASSES:
        assert len(model.observations(c)) == 256
        assert len(model.pool(c)) == 256
    assert len(model.observations("odd-1")) == 0
    with pytest.raises(ValueError):
        model.observe("not-a-class", 3)


def test_recent_lengths_replace_the_prior() -> None:
    model = OutputLengthModel(min_observations=4, prior_mean_tokens=1000.0)
    assert len(model.pool(CLASS)) == 4  # the prior alone
    model.observe(CLASS, 7)
    assert 7 in model.pool(CLASS) and len(model.pool(CLASS)) == 4
    for _ in range(3):
        model.observe(CLASS, 7)
    assert (model.pool(CLASS) == 7).all()
    assert (model.pool(WORKLOAD_CLASSES[1]) == 7).all()  # an unseen class borrows the pooled lengths


def test_full_size_forecast_runs() -> None:
    rng = np.random.default_rng(3)
    model = OutputLengthModel()
    for length in rng.lognormal(5.0, 1.0, 2000).astype(int):
        model.observe(WORKLOAD_CLASSES[int(rng.integers(0, 4))], int(length))
    requests = [
        RequestLoad(
            int(rng.integers(50, 3000)),
            int(rng.integers(0, 400)),
            1024,
            WORKLOAD_CLASSES[i % 4],
            int(rng.integers(0, 500)) if i % 8 == 0 else 0,
        )
        for i in range(256)
    ]
    f = forecast_usage(requests, 40_000, 16, 2.0, 0.03, 8000.0, model, n_samples=256)
    assert all(np.isfinite(v) for v in f.usage_quantiles.values())
    assert 0.0 <= f.overload_probability <= 1.0
