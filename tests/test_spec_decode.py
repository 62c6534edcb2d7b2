"""Speculative decoding with n-gram drafts (engine/spec.py): the proposer, the configuration, the acceptance rule's
exactness, and the engine with speculation giving what it gives without, token for token, in every place outputs
flow (greedy and seeded sampling, mixed batches, stops, max_tokens, preemption, resumes, the prefix cache).

The tiny random model rarely repeats itself, so most requests here add a logit_bias to eight tokens: its outputs
then run over a small alphabet, repeat in part, and drafts are both accepted and rejected (every test that needs
both asserts it from the engine's own counters)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.bench.sim_engine import PROFILES, LatencyModel
from kvmesh.bench.sim_runner import FIRST_ORDINARY_TOKEN, SimEngine, SimRunner
from kvmesh.cli import main
from kvmesh.engine.config import EngineConfig, load_config
from kvmesh.engine.constraint import Constraint
from kvmesh.engine.engine import Engine
from kvmesh.engine.kv.blocks import KVCacheManager
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.runner import StepInput, StepResult
from kvmesh.engine.sampling import SamplingParams, sample
from kvmesh.engine.scheduler import Scheduler, SchedulerOutput
from kvmesh.engine.spec import SpecConfig, TokenHistory, accept, propose

from .conftest import make_engine

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
BIAS = {t: 6.0 for t in range(500, 508)}  # the outputs run over these eight tokens, in part repeating
_ids = itertools.count()


# ---- the proposer ----------------------------------------------------------------------------------------------


def test_propose_continues_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    seq = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 6, 1, 2, 3, 4])
    # [2, 3, 4] occurs twice before the end; the latest (followed by 7, 8, ...) wins over the earlier (5, 9, ...)
    assert propose(seq, 3, 2, 3) == [7, 8, 6]
    # the 4-gram [1, 2, 3, 4] occurs only at the start: the longest n is tried first
    assert propose(seq, 3, 2, 4) == [5, 9, 2]
    assert propose(np.array([1, 2, 3, 4, 5]), 3, 1, 3) == []  # no earlier occurrence
    assert propose(np.array([5, 6, 7, 5]), 3, 2, 2) == []  # n below prompt_lookup_min does not count
    assert propose(np.array([5, 6, 7, 5]), 3, 1, 2) == [6, 7, 5]
    assert propose(np.array([1, 2, 1, 2]), 0, 1, 2) == []


def test_propose_inside_a_repeated_run_proposes_k_tokens() -> None:
    """The latest occurrence of [7, 7] overlaps the end and leaves one token after it: an earlier one is taken."""
    assert propose(np.array([3] + [7] * 10), 4, 2, 2) == [7, 7, 7, 7]
    assert propose(np.array([1, 2, 1, 2, 1, 2]), 3, 2, 2) == [1, 2, 1]


def test_token_history_follows_prompt_and_output_growth() -> None:
    history = TokenHistory()
    prompt = list(range(300))
    output: list[int] = []
    history.sync(prompt, output)
    for t in range(500):
        output.append(t % 7)
        if t % 3 == 0:
            history.sync(prompt, output)
    history.sync(prompt, output)
    assert history.tokens.tolist() == prompt + output


# ---- configuration ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown keys ['lookahead']"),
    ("{not json", "not JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_speculative_config_is_refused_at_start(value: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SpecConfig.parse(value)
    assert message in str(info.value)
    with pytest.raises(ValueError):
        load_config(None, {"speculative_config": value})


def test_speculative_config_from_json_and_yaml(tmp_path: Path) -> None:
    assert SpecConfig.parse(json.dumps(SPEC)) == SpecConfig(4, 2, 4)
    assert SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}) == \
        SpecConfig(3, 3, 3)
    assert SpecConfig.parse(None) is None and SpecConfig.parse({}) is None
    path = tmp_path / "engine.yaml"
    path.write_text("engine:\n  speculative_config:\n    method: ngram\n    num_speculative_tokens: 2\n")
    assert SpecConfig.parse(load_config(path).speculative_config) == SpecConfig(2, 5, 5)


def test_cli_refuses_a_bad_speculative_config_before_loading_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}']) == 2
    assert "method must be one of ngram" in capsys.readouterr().err


# ---- the acceptance rule ---------------------------------------------------------------------------------------


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_the_seeded_draws_a_draft_is_verified_against_follow_the_target_distribution() -> None:
    """What makes the acceptance rule exact is the sampler, not `accept` (which keeps a draft iff it equals the
    draw): each output index's seeded draw must follow p (after temperature and top-k), independently of the
    others. Then a draft d is accepted with probability p(d) and a rejection emits p without d renormalised:
    chi-square bounds at fixed seeds (deterministic, never flaky). 20,000 draws over 6 tokens; 0.1 % critical
    values."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 3.0, -9.0])
    params = SamplingParams(temperature=0.8, top_k=6, seed=7)
    probs = torch.softmax(logits / 0.8, -1)
    probs[6] = 0.0  # top-k 6 drops the last token
    probs = (probs / probs.sum()).numpy()[:6]
    draws = 20_000
    for draft in (0, 3):
        rows = sample(logits.repeat(draws, 1), [params] * draws, list(range(draws))).token_ids
        emitted, accepted, rejected = np.zeros(6), 0, np.zeros(6)
        for x in rows:
            verdict = accept([draft], [x, 0])
            token = verdict.token_ids[0]
            emitted[token] += 1
            if verdict.num_accepted:
                accepted += 1
                assert token == draft
            else:
                rejected[token] += 1
                assert token != draft and len(verdict.token_ids) == 1
        assert _chi_square(emitted, probs) < 20.5  # 5 degrees of freedom
        p_d = probs[draft]
        assert abs(accepted / draws - p_d) < 3.3 * (p_d * (1 - p_d) / draws) ** 0.5
        residual = np.delete(probs, draft) / (1 - p_d)
        assert _chi_square(np.delete(rejected, draft), residual) < 18.5  # 4 degrees of freedom


