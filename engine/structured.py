"""Structured outputs: a request's constraint (JSON object, JSON schema, regex, choice, grammar) compiled into an
llguidance grammar, a matcher per sequence, and the allowed-token mask of each decoding step.

llguidance (the grammar engine vLLM and SGLang also offer) computes a mask lazily over the tokenizer's token trie
with an Earley parser, so a mask costs tens of microseconds on a 49k vocabulary and nothing is precompiled per
schema. The scheduler and the KV manager know nothing of this: the matcher lives with the request, and a batch
where no request is constrained computes no mask at all.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import torch
from llguidance import LLMatcher, LLTokenizer
from prometheus_client import Counter

from kvmesh.engine.model.tokenizer import Tokenizer
from kvmesh.engine.protocol import STRUCTURED_KINDS

# JSON as json.dumps writes it: fixed separators, no free whitespace between tokens (with free whitespace a model
# can pad a JSON value with newlines until max_tokens, the failure vLLM's disable_any_whitespace exists for).
# A schema may still choose otherwise with its own "x-guidance" options, which override these defaults.
JSON_DEFAULTS: llguidance.JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                                "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What one request constrains its output to. `param` is the request field it came from, named in errors."""

    kind: str
    spec: Any  # json_schema: the schema (dict); regex, grammar: the text; choice: the strings; json_object: None
    param: str

    def __post_init__(self) -> None:
        assert self.kind in STRUCTURED_KINDS, self.kind

    def grammar(self) -> str:
        """The llguidance grammar (not yet checked); ValueError when the spec cannot even be read."""
        if self.kind in ("json_object", "json_schema"):
            schema = {"type": "object"} if self.kind == "json_object" else self.spec
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(self.spec))
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        return llguidance.grammar_from("grammar", self.spec)  # Lark, or llama.cpp's GBNF (converted)


def check(constraint: Constraint) -> None:
    """Raise ValueError with llguidance's message when the constraint is not a valid grammar. Needs no tokenizer,
    so the router's request parsing refuses a bad schema or regex as the engine's does."""
    try:
        grammar = constraint.grammar()
    except ValueError as exc:
        raise ValueError(f"invalid {constraint.kind}: {exc}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"invalid {constraint.kind}: {messages[0].strip()}")


class StructuredError(ValueError):
    """A matcher refused a token or hit one of llguidance's limits."""


class Guide:
    """One sequence's matcher: which tokens may come next, and the tokens generated so far fed through it."""

    def __init__(self, kind: str, matcher: LLMatcher) -> None:
        self.kind = kind
        self._matcher = matcher

    @property
    def finished(self) -> bool:
        """The output is complete: the grammar allows nothing but EOS (or the matcher failed)."""
        return self._matcher.is_stopped()

    def error(self) -> str | None:
        """Why the matcher failed (a refused token, a limit of llguidance's), or None; a failed matcher stays so."""
        if not self._matcher.is_error():
            return None
        return self._matcher.get_error() or "the matcher failed"

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
        when the grammar is invalid for this tokenizer or the resumed tokens break it."""
        matcher = LLMatcher(self.ll_tokenizer, constraint.grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {constraint.kind}: {matcher.get_error()}")
        guide = Guide(constraint.kind, matcher)
        try:
            guide.consume(resumed)
        except StructuredError as exc:
            raise StructuredError(f"resume_output_ids do not follow the {constraint.kind} constraint: {exc}") from None
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
