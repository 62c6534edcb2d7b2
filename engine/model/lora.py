"""LoRA adapters over the base model: read PEFT directories, keep them in preallocated slots, add their deltas.

For a target projection y = x W^T, an adapter adds scale * (x A^T) B^T. Weights sit in `max_loras` slots of
`max_lora_rank`, allocated once (at the first load, so an engine that never serves an adapter pays nothing) and
overwritten in place, so loading never reallocates the model. A step's tokens come grouped by adapter (the
runner sorts its sequences), so each adapter present adds its delta to one contiguous row segment: punica's
segmented idea with torch matmuls, and a batch without adapters runs no extra code at all.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from kvmesh.engine.model.loader import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The model's fused projections (llama.py concatenates them in this order) and the PEFT modules inside each.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
TARGET_MODULES: tuple[str, ...] = tuple(m for subs in PROJECTIONS.values() for m in subs)
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class LoraError(ValueError):
    """A bad or unsupported adapter, or a request the adapters' state refuses (the server answers 400)."""


class LoraConflict(LoraError):
    """Refused because of what is loaded or running now: too many adapters, or one still in use (409)."""


class LoraNotFound(LoraError, LookupError):
    """No adapter of that name is loaded (404)."""


@dataclass(frozen=True)
class LoraAdapter:
    """One PEFT adapter as read from disk: per (layer, module) its A [r, in] and B [out, r], and its scale."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    fingerprint: str  # of the files' bytes: its requests' blocks are hashed with it, so weights never share KV


@dataclass(frozen=True)
class LoraSegment:
    """Rows [start, end) of a step's flat batch run with the adapter in `slot`."""

    start: int
    end: int
    slot: int


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module of the base model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _refuse_unsupported(cfg: dict, where: Path) -> None:
    """PEFT features this engine does not compute are refused by name, never silently ignored."""
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraError(f"{where}: peft_type {peft_type!r} is not supported; only LORA adapters are")
    if cfg.get("use_dora"):
        raise LoraError(f"{where}: DoRA adapters (use_dora: true) are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias {cfg['bias']!r} is not supported; only bias: none")
    if cfg.get("fan_in_fan_out"):
        raise LoraError(f"{where}: fan_in_fan_out adapters (GPT-2 Conv1D layout) are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoraError(f"{where}: {key} (a rank or alpha per module) is not supported; one r and lora_alpha")
    if cfg.get("modules_to_save"):
        raise LoraError(f"{where}: modules_to_save ({cfg['modules_to_save']}) is not supported: only LoRA "
                        f"deltas on {', '.join(TARGET_MODULES)}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):  # a regex over module names: the weights' keys are checked instead
        targets = []
    if not isinstance(targets, list | None) or not all(isinstance(t, str) for t in targets or ()):
        raise LoraError(f"{where}: target_modules must be a list of module names, got {targets!r}")
    unsupported = sorted(set(targets or ()) - set(TARGET_MODULES))
    if unsupported:
        raise LoraError(f"{where}: target modules {', '.join(unsupported)} are not supported; supported: "
                        f"{', '.join(TARGET_MODULES)} (embed_tokens and lm_head are not)")


@dataclass(frozen=True)
class AdapterConfig:
    """A PEFT LoRA directory's checked config: where it is, its rank and scale, and its config file's bytes."""

    where: Path
    rank: int
    scale: float
    config_bytes: bytes


def read_adapter_config(name: str, path: str, max_rank: int) -> AdapterConfig:
    """The checks of a PEFT directory that need no tensor: its files, its config's rank and alpha, the PEFT features
    refused by name, the rank against `max_rank`. Raises LoraError."""
    where = Path(path).expanduser()
    if not (where / CONFIG_FILE).is_file():
        raise LoraError(f"LoRA adapter {name!r}: {where} has no {CONFIG_FILE} (is it a PEFT adapter directory?)")
    if not (where / WEIGHTS_FILE).is_file():
        raise LoraError(f"LoRA adapter {name!r}: {where} has no {WEIGHTS_FILE} (pickled .bin weights are not read)")
    try:
        config_bytes = (where / CONFIG_FILE).read_bytes()
        cfg = json.loads(config_bytes)
        rank, alpha = cfg["r"], cfg["lora_alpha"]
    except OSError as exc:
        raise LoraError(f"LoRA adapter {name!r}: cannot read {where / CONFIG_FILE}: {exc}") from None
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise LoraError(f"{where / CONFIG_FILE}: needs integer r and number lora_alpha ({exc!r})") from None
    # exact types: 1.5 is no rank, and 1e999 (JSON's infinity) or NaN no scale
    if isinstance(rank, bool) or not isinstance(rank, int) or isinstance(alpha, bool) \
            or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoraError(f"{where / CONFIG_FILE}: needs integer r and a finite number lora_alpha (r {rank!r}, "
                        f"lora_alpha {alpha!r})")
    _refuse_unsupported(cfg, where)
    if not 1 <= rank <= max_rank:
        raise LoraError(f"LoRA adapter {name!r} has rank {rank}; this engine takes ranks 1 to {max_rank} "
                        f"(max_lora_rank)")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterConfig(where, rank, scale, config_bytes)


@dataclass(frozen=True)
class AdapterTensors:
    """A PEFT LoRA weights file as read: per (layer, module) its A and B, and the adapter's fingerprint."""

    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    fingerprint: str  # of the config's bytes and every tensor's key and values


def read_adapter_tensors(name: str, checked: AdapterConfig) -> AdapterTensors:
    """The checks of the weights file that need no base model, shared with the simulated engine so it refuses the
    files the engine refuses: safetensors opens it and reads every tensor (a damaged or foreign file is refused),
    each key is a LoRA A or B of a target module, each module has both, and it holds at least one. Raises
    LoraError."""
    where = checked.where / WEIGHTS_FILE
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    digest = hashlib.sha256(checked.config_bytes)
    try:
        with safe_open(str(where), framework="pt") as f:
            for key in sorted(f.keys()):
                match = _KEY.match(key)
                if match is None or match.group(2) not in TARGET_MODULES:
                    raise LoraError(f"{where}: tensor {key!r} is not a LoRA A or B weight of "
                                    f"{', '.join(TARGET_MODULES)}; embeddings, lm_head and other modules are not "
                                    f"supported")
                tensor = f.get_tensor(key)
                digest.update(key.encode() + tensor.float().numpy().tobytes())
                halves.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    except LoraError:
        raise
    except Exception as exc:  # safetensors' own errors: a damaged or foreign file
        raise LoraError(f"{where} could not be read: {exc}") from None
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_{'B' if 'A' in ab else 'A'}")
        pairs[(layer, module)] = (ab["A"], ab["B"])
    if not pairs:
        raise LoraError(f"LoRA adapter {name!r}: {where} holds no LoRA weights")
    return AdapterTensors(pairs, digest.hexdigest()[:16])


def read_adapter(name: str, path: str, config: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    """Read and check a PEFT LoRA directory against the base model; raises LoraError naming the problem."""
    checked = read_adapter_config(name, path, max_rank)
    tensors = read_adapter_tensors(name, checked)
    rank, shapes = checked.rank, module_shapes(config)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), (a, b) in tensors.pairs.items():
        fan_in, fan_out = shapes[module]
        if layer >= config.num_layers:
            raise LoraError(f"LoRA adapter {name!r} names layer {layer}; the model has {config.num_layers}")
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; this model and r={rank} need A {(rank, fan_in)} and B "
                            f"{(fan_out, rank)} (an adapter of another base model?)")
        weights[(layer, module)] = (a.to(dtype), b.to(dtype))
    return LoraAdapter(name, str(checked.where), rank, checked.scale, weights, tensors.fingerprint)


@dataclass
class _Slot:
    rank: int = 0
    # per layer, per projection: which of its modules (index in PROJECTIONS[p]) the adapter changes
    modules: list[dict[str, tuple[int, ...]]] = field(default_factory=list)


class LoraWeights:
    """The adapters' weights in `max_loras` slots of `max_rank`, per projection stacked over slots and layers:
    A as [slot, layer, modules x rank, in] (an adapter's modules packed at its own rank, so one contiguous slice
    feeds one matmul), B per module as [slot, layer, rank, out] with the scale folded in."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        shapes = module_shapes(config)
        self._in = {p: shapes[subs[0]][0] for p, subs in PROJECTIONS.items()}
        self._outs = {p: [shapes[m][1] for m in subs] for p, subs in PROJECTIONS.items()}
        self.out_slices = {p: [(sum(outs[:j]), sum(outs[: j + 1])) for j in range(len(outs))]
                           for p, outs in self._outs.items()}
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, list[torch.Tensor]] = {}
        self.slots = [_Slot() for _ in range(max_loras)]

    def nbytes(self) -> int:
        """What all slots take once allocated."""
        per_slot = sum(len(subs) * self.max_rank * self._in[p] + self.max_rank * sum(self._outs[p])
                       for p, subs in PROJECTIONS.items())
        return per_slot * self.config.num_layers * self.max_loras * self.dtype.itemsize

    def _allocate(self) -> None:
        n, layers, r = self.max_loras, self.config.num_layers, self.max_rank
        for p, subs in PROJECTIONS.items():
            self.a[p] = torch.zeros(n, layers, len(subs) * r, self._in[p], dtype=self.dtype, device=self.device)
            self.b[p] = [torch.zeros(n, layers, r, out, dtype=self.dtype, device=self.device)
                         for out in self._outs[p]]

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` into `slot` (in place; the slot must be unused by any running sequence)."""
        assert 0 <= slot < self.max_loras and adapter.rank <= self.max_rank
        if not self.a:
            self._allocate()
        r = adapter.rank
        modules: list[dict[str, tuple[int, ...]]] = []
        for layer in range(self.config.num_layers):
            present: dict[str, tuple[int, ...]] = {}
            for p, subs in PROJECTIONS.items():
                self.a[p][slot, layer].zero_()
                found = []
                for j, module in enumerate(subs):
                    ab = adapter.weights.get((layer, module))
                    if ab is None:
                        continue
                    a, b = ab
                    self.a[p][slot, layer, j * r : (j + 1) * r].copy_(a)
                    self.b[p][j][slot, layer, :r].copy_((b.float() * adapter.scale).t())
                    found.append(j)
                if found:
                    present[p] = tuple(found)
            modules.append(present)
        self.slots[slot] = _Slot(r, modules)

    def clear(self, slot: int) -> None:
        """Forget the slot's adapter (its tensors are overwritten by the next write)."""
        self.slots[slot] = _Slot()

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str,
            segments: Sequence[LoraSegment]) -> None:
        """out[rows] += scale * (x[rows] A^T) B^T, per segment, for the modules its adapter changes."""
        a_all, b_all, slices = self.a[projection], self.b[projection], self.out_slices[projection]
        n = len(PROJECTIONS[projection])
        for seg in segments:
            slot = self.slots[seg.slot]
            modules = slot.modules[layer].get(projection)
            if not modules:
                continue
            r = slot.rank
            xa = F.linear(x[seg.start : seg.end], a_all[seg.slot, layer, : n * r])
            for j in modules:
                lo, hi = slices[j]
                out[seg.start : seg.end, lo:hi].addmm_(xa[:, j * r : (j + 1) * r], b_all[j][seg.slot, layer, :r])