def test_accept_stops_at_the_first_mismatch_and_adds_a_bonus_after_all() -> None:
    assert accept([5, 6, 7], [5, 6, 7, 8]).token_ids == [5, 6, 7, 8]
    assert accept([5, 6, 7], [5, 9, 7, 8]).token_ids == [5, 9]
    assert accept([5, 6, 7], [5, 9, 7, 8]).num_accepted == 1
    assert accept([5], [4, 1]).token_ids == [4] and accept([5], [4, 1]).num_accepted == 0


# ---- the scheduler: drafts only from what is left -------------------------------------------------------------


def decoding(scheduler: Scheduler, prompts: list[list[int]]) -> list[Request]:
    """Requests prefilled to their last prompt token and given one output token: each decodes next step."""
    reqs = [Request(f"d{i}", list(p), SamplingParams(max_tokens=50)) for i, p in enumerate(prompts)]
    for r in reqs:
        scheduler.add(r)
    while any(r.num_computed_tokens < len(r.prompt_ids) for r in reqs):
        for s in scheduler.schedule().scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
    for r in reqs:
        r.output_ids.append(100)
    return reqs


def planned(out: SchedulerOutput) -> list[tuple[str, int, tuple[int, ...]]]:
    return [(s.request.request_id, s.num_new_tokens, s.draft_ids) for s in out.scheduled]


def test_drafts_never_preempt_a_request_that_fits_without_them() -> None:
    """a's drafts would take the last free block that b's own next token needs: they are dropped, not b."""
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_cache=False)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    a, _ = decoding(scheduler, [list(range(1, 8)), list(range(11, 19))])  # a: 8 tokens, b: 9 (needs a 3rd block)
    assert kv.pool.num_available == 1
    out = scheduler.schedule({a.request_id: [5, 6]})
    assert planned(out) == [("d0", 1, ()), ("d1", 1, ())] and not out.preempted
    kv.check_invariants()


def test_drafts_take_only_the_budget_left_after_every_decoding_token() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=16, enable_prefix_cache=False)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32)
    reqs = decoding(scheduler, [[10 + i] * 7 for i in range(4)])
    scheduler.max_num_batched_tokens = 8
    out = scheduler.schedule({r.request_id: [1, 2, 3, 4] for r in reqs})
    # every request gets its token; the 4 tokens left go to drafts, earlier requests first
    assert planned(out) == [("d0", 5, (1, 2, 3, 4)), ("d1", 1, ()), ("d2", 1, ()), ("d3", 1, ())]
    assert out.num_tokens == 8


