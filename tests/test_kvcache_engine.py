"""An engine with an int8 KV cache (`kv_cache_dtype: int8`, engine/kvcache.py), on the tiny model: more blocks in
the same memory, answers close to the model-dtype cache's, a cached prefix giving exactly what recomputing it
gives, KV moving between two int8 engines, a peer of the other format refused without failing the request,
and the host tier carrying int8 blocks. (The Triton path over an int8 cache: tests/test_kernels_int8.py and
tests/test_kernels_engine.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from kvmesh.cli import main
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.protocol import read_engine_metrics
from kvmesh.engine.runner import StepInput

from .conftest import make_engine
from .engines import serve_engine
from .test_engine import generate, prompt


def test_the_same_memory_holds_more_blocks(tiny_dir: Path) -> None:
    auto = make_engine(tiny_dir, kv_cache_blocks=None, kv_cache_memory_mib=4)
    int8 = make_engine(tiny_dir, kv_cache_blocks=None, kv_cache_memory_mib=4, kv_cache_dtype="int8")
    dim = auto.model_config.head_dim
    assert auto.kv_config.block_bytes / int8.kv_config.block_bytes == pytest.approx(4 * dim / (dim + 4))
    assert int8.kv.pool.num_blocks >= 3 * auto.kv.pool.num_blocks
    assert int8.kv_config.kv_cache_dtype == "int8" and auto.kv_config.kv_cache_dtype == "auto"
    info = f'cache_dtype="int8",kv_format="int8",num_gpu_blocks="{int8.kv.pool.num_blocks}"'
    assert info in int8.metrics.render().decode()
    assert read_engine_metrics(int8.metrics.render().decode()).cache_dtype == "int8"  # what the operator reads


def test_auto_caches_of_two_model_dtypes_are_told_apart(tiny_dir: Path) -> None:
    """A rolling change of the model's dtype (fp32 to bf16 weights) keeps `kv_cache_dtype: auto`; the blocks' bytes
    differ all the same, so pulls, handoffs and warm-ups must not pair the two: the stored format says so."""
    fp32, bf16 = (make_engine(tiny_dir, dtype=d, kv_cache_blocks=8) for d in ("float32", "bfloat16"))
    assert (fp32.kv_config.kv_format, bf16.kv_config.kv_format) == ("float32", "bfloat16")
    assert fp32.kv_config.kv_cache_dtype == bf16.kv_config.kv_cache_dtype == "auto"
    assert not fp32.kv_config.stores_like(bf16.kv_config)
    assert fp32.kv_config.stores_like(make_engine(tiny_dir, kv_cache_blocks=8).kv_config)
    scraped = read_engine_metrics(bf16.metrics.render().decode())  # what the operator's warm-up pairing reads
    assert (scraped.cache_dtype, scraped.kv_format) == ("auto", "bfloat16")


def test_logits_stay_close_to_the_model_dtype_cache(tiny_dir: Path) -> None:
    """A 40-token prompt in three chunks and two decode steps, so later tokens attend over quantized KV."""
    engines = [make_engine(tiny_dir, kv_cache_blocks=16, kv_cache_dtype=d) for d in ("auto", "int8")]
    ids = prompt(5, 42)
    table = [3, 9, 1]
    steps = [(0, ids[:16]), (16, ids[16:32]), (32, ids[32:40]), (40, ids[40:41]), (41, ids[41:42])]
    divergences = []
    for computed, new in steps:
        want, got = (e.runner.run([StepInput(table, computed, new, True)]).logits.log_softmax(-1) for e in engines)
        divergences.append(torch.sum(want.exp() * (want - got)).item())  # KL(model-dtype cache || int8 cache)
        assert got.argmax() == want.argmax()
    assert 0 < max(divergences) < 2e-3  # measured: 2e-4 to 6e-4 nats


def test_a_cached_prefix_answers_exactly_as_recomputing_it(tiny_dir: Path) -> None:
    """Quantizing a row depends on that row alone, so cached blocks hold what recomputing would write."""
    cold = make_engine(tiny_dir, kv_cache_dtype="int8")
    warm = make_engine(tiny_dir, kv_cache_dtype="int8")
    base = prompt(11, 70)
    generate(warm, [base])
    [reused] = generate(warm, [[*base[:64], 5, 6, 7]], max_tokens=12)
    [fresh] = generate(cold, [[*base[:64], 5, 6, 7]], max_tokens=12)
    assert reused.final.cached_tokens == 64 and fresh.final.cached_tokens == 0
    assert reused.tokens == fresh.tokens


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        EngineConfig(kv_cache_dtype="fp8").validate()


def _complete(url: str, **body: object) -> dict:
    reply = httpx.post(url + "/v1/completions", json={"return_token_ids": True, "temperature": 0, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.slow
def test_kv_moves_between_int8_engines_and_not_across_formats(tiny_dir: Path) -> None:
    source = make_engine(tiny_dir, kv_cache_dtype="int8")
    same = make_engine(tiny_dir, kv_cache_dtype="int8")
    other = make_engine(tiny_dir)
    ids = prompt(21, 130)
    with serve_engine(source) as src, serve_engine(same) as dst, serve_engine(other) as mixed:
        reference = _complete(src, prompt=[*ids, 7, 7], max_tokens=6)["choices"][0]["token_ids"]
        pulled = _complete(dst, prompt=[*ids, 7, 7], max_tokens=6,
                           kv_transfer={"mode": "pull", "source": src, "tokens": 128})
        assert pulled["usage"]["prompt_tokens_details"]["kvmesh_cached_by_source"]["peer"] == 128
        assert pulled["choices"][0]["token_ids"] == reference  # the pulled bytes are the source's own KV
        refused = _complete(mixed, prompt=[*ids, 7, 7], max_tokens=6,
                            kv_transfer={"mode": "pull", "source": src, "tokens": 128})
        assert refused["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed, not failed
        failed = httpx.get(mixed + "/metrics").text
        assert 'kvmesh_kv_transfers_total{kind="pull",outcome="failed"} 1.0' in failed


def test_the_host_tier_carries_int8_blocks(tiny_dir: Path, tmp_path: Path) -> None:
    """The device forgets a prefix; the host tier's int8 copy (values and scales, one run a block) answers
    exactly as recomputing would."""
    cold = make_engine(tiny_dir, kv_cache_dtype="int8")
    engine = make_engine(tiny_dir, kv_cache_dtype="int8", kv_cache_blocks=64, kv_host_memory_mib=1,
                         kv_host_path=str(tmp_path / "host.kv"), kv_tier_cost_profile="cpu")
    try:
        ids = prompt(31, 100)
        generate(engine, [ids])
        engine.kv.pool.clear()  # only the host tier holds the prefix now
        [loaded] = generate(engine, [[*ids, 7, 8]], max_tokens=8)
        [fresh] = generate(cold, [[*ids, 7, 8]], max_tokens=8)
        assert loaded.final.cached_by_tier["host"] == 96
        assert loaded.tokens == fresh.tokens
    finally:
        engine.close()


@pytest.mark.slow
def test_the_kv_cache_benchmark_reports_every_section(tiny_dir: Path, tmp_path: Path) -> None:
    """`kvmesh bench kv-cache` on the tiny model at toy sizes: both formats side by side in every section."""
    out = tmp_path / "kv-cache.json"
    assert main(["bench", "kv-cache", "--model", str(tiny_dir), "--dtype", "float32", "--concurrency", "3",
                 "--prompt-tokens", "40", "--output-tokens", "4", "--accuracy-prompts", "1", "--accuracy-tokens", "3",
                 "--budget-mib", "1", "--ample-mib", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    auto, int8 = report["capacity"]
    assert int8["blocks"] > 3 * auto["blocks"]
    assert report["accuracy"]["positions"] == 3 and 0 <= report["accuracy"]["top1_agreement"] <= 1
    runs = {(r["kv_cache_dtype"], r["budget_mib"]) for r in report["throughput"]}
    assert runs == {("auto", 1), ("int8", 1), ("auto", 4), ("int8", 4)}
    assert all(r["output_tokens_per_second"] > 0 for r in report["throughput"])


def test_the_kv_cache_benchmark_refuses_a_bad_question_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "kv-cache", "--accuracy-prompts", "0"]) == 2
    assert "--accuracy-prompts must be 1 to 8" in capsys.readouterr().err