@dataclass(frozen=True)
class LoadedLora:
    name: str
    path: str
    slot: int
    rank: int
    fingerprint: str  # its weights': its requests' blocks are hashed with it (BlockExtra.lora_fingerprint)


@dataclass(frozen=True)
class LoraUpdate:
    """What an in-place update did: the name's entry now and the one it replaced; `revived` when the new entry's
    slot is a retired one that already holds those weights (nothing to write)."""

    new: LoadedLora
    old: LoadedLora
    revived: bool


class LoraRegistry:
    """Which adapter names are loaded and in which slot, and which slots still hold earlier weights of a name updated
    in place while requests run with them (`retired`, freed when the last of those ends); torch-free bookkeeping the
    engine thread changes and the HTTP edge reads."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.loaded: dict[str, LoadedLora] = {}
        self.retired: dict[int, LoadedLora] = {}

    def names(self) -> list[str]:
        return list(self.loaded)

    def slot(self, name: str | None) -> int | None:
        if name is None:
            return None
        return self.loaded[name].slot

    def free_slots(self) -> list[int]:
        """Slots neither a loaded name nor a retired copy holds."""
        taken = {a.slot for a in self.loaded.values()} | self.retired.keys()
        return [s for s in range(self.max_loras) if s not in taken]

    def _full(self, what: str) -> LoraConflict:
        held = f", and {len(self.retired)} hold earlier weights of adapters updated in place until their requests " \
            f"finish" if self.retired else ""
        return LoraConflict(f"{len(self.loaded)} LoRA adapters are loaded{held}: every slot is taken (max_loras = "
                            f"{self.max_loras}); {what}")

    def add(self, adapter: LoraAdapter) -> LoadedLora:
        """Take a free slot for `adapter`; raises LoraError (its name is loaded: unload it first or load it in
        place, whatever the weights) or LoraConflict (every slot taken)."""
        name = adapter.name
        if name in self.loaded:
            raise LoraError(f"LoRA adapter {name!r} is already loaded (from {self.loaded[name].path}); unload it "
                            f"first, or load it with load_inplace")
        free = self.free_slots()
        if not free:
            raise self._full("unload one first")
        entry = _entry(adapter, free[0])
        self.loaded[name] = entry
        return entry

    def update(self, adapter: LoraAdapter, in_use: bool) -> LoraUpdate:
        """Point a loaded name at new weights (an in-place update), the old entry retired while it is `in_use` (else
        the caller clears its slot unless the name keeps it). The new weights go, in this order: to the retired slot
        of the name that still holds them (going back to earlier weights while their requests run: no write, no
        slot taken), to a free slot, or into the old slot itself when none is free and it is not in use. Raises
        LoraConflict when no slot is free and the old weights are in use: a busy adapter's update needs one spare
        slot."""
        old = self.loaded[adapter.name]
        held = next((e for e in self.retired.values()
                     if (e.name, e.fingerprint) == (adapter.name, adapter.fingerprint)), None)
        if held is not None:
            entry = replace(self.retired.pop(held.slot), path=adapter.path)
        else:
            free = self.free_slots()
            if not free and in_use:
                raise self._full(f"LoRA adapter {adapter.name!r} has running or queued requests, and its update in "
                                 f"place needs a free slot for the new weights while they finish: unload another "
                                 f"adapter, or retry when it is idle")
            entry = _entry(adapter, free[0] if free else old.slot)
        self.loaded[adapter.name] = entry
        if in_use:
            self.retired[old.slot] = old
        return LoraUpdate(entry, old, revived=held is not None)

    def revert(self, update: LoraUpdate) -> None:
        """Undo `update` whose weights could not be written into a slot of their own (the slot is free again): the
        name serves its earlier weights, which stay where they were."""
        assert not update.revived and update.new.slot != update.old.slot, "only a write into a new slot can fail"
        self.loaded[update.new.name] = update.old
        self.retired.pop(update.old.slot, None)

    def repath(self, name: str, path: str) -> LoadedLora:
        """The same weights read from another directory: the name's card shows the new one."""
        entry = replace(self.loaded[name], path=path)
        self.loaded[name] = entry
        return entry

    def release(self, slot: int) -> LoadedLora:
        """A retired slot's last request ended: it is free again."""
        return self.retired.pop(slot)

    def remove(self, name: str) -> LoadedLora:
        entry = self.loaded.pop(name, None)
        if entry is None:
            raise LoraNotFound(f"no LoRA adapter named {name!r} is loaded")
        return entry

    def check_invariants(self, requests_per_slot: Mapping[int, int]) -> None:
        """Each slot is free, live (one loaded name's weights) or retired (earlier weights of a loaded name that
        requests still run with), and requests are bound to live or retired slots only; `requests_per_slot` counts
        the queued and running requests bound to each slot. Raises AssertionError."""
        live = [e.slot for e in self.loaded.values()]
        assert len(set(live)) == len(live), f"two names share a slot: {self.loaded}"
        assert all(0 <= s < self.max_loras for s in (*live, *self.retired)), "a slot past max_loras"
        weights = [(e.name, e.fingerprint) for e in (*self.loaded.values(), *self.retired.values())]
        assert len(set(weights)) == len(weights), f"the same weights of a name in two slots: {weights}"
        for slot, entry in self.retired.items():
            assert slot not in live, f"slot {slot} both live and retired"
            assert entry.slot == slot and entry.name in self.loaded, f"retired slot {slot}: {entry}"
            assert requests_per_slot.get(slot, 0) > 0, f"retired slot {slot} has no request left"
        bound = {s for s, n in requests_per_slot.items() if n > 0}
        assert bound <= {*live, *self.retired}, f"requests bound to free slots {bound - {*live, *self.retired}}"


def _entry(adapter: LoraAdapter, slot: int) -> LoadedLora:
    return LoadedLora(adapter.name, adapter.path, slot, adapter.rank, adapter.fingerprint)
