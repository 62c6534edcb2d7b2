"""The engine stepped synchronously over the tiny model: prefix reuse, batching, preemption, sampling, stops,
metrics conservation and tenants. Each test counts what the runner computed, so a stand-in cannot pass."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine import engine as engine_module
from kvmesh.engine.engine import Engine
from kvmesh.engine.protocol import BlockExtra
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.runner import StepInput
from kvmesh.engine.sampling import SamplingParams

from .conftest import make_engine

_ids = itertools.count()


@dataclass
class Result:
    request: Request
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.new_token_ids]

    @property
    def logprobs(self) -> list[float]:
        return [x for o in self.outputs for x in (o.logprobs or [])]

    @property
    def final(self) -> RequestOutput:
        return self.outputs[-1]


def generate(
    engine: Engine, prompts: list[list[int]], sequential: bool = False, salt: str | None = None, **params: object
) -> list[Result]:
    results = []
    for prompt in prompts:
        p = SamplingParams(**{"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **params})  # type: ignore[arg-type]
        extra = BlockExtra(cache_salt=salt)
        request = Request(f"req-{next(_ids)}", list(prompt), p, extra=extra)
        result = Result(request)
        request.on_output = result.outputs.append
        results.append(result)
        engine.submit(request)
        if sequential:
            engine.run_until_idle()
    engine.run_until_idle()
    engine.kv.check_invariants()
    return results


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 1000 + i * 7919) % 49000 + 100 for i in range(n)]


def test_prefix_reuse_computes_only_the_uncached_tail(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    shared = prompt(1, 96)
    generate(engine, [[*shared, 5, 6, 7]], logprobs=True)
    second = [*shared, 8, 9, 10, 11]
    before = engine.runner.computed_tokens
    (warm,) = generate(engine, [second], logprobs=True, max_tokens=6)
    assert warm.final.cached_tokens == 96
    # the runner computed the uncached prompt tokens plus one per output token after the first
    assert engine.runner.computed_tokens - before == len(second) - 96 + 5
    cold_engine = make_engine(tiny_dir, enable_prefix_cache=False)
    (cold,) = generate(cold_engine, [second], logprobs=True, max_tokens=6)
    assert cold.final.cached_tokens == 0
    assert warm.tokens == cold.tokens
    assert max(abs(a - b) for a, b in zip(warm.logprobs, cold.logprobs, strict=True)) < 1e-4


def test_concurrent_requests_share_steps(tiny_dir: Path) -> None:
    prompts = [prompt(s, 30) for s in range(8)]
    seq_engine = make_engine(tiny_dir)
    sequential = generate(seq_engine, prompts, sequential=True)
    seq_steps = seq_engine.runner.steps
    batch_engine = make_engine(tiny_dir)
    batched = generate(batch_engine, prompts)
    assert batch_engine.runner.steps < seq_steps
    sizes = _samples(batch_engine)
    mean_batch = sizes[("kvmesh_step_batch_size_sum", ())] / sizes[("kvmesh_step_batch_size_count", ())]
    assert mean_batch > 1
    assert [r.tokens for r in batched] == [r.tokens for r in sequential]


def test_memory_pressure_preempts_and_still_matches(tiny_dir: Path) -> None:
    prompts = [prompt(s, 40) for s in range(8)]
    free_engine = make_engine(tiny_dir)
    expected = generate(free_engine, prompts, max_tokens=40)
    tight = make_engine(tiny_dir, kv_cache_blocks=10)  # 80 tokens a request = 5 blocks: two fit
    results = generate(tight, prompts, max_tokens=40)
    assert [r.tokens for r in results] == [r.tokens for r in expected]
    assert all(r.final.finish_reason == "length" for r in results)
    assert tight.scheduler.num_preemptions > 0
    preemptions = _samples(tight)[("vllm:num_preemptions_total", (("model_name", tight.model_name),))]
    assert preemptions == tight.scheduler.num_preemptions
    stats = tight.kv.stats()
    assert stats.used == 0 and stats.used + stats.evictable + stats.free == stats.total


def test_a_request_larger_than_the_pool_fails_alone(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, kv_cache_blocks=4)  # 64 tokens; the HTTP edge refuses the big one (400)
    small, big = generate(engine, [prompt(1, 10), prompt(2, 70)], max_tokens=8)
    assert small.final.finish_reason == "length" and len(small.tokens) == 8
    assert big.final.error and "does not fit" in big.final.error


def submit(engine: Engine, tokens: list[int], **params: object) -> Result:
    p = SamplingParams(**{"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **params})  # type: ignore[arg-type]
    result = Result(Request(f"req-{next(_ids)}", list(tokens), p))
    result.request.on_output = result.outputs.append
    engine.submit(result.request)
    return result


def handoff(engine: Engine, tokens: list[int]) -> str:
    """A prefill for another pod, run to its end: its blocks stay pinned under the handle it returns."""
    result = submit(engine, tokens, max_tokens=1)
    result.request.handoff_ttl = 30.0
    engine.run_until_idle()
    assert result.final.kv_transfer is not None
    return result.final.kv_transfer["handle"]


def test_a_lone_request_short_of_blocks_a_handle_holds_waits_for_them_instead_of_being_cut(tiny_dir: Path) -> None:
    """A handle pins half the pool; the one running request then needs more than the rest. It fits the whole pool,
    so it waits in the queue (not ended with 'length' and a 'does not fit' error) and, once the handle goes,
    runs to its end with the tokens a free engine gives."""
    (expected,) = generate(make_engine(tiny_dir), [prompt(2, 20)], max_tokens=60)
    engine = make_engine(tiny_dir, kv_cache_blocks=8)
    handle = handoff(engine, prompt(1, 60))  # 4 of the 8 blocks
    result = submit(engine, prompt(2, 20), max_tokens=60)  # 80 tokens: 5 blocks
    for _ in range(200):
        engine.step()
    assert not result.outputs or result.final.finish_reason is None  # still going, not cut
    assert engine.scheduler.waiting == [result.request] and not engine.scheduler.running
    engine.drop_handle(handle)
    engine.run_until_idle()
    assert result.final.error is None and result.final.finish_reason == "length"
    assert result.tokens == expected.tokens
    engine.kv.check_invariants()


def test_a_queue_head_short_of_blocks_an_import_holds_lets_the_import_s_request_run_first(tiny_dir: Path) -> None:
    """Blocks pulled from a peer for request X are held until X runs. When they leave too little for the
    request ahead of X and nothing is running (so nothing will free a block), X is admitted past it: otherwise
    neither ever runs."""
    engine = make_engine(tiny_dir, kv_cache_blocks=8)
    pulled = prompt(1, 100)
    chain = engine.kv.prefix_hashes("probe", pulled)
    engine.kv.seqs.pop("probe")
    ids = engine.reserve_import("import:x", len(chain[:6]))  # 6 of 8 blocks: what a pull reserves
    assert ids is not None
    engine.finish_import(ids, chain[:6], None)
    ahead = submit(engine, prompt(2, 40), max_tokens=4)
    ahead.request.priority = 5  # ahead of X in the queue
    behind = submit(engine, pulled, max_tokens=4)
    behind.request.import_key = "import:x"
    engine.run_until_idle(max_steps=2_000)
    assert behind.final.finish_reason == "length" and behind.final.cached_tokens == 96
    assert ahead.final.finish_reason == "length" and len(ahead.tokens) == 4
    engine.kv.check_invariants()
    assert engine.kv.stats().used == 0


def test_two_queue_heads_short_of_blocks_an_import_holds_do_not_take_turns_forever(tiny_dir: Path) -> None:
    """As above with two requests ahead of X and prompts longer than a step (chunked prefill): each fits the pool,
    not what the import leaves. Admitted a chunk at a time, each evicted the other's cached blocks and preempted
    itself, turn about, and X behind them never ran (no output from anyone after thousands of steps)."""
    engine = make_engine(tiny_dir, kv_cache_blocks=10, max_num_batched_tokens=32)
    pulled = prompt(1, 140)
    chain = engine.kv.prefix_hashes("probe", pulled)
    engine.kv.seqs.pop("probe")
    ids = engine.reserve_import("import:x", 8)  # 8 of 10 blocks, held until X runs
    assert ids is not None
    engine.finish_import(ids, chain[:8], None)
    ahead = [submit(engine, prompt(seed, 48), max_tokens=4) for seed in (2, 3)]
    for result in ahead:
        result.request.priority = 5
    behind = submit(engine, pulled, max_tokens=4)
    behind.request.import_key = "import:x"
    engine.run_until_idle(max_steps=3_000)
    assert behind.final.finish_reason == "length" and behind.final.cached_tokens == 128
    assert all(r.final.finish_reason == "length" and len(r.tokens) == 4 for r in ahead)
    engine.kv.check_invariants()
    assert engine.kv.stats().used == 0


def test_chunked_prefill_gives_the_same_output(tiny_dir: Path) -> None:
    long_prompt = prompt(3, 300)
    (whole,) = generate(make_engine(tiny_dir), [long_prompt], logprobs=True)
    chunked_engine = make_engine(tiny_dir, max_num_batched_tokens=64)
    (chunked,) = generate(chunked_engine, [long_prompt], logprobs=True)
    assert chunked.tokens == whole.tokens
    assert chunked_engine.runner.steps >= 300 // 64 + 8


def test_seeded_sampling_is_reproducible_and_resumable(tiny_engine: Engine) -> None:
    p = prompt(4, 20)
    a, b = generate(tiny_engine, [p, p], temperature=1.0, seed=42, max_tokens=12)
    assert a.tokens == b.tokens
    (other,) = generate(tiny_engine, [p], temperature=1.0, seed=43, max_tokens=12)
    assert other.tokens != a.tokens
    # another engine continuing after 5 tokens (resume_output_ids) produces the same stream
    request = Request("resume", list(p), SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True),
                      output_ids=a.tokens[:5])
    outputs: list[RequestOutput] = []
    request.on_output = outputs.append
    tiny_engine.submit(request)
    tiny_engine.run_until_idle()
    assert [t for o in outputs for t in o.new_token_ids] == a.tokens[5:]
    assert outputs[-1].completion_tokens == 12


def test_stop_strings_and_stop_tokens(tiny_engine: Engine) -> None:
    (free,) = generate(tiny_engine, [prompt(5, 12)], max_tokens=20)
    text = tiny_engine.tokenizer.decode(free.tokens)
    assert len(text) > 4
    stop = text[2:4]
    (stopped,) = generate(tiny_engine, [prompt(5, 12)], max_tokens=20, stop=[stop])
    out_text = "".join(o.new_text for o in stopped.outputs)
    assert stopped.final.finish_reason == "stop" and out_text == text[: text.find(stop)]
    (by_token,) = generate(tiny_engine, [prompt(5, 12)], max_tokens=20, stop_token_ids=[free.tokens[3]])
    assert by_token.final.finish_reason == "stop"
    assert by_token.tokens == free.tokens[: free.tokens.index(free.tokens[3]) + 1]


def _samples(engine: Engine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(engine.metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_conservation_and_hits_equal_cached_tokens(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, kv_cache_blocks=40)
    before = _samples(engine)
    hits_key = ("vllm:prefix_cache_hits_total", (("model_name", engine.model_name),))
    shared = prompt(6, 64)
    results = []
    for k in range(6):
        results += generate(engine, [[*shared, *prompt(10 + k, 30)]], max_tokens=10)
        s = _samples(engine)
        blocks = {state: s[("kvmesh_kv_blocks", (("state", state), ("tier", "device")))]
                  for state in ("used", "evictable", "free")}
        assert sum(blocks.values()) == engine.kv.pool.num_blocks
    after = _samples(engine)
    assert after[hits_key] - before.get(hits_key, 0.0) == sum(r.final.cached_tokens for r in results) > 0
    config_labels = (("block_size", "16"), ("cache_dtype", "auto"), ("kv_format", "float32"), ("num_gpu_blocks", "40"),
                     ("weights_fingerprint", engine.kv_config.weights_fingerprint))
    assert after[("vllm:cache_config_info", config_labels)] == 1


def test_cache_salt_isolates_tenants(tiny_engine: Engine) -> None:
    p = prompt(7, 50)
    generate(tiny_engine, [p], salt="tenant-a")
    (same,) = generate(tiny_engine, [p], salt="tenant-a")
    (other,) = generate(tiny_engine, [p], salt="tenant-b")
    assert same.final.cached_tokens == 48
    assert other.final.cached_tokens == 0


def test_abort_frees_blocks_at_once(tiny_engine: Engine) -> None:
    request = Request("to-abort", prompt(8, 40), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    outputs: list[RequestOutput] = []
    request.on_output = outputs.append
    tiny_engine.submit(request)
    tiny_engine.step()
    tiny_engine.step()
    assert tiny_engine.kv.stats().used > 0
    tiny_engine.abort("to-abort")
    tiny_engine.step()
    assert tiny_engine.kv.stats().used == 0
    assert outputs[-1].finish_reason == "abort"
    tiny_engine.kv.check_invariants()


def test_events_and_snapshot_agree(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, kv_cache_blocks=12)
    for k in range(5):
        generate(engine, [prompt(20 + k, 40)], max_tokens=4)
    held: set[int] = set()
    for batch in engine.events.read(0):
        for event in batch.events:
            if event.kind == "stored":
                held.update(event.block_hashes)
            elif event.kind == "removed":
                held.difference_update(event.block_hashes)
    snapshot = engine.events.snapshot()
    assert set(snapshot.blocks["device"]) == held == set(engine.kv.pool.cached_hashes())
    assert snapshot.seq == engine.events.seq > 0
    assert engine.events.read(0, boot_id="another-boot")[0].reset


def test_the_earliest_stop_string_wins(tiny_engine: Engine) -> None:
    (free,) = generate(tiny_engine, [prompt(9, 12)], max_tokens=20)
    text = tiny_engine.tokenizer.decode(free.tokens)
    early, late = text[1:3], text[6:9]
    (stopped,) = generate(tiny_engine, [prompt(9, 12)], max_tokens=20, stop=[late, early])
    assert "".join(o.new_text for o in stopped.outputs) == text[: text.find(early)]


def test_cached_tokens_never_exceed_the_prompt_when_resuming(tiny_engine: Engine) -> None:
    p = prompt(11, 20)
    (first,) = generate(tiny_engine, [p], max_tokens=30)
    request = Request("resume-cached", list(p), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                      output_ids=first.tokens[:25])
    outputs: list[RequestOutput] = []
    request.on_output = outputs.append
    tiny_engine.submit(request)
    tiny_engine.run_until_idle()
    assert outputs[-1].cached_tokens <= 20
    assert [t for o in outputs for t in o.new_token_ids] == first.tokens[25:]


def test_min_tokens_holds_off_stop_strings(tiny_engine: Engine) -> None:
    (free,) = generate(tiny_engine, [prompt(12, 12)], max_tokens=12)
    text = tiny_engine.tokenizer.decode(free.tokens)
    stop = text[1:3]
    (early,) = generate(tiny_engine, [prompt(12, 12)], max_tokens=12, stop=[stop])
    assert len(early.tokens) < 12
    (held,) = generate(tiny_engine, [prompt(12, 12)], max_tokens=12, stop=[stop], min_tokens=12)
    assert held.tokens == free.tokens and held.final.finish_reason == "length"
    # the token that completes the stop string is the min_tokens-th: it ends nothing, as a stop token would not
    # (vLLM's rule), and the string stays in the output; one token earlier, it ends the output
    (at_min,) = generate(tiny_engine, [prompt(12, 12)], max_tokens=12, stop=[stop], min_tokens=len(early.tokens))
    assert at_min.tokens == free.tokens and at_min.final.finish_reason == "length"
    assert "".join(o.new_text for o in at_min.outputs) == text
    (after_min,) = generate(tiny_engine, [prompt(12, 12)], max_tokens=12, stop=[stop], min_tokens=len(early.tokens) - 1)
    assert after_min.tokens == early.tokens and after_min.final.finish_reason == "stop"


def test_auto_dtype_follows_the_cpus_bf16_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without bf16 matrix units serves in fp32 (bf16 is several times slower there), whatever a timing on
    a busy machine would say; one with them in bf16; CUDA in bf16; a named dtype is taken as named."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(engine_module, "_cpu_flags", lambda: {"avx2", "avx512f"})
    assert engine_module.pick_dtype("auto", cpu) == torch.float32
    for units in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(engine_module, "_cpu_flags", lambda units=units: {"avx512f", units})
        assert engine_module.pick_dtype("auto", cpu) == torch.bfloat16
    assert engine_module.pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert engine_module.pick_dtype("float16", cpu) == torch.float16


def test_bf16_attention_on_a_cpu_only_with_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 SDPA on a CPU is the fast kernel with AMX and several times the slow one without (docs/architecture.md
    "Serving dtype"), so a CPU without AMX attends in fp32, and so does any other dtype on a CPU; CUDA attends in
    the serving dtype."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(engine_module, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert engine_module.pick_attention_dtype(torch.bfloat16, cpu) == torch.float32
    monkeypatch.setattr(engine_module, "_cpu_flags", lambda: None)
    assert engine_module.pick_attention_dtype(torch.bfloat16, cpu) == torch.float32
    monkeypatch.setattr(engine_module, "_cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    assert engine_module.pick_attention_dtype(torch.bfloat16, cpu) == torch.bfloat16
    assert engine_module.pick_attention_dtype(torch.float32, cpu) == torch.float32
    assert engine_module.pick_attention_dtype(torch.float16, cpu) == torch.float32  # fp16 attends in fp32, as before
    assert engine_module.pick_attention_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16


def test_bf16_serving_computes_fp32_logits_from_an_fp32_residual_stream(tiny_dir: Path) -> None:
    """bf16 logits step by 0.125 near 25 and tied the bundled model's two best first tokens (docs/architecture.md
    "Serving dtype"): under bf16 the hidden states and the vocabulary product stay fp32, so the logits carry
    more than bf16's 8 bits of mantissa."""
    engine = make_engine(tiny_dir, dtype="bfloat16", kv_cache_blocks=8)
    model = engine.runner.model
    assert model.dtype == torch.bfloat16 and model.layers[0].qkv(torch.zeros(1, 64, dtype=torch.bfloat16)).dtype \
        == torch.bfloat16  # the layers' products do run in bf16
    logits = engine.runner.run([StepInput([0, 1], 0, list(range(100, 120)), True)]).logits
    assert logits.dtype == torch.float32
    assert (logits != logits.to(torch.bfloat16).float()).float().mean() > 0.9


