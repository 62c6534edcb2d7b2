"""A pod's usage object as the router reads it. A pod of another make may send null counts, negative ones, or no
object at all; every reader (the request's end: its slot and log row; a disaggregated request's merge; the Responses
API's usage; a batch line's; the trace) reads it through these, so none fails after the pod has answered."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def usage_object(usage: object) -> dict[str, Any]:
    """A pod's usage as a mapping: {} for null or anything that is no JSON object."""
    return usage if isinstance(usage, dict) else {}


def usage_count(usage: object, name: str, default: int = 0) -> int:
    """A token count of a usage object, `default` when it has none (null, not a whole number, no object)."""
    value = usage.get(name) if isinstance(usage, Mapping) else None
    return max(value, 0) if isinstance(value, int) and not isinstance(value, bool) else default


def cached_tokens(usage: object, details: str = "prompt_tokens_details") -> int:
    """The prompt tokens a pod found cached, from a usage object's `details` (a response object's are
    `input_tokens_details`)."""
    return usage_count(usage_object(usage).get(details), "cached_tokens")
