"""What the router knows of LoRA adapters: which models a pod serves (its `/v1/models`: the base model, then one
card per loaded adapter with its `parent`), and which adapters it is running now (vLLM's
`vllm:lora_requests_info`). Pure parsing; pods.py fetches, picker.py filters and scores on the result.

Adapters come and go at run time (`/v1/load_lora_adapter`), so the router re-reads each pod's `/v1/models`
every MODELS_REFRESH_SECONDS: a freshly loaded adapter is routed to within that bound (plus one scrape), and a
pod that unloaded one may still get its requests for as long (it answers them 404, and the HTTP edge tries the
next pod serving the adapter). Each adapter card also names the weights' fingerprint (LORA_FINGERPRINT_FIELD),
which the pod hashes the adapter's blocks with; the router hashes a request once per fingerprint among the pods
serving it (one in steady state, two during a rollout of new weights) and matches each pod with its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.protocol import LORA_FINGERPRINT_FIELD, LORA_INFO_LABELS, MODELS_PATH

RUNNING, WAITING, MAX_LORA = LORA_INFO_LABELS
MODELS_REFRESH_SECONDS = 2.0


@dataclass(frozen=True)
class ServedModels:
    """A pod's `/v1/models`: every model name it answers to, and which of them are adapters (name -> base)."""

    names: frozenset[str]
    adapters: Mapping[str, str]
    cards: tuple[dict[str, Any], ...]  # as the pod listed them, for the router's own /v1/models
    # adapter -> its weights' fingerprint (None where the pod publishes none): how the pod hashes its blocks
    fingerprints: Mapping[str, str | None] = field(default_factory=dict)

    @classmethod
    def of(cls, body: Any) -> ServedModels:
        """From a `/v1/models` answer (ValueError when it is not one): the one reading of it, the router's and the
        operator's adapter sync's (operator/lora.py `served_adapters`)."""
        data = body.get("data") if isinstance(body, Mapping) else None
        if not isinstance(data, list) or not all(isinstance(c, Mapping) and isinstance(c.get("id"), str)
                                                 for c in data):
            raise ValueError(f"{MODELS_PATH} did not answer a list of models with ids: {str(body)[:200]}")
        adapters = {c["id"]: str(c["parent"]) for c in data if c.get("parent")}
        fingerprints = {c["id"]: _fingerprint(c.get(LORA_FINGERPRINT_FIELD)) for c in data if c.get("parent")}
        return cls(frozenset(c["id"] for c in data), adapters, tuple(dict(c) for c in data), fingerprints)

    def without(self, model: str) -> ServedModels:
        """The list less `model`: what a pod that just answered 404 for it serves until its list is read again."""
        return ServedModels(self.names - {model}, {k: v for k, v in self.adapters.items() if k != model},
                            tuple(c for c in self.cards if c.get("id") != model),
                            {k: v for k, v in self.fingerprints.items() if k != model})

    @classmethod
    def base_only(cls, model: str) -> ServedModels:
        """A pod whose list is not read yet: it serves the model its KV config names."""
        if not model:
            return cls(frozenset(), {}, ())
        return cls(frozenset({model}), {}, ({"id": model, "object": "model", "created": 0, "owned_by": "kvmesh"},))


def _fingerprint(value: Any) -> str | None:
    """A card's fingerprint as the engine wrote it; anything else (an engine that publishes none) is None."""
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True)
class LoraLoad:
    """vllm:lora_requests_info: adapters with running or waiting requests, and the pod's adapter slots."""

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int = 0

    @property
    def active(self) -> frozenset[str]:
        return self.running | self.waiting


def _names(value: str) -> frozenset[str]:
    return frozenset(n for n in value.split(",") if n)


def lora_load(labels: Mapping[str, str] | None) -> LoraLoad:
    """A pod's vllm:lora_requests_info labels (ScrapedMetrics.lora_info) as the picker reads them."""
    if labels is None:
        return LoraLoad()
    try:
        max_lora = int(float(labels.get(MAX_LORA, "0")))
    except ValueError:
        max_lora = 0
    return LoraLoad(_names(labels.get(RUNNING, "")), _names(labels.get(WAITING, "")), max_lora)


def union_cards(lists: Iterable[ServedModels]) -> list[dict[str, Any]]:
    """The models a pool serves, each once: base models first, then adapters, each group by name (the first
    pod's card of a name wins)."""
    seen: dict[str, dict[str, Any]] = {}
    for served in lists:
        for card in served.cards:
            seen.setdefault(card["id"], card)
    return sorted(seen.values(), key=lambda c: (bool(c.get("parent")), c["id"]))
