"""The vocabulary product of bf16 serving on a CPU: bf16 speed, with the top of each row exact in fp32.

An fp32 product over the bundled model's 49,152 x 576 table reads 113 MB a step at fp32 speed. bf16 logits would
be fast but round by 2^-8 of their size (0.125 near 25) and once tied the bundled model's two best first tokens
(docs/architecture.md "Serving dtype"). So the logits here come from bf16 products and are then repaired:

1. x (fp32) is split as hi + lo, both bf16 (x - hi is exact in fp32, and rounding it to bf16 leaves 2^-16 of x),
   and both go through one product (one read of the table): the table's values are bf16 already, so each
   product is exact up to oneDNN's fp32 accumulation and the one rounding of its output. Their sum is within
   `bound` of the fp32 logits: 2^-8 of the outputs' magnitudes plus a few 2^-16 |x| |w| (Cauchy-Schwarz over
   lo, whose own rounding and input rounding it bounds) and the fp32 accumulations' hidden x 2^-23 |x| |w|.
2. Every entry within 2 x bound of its row's maximum is a candidate for the true maximum (any other lies below
   it), and those few are recomputed in fp32 from the table's rows. Rows so flat that more than MAX_CANDIDATES
   a row qualify (a zero hidden state makes every logit one) get the fp32 product instead.

So greedy decoding over these logits picks the token the fp32 product would (up to fp32 summation order), and
every other logit is within `bound` (about 0.1 near 25) of it, closer than the bf16 logits GPU engines sample
from. What the sampler does after (a structured-output mask, logit_bias, penalties, min_tokens) can demote the
exact entries: the engine asks for such greedy rows' logits exact (`exact_rows`: the fp32 product, at its cost),
so greedy decoding always picks the fp32 product's token. Sampling and logprobs away from the top see logits
within `bound` of the fp32 ones.
Measured on 2 cores of a Xeon with AMX: 2.1, 3.3 and 8.1 ms for 1, 8 and 32 rows against the fp32 product's 3.1,
8.1 and 16.3 ms; 1.5 candidates a row for the bundled model; largest error outside them 0.12.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.engine.model.linear import _prepacked
from kvmesh.engine.sampling import block_columns, block_maxima

MARGIN = 1.01  # over the bound, for the bound's own fp32 arithmetic
MAX_CANDIDATES = 64  # a row on average; beyond, the rows are nearly flat and the fp32 product is cheaper
FP32_SLICE = 8192  # table rows converted to fp32 at a time by the fallback (19 MB for a hidden size of 576)


class SplitBf16Head:
    """fp32 logits for fp32 hidden states from a bf16 table ([vocab, hidden], what the embedding holds too)."""

    def __init__(self, table: torch.Tensor) -> None:
        if table.dtype != torch.bfloat16 or table.device.type != "cpu":
            raise ValueError(f"SplitBf16Head needs a bf16 table on the CPU, got {table.dtype} on {table.device}")
        self.table = table
        self._product = _prepacked(table, None)  # x W^T in bf16
        self.max_row_norm = float(table.float().norm(dim=-1).max())

    def __call__(self, hidden: torch.Tensor, exact_rows: Sequence[int] = ()) -> torch.Tensor:
        """Logits [rows, vocab] in fp32; `exact_rows` get the fp32 product whole (rows whose greedy choice the
        sampler makes after a mask, logit_bias, penalties or min_tokens, which may demote the exact entries)."""
        x = hidden.float()
        if x.shape[0] == 0:  # a step in which no sequence samples
            return x.new_empty(0, self.table.shape[0])
        if len(exact_rows) == x.shape[0]:
            return self._fp32_product(x)
        logits = self._split(x)
        if exact_rows:
            logits[list(exact_rows)] = self._fp32_product(x[list(exact_rows)])
        return logits

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """The split bf16 product, each row's top repaired (the module's docstring)."""
        hi = x.to(torch.bfloat16)
        lo = (x - hi.float()).to(torch.bfloat16)
        y_hi, y_lo = self._product(torch.cat([hi, lo])).split(x.shape[0])  # one read of the table for both
        logits = y_hi.float().add_(y_lo)
        low, top = torch.aminmax(logits, dim=-1)
        # |y_lo| <= 2^-8 |x| |w|, so 2^-8 max |y_hi| <= 2^-8 max |logits| + 2^-16 |x| |w|; lo's own rounding adds
        # 2^-8 |y_lo| and lo's input rounding 2^-16 |x| |w|; fp32 accumulation over `hidden` terms, in both
        # products and in the fp32 product they stand in for, at most hidden x 2^-24 |x| |w| each
        scale = (3 * 2.0**-16 + x.shape[1] * 2.0**-23) * x.norm(dim=-1) * self.max_row_norm
        bound = MARGIN * (2.0**-8 * torch.maximum(top, -low) + scale)
        rows, cols = _near_top(logits, top - 2 * bound)
        if rows.shape[0] > MAX_CANDIDATES * x.shape[0]:  # nearly flat rows: the whole vocabulary is close to the top
            return self._fp32_product(x)
        logits[rows, cols] = (x[rows] * self.table[cols].float()).sum(dim=-1)
        return logits

    def _fp32_product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in fp32, converting a slice of the table at a time (never the whole table at once)."""
        vocab = self.table.shape[0]
        return torch.cat([x @ self.table[i : i + FP32_SLICE].float().t() for i in range(0, vocab, FP32_SLICE)], dim=1)


def _near_top(logits: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every entry >= its row's `floor`, found through block maxima: comparing and scanning the
    whole [rows, vocab] matrix took 2.9 ms at 32 rows, the blocks 0.7 ms. A column may be listed twice (the last,
    ragged block is read with its last column repeated)."""
    hit = (block_maxima(logits) >= floor[:, None]).nonzero()  # [k, 2]: (row, block)
    cols = block_columns(hit[:, 1:], logits.shape[1])  # [k, BLOCK_WIDTH]
    rows = hit[:, :1]
    near = (logits[rows, cols] >= floor[hit[:, 0], None]).nonzero()  # [m, 2]: (hit, column in block)
    return rows[near[:, 0], 0], cols[near[:, 0], near[:, 1]]
