"""OpenAI's Batch API, the pure part: checking an input file, ordering its requests, and the objects the API answers.

A batch is a JSONL file of requests (`custom_id`, `method`, `url`, `body`) that the router runs at low priority in
the pool's idle capacity and answers as two files: the responses, and the requests that failed. Nothing here does
I/O: router/batch_store.py keeps files and batches in the pool's database, router/batch_runner.py runs them.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.openai_types import read_json
from kvmesh.engine.protocol import CHAT_COMPLETIONS_PATH as CHAT_PATH
from kvmesh.engine.protocol import COMPLETIONS_PATH
from kvmesh.router.usage import cached_tokens, usage_count, usage_object

RESPONSES_PATH = "/v1/responses"
BATCH_ENDPOINTS: tuple[str, ...] = (CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH)
FILE_PURPOSES: tuple[str, ...] = ("batch", "batch_output")  # what clients upload, what batches write
UPLOAD_PURPOSE, OUTPUT_PURPOSE = FILE_PURPOSES
# validating: the input file is being checked; finalizing: the output files are being written
ACTIVE_STATUSES: tuple[str, ...] = ("validating", "in_progress", "finalizing", "cancelling")
FINAL_STATUSES: tuple[str, ...] = ("completed", "failed", "cancelled", "expired")
CANCELLABLE_STATUSES: tuple[str, ...] = ("validating", "in_progress")
# ok: answered 200; failed: answered otherwise (in the error file); retried: refused for load or limits, sent again
BATCH_REQUEST_OUTCOMES: tuple[str, ...] = ("ok", "failed", "retried")
# a tenant's requests waiting in its validating and in-progress batches, at most (OpenAI bounds an organisation's
# enqueued tokens the same way): a new batch past it is refused with a 429 until earlier ones end
MAX_ENQUEUED_REQUESTS = 200_000
ENQUEUED_STATUSES: tuple[str, ...] = ("validating", "in_progress")
MAX_FILE_BYTES = 100 * 2**20  # an input file's default bound (OpenAI's is 200 MB; this one lives in a database)
# What one tenant may keep in the pool's database at most (its uploads and its batches' output and error files,
# unexpired): an upload past either is a 400 until files are deleted or expire. A batch's output files are written
# whatever the quota (a finished batch never fails on it) but count against the tenant's next upload.
MAX_STORED_FILES = 1000
MAX_STORED_BYTES = 10 * 2**30  # a hundred input files at the default bound
MAX_CONCURRENT_UPLOADS = 4  # uploads one replica reads at once, over all tenants: each is up to MAX_FILE_BYTES
# how long an upload waits for one of them (the next free one goes to the tenant reading the fewest) before its 429
UPLOAD_WAIT_SECONDS = 5.0
# who sent a request the router serves (label `source` of kvmesh_router_requests_total and kvmesh_router_shed_total): a
# client, or this router's own batch runner, whose 429s are deferrals it retries and no client sees
CLIENT_SOURCE, BATCH_SOURCE = REQUEST_SOURCES = ("client", "batch")
BATCH_PRIORITY = -1  # x-kvmesh-priority of a batch's requests: shed before any interactive request (router/shed.py)
MAX_CUSTOM_ID_CHARS = 512
PREFIX_ORDER, FILE_ORDER = "prefix", "file"  # how a batch's requests are ordered to be sent (batch_order)
BATCH_ORDERS: tuple[str, ...] = (PREFIX_ORDER, FILE_ORDER)
MAX_LISTED_ERRORS = 100  # a batch that fails its check lists this many problems, then says how many more
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds on metadata
_WINDOW = re.compile(r"([1-9][0-9]{0,2})h")
_WHOLE_NUMBER = re.compile(r"[0-9]{1,18}")  # ASCII digits only (str.isdigit also takes "²", which int() refuses)
MAX_WINDOW_HOURS = 168
FILE_TTL_SECONDS = 30 * 86400  # a batch file's default lifetime and the longest one asked for (OpenAI's)
MIN_FILE_TTL_SECONDS = 3600


class BatchInputError(ValueError):
    """A call that cannot be accepted: its status (400, 409 for a conflict with a running batch, 429 for a tenant
    over its enqueued requests), message and OpenAI-style code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass(frozen=True)
