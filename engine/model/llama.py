"""The Llama architecture (Llama, SmolLM, Mistral, Qwen2, Qwen3) over a flat batch of tokens and the paged KV cache.

The families differ only in details a flag covers: Qwen2's q/k/v biases, Qwen3's RMSNorm over each q and k head
before RoPE (q_norm, k_norm), an o_proj bias where attention_bias says so. Mistral's sliding window is served by
capping the context to it (loader.py), so attention here is always over the whole context.

Weights arrive under Hugging Face names and are fused on load (q, k, v into one projection; gate and up into
one), so a layer is four matrix products, each in the form linear.py picks. The model sees tokens, positions
and attention metadata; it knows nothing of requests or blocks beyond that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.engine.attention import AttentionMetadata, paged_attention
from kvmesh.engine.kvcache import LayerKV
from kvmesh.engine.model.head import SplitBf16Head
from kvmesh.engine.model.linear import Linear, make_linear, onednn_bf16
from kvmesh.engine.model.loader import ModelConfig
from kvmesh.engine.model.lora import LoraSegment, LoraWeights


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the position scale for the configured RoPE scaling (none, linear, llama3)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq, 1.0 / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled), 1.0
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")


@dataclass(frozen=True)
class Layer:
    """One decoder layer: norms as weights, projections as callables (see linear.py)."""

    attn_norm: torch.Tensor
    qkv: Linear
    qk_norm: torch.Tensor | None  # Qwen3: [q heads + kv heads, head_dim], q_norm's weight per q head, k_norm's per k
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class Llama:
    """Forward pass of a Llama-architecture decoder with fused weights."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        quantization: str = "none",
        max_loras: int = 0,
        max_lora_rank: int = 0,
        attention_dtype: torch.dtype | None = None,
    ) -> None:
        """`attention_dtype`: what attention reads the context in (None: fp32 on a CPU, the serving dtype on CUDA;
        engine.pick_attention_dtype chooses per machine)."""
        self.config = config
        self.attention_dtype = attention_dtype
        self.device = device
        c = config
        embed = weights["model.embed_tokens.weight"]
        self.dtype = embed.dtype
        head = weights.get("lm_head.weight")
        tied = c.tie_word_embeddings or head is None
        # On a CPU, whatever the serving dtype, the residual stream, the norms and the vocabulary product run in
        # fp32 (the product, where oneDNN runs bf16, as head.py's split one: exact at each row's top) and only the
        # layers' products (and attention, where engine.pick_attention_dtype says so) in the serving dtype: bf16
        # rounding there flipped the bundled model's greedy answers (docs/architecture.md "Serving dtype"). On
        # CUDA they stay in the serving dtype, as other engines serve: an fp32 vocabulary product would cost a
        # large batch several ms a step and the head twice its memory (not measured here: no GPU). A tied table
        # is kept once.
        self.stream_dtype = torch.float32 if device.type == "cpu" else self.dtype
        self.lm_head: Linear
        if device.type == "cpu" and self.dtype == torch.bfloat16 and quantization == "none" and onednn_bf16():
            # the fp32 product's greedy choice at bf16 speed (head.py), from the bf16 table the embedding reads too
            self.embed = embed
            self.lm_head = SplitBf16Head(embed if tied else head)
        else:
            head_weight = (embed if tied else head).to(device, self.stream_dtype)
            self.embed = head_weight if tied else embed.to(device)
            self.lm_head = make_linear(head_weight, None, quantization, device, transpose=False)
        self.final_norm = weights["model.norm.weight"].to(device, self.stream_dtype)
        self.layers: list[Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if c.attention_bias:
                bias = torch.cat([weights[a + f"{n}_proj.bias"] for n in ("q", "k", "v")])
            qkv = torch.cat([weights[a + f"{n}_proj.weight"] for n in ("q", "k", "v")])
            qk_norm = None
            if c.qk_norm:
                qk_norm = torch.cat([weights[a + "q_norm.weight"].expand(c.num_heads, c.head_dim),
                                     weights[a + "k_norm.weight"].expand(c.num_kv_heads, c.head_dim)])
                qk_norm = qk_norm.to(device, torch.float32)
            gate_up = torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])
            self.layers.append(
                Layer(
                    attn_norm=weights[p + "input_layernorm.weight"].to(device, self.stream_dtype),
                    qkv=make_linear(qkv, bias, quantization, device),
                    qk_norm=qk_norm,
                    o=make_linear(weights[a + "o_proj.weight"], weights.get(a + "o_proj.bias"), quantization, device),
                    mlp_norm=weights[p + "post_attention_layernorm.weight"].to(device, self.stream_dtype),
                    gate_up=make_linear(gate_up, None, quantization, device),
                    down=make_linear(weights[p + "mlp.down_proj.weight"], None, quantization, device),
                )
            )
        # LoRA deltas on the four projections (lora.py); slots are allocated at the first adapter's load
        self.lora = LoraWeights(c, max_loras, max_lora_rank, self.dtype, device) if max_loras else None
        inv_freq, pos_scale = rope_inv_freq(c)
        positions = torch.arange(c.max_position_embeddings, dtype=torch.float64) * pos_scale
        freqs = torch.outer(positions, inv_freq)
        self.cos = freqs.cos().to(torch.float32).to(device)
        self.sin = freqs.sin().to(torch.float32).to(device)
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5

    def _rms_norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the residual stream, in its dtype (fp32 on a CPU)."""
        return F.rms_norm(h, (h.shape[-1],), weight, self.config.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE (HF's convention) on [T, heads, D], computed in fp32."""
        half = x.shape[-1] // 2
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def _project(self, linear: Linear, x: torch.Tensor, layer: int, name: str,
                 lora: Sequence[LoraSegment]) -> torch.Tensor:
        """The base projection, plus the adapters' deltas on their rows when the step has any."""
        y = linear(x)
        if lora:
            assert self.lora is not None, "LoRA segments given to a model built without adapter slots"
            self.lora.add(y, x, layer, name, lora)
        return y

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_layers: Sequence[tuple[LayerKV, LayerKV]],
        lora: Sequence[LoraSegment] = (),
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm (fp32 on a CPU, the serving dtype on CUDA), for a flat
        batch of T tokens. `lora`: the row segments that run with an adapter (rows outside every segment run the
        base model)."""
        c = self.config
        t = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed).to(self.stream_dtype)
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        for i, w in enumerate(self.layers):
            x = self._rms_norm(h, w.attn_norm).to(self.dtype)
            qkv = self._project(w.qkv, x, i, "qkv", lora)
            # q and k rotated in one pass: their columns are adjacent, so they are one run of heads
            qk = qkv[:, : self.q_size + self.kv_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim)
            if w.qk_norm is not None:  # in fp32, then rounded to the serving dtype (transformers: before the weight)
                qk = (F.rms_norm(qk.float(), (c.head_dim,), None, c.rms_norm_eps) * w.qk_norm).to(qkv.dtype)
            q, k = self._rope(qk, cos, sin).split([c.num_heads, c.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size :].view(t, c.num_kv_heads, c.head_dim)
            attn = paged_attention(q, k, v, kv_layers[i], meta, self.scale, self.attention_dtype)
            h = h + self._project(w.o, attn.reshape(t, self.q_size), i, "o", lora)
            x = self._rms_norm(h, w.mlp_norm).to(self.dtype)
            gate, up = self._project(w.gate_up, x, i, "gate_up", lora).chunk(2, dim=-1)
            h = h + self._project(w.down, F.silu(gate) * up, i, "down", lora)
        return self._rms_norm(h, self.final_norm)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, exact_rows: Sequence[int] = ()) -> torch.Tensor:
        """Vocabulary logits in fp32 for the given rows of hidden states; `exact_rows` get the exact product where
        the head otherwise approximates (head.py: its greedy choice is exact only before the sampler's changes)."""
        if isinstance(self.lm_head, SplitBf16Head):
            return self.lm_head(hidden, exact_rows)
        return self.lm_head(hidden).float()
