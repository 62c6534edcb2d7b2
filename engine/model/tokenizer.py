"""Tokenizer, chat template and streaming detokenizer of a model directory.

Torch-free on purpose: the router imports this module to compute the same prompt tokens (and so the same block
hashes) as the engine, and checks `Tokenizer.fingerprint` against each pod's before trusting those hashes.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError, meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kvmesh.engine.model.token_cache import DEFAULT_CAPACITY_TOKENS, TokenCache
from kvmesh.engine.model.tool_prompt import prompt_messages

_REPLACEMENT_CHAR = "\ufffd"
_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback tokens (Llama 2's)
# Tokens an incremental detokenizer decodes again with each step: enough for a word boundary or a split character.
_CONTEXT_TOKENS = 5


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode, which the ByteLevel decoder inverts): the character
    that stands for each byte in a token's piece, here mapped back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def _token_text(value: object) -> str | None:
    """A special token from tokenizer_config.json, which stores it as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ids(value: object) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _chat_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    """The default chat template: chat_template.jinja (newer HF layout) or tokenizer_config.json's entry."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's tojson: plain json.dumps, without jinja's HTML escaping, which would change the prompt."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_env() -> ImmutableSandboxedEnvironment:
    """The sandboxed environment transformers renders chat templates in, so templates written for it work here."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# What a message's text parts are joined with (as vLLM does), wherever parts become one content string: chat
# messages here, the Responses API's input_text parts in the router, so one conversation is one prompt
TEXT_PARTS_SEPARATOR = "\n"


def _content_text(index: int, content: object) -> str:
    """A message's content as one string; OpenAI's list of text parts is joined with newlines (as vLLM does)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ValueError(f"messages[{index}].content must be a string or a non-empty list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{index}].content parts must be {{'type': 'text', 'text': str}}, got {part!r}")
        texts.append(part["text"])
    return TEXT_PARTS_SEPARATOR.join(texts)


def _normalize_messages(messages: object, developer_role: bool) -> list[dict]:
    """The messages as a template reads them: content as text, and OpenAI's `developer` role (its newer name for
    the system prompt) as `system` for a template that does not name it (`developer_role` False)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a non-empty string 'role'")
        if "content" not in message:
            raise ValueError(f"messages[{i}] needs 'content'")
        calls_only = role == "assistant" and message["content"] is None and message.get("tool_calls")
        normalized.append({**message, "role": "system" if role == "developer" and not developer_role else role,
                           "content": "" if calls_only else _content_text(i, message["content"])})
    return normalized


