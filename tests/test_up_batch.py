"""A local pool (`kvmesh up`) serves the Batch API out of the box: its router gets a SQLite database in the pool's
work folder when the pool names none, and runs a batch through the pool's engine (simulated: the bundled model's
timing) with the official client."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from kvmesh.router.batches import CHAT_PATH, jsonl

from .engines import stop_up
from .test_up_scaling import wait_for
from .test_up_stop import start_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_a_local_pool_runs_a_batch_with_no_database_configured(tmp_path: Path) -> None:
    proc, url, log = start_pool(tmp_path)
    try:
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        entries = [{"custom_id": f"q{i}", "method": "POST", "url": CHAT_PATH,
                    "body": {"messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 2}}
                   for i in range(3)]
        file_id = api.files.create(file=("q.jsonl", jsonl(entries)), purpose="batch").id
        batch_id = api.batches.create(input_file_id=file_id, endpoint=CHAT_PATH, completion_window="24h").id
        wait_for(lambda: api.batches.retrieve(batch_id).status in ("completed", "failed", "cancelled", "expired"),
                 "the batch to end", proc, log)
        batch = api.batches.retrieve(batch_id)
        assert batch.status == "completed" and batch.request_counts.completed == 3, batch
        output = [json.loads(x) for x in api.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in output) == ["q0", "q1", "q2"]
        assert all(x["response"]["body"]["usage"]["completion_tokens"] == 2 for x in output)
    finally:
        stop_up(proc, log)
