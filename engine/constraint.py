"""A request's output constraint (JSON object, JSON schema, regex, choice, grammar) as an llguidance grammar, and
its check. Torch-free: the router parses requests with the same models (engine/openai_types.py) and refuses a bad
schema, regex or grammar as the engine does; the matchers and masks are engine/structured.py's.

The check runs in a child process with a deadline (`python -m kvmesh.engine.constraint` serves them): llguidance
decides whether intersected regexes can match anything in time exponential in their number, so a 1 KiB schema
(an allOf of 25 string patterns) held a thread, and the router's event loop, for minutes. A check past the
deadline is a 400 and its child is killed; a few children serve all checks, each check one at a time.

Tenants share the children but nothing else: verdicts are remembered per scope (CACHE_SCOPE, as the token cache's
pieces: the tenant in the router, the cache_salt in the engine), so a tenant timing a check learns nothing of the
schemas others sent; and a free child goes to the waiting scope that holds the fewest, so a tenant sending schemas
that each run out the deadline holds at most one child while another tenant waits. No child within
CHECK_QUEUE_SECONDS is ChecksBusy, which each edge answers as a retryable overload (with Retry-After), not a 400.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import itertools
import json
import math
import queue
import select
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import llguidance
from llguidance import LLMatcher

from kvmesh.engine.model.token_cache import CACHE_SCOPE, scope_key
from kvmesh.engine.protocol import STRUCTURED_KINDS

# JSON as json.dumps writes it: fixed separators, no free whitespace between tokens (with free whitespace a model
# can pad a JSON value with newlines until max_tokens, the failure vLLM's disable_any_whitespace exists for).
# A schema may still choose otherwise with its own "x-guidance" options, which override these defaults.
JSON_DEFAULTS: llguidance.JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                                "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What one request constrains its output to. `param` is the request field it came from, named in errors."""

    kind: str
    spec: Any  # json_schema: the schema (dict); regex, grammar: the text; choice: the strings; json_object: None
    param: str

    def __post_init__(self) -> None:
        assert self.kind in STRUCTURED_KINDS, self.kind

    def grammar(self) -> str:
        """The llguidance grammar (not yet checked); ValueError when the spec cannot even be read."""
        if self.kind in ("json_object", "json_schema"):
            schema = {"type": "object"} if self.kind == "json_object" else self.spec
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(self.spec))
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        return llguidance.grammar_from("grammar", self.spec)  # Lark, or llama.cpp's GBNF (converted)


def check(constraint: Constraint) -> None:
    """Raise ValueError with llguidance's message when the constraint is not a valid grammar (or could not be
    checked within CHECK_SECONDS); ChecksBusy (not a ValueError, so validation passes it on to the edge) when no
    checker was free in time. Needs no tokenizer, so the router's request parsing refuses a bad schema or regex
    as the engine's does. Verdicts are remembered per CACHE_SCOPE: agents send the same schema with every request,
    and compiling a large one takes tens of milliseconds."""
    spec_json = json.dumps(constraint.spec, sort_keys=True)
    check_once = _problem if len(spec_json) <= CACHED_SPEC_CHARS else _problem.__wrapped__
    try:
        problem = check_once(scope_key(CACHE_SCOPE.get()), constraint.kind, spec_json)
    except NotChecked as exc:  # raised, so never remembered: the next request is checked
        raise ValueError(str(exc)) from None
    if problem is not None:
        raise ValueError(problem)


CACHED_SPEC_CHARS = 16384  # larger specs are checked each time: the cache holds at most 1024 x 16 KiB, all scopes
CHECK_SECONDS = 2.0  # a grammar check's deadline (checks of real schemas take milliseconds to tens of them)
CHECK_WORKERS = 2  # child processes checking at once; a check waits up to CHECK_QUEUE_SECONDS for one
CHECK_QUEUE_SECONDS = 4 * CHECK_SECONDS
# Request bodies are parsed in threads of their own (`parse_off_loop`), on the router and the engine alike: parsing
# checks a request's grammar, which may wait CHECK_QUEUE_SECONDS for a checker, and such waits in the default pool
# would hold the threads that tokenize prompts and move KV for every tenant.
_BODY_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvmesh-body")
_T = TypeVar("_T")


async def parse_off_loop(call: Callable[..., _T], *args: Any) -> _T:
    """`call(*args)` (a body's parsing and validation) in a body thread, with the caller's context (its CACHE_SCOPE)."""
    return await asyncio.get_running_loop().run_in_executor(_BODY_THREADS, contextvars.copy_context().run, call, *args)


class NotChecked(Exception):
    """No verdict this time (the checking process failed): not one to remember, and a 400 for this request."""


class ChecksBusy(Exception):
    """No checker free within CHECK_QUEUE_SECONDS: the server's overload, not the request's fault, so each edge
    answers it as a retryable overload; a slot frees within one check's deadline, hence the Retry-After."""

    retry_after_seconds = math.ceil(CHECK_SECONDS)


