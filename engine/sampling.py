"""Sampling parameters and the sampler.

Seeded sampling derives a fresh random stream from (seed, output index) for every token, so any pod that
knows the seed and how many tokens were already generated continues the stream exactly (docs/contracts.md, contract 0).
Penalties count the tokens generated so far, which a pod continuing a request receives (`resume_output_ids`),
so they continue exactly too (repetition_penalty counts the prompt's as well, which that pod has). Structured
outputs' masks (engine/structured.py) apply first: a forbidden token stays forbidden whatever its penalty or bias.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
import xxhash

from kvmesh.engine.config import DEFAULT_LOGPROBS_MODE
from kvmesh.engine.openai_types import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
)
from kvmesh.engine.structured import Masks

GREEDY_TEMPERATURE = 1e-5
# what an -inf logprob or logit (a token a processed logprobs_mode filtered out) is reported as: JSON has no
# infinity, and vLLM's OpenAI server clamps to this value
LOGPROB_FLOOR = -9999.0


class InvalidParam(ValueError):
    """A sampling parameter outside its range; `param` names the request field (a 400 names it too)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """What a request asks of the sampler and the stop checks. Ranges follow OpenAI's documented ones."""

    max_tokens: int = 16
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) are suppressed until this many were generated
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # vLLM's: drop tokens less likely than this share of the most likely one (0: off)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many alternatives (echo); None: off
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated at least once
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    repetition_penalty: float = 1.0  # vLLM's: divides positive (multiplies negative) logits of prompt and output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] = field(default_factory=list)  # vLLM's: only these may be sampled (empty: any)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string, or a stop token's text, ends the output
    skip_special_tokens: bool = True  # vLLM's: false decodes special tokens into the text too

    def __post_init__(self) -> None:
        if self.seed is None:
            # an unseeded request still gets one stream for its whole life, so a handoff continues it
            self.seed = secrets.randbits(63)

    @property
    def greedy(self) -> bool:
        """Below 1e-5 the scaled logits overflow; such a temperature means greedy, as in vLLM."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self, vocab_size: int, eos_ids: frozenset[int] = frozenset()) -> None:
        """Raise InvalidParam naming the first parameter outside its range, or allowed_token_ids that min_tokens
        would leave nothing of (`eos_ids`: the model's end tokens, which min_tokens masks with stop_token_ids)."""
        if self.max_tokens < 0:  # 0: the prompt alone (echo), which the API allows only with echo
            raise InvalidParam("max_tokens", f"max_tokens must be at least 1 (0 only with echo), got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParam("min_tokens", f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), "
                                             f"got {self.min_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidParam("temperature", f"temperature must be between 0 and 2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParam("top_p", f"top_p must be above 0 and at most 1, got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParam("min_p", f"min_p must be between 0 and 1, got {self.min_p}")
        if self.top_k < -1:
            raise InvalidParam("top_k", f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise InvalidParam("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise InvalidParam("stop", "stop sequences must not be empty")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParam("logprobs", f"prompt logprobs take 0 to {MAX_TOP_LOGPROBS} alternatives, "
                                           f"got {self.prompt_logprobs}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParam("top_logprobs", f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, "
                                               f"got {self.top_logprobs}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidParam("stop_token_ids", f"stop_token_ids outside the vocabulary (0..{vocab_size - 1}): "
                                                 f"{bad[:5]}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidParam(name, f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {value}")
        if not (0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidParam("repetition_penalty", f"repetition_penalty must be above 0 and at most "
                                                     f"{MAX_REPETITION_PENALTY:g}, got {self.repetition_penalty}")
        bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise InvalidParam("logit_bias", f"logit_bias names token ids outside the vocabulary "
                                             f"(0..{vocab_size - 1}): {bad[:5]}")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in self.logit_bias.values()):
            raise InvalidParam("logit_bias", f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and "
                                             f"{MAX_LOGIT_BIAS:g}")
        bad = [t for t in self.allowed_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidParam("allowed_token_ids", f"allowed_token_ids outside the vocabulary (0..{vocab_size - 1}): "
                                                    f"{bad[:5]}")
        if self.min_tokens and self.allowed_token_ids and set(self.allowed_token_ids) <= eos_ids | set(
                self.stop_token_ids):
            raise InvalidParam("allowed_token_ids", "allowed_token_ids holds only stop tokens, which min_tokens "
                                                    "forbids for the first tokens: nothing could be sampled")

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.penalizes_repeats
                    or self.allowed_token_ids)

    @property
    def penalizes_repeats(self) -> bool:
        return self.repetition_penalty != 1.0

    @cached_property
    def allowed_index(self) -> torch.Tensor:
        """allowed_token_ids as an index tensor, built once per request: building it from the list every decode
        step cost 0.9 ms for 10,000 ids."""
        return torch.tensor(self.allowed_token_ids, dtype=torch.long)


def token_seed(seed: int, output_index: int) -> int:
    """The seed of the random stream for output token `output_index` (0 = first generated token)."""
    return xxhash.xxh3_64_intdigest(f"{seed}:{output_index}".encode()) & ((1 << 63) - 1)


@dataclass(frozen=True)
class SampleResult:
    """Per row: the sampled token, its logprob, and (when asked) the top alternatives."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def _filter_tail(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The unlikely tokens a row's min_p, top_k and top_p leave out, at -inf."""
    if min_p > 0.0:  # after temperature, as vLLM: p_i < min_p * p_max, i.e. logit_i < max + log(min_p)
        logits = logits.masked_fill(logits < logits.max() + math.log(min_p), float("-inf"))
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # keep the smallest set whose mass reaches top_p: drop a token when the mass before it already does
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def prompt_vocabulary(prompt_ids: Sequence[int]) -> torch.Tensor:
    """The distinct token ids of a prompt: what repetition_penalty counts beside the output (a request keeps it,
    so a long prompt is not read again every step)."""
    return torch.unique(torch.tensor(prompt_ids, dtype=torch.long))


def _adjust(logits: torch.Tensor, p: SamplingParams, generated: Sequence[int], prompt: torch.Tensor | None) -> None:
    """logit_bias and the penalties, in place on one row, in vLLM's order: the bias, then vLLM's repetition penalty
    over the tokens of the prompt (`prompt`, its distinct ids) and the output, then OpenAI's presence (once per
    token generated) and frequency (once per time); last, every token outside allowed_token_ids to -inf, which no
    bias or penalty moves."""
    if p.logit_bias:  # first, as vLLM's sampler applies it before the penalties (the repetition one scales it)
        ids = torch.tensor(list(p.logit_bias), device=logits.device)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
    if p.penalizes_repeats:
        seen = torch.tensor(list(generated), dtype=torch.long, device=logits.device)
        if prompt is not None:
            seen = torch.cat([prompt.to(logits.device), seen])
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if generated and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(generated, device=logits.device), minlength=logits.shape[-1])
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if p.allowed_token_ids:
        ids = p.allowed_index.to(logits.device)
        kept = logits[ids]
        logits.fill_(float("-inf"))
        logits[ids] = kept


def _apply_masks(logits: torch.Tensor, masks: Masks) -> None:
    """Forbidden tokens of the constrained rows to -inf, in place. Bit k of a row's word w allows token 32w+k
    (llguidance's layout). Measured on this CPU for a 49k row: numpy unpacks the bits in 6 us (torch shifts: a
    hundred times that) and writes the row in about 20 us (torch's masked_fill: 120 us, where: 35 us)."""
    width = logits.shape[-1]
    allowed = np.unpackbits(masks.bits.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :width].view(bool)
    if logits.is_cpu:
        rows = logits.numpy()
        for i, row in enumerate(masks.rows):
            np.copyto(rows[row], -np.inf, where=~allowed[i])
        return
    on_device = torch.from_numpy(allowed).to(logits.device)
    forbidden = torch.tensor(float("-inf"), device=logits.device)
    for i, row in enumerate(masks.rows):
        logits[row] = torch.where(on_device[i], logits[row], forbidden)


BLOCK_WIDTH = 1024  # columns a block maximum covers (first_argmax, and the split head's search near each row's top)


def block_maxima(x: torch.Tensor) -> torch.Tensor:
    """[rows, ceil(width / BLOCK_WIDTH)]: each row's maximum over each block of BLOCK_WIDTH columns (the last block
    ragged). Scanning these, then one block, is how torch's CPU finds a row's top fast: its argmax and whole-row
    comparisons are not vectorized."""
    rows, width = x.shape
    full = width // BLOCK_WIDTH
    maxima = x[:, : full * BLOCK_WIDTH].view(rows, full, BLOCK_WIDTH).amax(-1)
    if width > full * BLOCK_WIDTH:
        maxima = torch.cat([maxima, x[:, full * BLOCK_WIDTH :].amax(-1, keepdim=True)], dim=1)
    return maxima


def block_columns(blocks: torch.Tensor, width: int) -> torch.Tensor:
    """[k, BLOCK_WIDTH] column indices of each block in `blocks` ([k, 1]); the ragged last block repeats its last
    column."""
    return (blocks * BLOCK_WIDTH + torch.arange(BLOCK_WIDTH, device=blocks.device)).clamp_(max=width - 1)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` for a 2-D tensor (the first of equal maxima), from block maxima: torch's CPU argmax took
    2.0 ms for 32 rows of 49,152 logits (2 cores of a Xeon), this 0.4 ms."""
    if x.shape[1] <= 2 * BLOCK_WIDTH:
        return x.argmax(-1)
    block = block_maxima(x).argmax(-1)  # the first block holding its row's maximum
    cols = block_columns(block[:, None], x.shape[1])
    return cols.gather(1, x.gather(1, cols).argmax(-1, keepdim=True)).squeeze(1)


LOGPROB_SLICE_ROWS = 256  # prompt rows turned into logprobs at a time: a log_softmax copy of 50 MB at 49k tokens


def _reported(logits: torch.Tensor, logprobs_mode: str) -> torch.Tensor:
    """What a logprobs_mode reports of these logits: their log-probabilities (*_logprobs) or themselves (*_logits)."""
    return torch.log_softmax(logits, dim=-1) if logprobs_mode.endswith("_logprobs") else logits


@torch.inference_mode()
def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top: int,
                   logprobs_mode: str = DEFAULT_LOGPROBS_MODE) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Row i's log-probability of token_ids[i] under the model's distribution, and its `top` most likely tokens
    with theirs: a prompt's logprobs (echo), read from its positions' logits a slice at a time. No sampler touches
    a prompt's tokens, so raw and processed modes agree (vLLM's rule): *_logits modes report the logits."""
    chosen: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    for begin in range(0, len(token_ids), LOGPROB_SLICE_ROWS):
        rows = _reported(logits[begin : begin + LOGPROB_SLICE_ROWS].float(), logprobs_mode)
        ids = torch.tensor(token_ids[begin : begin + LOGPROB_SLICE_ROWS], dtype=torch.long, device=rows.device)
        chosen += rows.gather(1, ids[:, None]).squeeze(1).tolist()
        if top:
            values, best = torch.topk(rows, top, dim=-1)
            tops += [list(zip(i, v, strict=True)) for i, v in zip(best.tolist(), values.tolist(), strict=True)]
        else:
            tops += [[] for _ in range(rows.shape[0])]
    return chosen, tops


@torch.inference_mode()
def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_indices: list[int],
    stop_ids: frozenset[int] = frozenset(),
    generated: Sequence[Sequence[int]] | None = None,
    masks: Masks | None = None,
    prompts: Sequence[torch.Tensor | None] | None = None,
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE,
) -> SampleResult:
    """Sample one token per row of `logits` ([rows, vocab]); row i follows params[i] at output_indices[i], after
    its structured-output mask (`masks`), its penalties over `generated[i]` (the tokens it generated so far) and
    `prompts[i]` (its prompt's distinct ids, for repetition_penalty), and its logit_bias. Rows still under their
    `min_tokens` cannot pick `stop_ids` or their own stop_token_ids, unless their
    constraint allows nothing else (the constraint wins: a token it forbids would fail the request). Logprobs are
    the model's own, or with a processed `logprobs_mode` (config.LOGPROBS_MODES) those of the distribution sampled
    from: after all of the above, then temperature, min_p, top_k and top_p (a greedy row's: none of these four, as
    vLLM's, which neutralises them for greedy requests)."""
    if not logits.shape[0] == len(params) == len(output_indices):
        raise ValueError(f"sample: {logits.shape[0]} logits rows, {len(params)} sampling params and "
                         f"{len(output_indices)} output indices; one of each per row")
    raw = logits.float()
    logits = raw
    if masks is not None:
        logits = raw.clone()
        _apply_masks(logits, masks)
    for row, p in enumerate(params):
        if p.adjusts_logits:
            logits = raw.clone() if logits is raw else logits
            _adjust(logits[row], p, generated[row] if generated is not None else (),
                    prompts[row] if prompts is not None else None)
    constrained = set(masks.rows) if masks is not None else set()
    for row, (p, index) in enumerate(zip(params, output_indices, strict=True)):
        if index < p.min_tokens:
            logits = raw.clone() if logits is raw else logits
            stops = sorted(stop_ids | set(p.stop_token_ids))
            kept = logits[row, stops].clone()
            logits[row, stops] = float("-inf")
            if row in constrained and not torch.isfinite(logits[row]).any():
                logits[row, stops] = kept  # the constraint allows only stop tokens here: it ends the output early
    tokens = first_argmax(logits)
    want_logprobs = any(p.logprobs for p in params)
    # the processed rows reported: the sampler's logits, each sampled row's scaled and filtered in the loop below
    processed = logits.clone() if want_logprobs and logprobs_mode.startswith("processed") else None
    for row, (p, index) in enumerate(zip(params, output_indices, strict=True)):
        if p.temperature < GREEDY_TEMPERATURE or (p.greedy and processed is None):
            continue
        scaled = _filter_tail(logits[row] / p.temperature, p.top_k, p.top_p, p.min_p)
        if processed is not None:
            processed[row] = scaled
        if p.greedy:  # top_k 1: the argmax is taken already
            continue
        probs = torch.softmax(scaled, dim=-1)
        generator = torch.Generator().manual_seed(token_seed(p.seed or 0, index))
        # drawn on the CPU whatever the device, so every pod, CPU or GPU, continues the same stream
        noise = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=generator).to(probs.device)
        # the exponential race: argmax p_i / E_i draws i with probability p_i
        tokens[row] = first_argmax((probs / noise)[None])[0]
    token_list = tokens.tolist()
    if not want_logprobs:
        return SampleResult(token_list, None, None)
    reported = _reported(raw if processed is None else processed, logprobs_mode)
    chosen = reported.gather(1, tokens[:, None]).squeeze(1).clamp(min=LOGPROB_FLOOR).tolist()
    k = max(p.top_logprobs for p in params)
    tops: list[list[tuple[int, float]]] = [[] for _ in params]
    if k > 0:
        values, ids = torch.topk(reported, k, dim=-1)
        values = values.clamp(min=LOGPROB_FLOOR)
        for row, p in enumerate(params):
            n = p.top_logprobs
            tops[row] = list(zip(ids[row, :n].tolist(), values[row, :n].tolist(), strict=True))
    return SampleResult(token_list, chosen, tops)
