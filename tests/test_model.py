"""The model against transformers' LlamaForCausalLM (the reference; a test dependency only), in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.engine.engine import Engine
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
