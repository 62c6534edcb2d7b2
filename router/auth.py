"""Optional API keys, each mapped to a tenant; the tenant decides the engine's `cache_salt` (contract 0).

Keys are stored only as sha256 digests, so a leaked key file or ConfigMap grants nothing. Tenant names never
reach the request log or the engines in the clear: the log gets `tenant_hash`, the engines `cache_salt_for`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import yaml

from kvmesh.engine.openai_types import error_body

DEFAULT_TENANT = "default"  # every request's tenant when auth is off
CACHE_SALT_SECRET_ENV = "KVMESH_CACHE_SALT_SECRET"  # the environment's cache_salt_secret (from a Secret)
KEYS_CHECK_SECONDS = 1.0  # how often the keys file's stat is compared with the one last read
# the 401 of every router endpoint for a request without a valid key: message, OpenAI error type and code
UNAUTHORIZED = ("a valid API key is required (Authorization: Bearer KEY)", "authentication_error", "invalid_api_key")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_ENTRY_FIELDS = frozenset({"tenant", "key_sha256"})
_HOW_TO_HASH = (
    "store the key's sha256 hex digest as key_sha256 instead, e.g. "
    '`printf %s "$KEY" | sha256sum`'
)


def unauthorized_body() -> dict[str, Any]:
    """The 401's OpenAI error body, as every router endpoint answers a request without a valid key."""
    message, kind, code = UNAUTHORIZED
    return error_body(message, kind, code=code)


def hash_key(key: str) -> str:
    """The sha256 hex digest under which a key is stored and looked up."""
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_hash(tenant: str) -> str:
    """A short stable pseudonym for the request log: the same on every replica, 64 bits against collisions.

    Domain-separated from `hash_key` and the cache salt, so no log column equals or prefixes either of them.
    """
    return hashlib.sha256(b"kvmesh-tenant\x00" + tenant.encode()).hexdigest()[:16]


def cache_salt_for(tenant: str, pool_salt: str = "", *, share_across_tenants: bool = False) -> str | None:
    """The `cache_salt` the router puts on every request it forwards (overwriting any the client sent).

    By default each tenant gets its own salt, so one tenant's cached prefixes can never speed up, and so never
    reveal themselves to, another's (prompt-cache timing attacks). A pool whose tenants trust one another may
    set `share_across_tenants` to trade that isolation for hit ratio: then no salt is set and identical prompts
    share blocks. `pool_salt` is a per-pool secret that keys the salt, so salts cannot be derived from tenant
    names by anyone who reaches an engine directly. With auth off, all traffic is tenant "default" and shares
    one salt.
    """
    if share_across_tenants:
        return None
    return hmac.new(pool_salt.encode(), b"kvmesh-cache-salt\x00" + tenant.encode(), hashlib.sha256).hexdigest()[:32]