class FileQuota:
    """What one tenant may store at most (batch_max_stored_files, batch_max_stored_bytes)."""

    files: int = MAX_STORED_FILES
    bytes: int = MAX_STORED_BYTES

    def check(self, files: int, stored: int, adding: int) -> None:
        """BatchInputError 400 when a tenant holding `files` files of `stored` bytes may not add one of `adding`."""
        if files + 1 > self.files or stored + adding > self.bytes:
            raise BatchInputError(
                f"File storage limit reached: this tenant stores {files} files of {stored} bytes and this upload "
                f"has {adding}; the limits are {self.files} files and {self.bytes} bytes (batch_max_stored_files, "
                "batch_max_stored_bytes). Delete files (DELETE /v1/files/{id}) or wait for them to expire.",
                "file", 400, "file_storage_limit_reached")


def request_lines(content: bytes | Iterable[bytes]) -> int:
    """An input file's lines, blank ones too: what its batch will enqueue at most, known without parsing it.
    `content`: the file's bytes, or its pieces in order."""
    count, last = 0, b"\n"
    for piece in _pieces(content):
        if piece:
            count, last = count + piece.count(b"\n"), piece[-1:]
    return count + (last != b"\n")


def _pieces(content: bytes | Iterable[bytes]) -> Iterable[bytes]:
    return (content,) if isinstance(content, bytes) else content


def enqueued_limit_error(enqueued: int, adding: int, limit: int) -> BatchInputError:
    return BatchInputError(f"Enqueued request limit reached: this tenant's validating and in-progress batches hold "
                           f"{enqueued} requests and this batch's input file has {adding} lines; the limit is "
                           f"{limit} (batch_max_enqueued_requests). Wait for a batch to end, or cancel one.",
                           "input_file_id", 429, "batch_enqueued_limit_reached")


def new_id(prefix: str) -> str:
    """An id as OpenAI's look (`file-...`, `batch_...`): random, so ids reveal nothing of other tenants' counts."""
    return f"{prefix}{secrets.token_hex(12)}"


def whole_number(text: str) -> int | None:
    """A decimal text of ASCII digits as an int (a query value, a form field, a header), or None: another text,
    digits Python's int() would refuse or take ("²", "٣"), or more than 18 of them."""
    return int(text) if _WHOLE_NUMBER.fullmatch(text) else None


def window_seconds(completion_window: Any) -> int:
    """`24h` (OpenAI's only window), or another whole number of hours up to a week: a self-hosted pool's choice."""
    match = _WINDOW.fullmatch(completion_window) if isinstance(completion_window, str) else None
    if match is None or int(match.group(1)) > MAX_WINDOW_HOURS:
        raise BatchInputError(f"completion_window must be a whole number of hours up to {MAX_WINDOW_HOURS}, "
                              f"like '24h'; got {completion_window!r}", "completion_window")
    return int(match.group(1)) * 3600


def expiry_seconds(policy: Any, param: str) -> int:
    """OpenAI's `expires_after` ({"anchor": "created_at", "seconds": N}, N from an hour to 30 days): a file's
    lifetime. Without one a batch's files live FILE_TTL_SECONDS, as at OpenAI, so the database does not grow
    without bound."""
    if policy is None:
        return FILE_TTL_SECONDS
    seconds = policy.get("seconds") if isinstance(policy, dict) else None
    if isinstance(seconds, str):
        seconds = whole_number(seconds)  # a multipart form's fields are text
    if (not isinstance(policy, dict) or policy.get("anchor") != "created_at" or not isinstance(seconds, int)
            or not MIN_FILE_TTL_SECONDS <= seconds <= FILE_TTL_SECONDS):
        raise BatchInputError(f"{param} must be {{\"anchor\": \"created_at\", \"seconds\": N}} with N from "
                              f"{MIN_FILE_TTL_SECONDS} to {FILE_TTL_SECONDS}", param)
    return seconds


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS or not all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
        for k, v in metadata.items()
    ):
        raise BatchInputError(f"metadata must map at most {MAX_METADATA_PAIRS} strings of up to {MAX_METADATA_KEY} "
                              f"characters to strings of up to {MAX_METADATA_VALUE}", "metadata")
    return dict(metadata)