@functools.lru_cache(maxsize=1024)
def _problem(scope_key: bytes, kind: str, spec_json: str) -> str | None:
    """The verdict, remembered per scope: a verdict another scope's request left is never this one's."""
    return _CHECKERS.problem(scope_key, kind, spec_json)


def verdict(kind: str, spec_json: str) -> str | None:
    """The check itself, as a child runs it: None, or what is wrong with the spec."""
    constraint = Constraint(kind, json.loads(spec_json), "check")
    try:
        grammar = constraint.grammar()
    except ValueError as exc:
        return f"invalid {kind}: {exc}"
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return f"invalid {kind}: {messages[0].strip()}" if is_error else None


class _Child:
    """One checking child: a request line (kind, spec) in, a verdict line out."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, bufsize=0)

    def ask(self, kind: str, spec_json: str, seconds: float) -> str | None:
        """The child's verdict; TimeoutError past `seconds`, OSError or EOFError when the child is gone."""
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps([kind, spec_json]).encode() + b"\n")
        if not select.select([stdout], [], [], seconds)[0]:
            raise TimeoutError
        line = _read_line(stdout)
        if not line:
            raise EOFError("the checking child exited")
        return json.loads(line)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


def _read_line(stream: IO[bytes]) -> bytes:
    """A whole line from an unbuffered pipe (the child writes each verdict with one write)."""
    parts = []
    while not parts or not parts[-1].endswith(b"\n"):
        part = stream.read(65536)
        if not part:
            break
        parts.append(part)
    return b"".join(parts)


class _FairSlots:
    """`count` slots shared by scopes. A free slot goes to the waiter whose scope holds the fewest slots (the
    earliest among equals): slots never idle while anyone waits (alone, a scope may use them all), yet a scope that
    waits for its first slot is served before any scope already holding one, so it waits at most until the first
    held check ends (CHECK_SECONDS, within CHECK_QUEUE_SECONDS) however many checks another scope has queued."""

    def __init__(self, count: int) -> None:
        self._free = count
        self._held: Counter[bytes] = Counter()
        self._waiting: list[tuple[int, bytes]] = []  # (arrival, scope)
        self._arrivals = itertools.count()
        self._changed = threading.Condition()

    def acquire(self, scope: bytes, timeout: float) -> bool:
        """Whether a slot was taken for `scope` within `timeout` seconds."""
        with self._changed:
            waiter = (next(self._arrivals), scope)
            self._waiting.append(waiter)
            taken = self._changed.wait_for(lambda: self._free > 0 and self._next() == waiter, timeout)
            self._waiting.remove(waiter)
            if taken:
                self._free -= 1
                self._held[scope] += 1
            self._changed.notify_all()  # the next in line changed
            return taken

    def release(self, scope: bytes) -> None:
        with self._changed:
            self._free += 1
            self._held[scope] -= 1
            if not self._held[scope]:
                del self._held[scope]
            self._changed.notify_all()

    def _next(self) -> tuple[int, bytes]:
        return min(self._waiting, key=lambda waiter: (self._held[waiter[1]], waiter[0]))


class _Checkers:
    """Up to CHECK_WORKERS children, started when first needed and kept; one that misses the deadline is killed."""

    def __init__(self) -> None:
        self._slots = _FairSlots(CHECK_WORKERS)
        self._idle: queue.LifoQueue[_Child] = queue.LifoQueue()

    def problem(self, scope_key: bytes, kind: str, spec_json: str) -> str | None:
        if not self._slots.acquire(scope_key, CHECK_QUEUE_SECONDS):
            raise ChecksBusy(f"{kind} not checked: this server's constraint checks are all busy, try again in "
                             f"{ChecksBusy.retry_after_seconds} s")
        try:
            try:
                child = self._idle.get_nowait()
            except queue.Empty:
                child = _Child()
            try:
                answer = child.ask(kind, spec_json, CHECK_SECONDS)
            except TimeoutError:
                child.kill()
                return (f"invalid {kind}: too complex, not checked within {CHECK_SECONDS:g} s (intersected "
                        "patterns, as in an allOf of several string patterns, take time exponential in their number)")
            except (OSError, EOFError, ValueError):
                child.kill()
                raise NotChecked(f"{kind} not checked: the checking process ended, try again") from None
            self._idle.put(child)
            return answer
        finally:
            self._slots.release(scope_key)


_CHECKERS = _Checkers()


def _serve_checks() -> None:
    """A child's loop: one verdict line per request line, until its parent closes the pipe."""
    for line in sys.stdin.buffer:
        kind, spec_json = json.loads(line)
        sys.stdout.buffer.write(json.dumps(verdict(kind, spec_json)).encode() + b"\n")
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    _serve_checks()
