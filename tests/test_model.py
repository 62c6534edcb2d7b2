"""The model against transformers' LlamaForCausalLM (the reference; a test dependency only), in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.engine.engine import Engine
from kvmesh.engine.model.linear import make_linear, onednn_bf16
from kvmesh.engine.runner import StepInput

from .conftest import make_engine


@pytest.fixture(scope="module")
def reference(tiny_dir: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()


def _hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def _table(engine: Engine, start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_prefill_and_16_decode_steps_match_transformers(tiny_engine: Engine, reference) -> None:
    prompt = [(i * 7919) % 49152 for i in range(37)]
    table = _table(tiny_engine, 0, 8)
    logits = tiny_engine.runner.run([StepInput(table, 0, prompt, True)]).logits[0]
    ids = list(prompt)
    torch.testing.assert_close(logits, _hf_last_logits(reference, ids), atol=1e-4, rtol=0)
    for _ in range(16):
        ids.append(int(logits.argmax()))
        logits = tiny_engine.runner.run([StepInput(table, len(ids) - 1, ids[-1:], True)]).logits[0]
        torch.testing.assert_close(logits, _hf_last_logits(reference, ids), atol=1e-4, rtol=0)


def test_mixed_batch_of_chunks_and_decodes_matches_transformers(tiny_engine: Engine, reference) -> None:
    """One step holding a decode, a first prefill chunk, and a second chunk over a cached prefix."""
    a = [(i * 31) % 49152 for i in range(21)]
    b = [(i * 17 + 5) % 49152 for i in range(40)]
    c = [(i * 13 + 9) % 49152 for i in range(50)]
    ta, tb, tc = _table(tiny_engine, 10, 3), _table(tiny_engine, 20, 4), _table(tiny_engine, 30, 4)
    run = tiny_engine.runner.run
    run([StepInput(ta, 0, a[:-1], False), StepInput(tc, 0, c[:32], False)])
    out = run([StepInput(ta, 20, a[-1:], True), StepInput(tb, 0, b, True), StepInput(tc, 32, c[32:], True)])
    for row, ids in enumerate((a, b, c)):
        torch.testing.assert_close(out.logits[row], _hf_last_logits(reference, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("setting", [{"dtype": "bfloat16"}, {"quantization": "int8"}])
def test_faster_arithmetic_stays_close(tiny_dir: Path, reference, setting: dict[str, str]) -> None:
    engine = make_engine(tiny_dir, kv_cache_blocks=8, **setting)
    prompt = [(i * 7919) % 49152 for i in range(20)]
    logits = engine.runner.run([StepInput(list(range(2)), 0, prompt, True)]).logits[0]
    ref = _hf_last_logits(reference, prompt)
    assert torch.nn.functional.cosine_similarity(logits, ref, dim=0) > 0.99
    assert not torch.equal(logits, ref)  # it really is another computation


@pytest.mark.parametrize("attention_dtype", [torch.float32, torch.bfloat16])
def test_bf16_serving_stays_close_whichever_dtype_attention_reads(
    tiny_dir: Path, reference, attention_dtype: torch.dtype
) -> None:
    """engine.pick_attention_dtype keeps attention in bf16 on a CPU with AMX and in fp32 elsewhere: both, over
    a prefill and decode steps, stay close to transformers' fp32 and are different computations."""
    engine = make_engine(tiny_dir, dtype="bfloat16", kv_cache_blocks=8)
    engine.runner.model.attention_dtype = attention_dtype
    ids = [(i * 7919) % 49152 for i in range(20)]
    logits = engine.runner.run([StepInput([0, 1], 0, ids, True)]).logits[0]
    for _ in range(4):
        assert torch.nn.functional.cosine_similarity(logits, _hf_last_logits(reference, ids), dim=0) > 0.99
        ids.append(int(logits.argmax()))
        logits = engine.runner.run([StepInput([0, 1], len(ids) - 1, ids[-1:], True)]).logits[0]
    engine.runner.model.attention_dtype = torch.float32 if attention_dtype == torch.bfloat16 else torch.bfloat16
    other = engine.runner.run([StepInput([2, 3], 0, ids, True)]).logits[0]
    engine.runner.model.attention_dtype = attention_dtype
    again = engine.runner.run([StepInput([4, 5], 0, ids, True)]).logits[0]
    assert not torch.equal(other, again)


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_bf16_products_on_a_cpu_are_torchs_linear(rows: int) -> None:
    """bf16 weights on a CPU whose oneDNN runs bf16 are reordered once into oneDNN's layout (model/linear.py):
    the products are bit for bit torch's `F.linear`, with and without a bias, for any row count."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    for bias in (None, b):
        got = make_linear(w, bias, "none", torch.device("cpu"))(x)
        want = torch.nn.functional.linear(x, w, bias)
        if onednn_bf16():
            assert torch.equal(got, want)
        else:  # the transposed-weight product: the same sums, perhaps in another order
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
