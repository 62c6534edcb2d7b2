"""Structured outputs: a matcher per sequence for its request's constraint (engine/constraint.py), and the
allowed-token mask of each decoding step.

llguidance (the grammar engine vLLM and SGLang also offer) computes a mask lazily over the tokenizer's token trie
with an Earley parser, so a mask costs tens of microseconds on a 49k vocabulary and nothing is precompiled per
schema. The scheduler and the KV manager know nothing of this: the matcher lives with the request, and a batch
where no request is constrained computes no mask at all.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from llguidance import LLMatcher, LLTokenizer
from prometheus_client import Counter

from kvmesh.engine.constraint import Constraint
from kvmesh.engine.model.tokenizer import Tokenizer


class StructuredError(ValueError):
    """A matcher refused a token or hit one of llguidance's limits."""


def _reason(error: str) -> str:
    """llguidance's error without the parser state or the panic's backtrace it dumps after it (dozens of lines
    no client can act on)."""
    return re.split(r"\n<(?:state|backtrace)>", error, maxsplit=1)[0].strip()


class Guide:
    """One sequence's matcher: which tokens may come next, and the tokens generated so far fed through it."""

    def __init__(self, matcher: LLMatcher) -> None:
        self._matcher = matcher

    @property
    def finished(self) -> bool:
        """The output is complete: the grammar allows nothing but EOS (or the matcher failed)."""
        return self._matcher.is_stopped()

    def error(self) -> str | None:
        """Why the matcher failed (a refused token, a limit of llguidance's), or None; a failed matcher stays so."""
        if not self._matcher.is_error():
            return None
        return _reason(self._matcher.get_error() or "") or "the matcher failed"

    def fill(self, bits: torch.Tensor, row: int) -> None:
        """Write the allowed-token bitmask of the next step into `bits[row]` (int32, 1 bit per token)."""
        target = bits[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def consume(self, tokens: Sequence[int]) -> None:
        if not self._matcher.consume_tokens(list(tokens)):
            raise StructuredError(self.error() or f"the constraint does not allow token {list(tokens)}")


@dataclass(frozen=True)
class Masks:
    """A step's masks: `bits[i]` is row `rows[i]`'s; `failed` maps a row to why its matcher gave no mask."""

    rows: list[int]
    bits: torch.Tensor  # int32 [len(rows), words]
    failed: dict[int, str]


class StructuredOutputs:
    """Per engine: llguidance's view of the tokenizer (built at the first constrained request, about a quarter
    second for 49k tokens, then cached) and the per-step masks. Counters are the engine's metrics."""

    def __init__(self, tokenizer: Tokenizer, logits_width: int, mask_seconds: Counter | None = None,
                 masks: Counter | None = None) -> None:
        self._tokenizer = tokenizer
        self.n_vocab = max(tokenizer.vocab_size, logits_width)  # masks cover every logit (padded vocabularies)
        self._ll: LLTokenizer | None = None
        self._lock = threading.Lock()
        self._mask_seconds = mask_seconds
        self._masks = masks

    @property
    def ll_tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = LLTokenizer(self._tokenizer.to_json(), n_vocab=self.n_vocab,
                                       eos_token=sorted(self._tokenizer.eos_token_ids))
            return self._ll

    def guide(self, constraint: Constraint, resumed: Sequence[int] = ()) -> Guide:
        """A matcher for one sequence, with the tokens it already generated (`resume_output_ids`: a handoff or a
        migration) fed through it, so a continuing pod masks exactly as the first one would have. ValueError
        when the grammar is invalid for this tokenizer or allows no output at all (a regex such as [^\\s\\S]: its
        first mask would fail the request mid-flight), StructuredError when the resumed tokens break it."""
        matcher = LLMatcher(self.ll_tokenizer, constraint.grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {constraint.kind}: {_reason(matcher.get_error())}")
        guide = Guide(matcher)
        try:
            guide.consume(resumed)
        except StructuredError as exc:
            raise StructuredError(f"resume_output_ids do not follow the {constraint.kind} constraint: {exc}") from None
        if not matcher.is_stopped():
            matcher.compute_bitmask()  # tens of microseconds, off the engine thread: a grammar of nothing fails here
            if (error := guide.error()) is not None:
                raise ValueError(f"the {constraint.kind} allows no output: {error}")
        return guide

    def masks(self, guides: Sequence[Guide | None]) -> Masks | None:
        """The masks of the constrained rows of a step; None (and no work) when no row is constrained."""
        rows = [row for row, g in enumerate(guides) if g is not None]
        if not rows:
            return None
        start = time.perf_counter()
        bits = torch.full((len(rows), (self.n_vocab + 31) // 32), -1, dtype=torch.int32)
        failed = {}
        for i, row in enumerate(rows):
            guide = guides[row]
            assert guide is not None
            guide.fill(bits, i)
            if (error := guide.error()) is not None:
                failed[row] = error
        if self._mask_seconds is not None and self._masks is not None:
            self._mask_seconds.inc(time.perf_counter() - start)
            self._masks.inc(len(rows))
        return Masks(rows, bits, failed)
