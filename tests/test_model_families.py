"""The model families beyond Llama against transformers (the reference; a test dependency only), in fp32: Qwen3
(q_norm and k_norm per head, a head_dim other than hidden / heads, tied embeddings or biases) and Mistral (with a
sliding window wider than the context, and one narrower, which caps the served context), from Hugging Face
directories and a Qwen3 GGUF laid out as llama.cpp writes one: logits of a prefill and decode steps through the
paged KV cache, greedy generation through the engine, the faster arithmetic, LoRA, the families' errors."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kvmesh.engine.model.loader import load_config, load_weights, resolve_model_dir
from kvmesh.engine.model.lora import TARGET_MODULES, module_shapes
from kvmesh.engine.runner import StepInput

from .conftest import TOKENIZER_FILES, make_engine
from .test_engine import generate, prompt
from .test_loader import GGUF_TOKENS, write_gguf
from .test_lora import hf_greedy, run

ATOL = 1e-4  # fp32 logits against transformers (as tests/test_model.py)
WINDOW = 16  # mistral-window's sliding window, narrower than its 1,024 positions
# name -> (transformers class, its config's settings); every model has 2 layers and GQA 4:2
FAMILIES: dict[str, tuple[str, dict[str, object]]] = {
    # head_dim 64 (the Triton kernels' smaller head size) over a hidden size of 128: hidden / heads would be 32
    "qwen3": ("Qwen3", {"hidden_size": 128, "head_dim": 64, "tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen3-bias": ("Qwen3", {"hidden_size": 64, "head_dim": 16, "tie_word_embeddings": False,
                             "attention_bias": True}),
    # llama with attention_bias: biases on q, k, v and o (the o_proj bias was once dropped)
    "llama-bias": ("Llama", {"hidden_size": 64, "tie_word_embeddings": False, "attention_bias": True}),
    "mistral": ("Mistral", {"hidden_size": 64, "tie_word_embeddings": False, "sliding_window": 4096}),
    "mistral-window": ("Mistral", {"hidden_size": 64, "tie_word_embeddings": False, "sliding_window": WINDOW}),
}


def _hf_model(family: str, vocab_size: int) -> torch.nn.Module:
    """A random two-layer model of the family, its norms' weights random too (a q_norm swapped with a k_norm, or a
    norm left out, changes the logits)."""
    import transformers

    kind, settings = FAMILIES[family]
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=vocab_size, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, **settings,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                weight.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, bundled_dir: Path) -> dict[str, tuple[Path, torch.nn.Module]]:
    """family -> (its directory, saved by transformers with the bundled tokenizer, and the model as reference)."""
    saved = {}
    for family in FAMILIES:
        model = _hf_model(family, 49152)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (bundled_dir / name).exists() and not (path / name).exists():
                shutil.copy(bundled_dir / name, path / name)
        saved[family] = (path, model)
    return saved


def _hf_last_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def _prompt_and_steps(family: str) -> tuple[list[int], int]:
    """A prompt and a number of decode steps that stay within the family's served context."""
    return (prompt(3, 10), 5) if family == "mistral-window" else (prompt(3, 37), 8)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_and_decode_steps_match_transformers(models, family: str) -> None:
    path, reference = models[family]
    engine = make_engine(path, kv_cache_blocks=16)
    ids, steps = _prompt_and_steps(family)
    table = list(range(4))
    logits = engine.runner.run([StepInput(table, 0, ids, True)]).logits[0]
    torch.testing.assert_close(logits, _hf_last_logits(reference, ids), atol=ATOL, rtol=0)
    for _ in range(steps):
        ids = [*ids, int(logits.argmax())]
        logits = engine.runner.run([StepInput(table, len(ids) - 1, ids[-1:], True)]).logits[0]
        torch.testing.assert_close(logits, _hf_last_logits(reference, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers_generate(models, family: str) -> None:
    """Two prompts batched through the engine's scheduler, cache and sampler give transformers' greedy tokens."""
    path, reference = models[family]
    engine = make_engine(path, kv_cache_blocks=16)
    prompts = [prompt(5, 8), prompt(6, 7)]
    results = generate(engine, prompts, max_tokens=8)
    for ids, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        assert result.tokens == out[0, len(ids):].tolist()
    engine.kv.check_invariants()


def test_a_narrow_sliding_window_caps_the_served_context(models, caplog: pytest.LogCaptureFixture) -> None:
    """Within its window a sliding layer attends to everything before it, so the capped model is exact (the logits
    tests above run mistral-window up to its window); a window as wide as the context changes nothing."""
    with caplog.at_level(logging.WARNING, logger="kvmesh.engine.loader"):
        assert load_config(models["mistral"][0]).max_position_embeddings == 1024
        assert not caplog.records
        assert load_config(models["mistral-window"][0]).max_position_embeddings == WINDOW
    assert f"sliding window of {WINDOW} tokens; serving at most {WINDOW} tokens" in caplog.text
    assert make_engine(models["mistral-window"][0], kv_cache_blocks=4).max_model_len == WINDOW


@pytest.mark.parametrize(
    ("settings", "context"),
    [
        ({"model_type": "mistral", "sliding_window": None}, 1024),
        ({"model_type": "mistral", "sliding_window": 100}, 100),
        # Qwen's configs often carry a sliding_window they do not use
        ({"model_type": "qwen2", "sliding_window": 100, "use_sliding_window": False}, 1024),
        ({"model_type": "qwen3", "sliding_window": 100, "use_sliding_window": True}, 100),
        # transformers 5 lists each layer's attention
        ({"model_type": "qwen3", "sliding_window": 100, "layer_types": ["full_attention"] * 2}, 1024),
        ({"model_type": "qwen3", "sliding_window": 100, "layer_types": ["full_attention", "sliding_attention"]}, 100),
        ({"model_type": "llama", "sliding_window": 100}, 1024),
    ],
)
def test_which_configs_slide(tmp_path: Path, settings: dict[str, object], context: int) -> None:
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "max_position_embeddings": 1024, "eos_token_id": 3}
    (tmp_path / "config.json").write_text(json.dumps({**base, **settings}))
    config = load_config(tmp_path)
    assert config.max_position_embeddings == context
    assert config.qk_norm == (settings["model_type"] == "qwen3")


@pytest.mark.parametrize("setting", [{"dtype": "bfloat16"}, {"quantization": "int8"}])
def test_faster_arithmetic_stays_close_for_qwen3(models, setting: dict[str, str]) -> None:
    path, reference = models["qwen3"]
    engine = make_engine(path, kv_cache_blocks=8, **setting)
    ids = prompt(7, 20)
    logits = engine.runner.run([StepInput([0, 1], 0, ids, True)]).logits[0]
    ref = _hf_last_logits(reference, ids)
    assert torch.nn.functional.cosine_similarity(logits, ref, dim=0) > 0.99
    assert not torch.equal(logits, ref)  # it really is another computation


def test_lora_on_qwen3_matches_the_merged_model(models, tmp_path: Path) -> None:
    """An adapter on every target module of a model whose q/k/v widths are not the hidden size, with a base request
    in the same batch: greedy tokens and logprobs of transformers with the adapter merged (W + scale B A)."""
    path, reference = models["qwen3"]
    engine = make_engine(path, kv_cache_blocks=16, max_loras=1, max_lora_rank=4)
    rank, alpha = 4, 8.0
    g = torch.Generator().manual_seed(1)
    tensors, merged = {}, copy.deepcopy(reference)
    for layer in range(2):
        for module, (fan_in, fan_out) in module_shapes(engine.model_config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            a, b = torch.randn(rank, fan_in, generator=g) * 0.3, torch.randn(fan_out, rank, generator=g) * 0.3
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            with torch.no_grad():
                merged.get_submodule(f"model.layers.{layer}.{part}.{module}").weight += alpha / rank * b @ a
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(TARGET_MODULES)}))
    engine.add_lora(engine.read_lora("all", str(tmp_path)))
    ids = prompt(8, 12)
    with_lora, base = run(engine, [("all", ids), (None, ids)])
    for result, model in ((with_lora, merged), (base, reference)):
        tokens, logprobs = hf_greedy(model, ids, 6)
        assert result.tokens == tokens
        np.testing.assert_allclose(result.logprobs, logprobs, atol=1e-3)
    assert with_lora.tokens != base.tokens


