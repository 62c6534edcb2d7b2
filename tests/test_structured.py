"""Structured outputs (engine/structured.py) over the tiny random model: left alone it writes garbage, so every
output that parses, validates or fullmatches here was made so by the mask. Through the engine (continuation,
batching, failures) and through the HTTP server (request shapes, errors, streaming, n, handoff, metrics)."""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from kvmesh.engine.constraint import Constraint, check
from kvmesh.engine.engine import Engine
from kvmesh.engine.openai_types import ChatRequest, CompletionRequest
from kvmesh.engine.protocol import STRUCTURED_KINDS
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.sampling import SamplingParams, sample
from kvmesh.engine.structured import Guide, Masks, StructuredError, _reason
from kvmesh.router.app import build_router, create_router_app
from kvmesh.router.config import RouterConfig

from .conftest import make_engine
from .engines import serve_checked, serve_engine, serve_router

_ids = itertools.count()
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "maximum": 8}},
            "required": ["kind", "legs"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "colors", "pet"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
GRAMMAR_LARK = 'start: "(" ITEM ("," ITEM)* ")"\nITEM: /[a-c]{1,3}/'
GRAMMAR_GBNF = 'root ::= "<" [xyz]+ ">"'


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[Engine]:
    engine = make_engine(tiny_dir)
    yield engine
    engine.kv.check_invariants()


@pytest.fixture(scope="module")
def url(tiny_dir: Path) -> Iterator[str]:
    with serve_checked(make_engine(tiny_dir, kv_cache_blocks=256, max_model_len=512)) as url:
        yield url


def run(engine: Engine, requests: list[Request]) -> list[list[RequestOutput]]:
    outputs: list[list[RequestOutput]] = [[] for _ in requests]
    for request, outs in zip(requests, outputs, strict=True):
        request.on_output = outs.append
        engine.submit(request)
    engine.run_until_idle()
    return outputs


def request(engine: Engine, constraint: Constraint | None, resumed: list[int] | None = None,
            **params: object) -> Request:
    resumed = list(resumed or [])
    p = SamplingParams(**{"max_tokens": 60, "temperature": 1.0, "seed": 3, **params})  # type: ignore[arg-type]
    guide = engine.structured.guide(constraint, resumed) if constraint is not None else None
    return Request(f"s-{next(_ids)}", engine.tokenizer.encode("Describe a person:"), p, output_ids=resumed,
                   guide=guide)


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def text(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


# ---- through the engine -------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(engine: Engine, temperature: float) -> None:
    (outs,) = run(engine, [request(engine, Constraint("json_schema", SCHEMA, "x"), temperature=temperature)])
    assert outs[-1].finish_reason == "stop" and outs[-1].error is None
    jsonschema.validate(json.loads(text(outs)), SCHEMA)


def test_preempted_constrained_requests_resume_their_matchers_exactly(tiny_dir: Path) -> None:
    """Under memory pressure requests are preempted and recomputed; a matcher lives with its request's tokens,
    not its KV, so a recomputed request goes on where it stopped: every output the same as with memory to spare,
    and every one valid."""
    def outputs(engine: Engine) -> list[list[int]]:
        reqs = [request(engine, Constraint("json_schema", SCHEMA, "x"), seed=s) for s in range(6)]
        done = run(engine, reqs)
        assert all(o[-1].error is None for o in done)
        for o in done:
            if o[-1].finish_reason == "stop":
                jsonschema.validate(json.loads(text(o)), SCHEMA)
        return [tokens(o) for o in done]

    tight = make_engine(tiny_dir, kv_cache_blocks=14)  # a prompt and 60 tokens take 5 blocks: two or three fit
    assert outputs(tight) == outputs(make_engine(tiny_dir))
    assert tight.scheduler.num_preemptions > 0


def test_unconstrained_tiny_model_writes_no_json(engine: Engine) -> None:
    """The control: the same request without the mask is not JSON, so the test above measures the mask."""
    (outs,) = run(engine, [request(engine, None, max_tokens=40)])
    with pytest.raises(json.JSONDecodeError):
        json.loads(text(outs))


def test_regex_choice_and_grammars_hold(engine: Engine) -> None:
    cases = [
        (Constraint("regex", REGEX, "x"), lambda s: re.fullmatch(REGEX, s)),
        (Constraint("choice", ["yes", "no", "maybe so"], "x"), lambda s: s in ("yes", "no", "maybe so")),
        (Constraint("grammar", GRAMMAR_LARK, "x"), lambda s: re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3})*\)", s)),
        (Constraint("grammar", GRAMMAR_GBNF, "x"), lambda s: re.fullmatch(r"<[xyz]+>", s)),
    ]
    results = run(engine, [request(engine, c, seed=seed) for c, _ in cases for seed in (1, 2)])
    for (constraint, holds), outs in zip([c for c in cases for _ in (1, 2)], results, strict=True):
        assert outs[-1].finish_reason == "stop", (constraint, text(outs))
        assert holds(text(outs)), (constraint, text(outs))


