"""Where the forecast looks: every request is seen within the window, whatever the step time.

The forecast evaluates its futures at a few steps, not at all of them. With fast decode steps an even grid put
hundreds of steps between its points, and a queue of short requests that prefilled and ended between two of them
was never seen: a full engine forecast no overload at 2 ms steps and certain overload at 20 ms. These tests hold
the forecast to the same model evaluated at every step.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.forecast import OutputLengthModel, RequestLoad, _points, forecast_usage
from kvmesh.engine.protocol import WORKLOAD_CLASSES

CLASS = WORKLOAD_CLASSES[0]
HORIZON = 10.0


def known_lengths(length: int) -> OutputLengthModel:
    """A model that has only ever seen one output length, so every future is that one."""
    model = OutputLengthModel(min_observations=8)
    for _ in range(8):
        model.observe(CLASS, length)
    return model


def every_step(requests: list[RequestLoad], model: OutputLengthModel, block_size: int, horizon_seconds: float,
               step_seconds: float, prefill_tokens_per_second: float) -> tuple[np.ndarray, np.ndarray]:
    """The forecast's model at every step of the window, for lengths known in advance: blocks held per step, and
    each request's decode start."""
    steps = max(1, math.floor(horizon_seconds / step_seconds + 1e-9))
    context = np.array([r.context_tokens for r in requests])
    pending = np.minimum([r.pending_prefill_tokens for r in requests], context)
    per_step = prefill_tokens_per_second * step_seconds
    done_by = np.cumsum(pending)
    start = np.where(pending > 0, np.ceil(done_by / per_step), 0).astype(np.int64)
    remaining = model.sample_remaining(CLASS, np.array([r.generated_tokens for r in requests]),
                                       np.array([r.max_tokens for r in requests]), np.random.default_rng(0), 1)[0]
    end = np.maximum(start + remaining, 1)
    t = np.arange(steps + 1)[:, None]
    tokens = context - pending + np.clip(t * per_step - (done_by - pending), 0, pending).astype(np.int64)
    tokens += np.maximum(t - start, 0)
    return ((-(-tokens // block_size)) * (t < end)).sum(axis=1), start


@pytest.mark.parametrize("step_seconds", [0.002, 0.0023, 0.02])
def test_a_queue_of_short_requests_that_overfills_the_cache_overloads_at_any_step_time(step_seconds: float) -> None:
    """40 queued prompts of 290 tokens (19 blocks each) against 128 blocks, all prefilled within 6 steps, each
    decoding 12 tokens: all 40 are held together (760 blocks) a few steps from now. At 2 ms steps the even grid's
    first point after 0 was step 156, when all had ended: it forecast 0 and no overload."""
    queue = [RequestLoad(290, 0, 16, CLASS, pending_prefill_tokens=290)] * 40
    f = forecast_usage(queue, 128, 16, HORIZON, step_seconds, 1e6, known_lengths(12), n_samples=16)
    held, start = every_step(queue, known_lengths(12), 16, HORIZON, step_seconds, 1e6)
    assert held.max() == 40 * 19
    assert f.peak_quantiles["p50"] == 40 * 19 / 128
    assert f.overload_probability == 1.0
    assert f.seconds_to_exhaustion <= start.max() * step_seconds  # exhausted once the whole queue is in
    assert f.usage_quantiles["p50"] == 0.0  # the horizon's value stays the horizon's: all have ended


@settings(max_examples=60, deadline=None)
@given(
    loads=st.lists(
        st.tuples(st.integers(1, 400), st.integers(0, 20), st.integers(1, 60), st.booleans()), min_size=1,
        max_size=12),
    length=st.integers(1, 40),
    step_seconds=st.floats(0.0005, 0.05),
    prefill_tokens_per_second=st.floats(1_000.0, 1e6),
)
def test_the_peak_sees_every_decode_start_and_no_more_than_every_step(
    loads: list[tuple[int, int, int, bool]], length: int, step_seconds: float, prefill_tokens_per_second: float
) -> None:
    """Against the model at every step: the forecast's peak is at least the usage at each request's decode start
    (every request at its whole prompt, with all held beside it) and never above the true peak."""
    requests = [RequestLoad(context, generated, generated + budget, CLASS, context if queued else 0)
                for context, generated, budget, queued in loads]
    model = known_lengths(length)
    f = forecast_usage(requests, 100, 16, 1.0, step_seconds, prefill_tokens_per_second, model, n_samples=4)
    held, start = every_step(requests, model, 16, 1.0, step_seconds, prefill_tokens_per_second)
    seen = held[start[start < len(held)]].max() if (start < len(held)).any() else 0
    assert seen / 100 <= f.peak_quantiles["p50"] <= held.max() / 100
    assert f.overload_probability == float(f.peak_quantiles["p50"] > 0.95)


def test_points_are_bounded_and_keep_the_grid() -> None:
    """However long the queue, at most `points` starts join the grid: the forecast's cost stays bounded."""
    grid = _points(5000, 32, np.zeros(1, dtype=np.int64))
    assert len(grid) == 33 and grid[0] == 0 and grid[-1] == 5000
    starts = np.arange(1, 4000, 7, dtype=np.int64)  # 572 queued requests starting within the window
    points = _points(5000, 32, starts)
    assert np.isin(grid, points).all() and np.isin(points, np.union1d(grid, starts)).all()
    assert len(points) <= 2 * 32 + 1 and starts[-1] in points
    assert (np.diff(points) > 0).all()
