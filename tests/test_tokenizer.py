"""The torch-free tokenizer: parity with transformers, chat templates, fingerprints and streaming detokenization."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kvmesh.engine.model.loader import bundled_gguf_path, resolve_model_dir
from kvmesh.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "",
    "The year 2024 had 366 days; pi is 3.14159 and 1,000,000 > 999.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A: pass",
    "😀👍🏽 emoji and a family 👨‍👩‍👧 🇫🇷",
    "中文测试，日本語のテキスト、한국어 text",
    "   leading spaces\t\ttabs\n\n\nnewlines   trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "don't you'll we've I'm THEY'RE",
    "Ünïcödé àccents — “quotes” … ½ ①",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_dir(None, progress=False)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tok(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def _copy_tokenizer_files(src: Path, dst: Path, template: str | None = None) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    if template is not None:
        config = json.loads((dst / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_special_tokens_match_the_original_model(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == frozenset({2})  # <|im_end|>
    assert tok.bos_token_id == 1
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)  # no BOS, like HF's SmolLM2


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    for add_special_tokens in (True, False):
        assert tok.encode(text, add_special_tokens) == hf_tok(text, add_special_tokens=add_special_tokens).input_ids
    ids = tok.encode(text)
    for skip in (True, False):
        assert tok.decode(ids, skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_encode_matches_transformers_gguf_tokenizer(tok: Tokenizer) -> None:
    gguf_path = bundled_gguf_path()
    try:
        reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (ImportError, ValueError) as e:
        pytest.skip(f"transformers cannot read the GGUF tokenizer here: {e}")
    # transformers' GGUF reader drops SmolLM's digit splitting (llama.cpp's "smollm" pre-tokenizer and the original
    # tokenizer.json split every number character), which only shows where a space precedes a non-ASCII number.
    comparable = [t for t in TEXTS if not any(c.isnumeric() and not c.isascii() for c in t)]
    for text in comparable:
        assert tok.encode(text, add_special_tokens=False) == reference(text, add_special_tokens=False).input_ids, text


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok, messages: list[dict]) -> None:
    for add_generation_prompt in (True, False):
        expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert tok.apply_chat_template(messages, add_generation_prompt) == expected
    expected_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tok.encode_chat(messages) == list(expected_ids)


def test_content_parts_are_flattened(tok: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "Hello\nthere"}])


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        None,
        ["hello"],
        [{"content": "no role"}],
        [{"role": "", "content": "empty role"}],
        [{"role": 3, "content": "numeric role"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": 42}],
        [{"role": "user", "content": []}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
    ],
)
def test_malformed_messages_raise_value_error(tok: Tokenizer, messages: object) -> None:
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


def test_template_exceptions_become_value_errors(model_dir: Path, tmp_path: Path) -> None:
    strict = _copy_tokenizer_files(model_dir, tmp_path / "strict", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        Tokenizer.from_dir(strict).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_environment_matches_transformers(model_dir: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}{{ bos_token }}{{ eos_token }}"
    copy = _copy_tokenizer_files(model_dir, tmp_path / "json", template)
    messages = [{"role": "user", "content": '<é & "q">'}]
    rendered = Tokenizer.from_dir(copy).apply_chat_template(messages)
    assert rendered == AutoTokenizer.from_pretrained(copy).apply_chat_template(messages, tokenize=False)
    assert rendered.startswith('{"role": "user", "content": "<é & \\"q\\">"}')


def test_fingerprint_is_stable_and_content_based(model_dir: Path, tok: Tokenizer, tmp_path: Path) -> None:
    assert len(tok.fingerprint) == 16 and int(tok.fingerprint, 16) >= 0
    assert Tokenizer.from_dir(model_dir).fingerprint == tok.fingerprint
    assert Tokenizer.from_dir(_copy_tokenizer_files(model_dir, tmp_path / "same")).fingerprint == tok.fingerprint
    changed = _copy_tokenizer_files(model_dir, tmp_path / "changed", "{{ messages[0]['content'] }}")
    assert Tokenizer.from_dir(changed).fingerprint != tok.fingerprint


def test_fingerprint_across_processes_without_torch(model_dir: Path, tok: Tokenizer) -> None:
    code = (
        "import sys; from pathlib import Path; from kvmesh.engine.model.tokenizer import Tokenizer; "
        f"print(Tokenizer.from_dir(Path({str(model_dir)!r})).fingerprint); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [tok.fingerprint, "False"]


def _stream(tok: Tokenizer, ids: list[int], chunk: int = 1, prompt: list[int] | None = None, skip: bool = True):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.text


def test_multibyte_characters_split_over_tokens(tok: Tokenizer) -> None:
    text = "Emoji 😀👍🏽, CJK 世界你好 and é."
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the test is only meaningful if characters are split
    deltas, streamed = _stream(tok, ids)
    assert "".join(deltas) == streamed == text
    assert not any("\ufffd" in d for d in deltas)


def test_incomplete_character_is_held_back(tok: Tokenizer) -> None:
    ids = tok.encode(" 😀")
    detok = IncrementalDetokenizer(tok)
    assert [detok.step([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step(ids[-1:]) == " 😀" and detok.text == " 😀"


def test_prompt_context_and_special_tokens(tok: Tokenizer) -> None:
    prompt = tok.encode_chat([{"role": "user", "content": "hi"}])
    ids = [*tok.encode("Hello there!"), 2]
    assert "".join(_stream(tok, ids, prompt=prompt)[0]) == "Hello there!"
    assert "".join(_stream(tok, ids, prompt=prompt, skip=False)[0]) == "Hello there!<|im_end|>"


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_deltas_concatenate_to_decode(tok: Tokenizer, data: st.DataObject) -> None:
    # Low ids are the special tokens and single bytes, which split characters most often.
    token = st.one_of(st.integers(0, tok.vocab_size - 1), st.integers(0, 300))
    ids = data.draw(st.lists(token, min_size=1, max_size=24), label="ids")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    expected = tok.decode(ids, skip)
    assume(not expected.endswith("\ufffd"))  # ends mid-character: held back by design
    prompt = data.draw(st.sampled_from([None, tok.encode_chat(CONVERSATIONS[0])]), label="prompt")
    chunk = data.draw(st.integers(1, 4), label="chunk")
    deltas, streamed = _stream(tok, ids, chunk, prompt, skip)
    assert "".join(deltas) == streamed == expected


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_deltas_and_flush_concatenate_to_decode_even_mid_character(tok: Tokenizer, data: st.DataObject) -> None:
    """At the end of an output, flush() gives what was held back: the stream then equals decode(all ids)."""
    token = st.one_of(st.integers(0, tok.vocab_size - 1), st.integers(0, 300))
    ids = data.draw(st.lists(token, min_size=1, max_size=24), label="ids")
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert streamed == detok.text == tok.decode(ids)


def test_a_half_character_at_the_end_is_flushed(tok: Tokenizer) -> None:
    ids = tok.encode(" 😀")[:-1]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.step([i]) for i in ids) == ""
    assert detok.flush() == tok.decode(ids) and "\ufffd" in detok.text


def test_the_developer_role_is_the_system_prompt_for_a_template_that_does_not_name_it(tok: Tokenizer,
                                                                                        model_dir: Path,
                                                                                        tmp_path: Path) -> None:
    """OpenAI's newer name for the system prompt: SmolLM2's template knows only `system`, and rendered `developer`
    as an unknown turn after its own default system prompt."""
    asked = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    as_system = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(asked) == tok.apply_chat_template(as_system)
    knows = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
             "{# developer turns are kept #}")
    own = Tokenizer.from_dir(_copy_tokenizer_files(model_dir, tmp_path / "own", knows))
    assert own.apply_chat_template(asked, add_generation_prompt=False) == "<developer>Answer in French.<user>Hi"


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(model_dir: Path, tmp_path: Path) -> None:
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking): more variables for the template, rendered as HF's
    apply_chat_template(**kwargs) renders them; the request's own variables cannot be replaced by them, and a chat
    request's prompt ids (what the engine prefills and the router hashes) carry them."""
    from kvmesh.engine.openai_types import ChatRequest

    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}")
    path = _copy_tokenizer_files(model_dir, tmp_path / "thinking", template)
    own, hf = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "Hi"}]
    rendered = own.apply_chat_template(messages, template_kwargs={"enable_thinking": False})
    assert rendered == hf.apply_chat_template(messages, tokenize=False, enable_thinking=False) == "<user>Hi<no_think>"
    assert own.apply_chat_template(messages) == "<user>Hi"
    assert own.apply_chat_template(messages, template_kwargs={"messages": []}) == "<user>Hi"
    request = ChatRequest(messages=messages, chat_template_kwargs={"enable_thinking": False})
    assert own.decode(request.prompt_ids(own)) == "<user>Hi<no_think>"
    with pytest.raises(ValueError, match="messages cannot be set here"):
        ChatRequest(messages=messages, chat_template_kwargs={"messages": []})


def test_template_variables_of_a_kind_the_template_cannot_use_are_a_value_error(model_dir: Path,
                                                                               tmp_path: Path) -> None:
    """A number where a Llama 3 style template loops over `custom_tools` raised TypeError (a 500 on engine and
    router); it is the request's error, as a template's own refusal is. The environment's functions cannot be
    replaced by a request's variables."""
    from kvmesh.engine.openai_types import ChatRequest

    template = "{% for t in custom_tools %}{{ t }}{% endfor %}{{ strftime_now('%Y') }}{{ messages[0]['content'] }}"
    own = Tokenizer.from_dir(_copy_tokenizer_files(model_dir, tmp_path / "tools", template))
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="TypeError"):
        own.apply_chat_template(messages, template_kwargs={"custom_tools": 5})
    assert own.apply_chat_template(messages, template_kwargs={"custom_tools": ["a"]}).startswith("a")
    with pytest.raises(ValueError, match="strftime_now cannot be set here"):
        ChatRequest(messages=messages, chat_template_kwargs={"strftime_now": "today"})
