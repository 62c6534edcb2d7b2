"""The sampler alone: filters, seeded streams, min_tokens and logprobs, on hand-made logits."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvmesh.engine.sampling import (
    BLOCK_WIDTH,
    SamplingParams,
    _adjust,
    first_argmax,
    prompt_vocabulary,
    sample,
    token_seed,
)
from kvmesh.engine.structured import Masks

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def draw(params: SamplingParams, n: int, logits: torch.Tensor = LOGITS) -> Counter[int]:
    return Counter(sample(logits, [params], [i]).token_ids[0] for i in range(n))


def test_greedy_and_top_k_1_pick_the_argmax() -> None:
    assert draw(SamplingParams(temperature=0.0), 5) == Counter({0: 5})
    assert draw(SamplingParams(temperature=1.5, top_k=1, seed=3), 20) == Counter({0: 20})


@pytest.mark.parametrize("width", [7, 2 * BLOCK_WIDTH, 2 * BLOCK_WIDTH + 1, 32_000, 49_152, 50_257])
def test_first_argmax_is_torchs_argmax_ties_included(width: int) -> None:
    """Greedy decoding takes the first of equal maxima, wherever they fall: inside one block, across blocks,
    in the ragged last block, or a row of equal values."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=g)
    x[1, [3, width - 1]] = 50.0  # a tie across blocks
    x[2] = 0.0  # all equal
    x[3, width - 1] = 50.0  # the last column alone
    x[4, [width // 2, width // 2 + 1]] = 50.0  # a tie in one block
    x[5:] = torch.randint(0, 3, (4, width), generator=g).float()  # many ties
    assert torch.equal(first_argmax(x), x.argmax(-1))


def test_sampling_follows_the_softmax() -> None:
    counts = draw(SamplingParams(temperature=1.0, seed=11), 4000)
    probs = torch.softmax(LOGITS[0], -1).tolist()
    for token, p in enumerate(probs):
        # 5 standard deviations of a binomial: fails only if the sampler is wrong
        assert abs(counts[token] / 4000 - p) < 5 * math.sqrt(p * (1 - p) / 4000)


def test_top_k_and_top_p_exclude_the_tail() -> None:
    assert set(draw(SamplingParams(temperature=1.0, top_k=2, seed=1), 300)) == {0, 1}
    # softmax of LOGITS: 0.55, 0.20, 0.12, 0.07, 0.03 -> top_p 0.7 keeps the first two
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.7, seed=2), 300)) == {0, 1}
    # min_p 0.3: tokens under 0.3 x 0.55 = 0.165 are out (the first two stay); after temperature, as in vLLM
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.3, seed=4), 300)) == {0, 1}
    assert set(draw(SamplingParams(temperature=2.0, min_p=0.3, seed=4), 300)) == {0, 1, 2, 3}


def test_the_stream_depends_only_on_seed_and_position() -> None:
    p = SamplingParams(temperature=1.0, seed=99)
    alone = [sample(LOGITS, [p], [i]).token_ids[0] for i in range(50)]
    batched = sample(LOGITS.repeat(50, 1), [p] * 50, list(range(50))).token_ids
    assert alone == batched
    assert token_seed(99, 3) == token_seed(99, 3) != token_seed(99, 4)


def test_min_tokens_suppresses_stop_tokens() -> None:
    p = SamplingParams(temperature=0.0, min_tokens=2)
    assert sample(LOGITS, [p], [0], frozenset({0})).token_ids == [1]
    assert sample(LOGITS, [p], [2], frozenset({0})).token_ids == [0]