@dataclass(frozen=True)
class BatchLine:
    """One request of an input file: its line number (0-based), the client's id for it, and the request body."""

    line: int
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineProblem:
    """Why an input file was refused, as OpenAI lists it in `errors` (line numbers 1-based there)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "line": self.line, "param": self.param}


@dataclass(frozen=True)
class CheckedInput:
    """An input file's requests, or the problems that refuse it (then `lines` is empty)."""

    lines: list[BatchLine] = field(default_factory=list)
    problems: list[LineProblem] = field(default_factory=list)

    @property
    def model(self) -> str | None:
        """The model the batch's requests ask for, as OpenAI's batch object reports it: the first request's (a
        file normally names one model; a pool serving several takes each request's own)."""
        for line in self.lines:
            if isinstance(line.body.get("model"), str):
                return line.body["model"]
        return None


def check_input(content: bytes | Iterable[bytes], endpoint: str, max_requests: int) -> CheckedInput:
    """Every line a request for `endpoint` with a unique custom_id and a body, and at most `max_requests` of
    them: a file with any problem is refused whole (as OpenAI does), so a batch never runs half of what was meant.
    `content`: the file's bytes, or its pieces in order (the runner reads them from the database one at a time,
    so it holds the parsed requests and a piece, never the file whole)."""
    problems: list[LineProblem] = []
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw_bytes in enumerate(_byte_lines(_pieces(content)), start=1):
        try:  # a line at a time: "\n" is never part of a longer UTF-8 character
            raw_line = raw_bytes.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError:
            return _refused([LineProblem("invalid_file_format", f"the input file is not UTF-8 text (line {number})",
                                         number)])
        if not raw_line.strip():
            continue
        problem = _check_line(raw_line, number, endpoint, seen)
        if isinstance(problem, LineProblem):
            problems.append(problem)
        else:
            lines.append(BatchLine(len(lines), *problem))
    if not lines and not problems:
        problems.append(LineProblem("empty_file", "the input file has no requests"))
    if len(lines) > max_requests:
        problems.append(LineProblem("too_many_requests", f"the input file has {len(lines)} requests; a batch "
                                                         f"takes at most {max_requests}"))
    return _refused(problems) if problems else CheckedInput(lines)


