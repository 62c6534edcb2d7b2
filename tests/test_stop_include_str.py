"""include_stop_str_in_output: the stop string stays in the output, so a stream holds nothing back (vLLM's rule),
and a pod resuming such a request takes the client to have all of its text."""

from __future__ import annotations

import pytest

from kvmesh.engine.engine import Engine
from kvmesh.engine.protocol import sendable_length
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.sampling import SamplingParams

from .test_engine import generate, stop_in_token_6


def test_nothing_is_held_back_when_the_stop_string_stays_in_the_output() -> None:
    assert sendable_length("say ab", 0, ["abc"]) == len("say ")
    assert sendable_length("say ab", 0, ["abc"], include_stop_str_in_output=True) == len("say ab")


@pytest.mark.parametrize("completes", [False, True])
def test_a_stream_with_include_stop_str_in_output_sends_a_possible_stop_strings_start_at_once(
        tiny_engine: Engine, completes: bool) -> None:
    """The tail of token 6's text begins the stop string: with the flag it is sent with token 6, not after token 7
    shows whether the stop string completes; the whole output is the same as without holding back. A pod resuming
    after token 6 (resume_output_ids) takes the client to have all of its text."""
    case = stop_in_token_6(tiny_engine, completes)
    ids, free, before, after, stop = case.ids, case.free, case.before, case.after, case.stop
    decode = tiny_engine.tokenizer.decode
    params = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True, "stop": [stop],
              "include_stop_str_in_output": True}
    [alone] = generate(tiny_engine, [ids], **params)
    assert "".join(o.new_text for o in alone.outputs[:6]) == before  # the stop string's start went out with token 6
    whole = "".join(o.new_text for o in alone.outputs)
    assert whole == (after[: len(before) + 1] if completes else decode(free.tokens))
    outputs: list[RequestOutput] = []
    tiny_engine.submit(Request("resumed-include-stop", list(ids), SamplingParams(**params),  # type: ignore[arg-type]
                               on_output=outputs.append, output_ids=free.tokens[:6]))
    tiny_engine.run_until_idle()
    assert before + "".join(o.new_text for o in outputs) == whole
    assert outputs[-1].finish_reason == alone.final.finish_reason == ("stop" if completes else "length")
