"""Speculative decoding with n-gram (prompt-lookup) drafts: the configuration, the proposer and the acceptance rule.

A decoding request whose last tokens occurred earlier in its prompt or output is guessed to continue as it did
then: the proposer finds the most recent earlier occurrence of its last n tokens (n from `prompt_lookup_max` down
to `prompt_lookup_min`) and proposes the k tokens that followed. The engine computes the last token and the k
drafts in one step and keeps the drafts the target model would itself have produced (docs/engine.md, "Speculative
decoding").

Acceptance (`accept`) compares each draft with the token the sampler draws at that position from the same
distribution and the same seeded stream as without speculation. For a draft that is a point mass on d, "draw
x ~ p; accept d iff x == d, else emit x" accepts with probability p(d) and, on rejection, emits a token
distributed as p with d removed and renormalised: the standard rejection-sampling rule for a deterministic draft,
so the output distribution is exactly the target's. Because the draw is the one the non-speculative sampler
makes for that output index, a seeded request's output is the same token for token with or without
speculation, on any pod, wherever the logits are the same bits both ways. They rarely are: verified positions go
through the prefill attention path and a batch of another shape (about 1e-6 apart on the CPU in fp32; on a GPU the
extend and decode kernels sum in different orders), so a near-tie can flip, as between batch shapes without
speculation (docs/engine.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmesh.engine.openai_types import json_object

SPEC_METHODS: tuple[str, ...] = ("ngram",)
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min/max when neither is given


@dataclass(frozen=True)
class SpecConfig:
    """vLLM's `--speculative-config` for its n-gram method: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": a, "prompt_lookup_max": b}."""

    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    method: str = "ngram"

    @classmethod
    def parse(cls, value: Any) -> SpecConfig | None:
        """From a mapping (YAML) or its JSON text (the CLI flag); None (or an empty mapping) means off. Raises
        ValueError naming what is wrong."""
        if value is None:
            return None
        value = json_object(value, "speculative_config")
        if not value:
            return None
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {', '.join(sorted(known))}")
        method = value.get("method", "ngram")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(SPEC_METHODS)}, got {method!r}")
        k = value.get("num_speculative_tokens")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = DEFAULT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        for name, v in (("num_speculative_tokens", k), ("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) must not exceed prompt_lookup_max "
                             f"({high})")
        return cls(k, low, high, method)


class TokenHistory:
    """A request's token ids in a growing numpy buffer, so a lookup never rebuilds an array from a list."""

    def __init__(self) -> None:
        self._buf = np.empty(256, dtype=np.int64)
        self.size = 0

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Append what the request gained since the last call (its tokens only grow)."""
        have = self.size
        new = list(prompt[have:]) if have < len(prompt) else []
        new += output[max(have - len(prompt), 0):]
        if not new:
            return
        need = self.size + len(new)
        if need > len(self._buf):
            grown = np.empty(max(need, 2 * len(self._buf)), dtype=np.int64)
            grown[: self.size] = self._buf[: self.size]
            self._buf = grown
        self._buf[self.size : need] = new
        self.size = need

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self.size]


def propose(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n tokens of `tokens` (one that
    leaves k tokens after it, where there is one), for the largest n in [min_n, max_n] that has one; [] if none.
    Cost: one vectorised scan for the last token, then checks at its occurrences only (`kvmesh bench spec`
    measures it on long sequences)."""
    size = len(tokens)
    if k < 1 or size < min_n + 1:
        return []
    # ends: earlier positions holding the last token, each the end of a candidate match
    ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        match = ends[ends >= n - 1]
        for back in range(1, n):
            if not match.size:
                break
            match = match[tokens[match - back] == tokens[size - 1 - back]]
        if match.size:
            # the most recent occurrence that leaves k tokens after it; inside a repeated run the most recent one
            # overlaps the end and would propose a single token, so then the earliest (the longest continuation)
            full = match[match <= size - 1 - k]
            start = int(full[-1] if full.size else match[0]) + 1
            return tokens[start : start + k].tolist()
    return []


@dataclass(frozen=True)
class Verdict:
    """What one verified draft run gives: the tokens to append (accepted drafts, then the model's own token) and
    how many drafts were accepted."""

    token_ids: list[int]
    num_accepted: int


def accept(drafts: Sequence[int], sampled: Sequence[int]) -> Verdict:
    """`sampled[i]` is the token the sampler drew at draft position i (len(drafts) + 1 of them, the last after
    every draft). Drafts are accepted while they equal the draw; the first draw that differs (or the last, a
    bonus token) ends the run."""
    assert len(sampled) == len(drafts) + 1, "one draw per draft plus the bonus position"
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return Verdict(list(sampled[: i + 1]), i)
    return Verdict(list(sampled), len(drafts))