def _byte_lines(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a file given in pieces, each line copied alone (one that pieces cut is joined): the file is
    neither decoded nor split whole. A UTF-8 character cut between two pieces is whole again in its line, as "\n"
    is never part of a longer character. JSONL lines end at "\n" only (str.splitlines would also cut at U+2028 and
    the like, which JSON strings may hold)."""
    partial: list[bytes] = []  # the start of a line, cut by the end of a piece (or of several)
    for piece in pieces:
        start = 0
        while (end := piece.find(b"\n", start)) >= 0:
            yield b"".join([*partial, piece[start:end]]) if partial else piece[start:end]
            partial, start = [], end + 1
        if start < len(piece):
            partial.append(piece[start:])
    yield b"".join(partial)


def _refused(problems: list[LineProblem]) -> CheckedInput:
    """The first MAX_LISTED_ERRORS problems, and a last one saying how many more there are."""
    listed = problems[:MAX_LISTED_ERRORS]
    if len(problems) > MAX_LISTED_ERRORS:
        listed.append(LineProblem("more_problems", f"{len(problems) - MAX_LISTED_ERRORS} more problems not listed"))
    return CheckedInput([], listed)


def _check_line(raw_line: str, number: int, endpoint: str, seen: set[str]) -> LineProblem | tuple[str, dict[str, Any]]:
    try:  # as the router parses a request's body (its nesting bound too), which this line's becomes
        entry = read_json(raw_line)
    except ValueError as exc:
        return LineProblem("invalid_json_line", f"line {number}: {exc}", number)
    if not isinstance(entry, dict):
        return LineProblem("invalid_json_line", f"line {number} is not a JSON object", number)
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineProblem("invalid_custom_id", f"line {number}: custom_id must be a string of 1 to "
                                                f"{MAX_CUSTOM_ID_CHARS} characters", number, "custom_id")
    if custom_id in seen:
        return LineProblem("duplicate_custom_id", f"line {number}: custom_id {custom_id!r} is used by an earlier "
                                                  f"line", number, "custom_id")
    seen.add(custom_id)
    if entry.get("method") != "POST":
        return LineProblem("invalid_method", f"line {number}: method must be POST", number, "method")
    if entry.get("url") != endpoint:
        return LineProblem("mismatched_endpoint", f"line {number}: url {entry.get('url')!r} is not the batch's "
                                                  f"endpoint {endpoint}", number, "url")
    body = entry.get("body")
    if not isinstance(body, dict):
        return LineProblem("invalid_request", f"line {number}: body must be a JSON object", number, "body")
    if body.get("stream"):
        return LineProblem("invalid_request", f"line {number}: a batch's requests cannot stream", number,
                           "body.stream")
    if body.get("stream_options") is not None:  # the engines refuse it without stream: true (as OpenAI does)
        return LineProblem("invalid_request", f"line {number}: stream_options is only allowed with stream: true, and "
                                              "a batch's requests cannot stream", number, "body.stream_options")
    return custom_id, body


def prefix_key(body: Mapping[str, Any]) -> str:
    """A text that sorts requests sharing a prompt prefix next to each other: the model, the tools (a chat
    template shows them before the messages), a response request's instructions (its system message), then the
    messages, the prompt or the response request's input as the client wrote them. Sorted
    order is the depth-first order of the prefix trie, so a run of requests shares the longest prefixes the file
    has, and a pod's prefix cache serves each run's prefix from its first request on."""
    prompt = body.get("messages", body.get("prompt", body.get("input")))
    parts = (body.get("model"), body.get("tools"), body.get("instructions"), prompt)
    return "\x00".join(p if isinstance(p, str) else json.dumps(p, sort_keys=True, ensure_ascii=False) for p in parts)


def run_order(lines: Iterable[BatchLine], order: str = PREFIX_ORDER) -> list[BatchLine]:
    """The order a batch's requests are sent in: shared prefixes together (ties in file order), or the file's."""
    if order == FILE_ORDER:
        return sorted(lines, key=lambda line: line.line)
    return sorted(lines, key=lambda line: (prefix_key(line.body), line.line))


def prefix_groups(ordered: Sequence[BatchLine], min_shared_chars: int) -> list[list[BatchLine]]:
    """Runs of `ordered` (run_order's) whose prefix keys begin with the same `min_shared_chars` characters as the
    run's first: requests worth sending once the first of their run was answered, its prefix then cached. With
    min_shared_chars 0 each request is a run of its own."""
    groups: list[list[BatchLine]] = []
    opening = ""
    for line in ordered:
        key = prefix_key(line.body)
        if groups and min_shared_chars > 0 and len(key) >= min_shared_chars and key[:min_shared_chars] == opening:
            groups[-1].append(line)
        else:
            groups.append([line])
            opening = key[:min_shared_chars]
    return groups


@dataclass(frozen=True)
class LineResult:
    """How one request of a batch ended: the response's status and body (the pod's answer or the router's
    error), and its usage counted into the batch's."""

    line: int
    custom_id: str
    status_code: int
    body: dict[str, Any]
    request_id: str

    @property
    def ok(self) -> bool:
        return self.status_code == 200

    def usage(self) -> tuple[int, int, int]:
        """(prompt, cached, completion) tokens of a served request; zeros otherwise."""
        usage = usage_object(self.body.get("usage") if self.ok else None)
        if "input_tokens" in usage:  # a response object's
            return (usage_count(usage, "input_tokens"), cached_tokens(usage, "input_tokens_details"),
                    usage_count(usage, "output_tokens"))
        return usage_count(usage, "prompt_tokens"), cached_tokens(usage), usage_count(usage, "completion_tokens")

    def output_line(self) -> dict[str, Any]:
        """The line of the output file (served) or the error file (not), in OpenAI's shape."""
        return {"id": new_id("batch_req_"), "custom_id": self.custom_id,
                "response": {"status_code": self.status_code, "request_id": self.request_id, "body": self.body},
                "error": None}  # as OpenAI's: `error` is for a request that got no HTTP answer (unrun_line)


def unrun_line(line: BatchLine, code: str, message: str) -> dict[str, Any]:
    """The error file's line for a request the batch never ran (it expired or was cancelled first)."""
    return {"id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}


def jsonl(entries: Iterable[Mapping[str, Any]]) -> bytes:
    return "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode()


def list_page(items: Sequence[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A cursor page as OpenAI's list endpoints answer (`after` = the last id of the page before)."""
    return {"object": "list", "data": list(items), "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}
