"""The split bf16 vocabulary product (engine/model/head.py) against the fp32 product it stands in for."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.model.head import SplitBf16Head
from kvmesh.engine.model.linear import onednn_bf16
from kvmesh.engine.sampling import BLOCK_WIDTH

pytestmark = pytest.mark.skipif(not onednn_bf16(), reason="this CPU's oneDNN has no bf16 products (the engine "
                                "serves such a CPU with the fp32 vocabulary product)")


def _fp32(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x @ table.float().t()


@pytest.mark.parametrize("vocab", [BLOCK_WIDTH // 3, 5 * BLOCK_WIDTH, 5 * BLOCK_WIDTH + 77])
def test_greedy_choice_is_the_fp32_products_and_every_logit_is_close(vocab: int) -> None:
    """Logits of the bundled model's size (about 25 at the top): each row's argmax is the fp32 product's, the
    top entries are its values, and the rest lie within bf16's rounding of it."""
    g = torch.Generator().manual_seed(vocab)
    table = (torch.randn(vocab, 96, generator=g) * 0.5).bfloat16()
    x = torch.randn(40, 96, generator=g) * 4
    got, want = SplitBf16Head(table)(x), _fp32(table, x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    top = want.argmax(-1, keepdim=True)
    torch.testing.assert_close(got.gather(1, top), want.gather(1, top), atol=1e-4, rtol=1e-6)
    assert ((got - want).abs() <= 2.0**-7 * want.abs().amax(-1, keepdim=True)).all()


def test_a_near_tie_that_bf16_logits_cannot_tell_apart_goes_the_fp32_way() -> None:
    """Two tokens 0.02 apart near 25 round to the same bf16 logit (steps of 0.125 there); the split product
    still ranks them as fp32 does, whichever of the two is ahead."""
    g = torch.Generator().manual_seed(0)
    hidden = 64
    x = torch.randn(1, hidden, generator=g).abs() + 0.5
    base = (x[0] / x[0].norm() * 25 / x[0].norm()).bfloat16()  # a row whose logit is about 25
    for ahead in (0, 1):
        table = (torch.randn(3 * BLOCK_WIDTH, hidden, generator=g) * 0.01).bfloat16()
        rows = [BLOCK_WIDTH - 1, 2 * BLOCK_WIDTH + 5]  # in different blocks
        table[rows[0]] = base
        table[rows[1]] = base
        nudge = 0
        while abs(float(_fp32(table, x)[0, rows[1]] - _fp32(table, x)[0, rows[0]])) < 0.01:
            nudge += 1  # raise one element of the row that should win by bf16 steps until they differ
            table[rows[ahead], nudge % hidden] = table[rows[ahead], nudge % hidden].float().mul(1.01).bfloat16()
        want = _fp32(table, x)
        assert int(want.argmax()) == rows[ahead]
        bf16_logits = (x.bfloat16() @ table.t()).float()
        assert bf16_logits[0, rows[0]] == bf16_logits[0, rows[1]]  # bf16 logits tie: the test means something
        assert int(SplitBf16Head(table)(x).argmax()) == rows[ahead]


def test_rows_asked_exact_are_the_fp32_product_whole() -> None:
    """Rows whose greedy choice the sampler makes after changing the logits get every entry exact; the others
    keep the split product's approximation away from their top."""
    g = torch.Generator().manual_seed(2)
    table = (torch.randn(3 * BLOCK_WIDTH, 64, generator=g) * 0.5).bfloat16()
    x = torch.randn(3, 64, generator=g) * 4
    head, want = SplitBf16Head(table), _fp32(table, x)
    got = head(x, exact_rows=[1])
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-6)
    assert (got[0] - want[0]).abs().max() > 1e-3  # the others are the approximation
    torch.testing.assert_close(head(x, exact_rows=[0, 1, 2]), want, atol=1e-4, rtol=1e-6)


def test_flat_rows_fall_back_to_the_fp32_product() -> None:
    """A zero hidden state makes every logit a candidate: such a step is the fp32 product (computed a slice of the
    table at a time), not a gather of the whole table per row."""
    g = torch.Generator().manual_seed(1)
    table = torch.randn(3 * BLOCK_WIDTH + 5, 32, generator=g).bfloat16()
    x = torch.randn(4, 32, generator=g)
    x[1:3] = 0.0
    got = SplitBf16Head(table)(x)
    torch.testing.assert_close(got, _fp32(table, x), atol=1e-5, rtol=1e-5)
    assert (got[1:3] == 0).all()


def test_no_rows_give_no_logits() -> None:
    """A step in which no sequence samples asks for no rows."""
    assert SplitBf16Head(torch.zeros(3000, 8).bfloat16())(torch.empty(0, 8)).shape == (0, 3000)


def test_a_table_in_another_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="bf16 table"):
        SplitBf16Head(torch.zeros(4, 4))