def test_waiting_requests_are_admitted_before_drafts() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=16, enable_prefix_cache=False)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32)
    (a,) = decoding(scheduler, [[7] * 7])
    scheduler.max_num_batched_tokens = 6
    scheduler.add(Request("new", [9] * 4, SamplingParams(max_tokens=5)))
    assert planned(scheduler.schedule({a.request_id: [1, 2, 3, 4]})) == [("d0", 2, (1,)), ("new", 4, ())]


def test_drafts_use_free_blocks_only_and_never_evict_the_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    cached = Request("cached", [50, 51, 52, 53, 54], SamplingParams(max_tokens=1))
    scheduler.add(cached)
    (s,) = scheduler.schedule().scheduled
    cached.num_computed_tokens += s.num_new_tokens
    kv.commit("cached", cached.token_ids, cached.num_computed_tokens)
    (cached_hash,) = kv.seqs["cached"].hashes
    scheduler.remove(cached)  # its full block stays cached (evictable), the other goes back to the free list
    assert (kv.stats().evictable, kv.stats().free) == (1, 3)
    (a,) = decoding(scheduler, [list(range(1, 8))])  # 8 tokens: two blocks, one free left
    drafts = {a.request_id: [5, 6, 7, 8, 9, 10]}  # would need two more blocks
    assert planned(scheduler.schedule(drafts)) == [("d0", 5, (5, 6, 7, 8))]
    assert kv.stats().evictable == 1 and kv.pool.lookup(cached_hash) is not None


# ---- the engine ------------------------------------------------------------------------------------------------