def test_json_object_with_logit_bias_still_parses(engine: Engine) -> None:
    """Any JSON object. A +100 bias on '"' closes the random model's strings at once (else it writes one string
    for hundreds of tokens); the mask still wins over the bias wherever a quote would break the JSON."""
    quote = engine.tokenizer.encode('"', add_special_tokens=False)[0]
    (outs,) = run(engine, [request(engine, Constraint("json_object", None, "x"), logit_bias={quote: 100.0},
                                   max_tokens=200)])
    assert outs[-1].finish_reason == "stop"
    assert isinstance(json.loads(text(outs)), dict)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11}])
@pytest.mark.parametrize("cut", [1, 7])
def test_continuation_equals_one_pod(engine: Engine, sampling: dict, cut: int) -> None:
    """A pod continuing after `cut` tokens (1: a prefill/decode handoff; more: a migration) feeds them through
    its matcher first, so it masks, and so samples, exactly as the first pod would have."""
    constraint = Constraint("json_schema", SCHEMA, "x")
    (whole,) = run(engine, [request(engine, constraint, **sampling)])
    ids = tokens(whole)
    assert len(ids) > cut
    (rest,) = run(engine, [request(engine, constraint, resumed=ids[:cut], **sampling)])
    assert tokens(rest) == ids[cut:]
    assert rest[-1].finish_reason == whole[-1].finish_reason == "stop"
    assert rest[-1].completion_tokens == len(ids)


def test_resuming_after_a_complete_output_stops_at_once(engine: Engine) -> None:
    """A migration whose client already has the whole output ends as the first pod did: `stop`, nothing new."""
    constraint = Constraint("choice", ["yes", "no"], "x")
    (whole,) = run(engine, [request(engine, constraint)])
    steps = engine.runner.steps
    (rest,) = run(engine, [request(engine, constraint, resumed=tokens(whole))])
    assert tokens(rest) == [] and rest[-1].finish_reason == "stop" and rest[-1].error is None
    assert rest[-1].completion_tokens == len(tokens(whole)) and engine.runner.steps == steps


def test_resumed_tokens_that_break_the_grammar_are_refused(engine: Engine) -> None:
    bad = engine.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(StructuredError, match="resume_output_ids"):
        engine.structured.guide(Constraint("json_object", None, "x"), bad)


def test_unconstrained_neighbours_are_unaffected(engine: Engine) -> None:
    alone = run(engine, [request(engine, None, max_tokens=24, ignore_eos=True, logprobs=True)])[0]
    together = run(engine, [request(engine, Constraint("regex", REGEX, "x")),
                            request(engine, None, max_tokens=24, ignore_eos=True, logprobs=True),
                            request(engine, Constraint("json_schema", SCHEMA, "x"))])
    assert tokens(together[1]) == tokens(alone)
    # the logprobs too, up to the float noise of a bigger batch's matrix products
    assert [x for o in together[1] for x in o.logprobs or []] == pytest.approx([x for o in alone
                                                                                for x in o.logprobs or []], abs=1e-4)
    assert re.fullmatch(REGEX, text(together[0]))


