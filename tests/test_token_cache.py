"""Piecewise tokenization with a piece cache: always the same ids as encoding whole (the router's block hashes
depend on it), earlier turns of a conversation come from the cache, the cache stays within its bound, and a
tokenizer for which cutting is not exact is never cut."""

from __future__ import annotations

import contextvars
import gc
import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.model.token_cache import CACHE_SCOPE, TokenCache, pieces
from kvmesh.engine.model.tokenizer import Tokenizer

ALPHABET = st.sampled_from([
    "a", "b", "Z", "é", "日", "ß", "0", "7", " ", "  ", "\n", "\n\n", "\t", "\r\n", ".", ",", "'", "'s", "'t", "-",
    "$", "🙂", "<|im_start|>", "<|im_end|>", "user", "The", " the", "don't", "1,234.5", "::", "\u00a0", "#",
])


@pytest.fixture(scope="module")
def tokenizer(bundled_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(bundled_dir)


def whole(tokenizer: Tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """What the tokenizers library gives for the text in one piece: the reference."""
    return tokenizer._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def test_the_bundled_tokenizer_is_cut_and_cached(tokenizer: Tokenizer) -> None:
    assert tokenizer.token_cache is not None


@settings(max_examples=60, deadline=None)
@given(st.lists(ALPHABET, min_size=1, max_size=120), st.integers(1, 24))
def test_pieces_tokenize_to_the_whole(tokenizer: Tokenizer, parts: list[str], piece_chars: int) -> None:
    text = "".join(parts)
    cache = TokenCache(capacity_tokens=10_000, piece_chars=piece_chars)
    assert "".join(pieces(text, piece_chars)) == text
    assert cache.encode(text, tokenizer.encode_batch) == whole(tokenizer, text)
    assert cache.encode(text, tokenizer.encode_batch) == whole(tokenizer, text)  # again, from the cache


def test_a_conversation_reuses_its_earlier_turns(tokenizer: Tokenizer) -> None:
    turn = "The router keeps one index of every block.\nEach pod streams its events. " * 120
    cache = tokenizer.token_cache
    assert cache is not None
    cache.clear()
    messages = [{"role": "user", "content": turn}]
    first = tokenizer.encode_chat(messages)
    assert first == whole(tokenizer, tokenizer.apply_chat_template(messages))
    hits, misses = cache.hits, cache.misses
    messages += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "And then?"}]
    second = tokenizer.encode_chat(messages)
    assert second == whole(tokenizer, tokenizer.apply_chat_template(messages))
    assert cache.hits - hits >= 3  # the earlier turn's pieces were not tokenized again
    assert cache.misses - misses <= 2  # only the piece the new turn extends, and the new turn


def test_add_special_tokens_matches_the_library(tokenizer: Tokenizer) -> None:
    text = "word " * 2000
    assert tokenizer.encode(text) == whole(tokenizer, text, add_special_tokens=True)


def test_pieces_are_kept_per_scope(tokenizer: Tokenizer) -> None:
    """A scope (a tenant) reuses its own pieces only; the ids are the same in every scope."""
    cache = TokenCache(piece_chars=64)
    text = "The quick brown fox jumps over the lazy dog. " * 20

    def encode(scope: str) -> list[int]:
        return contextvars.copy_context().run(lambda: (CACHE_SCOPE.set(scope), cache.encode(text,
                                                                                            tokenizer.encode_batch))[1])

    first = encode("a")
    assert cache.hits == 0 and encode("b") == first and cache.hits == 0
    assert encode("a") == first and cache.hits == cache.misses // 2


def test_the_cache_stays_within_its_bound(tokenizer: Tokenizer) -> None:
    cache = TokenCache(capacity_tokens=300, piece_chars=50)
    for i in range(20):
        text = f"Document {i} says hello to everyone in the room and leaves.\n" * 10
        assert cache.encode(text, tokenizer.encode_batch) == whole(tokenizer, text)
        assert cache.tokens <= 300
    assert 0 < len(cache) < 20 * 10
    with pytest.raises(ValueError):
        TokenCache(capacity_tokens=-1)


