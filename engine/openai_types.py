"""OpenAI API request bodies with their documented ranges, plus kvmesh's extensions (docs/contracts.md, contract 0).

Torch-free, like protocol.py: the router parses the same bodies. Ranges are checked here so that a bad value
is a 400 naming the parameter, never a 500 from deep inside the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError, from_json
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from kvmesh.engine.constraint import Constraint, check
from kvmesh.engine.protocol import HOT_CHAINS_MAX, MAX_CHAIN_BLOCKS

# OpenAI's documented ranges (the sampler checks them again for callers that skip these models)
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence and frequency penalties: -2 to 2
MAX_LOGIT_BIAS = 100.0  # logit_bias values: -100 to 100
MAX_REPETITION_PENALTY = 10.0  # vLLM takes any positive value; past this every seen token is all but forbidden
# what the chat template is given by the engine itself: chat_template_kwargs may not replace them
TEMPLATE_OWN_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                    "pad_token", "unk_token", "raise_exception", "strftime_now"})
# chat's `verbosity` and the Responses API's `text.verbosity`: OpenAI's default, the only one served (another asks
# for a shorter or longer answer, which this server does not steer)
DEFAULT_VERBOSITY = "medium"
MAX_N = 16  # choices per prompt
# The sequences one request may start: a completion's prompts times `n`, each one engine request and one choice of
# the answer. OpenAI caps a request's choices at 128 (its bound on `n`); a list of prompts shares that bound, so one
# call cannot queue thousands of sequences ahead of everyone else's. The router parses with these models: one bound.
MAX_SEQUENCES_PER_REQUEST = 128
# A choice constraint's size, checked before llguidance compiles it: a grammar past about 65,000 symbols makes it
# panic (100,000 choices: half a minute, then a 400 holding its backtrace). OpenAI's bounds on a structured output
# schema's enum values: 1,000 of them, and 120,000 characters of strings in all.
MAX_CHOICES = 1000
MAX_CHOICES_CHARS = 120_000
# A grammar's text: the same panic past 65,000 symbols (80,000 alternatives, 700 kB), while a real grammar (JSON,
# SQL, a language's expressions in Lark or GBNF) takes a few kB; the densest 64 KiB (7,400 short alternatives)
# compiles in a fifth of a second.
MAX_GRAMMAR_CHARS = 64 * 1024
# A cache_salt's length. The router sets 32 hex characters; vLLM suggests 43 (256 random bits in base64) and sets no
# bound. Unbounded, a client reaching an engine directly (or any with auth off) had each salt stored with every piece
# its tokenizer cached: 100 KB salts would have held 2.8 GiB at the cache's token bound.
MAX_CACHE_SALT_CHARS = 1024


def _choices_within_bound(choices: list[str]) -> list[str]:
    total = sum(len(c) for c in choices)
    if total > MAX_CHOICES_CHARS:
        raise ValueError(f"the choices hold {total} characters in all; at most {MAX_CHOICES_CHARS} are allowed")
    return choices


Choices = Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES), AfterValidator(_choices_within_bound)]
GrammarText = Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON's \ud800 escape decodes to one; no UTF-8 encodes it
_TOKEN_ID_FIELDS = frozenset({"prompt", "resume_output_ids", "stop_token_ids"})  # no text inside (prompt: below)


def valid_text(value: Any) -> Any:
    """`value` unchanged; ValueError when a string anywhere in it holds a lone surrogate, which the tokenizer and
    the grammar engine cannot encode (a 500 from deep inside them otherwise). Iterative: a body nests as deep as
    its JSON parser allows."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                raise ValueError(f"text must be valid Unicode, got a lone surrogate in {item!r:.60}")
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return value


def _text_fields(value: Any, info: ValidationInfo) -> Any:
    """A body field's raw value, refused when it holds text that is not valid Unicode (token id fields skipped)."""
    return value if info.field_name in _TOKEN_ID_FIELDS else valid_text(value)


class StreamOptions(BaseModel):
    include_usage: bool = False