def _bearer_token(header: str | None) -> str | None:
    """The KEY of "Bearer KEY" (scheme case-insensitive, as RFC 7235 says), or None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


@dataclass(frozen=True)
class ApiKeys:
    """key hash -> tenant. Empty means auth is off (every request is tenant "default")."""

    by_hash: Mapping[str, str]

    def __post_init__(self) -> None:
        for digest, tenant in self.by_hash.items():
            if not _SHA256_HEX.fullmatch(digest):
                raise ValueError(f"API key hashes must be 64 lowercase hex characters (sha256), got {digest!r}")
            if not tenant:
                raise ValueError("every API key needs a non-empty tenant")
        object.__setattr__(self, "by_hash", MappingProxyType(dict(self.by_hash)))

    @property
    def enabled(self) -> bool:
        return bool(self.by_hash)

    @property
    def tenants(self) -> frozenset[str]:
        """The tenants that have a key (the one default tenant with auth off)."""
        return frozenset(self.by_hash.values()) if self.enabled else frozenset({DEFAULT_TENANT})

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ApiKeys:
        """Read `{"keys": [{"tenant": "acme", "key_sha256": "..."}, ...]}` from YAML; ValueError says what is wrong.

        A file with no keys is refused rather than read as "auth off": an empty Secret would otherwise open the
        pool to everyone. To run without auth, pass no file.
        """
        try:
            with open(path, encoding="utf-8") as f:
                data: Any = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from e
        where = str(path)
        if not isinstance(data, dict) or "keys" not in data:
            raise ValueError(f"{where}: expected a mapping with a 'keys' list")
        if extra := set(data) - {"keys"}:
            raise ValueError(f"{where}: unknown top-level fields {sorted(extra)}; only 'keys' is allowed")
        entries = data["keys"]
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{where}: 'keys' must be a non-empty list (to turn auth off, pass no key file)")
        by_hash: dict[str, str] = {}
        for i, entry in enumerate(entries):
            digest, tenant = _parse_entry(entry, f"{where}: keys[{i}]")
            if digest in by_hash:
                raise ValueError(
                    f"{where}: keys[{i}]: the same key is listed twice (tenants {by_hash[digest]!r}, {tenant!r})"
                )
            by_hash[digest] = tenant
        return cls(by_hash)

    def tenant_for(self, authorization_header: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer KEY` header; None when auth is on and the key is missing or unknown.

        The key itself is never compared with anything: it is hashed, and the digest looked up. A lookup's timing
        can reveal at most something about stored digests, which an attacker cannot steer (they would need
        sha256 preimages) and which are useless without one; so this is as safe as a constant-time scan over
        all keys, and O(1) instead of O(keys).
        """
        if not self.by_hash:
            return DEFAULT_TENANT
        token = _bearer_token(authorization_header)
        if token is None:
            return None
        return self.by_hash.get(hash_key(token))


def _parse_entry(entry: Any, where: str) -> tuple[str, str]:
    """One `{"tenant", "key_sha256"}` item, checked."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping with 'tenant' and 'key_sha256'")
    if "key" in entry or "api_key" in entry:
        raise ValueError(f"{where}: plain API keys are not accepted; {_HOW_TO_HASH}")
    if extra := set(entry) - _ENTRY_FIELDS:
        raise ValueError(f"{where}: unknown fields {sorted(extra)}; allowed: {sorted(_ENTRY_FIELDS)}")
    tenant, digest = entry.get("tenant"), entry.get("key_sha256")
    if not isinstance(tenant, str) or not tenant.strip():
        raise ValueError(f"{where}: 'tenant' must be a non-empty string")
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest.strip().lower()):
        raise ValueError(f"{where}: 'key_sha256' must be a sha256 hex digest (64 hex characters); {_HOW_TO_HASH}")
    return digest.strip().lower(), tenant.strip()


class KeysFile:
    """The API keys file, re-read when it changes, so keys are added and revoked without a restart.

    A Secret mounted as a volume is updated in place by the kubelet (it swaps a symlink to a new directory), so
    the router's background task (router/app.py) compares the file's identity (inode, mtime, size) every
    KEYS_CHECK_SECONDS, off the event loop: a poll, because a mounted Secret gives no event a process can wait
    on portably. A new version is taken whenever it is whole and valid, so a revoked key stops working at once;
    an invalid one (no keys, a plain key, broken YAML) is refused and the keys in force stay, with the error
    logged once per version: a broken rotation must neither open the pool nor lock every tenant out.
    `on_reload(outcome, keys)` hears of each version: "loaded" with its keys, or "refused" with None.
    """

    def __init__(self, path: str | os.PathLike[str],
                 on_reload: Callable[[str, ApiKeys | None], None] = lambda *_: None) -> None:
        self.path, self.on_reload = path, on_reload
        self._seen = self._identity()
        self.keys = ApiKeys.from_file(path)  # at start a bad file is an error, as before

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def reload_if_changed(self) -> bool:
        """Re-read the file if it changed since the last look (blocking: call it off the event loop); whether a
        new version was taken."""
        seen = self._identity()
        if seen == self._seen:
            return False
        self._seen = seen
        log = logging.getLogger("kvmesh.router")
        try:
            keys = ApiKeys.from_file(self.path)
        except (OSError, ValueError) as exc:
            log.error("API keys file %s changed but was not taken (the keys in force stay): %s", self.path, exc)
            self.on_reload("refused", None)
            return False
        self.keys = keys
        log.info("API keys file %s re-read: %d keys, %d tenants", self.path, len(keys.by_hash),
                 len(set(keys.by_hash.values())))
        self.on_reload("loaded", keys)
        return True
