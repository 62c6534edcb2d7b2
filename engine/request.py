"""A request inside the engine: its tokens, progress, timings and where its outputs go."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from kvmesh.engine.protocol import BlockExtra
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.structured import Guide

if TYPE_CHECKING:
    import torch


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What the engine hands the API layer after a step: new tokens and text, and the end when finished."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None  # what the error is to a client, where it is not the engine's fault (model_not_found)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    peer_tokens: int = 0  # of cached_tokens, those pulled from another pod
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # of cached_tokens, promoted from host/disk
    kv_transfer: dict[str, Any] | None = None  # a prefill's handoff: handle, expires_at, num_blocks
    prompt_logprobs: PromptLogprobs | None = None  # with the first output of a request that asked for them


@dataclass
class PromptLogprobs:
    """The logprob of each prompt token after the first, with its top alternatives, filled chunk by chunk as the
    prompt is computed (the logits at position p give token p + 1's); handed out with the first output."""

    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    sent: bool = False

    @property
    def positions_done(self) -> int:
        return len(self.logprobs)


@dataclass
class Request:
    """One generation request. `output_ids` only grows: a preempted request keeps what it generated and
    recomputes its KV later, so a client's stream never sees a token twice."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    workload: str = "completion-short"
    priority: int = 0
    extra: BlockExtra = field(default_factory=BlockExtra)
    on_output: Callable[[RequestOutput], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    guide: Guide | None = None  # structured outputs: the matcher, already fed output_ids (engine/structured.py)
    prompt_vocabulary: torch.Tensor | None = None  # the prompt's distinct ids, once repetition_penalty needs them
    prompt_logprobs: PromptLogprobs | None = None  # made when the params ask for them
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens supplied by the cache at first admission
    expected_cached_tokens: int = 0  # the cached prefix found at arrival (for load estimates while waiting)
    handoff_ttl: float | None = None  # a prefill for another pod: keep the KV under a handle this long
    import_key: str | None = None  # blocks pulled from a peer for this request, held until it is admitted
    lora_slot: int | None = None  # its adapter's weights' slot, bound as the engine queues it (for good)
    peer_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # of cached_tokens, promoted from host/disk
    num_preemptions: int = 0
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    detokenizer: Any = None  # IncrementalDetokenizer, set by the engine
    text: str = ""  # all text decoded so far
    emitted_text: str = ""  # the part already sent (text minus what may still turn out to be a stop string)

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = PromptLogprobs()

    @property
    def cache_limit(self) -> int | None:
        """Tokens of its prefix the cache may supply: for a request that asks for its prompt's logprobs, only the
        positions whose logits were already read (a cached position computes none); None: any."""
        return None if self.prompt_logprobs is None else self.prompt_logprobs.positions_done

    def prompt_logprob_positions(self, start: int, stop: int) -> range:
        """Of the positions [start, stop) a step computes, those whose logits give prompt logprobs not yet read."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, self.prompt_logprobs.positions_done), min(stop, len(self.prompt_ids) - 1))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] without building the whole list (a decode step needs one token of a long one)."""
        split = len(self.prompt_ids)
        if start >= split:
            return self.output_ids[start - split : stop - split]
        if stop <= split:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: stop - split]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        """Still computing tokens it already knows (prompt, or output recomputed after a preemption)."""
        return self.num_computed_tokens < self.num_tokens - 1