class KVTransfer(BaseModel):
    """The `kv_transfer` request field (docs/contracts.md, contract 0):
    - prefill: compute the prompt, sample the first token, keep the KV under a handle for `ttl_seconds`;
    - decode: pull the prompt's blocks this pod lacks from `source` (under `handle`) and continue after
      `first_token`;
    - pull: fetch the blocks of the first `tokens` prompt tokens from `source` before computing the rest.

    Only kvmesh's router writes it, and a router of the next release meets engines of this one mid-roll: a field
    this engine does not know is ignored, not refused with a 400 that would fail the request (or every handoff)
    until the roll ends. So a later field must be one an older engine may leave unread; a later mode is refused."""

    model_config = ConfigDict(extra="ignore")
    mode: Literal["prefill", "decode", "pull"]
    source: str | None = Field(default=None, pattern=r"^https?://")
    handle: str | None = None
    first_token: int | None = Field(default=None, ge=0)
    tokens: int | None = Field(default=None, ge=1)
    ttl_seconds: float | None = Field(default=None, gt=0, le=3600)

    @model_validator(mode="after")
    def _fields_of_mode(self) -> KVTransfer:
        needed = {"prefill": (), "decode": ("source", "handle", "first_token"), "pull": ("source", "tokens")}
        missing = [name for name in needed[self.mode] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"kv_transfer mode {self.mode!r} needs {', '.join(missing)}")
        return self


class FetchRequest(BaseModel):
    """POST /v1/kv/fetch: blocks by hash, optionally under a handoff handle (checked for expiry)."""

    block_hashes: list[int] = Field(min_length=1, max_length=MAX_CHAIN_BLOCKS)
    handle: str | None = None


class ReleaseRequest(BaseModel):
    """POST /v1/kv/release: unpin a handoff's blocks now (no decode pod took it); an unknown handle is no error."""

    handle: str = Field(min_length=1, max_length=200)


class WarmRequest(BaseModel):
    """POST /v1/kv/warm: pull from `source` the blocks of these chains (hashes from the root) this pod lacks.

    Only kvmesh's operator sends it, and a newer operator warms this release's pods during a roll: a field this
    engine does not know is ignored (a later field must be one an older engine may leave unread), not a 400 that
    would leave every new pod cold."""

    model_config = ConfigDict(extra="ignore")
    source: str = Field(pattern=r"^https?://")
    chains: list[list[int]] = Field(min_length=1, max_length=HOT_CHAINS_MAX)

    @field_validator("chains")
    @classmethod
    def _chains_not_empty(cls, chains: list[list[int]]) -> list[list[int]]:
        if any(not chain or len(chain) > MAX_CHAIN_BLOCKS for chain in chains):
            raise ValueError(f"every chain holds 1 to {MAX_CHAIN_BLOCKS} block hashes")
        return chains


class WarmResponse(BaseModel):
    """What a warm-up did: blocks pulled, blocks already here, chains that could not be completed (and why)."""

    blocks_pulled: int = 0
    blocks_present: int = 0
    failed: int = 0
    errors: list[str] = Field(default_factory=list)


class HotChainBody(BaseModel):
    hashes: list[int]
    hits: int