def test_logprobs_are_the_models_own() -> None:
    result = sample(LOGITS, [SamplingParams(temperature=0.7, logprobs=True, top_logprobs=2, seed=5)], [0])
    expected = torch.log_softmax(LOGITS[0], -1)
    assert result.logprobs[0] == pytest.approx(expected[result.token_ids[0]].item(), abs=1e-6)
    assert [t for t, _ in result.top_logprobs[0]] == [0, 1]


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        (SamplingParams(max_tokens=-1), "max_tokens"),  # 0 is the prompt alone (echo)
        (SamplingParams(temperature=2.5), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(stop=["a", "b", "c", "d", "e"]), "stop"),
        (SamplingParams(top_logprobs=21), "top_logprobs"),
        (SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=11.0), "repetition_penalty"),
    ],
)
def test_validation_names_the_parameter(params: SamplingParams, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        params.validate(vocab_size=1000)


def test_frequency_counts_every_repeat_and_presence_only_the_first() -> None:
    repeated = [0] * 5
    greedy = {"temperature": 0.0}
    assert sample(LOGITS, [SamplingParams(**greedy, presence_penalty=0.9)], [5], generated=[repeated]).token_ids == [0]
    assert sample(LOGITS, [SamplingParams(**greedy, frequency_penalty=0.3)], [5], generated=[repeated]).token_ids == [1]
    assert sample(LOGITS, [SamplingParams(**greedy, frequency_penalty=-2.0)], [2], generated=[[3, 3]]).token_ids == [3]
    assert sample(LOGITS, [SamplingParams(**greedy, frequency_penalty=2.0)], [0], generated=[[]]).token_ids == [0]


def test_repetition_penalty_shrinks_the_logits_of_prompt_and_output_tokens_toward_zero_from_both_sides() -> None:
    """Positive logits are divided by it and negative ones multiplied, so a seen token always loses ground (a
    plain division would raise a negative one); a token seen in the prompt and the output is penalized once."""
    logits = torch.tensor([[2.0, 1.9, 0.5, -0.1, -1.0]])
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=True)
    prompt = prompt_vocabulary([0, 3, 0])
    result = sample(logits, [greedy], [1], generated=[[0]], prompts=[prompt])
    assert result.token_ids == [1]  # 2.0 / 2 = 1.0 < 1.9
    assert result.logprobs == [pytest.approx(torch.log_softmax(logits[0], -1)[1].item())]  # the model's own
    adjusted = logits.clone()[0]
    _adjust(adjusted, greedy, [0, 4], prompt)
    assert adjusted.tolist() == pytest.approx([1.0, 1.9, 0.5, -0.2, -2.0])
    reward = SamplingParams(temperature=0.0, repetition_penalty=0.5)  # below 1 favours repeats
    assert sample(torch.tensor([[1.0, 1.9]]), [reward], [0], prompts=[prompt_vocabulary([0])]).token_ids == [0]


def test_logit_bias_comes_before_the_repetition_penalty_as_in_vllm() -> None:
    """vLLM's sampler adds the bias, then applies the penalties: a biased token seen in the prompt has its biased
    logit scaled ((-1 + 2) / 3 = 0.33 beats 0), not its raw one ((-1 x 3) + 2 = -1 loses)."""
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0, logit_bias={0: 2.0})
    assert sample(torch.tensor([[-1.0, 0.0]]), [params], [0], prompts=[prompt_vocabulary([0])]).token_ids == [0]


def test_logit_bias_forces_and_bans_and_logprobs_stay_the_models() -> None:
    forced = sample(LOGITS, [SamplingParams(temperature=0.0, logit_bias={4: 100.0}, logprobs=True)], [0])
    assert forced.token_ids == [4]
    assert forced.logprobs == [pytest.approx(torch.log_softmax(LOGITS[0], -1)[4].item())]
    banned = draw(SamplingParams(temperature=1.0, seed=4, logit_bias={0: -100.0, 1: -100.0}), 200)
    assert set(banned) <= {2, 3, 4}


def test_penalties_and_biases_outside_their_ranges_are_refused() -> None:
    with pytest.raises(ValueError, match="presence_penalty must be between -2 and 2"):
        SamplingParams(presence_penalty=2.5).validate(5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(logit_bias={7: 1.0}).validate(5)
    with pytest.raises(ValueError, match="between -100 and 100"):
        SamplingParams(logit_bias={1: -101.0}).validate(5)


def test_the_sampler_keeps_a_constrained_rows_only_tokens_under_min_tokens() -> None:
    logits = torch.zeros(2, 64)
    bits = torch.zeros(2, 2, dtype=torch.int32)
    bits[:, 0] = 1 << 3  # both rows: only token 3, a stop token
    masks = Masks(rows=[0, 1], bits=bits, failed={})
    params = [SamplingParams(min_tokens=2, temperature=0.0), SamplingParams(min_tokens=2, seed=1)]
    assert sample(logits, params, [0, 0], frozenset({3}), masks=masks).token_ids == [3, 3]
    unconstrained = sample(logits[:1], params[:1], [0], frozenset({0}))  # no mask: min_tokens still holds
    assert unconstrained.token_ids != [0]


def test_allowed_token_ids_become_an_index_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's allowed_token_ids are turned into an index tensor at its first step, not at every one (that cost
    0.9 ms a step for 10,000 ids); every step still samples among them alone."""
    allowed = [1, 3, 4]
    built: list[object] = []
    make_tensor = torch.tensor

    def counting_tensor(data: object, *args: object, **kwargs: object) -> torch.Tensor:
        if data == allowed:
            built.append(data)
        return make_tensor(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting_tensor)
    params = SamplingParams(allowed_token_ids=allowed, seed=5)
    tokens = [sample(LOGITS, [params], [i]).token_ids[0] for i in range(6)]
    assert set(tokens) <= set(allowed) and len(built) == 1