def test_logprobs_stay_the_models_own(engine: Engine) -> None:
    """The mask changes what is sampled, not the reported distribution (vLLM's convention): the chosen tokens'
    logprobs are those of the unconstrained model, finite although most of the vocabulary was masked. Greedy: had
    they been taken after the mask, the chosen token would always be the top one."""
    (outs,) = run(engine, [request(engine, Constraint("regex", REGEX, "x"), logprobs=True, top_logprobs=3,
                                   temperature=0.0)])
    logprobs = [x for o in outs for x in o.logprobs or []]
    assert len(logprobs) == len(tokens(outs)) and all(-60 < x < 0 for x in logprobs)
    top = [t for o in outs for t in o.top_logprobs or []]
    assert any(alternatives[0][0] != token and alternatives[0][1] > logprob
               for alternatives, token, logprob in zip(top, tokens(outs), logprobs, strict=True))


def test_mask_bit_layout_reaches_the_sampler() -> None:
    """Bit k of word w allows token 32w+k (llguidance's layout): only the allowed tokens of a constrained row can
    be drawn, and an unconstrained row of the same batch keeps its logits."""
    allowed = [3, 32, 49151]
    bits = torch.zeros((1, 49152 // 32), dtype=torch.int32)
    for token in allowed:
        bits[0, token // 32] |= 1 << (token % 32) if token % 32 != 31 else -(1 << 31)
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0)) * 3
    logits[1, allowed] = 0.0  # equally likely once masked: 40 draws miss one with probability 3 * (2/3)^40
    drawn = {sample(logits, [SamplingParams(temperature=1.0, seed=s)] * 2, [0, 0],
                    masks=Masks([1], bits, {})).token_ids[1] for s in range(40)}
    assert drawn == set(allowed)
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0],
                  masks=Masks([1], bits, {})).token_ids[0] == int(logits[0].argmax())


class _FailingGuide(Guide):
    """A matcher that fails on its third token, standing in for llguidance hitting a limit mid-generation (the
    real limits need grammars far larger than a test can afford)."""

    def consume(self, tokens: object) -> None:
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls >= 3:
            raise StructuredError("step lexer fuel exhausted (stand-in)")
        super().consume(tokens)  # type: ignore[arg-type]


def test_a_failing_matcher_ends_only_its_request(engine: Engine) -> None:
    failing = request(engine, Constraint("regex", "[a-z]{20}", "x"))
    real = failing.guide
    assert real is not None
    failing.guide = _FailingGuide(real._matcher)
    other = request(engine, Constraint("regex", REGEX, "x"))
    broken, fine = run(engine, [failing, other])
    assert broken[-1].finish_reason == "error" and "stand-in" in (broken[-1].error or "")
    assert fine[-1].finish_reason == "stop" and re.fullmatch(REGEX, text(fine))


def test_max_tokens_ends_a_constrained_request_with_length(engine: Engine) -> None:
    (outs,) = run(engine, [request(engine, Constraint("regex", "[a-z]+", "x"), max_tokens=5)])
    assert outs[-1].finish_reason == "length" and len(tokens(outs)) == 5
    assert re.fullmatch("[a-z]+", text(outs))


# ---- request shapes (the models the router validates with too) ----------------------------------------------


@pytest.mark.parametrize("body, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     "json_schema"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema"),
    ({"structured_outputs": {"regex": REGEX}}, "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
    ({"structured_outputs": {"grammar": GRAMMAR_GBNF}}, "grammar"),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema"),
    ({"guided_regex": REGEX}, "regex"),
    ({"guided_choice": ["a"]}, "choice"),
    ({"guided_grammar": GRAMMAR_LARK}, "grammar"),
    ({"response_format": {"type": "text"}}, None),
])
def test_request_shapes(body: dict, kind: str | None) -> None:
    for model, base in ((CompletionRequest, {"prompt": "x"}), (ChatRequest, {"messages": [{"role": "user",
                                                                                           "content": "x"}]})):
        constraint = model.model_validate({**base, **body}).constraint
        assert (constraint.kind if constraint else None) == kind


@pytest.mark.parametrize("body, where, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "thing"}}}},
     "response_format", "Invalid type"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs", "unclosed group"),
    ({"guided_regex": "[z-a]"}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "start: missing"}, "guided_grammar", "unknown name"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "Extra inputs"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
     "not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "", "at most one"),
])
def test_bad_constraints_fail_validation(body: dict, where: str, message: str) -> None:
    """What the router's admission (router/app.py, the same models) refuses with a 400 before any engine."""
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", **body})
    (error,) = info.value.errors()
    assert ".".join(str(x) for x in error["loc"]).startswith(where) and message in error["msg"], error


