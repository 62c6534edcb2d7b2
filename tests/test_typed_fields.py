"""Settings files with a value of the wrong type (a YAML null, a quoted number, a word for a flag) are refused with
a message that names the setting, by the engine's and the router's loaders alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvmesh.engine.config import load_config
from kvmesh.router.config import load_router_config


@pytest.mark.parametrize(("settings", "message"), [
    ({"max_num_seqs": None}, "engine setting max_num_seqs must be a whole number, not None"),
    ({"threads": "2"}, "engine setting threads must be a whole number or null, not '2'"),
    ({"enable_prefix_cache": "yes"}, "engine setting enable_prefix_cache must be true or false, not 'yes'"),
    ({"kv_host_memory_mib": True}, "engine setting kv_host_memory_mib must be a number, not True"),
])
def test_the_engine_names_a_setting_of_the_wrong_type(tmp_path: Path, settings: dict, message: str) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"engine": settings}))
    with pytest.raises(ValueError) as caught:
        load_config(path)
    assert str(caught.value) == message


def test_numbers_a_setting_allows_are_taken_as_written(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"engine": {"kv_host_memory_mib": 64, "max_queue_delay_seconds": 1,
                                               "speculative_config": None, "lora_modules": []}}))
    assert load_config(path).kv_host_memory_mib == 64


def test_the_router_names_a_setting_of_the_wrong_type(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"router": {"pods": ["http://127.0.0.1:9"], "retries": None}}))
    with pytest.raises(ValueError, match="router setting retries must be a whole number, not None"):
        load_router_config(path)
    path.write_text(yaml.safe_dump({"router": {"pods": "http://127.0.0.1:9"}}))
    with pytest.raises(ValueError, match="router setting pods must be a list, not 'http"):
        load_router_config(path)
