"""A request's output constraint (JSON object, JSON schema, regex, choice, grammar) as an llguidance grammar, and
its check. Torch-free: the router parses requests with the same models (engine/openai_types.py) and refuses a bad
schema, regex or grammar as the engine does; the matchers and masks are engine/structured.py's.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance import LLMatcher

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
    so the router's request parsing refuses a bad schema or regex as the engine's does. Verdicts are remembered:
    agents send the same schema with every request, and compiling a large one takes tens of milliseconds."""
    spec_json = json.dumps(constraint.spec, sort_keys=True)
    check_once = _problem if len(spec_json) <= CACHED_SPEC_CHARS else _problem.__wrapped__
    problem = check_once(constraint.kind, spec_json)
    if problem is not None:
        raise ValueError(problem)


CACHED_SPEC_CHARS = 16384  # larger specs are checked each time: the cache holds at most 1024 x 16 KiB


@functools.lru_cache(maxsize=1024)
def _problem(kind: str, spec_json: str) -> str | None:
    constraint = Constraint(kind, json.loads(spec_json), "check")
    try:
        grammar = constraint.grammar()
    except ValueError as exc:
        return f"invalid {kind}: {exc}"
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return f"invalid {kind}: {messages[0].strip()}" if is_error else None