def test_router_refuses_a_bad_regex_before_any_pod(tiny_dir: Path) -> None:
    """The router parses with the same models: a bad constraint is its 400, with llguidance's message, even
    with no pod to send anything to."""
    with TestClient(create_router_app(build_router(RouterConfig(pods=[]), tiny_dir))) as router:
        reply = router.post("/v1/completions", json={"prompt": "x", "structured_outputs": {"regex": "(unclosed"}})
        two = router.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "guided_regex": "a",
                                                        "response_format": {"type": "json_object"}})
    assert reply.status_code == 400 and "unclosed group" in reply.json()["error"]["message"]
    assert two.status_code == 400 and "at most one" in two.json()["error"]["message"]


# An allOf of string patterns: llguidance decides whether their intersection can match anything in time
# exponential in their number (25 took 106 s; 30, hours). The body is about 1.3 KiB.
def intersected(n: int) -> dict[str, object]:
    return {"allOf": [{"type": "string", "pattern": f"^.*a.{{{i}}}$"} for i in range(n)]}


def test_a_schema_too_complex_to_check_in_time_is_refused_and_checks_go_on() -> None:
    """The check's child is killed at the deadline; the next check gets a fresh one."""
    with pytest.raises(ValueError, match="too complex, not checked within"):
        check(Constraint("json_schema", intersected(30), "response_format"))
    check(Constraint("json_schema", SCHEMA, "response_format"))
    with pytest.raises(ValueError, match="unclosed group"):
        check(Constraint("regex", "(unclosed", "guided_regex"))


