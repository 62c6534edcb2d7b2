"""What a decode step costs this engine, fitted from its own steps as they run.

A decode step reads the weights once (a fixed part), computes each sequence's row (a part per sequence) and
reads each sequence's KV (a part per KV token), so its time is close to linear in the batch and in the KV tokens
the batch attends to. The operator needs that line to size decode pods for the pool's inter-token latency
objective: how many sequences a pod may batch before its step, each sequence's time between tokens, passes the
objective. A moving average of the step time (kvmesh_decode_step_seconds_avg) says what a step costs at the
batch the pod runs now; it cannot say what a bigger or smaller batch would cost.

The fit is weighted least squares with exponential forgetting over the engine's decode-only steps (a step with
a prompt chunk in it costs the chunk too), the slopes kept non-negative (a fit over a narrow range can turn a
slope negative, which would promise a free sequence). It says nothing until the batch has varied: a pod that
ran only one batch size shows a step time, not a slope.
"""

from __future__ import annotations

import numpy as np

from kvmesh.engine.protocol import DecodeStepCost

MEMORY_STEPS = 4096  # the forgetting factor's time constant, in steps: minutes of a busy engine's decoding
MIN_STEPS = 32.0  # the weight of samples (steps) the fit needs
MIN_BATCH_VARIANCE = 0.25  # the batch's weighted variance it needs (batches of 1 and 2, half the steps each)
KV_SCALE = 1024.0  # KV tokens are fitted in units of this, so the normal equations stay well conditioned
RIDGE = 1e-9  # relative: splits the slopes when the batch and its KV tokens rose together
REFIT_STEPS = 16  # `cost` refits after this many new steps (the engine reads it after every step)


class DecodeStepFit:
    """The running fit: the weighted sums of the normal equations, each decayed by 1 - 1/MEMORY_STEPS a step."""

    def __init__(self, memory_steps: float = MEMORY_STEPS) -> None:
        if memory_steps < 1:
            raise ValueError(f"memory_steps must be at least 1, got {memory_steps}")
        self.decay = 1.0 - 1.0 / memory_steps
        self._xx = np.zeros((3, 3))  # sum of w x x^T over x = (1, batch, kv tokens / KV_SCALE)
        self._xy = np.zeros(3)  # sum of w x seconds
        self._yy = 0.0  # sum of w seconds^2 (the residuals' size, to compare the constrained fits)
        self._fitted: DecodeStepCost | None = None
        self._unfitted_steps = REFIT_STEPS  # steps added since the last fit

    def add(self, batch: int, kv_tokens: int, seconds: float) -> None:
        """One decode step of `batch` sequences attending to `kv_tokens` tokens in all, that took `seconds`."""
        if batch < 1 or kv_tokens < 0 or not seconds > 0:
            raise ValueError(f"need batch >= 1, kv_tokens >= 0 and seconds > 0, got {batch}, {kv_tokens}, {seconds}")
        x = np.array([1.0, float(batch), kv_tokens / KV_SCALE])
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + seconds * x
        self._yy = self.decay * self._yy + seconds * seconds
        self._unfitted_steps += 1

    @property
    def weight(self) -> float:
        return float(self._xx[0, 0])

    def cost(self) -> DecodeStepCost | None:
        """The best line with non-negative slopes (each subset of the two slopes fitted, the least squared error
        kept), or None while the batch has not varied enough to fit one; refitted every REFIT_STEPS steps."""
        if self._unfitted_steps >= REFIT_STEPS:
            self._fitted, self._unfitted_steps = self._fit(), 0
        return self._fitted

    def _fit(self) -> DecodeStepCost | None:
        w = self.weight
        if w < MIN_STEPS:
            return None
        mean_batch = self._xx[0, 1] / w
        if self._xx[1, 1] / w - mean_batch**2 < MIN_BATCH_VARIANCE:
            return None
        best: tuple[float, np.ndarray] | None = None
        for kept in ((0, 1, 2), (0, 1), (0, 2), (0,)):
            rows = list(kept)
            xx = self._xx[np.ix_(rows, rows)]
            ridge = RIDGE * np.trace(xx) * np.diag([0.0, *([1.0] * (len(rows) - 1))])
            try:
                beta = np.linalg.solve(xx + ridge, self._xy[rows])
            except np.linalg.LinAlgError:
                continue
            if (beta[1:] < 0).any():
                continue
            error = self._yy - 2 * beta @ self._xy[rows] + beta @ xx @ beta
            if best is None or error < best[0] - 1e-18:
                full = np.zeros(3)
                full[rows] = beta
                best = (error, full)
        if best is None:
            return None
        base, per_sequence, per_scaled_kv = best[1]
        cost = DecodeStepCost(float(base), float(per_sequence), float(per_scaled_kv) / KV_SCALE)
        return cost if cost.per_sequence > 0 or cost.per_kv_token > 0 else None