def prompt(seed: int, n: int = 24) -> list[int]:
    """A prompt that repeats: a run of ids, then the run again and the biased tokens, so drafts come from both."""
    run = [(seed * 1000 + i * 7919) % 49000 + 100 for i in range(n // 2)]
    return [*run, 500 + seed % 8, 501, 502, *run[: n // 2 - 3]]


def submit(engine: Engine, prompts: list[list[int]], **params: object) -> list[list[RequestOutput]]:
    outs: list[list[RequestOutput]] = []
    for p in prompts:
        settings = {"max_tokens": 48, "temperature": 0.0, "logit_bias": dict(BIAS), **params}
        request = Request(f"spec-{next(_ids)}", list(p), SamplingParams(**settings))  # type: ignore[arg-type]
        outs.append([])
        request.on_output = outs[-1].append
        engine.submit(request)
    return outs


def generate(engine: Engine, prompts: list[list[int]], **params: object) -> list[list[RequestOutput]]:
    outs = submit(engine, prompts, **params)
    engine.run_until_idle()
    check_idle(engine)
    return outs


def check_idle(engine: Engine) -> None:
    """KV accounting after everything finished: invariants hold, no block is held, none is pinned."""
    engine.kv.check_invariants()
    assert engine.kv.stats().used == 0 and not engine.kv.seqs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def spec_counts(engine: Engine) -> tuple[float, float, float]:
    """(draft runs, draft tokens, accepted tokens) from the engine's Prometheus registry."""
    labels = {"model_name": engine.model_name}
    get = engine.metrics.registry.get_sample_value
    return (get("vllm:spec_decode_num_drafts_total", labels) or 0.0,
            get("vllm:spec_decode_num_draft_tokens_total", labels) or 0.0,
            get("vllm:spec_decode_num_accepted_tokens_total", labels) or 0.0)


def assert_accepted_and_rejected(engine: Engine) -> None:
    runs, drafted, accepted = spec_counts(engine)
    assert runs > 0 and 0 < accepted < drafted, (runs, drafted, accepted)


@pytest.fixture(scope="module")
def plain(tiny_dir: Path) -> Engine:
    return make_engine(tiny_dir)


@pytest.fixture(scope="module")
def spec(tiny_dir: Path) -> Engine:
    return make_engine(tiny_dir, speculative_config=SPEC)


def test_greedy_output_is_identical_and_takes_fewer_steps(tiny_dir: Path) -> None:
    prompts = [prompt(s) for s in range(6)]
    plain, spec = make_engine(tiny_dir), make_engine(tiny_dir, speculative_config=SPEC)
    want = generate(plain, prompts)
    got = generate(spec, prompts)
    assert [tokens(o) for o in got] == [tokens(o) for o in want]
    assert ["".join(x.new_text for x in o) for o in got] == ["".join(x.new_text for x in o) for o in want]
    assert [o[-1].completion_tokens for o in got] == [48] * 6
    assert_accepted_and_rejected(spec)
    assert spec.runner.steps < plain.runner.steps
    labels = {"model_name": spec.model_name}
    per_pos = [spec.metrics.registry.get_sample_value("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                                      {**labels, "position": str(i)}) for i in range(4)]
    assert sum(per_pos) == spec_counts(spec)[2] and per_pos == sorted(per_pos, reverse=True)
    assert spec_counts(plain) == (0.0, 0.0, 0.0)


def test_seeded_sampling_is_identical_with_and_without_speculation(plain: Engine, spec: Engine) -> None:
    """Each position is verified with the draw the plain sampler makes at that output index, so a seeded request's
    output does not depend on speculation (nor on where a pod's steps fell)."""
    prompts = [prompt(s) for s in range(2)]
    before = spec_counts(spec)
    for params in ({"temperature": 0.7, "seed": 3, "max_tokens": 24},
                   {"temperature": 1.0, "top_p": 0.9, "top_k": 5, "seed": 11, "max_tokens": 24}):
        want = generate(plain, prompts, **params)
        got = generate(spec, prompts, **params)
        assert [tokens(o) for o in got] == [tokens(o) for o in want]
    assert spec_counts(spec)[2] > before[2]


def test_mixed_batch_with_penalties_logprobs_min_tokens_and_a_constraint(plain: Engine, spec: Engine) -> None:
    """Penalties count the drafts before each position, logprobs come per position, min_tokens holds stop tokens
    off by output index; a constrained request decodes without drafts in the same steps."""
    variants = [
        {"presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"logprobs": True, "top_logprobs": 2},
        {"min_tokens": 20, "stop_token_ids": [503]},
        {},
    ]

    def run(engine: Engine) -> list[list[RequestOutput]]:
        outs = [submit(engine, [prompt(i)], **v)[0] for i, v in enumerate(variants)]
        regex = Request(f"spec-{next(_ids)}", prompt(9), SamplingParams(max_tokens=12, temperature=0.0),
                        guide=engine.structured.guide(Constraint("regex", "(ab|cd)+x", "t")))
        outs.append([])
        regex.on_output = outs[-1].append
        engine.submit(regex)
        engine.run_until_idle()
        check_idle(engine)
        return outs

    before = spec_counts(spec)
    want, got = run(plain), run(spec)
    assert [tokens(o) for o in got] == [tokens(o) for o in want]
    assert [o[-1].finish_reason for o in got] == [o[-1].finish_reason for o in want]
    assert len(tokens(got[2])) >= 20
    lp_want = [x for o in want[1] for x in o.logprobs or []]
    lp_got = [x for o in got[1] for x in o.logprobs or []]
    assert len(lp_got) == len(tokens(got[1])) and max(abs(a - b) for a, b in zip(lp_got, lp_want, strict=True)) < 1e-4
    assert [len(t) for o in got[1] for t in o.top_logprobs or []] == [2] * len(lp_got)
    assert spec_counts(spec)[2] > before[2]


def test_stops_inside_a_draft_drop_what_follows(plain: Engine, spec: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop string or stop token completed inside a run of accepted drafts ends the request there: the run's
    later tokens are dropped, and the output is the plain engine's. An accepted draft repeats what came before, so
    a stop inside a run must be one seen earlier: a stop string past `min_tokens` (which holds stop strings off
    without changing what is sampled), or a stop token after a resume whose resumed tokens hold it."""
    runs: list[tuple[int, int]] = []  # per verified run: (tokens appended, tokens in the run)
    append_verified = spec._append_verified

    def spy(s, verdict, *args):  # type: ignore[no-untyped-def]
        before = s.request.num_generated
        append_verified(s, verdict, *args)
        runs.append((s.request.num_generated - before, len(verdict.token_ids)))

    def run(engine: Engine, resume: list[int], **params: object) -> list[RequestOutput]:
        settings = {"max_tokens": 48, "temperature": 0.0, "logit_bias": dict(BIAS), **params}
        request = Request(f"spec-{next(_ids)}", prompt(2), SamplingParams(**settings),  # type: ignore[arg-type]
                          output_ids=list(resume))
        outs: list[RequestOutput] = []
        request.on_output = outs.append
        engine.submit(request)
        engine.run_until_idle()
        check_idle(engine)
        return outs

    monkeypatch.setattr(spec, "_append_verified", spy)
    (free,) = generate(spec, [prompt(2)])
    ids = tokens(free)
    text = spec.tokenizer.decode
    inside, at = [], 0  # output indices inside a run, not its last token
    for appended, _ in runs:
        inside += range(at, at + appended - 1)
        at += appended
    candidates = [([], {"stop": [text(ids[j - 1 : j + 1])], "min_tokens": j - 1}) for j in inside if j > 1]
    candidates += [(ids[: max(i for i in range(j) if ids[i] == ids[j]) + 1], {"stop_token_ids": [ids[j]]})
                   for j in inside if ids[j] in ids[:j]]
    cut = {"stop": 0, "stop_token_ids": 0}
    for resume, params in candidates:
        runs.clear()
        got = run(spec, resume, **params)
        if not runs or runs[-1][0] == runs[-1][1]:
            continue  # the stop fell at a run's end or outside one: not what this test is after
        kind = next(k for k in cut if k in params)
        cut[kind] += 1
        want = run(plain, resume, **params)
        assert tokens(got) == tokens(want) and "".join(o.new_text for o in got) == "".join(o.new_text for o in want)
        assert got[-1].finish_reason == want[-1].finish_reason == "stop"
        assert got[-1].completion_tokens == want[-1].completion_tokens < 48
        if all(cut.values()):
            break
    assert all(cut.values()), cut


def test_never_computes_past_max_tokens(tiny_dir: Path) -> None:
    """Drafts stop at max_tokens: no position past the last output's is ever computed, whatever max_tokens is."""
    plain, spec = make_engine(tiny_dir), make_engine(tiny_dir, speculative_config=SPEC)
    computed: list[tuple[int, int]] = []  # (prompt + max_tokens, last position computed) per sequence per step
    run = spec.runner.run
    limits: dict[tuple[int, ...], int] = {}

    def spy(seqs: list[StepInput]):
        for s in seqs:
            computed.append((s.num_computed + len(s.token_ids), max(limits.values())))
        return run(seqs)

    spec.runner.run = spy  # type: ignore[method-assign]
    for max_tokens in (1, 2, 3, 5, 9, 17):
        limits[(max_tokens,)] = len(prompt(1)) + max_tokens - 1
        (want,) = generate(plain, [prompt(1)], max_tokens=max_tokens)
        (got,) = generate(spec, [prompt(1)], max_tokens=max_tokens)
        assert tokens(got) == tokens(want) and got[-1].completion_tokens == max_tokens
        assert all(end <= limit for end, limit in computed), computed
        computed.clear()
        del limits[(max_tokens,)]
    assert spec_counts(spec)[2] > 0


def test_preemption_during_speculation_recomputes_to_the_same_output(tiny_dir: Path) -> None:
    prompts = [prompt(s, 40) for s in range(6)]
    want = generate(make_engine(tiny_dir), prompts, max_tokens=40)
    tight = make_engine(tiny_dir, kv_cache_blocks=12, speculative_config=SPEC)  # 80 tokens = 5 blocks a request
    got = generate(tight, prompts, max_tokens=40)
    assert [tokens(o) for o in got] == [tokens(o) for o in want]
    assert tight.scheduler.num_preemptions > 0
    assert_accepted_and_rejected(tight)


def test_resumed_request_continues_the_same_stream(plain: Engine, spec: Engine) -> None:
    (whole,) = generate(plain, [prompt(5)], temperature=0.9, seed=5)
    ids = tokens(whole)
    request = Request("spec-resume", prompt(5), SamplingParams(max_tokens=48, temperature=0.9, seed=5,
                                                               logit_bias=dict(BIAS)), output_ids=ids[:17])
    outs: list[RequestOutput] = []
    request.on_output = outs.append
    spec.submit(request)
    spec.run_until_idle()
    check_idle(spec)
    assert tokens(outs) == ids[17:] and outs[-1].completion_tokens == 48


def test_prefix_cache_holds_the_same_blocks_as_without_speculation(tiny_dir: Path) -> None:
    """Only verified tokens are ever committed: after the same requests, both engines cache (and announced) the
    same block hashes, and a follow-up request over prompt + output gets the same hit."""
    prompts = [prompt(s, 40) for s in range(3)]
    engines = [make_engine(tiny_dir), make_engine(tiny_dir, speculative_config=SPEC)]
    stored: list[list[int]] = [[], []]
    for engine, hashes in zip(engines, stored, strict=True):
        record = engine.events.record

        def keep(event, record=record, hashes=hashes):  # type: ignore[no-untyped-def]
            if event.kind == "stored":
                hashes.extend(event.block_hashes)
            record(event)

        engine.events.record = keep  # type: ignore[method-assign]
    outs = [generate(e, prompts, max_tokens=45) for e in engines]
    assert [tokens(o) for o in outs[0]] == [tokens(o) for o in outs[1]]
    assert_accepted_and_rejected(engines[1])
    assert engines[0].kv.pool.evictions == engines[1].kv.pool.evictions == 0
    assert sorted(engines[0].kv.pool.cached_hashes()) == sorted(engines[1].kv.pool.cached_hashes())
    assert sorted(stored[0]) == sorted(stored[1]) == sorted(engines[1].kv.pool.cached_hashes())
    follow = prompts[0] + tokens(outs[0][0]) + [7, 8, 9]
    hits = [generate(e, [follow], max_tokens=2)[0][-1].cached_tokens for e in engines]
    assert hits[0] == hits[1] >= 80


def test_rolled_back_draft_blocks_return_to_the_free_list(tiny_dir: Path) -> None:
    """With block size 4, rejected drafts often reach into a fresh block: it goes back at once, unregistered."""
    engine = make_engine(tiny_dir, block_size=4, speculative_config={**SPEC, "num_speculative_tokens": 6})
    outs = submit(engine, [prompt(s) for s in range(3)])
    while engine.scheduler.has_work() or engine._inbox:
        engine.step()
        engine.kv.check_invariants()
        for r in engine.scheduler.running:  # a running request holds exactly the blocks of its verified tokens
            assert len(engine.kv.seqs[r.request_id].blocks) == engine.kv.blocks_for(r.num_computed_tokens)
    check_idle(engine)
    assert all(o[-1].completion_tokens == 48 for o in outs)
    assert_accepted_and_rejected(engine)


def test_under_a_small_token_budget_speculation_never_costs_steps(tiny_dir: Path) -> None:
    """Chunked prefills and draft runs share a 12-token budget: drafts take only what is left, so every request
    decodes and prefills as fast as without speculation and the whole takes no more steps (it took 50 against
    45 when the first requests' drafts came before the others' tokens)."""
    spec = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = [prompt(s, 40) for s in range(4)]
    plain = make_engine(tiny_dir, max_num_batched_tokens=12)
    speculating = make_engine(tiny_dir, max_num_batched_tokens=12, speculative_config=spec)
    want = generate(plain, prompts, max_tokens=30)
    got = generate(speculating, prompts, max_tokens=30)
    assert [tokens(o) for o in got] == [tokens(o) for o in want]
    assert spec_counts(speculating)[2] > 0 and speculating.runner.steps <= plain.runner.steps


def test_inter_token_latency_is_observed_once_per_output_step(tiny_dir: Path) -> None:
    """A step that outputs a run of verified drafts is one gap in vllm:inter_token_latency_seconds (as vLLM
    observes it), not one gap plus near-zero ones that would drag the Latency dashboard's quantiles to 0; the
    forecast sees the tokens a decode step outputs per request."""
    engine = make_engine(tiny_dir, speculative_config=SPEC)
    (out,) = generate(engine, [prompt(0)])  # alone: one prefill step (the first token), then decode steps
    get = engine.metrics.registry.get_sample_value
    itl = get("vllm:inter_token_latency_seconds_count", {"model_name": engine.model_name})
    assert itl == engine.runner.steps - 1 < out[-1].completion_tokens - 1
    assert engine.tokens_per_decode_step > 1.0


def test_commit_builds_the_token_list_only_when_a_block_fills(tiny_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Committing copies prompt + output (about 50 us at 32k tokens): it happens only when a verified token fills
    a block, not once per accepted token."""
    engine = make_engine(tiny_dir, block_size=4, speculative_config=SPEC)
    calls: list[int] = []
    commit = engine.kv.commit

    def counted(seq_id: str, token_ids: list[int], num_computed: int, extra: object) -> None:
        registered = engine.kv.seqs[seq_id].num_registered
        commit(seq_id, token_ids, num_computed, extra)  # type: ignore[arg-type]
        calls.append(engine.kv.seqs[seq_id].num_registered - registered)

    monkeypatch.setattr(engine.kv, "commit", counted)
    generate(engine, [prompt(s) for s in range(3)])
    assert calls and all(n > 0 for n in calls)
    assert_accepted_and_rejected(engine)


# ---- the simulated engine --------------------------------------------------------------------------------------


def sim_engine(spec: dict[str, object] | None, runner: type[SimRunner] = SimRunner) -> SimEngine:
    class Engine_(SimEngine):
        def make_runner(self, loaded: object, num_blocks: int) -> SimRunner:
            return runner(self.latency, self.tokenizer.vocab_size, num_blocks, self.config.block_size)

    free = LatencyModel(0.0, 0.0, 0.0, 0.0, 1e15)  # no modelled time
    return Engine_(EngineConfig(kv_cache_blocks=64, speculative_config=spec), PROFILES["cpu-smollm"], free)


def repeating_sim_prompt(runner: SimRunner, length: int = 40, ahead: int = 12) -> list[int]:
    """A prompt whose first tokens are the simulated model's own continuation of it: the sim's next token depends
    only on the token before and the position, so with last token z at position length - 1 the continuation is
    known before the prompt's middle is chosen; prompt lookup then finds it after the first z."""
    z, run = 4321, []
    last = z
    for position in range(length, length + ahead):
        last = runner.next_token(last, position)
        run.append(last)
    filler = [FIRST_ORDINARY_TOKEN + 7 + i for i in range(length - ahead - 2)]
    return [z, *run, *filler, z]


def test_sim_engine_speculates_with_the_same_outputs() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    plain, speculating = sim_engine(None), sim_engine(spec)
    p = repeating_sim_prompt(speculating.runner)  # type: ignore[arg-type]
    want = generate(plain, [p, prompt(1)], max_tokens=20, logit_bias={})
    got = generate(speculating, [p, prompt(1)], max_tokens=20, logit_bias={})
    assert [tokens(o) for o in got] == [tokens(o) for o in want]
    assert tokens(got[0])[:12] == p[1:13]
    assert spec_counts(speculating)[2] >= 8
    steps = plain.runner.steps, speculating.runner.steps
    generate(plain, [p], max_tokens=20, logit_bias={})
    generate(speculating, [p], max_tokens=20, logit_bias={})
    assert speculating.runner.steps - steps[1] < plain.runner.steps - steps[0]


def test_a_runner_returning_too_few_logits_rows_is_a_clear_error() -> None:
    """A runner that ignores StepInput.num_logits (one row per sequence, as the simulated one did) is named in the
    error, not found by an assertion deep in the acceptance rule. The broken runner is made up for this."""

    class OneRowRunner(SimRunner):
        def run(self, seqs: list[StepInput]) -> StepResult:
            result = super().run(seqs)
            first_rows = np.cumsum([0] + [s.num_logits for s in seqs if s.wants_logits])[:-1]
            return StepResult(result.logits[first_rows], result.num_tokens, result.seconds)

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    engine = sim_engine(spec, OneRowRunner)
    submit(engine, [repeating_sim_prompt(engine.runner)], max_tokens=20, logit_bias={})  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"OneRowRunner returned 1 logits rows for \d+ positions that want them"):
        engine.run_until_idle()
    with pytest.raises(ValueError, match="2 logits rows, 1 sampling params"):
        sample(torch.zeros(2, 8), [SamplingParams()], [0])


def test_streams_over_http_with_several_tokens_a_step(tiny_dir: Path) -> None:
    import httpx

    from .engines import serve_checked

    plain_engine = make_engine(tiny_dir)
    want = tokens(generate(plain_engine, [prompt(3)], max_tokens=30)[0])
    text = plain_engine.tokenizer.decode(want)
    engine = make_engine(tiny_dir, speculative_config=SPEC)
    body = {"model": engine.model_name, "prompt": prompt(3), "max_tokens": 30, "temperature": 0,
            "logit_bias": {str(k): v for k, v in BIAS.items()}}
    with serve_checked(engine) as url:
        whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        chunks = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True,
                          "stream_options": {"include_usage": True}}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    assert whole["choices"][0]["text"] == text and whole["usage"]["completion_tokens"] == 30
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    assert chunks[-1]["usage"]["completion_tokens"] == 30
    assert spec_counts(engine)[2] > 0


def test_engine_config_validation_rejects_bad_speculation() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative_config={"num_speculative_tokens": 2, "prompt_lookup_min": 3,
                                         "prompt_lookup_max": 2}).validate()


def test_bench_spec_reports_ratios_and_same_outputs(tiny_dir: Path, tmp_path: Path) -> None:
    """`kvmesh bench spec` end to end on the tiny model (few tokens): a row per workload and concurrency, outputs
    compared, the lookup cost measured."""
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--model", str(tiny_dir), "--concurrency", "1,2", "--max-tokens", "6",
                 "--repeats", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [(r["workload"], r["concurrency"]) for r in results["rows"]] == [
        ("repeat", 1), ("repeat", 2), ("chat", 1), ("chat", 2)]
    assert all(r["identical_outputs"] and r["speedup"] > 0 and r["tokens_per_step"] >= 1 for r in results["rows"])
    assert set(results["lookup_us"]) == {"1000", "8000", "32000"}


def test_lora_requests_verify_drafts_through_their_adapter(tiny_dir: Path, tmp_path: Path) -> None:
    """Drafts run in the request's own adapter segment: a batch mixing the base model and an adapter gives, with
    speculation, what it gives without."""
    from kvmesh.engine.protocol import BlockExtra

    from .test_lora import write_adapter

    adapter = str(write_adapter(tmp_path / "a", seed=3))
    engines = [make_engine(tiny_dir, lora_modules={"a": adapter}, **extra)
               for extra in ({}, {"speculative_config": SPEC})]
    results = []
    for engine in engines:
        outs: list[list[RequestOutput]] = []
        for i, lora in ((0, None), (0, "a"), (1, "a"), (1, None)):
            request = Request(f"spec-{next(_ids)}", prompt(i), SamplingParams(max_tokens=40, temperature=0.0,
                                                                              logit_bias=dict(BIAS)),
                              extra=BlockExtra(lora=lora))
            outs.append([])
            request.on_output = outs[-1].append
            engine.submit(request)
        engine.run_until_idle()
        check_idle(engine)
        results.append([tokens(o) for o in outs])
    assert results[0] == results[1]
    assert results[0][0] != results[0][1]  # the adapter changes the answer, so a wrong segment would show it
    assert spec_counts(engines[1])[2] > 0


def test_a_pool_turns_it_on_through_engine_settings(tmp_path: Path) -> None:
    """An InferencePool's free-form engine.settings carries the mapping into the engines' file, which the real
    engine configuration reads; a bad one is refused there, at the engine's start."""
    import yaml

    from kvmesh.operator.desired import desired_objects

    from .test_operator_desired import AGGREGATED, by_kind, pool

    def engine_file(settings: dict[str, object]) -> Path:
        doc = yaml.safe_load(AGGREGATED.read_text())
        p = pool(engine={**doc["spec"]["engine"], "settings": {"speculative_config": settings}})
        path = tmp_path / "engine.yaml"
        path.write_text(by_kind(desired_objects(p), "ConfigMap")[f"{p.name}-config"]["data"]["engine.yaml"])
        return path

    assert SpecConfig.parse(load_config(engine_file(SPEC)).speculative_config) == SpecConfig(4, 2, 4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        load_config(engine_file({"method": "ngram", "num_speculative_tokens": -1}))
