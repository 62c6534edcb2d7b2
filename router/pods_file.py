"""File discovery: keep a router's pod set equal to a JSON or YAML file that something else rewrites (`kvmesh up`
scaling a local pool, or any script). The file lists pod URLs, each a string or `{url, role, draining}`:

    pods:
      - http://127.0.0.1:8001
      - {url: http://127.0.0.1:8002, role: decode, draining: true}

(a bare list works too). A pod's role is what its own /v1/kv/config says; the file's `role` is for people and
tools reading it. Pure core, thin edge: `parse_pods_file` turns text into the wanted set (pod URL -> draining);
the watcher polls the file's identity (inode, mtime, size) from a worker thread and applies each change on the
event loop. A file that
cannot be read or parsed is logged and ignored: the router keeps the pods it knows.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import yaml

log = logging.getLogger("kvmesh.router.pods_file")
POLL_SECONDS = 0.5


def parse_pods_file(text: str) -> dict[str, bool]:
    """Pod URL -> draining from the file's text; ValueError saying what is wrong with it."""
    try:
        data = yaml.safe_load(text)  # YAML reads JSON too
    except yaml.YAMLError as exc:
        raise ValueError(f"not JSON or YAML: {exc}") from exc
    if data is None:
        return {}
    if isinstance(data, dict):
        if set(data) - {"pods"}:
            raise ValueError(f"unknown keys {sorted(set(data) - {'pods'})}; expected `pods`")
        data = data.get("pods") or []
    if not isinstance(data, list):
        raise ValueError("expected a list of pods, or a mapping with a `pods` list")
    wanted: dict[str, bool] = {}
    for entry in data:
        if isinstance(entry, str):
            entry = {"url": entry}
        if not isinstance(entry, dict) or set(entry) - {"url", "role", "draining"}:
            raise ValueError(f"pod {entry!r}: expected a URL or a mapping of url, role, draining")
        url, role, draining = entry.get("url"), entry.get("role"), entry.get("draining", False)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"pod {entry!r}: url must be an http(s) URL")
        if role is not None and not isinstance(role, str):
            raise ValueError(f"pod {url}: role must be a string")
        if not isinstance(draining, bool):
            raise ValueError(f"pod {url}: draining must be true or false")
        wanted[url.rstrip("/")] = draining
    return wanted


class PodsFileWatcher:
    """Polls `path` every `poll_seconds` (a task on the event loop that starts it; the file is read in a worker
    thread); hands each new, valid content to the pod set. A missing file is an empty pool until it appears."""

    def __init__(self, path: str | Path, poll_seconds: float = POLL_SECONDS) -> None:
        self.path = Path(path)
        self.poll_seconds = poll_seconds
        self._seen: tuple[int, int, int] | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, apply: Callable[[Mapping[str, bool]], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self.poll(apply)  # the first view before any request is routed
        self._task = asyncio.create_task(self._run(apply), name=f"pods file {self.path}")
        log.info("reading pods from %s", self.path)

    def stop(self) -> None:
        """Safe from any thread (the pod set calls it from a worker thread)."""
        if self._task is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._task.cancel)

    def poll(self, apply: Callable[[Mapping[str, bool]], None]) -> None:
        """Apply the file if it changed since the last look, unless it is unreadable or malformed."""
        wanted = self._read_if_changed()
        if wanted is not None:
            apply(wanted)

    def _read_if_changed(self) -> dict[str, bool] | None:
        """The file's pods when it changed since the last look and reads well; None otherwise."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            identity = (0, 0, 0)
        except OSError as exc:
            log.error("pods file %s: %s; keeping the current pods", self.path, exc)
            return None
        else:
            identity = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if identity == self._seen:
            return None
        self._seen = identity
        if identity == (0, 0, 0):
            log.warning("pods file %s does not exist: no pods until it does", self.path)
            return {}
        try:
            return parse_pods_file(self.path.read_text())
        except (OSError, ValueError) as exc:
            log.error("pods file %s: %s; keeping the current pods", self.path, exc)
            return None

    async def _run(self, apply: Callable[[Mapping[str, bool]], None]) -> None:
        """Stat and read in a worker thread (a slow or network file system must not stall routing); apply on
        the loop, where the pod set lives."""
        while True:
            await asyncio.sleep(self.poll_seconds)
            wanted = await asyncio.to_thread(self._read_if_changed)
            if wanted is not None:
                apply(wanted)
