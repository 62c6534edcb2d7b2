"""KV belongs to the base weights that computed it, not to the model's name: an engine's weights fingerprint
(the loaded tensors and the architecture) is in its /v1/kv/config, in what its tier files are written under and
in every frame it sends; a receiving engine refuses a peer's blocks computed by other weights (a pool midway
through a weights change, all under one name and the same block hashes) and recomputes them, and the router
pairs only pods whose weights match for pulls and handoffs."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvmesh.engine.engine import Engine
from kvmesh.engine.model import loader
from kvmesh.engine.protocol import KVConfig
from kvmesh.operator.forecast import parse_pod
from kvmesh.operator.memory import PoolMemory
from kvmesh.operator.warmup import PodPlace, WarmupSettings, plan_tick_warmups

from .conftest import make_engine
from .engines import serve_engine
from .test_kv_tiers import samples

NAME = "same-name"  # both checkpoints are served under it, as a pool's model.name through a weights change


def reweighted(tiny_dir: Path, where: Path, scale: float = 1.01) -> Path:
    """A copy of the tiny model (same config, tokenizer and directory name) whose every weight is scaled: other
    weights, nothing else different."""
    out = where / tiny_dir.name
    shutil.copytree(tiny_dir, out)
    for path in out.glob("*.safetensors"):
        tensors = {k: (v * scale).contiguous() for k, v in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def other_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return reweighted(tiny_dir, tmp_path_factory.mktemp("other-weights"))


def fingerprint(model_dir: Path) -> str:
    digests: dict[str, str] = {}
    loader.load_weights(model_dir, torch.float32, digests=digests)
    return loader.weights_fingerprint(loader.load_config(model_dir), digests)


def test_the_fingerprint_follows_the_weights_not_the_name_or_the_files(tiny_dir: Path, other_dir: Path,
                                                                       tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "another-name"
    shutil.copytree(tiny_dir, copy)
    assert fingerprint(copy) == fingerprint(tiny_dir)  # same tensors: the path and the directory name do not count
    assert loader.load_config(other_dir).name == loader.load_config(tiny_dir).name
    assert fingerprint(other_dir) != fingerprint(tiny_dir)
    # the same tensors saved in two shards are the same weights
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for path in tiny_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, sharded / path.name)
    tensors = {k: v for path in tiny_dir.glob("*.safetensors") for k, v in load_file(path).items()}
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[::2]}, sharded / "a.safetensors", metadata={"format": "pt"})
    save_file({k: tensors[k] for k in names[1::2]}, sharded / "b.safetensors", metadata={"format": "pt"})
    assert fingerprint(sharded) == fingerprint(tiny_dir)


def test_int8_products_are_other_weights_to_the_kv(tiny_dir: Path) -> None:
    """The same checkpoint served with int8 weights and activations computes other K and V: its blocks must not
    pass for the unquantized engine's (a rolling change of spec.engine.quantization)."""
    digests: dict[str, str] = {}
    loader.load_weights(tiny_dir, torch.float32, digests=digests)
    config = loader.load_config(tiny_dir)
    assert loader.weights_fingerprint(config, digests, "int8") != loader.weights_fingerprint(config, digests)
    assert loader.weights_fingerprint(config, digests, None) == fingerprint(tiny_dir)


def test_the_kv_config_says_which_weights(tiny_dir: Path, other_dir: Path) -> None:
    a = make_engine(tiny_dir, served_model_name=NAME, kv_cache_blocks=8).kv_config
    b = make_engine(other_dir, served_model_name=NAME, kv_cache_blocks=8).kv_config
    assert a.model == b.model and a.hashing() == b.hashing() and a.compatible_with(b)  # same hashes, same name
    assert a.weights_fingerprint and b.weights_fingerprint and a.weights_fingerprint != b.weights_fingerprint
    assert a.to_json()["weights_fingerprint"] == a.weights_fingerprint
    # a router pairs only pods of the same weights for pulls and handoffs (stores_like); an older engine that
    # does not say ("") is like only those that do not either
    assert not a.stores_like(b) and a.stores_like(make_engine(tiny_dir, kv_cache_blocks=8).kv_config)
    older = KVConfig(**{**a.to_json(), "weights_fingerprint": ""})
    assert not older.stores_like(a) and older.stores_like(KVConfig(**older.to_json()))
    # the router's own expected config (model "" and no weights) still accepts both pods' hashing
    expected = KVConfig(model="", block_size=a.block_size, hash_algo=a.hash_algo, hash_root=a.hash_root,
                        tokenizer_fingerprint=a.tokenizer_fingerprint, num_device_blocks=0, boot_id="")
    assert a.compatible_with(expected) and b.compatible_with(expected)


