"""Tokenize long texts in pieces, remembering the pieces: a conversation's earlier turns are tokenized once.

A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen2, SmolLM) first splits text into words with a regex, then merges
bytes inside each word; so text cut where the regex itself would cut tokenizes to the concatenation of its
pieces' tokens. Two such cuts are safe for all those regexes: before a space that follows a non-space and
precedes a letter (" The" always starts a word; a word never ends in a space), and after a lone newline between
two non-spaces (a run of whitespace would merge differently at the end of a piece than inside the text). Cuts
are chosen from the start of the text, each at the first safe place at least `piece_chars` after the last, so a
text that extends an earlier one (the next turn of a chat) cuts into the same pieces up to its old end, and
those come from the cache. Missing pieces are encoded together in one `encode_batch`, which the tokenizers
library spreads over the cores.

`TokenCache.exact` checks the rule on a probe text at start: a tokenizer it does not hold for (a normalizer, a
SentencePiece-style prefix marker) gets whole-text encoding, never a different answer.

Pieces are kept per scope (`CACHE_SCOPE`: the request's tenant in the router, its cache_salt in the engine), as
the prefix cache is salted per tenant: a text another tenant sent came back several times faster, so any tenant
could tell whether anyone had sent a given document or system prompt.

The cache is bounded in bytes as well as tokens, each entry charged what it really holds: a piece is remembered by a
32-byte keyed digest of its text (the key: a digest of its scope), not by the text or the scope, and its ids as 4-byte
machine integers. Keys of (scope, piece text) counting tokens only had let one token hold 359 bytes (64 "=" to a
token, and one emoji making Python store the text at 4 bytes a character: 359 MiB at the default bound) and a
100 KB cache_salt 2.9 kB (2.8 GiB).
"""

from __future__ import annotations

import hashlib
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextvars import ContextVar

_SAFE_CUT = re.compile(r"(?<=\S)(?= [^\W\d_])|(?<=\S\n)(?=\S)")
DEFAULT_PIECE_CHARS = 2048  # about 500 tokens: small enough that a new turn re-tokenizes little
DEFAULT_CAPACITY_TOKENS = 1 << 20  # a bound in tokens (Tokenizer's token_cache_tokens; 0 turns the cache off)
DEFAULT_CAPACITY_BYTES = 40 << 20  # and in bytes, whichever binds first: 40 MiB a process (each router, each engine)
_DIGEST_BYTES = 32  # blake2b's longest key: a scope's digest keys its pieces' digests
_PROBE = (
    "Hello world! It's 2024-05-17, and the price is $1,234.56.\n\nSection 2:\tdata\n  indented line\n"
    "def f(x):\n    return x ** 2  # comment\n\n\n"
    "Ünïcödé wörds, 日本語のテキスト, emoji 🙂 and symbols §±×÷ — dashes… quotes \"'`'\" end.\n"
    "Contractions: don't, I'm, we'll, they've, she'd, it's; URLs https://example.com/a?b=c&d=e.\n"
    "Numbers 1 22 333 4444 55555 and 3.14159 then words again after     many spaces and\ttabs.\r\nCRLF line.\n"
)

EncodeBatch = Callable[[list[str]], list[list[int]]]
# whose pieces this tokenizing may reuse; set by the edge that knows the request (a context variable, so it follows
# the request into the thread that tokenizes it). Unset: the one shared scope (no tenants).
CACHE_SCOPE: ContextVar[str] = ContextVar("kvmesh_token_cache_scope", default="")


def pieces(text: str, piece_chars: int) -> list[str]:
    """`text` cut at the first safe place at least `piece_chars` after each previous cut (see the module doc)."""
    out = []
    start = 0
    while len(text) - start > piece_chars:
        cut = _SAFE_CUT.search(text, start + piece_chars)
        if cut is None:
            break
        out.append(text[start : cut.start()])
        start = cut.start()
    out.append(text[start:])
    return out


def scope_key(scope: str) -> bytes:
    """A fixed-size stand-in for a scope (a cache_salt of any length costs a cache nothing more): this cache's, and
    the grammar checks' verdicts' (engine/constraint.py)."""
    return hashlib.blake2b(scope.encode("utf-8", "surrogatepass"), digest_size=_DIGEST_BYTES).digest()


