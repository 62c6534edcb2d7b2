"""The engine with its attention forced onto the Triton kernels (run by Triton's CPU interpreter) computes what
the torch path computes: prefill, extend over a cached prefix, chunked prefill and decode, in mixed batches,
over the tiny two-layer model; a launch counter proves the kernels ran. And the backend choice itself."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined: triton decides when a kernel is decorated

from pathlib import Path

import pytest
import torch

from kvmesh.engine.attention import resolve_backend
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.runner import ModelRunner, StepInput

from .conftest import make_engine
from .test_engine import generate, prompt


def launches() -> dict[str, int]:
    from kvmesh.engine.kernels.common import LAUNCHES

    return dict(LAUNCHES)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_runner_logits_match_the_torch_path_step_by_step(tiny_dir: Path, kv_cache_dtype: str) -> None:
    """The same three steps through both backends: a ragged prefill, then one sequence extending its cached
    prefix while the other decodes (one mixed batch), then both decoding. Logits agree to fp32 rounding, and an
    int8 cache holds the same values after either backend wrote it: the same bytes in layer 0 (same inputs), and
    at most one quantization step apart in later layers (their inputs differ by fp32 rounding)."""
    engine = make_engine(tiny_dir, kv_cache_blocks=32, kv_cache_dtype=kv_cache_dtype)
    model = engine.runner.model
    runners = [ModelRunner(model, 32, engine.kv_layout, model.device, attention_backend=name)
               for name in ("torch", "triton")]
    assert [r.attention_backend for r in runners] == ["torch", "triton"]
    a, b = prompt(1, 40), prompt(2, 21)
    table_a, table_b = [7, 3, 12, 30], [5, 0, 9]  # permuted, non-contiguous
    steps = [
        [StepInput(table_a, 0, a[:20], True), StepInput(table_b, 0, b[:20], True)],
        [StepInput(table_a, 20, a[20:39], True), StepInput(table_b, 20, b[20:21], True)],
        [StepInput(table_b, 21, [11], True), StepInput(table_a, 39, a[39:], True)],
    ]
    before = launches()
    for step in steps:
        expected, actual = (r.run(step).logits for r in runners)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    after = launches()
    layers = model.config.num_layers
    assert after.get("kv_write", 0) - before.get("kv_write", 0) == 3 * layers
    assert after.get("extend", 0) - before.get("extend", 0) == 2 * layers
    assert after.get("decode", 0) - before.get("decode", 0) == 2 * layers
    if kv_cache_dtype == "int8":
        (k0, v0), *rest = runners[0].kv_layers
        (k1, v1), *others = runners[1].kv_layers
        for mine, theirs in ((k1, k0), (v1, v0)):  # layer 0: the very same bytes
            assert torch.equal(mine.values, theirs.values) and torch.equal(mine.scales, theirs.scales)
        for (a, b), (c, d) in zip(rest, others, strict=True):
            for mine, theirs in ((c, a), (d, b)):
                assert (mine.values.short() - theirs.values.short()).abs().max() <= 1
                torch.testing.assert_close(mine.scales, theirs.scales, atol=1e-6, rtol=1e-5)
    else:
        torch.testing.assert_close(runners[1].kv_cache, runners[0].kv_cache, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_engine_outputs_equal_the_torch_path(tiny_dir: Path) -> None:
    """Greedy generations through the whole engine: a prompt, then one sharing its prefix (a cache hit, so an
    extend over cached blocks), then three at once with a small token budget (chunked prefill beside decodes)."""
    shared = prompt(4, 48)
    first = [[*shared, 1, 2, 3]]
    second = [[*shared, 9, 8, 7, 6, 5]]
    batch = [prompt(5, 30), prompt(6, 7), [*shared, 4]]
    torch_engine = make_engine(tiny_dir, kv_cache_blocks=64, max_num_batched_tokens=32)
    triton_engine = make_engine(tiny_dir, kv_cache_blocks=64, max_num_batched_tokens=32, attention_backend="triton")
    assert triton_engine.runner.attention_backend == "triton"
    before = launches()
    results = []
    for engine in (torch_engine, triton_engine):
        runs = [generate(engine, p, logprobs=True, max_tokens=5) for p in (first, second, batch)]
        results.append([r for run in runs for r in run])
    for expected, actual in zip(*results, strict=True):
        assert actual.tokens == expected.tokens
        assert actual.final.cached_tokens == expected.final.cached_tokens
        assert max(abs(x - y) for x, y in zip(actual.logprobs, expected.logprobs, strict=True)) < 1e-4
    assert results[1][1].final.cached_tokens == 48  # the second prompt extended a cached prefix
    after = launches()
    for kernel in ("kv_write", "extend", "decode"):
        assert after.get(kernel, 0) > before.get(kernel, 0), f"the {kernel} kernel never ran"


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("torch", cpu) == "torch"
    assert resolve_backend("triton", cpu) == "triton"  # allowed here only because the interpreter is on
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_backend("cuda", cpu)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA device, or TRITON_INTERPRET=1"):
        resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash").validate()
