"""The simulated engine behind `kvmesh sim-engine` (kvmesh/bench/sim_engine.py has its latency model and CLI):
the real engine, with a model runner that sleeps instead of computing. LoRA adapters are the engine's own
(registry, endpoints, updates in place, /v1/models cards, vllm:lora_requests_info, blocks hashed with the adapter's
name and weights, the files checked as the engine checks them); only their weights are not applied, since the
simulated model has none to add them to."""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field

import torch

from kvmesh.bench.sim_engine import LatencyModel, Profile, served_name
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine, LoadedModel
from kvmesh.engine.model import loader
from kvmesh.engine.model.lora import LoraAdapter, read_adapter_config, read_adapter_tensors
from kvmesh.engine.model.tokenizer import Tokenizer
from kvmesh.engine.runner import ModelRunner, StepInput, StepResult

FIRST_ORDINARY_TOKEN = 100  # simulated outputs stay above the special tokens of the bundled vocabulary
NOT_CHOSEN = -1e9  # the logit of every token the simulated model does not pick


@dataclass
class SimLoraSlots:
    """The simulated model's adapter slots (the engine fills and clears them as the real model's): which adapter
    weights each holds (`name@fingerprint`), so an adapter's answers differ from the base model's, and new weights'
    (an update in place) from the old ones'."""

    weights: dict[int, str] = field(default_factory=dict)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        self.weights[slot] = f"{adapter.name}@{adapter.fingerprint}"

    def clear(self, slot: int) -> None:
        self.weights.pop(slot, None)


@dataclass
class SimModel:
    lora: SimLoraSlots = field(default_factory=SimLoraSlots)


class SimRunner(ModelRunner):
    """A model runner that computes nothing: it sleeps for the step's modelled time and picks, at each position that
    wants logits (`num_logits` per sequence: a draft run verifies several), one token determined by the token
    there, its position and the adapter's weights (the same prompt always gets the same answer, on every pod serving
    the same weights, whatever the sampling parameters). Its KV tensor holds one number per token, so KV transfer
    still moves (and checks) real frames."""

    def __init__(self, latency: LatencyModel, vocab_size: int, num_blocks: int, block_size: int) -> None:
        self.latency = latency
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = torch.device("cpu")
        self.kv_cache = torch.zeros((num_blocks, 1, 1, block_size, 1, 1), dtype=torch.float32)
        self.computed_tokens = 0
        self.steps = 0
        self.model = SimModel()

    def next_token(self, last_token: int, position: int, adapter: str | None = None) -> int:
        """`adapter`: the weights' `name@fingerprint` (SimLoraSlots), None for the base model."""
        span = self.vocab_size - FIRST_ORDINARY_TOKEN
        shift = zlib.crc32(adapter.encode()) if adapter is not None else 0  # stable across processes, unlike hash()
        return FIRST_ORDINARY_TOKEN + (last_token * 7919 + position * 104729 + shift) % span

    def run(self, seqs: list[StepInput]) -> StepResult:
        start = time.perf_counter()
        rows = [s for s in seqs if s.wants_logits]
        logits = torch.full((sum(s.num_logits for s in rows), self.vocab_size), NOT_CHOSEN)
        row = 0
        for s in rows:  # num_logits rows per sequence: each predicts the token after one of its last positions
            adapter = self.model.lora.weights.get(s.lora_slot) if s.lora_slot is not None else None
            for at in range(len(s.token_ids) - s.num_logits, len(s.token_ids)):
                logits[row, self.next_token(s.token_ids[at], s.num_computed + at + 1, adapter)] = 0.0
                row += 1
        num_tokens = sum(len(s.token_ids) for s in seqs)
        self.computed_tokens += num_tokens
        self.steps += 1
        time.sleep(max(0.0, self.latency.step_seconds(seqs) - (time.perf_counter() - start)))
        return StepResult(logits, num_tokens, time.perf_counter() - start)


class SimEngine(Engine):
    """The engine over a `SimRunner`: reading KV for a peer also takes the time the profile's link needs for the
    blocks' real size."""

    def __init__(self, config: EngineConfig, profile: Profile, latency: LatencyModel | None = None) -> None:
        self.latency = latency or profile.latency
        super().__init__(config, simulated_model(profile, config.served_model_name))

    def make_runner(self, loaded: LoadedModel, num_blocks: int) -> ModelRunner:
        return SimRunner(self.latency, loaded.tokenizer.vocab_size, num_blocks, self.config.block_size)

    def read_adapter_files(self, name: str, path: str) -> LoraAdapter:
        """A PEFT directory as the engine checks it (read_adapter_config: its files, its config, the PEFT features
        refused by name, its rank; read_adapter_tensors: its weights file opened and read whole, its keys), less
        the tensors' shapes, which are the adapter's base model's, not the simulated model's; the tensors are not
        kept. Its fingerprint is the engine's, so new weights under a name served before hash their blocks apart, as
        in the engine. Raises LoraError."""
        checked = read_adapter_config(name, path, self.config.max_lora_rank)
        fingerprint = read_adapter_tensors(name, checked).fingerprint
        return LoraAdapter(name, str(checked.where), checked.rank, checked.scale, {}, fingerprint)

    def read_frame(self, block_ids: list[int], hashes: list[int]) -> bytes:
        start = time.perf_counter()
        frame = super().read_frame(block_ids, hashes)
        wire = len(block_ids) * self.kv_config.block_bytes / self.latency.transfer_bytes_per_second
        time.sleep(max(0.0, wire - (time.perf_counter() - start)))
        return frame


def simulated_model(profile: Profile, configured_name: str | None = None) -> LoadedModel:
    """The bundled tokenizer (so a router over the bundled model indexes these pods) and the profile's shape."""
    model_dir = loader.resolve_model_dir(None, progress=False)
    tokenizer = Tokenizer.from_dir(model_dir)
    config = loader.ModelConfig(
        name=served_name(profile, configured_name),
        vocab_size=tokenizer.vocab_size,
        hidden_size=profile.num_kv_heads * profile.head_dim,
        intermediate_size=0,
        num_layers=profile.num_layers,
        num_heads=profile.num_kv_heads,
        num_kv_heads=profile.num_kv_heads,
        head_dim=profile.head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=profile.max_model_len,
        tie_word_embeddings=True,
        attention_bias=False,
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
    )
    return LoadedModel(config.name, config, tokenizer, None, getattr(torch, profile.dtype))  # type: ignore[arg-type]