class HotResponse(BaseModel):
    """GET /v1/kv/hot: the hottest cached prefix chains, hottest first."""

    chains: list[HotChainBody]


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema. The schema is followed as written: `strict` changes nothing here
    (an object allows more properties unless its schema says `additionalProperties: false`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _valid(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        if (constraint := self.constraint()) is not None:
            check(constraint)
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return Constraint("json_object", None, "response_format")
        if self.json_schema is not None:
            return Constraint("json_schema", self.json_schema.schema_, "response_format")
        return None


def read_json(payload: bytes | str, what: str | None = None) -> Any:
    """JSON a client sent, whole bodies and JSON given as text inside them (a schema, a config flag): the one
    reader, pydantic's parser rather than the json module, so its nesting bound (about 200 levels) holds wherever it
    runs (json's recursion limit depends on the caller's stack, so a body a little less deep could parse in one
    place and fail to serialize again on its way to a pod: a 500), twice as fast too. ValueError ("malformed JSON: ...",
    or "`what` is not JSON: ..." for a part of a body) for text that is not UTF-8 JSON or nests past the bound."""
    try:
        return from_json(payload)
    except ValueError as exc:
        reason = "it nests too deeply to read" if "recursion limit" in str(exc) else str(exc)
        raise ValueError(f"{what} is not JSON: {reason}" if what else f"malformed JSON: {reason}") from None


def json_object(value: Any, what: str) -> dict[str, Any]:
    """A mapping given as itself or as its JSON text (vLLM takes both: a schema in a body, a config in a flag);
    ValueError naming `what` otherwise."""
    if isinstance(value, str):
        value = read_json(value, what)
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object (a mapping), got {value!r:.80}")
    return value


def _schema(value: dict[str, Any] | str) -> dict[str, Any]:
    return json_object(value, "the JSON schema")


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, a list of choices, a grammar (Lark or
    GBNF), or any JSON object. Options of vLLM's that this engine does not apply are refused, not ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputsParams:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, "json_" if name == "json" else name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got {given or 'none'})")
        check(self.constraint())
        return self

    def constraint(self) -> Constraint:
        if self.json_ is not None:
            return Constraint("json_schema", _schema(self.json_), "structured_outputs")
        if self.regex is not None:
            return Constraint("regex", self.regex, "structured_outputs")
        if self.choice is not None:
            return Constraint("choice", self.choice, "structured_outputs")
        if self.grammar is not None:
            return Constraint("grammar", self.grammar, "structured_outputs")
        return Constraint("json_object", None, "structured_outputs")


_GUIDED_KINDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # vLLM's older top-level fields, which many clients still send
# the body fields whose validation checks a grammar (engine/constraint.py), which may take up to CHECK_SECONDS
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *_GUIDED_KINDS, "tools")


def checks_a_grammar(raw: Any) -> bool:
    """Whether validating this parsed body checks a grammar: the router validates it off its event loop then."""
    return isinstance(raw, dict) and any(raw.get(name) is not None for name in CONSTRAINT_FIELDS)


def stop_strings(value: str | list[str] | None) -> list[str]:
    """A request's `stop` as a list (OpenAI takes one string or several)."""
    return [value] if isinstance(value, str) else list(value or [])


def _own_template_variables(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs may add variables but not replace those the engine gives the template."""
    if taken := sorted(TEMPLATE_OWN_VARIABLES & set(value or {})):
        raise ValueError(f"{', '.join(taken)} cannot be set here: the request's own fields give the template those")
    return value


# vLLM's request fields beyond OpenAI's that this server does not honour: each is refused with a 400 naming it when
# given a value other than its neutral one (its default, or null), never ignored, since an ignored one answers other
# than asked. Name -> (neutral value, why). The one home of this list: docs/engine.md states it from here.
REFUSED_FIELDS: dict[str, tuple[Any, str]] = {
    "bad_words": ([], "is not supported: no words are banned from the output here"),
    "prompt_logprobs": (None, "is not supported: for a completion, send echo: true with logprobs for the prompt's "
                              "logprobs"),
    "use_beam_search": (False, "is not supported: beam search is not run here"),
    "length_penalty": (1.0, "is not supported: it weighs beam search, which is not run here"),
    "logits_processors": (None, "are not supported: no custom logits processors run here"),
    "vllm_xargs": (None, "is not supported: no sampling plugins run here to read it"),
    "return_tokens_as_token_ids": (False, "is not supported: logprobs name tokens by their text"),
    "prompt_embeds": (None, "is not supported: prompts are text or token ids"),
}
# the chat endpoint's own (its prompt is built from the messages through the chat template)
REFUSED_CHAT_FIELDS: dict[str, tuple[Any, str]] = {
    "echo": (False, "is not supported for chat (a completion echoes its prompt)"),
    "continue_final_message": (False, "is not supported: the answer starts a new assistant turn"),
    "documents": (None, "are not supported: put them in the messages"),
    "chat_template": (None, "is not supported: the model's own chat template is used"),
    "add_special_tokens": (False, "is not supported for chat: the chat template places the special tokens"),
}
# vLLM's fields accepted (ignored, as any unknown field) because they change nothing an answer holds:
# spaces_between_special_tokens (special tokens' text is joined as the tokenizer decodes it, as vLLM's fast tokenizers
# do whatever it says), priority (x-kvmesh-priority orders requests here), request_id (the response's id is the
# engine's own), mm_processor_kwargs (only text is served), guided_decoding_backend (llguidance enforces every
# constraint).


def _refused(data: Any, refused: Mapping[str, tuple[Any, str]], model: str) -> Any:
    """`data` unchanged; a ValidationError at the first refused field given a value other than its neutral one."""
    if isinstance(data, dict):
        for name, (neutral, why) in refused.items():
            if data.get(name) not in (None, neutral):
                raise ValidationError.from_exception_data(model, [InitErrorDetails(
                    type=PydanticCustomError("value_error", why), loc=(name,), input=data[name])])
    return data


class _Common(BaseModel):
    """Fields both endpoints share. Unknown fields are accepted and ignored, as OpenAI-compatible servers do, except
    vLLM's that would change the answer (REFUSED_FIELDS)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    # vLLM's (and HF's): logits of tokens already in the prompt or the output divided by it (multiplied when negative)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI's clients send it) -> bias
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None
    guided_whitespace_pattern: str | None = None  # vLLM's: refused (JSON here is written with fixed separators)
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    kv_transfer: KVTransfer | None = None
    resume_output_ids: list[int] | None = None
    return_token_ids: bool = False
    # vLLM's sampling extensions (SamplingParams' meanings)
    include_stop_str_in_output: bool = False  # a stop string (and a stop token's text) stays in the output
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)  # only these may be sampled
    skip_special_tokens: bool = True  # false: special tokens' text (such as "<|im_end|>") is in the output
    # the prompt's last N tokens only (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    _text = field_validator("*", mode="before")(_text_fields)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _refused(data, REFUSED_FIELDS, cls.__name__)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_some(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be at least 1 (the prompt's last N tokens), or -1 for as many as the context holds")
        return value

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """A prompt's ids as this request has them computed: its last `truncate_prompt_tokens`, as vLLM keeps."""
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return prompt_ids[-keep:] if keep is not None else prompt_ids

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """null for an optional field means its default, as OpenAI and vLLM read it: the official client sends null
        for an argument given as None (`temperature=None`), and many wrappers serialize unset fields so."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        """Options of a stream, refused without one, as OpenAI and vLLM refuse them (`stream` is validated
        first: a field declared before this one; when it failed, that error is the one to read)."""
        if value is not None and info.data.get("stream") is False:
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    @field_validator("guided_whitespace_pattern")
    @classmethod
    def _no_whitespace_pattern(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("is not supported: JSON is written with fixed separators (a schema may choose its own "
                             "with llguidance's x-guidance options)")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = stop_strings(value)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def stops(self) -> list[str]:
        return self.stop if isinstance(self.stop, list) else []

    @field_validator(*_GUIDED_KINDS)
    @classmethod
    def _guided(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            kind = _GUIDED_KINDS[info.field_name or ""]
            check(Constraint(kind, _schema(value) if kind == "json_schema" else value, info.field_name or ""))
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> _Common:
        if len(self.constraints()) > 1:
            named = ", ".join(c.param for c in self.constraints())
            raise ValueError(f"at most one structured output constraint per request, got {named}")
        if self.allowed_token_ids and self.constraints():
            self._allowed_tokens_alone(self.constraints()[0].param)
        return self

    def _allowed_tokens_alone(self, mask: str) -> None:
        """allowed_token_ids beside an output constraint, refused naming allowed_token_ids: the two masks could leave
        no token to sample at some step, which nothing can tell before it comes."""
        problem = PydanticCustomError("value_error", f"cannot be combined with {mask}: their masks together could "
                                                     "leave no token to sample")
        raise ValidationError.from_exception_data(type(self).__name__, [InitErrorDetails(
            type=problem, loc=("allowed_token_ids",), input=self.allowed_token_ids)])

    def constraints(self) -> list[Constraint]:
        found = [self.response_format.constraint() if self.response_format else None,
                 self.structured_outputs.constraint() if self.structured_outputs else None]
        for name, kind in _GUIDED_KINDS.items():
            value = getattr(self, name)
            if value is not None:
                found.append(Constraint(kind, _schema(value) if kind == "json_schema" else value, name))
        return [c for c in found if c is not None]

    @property
    def constraint(self) -> Constraint | None:
        """The request's structured output constraint, if it has one (validation allows at most one)."""
        found = self.constraints()
        return found[0] if found else None

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.strip().isascii() and token.strip().isdigit()):
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}")
        return value

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(token): bias for token, bias in (self.logit_bias or {}).items()}


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: the prompt (and its logprobs) only
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False  # the prompt before the completion, and with logprobs its tokens' (lm-eval's loglikelihood)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True  # vLLM's: false tokenizes a text prompt without the tokenizer's BOS

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        """best_of candidates ranked server-side are not computed here: only best_of equal to n (every candidate
        returned) is the same request; anything else would answer other than asked."""
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of must equal n (ranking best_of candidates on the server is not supported: "
                             "ask for n choices and rank them)")
        return value

    @model_validator(mode="after")
    def _nothing_to_do(self) -> CompletionRequest:
        """Checked once echo is read, yet raised as max_tokens' error, so a 400 names it (`param`, the message)."""
        if self.max_tokens == 0 and not self.echo:
            problem = PydanticCustomError("value_error", "must be at least 1 (0 only with echo, for the prompt alone)")
            raise ValidationError.from_exception_data(
                type(self).__name__, [InitErrorDetails(type=problem, loc=("max_tokens",), input=0)])
        return self

    @field_validator("prompt")
    @classmethod
    def _nonempty(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        prompts = len(value) if isinstance(value, list) and not isinstance(value[0], int) else 1
        n = info.data.get("n", 1)  # validated before the prompt (a field of _Common); absent when it failed
        if prompts * n > MAX_SEQUENCES_PER_REQUEST:
            raise ValueError(f"{prompts} prompts with n={n} would start {prompts * n} sequences; a request may "
                             f"start at most {MAX_SEQUENCES_PER_REQUEST} (prompts x n): send the prompts in several "
                             "requests")
        if isinstance(value, str) or isinstance(value[0], str):  # token ids hold no text: not walked
            valid_text(value)
        return value


class CalledFunction(BaseModel):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = ""  # OpenAI sends JSON text; some clients an object

    @field_validator("arguments")
    @classmethod
    def _readable(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        """JSON text is read as an object for the chat template: it must be readable; other text is shown as is."""
        if isinstance(value, str):
            try:
                json.loads(value)
            except json.JSONDecodeError:
                pass  # free text
            except RecursionError:
                raise ValueError("arguments nest too deeply to read as JSON") from None
        return value


class PastToolCall(BaseModel):
    """A call an assistant made earlier in the conversation (its `tool_calls` in the history)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[PastToolCall] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: the tool fields only where the client sent them (templates test
        `message.tool_calls is defined`)."""
        return self.model_dump(exclude={k for k in ("tool_calls", "tool_call_id") if getattr(self, k) is None})

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        return value

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        """Refused here, where the error names this message (the template would count a prepended tools prompt)."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema_compiles(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check(Constraint("json_schema", value, "tools"))
        return value


class ToolDef(BaseModel):
    """OpenAI's function tool (engine/tools.py turns tool_choice into a constraint and the output into calls)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking, a date, a system default)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM's: false leaves the assistant's turn unopened
    # Fields that change what an answer holds, which this server does not do: refused with a 400 naming the field
    # rather than ignored (an ignored one answers something else than what was asked)
    functions: Any = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None
    verbosity: str | None = None

    _template_kwargs = field_validator("chat_template_kwargs")(_own_template_variables)

    @model_validator(mode="before")
    @classmethod
    def _unsupported_in_chat(cls, data: Any) -> Any:
        return _refused(data, REFUSED_CHAT_FIELDS, cls.__name__)

    @model_validator(mode="after")
    def _allowed_tokens_without_tool_mask(self) -> ChatRequest:
        if self.allowed_token_ids and self.tool_mode in ("required", "named"):
            self._allowed_tokens_alone("tool_choice")
        return self

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("is OpenAI's deprecated function calling, not supported here: send tools and "
                             "tool_choice")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(m != "text" for m in value):
            raise ValueError("only the text modality is supported")
        return value

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("audio output is not supported")
        return value

    @field_validator("web_search_options")
    @classmethod
    def _no_web_search(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("web search is not supported: this server answers from the model alone")
        return value

    @field_validator("verbosity")
    @classmethod
    def _default_verbosity(cls, value: str | None) -> str | None:
        if value not in (None, DEFAULT_VERBOSITY):
            raise ValueError(f"other than {DEFAULT_VERBOSITY!r} is not supported: the answer is not steered to a "
                             "length")
        return value

    def prompt_ids(self, tokenizer: Any) -> list[int]:
        """What the engine prefills and the router hashes, from one place (`chat_ids` with this request's tools and
        template variables); ValueError when the template refuses the messages."""
        return chat_ids(tokenizer, self.messages, self.tools, self.add_generation_prompt, self.chat_template_kwargs)

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[ToolDef] | None, info: ValidationInfo) -> list[ToolDef] | None:
        names = [t.function.name for t in value or []]
        if duplicated := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"tool names must be unique, got {', '.join(duplicated)} more than once")
        rf = info.data.get("response_format")
        other = [name for name in ("structured_outputs", *_GUIDED_KINDS) if info.data.get(name) is not None]
        if value and (other or (rf is not None and rf.type != "text")):
            raise ValueError(f"tools cannot be combined with {(other or ['response_format'])[0]}: "
                             "tool calls already constrain the output")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data:
            return value  # the tools were refused: that error is the one to read
        names = {t.function.name for t in info.data.get("tools") or []}
        if value is not None and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"tool_choice names function {value.function.name!r}, which is not in tools "
                             f"({', '.join(sorted(names))})")
        return value

    @property
    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as plain dicts (what chat templates and the Hermes prompt show)."""
        return _tool_dicts(self.tools)


    @property
    def tool_mode(self) -> str | None:
        """How the output becomes tool calls: "named" (tool_choice names `named_tool`), "required", "auto", or
        None (no tools, or tool_choice "none": plain content)."""
        if not self.tools:
            return None
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            return "named"
        return None if choice == "none" else choice

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def tool_names(self) -> set[str]:
        return {t.function.name for t in self.tools or []}


MODEL_NOT_FOUND = "model_not_found"  # OpenAI's error code for a model (here also an adapter) nobody serves


BYTES_TOKEN_PREFIX = "bytes:"  # completions' name for a token that is part of a character: "bytes:\\xe2"


def completion_token_name(text: str, raw: bytes) -> str:
    """A token as completions' logprobs name it (in `tokens` and as a `top_logprobs` key), from its decoded `text`
    and its own bytes `raw`: its text, or, for a token that is part of a character (its text is U+FFFD, not its
    bytes), "bytes:" and its bytes escaped, as OpenAI's legacy API names it, so that two such tokens never share a
    key and one alternative hides another."""
    return text if raw == text.encode() else BYTES_TOKEN_PREFIX + "".join(f"\\x{b:02x}" for b in raw)


def completion_token_length(name: str) -> int:
    """How far a token named so moves completions' text_offset: its text's characters (a "bytes:" token's bytes
    decoded alone, U+FFFD for what is not a whole character, as the tokenizer decodes it)."""
    if name.startswith(BYTES_TOKEN_PREFIX) and re.fullmatch(r"(\\x[0-9a-f]{2})+", escaped := name[6:]):
        return len(bytes.fromhex(escaped.replace("\\x", "")).decode(errors="replace"))
    return len(name)


def finish_apart(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed chat choice as OpenAI sends its end: what it delivers (content, tool_calls, the role, logprobs,
    token ids) in one chunk, then its finish_reason in a chunk of its own with an empty delta. The openai client's
    stream helper closes a tool call (tool_calls.function.arguments.done) only on a chunk after the one that
    delivered it, so a last call sent beside the finish_reason would never be closed. A choice that has not finished
    is returned as it is; one that delivers nothing more is only the finishing chunk."""
    reason = choice.get("finish_reason")
    if reason is None:
        return [choice]
    delta = choice.get("delta") or {}
    end: dict[str, Any] = {"index": choice.get("index", 0), "delta": {}, "logprobs": None, "finish_reason": reason}
    if "token_ids" in choice:
        end["token_ids"] = []
    delivers = (any(key != "content" for key in delta) or bool(delta.get("content"))
                or bool((choice.get("logprobs") or {}).get("content")) or bool(choice.get("token_ids")))
    return [{**choice, "finish_reason": None}, end] if delivers else [end]