def test_a_check_that_gave_no_verdict_is_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checking process gone is a 400 for this request only, every checker busy its retryable overload
    (tests/test_constraint_tenants.py): the next request is checked."""
    from kvmesh.engine import constraint

    schema = {"type": "object", "properties": {"busy": {"type": "integer"}}}
    answer = constraint._CHECKERS.problem

    def gone(scope_key: bytes, kind: str, spec_json: str) -> str | None:
        raise constraint.NotChecked(f"{kind} not checked: the checking process ended, try again")

    def busy(scope_key: bytes, kind: str, spec_json: str) -> str | None:
        raise constraint.ChecksBusy(f"{kind} not checked: this server's constraint checks are all busy")

    monkeypatch.setattr(constraint._CHECKERS, "problem", gone)
    with pytest.raises(ValueError, match="process ended"):
        check(Constraint("json_schema", schema, "response_format"))
    monkeypatch.setattr(constraint._CHECKERS, "problem", busy)
    with pytest.raises(constraint.ChecksBusy):
        check(Constraint("json_schema", schema, "response_format"))
    monkeypatch.setattr(constraint._CHECKERS, "problem", answer)
    check(Constraint("json_schema", schema, "response_format"))


def test_the_router_answers_others_while_a_schema_is_checked(tiny_dir: Path, url: str) -> None:
    """A grammar is checked off the router's event loop: its /health answers while the schema above is checked
    (on the loop, one such request held every client, health probes included, for as long as the check ran), and
    the request is a 400 at the deadline."""
    schema = intersected(31)  # not one whose verdict this process remembers
    body = {"messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    with serve_router(build_router(RouterConfig(pods=[url]), tiny_dir)) as router, ThreadPoolExecutor(1) as pool:
        checked = pool.submit(httpx.post, router + "/v1/chat/completions", json=body, timeout=120)
        time.sleep(0.5)  # the request is being checked by now
        assert httpx.get(router + "/health", timeout=120).status_code == 200
        assert not checked.done()
        reply = checked.result()
    assert reply.status_code == 400 and "too complex" in reply.json()["error"]["message"]


# ---- through the HTTP server --------------------------------------------------------------------------------


def post(url: str, path: str, **body: object) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def test_http_chat_json_schema_and_completion_regex(url: str) -> None:
    chat = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "A person, as JSON"}],
                max_tokens=80, seed=5, response_format={"type": "json_schema",
                                                        "json_schema": {"name": "person", "schema": SCHEMA}})
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    completion = post(url, "/v1/completions", prompt="Code:", max_tokens=20, guided_regex=REGEX)
    assert completion.status_code == 200, completion.text
    assert re.fullmatch(REGEX, completion.json()["choices"][0]["text"])


def test_http_errors_are_400_with_the_message(url: str) -> None:
    bad_schema = post(url, "/v1/completions", prompt="x", response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "minProperties": "x"}}})
    assert bad_schema.status_code == 400
    error = bad_schema.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    bad_regex = post(url, "/v1/completions", prompt="x", structured_outputs={"regex": "(unclosed"})
    assert bad_regex.status_code == 400 and "unclosed group" in bad_regex.json()["error"]["message"]
    assert bad_regex.json()["error"]["param"] == "structured_outputs"
    two = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}], guided_regex="a",
               guided_choice=["a"])
    assert two.status_code == 400 and "at most one" in two.json()["error"]["message"]
    broken_resume = post(url, "/v1/completions", prompt="x", guided_regex="[0-9]+",
                         resume_output_ids=[post(url, "/v1/completions", prompt="x", max_tokens=1,
                                                 guided_choice=["hello"], return_token_ids=True)
                                            .json()["choices"][0]["token_ids"][0]])
    assert broken_resume.status_code == 400 and broken_resume.json()["error"]["param"] == "resume_output_ids"


def test_http_n_choices_each_follow_the_schema(url: str) -> None:
    reply = post(url, "/v1/completions", prompt="People:", n=2, seed=9, max_tokens=80,
                 structured_outputs={"json": SCHEMA})
    assert reply.status_code == 200, reply.text
    texts = [c["text"] for c in reply.json()["choices"]]
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    assert texts[0] != texts[1]  # two streams, two matchers: not one matcher fed both choices' tokens


def test_http_streaming(url: str) -> None:
    chunks = []
    body = {"messages": [{"role": "user", "content": "Pick"}], "stream": True, "max_tokens": 30,
            "guided_grammar": GRAMMAR_LARK, "seed": 4}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3})*\)", content)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_http_migration_with_resume_output_ids(url: str) -> None:
    body = {"prompt": "JSON:", "max_tokens": 80, "temperature": 1.0, "seed": 21, "return_token_ids": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
    whole = post(url, "/v1/completions", **body).json()["choices"][0]
    rest = post(url, "/v1/completions", **body, resume_output_ids=whole["token_ids"][:4]).json()["choices"][0]
    assert rest["token_ids"] == whole["token_ids"][4:] and rest["finish_reason"] == "stop"


def test_prefill_decode_handoff_between_two_engines(tiny_dir: Path, url: str) -> None:
    """A constrained request split across a prefill pod (`url`) and a decode pod gives the one-pod answer."""
    sampling = {"prompt": "A person:", "max_tokens": 80, "temperature": 1.0, "seed": 8, "return_token_ids": True,
                "structured_outputs": {"json": SCHEMA}}
    reference = post(url, "/v1/completions", **sampling).json()["choices"][0]
    first = post(url, "/v1/completions", **sampling, kv_transfer={"mode": "prefill"}).json()
    (token,) = first["choices"][0]["token_ids"]
    with serve_engine(make_engine(tiny_dir, kv_cache_blocks=128, max_model_len=512)) as decode:
        rest = post(decode, "/v1/completions", **sampling, kv_transfer={
            "mode": "decode", "source": url, "handle": first["kv_transfer"]["handle"], "first_token": token})
    assert rest.status_code == 200, rest.text
    assert [token, *rest.json()["choices"][0]["token_ids"]] == reference["token_ids"]
    jsonschema.validate(json.loads(first["choices"][0]["text"] + rest.json()["choices"][0]["text"]), SCHEMA)


def test_a_prefill_whose_constraint_is_complete_at_once_answers_without_a_handle(url: str) -> None:
    """The only choice is empty: the request ends as it arrives, holding no blocks, so there is nothing to hand
    off; it must answer (the decode pod is not needed), not fail on a handle with no blocks."""
    reply = post(url, "/v1/completions", prompt="Pick:", max_tokens=4, structured_outputs={"choice": [""]},
                 kv_transfer={"mode": "prefill"})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["choices"][0]["text"] == ""
    assert "kv_transfer" not in answer


def test_metrics_count_kinds_and_mask_time(url: str) -> None:
    def read() -> dict[tuple[str, str], float]:
        families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
        return {(s.name, s.labels.get("kind", "")): s.value for f in families for s in f.samples
                if s.name.startswith("kvmesh_structured")}

    before = read()
    assert {("kvmesh_structured_requests_total", kind) for kind in STRUCTURED_KINDS} <= before.keys()
    post(url, "/v1/completions", prompt="x", max_tokens=5, structured_outputs={"choice": ["ab", "cd"]})
    after = read()
    assert after[("kvmesh_structured_requests_total", "choice")] == before[("kvmesh_structured_requests_total",
                                                                            "choice")] + 1
    assert after[("kvmesh_structured_masks_total", "")] > before[("kvmesh_structured_masks_total", "")]
    assert after[("kvmesh_structured_mask_seconds_total", "")] > before[("kvmesh_structured_mask_seconds_total", "")]
    unconstrained = after[("kvmesh_structured_masks_total", "")]
    post(url, "/v1/completions", prompt="x", max_tokens=5)
    assert read()[("kvmesh_structured_masks_total", "")] == unconstrained  # no mask for a free request


@pytest.mark.slow
def test_bundled_model_writes_a_small_json_object(bundled_dir: Path) -> None:
    engine = make_engine(bundled_dir, kv_cache_blocks=64)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "country": {"type": "string", "maxLength": 40}},
              "required": ["city", "country"], "additionalProperties": False}
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France? Answer "
                                                                        "in JSON with keys city and country."}])
    r = Request("bundled", prompt, SamplingParams(max_tokens=60, temperature=0.0),
                guide=engine.structured.guide(Constraint("json_schema", schema, "x")))
    (outs,) = run(engine, [r])
    answer = json.loads(text(outs))
    jsonschema.validate(answer, schema)
    assert outs[-1].finish_reason == "stop" and "Paris" in answer["city"]


def test_the_structured_benchmark_reports_every_kind_and_the_step_ratio(tiny_dir: Path, tmp_path: Path) -> None:
    from kvmesh.cli import main

    out = tmp_path / "structured.json"
    assert main(["bench", "structured", "--model", str(tiny_dir), "--batch", "2", "--tokens", "2", "--repeats", "1",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["masks"]) == {"json_schema", "json_object", "regex", "grammar"}
    assert all(m["tokens"] > 0 and m["mask_us"] > 0 for m in results["masks"].values())
    steps = results["step_seconds"]
    assert results["constrained_over_unconstrained"] == pytest.approx(steps["constrained"] / steps["unconstrained"])


def test_constraint_verdicts_are_remembered_per_kind_and_spec_and_large_specs_are_not_kept() -> None:
    """Agents send one schema with every request: its check is compiled once. A verdict belongs to its kind and
    spec (the same text is a valid regex and not a valid grammar), and a large spec is checked each time rather
    than held in memory."""
    from kvmesh.engine.constraint import CACHED_SPEC_CHARS, _problem

    _problem.cache_clear()
    for _ in range(3):
        check(Constraint("json_schema", SCHEMA, "x"))
    assert (_problem.cache_info().misses, _problem.cache_info().hits) == (1, 2)
    check(Constraint("regex", "[a-z]+", "x"))
    with pytest.raises(ValueError, match="invalid grammar"):
        check(Constraint("grammar", "[a-z]+", "x"))
    large = {"type": "object", "description": "x" * CACHED_SPEC_CHARS}
    check(Constraint("json_schema", large, "x"))
    assert _problem.cache_info().currsize == 3


def test_llguidance_s_state_dump_and_panic_backtrace_stay_out_of_error_messages() -> None:
    """What a client reads is llguidance's first lines; the parser state and a panic's backtrace (dozens of lines
    each) are cut."""
    assert _reason("regex matches nothing\n<state>\nrow 0: ...\n</state>") == "regex matches nothing"
    panic = "panic: assertion failed: grammar.symbols.len() < u16::MAX\n<backtrace>\n   0: llguidance::...\n"
    assert _reason(panic) == "panic: assertion failed: grammar.symbols.len() < u16::MAX"
    assert _reason("plain error") == "plain error"