def test_qwen3_gguf_converts_and_serves_like_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "Tiny-qwen3-F32.gguf"
    reference = write_gguf(path, _hf_model("qwen3", len(GGUF_TOKENS)), "qwen3")
    model_dir = resolve_model_dir(str(path), progress=False)
    config = load_config(model_dir)
    assert config.qk_norm and config.tie_word_embeddings and not config.attention_bias
    assert (config.hidden_size, config.num_heads, config.head_dim) == (128, 4, 64)
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]

    ours = load_weights(model_dir, torch.float32)
    expected = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name  # q and k rows unpermuted: llama.cpp keeps qwen3's as HF's

    engine = make_engine(model_dir, kv_cache_blocks=4)
    ids = [3, 50, 120, 7, 200, 260, 1, 9]
    logits = engine.runner.run([StepInput([0], 0, ids, True)]).logits[0]
    torch.testing.assert_close(logits, _hf_last_logits(reference, ids), atol=ATOL, rtol=0)


def test_other_families_are_refused_naming_the_supported_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "vocab_size": 10}))
    with pytest.raises(ValueError, match="unsupported model_type 'gemma3'; supported: llama, mistral, qwen2, qwen3"):
        load_config(tmp_path)
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'; supported: llama, qwen2, qwen3"):
        resolve_model_dir(str(tmp_path / "phi3.gguf"), progress=False)