# A body that is not a JSON object (a JSON array or string; on the engine, any body sent with another Content-Type,
# as `curl -d` sends form data's): pydantic's own words ("Input should be a valid dictionary or object to extract
# fields from") name nothing the client sent
NOT_A_JSON_OBJECT = "the request body must be a JSON object, sent with Content-Type: application/json"
_BODY_SHAPE_ERRORS = ("model_type", "model_attributes_type")


def validation_problem(loc: Sequence[str], error: Mapping[str, Any]) -> str:
    """One validation error of a request body, at its field's path `loc` (empty: the body), as a 400 says it."""
    if not loc and error.get("type") in _BODY_SHAPE_ERRORS:
        return NOT_A_JSON_OBJECT
    return f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}"


def validation_problems(exc: ValidationError) -> str:
    """A request body's first few validation errors, each at its field's path, as a 400 says them."""
    return "; ".join(validation_problem([str(x) for x in e["loc"]], e) for e in exc.errors()[:5])


def validation_param(exc: ValidationError) -> str | None:
    """The request field a body's first validation error is in (OpenAI's `param`), None for the body as a whole."""
    loc = exc.errors()[0]["loc"] if exc.errors() else ()
    return str(loc[0]) if loc else None


# OpenAI's code for a request past the model's context (or past a bound that stands for it). Clients look for it,
# or for "maximum context length" in the message, to trim a conversation and try again.
CONTEXT_LENGTH_CODE = "context_length_exceeded"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def http_error_handler(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """The web framework's own refusals (a path nobody serves, another method with its Allow header) in OpenAI's
    error shape, which clients read, on the engine and the router alike."""
    return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers)