def _variant(bundled_dir: Path, tmp_path: Path, change) -> Tokenizer:
    for name in ("tokenizer_config.json", "generation_config.json", "config.json"):
        if (bundled_dir / name).is_file():
            (tmp_path / name).write_text((bundled_dir / name).read_text())
    data = json.loads((bundled_dir / "tokenizer.json").read_text())
    change(data)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    return Tokenizer.from_dir(tmp_path)


def test_a_special_token_that_eats_whitespace_turns_cutting_off(bundled_dir: Path, tmp_path: Path) -> None:
    def lstrip(data: dict) -> None:
        data["added_tokens"][1]["lstrip"] = True

    tok = _variant(bundled_dir, tmp_path, lstrip)
    assert tok.token_cache is None
    text = "Hello there\n<|im_start|>user\nHi " * 200
    assert tok.encode(text) == whole(tok, text, add_special_tokens=True)


def test_a_tokenizer_where_cuts_are_not_exact_is_encoded_whole(bundled_dir: Path, tmp_path: Path) -> None:
    """With a prefix space added to every encoded text, a piece starting with a word would gain a space: the probe
    at start notices and the tokenizer encodes whole."""

    def prefix_space(data: dict) -> None:
        data["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True

    tok = _variant(bundled_dir, tmp_path, prefix_space)
    assert tok.token_cache is None
    text = "First line\nSecond line and more words\n" * 200
    assert tok.encode(text) == whole(tok, text, add_special_tokens=True)


def _held_bytes(fill: Callable[[], TokenCache]) -> tuple[TokenCache, int]:
    """The cache `fill` builds and the bytes Python holds for it once filled (tracemalloc: the entries, their keys
    and the table)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        cache = fill()
        gc.collect()
        return cache, tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


def _in_scope(scope: str, work: Callable[[], object]) -> None:
    contextvars.copy_context().run(lambda: (CACHE_SCOPE.set(scope), work()))


# the review's probes: 64 "=" make one token and one emoji makes Python hold the text at 4 bytes a character (358.9
# bytes a cached token, 359 MiB at the token bound); a small last piece costs a whole entry for a few tokens
ADVERSARIAL: dict[str, tuple[Callable[[int], str], int]] = {  # the texts, and how many fill a 64 KiB cache
    "long pieces held at 4 bytes a character": (lambda i: "=" * 64000 + f"\U0001F642{i} end", 30),
    "small last pieces": (lambda i: "The router keeps one index of every block. " * 60 + f"x{i}", 300),
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_the_cache_holds_no_more_bytes_than_its_budget(tokenizer: Tokenizer, name: str) -> None:
    budget = 64 * 1024
    text, texts = ADVERSARIAL[name]

    def fill() -> TokenCache:
        cache = TokenCache(capacity_bytes=budget)
        for i in range(texts):
            cache.encode(text(i), tokenizer.encode_batch)
        return cache

    cache, held = _held_bytes(fill)
    assert budget // 2 < cache.size_bytes <= budget  # full: the bound in bytes is what stopped it
    # past the charged bytes only the cache object itself, its lock and counters (under 1 KiB)
    assert held <= budget + 2048, f"{held} bytes held for a budget of {budget}"


def test_a_long_piece_or_a_long_salt_is_not_held(tokenizer: Tokenizer) -> None:
    """A cached token costs its 4 bytes and its share of the entry, whatever the piece's text or the scope: neither
    is kept (the review measured 359 bytes a token for the long pieces, 2,889 for 100 KB salts)."""
    text = ADVERSARIAL["long pieces held at 4 bytes a character"][0]

    def pieces_of_long_texts() -> TokenCache:
        cache = TokenCache(capacity_tokens=40_000)
        for i in range(40):
            cache.encode(text(i), tokenizer.encode_batch)
        return cache

    def long_salts() -> TokenCache:
        cache = TokenCache(capacity_tokens=40_000)
        for i in range(40):
            _in_scope(f"{i:06d}" + "s" * 100_000, lambda: cache.encode("=" * 2100 + " x", tokenizer.encode_batch))
        return cache

    for fill, most_per_token in ((pieces_of_long_texts, 8), (long_salts, 40)):
        cache, held = _held_bytes(fill)
        assert cache.tokens > 0 and held / cache.tokens <= most_per_token, (fill.__name__, held / cache.tokens)
