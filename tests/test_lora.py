"""LoRA adapters over the tiny model: logits and greedy tokens equal transformers with the adapter merged into
the weights (W + scale B A), for each adapter alone and mixed in one batch with the base model, through chunked
prefill and cascade decode; per-adapter prefix caching; /v1/models, the load and unload endpoints and their
errors; the LoRA metrics."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from kvmesh.cli import _serve_parser
from kvmesh.engine import attention as attention_module
from kvmesh.engine import runner as runner_module
from kvmesh.engine import server as server_module
from kvmesh.engine.attention import TorchMetadata
from kvmesh.engine.config import EngineConfig, load_config
from kvmesh.engine.engine import Engine
from kvmesh.engine.model.lora import TARGET_MODULES, LoraAdapter, LoraConflict, LoraError, LoraRegistry
from kvmesh.engine.protocol import (
    LOAD_LORA_PATH,
    LORA_FINGERPRINT_FIELD,
    UNLOAD_LORA_PATH,
    BlockExtra,
    Metric,
    VllmMetric,
    block_hashes,
)
from kvmesh.engine.request import Request
from kvmesh.engine.runner import StepInput
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.server import EngineHolder, create_app

from .conftest import make_engine
from .test_engine import Result, prompt
from .waiting import wait_for

ATOL = 1e-3  # fp32 logits and logprobs against transformers (measured: at most 1.7e-4, logits up to about 7)
ALL = TARGET_MODULES
ATTN_QV = ("q_proj", "v_proj")
_ids = iter(range(1_000_000))


def write_adapter(path: Path, seed: int, rank: int = 8, alpha: float = 16.0, targets: tuple[str, ...] = ALL,
                  rslora: bool = False, layers: int = 2, **config: object) -> Path:
    """A random PEFT LoRA directory for the tiny model (hidden 64, 4 heads and 2 KV heads of 16, MLP 128), with
    nonzero B so the adapter changes the output."""
    shapes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
              "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.3
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
            "use_rslora": rslora, "task_type": "CAUSAL_LM", **config}
    (path / "adapter_config.json").write_text(json.dumps(body))
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {"all": write_adapter(root / "all", seed=1),  # every module, rank 8, scale 2
            # two modules of the first layer only (as PEFT's layers_to_transform makes), rsLoRA's scale
            "qv": write_adapter(root / "qv", seed=2, rank=4, alpha=8.0, targets=ATTN_QV, rslora=True, layers=1)}


def merged(tiny_dir: Path, adapter: Path | None):
    """transformers' model with the adapter merged into a copy of the base weights: the reference."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    if adapter is None:
        return model
    from safetensors.torch import load_file

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in weights.items():
            if ".lora_A." not in key:
                continue
            b = weights[key.replace(".lora_A.", ".lora_B.")]
            module = model.get_submodule(key.removeprefix("base_model.model.").removesuffix(".lora_A.weight"))
            module.weight += scale * b @ a
    return model


@pytest.fixture(scope="module")
def references(tiny_dir: Path, adapters: dict[str, Path]) -> dict[str | None, object]:
    return {None: merged(tiny_dir, None), **{name: merged(tiny_dir, path) for name, path in adapters.items()}}


def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + tokens])).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
    return tokens, logprobs


def submit(engine: Engine, lora: str | None, ids: list[int], **params: object) -> Result:
    """Queue one greedy request (6 tokens with logprobs unless `params` say otherwise); its outputs gather in the
    Result."""
    p = SamplingParams(**{"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": True, **params})
    request = Request(f"lora-{next(_ids)}", list(ids), p, extra=BlockExtra(lora=lora))
    result = Result(request)
    request.on_output = result.outputs.append
    engine.submit(request)
    return result


def run(engine: Engine, jobs: list[tuple[str | None, list[int]]], **params: object) -> list[Result]:
    """Submit every (adapter, prompt) at once, so they share steps, and step until all finished."""
    results = [submit(engine, lora, ids, **params) for lora, ids in jobs]
    engine.run_until_idle()
    engine.kv.check_invariants()
    for r in results:
        assert r.final.error is None, r.final.error
    return results


@pytest.fixture(scope="module")
def lora_engine(tiny_dir: Path, adapters: dict[str, Path]) -> Iterator[Engine]:
    engine = make_engine(tiny_dir, lora_modules={name: str(path) for name, path in adapters.items()},
                         max_num_batched_tokens=48)
    yield engine
    engine.kv.check_invariants()


def test_one_step_of_base_and_two_adapters_matches_each_merged_model(lora_engine: Engine, references) -> None:
    ids = [prompt(3, 21), prompt(4, 30), prompt(5, 17)]
    slots = [None, lora_engine.loras.slot("all"), lora_engine.loras.slot("qv")]
    seqs = [StepInput(list(range(10 * k, 10 * k + 2)), 0, ids[k], True, slots[k]) for k in range(3)]
    logits = lora_engine.runner.run(seqs).logits
    for row, name in enumerate((None, "all", "qv")):
        with torch.no_grad():
            want = references[name](torch.tensor([ids[row]])).logits[0, -1]
        torch.testing.assert_close(logits[row], want, atol=ATOL, rtol=0)
    with torch.no_grad():  # the adapters change the answer: a model that ignored them would fail above
        base = references[None](torch.tensor([ids[1]])).logits[0, -1]
    assert (logits[1] - base).abs().max() > 0.5