def _piece_key(scope: bytes, piece: str) -> bytes:
    """The piece's entry: a 256-bit digest of its text keyed by its scope (another scope's never matches);
    surrogatepass, as JSON may carry a lone surrogate, and it encodes each string to different bytes."""
    return hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=_DIGEST_BYTES, key=scope).digest()


def entry_bytes(key: bytes, ids: array) -> int:
    """What an entry holds in memory besides its place in the table: its key and its ids."""
    return sys.getsizeof(key) + sys.getsizeof(ids)


class TokenCache:
    """piece digest (keyed by scope) -> token ids, least recently used out first, bounded by the tokens it holds
    and by the bytes its entries take; thread-safe."""

    def __init__(self, capacity_tokens: int = DEFAULT_CAPACITY_TOKENS, piece_chars: int = DEFAULT_PIECE_CHARS,
                 capacity_bytes: int = DEFAULT_CAPACITY_BYTES):
        if capacity_tokens < 0 or capacity_bytes < 0 or piece_chars < 1:
            raise ValueError("capacity_tokens and capacity_bytes must be >= 0 and piece_chars >= 1")
        self.capacity_tokens = capacity_tokens
        self.capacity_bytes = capacity_bytes
        self.piece_chars = piece_chars
        self._entries: OrderedDict[bytes, array] = OrderedDict()
        self._tokens = 0
        self._entries_bytes = 0  # the entries' own, without the table
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def exact(encode_batch: EncodeBatch, special_tokens: Sequence[str] = ()) -> bool:
        """Whether cutting at each safe place of a probe text gives the same ids as encoding it whole, for this
        tokenizer (its special tokens placed where chat templates put them: at line starts and after words)."""
        text = _PROBE + "".join(f"{t}user\nHi there {t} Bob\n" for t in special_tokens)
        cuts = [m.start() for m in _SAFE_CUT.finditer(text)]
        encoded = encode_batch([text, *(text[:c] for c in cuts), *(text[c:] for c in cuts)])
        whole, heads, tails = encoded[0], encoded[1 : len(cuts) + 1], encoded[len(cuts) + 1 :]
        return all(head + tail == whole for head, tail in zip(heads, tails, strict=True))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def size_bytes(self) -> int:
        """What the cache holds, as charged against `capacity_bytes`: its entries and its table, whose slots and
        links (105 to 190 bytes an entry, as entries come and go) are counted as they are, not estimated."""
        return self._entries_bytes + sys.getsizeof(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens = self._entries_bytes = 0

    def encode(self, text: str, encode_batch: EncodeBatch) -> list[int]:
        """The ids of `text`: pieces this scope cached from the cache, the rest encoded in one batch and
        remembered."""
        parts = pieces(text, self.piece_chars)
        if len(parts) == 1:
            return encode_batch(parts)[0]
        scope = scope_key(CACHE_SCOPE.get())
        keys = [_piece_key(scope, part) for part in parts]
        found: list[Sequence[int] | None] = [None] * len(parts)
        with self._lock:
            for i, key in enumerate(keys):
                ids = self._entries.get(key)
                if ids is not None:
                    self._entries.move_to_end(key)
                    found[i] = ids
        missing = [i for i, ids in enumerate(found) if ids is None]
        if missing:
            for i, ids in zip(missing, encode_batch([parts[i] for i in missing]), strict=True):
                found[i] = ids
            self._remember([(keys[i], found[i]) for i in missing])  # type: ignore[misc]
        with self._lock:
            self.hits += len(parts) - len(missing)
            self.misses += len(missing)
        out: list[int] = []
        for ids in found:
            out.extend(ids)  # type: ignore[arg-type]
        return out

    def _remember(self, entries: list[tuple[bytes, Sequence[int]]]) -> None:
        with self._lock:
            for key, ids in entries:
                held = array("i", ids)
                size = entry_bytes(key, held)
                if key in self._entries or len(held) > self.capacity_tokens or size > self.capacity_bytes:
                    continue
                self._entries[key] = held
                self._tokens += len(held)
                self._entries_bytes += size
            while self._entries and (self._tokens > self.capacity_tokens or self.size_bytes > self.capacity_bytes):
                key, dropped = self._entries.popitem(last=False)
                self._tokens -= len(dropped)
                self._entries_bytes -= entry_bytes(key, dropped)
