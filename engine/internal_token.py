"""The pool's internal token: engines serve only callers that present it (contract 0).

An engine's routes reach past a router's authentication, limits and request log: `/v1/kv/fetch` hands out the raw
KV of other tenants' prompts, `/v1/admin/drain` stops the pod, `/v1/kv/warm` makes it pull from any URL. Where the
network enforces nothing (a cluster without a policy-enforcing network plugin, several users on one machine), a
NetworkPolicy alone does not keep them to the pool. So every caller inside the pool (routers, peer engines, the
operator, `kvmesh up`) sends the token in `INTERNAL_TOKEN_HEADER`, and an engine started with one refuses every
other request with 401. `/health` (kubelet probes) and `/metrics` (Prometheus) stay open: they change nothing and
name no cached content.

The token lives in a file (`INTERNAL_TOKEN_FILE_ENV`; in a cluster the pool's Secret mounted as a volume), read
again when it changes: the kubelet replaces a mounted Secret's files in place, so a new token reaches every pod of
the pool within a minute or so, with no rollout. No file configured: no token asked or sent (an engine started by
hand, the tests).
"""

from __future__ import annotations

import hmac
import os
import secrets
import time
from collections.abc import Generator, Mapping
from pathlib import Path

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from kvmesh.engine.body_deadline import send_json
from kvmesh.engine.openai_types import error_body
from kvmesh.engine.protocol import LIVENESS_PATH

INTERNAL_TOKEN_HEADER = "x-kvmesh-internal-token"
INTERNAL_TOKEN_FILE_ENV = "KVMESH_INTERNAL_TOKEN_FILE"
INTERNAL_TOKEN_KEY = "token"  # the key of the token in the pool's Secret, and the file's name in its volume
OPEN_PATHS = frozenset({"/health", LIVENESS_PATH, "/metrics"})  # served without the token: probes and scrapes
RECHECK_SECONDS = 1.0  # how often the file's modification time is looked at
MIN_TOKEN_CHARS = 16
TOKEN_REFUSED_CODE = "internal_token_required"


def new_token() -> str:
    """A fresh random token (256 bits), as the operator puts in a pool's Secret and `kvmesh up` in its work folder."""
    return secrets.token_urlsafe(32)


class InternalToken(httpx.Auth):
    """The token of one process: read from its file, re-read when the file changes, or held in memory (`fixed`).
    As an `httpx.Auth`, it adds the header to every request of a client made with `auth=token` (the current token,
    each request).

    `path` None: the pool has no token (nothing is asked of callers, nothing is sent). A file that cannot be read or
    holds too short a token is an error at start (a pod that would refuse its own pool must not look healthy); a
    later failure to read keeps the last good token.
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self._token: str | None = None
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        if self.path is not None:
            self._token = self._read()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> InternalToken:
        """The token of the file the environment names; a ValueError naming the variable when it cannot be used."""
        try:
            return cls(environ.get(INTERNAL_TOKEN_FILE_ENV) or None)
        except (OSError, ValueError) as exc:
            raise ValueError(f"${INTERNAL_TOKEN_FILE_ENV}: {exc}") from None

    @classmethod
    def fixed(cls, token: str) -> InternalToken:
        """A token held in memory: the cluster operator reads each pool's from its Secret through the API."""
        held = cls(None)
        held._token = token
        return held

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def value(self) -> str | None:
        """The current token; one from a file is re-read at most once a `RECHECK_SECONDS` when its stamp moved."""
        if self.path is None:
            return self._token
        now = time.monotonic()
        if now - self._checked >= RECHECK_SECONDS:
            self._checked = now
            try:
                stat = self.path.stat()
                if (stat.st_mtime_ns, stat.st_ino) != self._stamp:
                    self._token = self._read()
            except (OSError, ValueError):
                pass  # mid-replacement or gone for a moment: keep the last good token
        return self._token

    def headers(self) -> dict[str, str]:
        """The header a caller inside the pool adds to each request to an engine (none without a token)."""
        token = self.value()
        return {INTERNAL_TOKEN_HEADER: token} if token else {}

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers.update(self.headers())
        yield request

    def admits(self, path: str, presented: str | None) -> bool:
        """Whether a request for `path` carrying `presented` may be served."""
        token = self.value()
        if token is None or path in OPEN_PATHS:
            return True
        return presented is not None and hmac.compare_digest(presented.encode(), token.encode())

    def __repr__(self) -> str:  # never the token itself: it may reach a log line
        return f"InternalToken({str(self.path) if self.path else 'fixed' if self._token else None})"

    def _read(self) -> str:
        assert self.path is not None
        stat = self.path.stat()
        token = self.path.read_text().strip()
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the internal token in {self.path} has {len(token)} characters; it needs at least "
                             f"{MIN_TOKEN_CHARS}")
        self._stamp = (stat.st_mtime_ns, stat.st_ino)
        return token


def write_token_file(path: Path, token: str) -> None:
    """Write a token readable by its owner only (a local pool's work folder)."""
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(token + "\n")


class RequireToken:
    """ASGI middleware: answer 401 (OpenAI's error shape) to an HTTP request without the pool's token, before its
    body is read. Outermost, so a refused caller costs no parsing."""

    def __init__(self, app: ASGIApp, token: InternalToken) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.token.admits(scope["path"], _header(scope, INTERNAL_TOKEN_HEADER)):
            await send_json(send, 401, error_body(
                f"this engine serves only its pool: send the pool's internal token in {INTERNAL_TOKEN_HEADER} "
                f"(clients call the router)", kind="authentication_error", code=TOKEN_REFUSED_CODE))
            return
        await self.app(scope, receive, send)


def _header(scope: Scope, name: str) -> str | None:
    wanted = name.encode("latin-1")
    for key, value in scope.get("headers", ()):
        if key.lower() == wanted:
            return value.decode("latin-1")
    return None