def test_mixed_batch_with_chunked_prefill_generates_each_references_tokens(
    lora_engine: Engine, references, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Base, both adapters and the same prompt under two adapters, in one batch; 70-token prompts against a
    48-token step budget, so prefills run in chunks beside other requests' decodes."""
    slots_per_step: list[set[int | None]] = []
    real = lora_engine.runner.run

    def spy(seqs: list[StepInput]):
        slots_per_step.append({s.lora_slot for s in seqs})
        return real(seqs)

    monkeypatch.setattr(lora_engine.runner, "run", spy)
    shared = prompt(7, 70)
    jobs = [(None, shared), ("all", shared), ("qv", shared), ("all", prompt(8, 70)), (None, prompt(9, 12))]
    results = run(lora_engine, jobs, max_tokens=8)
    for (name, ids), got in zip(jobs, results, strict=True):
        tokens, logprobs = hf_greedy(references[name], ids, 8)
        assert got.tokens == tokens, name
        assert max(abs(a - b) for a, b in zip(got.logprobs, logprobs, strict=True)) < ATOL
    assert results[0].tokens != results[1].tokens  # the adapter is not ignored
    assert max(len(s) for s in slots_per_step) == 3  # base and both adapters really shared a step


def test_cascade_decode_groups_an_adapters_requests_and_matches_the_reference(
    lora_engine: Engine, references, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests of one adapter over a cached system prompt decode in cascade (the threshold lowered so the tiny
    setup forms a group); the base model's requests over the same text never share the adapter's blocks."""
    monkeypatch.setattr(attention_module, "CASCADE_MIN_SAVED_BLOCKS", 4)
    groups: list[list[int]] = []
    real = runner_module.build_metadata

    def spy(*args: object, **kwargs: object) -> object:
        meta = real(*args, **kwargs)  # type: ignore[arg-type]
        if isinstance(meta, TorchMetadata):
            groups.append([int(g.rows.shape[0]) for g in meta.cascade_groups])
        return meta

    monkeypatch.setattr(runner_module, "build_metadata", spy)
    system = prompt(11, 4 * 16)
    run(lora_engine, [("qv", [*system, 1]), (None, [*system, 1])], max_tokens=1)  # both prefixes cached
    groups.clear()
    jobs = [("qv", [*system, *prompt(12 + j, 3 + j)]) for j in range(3)] + [(None, [*system, *prompt(20, 3)])]
    results = run(lora_engine, jobs, max_tokens=6)
    assert max((sorted(g) for g in groups), default=[]) == [3]  # the three adapter requests, not the base one
    for (name, ids), got in zip(jobs, results, strict=True):
        assert got.final.cached_tokens == 64
        assert got.tokens == hf_greedy(references[name], ids, 6)[0]


def test_preempted_adapter_requests_recompute_with_their_adapter(lora_engine: Engine, tiny_dir: Path,
                                                                   adapters: dict[str, Path]) -> None:
    """A request preempted by recompute gets its adapter's slot back when it runs again: under memory pressure
    every request of a base/adapter mix produces what it produces with memory to spare."""
    jobs = [(name, prompt(60 + k, 40)) for k, name in enumerate([None, "all", "qv", "all", None, "qv"])]
    expected = [r.tokens for r in run(lora_engine, jobs, max_tokens=40)]
    modules = {name: str(path) for name, path in adapters.items()}
    tight = make_engine(tiny_dir, lora_modules=modules, kv_cache_blocks=12)  # 80 tokens = 5 blocks: two fit
    assert [r.tokens for r in run(tight, jobs, max_tokens=40)] == expected
    assert tight.scheduler.num_preemptions > 0


def test_a_bad_adapter_at_start_is_left_out_and_the_rest_serve(
    tiny_dir: Path, adapters: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Under the operator a pod whose engine died on one bad adapter would crash-loop, taking the base model and the
    good adapters with it: the engine starts without it and says why (the operator's sync reports the refusal)."""
    with caplog.at_level("ERROR", logger="kvmesh.engine"):
        engine = make_engine(tiny_dir, kv_cache_blocks=8, lora_modules={"all": str(adapters["all"]),
                                                                        "bad": str(tmp_path / "missing")})
    assert set(engine.loras.loaded) == {"all"}
    assert "LoRA adapter 'bad' not loaded" in caplog.text and "adapter_config.json" in caplog.text


def test_prefix_cache_is_kept_apart_per_adapter(lora_engine: Engine) -> None:
    ids = prompt(30, 40)
    first = run(lora_engine, [("all", ids)])[0]
    other = run(lora_engine, [("qv", ids)])[0]
    base = run(lora_engine, [(None, ids)])[0]
    again = run(lora_engine, [("all", ids)])[0]
    assert (first.final.cached_tokens, other.final.cached_tokens, base.final.cached_tokens) == (0, 0, 0)
    assert again.final.cached_tokens == 32
    assert again.tokens == first.tokens


def test_an_adapters_blocks_are_hashed_with_its_weights_not_only_its_name(lora_engine: Engine) -> None:
    """New weights under an old name must never find the old weights' KV: the same tokens under the same name
    hash apart with other weights, in every block; and the engine hashes a request with the weights it runs with,
    whatever fingerprint the HTTP edge read before (an in-place update can fall in between)."""
    ids = prompt(32, 40)
    old, new = (block_hashes(ids, 16, BlockExtra("all", None, f)) for f in ("1" * 16, "2" * 16))
    assert len(old) == 2 and not set(old) & set(new)
    assert not set(old) & set(block_hashes(ids, 16, BlockExtra("all")))
    assert old == block_hashes(ids, 16, BlockExtra("all", None, "1" * 16))  # stable: the router computes them too
    weights = lora_engine.loras.loaded["all"].fingerprint
    request = Request("stale-weights", ids, SamplingParams(max_tokens=1), extra=BlockExtra("all", None, "1" * 16))
    lora_engine.submit(request)
    lora_engine.run_until_idle()
    assert request.extra.lora_fingerprint == weights
    cached = [lora_engine.cached_run(block_hashes(ids, 16, BlockExtra("all", None, f))) for f in (weights, "1" * 16)]
    assert cached == [2, 0]


def test_new_weights_under_a_name_served_before_find_none_of_the_old_weights_cache(
    lora_engine: Engine, adapters: dict[str, Path], tiny_dir: Path, tmp_path: Path,
) -> None:
    """An in-place update: unload an adapter, load other weights under its name. The old weights' cached prefix
    is not reused (a hit of 0), the answer is the new weights' (the merged reference's), and the old weights,
    loaded back, find their own blocks again."""
    ids = prompt(33, 40)
    old = run(lora_engine, [("qv", ids)])[0]
    assert run(lora_engine, [("qv", ids)])[0].final.cached_tokens == 32  # the old weights' blocks are cached
    new_path = write_adapter(tmp_path / "qv-new", seed=7)  # every module, rank 8: changes the output plainly
    lora_engine.remove_lora("qv")
    lora_engine.add_lora(lora_engine.read_lora("qv", str(new_path)))
    try:
        swapped = run(lora_engine, [("qv", ids)])[0]
        assert swapped.final.cached_tokens == 0
        assert swapped.tokens == hf_greedy(merged(tiny_dir, new_path), ids, 6)[0] != old.tokens
        assert run(lora_engine, [("qv", ids)])[0].final.cached_tokens == 32  # the new weights cache their own
    finally:
        lora_engine.remove_lora("qv")
        lora_engine.add_lora(lora_engine.read_lora("qv", str(adapters["qv"])))
    back = run(lora_engine, [("qv", ids)])[0]
    assert (back.final.cached_tokens, back.tokens) == (32, old.tokens)


@pytest.fixture(scope="module")
def qv_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """New weights for the "qv" adapter: every module, rank 8, so they change the output plainly."""
    return write_adapter(tmp_path_factory.mktemp("qv-v2"), seed=7)


def test_an_in_place_update_serves_new_requests_the_new_weights_while_running_ones_finish_on_the_old(
    tiny_dir: Path, adapters: dict[str, Path], references, qv_v2: Path,
) -> None:
    """vLLM's load_inplace with a spare slot: the name points at the new weights at once (no moment it is not
    served, no waiting for the busy adapter to go idle); a request queued before keeps the slot and fingerprint it
    was bound to (its tokens are the old merged model's, its blocks hashed with the old weights), one queued after
    runs and hashes with the new; the old slot is freed when its last request ends."""
    engine = make_engine(tiny_dir, kv_cache_blocks=64, max_loras=2, lora_modules={"qv": str(adapters["qv"])})
    ids = prompt(34, 40)
    before = engine.loras.loaded["qv"]
    old = submit(engine, "qv", ids, max_tokens=8)
    engine.step()
    engine.step()  # prefilled, decoding
    assert old.outputs and old.final.finish_reason is None
    entry = engine.add_lora(engine.read_lora("qv", str(qv_v2)), inplace=True)
    assert engine.loras.loaded["qv"] == entry and entry.slot != before.slot and entry.fingerprint != before.fingerprint
    new = submit(engine, "qv", ids, max_tokens=8)
    engine.step()
    assert engine.loras.retired == {before.slot: before}  # still running on it
    engine.run_until_idle()
    assert old.tokens == hf_greedy(references["qv"], ids, 8)[0]
    assert new.tokens == hf_greedy(merged(tiny_dir, qv_v2), ids, 8)[0] != old.tokens
    assert (old.request.lora_slot, old.request.extra.lora_fingerprint) == (before.slot, before.fingerprint)
    assert (new.request.lora_slot, new.request.extra.lora_fingerprint) == (entry.slot, entry.fingerprint)
    assert new.final.cached_tokens == 0  # none of the old weights' blocks
    cached = [engine.cached_run(block_hashes(ids, 16, BlockExtra("qv", None, e.fingerprint))) for e in (before, entry)]
    assert cached == [2, 2]  # each request's blocks, cached under its own weights
    assert engine.loras.retired == {} and engine.loras.free_slots() == [before.slot]
    assert engine.runner.model.lora.slots[before.slot].rank == 0  # cleared
    assert engine.state.loras_loaded == 1 and engine.loras.names() == ["qv"]
    engine.kv.check_invariants()


def test_a_busy_adapters_update_needs_a_spare_slot_else_409_and_the_same_weights_are_a_no_op(
    tiny_dir: Path, adapters: dict[str, Path], qv_v2: Path, tmp_path: Path,
) -> None:
    """With every slot taken a busy adapter cannot be updated (LoraConflict: the server's 409, naming max_loras) and
    keeps its weights; idle, it is updated in its own slot. Loading the weights it has, from any directory, changes
    only the path its card shows."""
    engine = make_engine(tiny_dir, kv_cache_blocks=64, max_loras=2,
                         lora_modules={name: str(path) for name, path in adapters.items()})
    before = engine.loras.loaded["qv"]
    busy = submit(engine, "qv", prompt(35, 20))
    engine.step()
    with pytest.raises(LoraConflict, match=r"max_loras = 2.*'qv' has running or queued requests"):
        engine.add_lora(engine.read_lora("qv", str(qv_v2)), inplace=True)
    assert engine.loras.loaded["qv"] == before and engine.loras.retired == {}
    engine.run_until_idle()
    assert busy.final.finish_reason == "length"
    entry = engine.add_lora(engine.read_lora("qv", str(qv_v2)), inplace=True)
    assert (entry.slot, entry.path) == (before.slot, str(qv_v2)) and entry.fingerprint != before.fingerprint
    copy_dir = tmp_path / "qv-v2-copy"
    shutil.copytree(qv_v2, copy_dir)
    same = engine.add_lora(engine.read_lora("qv", str(copy_dir)), inplace=True)
    assert same == dataclasses.replace(entry, path=str(copy_dir)) and engine.loras.retired == {}
    with pytest.raises(LoraError, match="already loaded"):  # without load_inplace a loaded name is refused
        engine.add_lora(engine.read_lora("qv", str(qv_v2)))


def test_going_back_to_weights_still_running_revives_their_slot_with_no_load_and_no_spare_slot(
    tiny_dir: Path, adapters: dict[str, Path], references, qv_v2: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Update A -> B while A's request runs, then B -> A while both A's and B's run: with max_loras 2 both slots are
    taken, which refused an update of a busy adapter (409); A's retired slot still holds A's weights, so it is
    served again, with no load, and B's slot is retired until B's request ends. Every request answers with the
    weights it was bound to, and the request on A again finds A's cached prefix."""
    engine = make_engine(tiny_dir, kv_cache_blocks=64, max_loras=2, lora_modules={"qv": str(adapters["qv"])})
    slots = engine.runner.model.lora
    writes: list[int] = []
    write = slots.write
    monkeypatch.setattr(slots, "write", lambda slot, adapter: (writes.append(slot), write(slot, adapter)))
    a = engine.loras.loaded["qv"]
    ids = prompt(36, 40)
    on_a = submit(engine, "qv", ids, max_tokens=12)
    engine.step()
    engine.step()
    b = engine.add_lora(engine.read_lora("qv", str(qv_v2)), inplace=True)
    on_b = submit(engine, "qv", ids, max_tokens=12)
    engine.step()
    assert engine.loras.free_slots() == [] and on_a.final.finish_reason is None and on_b.outputs
    engine.check_lora_invariants()
    back = engine.add_lora(engine.read_lora("qv", str(adapters["qv"])), inplace=True)  # no LoraConflict
    assert back == a and writes == [b.slot]  # A's slot and entry again; only B's weights were ever written
    assert engine.loras.retired == {b.slot: b} and engine.loras.free_slots() == []
    engine.check_lora_invariants()
    on_a_again = submit(engine, "qv", ids, max_tokens=12)
    engine.step()
    engine.check_lora_invariants()
    engine.run_until_idle()
    a_tokens = hf_greedy(references["qv"], ids, 12)[0]
    assert on_a.tokens == on_a_again.tokens == a_tokens
    assert on_b.tokens == hf_greedy(merged(tiny_dir, qv_v2), ids, 12)[0] != a_tokens
    assert [r.request.lora_slot for r in (on_a, on_b, on_a_again)] == [a.slot, b.slot, a.slot]
    assert on_a_again.final.cached_tokens == 32  # A's blocks, hashed with A's weights, are A's again
    assert engine.loras.retired == {} and engine.loras.free_slots() == [b.slot] and slots.slots[b.slot].rank == 0
    engine.check_lora_invariants()
    engine.kv.check_invariants()


def test_going_back_to_earlier_weights_when_the_current_ones_are_idle_frees_their_slot(
    tiny_dir: Path, adapters: dict[str, Path], qv_v2: Path,
) -> None:
    """A -> B while A's request runs, then B -> A with no request on B: A's slot serves again and B's is freed at
    once (cleared); a request on A started before the revival and one after share A's slot."""
    engine = make_engine(tiny_dir, kv_cache_blocks=64, max_loras=2, lora_modules={"qv": str(adapters["qv"])})
    a = engine.loras.loaded["qv"]
    on_a = submit(engine, "qv", prompt(37, 20), max_tokens=20)
    engine.step()
    b = engine.add_lora(engine.read_lora("qv", str(qv_v2)), inplace=True)
    assert engine.add_lora(engine.read_lora("qv", str(adapters["qv"])), inplace=True) == a
    assert engine.loras.retired == {} and engine.loras.free_slots() == [b.slot]
    assert engine.runner.model.lora.slots[b.slot].rank == 0 and on_a.final.finish_reason is None
    engine.check_lora_invariants()
    engine.run_until_idle()
    assert on_a.final.finish_reason == "length" and on_a.request.lora_slot == a.slot
    assert engine.loras.free_slots() == [b.slot]


def test_the_registry_revives_only_the_same_name_and_weights_and_keeps_one_slot_per_weights() -> None:
    """The bookkeeping alone, through a chain of updates: each slot free, live or retired, never the same weights
    of a name in two slots; another name's identical weights are not revived (a slot serves one name)."""
    registry = LoraRegistry(3)

    def weights(name: str, fingerprint: str) -> LoraAdapter:
        return LoraAdapter(name, f"/adapters/{name}-{fingerprint}", 4, 1.0, {}, fingerprint)

    a = registry.add(weights("x", "a"))
    b = registry.update(weights("x", "b"), in_use=True)
    assert (b.new.slot, b.old, b.revived, registry.retired) == (1, a, False, {0: a})
    registry.check_invariants({0: 1, 1: 1})
    revived = registry.update(weights("x", "a"), in_use=True)
    assert (revived.new.slot, revived.revived, registry.retired, registry.free_slots()) == (0, True, {1: b.new}, [2])
    assert revived.new.path == "/adapters/x-a"
    registry.check_invariants({0: 2, 1: 1})
    y = registry.add(weights("y", "b"))  # B's weights under another name: a slot of its own
    assert y.slot == 2 and registry.free_slots() == []
    registry.check_invariants({0: 2, 1: 1})
    registry.release(1)
    registry.check_invariants({0: 2})
    registry.update(weights("x", "c"), in_use=True)
    with pytest.raises(AssertionError, match="no request left"):  # a retired slot with no request would leak
        registry.check_invariants({1: 1, 2: 1})


def test_weights_that_cannot_be_written_leave_the_adapters_as_they_were(
    tiny_dir: Path, adapters: dict[str, Path], references, qv_v2: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slot write that fails (out of memory allocating the slots, on a GPU) must not leave a name pointing at a
    half-written slot: a new name is not loaded, an update into a spare slot keeps serving the earlier weights,
    and an update that was overwriting the name's own slot unloads it (its weights are no longer whole)."""
    engine = make_engine(tiny_dir, kv_cache_blocks=64, max_loras=2, lora_modules={"qv": str(adapters["qv"])})
    before = engine.loras.loaded["qv"]
    lora = engine.runner.model.lora
    written = lora.write

    def out_of_memory(slot: int, adapter: LoraAdapter) -> None:
        written(slot, adapter)  # partly, then the allocator gives up
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(lora, "write", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        engine.add_lora(engine.read_lora("all", str(adapters["all"])))
    assert engine.loras.names() == ["qv"] and engine.loras.free_slots() == [1 - before.slot]
    with pytest.raises(torch.OutOfMemoryError):  # into the spare slot: qv serves its earlier weights on
        engine.add_lora(engine.read_lora("qv", str(qv_v2)), inplace=True)
    assert engine.loras.loaded["qv"] == before and engine.loras.retired == {}
    assert lora.slots[1 - before.slot].rank == 0
    engine.check_lora_invariants()
    ids = prompt(36, 20)
    assert run(engine, [("qv", ids)])[0].tokens == hf_greedy(references["qv"], ids, 6)[0]
    monkeypatch.setattr(lora, "write", written)
    engine.add_lora(engine.read_lora("all", str(adapters["all"])))  # no spare slot left: into qv's own
    monkeypatch.setattr(lora, "write", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        engine.add_lora(engine.read_lora("qv", str(qv_v2)), inplace=True)
    assert engine.loras.names() == ["all"] and engine.state.loras_loaded == 1
    engine.check_lora_invariants()
    monkeypatch.setattr(lora, "write", written)
    engine.add_lora(engine.read_lora("qv", str(qv_v2)))
    assert run(engine, [("qv", ids)])[0].tokens == hf_greedy(merged(tiny_dir, qv_v2), ids, 6)[0]


def test_a_request_for_an_adapter_unloaded_before_it_was_queued_ends_with_an_error(lora_engine: Engine) -> None:
    """The HTTP edge checks the name, then submits: an unload can fall in between."""
    request = Request("orphan", prompt(31, 5), SamplingParams(max_tokens=2), extra=BlockExtra(lora="gone"))
    outputs = []
    request.on_output = outputs.append
    lora_engine.submit(request)
    lora_engine.run_until_idle()
    assert outputs[-1].finish_reason == "error" and "'gone' was unloaded" in (outputs[-1].error or "")
    assert outputs[-1].error_code == "model_not_found"  # a client's 404, not the engine's 500


def test_int8_base_with_an_adapter_stays_near_the_merged_model(tiny_dir: Path, adapters: dict[str, Path],
                                                                references) -> None:
    """The adapter's delta runs in the activations' dtype beside the int8 product."""
    engine = make_engine(tiny_dir, kv_cache_blocks=8, quantization="int8", lora_modules={"all": str(adapters["all"])})
    ids = prompt(40, 20)
    got = engine.runner.run([StepInput([0, 1], 0, ids, True, engine.loras.slot("all"))]).logits[0]
    with torch.no_grad():
        want = references["all"](torch.tensor([ids])).logits[0, -1]
        base = references[None](torch.tensor([ids])).logits[0, -1]
    assert (got - want).abs().max() < 0.25 * (want - base).abs().max()


@pytest.mark.filterwarnings("ignore:Found missing adapter keys")  # the "qv" adapter covers one layer on purpose
def test_peft_agrees_with_the_merged_reference(tiny_dir: Path, adapters: dict[str, Path], references) -> None:
    """PEFT itself (a test dependency) reads the adapters these tests write and agrees with the merged reference
    the engine is compared with: the key names, alpha / r and rsLoRA scaling are PEFT's, not only ours."""
    import peft
    ids = torch.tensor([prompt(41, 20)])
    for name, path in adapters.items():
        model = peft.PeftModel.from_pretrained(copy.deepcopy(references[None]), str(path)).eval()
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, references[name](ids).logits, atol=ATOL, rtol=0)


def test_lora_modules_from_flags_and_yaml(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--lora-modules", "a=/x", "b = /y", "--max-lora-rank", "16"])
    config = load_config(None, {f.name: getattr(args, f.name, None) for f in dataclasses.fields(EngineConfig)})
    assert (config.lora_modules, config.max_lora_rank) == ({"a": "/x", "b": "/y"}, 16)
    (tmp_path / "e.yaml").write_text("engine:\n  lora-modules: {sql: /adapters/sql}\n  max-loras: 2\n")
    config = load_config(tmp_path / "e.yaml")
    assert (config.lora_modules, config.max_loras, config.max_lora_rank) == ({"sql": "/adapters/sql"}, 2, 64)
    with pytest.raises(ValueError, match="name=path"):
        load_config(None, {"lora_modules": ["nopath"]})
    with pytest.raises(ValueError, match="max_loras is 1"):
        load_config(None, {"lora_modules": ["a=/x", "b=/y"], "max_loras": 1})
    for bad in ("sql,v2", 'a"b', " ", "-lead"):  # a comma would split vllm:lora_requests_info's lists
        with pytest.raises(ValueError, match=r"adapter name|non-empty"):
            load_config(None, {"lora_modules": {bad: "/x"}})
    assert load_config(None, {"lora_modules": {"org/sql-v2.1": "/x"}}).lora_modules == {"org/sql-v2.1": "/x"}


# ---- the HTTP edge ----------------------------------------------------------------------------------------


def lora_info(http: TestClient) -> tuple[dict[str, str], float, float]:
    """vllm:lora_requests_info's labels and value, and kvmesh_lora_adapters_loaded."""
    info, loaded = None, None
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == VllmMetric.LORA_REQUESTS_INFO:
                info = sample
            elif sample.name == Metric.LORA_ADAPTERS_LOADED:
                loaded = sample.value
    assert info is not None and loaded is not None
    return info.labels, info.value, loaded


@pytest.fixture
def served(tiny_dir: Path, adapters: dict[str, Path]) -> Iterator[tuple[TestClient, Engine]]:
    engine = make_engine(tiny_dir, kv_cache_blocks=64, max_loras=2, max_lora_rank=8,
                         lora_modules={"all": str(adapters["all"])})
    engine.start()
    try:
        with TestClient(create_app(EngineHolder(engine))) as http:
            yield http, engine
    finally:
        engine.stop()
    engine.kv.check_invariants()


@pytest.mark.slow
def test_an_adapter_unloaded_between_the_check_and_the_queue_is_a_404(served, monkeypatch: pytest.MonkeyPatch
                                                                      ) -> None:
    """The race the engine test above covers, seen by a client: the same 404 as a name never loaded, not a 500."""
    http, engine = served
    checked = server_module._Completions.job

    async def check_then_unload(self: server_module._Completions) -> object:
        job = await checked(self)
        engine.call(lambda: engine.remove_lora("all")).result(timeout=60)
        return job

    monkeypatch.setattr(server_module._Completions, "job", check_then_unload)
    reply = http.post("/v1/completions", json={"model": "all", "prompt": "Hello", "max_tokens": 2})
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and "'all' was unloaded" in error["message"]


@pytest.mark.slow
def test_models_endpoint_load_unload_and_metrics(served: tuple[TestClient, Engine], adapters: dict[str, Path],
                                                  tmp_path: Path) -> None:
    http, engine = served
    base = engine.model_name
    cards = http.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [base, "all"]
    assert {k: cards[1][k] for k in ("object", "owned_by", "root", "parent", "max_model_len")} == {
        "object": "model", "owned_by": "kvmesh", "root": str(adapters["all"]), "parent": base,
        "max_model_len": engine.max_model_len}
    labels, _, loaded = lora_info(http)
    assert (labels, loaded) == ({"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "2"}, 1)

    ids = prompt(60, 40)
    answer = http.post("/v1/completions", json={"model": "all", "prompt": ids, "max_tokens": 3, "temperature": 0})
    assert answer.status_code == 200 and answer.json()["model"] == "all"
    # its blocks are cached under the hashes a router computes from the adapter's name and the fingerprint its card
    # publishes, not under the name alone nor the base model's
    weights = cards[1][LORA_FINGERPRINT_FIELD]
    assert weights == engine.loras.loaded["all"].fingerprint and len(weights) == 16
    hashed = [block_hashes(ids, engine.config.block_size, extra)
              for extra in (BlockExtra("all", None, weights), BlockExtra("all"), BlockExtra())]
    assert [engine.call(lambda h=h: engine.cached_run(h)).result() for h in hashed] == [2, 0, 0]
    missing = http.post("/v1/completions", json={"model": "nope", "prompt": [5], "max_tokens": 1})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

    assert http.post(LOAD_LORA_PATH, json={"lora_name": "qv", "lora_path": str(adapters["qv"])}).status_code == 200
    assert [c["id"] for c in http.get("/v1/models").json()["data"]] == [base, "all", "qv"]
    assert lora_info(http)[2] == 2

    def refused(path: str, body: dict, status: int, fragment: str) -> None:
        r = http.post(path, json=body)
        assert r.status_code == status, r.text
        assert fragment in r.json()["error"]["message"], r.json()

    refused(LOAD_LORA_PATH, {"lora_name": "qv", "lora_path": str(adapters["qv"])}, 400, "already loaded")
    refused(LOAD_LORA_PATH, {"lora_name": "x", "lora_path": str(adapters["all"])}, 409, "max_loras = 2")
    refused(LOAD_LORA_PATH, {"lora_name": "x"}, 400, "lora_path")
    refused(LOAD_LORA_PATH, {"lora_name": "a,b", "lora_path": str(adapters["qv"])}, 400, "lora_name")
    refused(UNLOAD_LORA_PATH, {"lora_name": "nope"}, 404, "no LoRA adapter named 'nope'")
    assert http.post(UNLOAD_LORA_PATH, json={"lora_name": "qv"}).status_code == 200
    refused(LOAD_LORA_PATH, {"lora_name": "x", "lora_path": str(tmp_path / "none")}, 400, "adapter_config.json")
    refused(LOAD_LORA_PATH, {"lora_name": "x", "lora_path": str(write_adapter(tmp_path / "r16", 3, rank=16))},
            400, "ranks 1 to 8")
    for bad, fragment in (({"target_modules": ["q_proj", "lm_head"]}, "lm_head"), ({"use_dora": True}, "DoRA"),
                          ({"bias": "all"}, "bias"), ({"modules_to_save": ["embed_tokens"]}, "modules_to_save")):
        path = write_adapter(tmp_path / f"bad-{len(fragment)}-{fragment}", 4, targets=ATTN_QV, **bad)
        refused(LOAD_LORA_PATH, {"lora_name": "x", "lora_path": str(path)}, 400, fragment)
    for field, raw in (("r", "1e999"), ("r", "1.5"), ("r", "true"), ("lora_alpha", "NaN"), ("lora_alpha", "1e999")):
        path = write_adapter(tmp_path / f"numbers-{field}-{raw}", 4, targets=ATTN_QV)
        config = path / "adapter_config.json"  # the number as written in the file: JSON's 1e999 reads as infinity
        config.write_text(config.read_text().replace(f'"{field}": ', f'"{field}": {raw}, "was": ', 1))
        refused(LOAD_LORA_PATH, {"lora_name": "x", "lora_path": str(path)}, 400, "needs integer r and a finite")
    embedding = write_adapter(tmp_path / "embed", 5, targets=ATTN_QV)
    save_file({"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 8)},
              str(embedding / "adapter_model.safetensors"))
    refused(LOAD_LORA_PATH, {"lora_name": "x", "lora_path": str(embedding)}, 400, "embed_tokens")
    other = write_adapter(tmp_path / "other-qv", 6, rank=4, targets=ATTN_QV)
    refused(LOAD_LORA_PATH, {"lora_name": base, "lora_path": str(other)}, 400, "base model's name")
    # other weights under a name served before are taken (an in-place update): the card names the new weights
    assert http.post(LOAD_LORA_PATH, json={"lora_name": "qv", "lora_path": str(other)}).status_code == 200
    refused(LOAD_LORA_PATH, {"lora_name": "qv", "lora_path": str(adapters["qv"])}, 400, "already loaded")
    (card,) = [c for c in http.get("/v1/models").json()["data"] if c["id"] == "qv"]
    assert (card["root"], card[LORA_FINGERPRINT_FIELD]) == (str(other), engine.loras.loaded["qv"].fingerprint)
    assert card[LORA_FINGERPRINT_FIELD] != engine.read_lora("qv", str(adapters["qv"])).fingerprint
    assert http.post(UNLOAD_LORA_PATH, json={"lora_name": "qv"}).status_code == 200
    assert lora_info(http)[2] == 1

    # an adapter with a request in flight is not unloaded; the metric names it as running
    p = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    request = Request("long", prompt(50, 8), p, extra=BlockExtra(lora="all"))
    finished = threading.Event()
    request.on_output = lambda out: finished.set() if out.finish_reason else None
    engine.submit(request)
    refused(UNLOAD_LORA_PATH, {"lora_name": "all"}, 409, "running or queued")
    wait_for(lambda: lora_info(http)[0]["running_lora_adapters"] == "all", "running label")
    labels, stamp, _ = lora_info(http)
    assert (labels["waiting_lora_adapters"], labels["max_lora"]) == ("", "2")
    assert abs(stamp - time.time()) < 3600  # a unix time, as vLLM's
    engine.abort("long")
    wait_for(finished.is_set, "abort")
    assert http.post(UNLOAD_LORA_PATH, json={"lora_name": "all"}).status_code == 200
    assert [c["id"] for c in http.get("/v1/models").json()["data"]] == [base]
    gone = http.post("/v1/completions", json={"model": "all", "prompt": [5], "max_tokens": 1})
    assert gone.status_code == 404
    assert lora_info(http)[2] == 0
    # the same weights come back under their name (their cached blocks are still right)
    assert http.post(LOAD_LORA_PATH, json={"lora_name": "all", "lora_path": str(adapters["all"])}).status_code == 200


@pytest.mark.slow
def test_load_inplace_updates_a_busy_adapter_over_http_when_a_slot_is_spare(
    served: tuple[TestClient, Engine], adapters: dict[str, Path], qv_v2: Path,
) -> None:
    """POST /v1/load_lora_adapter with vLLM's `load_inplace`: a name not loaded is an ordinary load; a busy adapter
    with every slot taken is a 409 naming the spare slot it needs; with one spare it is updated at once while its
    request runs on, its card naming the new weights, and the old slot comes free when the request ends."""
    http, engine = served

    def load(name: str, path: Path, **flags: object) -> httpx.Response:
        return http.post(LOAD_LORA_PATH, json={"lora_name": name, "lora_path": str(path), **flags})

    assert load("qv", adapters["qv"], load_inplace=True).status_code == 200  # not loaded: a plain load
    before = engine.loras.loaded["all"]
    long = submit(engine, "all", prompt(51, 8), max_tokens=1000)
    wait_for(lambda: lora_info(http)[0]["running_lora_adapters"] == "all", "running label")
    full = load("all", qv_v2, load_inplace=True)
    assert full.status_code == 409, full.text
    error = full.json()["error"]
    assert error["code"] == "lora_conflict" and "max_loras = 2" in error["message"] and "free slot" in error["message"]
    assert load("all", qv_v2).status_code == 400  # without the flag: already loaded
    assert http.post(UNLOAD_LORA_PATH, json={"lora_name": "qv"}).status_code == 200  # a spare slot
    updated = load("all", qv_v2, load_inplace=True)
    assert updated.status_code == 200, updated.text
    (card,) = [c for c in http.get("/v1/models").json()["data"] if c["id"] == "all"]
    assert card["root"] == str(qv_v2) and card[LORA_FINGERPRINT_FIELD] == updated.json()[LORA_FINGERPRINT_FIELD] \
        != before.fingerprint
    assert long.outputs[-1].finish_reason is None and engine.loras.retired == {before.slot: before}  # ran on
    answer = http.post("/v1/completions", json={"model": "all", "prompt": [5, 6], "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["model"] == "all"
    engine.abort(long.request.request_id)
    wait_for(lambda: engine.loras.retired == {}, "the old slot freed")
    assert long.final.finish_reason == "abort" and engine.loras.free_slots() == [before.slot]
    assert lora_info(http)[2] == 1
