"""API keys and tenants: hashed storage, bearer parsing, refusals, and per-tenant cache salts."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from kvmesh.router.app import RouteError, build_router, create_router_app
from kvmesh.router.auth import DEFAULT_TENANT, ApiKeys, KeysFile, cache_salt_for, hash_key, tenant_hash
from kvmesh.router.config import RouterConfig

ACME_KEY = "sk-acme-0123456789"
GLOBEX_KEY = "sk-globex-abcdef"


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    entries = [
        {"tenant": "acme", "key_sha256": hash_key(ACME_KEY)},
        {"tenant": "globex", "key_sha256": hash_key(GLOBEX_KEY).upper()},
    ]
    path.write_text(yaml.safe_dump({"keys": entries}))
    return path


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def test_hashing() -> None:
    assert hash_key("secret") == hashlib.sha256(b"secret").hexdigest()
    assert len(tenant_hash("acme")) == 16 and tenant_hash("acme") == tenant_hash("acme")
    assert tenant_hash("acme") != tenant_hash("globex")
    assert int(tenant_hash("acme"), 16) >= 0  # hex, so it fits the log's short column
    assert not hash_key("acme").startswith(tenant_hash("acme"))  # domain-separated


def test_bearer_parsing_and_lookup(keys_file: Path) -> None:
    keys = ApiKeys.from_file(keys_file)
    assert keys.enabled
    assert keys.tenant_for(f"Bearer {ACME_KEY}") == "acme"
    assert keys.tenant_for(f"bearer   {ACME_KEY}  ") == "acme"  # scheme is case-insensitive, spaces trimmed
    assert keys.tenant_for(f"Bearer {GLOBEX_KEY}") == "globex"  # upper-case digest in the file is normalised
    assert keys.tenant_for("Bearer sk-unknown") is None
    assert keys.tenant_for(None) is None
    assert keys.tenant_for("") is None
    assert keys.tenant_for("Bearer") is None
    assert keys.tenant_for("Bearer ") is None
    assert keys.tenant_for(f"Basic {ACME_KEY}") is None
    assert keys.tenant_for(ACME_KEY) is None  # no scheme
    assert keys.tenant_for(f"Bearer {hash_key(ACME_KEY)}") is None  # the stored hash is not a key


def test_auth_off_means_default_tenant() -> None:
    keys = ApiKeys({})
    assert not keys.enabled
    assert keys.tenant_for(None) == DEFAULT_TENANT == "default"
    assert keys.tenant_for("Bearer anything") == "default"


def test_keys_are_immutable_and_checked() -> None:
    source = {hash_key("k"): "t"}
    keys = ApiKeys(source)
    source[hash_key("other")] = "intruder"
    assert keys.tenant_for("Bearer other") is None
    with pytest.raises(TypeError):
        keys.by_hash[hash_key("x")] = "y"  # type: ignore[index]
    with pytest.raises(ValueError, match="sha256"):
        ApiKeys({"plain-key": "t"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "mapping with a 'keys' list"),
        ("- a\n- b\n", "mapping with a 'keys' list"),
        ("keys: [\n", "not valid YAML"),
        ("keys: []\n", "non-empty list"),
        ("keys: {tenant: a}\n", "non-empty list"),
        ("keys: [1]\n", "expected a mapping"),
        ("keys: [{tenant: acme, key: sk-123}]\n", "plain API keys are not accepted.*sha256"),
        ("keys: [{tenant: acme, key_sha256: sk-123}]\n", "64 hex characters.*sha256sum"),
        (f"keys: [{{key_sha256: {'a' * 64}}}]\n", "'tenant' must be a non-empty string"),
        (f"keys: [{{tenant: '', key_sha256: {'a' * 64}}}]\n", "'tenant' must be a non-empty string"),
        (f"keys: [{{tenant: a, key_sha256: {'a' * 64}, role: admin}}]\n", r"unknown fields \['role'\]"),
        (f"keys: [{{tenant: a, key_sha256: {'a' * 64}}}]\nextra: 1\n", "unknown top-level fields"),
        (
            f"keys: [{{tenant: a, key_sha256: {'a' * 64}}}, {{tenant: b, key_sha256: {'A' * 64}}}]\n",
            r"keys\[1\]: the same key is listed twice",
        ),
    ],
)
def test_malformed_files_raise_value_error(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=message) as info:
        ApiKeys.from_file(path)
    assert str(path) in str(info.value)  # the message names the file


def test_salts_differ_per_tenant_and_pool() -> None:
    acme, globex = cache_salt_for("acme"), cache_salt_for("globex")
    assert acme and globex and acme != globex
    assert cache_salt_for("acme") == acme  # stable across calls (and so across replicas)
    assert cache_salt_for("acme", pool_salt="secret") != acme  # keyed by the pool's secret
    assert cache_salt_for("acme", pool_salt="secret") != cache_salt_for("globex", pool_salt="secret")
    assert acme != tenant_hash("acme") and not acme.startswith(tenant_hash("acme"))  # the log never shows a salt
    assert "acme" not in acme
    assert cache_salt_for("acme", share_across_tenants=True) is None
    assert cache_salt_for(DEFAULT_TENANT) is not None  # auth off: one shared salt for everybody


def write_keys(path: Path, keys: dict[str, str]) -> None:
    """Replace the file as the kubelet updates a mounted Secret: a new file swapped in (a new inode)."""
    staged = path.with_suffix(".new")
    staged.write_text(yaml.safe_dump({"keys": [{"tenant": t, "key_sha256": hash_key(k)} for k, t in keys.items()]}))
    staged.replace(path)


def test_a_rotated_keys_file_is_taken_without_a_restart(keys_file: Path) -> None:
    reloads: list[str] = []
    watched = KeysFile(keys_file, on_reload=lambda outcome, _: reloads.append(outcome))
    assert watched.keys.tenant_for(f"Bearer {ACME_KEY}") == "acme"
    assert not watched.reload_if_changed() and reloads == []  # unchanged: not read again

    write_keys(keys_file, {"sk-acme-rotated": "acme", GLOBEX_KEY: "globex"})  # acme's old key revoked
    assert watched.reload_if_changed()
    keys = watched.keys
    assert keys.tenant_for(f"Bearer {ACME_KEY}") is None and keys.tenant_for("Bearer sk-acme-rotated") == "acme"
    assert reloads == ["loaded"]
    assert not watched.reload_if_changed() and watched.keys is keys and reloads == ["loaded"]


@pytest.mark.parametrize("text", ["keys: []\n", "keys: [{tenant: acme, key: plain}]\n", "{{{"])
def test_a_broken_rotation_keeps_the_keys_in_force(keys_file: Path, text: str) -> None:
    """An empty, plain-key or unparsable new version neither opens the pool nor locks everyone out."""
    reloads: list[str] = []
    watched = KeysFile(keys_file, on_reload=lambda outcome, _: reloads.append(outcome))
    staged = keys_file.with_suffix(".new")
    staged.write_text(text)
    staged.replace(keys_file)
    assert not watched.reload_if_changed()
    assert watched.keys.tenant_for(f"Bearer {ACME_KEY}") == "acme" and reloads == ["refused"]
    assert not watched.reload_if_changed() and reloads == ["refused"]  # logged once
    write_keys(keys_file, {"sk-new": "acme"})  # the next good version is taken
    assert watched.reload_if_changed()
    assert watched.keys.tenant_for("Bearer sk-new") == "acme" and reloads == ["refused", "loaded"]


def test_the_router_re_reads_its_keys_and_a_revoked_key_stops_at_once_even_with_limits_left(
        keys_file: Path, tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    router = build_router(RouterConfig(pods=[], api_keys_file=str(keys_file),
                                       tenants={"globex": {"requests_per_minute": 10}}), tiny_dir)
    assert router.keys_file is not None
    assert router.authenticate({"authorization": f"Bearer {ACME_KEY}"}) == "acme"

    write_keys(keys_file, {"sk-acme-2": "acme", GLOBEX_KEY: "globex", "sk-initech": "initech"})
    # what the app's background task does every KEYS_CHECK_SECONDS: the file read off the event loop, then on it
    assert router.reload_keys()
    router.keys_changed()
    with pytest.raises(RouteError) as refused:
        router.authenticate({"authorization": f"Bearer {ACME_KEY}"})
    assert refused.value.status == 401
    assert router.authenticate({"authorization": "Bearer sk-acme-2"}) == "acme"
    assert router.authenticate({"authorization": "Bearer sk-initech"}) == "initech"
    exported = generate_latest(router.metrics.registry).decode()
    assert f'tenant="{tenant_hash("initech")}"' in exported  # the new tenant's series exist from its first key

    write_keys(keys_file, {"sk-acme-3": "acme"})  # globex's key revoked: taken although globex still has limits
    router.reload_keys()
    with pytest.raises(RouteError):
        router.authenticate({"authorization": f"Bearer {GLOBEX_KEY}"})
    assert "['globex'] have limits but no API key" in caplog.text
    write_keys(keys_file, {})  # no keys at all: refused, the keys in force stay (auth is never turned off)
    router.reload_keys()
    assert router.authenticate({"authorization": "Bearer sk-acme-3"}) == "acme"
    reloads = router.metrics.api_keys_reloads
    assert reloads.labels("loaded")._value.get() == 2 and reloads.labels("refused")._value.get() == 1


def test_the_running_router_takes_a_rotation_by_itself(keys_file: Path, tiny_dir: Path) -> None:
    """The app's background task re-reads the file: no request is needed to notice it (an idle router counts and
    logs a rotation too)."""
    router = build_router(RouterConfig(pods=[], api_keys_file=str(keys_file)), tiny_dir)
    with TestClient(create_router_app(router)) as client:  # runs the app's lifespan, its background tasks too
        write_keys(keys_file, {"sk-acme-4": "acme"})
        deadline = time.monotonic() + 30
        while router.metrics.api_keys_reloads.labels("loaded")._value.get() < 1:
            assert time.monotonic() < deadline, "the router never re-read its keys file"
            time.sleep(0.1)
        assert client.get("/v1/models", headers={"authorization": "Bearer sk-acme-4"}).status_code == 200
        assert client.get("/v1/models", headers={"authorization": f"Bearer {ACME_KEY}"}).status_code == 401
