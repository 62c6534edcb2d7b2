"""Shared fixtures: the bundled model's converted directory, a tiny random Llama with the same tokenizer, and
engines built on them (every engine a test touches has its block-pool invariants checked afterwards); a sleeping
child process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine
from kvmesh.engine.model.loader import resolve_model_dir
from kvmesh.up import STATE_DIR_ENV

# Property tests draw the same examples on every run, so CI passes or fails on the code, never on the draw; explore
# with other draws by hand: HYPOTHESIS_PROFILE=explore pytest ... (random, more examples).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted once from its GGUF (cached across runs)."""
    return resolve_model_dir(None, progress=False)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, bundled_dir: Path) -> Path:
    """A two-layer random Llama (GQA 4:2) with the bundled tokenizer, saved by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.2,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (bundled_dir / name).exists() and not (path / name).exists():
            shutil.copy(bundled_dir / name, path / name)
    return path


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real child process that runs until the test ends, for records of `kvmesh up`'s engines whose process is
    only polled (scaling or rolling them here rewrites files and starts nothing)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def make_engine(model_dir: Path, **overrides: object) -> Engine:
    """An fp32 engine over `model_dir`, stepped synchronously unless the test starts it."""
    settings: dict[str, object] = {"model": str(model_dir), "dtype": "float32", "kv_cache_blocks": 512}
    settings.update(overrides)
    return Engine(EngineConfig(**settings))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir: Path) -> Iterator[Engine]:
    """One engine per module over the tiny model; tests must leave it idle."""
    engine = make_engine(tiny_dir)
    yield engine
    engine.kv.check_invariants()


@pytest.fixture(scope="session", autouse=True)
def kvmesh_state_dir() -> Iterator[Path]:
    """`kvmesh up`'s state folder for the session's runs, so that they stay out of the user's ~/.local/state
    (outside pytest's temporary directories, which other pytest runs prune while a long run's pool uses it)."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-state-") as where, pytest.MonkeyPatch.context() as patch:
        patch.setenv(STATE_DIR_ENV, where)
        yield Path(where)


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real PostgreSQL (pgserver's wheel: the server binaries, no system package), started once per session:
    the database a cluster's routers share. Its files live outside pytest's temporary directories: pytest keeps
    only its 3 newest runs' directories, so other pytest runs started meanwhile on the machine would delete the
    data directory (and socket) of a long run's server under it."""
    os.environ.setdefault("XDG_RUNTIME_DIR", str(tmp_path_factory.mktemp("runtime")))  # its lock file's home
    with tempfile.TemporaryDirectory(prefix="kvmesh-postgres-") as where:  # the socket goes in the data directory
        import pgserver

        server = pgserver.get_server(Path(where) / "data", cleanup_mode="stop")
        yield server
        server.cleanup()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database of each kind the router's store runs on: a SQLite file (a local pool) and a fresh
    PostgreSQL database (a cluster), so each store test runs on both."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'pool.db'}"
    server = request.getfixturevalue("postgres_server")
    name = f"test_{uuid.uuid4().hex}"
    server.psql(f'CREATE DATABASE "{name}";')
    return server.get_uri(name).replace("postgresql://", "postgresql+psycopg://", 1)


def short_id(text: str, keep: int = 40) -> str:
    """A test id no longer than about `keep` characters: a parameter of thousands of characters would otherwise
    be its test's name in every report line."""
    return text if len(text) <= keep else f"{text[:keep]}...({len(text)} chars)"


def pytest_make_parametrize_id(config: pytest.Config, val: object, argname: str) -> str | None:
    """Long string parameters get a short id (the rest keep pytest's own)."""
    return short_id(val) if isinstance(val, str) and len(val) > 40 else None