def test_greedy_rows_whose_logits_the_sampler_changes_ask_the_model_for_exact_logits(
        tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 serving's vocabulary product is exact only near each row's top (model/head.py): greedy decoding under
    a logit_bias, penalties or min_tokens asks for exact logits; plain greedy and sampling do not."""
    asked: list[bool] = []
    run = tiny_engine.runner.run

    def spy(seqs: list[StepInput]) -> object:
        asked.extend(s.exact_logits for s in seqs if s.wants_logits)
        return run(seqs)

    monkeypatch.setattr(tiny_engine.runner, "run", spy)
    cases = [({}, [False] * 3), ({"logit_bias": {500: 1.0}}, [True] * 3), ({"presence_penalty": 0.5}, [True] * 3),
             ({"repetition_penalty": 1.2}, [True] * 3),
             ({"min_tokens": 2}, [True, True, False]), ({"temperature": 1.0, "seed": 1, "logit_bias": {500: 1.0}},
                                                        [False] * 3)]
    for params, expected in cases:
        asked.clear()
        generate(tiny_engine, [prompt(40, 12)], max_tokens=3, **params)
        assert asked == expected, params


def test_penalties_change_the_answer_and_continue_exactly_after_a_resume(tiny_engine: Engine) -> None:
    """Penalties count the tokens generated so far; a pod continuing a request gets them as its output so far
    (resume_output_ids), so it goes on exactly as one pod would have."""
    ids = prompt(9, 20)
    plain = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True, "logit_bias": {777: 20.0}}
    penalized = {**plain, "frequency_penalty": 2.0, "presence_penalty": 2.0}
    [free] = generate(tiny_engine, [ids], **plain)
    [whole] = generate(tiny_engine, [ids], **penalized)
    assert free.tokens == [777] * 10  # the bias alone makes one token win every step
    # the penalties take 2 (presence, once) + 2 (frequency, each time) from it as it repeats, until others win
    assert whole.tokens[0] == 777 and whole.tokens.count(777) < 10
    outputs: list[RequestOutput] = []
    resumed = Request("resumed", list(ids), SamplingParams(**penalized), on_output=outputs.append,
                      output_ids=whole.tokens[:4])  # type: ignore[arg-type]
    tiny_engine.submit(resumed)
    tiny_engine.run_until_idle()
    assert whole.tokens[:4] + [t for o in outputs for t in o.new_token_ids] == whole.tokens


def test_repetition_penalty_decodes_as_transformers_does_and_continues_exactly_after_a_resume(
        tiny_engine: Engine, tiny_dir: Path) -> None:
    """vLLM's repetition_penalty is HF's: logits of every token in the prompt or the output so far divided by it
    when positive, multiplied when negative. Greedy decoding under it matches transformers' own processor step for
    step, differs from plain greedy, and a pod resuming the request (the prompt and the output so far) goes on
    exactly."""
    from transformers import LlamaForCausalLM, RepetitionPenaltyLogitsProcessor

    ids = prompt(10, 8)  # plain greedy repeats a token here
    penalized = {"max_tokens": 12, "repetition_penalty": 1.8}
    [whole] = generate(tiny_engine, [ids], **penalized)
    [plain] = generate(tiny_engine, [ids], max_tokens=12)
    model = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    penalty, sequence = RepetitionPenaltyLogitsProcessor(1.8), torch.tensor([ids])
    with torch.no_grad():
        for _ in range(12):
            scores = penalty(sequence, model(sequence).logits[:, -1].float())
            sequence = torch.cat([sequence, scores.argmax(-1, keepdim=True)], dim=1)
    assert whole.tokens == sequence[0, len(ids):].tolist() != plain.tokens
    outputs: list[RequestOutput] = []
    resumed = Request("resumed-repeats", list(ids), SamplingParams(temperature=0.0, ignore_eos=True, **penalized),
                      on_output=outputs.append, output_ids=whole.tokens[:5])  # type: ignore[arg-type]
    tiny_engine.submit(resumed)
    tiny_engine.run_until_idle()
    assert whole.tokens[:5] + [t for o in outputs for t in o.new_token_ids] == whole.tokens


def test_prompt_logprobs_are_the_models_over_chunks_a_cached_prefix_and_a_preemption(tiny_dir: Path) -> None:
    """echo's prompt logprobs: token i's log-probability given the tokens before it, as transformers computes them,
    whatever way the prompt is computed: in chunks of a few tokens, behind a prefix another request cached (the cached
    positions are computed again: they have no logits), or preempted midway; max_tokens 0 answers with them alone."""
    from transformers import LlamaForCausalLM

    ids = prompt(12, 70)
    model = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = reference[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    engine = make_engine(tiny_dir, max_num_batched_tokens=24, kv_cache_blocks=64)
    generate(engine, [ids[:48]], max_tokens=1)  # caches the first three blocks
    [echoed] = generate(engine, [ids], max_tokens=3, logprobs=True, prompt_logprobs=2)
    [alone] = generate(engine, [ids], max_tokens=0, prompt_logprobs=0)
    [plain] = generate(engine, [ids], max_tokens=3)
    record = echoed.outputs[0].prompt_logprobs
    assert record is not None and echoed.outputs[0].new_token_ids  # with the first token
    assert record.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    top = torch.topk(reference[:-1], 2, dim=-1)
    assert [[t for t, _ in row] for row in record.top_logprobs] == top.indices.tolist()
    assert echoed.tokens == plain.tokens and echoed.final.cached_tokens == 0 < plain.final.cached_tokens
    assert alone.tokens == [] and alone.final.finish_reason == "length" and alone.final.completion_tokens == 0
    assert alone.final.prompt_logprobs is not None
    assert alone.final.prompt_logprobs.logprobs == pytest.approx(expected.tolist(), abs=1e-4)

    long_ids = prompt(12, 100)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([long_ids])).logits[0].float(), dim=-1)
    tight = make_engine(tiny_dir, max_num_batched_tokens=16, kv_cache_blocks=8)
    preempted = Result(Request("preempted", long_ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                                      prompt_logprobs=0)))
    preempted.request.on_output = preempted.outputs.append
    tight.submit(preempted.request)
    for _ in range(3):  # a few chunks in, a more important request takes its blocks
        tight.step()
    tight.submit(Request("rival", prompt(13, 40), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                         priority=1))
    tight.run_until_idle()
    record = preempted.outputs[0].prompt_logprobs
    assert preempted.request.num_preemptions == 1 and record is not None
    assert record.logprobs == pytest.approx(
        reference[:-1].gather(1, torch.tensor(long_ids[1:])[:, None]).squeeze(1).tolist(), abs=1e-4)
    tight.kv.check_invariants()


@dataclass(frozen=True)
class StopInToken6:
    """A prompt, its free greedy output, that output's text after tokens 6 and 7, and a stop string that begins in
    token 6's text and (when `completes`) ends in token 7's: a stop string a pod must hold back a tail for."""

    ids: list[int]
    free: Result
    before: str
    after: str
    stop: str


def stop_in_token_6(engine: Engine, completes: bool) -> StopInToken6:
    ids = prompt(21, 12)
    [free] = generate(engine, [ids], max_tokens=10)
    decode = engine.tokenizer.decode
    before, after = decode(free.tokens[:6]), decode(free.tokens[:7])
    assert after.startswith(before) and len(after) > len(before) and "\ufffd" not in after  # whole characters
    stop = before[-2:] + (after[len(before)] if completes else "\x00")
    assert decode(free.tokens).find(stop) == (len(before) - 2 if completes else -1)
    return StopInToken6(ids, free, before, after, stop)


@pytest.mark.parametrize("completes", [False, True])
def test_a_resumed_request_sends_or_drops_the_tail_a_stop_string_may_take(tiny_engine: Engine,
                                                                         completes: bool) -> None:
    """A pod holds back the tail of its text that may grow into a stop string; the client of a stream that moves to
    another pod (resume_output_ids) has the text up to there. The pod going on sends that tail when the stop string
    does not come, and drops it when it does: the client reads what one pod alone would have sent."""
    case = stop_in_token_6(tiny_engine, completes)
    ids, free, before, stop, decode = case.ids, case.free, case.before, case.stop, tiny_engine.tokenizer.decode
    params = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True, "stop": [stop]}
    [alone] = generate(tiny_engine, [ids], **params)
    client = before[: len(before) - 2]  # what the first pod had sent after 6 tokens
    outputs: list[RequestOutput] = []
    tiny_engine.submit(Request("resumed-stop", list(ids), SamplingParams(**params), on_output=outputs.append,
                               output_ids=free.tokens[:6]))  # type: ignore[arg-type]
    tiny_engine.run_until_idle()
    whole = "".join(o.new_text for o in alone.outputs)
    assert client + "".join(o.new_text for o in outputs) == whole
    assert whole == (client if completes else decode(free.tokens))
    assert outputs[-1].finish_reason == alone.final.finish_reason == ("stop" if completes else "length")


def test_a_requests_token_slice_is_that_of_its_whole_token_list() -> None:
    """A step reads the tokens it computes by slice (one for a decode) without joining prompt and output."""
    request = Request("r", [1, 2, 3, 4], SamplingParams())
    request.output_ids = [5, 6, 7]
    whole = request.token_ids
    for start, stop in itertools.combinations_with_replacement(range(len(whole) + 1), 2):
        assert request.token_slice(start, stop) == whole[start:stop]


def test_the_forecast_counts_the_blocks_a_handle_pins(tiny_dir: Path) -> None:
    """A disaggregated prefill pod's KV is mostly handles waiting for their decode pods: the forecast the router
    and the operator read counts them (it read 0 while the usage gauge read 50 %)."""
    engine = make_engine(tiny_dir, kv_cache_blocks=8, forecast_interval_seconds=0.0)
    handoff(engine, prompt(1, 60))  # 4 of the 8 blocks
    engine._maybe_forecast()
    assert engine.forecast is not None
    assert engine.forecast.usage_quantiles["p50"] == 0.5


def test_the_context_served_is_at_most_what_the_kv_cache_holds(tiny_dir: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A context longer than the cache would be cut short at the cache's size with finish_reason 'length', as if
    by max_tokens: the engine advertises (and checks requests against) what it can finish, and says so."""
    with caplog.at_level("WARNING", logger="kvmesh.engine"):
        engine = make_engine(tiny_dir, kv_cache_blocks=4, max_model_len=512)  # 4 blocks of 16: 64 tokens
    assert engine.max_model_len == 64
    assert "the KV cache holds 64 tokens, fewer than the model's context of 512" in caplog.text
    assert make_engine(tiny_dir, kv_cache_blocks=64, max_model_len=512).max_model_len == 512


def test_a_request_that_asked_no_logprobs_gets_none_from_a_step_it_shared_with_one_that_did(tiny_dir: Path) -> None:
    """A step computes logprobs for every row once one row wants them: they must reach only the requests that
    asked, or an answer's shape depends on what else was in its batch (OpenAI and vLLM answer logprobs null)."""
    engine = make_engine(tiny_dir)
    asked = submit(engine, prompt(1, 12), logprobs=True, top_logprobs=2)
    plain = submit(engine, prompt(2, 12))
    engine.run_until_idle()
    assert all(o.logprobs for o in asked.outputs) and all(o.top_logprobs for o in asked.outputs)
    assert not any(o.logprobs or o.top_logprobs for o in plain.outputs)