class Tokenizer:
    """A model directory's tokenizer.json and chat template, as transformers would apply them.

    Whether encode() adds a BOS token is decided by tokenizer.json's post-processor alone (SmolLM2's adds none);
    bos_token_id only names the token.
    """

    def __init__(
        self,
        tokenizer_json: str,
        chat_template: str | None,
        special_tokens: dict[str, str | None],
        extra_eos_ids: Sequence[int],
        token_cache_tokens: int = DEFAULT_CAPACITY_TOKENS,
    ) -> None:
        self._tokenizer = HFTokenizer.from_str(tokenizer_json)
        self._tokenizer_json = tokenizer_json
        self._chat_template = chat_template
        self._special_tokens = special_tokens
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        bos, eos = special_tokens.get("bos_token"), special_tokens.get("eos_token")
        self.bos_token_id: int | None = self._tokenizer.token_to_id(bos) if bos else None
        eos_id = self._tokenizer.token_to_id(eos) if eos else None
        self.eos_token_ids: frozenset[int] = frozenset([*extra_eos_ids, *([] if eos_id is None else [eos_id])])
        self._cache, self._added_prefix = self._piecewise(token_cache_tokens)

    def _piecewise(self, capacity_tokens: int) -> tuple[TokenCache | None, list[int] | None]:
        """A token cache when piecewise encoding is exact for this tokenizer (see token_cache.py), and the ids
        encode() adds in front with add_special_tokens (None when it adds anything after the text: then such
        encodes go whole)."""
        added = self._tokenizer.get_added_tokens_decoder().values()
        if capacity_tokens <= 0 or any(t.lstrip or t.rstrip or any(c.isspace() for c in t.content) for t in added):
            return None, None
        if not TokenCache.exact(self.encode_batch, [t.content for t in added]):
            return None, None
        prefix = None
        bare, full = self.encode_batch(["a b"])[0], self._tokenizer.encode("a b").ids
        if full[len(full) - len(bare) :] == bare:
            prefix = full[: len(full) - len(bare)]
        return TokenCache(capacity_tokens), prefix

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, without special tokens added (the pieces of a text are encoded this way)."""
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json, and the eos ids of generation_config.json and config.json."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        config = _read_json(model_dir / "tokenizer_config.json")
        specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        eos_ids = [
            *_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id")),
            *_ids(_read_json(model_dir / "config.json").get("eos_token_id")),
        ]
        return cls(path.read_text(), _chat_template(model_dir, config), specials, eos_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; long texts go piecewise through the token cache when that is exact."""
        if (self._cache is None or len(text) <= self._cache.piece_chars
                or (add_special_tokens and self._added_prefix is None)):
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._cache.encode(text, self.encode_batch)
        return [*self._added_prefix, *ids] if add_special_tokens and self._added_prefix else ids

    @property
    def token_cache(self) -> TokenCache | None:
        """The piece cache (None when this tokenizer must encode whole), for metrics and tests."""
        return self._cache

    def to_json(self) -> str:
        """The tokenizer.json text (structured outputs build llguidance's view of the vocabulary from it)."""
        return self._tokenizer_json

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _byte_level(self) -> dict[str, int] | None:
        """The byte-level alphabet when tokenizer.json decodes through it (a ByteLevel decoder), else None."""
        decoder = json.loads(self._tokenizer_json).get("decoder") or {}
        kinds = [d.get("type") for d in decoder.get("decoders") or []] + [decoder.get("type")]
        return _byte_level_alphabet() if "ByteLevel" in kinds else None

    def token_bytes(self, token_id: int, text: str | None = None) -> bytes:
        """The bytes one token stands for (`text`: its decode, if the caller has it): its text's UTF-8, or, for a
        token that is part of a character (it decodes alone to U+FFFD), its own bytes, read from its piece: a
        byte-fallback piece's (<0xE2>), or a byte-level piece's characters mapped back to their bytes."""
        text = self.decode([token_id], skip_special_tokens=False) if text is None else text
        if _REPLACEMENT_CHAR not in text:
            return text.encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return text.encode()
        if found := _BYTE_FALLBACK_PIECE.fullmatch(piece):
            return bytes([int(found.group(1), 16)])
        alphabet = self._byte_level
        if alphabet is not None and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return text.encode()

    @cached_property
    def _compiled_template(self) -> Template:
        if self._chat_template is None:
            raise ValueError("this model has no chat template; send a completion request instead")
        return _template_env().from_string(self._chat_template)

    @cached_property
    def template_uses_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (else model/tool_prompt.py adds the Hermes prompt): the
        template's undeclared variables, not its text, which may say "tools" in a comment or a sentence."""
        if not self._chat_template:
            return False
        try:
            return "tools" in meta.find_undeclared_variables(_template_env().parse(self._chat_template))
        except TemplateError:
            return False  # a template that does not parse fails when rendered, with its own message

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """Render messages into the prompt text; malformed messages or a template's own refusal raise ValueError.
        `tools` (OpenAI's tool dicts) is passed to the template as HF's apply_chat_template does, and
        `template_kwargs` as more variables (a template ignores those it does not read)."""
        normalized = _normalize_messages(messages, "developer" in (self._chat_template or ""))
        try:
            own = {"messages": normalized, "add_generation_prompt": add_generation_prompt, "tools": tools,
                   **{k: v for k, v in self._special_tokens.items() if v is not None}}
            return self._compiled_template.render({**(template_kwargs or {}), **own})
        except TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        except (TypeError, AttributeError, KeyError, IndexError) as e:  # a variable of a kind the template cannot use
            raise ValueError(f"the chat template failed on these messages or variables: {type(e).__name__}: {e}") \
                from e

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the rendered chat, with `tools` (OpenAI's tool dicts) shown the way this template can
        (model/tool_prompt.py); the template already holds its special tokens, so none are added again."""
        rendered = prompt_messages(messages, tools, self.template_uses_tools)
        text = self.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                        tools=tools if self.template_uses_tools else None,
                                        template_kwargs=template_kwargs)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def fingerprint(self) -> str:
        """Equal for tokenizers that turn the same messages into the same ids; the router compares it with pods'."""
        settings = {
            "tokenizer": hashlib.sha256(self._tokenizer_json.encode()).hexdigest(),
            "chat_template": self._chat_template,
            "special_tokens": self._special_tokens,
            "eos_token_ids": sorted(self.eos_token_ids),
        }
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas for streaming.

    Each step decodes a short window of recent ids twice: up to the last emitted token (prefix) and to the end;
    the difference is the new text. Decoding a window rather than single tokens keeps word boundaries right
    (a tokenizer may drop a leading space at the start of what it decodes), and text ending in U+FFFD is held
    back because the next token may complete that character. The window starts at prompt_ids' tail, so the
    first output token sees its real left context.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids or [])[-_CONTEXT_TOKENS:]
        self._read_offset = len(self._ids)
        self._prefix_offset = 0
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(_REPLACEMENT_CHAR):  # a prompt ending mid-character gives no usable context
            self._ids, self._read_offset, self._prefix_text = [], 0, ""
        self._text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, new_ids: Sequence[int]) -> str:
        """Append ids and return the text they complete (possibly empty while a character is still split)."""
        delta = []
        for token_id in new_ids:
            self._ids.append(token_id)
            text = self._decode(self._ids[self._prefix_offset :])
            if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
                continue
            delta.append(text[len(self._prefix_text) :])
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._text += "".join(delta)
        return "".join(delta)

    def flush(self) -> str:
        """At the end of the output: the text still held back (a character no token will complete), as the
        tokenizer decodes it, so the deltas add up to decode(all ids) whatever the last token was."""
        text = self._decode(self._ids[self._prefix_offset :])
        delta = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        self._text += delta
        return delta

    @property
    def text(self) -> str:
        return self._text