def _tool_dicts(tools: list[ToolDef] | None) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in tools or []]


def chat_ids(tokenizer: Any, messages: list[ChatMessage], tools: list[ToolDef] | None,
             add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt ids of chat messages with their tools, shown as the chat template can (a `Tokenizer`): what the
    engine prefills, the router hashes and /tokenize counts, from one place; ValueError when the template refuses
    the messages."""
    return tokenizer.encode_chat([m.for_template() for m in messages], _tool_dicts(tools) or None,
                                 add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs)


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a prompt, or chat messages rendered through the chat template (with their tools), turned
    into the ids a completion of it would prefill: what a client counts against `max_model_len` or a budget."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opening, as a chat completion does
    add_special_tokens: bool = True  # prompt: the tokenizer's BOS (messages: the template places its own)
    chat_template_kwargs: dict[str, Any] | None = None  # messages: as a chat completion's

    _template_kwargs = field_validator("chat_template_kwargs")(_own_template_variables)

    @field_validator("prompt", "messages", "tools", mode="before")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        return valid_text(value)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.tools and self.messages is None:
            raise ValueError("tools are shown through the chat template: give messages with them")
        return self

    def token_ids(self, tokenizer: Any) -> list[int]:
        """The ids (a `Tokenizer`'s encode or encode_chat); ValueError when the template refuses the messages."""
        if self.messages is None:
            return tokenizer.encode(self.prompt, add_special_tokens=self.add_special_tokens)
        return chat_ids(tokenizer, self.messages, self.tools, self.add_generation_prompt, self.chat_template_kwargs)


class DetokenizeRequest(BaseModel):
    """vLLM's `/detokenize`: token ids back to text."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]

    def text(self, tokenizer: Any) -> str:
        """The text of the ids; ValueError for an id outside the vocabulary."""
        if bad := [t for t in self.tokens if not 0 <= t < tokenizer.vocab_size]:
            raise ValueError(f"token ids outside the vocabulary (0..{tokenizer.vocab_size - 1}): {bad[:5]}")
        return tokenizer.decode(self.tokens, skip_special_tokens=False)

