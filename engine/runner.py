"""The model runner: owns the KV tensor, turns a scheduled step into model inputs, returns logits.

It chooses the attention backend (torch or triton, engine/attention.py) and counts the tokens it computes,
which is what tests and metrics use to tell a cache hit from a recompute. Sequences of LoRA adapters are put
together in the flat batch (base model first), so each adapter's tokens are one row segment (model/lora.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvmesh.engine.attention import build_metadata, resolve_backend
from kvmesh.engine.kvcache import KVLayout
from kvmesh.engine.model.llama import Llama
from kvmesh.engine.model.lora import LoraSegment


@dataclass(frozen=True)
class StepInput:
    """One sequence's part of a step: its block table, tokens already computed, and the new token ids."""

    block_table: list[int]
    num_computed: int
    token_ids: list[int]
    wants_logits: bool
    lora_slot: int | None = None  # the LoRA adapter's slot (model/lora.py); None: the base model
    num_logits: int = 1  # with wants_logits: logits at this many trailing positions (a draft run verifies them all)
    exact_logits: bool = False  # with wants_logits: the model's exact logits, not a faster close approximation


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor  # [sum of num_logits over the sequences wanting logits, vocab], fp32
    num_tokens: int
    seconds: float


class ModelRunner:
    def __init__(
        self,
        model: Llama,
        num_blocks: int,
        layout: KVLayout,
        device: torch.device,
        attention_backend: str = "auto",
    ) -> None:
        self.model = model
        self.block_size = layout.block_size
        self.device = device
        self.attention_backend = resolve_backend(attention_backend, device)
        self.kv_cache = layout.allocate(num_blocks, device)  # what tiers and transfers move, block by block
        self.kv_layers = layout.layers(self.kv_cache)  # what attention writes and reads, layer by layer
        self.computed_tokens = 0
        self.steps = 0
        # decoding sequences that share leading blocks attend over them once (torch backend, engine/attention.py);
        # off only to compare against in tests and benchmarks
        self.cascade_attention = True

    def run(self, seqs: list[StepInput]) -> StepResult:
        """Logits rows follow `seqs`' order, whatever order the flat batch took; a sequence's `num_logits` rows are
        consecutive, in position order."""
        start = time.perf_counter()
        order = seqs
        if any(s.lora_slot is not None for s in seqs):  # stable: the base model's sequences first, then by slot
            order = sorted(seqs, key=lambda s: -1 if s.lora_slot is None else s.lora_slot)
        ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}  # id(sequence) -> its last row in the flat batch
        segments: list[LoraSegment] = []
        for s in order:
            begin = len(ids)
            ids += s.token_ids
            positions += range(s.num_computed, s.num_computed + len(s.token_ids))
            last_row[id(s)] = len(ids) - 1
            if s.lora_slot is None:
                continue
            if segments and segments[-1].slot == s.lora_slot:
                segments[-1] = LoraSegment(segments[-1].start, len(ids), s.lora_slot)
            else:
                segments.append(LoraSegment(begin, len(ids), s.lora_slot))
        rows = [row for s in seqs if s.wants_logits
                for row in range(last_row[id(s)] - s.num_logits + 1, last_row[id(s)] + 1)]
        exact = [i for i, s in enumerate(r for r in seqs if r.wants_logits for _ in range(r.num_logits))
                 if s.exact_logits]
        meta = build_metadata(
            [(s.block_table, s.num_computed, len(s.token_ids)) for s in order],
            self.block_size,
            self.device,
            self.attention_backend,
            self.cascade_attention,
        )
        input_ids = torch.tensor(ids, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        hidden = self.model.forward(input_ids, pos, meta, self.kv_layers, segments)
        logits = self.model.logits(hidden[torch.tensor(rows, dtype=torch.long, device=self.device)], exact)
        self.computed_tokens += len(ids)
        self.steps += 1
        return StepResult(logits, len(ids), time.perf_counter() - start)
