"""The bundled SmolLM2-135M-Instruct end to end: against transformers token for token, and `kvmesh serve` as a
real process answering the openai client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.sampling import SamplingParams
from kvmesh.processes import free_port, spawn, stop, wait_healthy

from .conftest import make_engine

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_greedy_chat_equals_transformers_for_32_tokens(bundled_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = make_engine(bundled_dir, kv_cache_blocks=64)
    prompt = engine.tokenizer.encode_chat(QUESTION)
    hf_tokenizer = AutoTokenizer.from_pretrained(bundled_dir)
    expected = hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert prompt == expected["input_ids"]
    outputs: list[RequestOutput] = []
    request = Request("paris", prompt, SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0),
                      on_output=outputs.append)
    engine.submit(request)
    engine.run_until_idle()
    ours = [t for o in outputs for t in o.new_token_ids]
    model = AutoModelForCausalLM.from_pretrained(bundled_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert ours == ref[0, len(prompt):].tolist()
    assert "Paris" in engine.tokenizer.decode(ours)


def test_greedy_chat_in_bf16_answers_paris(bundled_dir: Path) -> None:
    """In bf16 the two best first tokens (25.33 "The" and 25.24 in fp32) once tied and greedy answered
    "L'Étoile, la Marseillaise..." (docs/architecture.md "Serving dtype")."""
    engine = make_engine(bundled_dir, dtype="bfloat16", kv_cache_blocks=16)
    outputs: list[RequestOutput] = []
    engine.submit(Request("paris-bf16", engine.tokenizer.encode_chat(QUESTION),
                          SamplingParams(max_tokens=10, temperature=0.0), on_output=outputs.append))
    engine.run_until_idle()
    assert "Paris" in engine.tokenizer.decode([t for o in outputs for t in o.new_token_ids])


@pytest.fixture(scope="module")
def serve_process(tmp_path_factory: pytest.TempPathFactory, bundled_dir: Path) -> Iterator[str]:
    port = free_port()
    config = tmp_path_factory.mktemp("serve") / "engine.yaml"
    config.write_text("engine:\n  kv-cache-memory-mib: 128\n  max-num-seqs: 16\n  dtype: float32\n")
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    proc = spawn(["serve", "--config", str(config), "--port", str(port)], log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout=300, log=log)
        yield url
    finally:
        stop([proc], timeout=30)


def test_serve_process_answers_paris(serve_process: str) -> None:
    client = openai.OpenAI(base_url=serve_process + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=32,
                                           temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=32,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_serve_process_reads_its_config_and_exports_metrics(serve_process: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    metrics = httpx.get(serve_process + "/metrics").text
    blocks = {s.labels["state"]: s.value for f in text_string_to_metric_families(metrics)
              for s in f.samples if s.name == "kvmesh_kv_blocks" and s.labels["tier"] == "device"}
    assert set(blocks) == {"used", "evictable", "free"}
    assert sum(blocks.values()) == httpx.get(serve_process + "/v1/kv/config").json()["num_device_blocks"]
    # 128 MiB of fp32 KV for SmolLM2 (30 layers, 3 KV heads of 64) is 182 blocks of 16 tokens
    assert sum(blocks.values()) == 182


def test_int8_engine_still_answers_paris(bundled_dir: Path) -> None:
    engine = make_engine(bundled_dir, quantization="int8", kv_cache_blocks=32)
    outputs: list[RequestOutput] = []
    engine.submit(Request("q", engine.tokenizer.encode_chat(QUESTION), SamplingParams(max_tokens=16, temperature=0),
                          on_output=outputs.append))
    engine.run_until_idle()
    assert "Paris" in "".join(o.new_text for o in outputs)