@pytest.fixture(scope="module")
def pods(tiny_dir: Path, other_dir: Path) -> Iterator[tuple[str, str, str, tuple[Engine, Engine, Engine]]]:
    """Engines served in this process under one name: two on the tiny model's weights, one on other weights."""
    engines = (make_engine(tiny_dir, served_model_name=NAME), make_engine(tiny_dir, served_model_name=NAME),
               make_engine(other_dir, served_model_name=NAME))
    with serve_engine(engines[0]) as a, serve_engine(engines[1]) as a2, serve_engine(engines[2]) as b:
        yield a, a2, b, engines
    for engine in engines:
        engine.kv.check_invariants()


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 48000 + 200 for i in range(n)]


def complete(url: str, **body: object) -> dict:
    reply = httpx.post(url + "/v1/completions", json={"return_token_ids": True, "temperature": 0,
                                                      "ignore_eos": True, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def transfers(engine: Engine, kind: str, outcome: str) -> float:
    return samples(engine).get(("kvmesh_kv_transfers_total", (("kind", kind), ("outcome", outcome))), 0.0)


def test_kv_config_endpoint_exports_the_fingerprint(pods: tuple[str, str, str, tuple[Engine, ...]]) -> None:
    a, _, b, engines = pods
    assert httpx.get(a + "/v1/kv/config").json()["weights_fingerprint"] == engines[0].kv_config.weights_fingerprint
    assert httpx.get(b + "/v1/kv/config").json()["weights_fingerprint"] == engines[2].kv_config.weights_fingerprint


def test_the_operator_warms_a_new_pod_only_from_a_pod_of_its_weights(
        pods: tuple[str, str, str, tuple[Engine, ...]]) -> None:
    """Midway through a weights change: the operator reads each engine's weights from its /metrics and warms the
    new pod of other weights from no old pod (the blocks would be refused: a wasted copy), and a new pod of the
    old weights from the old pod."""
    a, a2, b, _ = pods
    scraped = [parse_pod(name, "both", httpx.get(url + "/metrics").text) for name, url in (("a", a), ("a2", a2),
                                                                                          ("b", b))]
    assert scraped[0].weights == scraped[1].weights != scraped[2].weights != ""
    places = {"a": PodPlace(a, True), "a2": PodPlace(a2, False), "b": PodPlace(b, False)}
    plan = plan_tick_warmups(PoolMemory(serving=frozenset({"a"})), scraped, places, {}, WarmupSettings(16, gated=True))
    assert [(w.source.name, [t.name for t in w.targets]) for w in plan.warmups] == [("a", ["a2"])]
    assert [p.name for p in plan.open_now] == ["b"]  # nothing of its weights to copy: it serves at once


@pytest.mark.parametrize("mode", ["handoff", "pull"])
def test_a_peer_with_other_weights_is_refused_and_the_prompt_recomputed(
    pods: tuple[str, str, str, tuple[Engine, ...]], mode: str
) -> None:
    a, _, b, (_, _, engine_b) = pods
    prompt = tokens(3 if mode == "handoff" else 4, 100)
    failed = transfers(engine_b, mode, "failed")
    own = complete(b, prompt=prompt, max_tokens=8, cache_salt="own")["choices"][0]["token_ids"]  # B's own answer
    if mode == "handoff":
        first = complete(a, prompt=prompt, max_tokens=8, kv_transfer={"mode": "prefill"})
        (token,) = first["choices"][0]["token_ids"]
        handle = first["kv_transfer"]["handle"]
        body = {"max_tokens": 8,
                "kv_transfer": {"mode": "decode", "source": a, "handle": handle, "first_token": token}}
    else:
        complete(a, prompt=prompt, max_tokens=1)
        body = {"max_tokens": 8, "kv_transfer": {"mode": "pull", "source": a, "tokens": 96}}
    rest = complete(b, prompt=prompt, **body)
    details = rest["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == 0, details  # A's KV was not taken: B computed the prompt itself
    assert transfers(engine_b, mode, "failed") == failed + 1
    if mode == "pull":
        assert rest["choices"][0]["token_ids"] == own
    # B caches nothing of A's: its blocks of the prompt are its own, and a later request gets B's answer again
    assert complete(b, prompt=prompt, max_tokens=8)["choices"][0]["token_ids"] == own


def test_a_peer_with_the_same_weights_is_still_pulled_from(pods: tuple[str, str, str, tuple[Engine, ...]]) -> None:
    a, a2, _, (_, engine_a2, _) = pods
    prompt = tokens(5, 100)
    complete(a, prompt=prompt, max_tokens=1)
    ok = transfers(engine_a2, "pull", "ok")
    out = complete(a2, prompt=prompt, max_tokens=1, kv_transfer={"mode": "pull", "source": a, "tokens": 96})
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert transfers(engine_a2, "pull", "ok") == ok + 1
