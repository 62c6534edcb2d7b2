"""The weights fingerprint across releases: a ModelConfig field added at its default leaves the fingerprint of
unchanged weights as it was, so a half-rolled pool's old and new engines still store alike (router pulls and
handoffs, operator warm-ups); a value that changes the KV still changes it; today's values are pinned."""

from __future__ import annotations

import dataclasses

from kvmesh.engine.model import loader

TINY = loader.ModelConfig(
    name="tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
    tie_word_embeddings=True, attention_bias=False, eos_token_ids=(2,),
)
DIGESTS = {"model.embed_tokens.weight": "00" * 16}


@dataclasses.dataclass(frozen=True)
class NextReleaseConfig(loader.ModelConfig):
    """ModelConfig as a later release may have it: one more field, whose default is what engines did before it."""

    sliding_window: int | None = None
    extra_norms: tuple[str, ...] = dataclasses.field(default_factory=tuple)


def next_release(config: loader.ModelConfig, **changes: object) -> NextReleaseConfig:
    return NextReleaseConfig(**{**dataclasses.asdict(config), **changes})


def test_a_field_added_at_its_default_keeps_the_fingerprint() -> None:
    for config in (TINY, dataclasses.replace(TINY, qk_norm=True)):
        for quantization in (None, "int8"):
            assert (loader.weights_fingerprint(next_release(config), DIGESTS, quantization)
                    == loader.weights_fingerprint(config, DIGESTS, quantization))


def test_a_new_field_away_from_its_default_changes_the_fingerprint() -> None:
    today = loader.weights_fingerprint(TINY, DIGESTS)
    windowed = loader.weights_fingerprint(next_release(TINY, sliding_window=64), DIGESTS)
    normed = loader.weights_fingerprint(next_release(TINY, extra_norms=("post_attention",)), DIGESTS)
    assert len({today, windowed, normed}) == 3


def test_every_value_that_changes_the_kv_changes_the_fingerprint() -> None:
    changed = {
        "vocab_size": 65, "hidden_size": 48, "intermediate_size": 96, "num_layers": 3, "num_heads": 8,
        "num_kv_heads": 4, "head_dim": 4, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "attention_bias": True, "qk_norm": True,
    }
    assert set(changed) == {f.name for f in dataclasses.fields(loader.ModelConfig)} - {"name", "eos_token_ids"}
    prints = {loader.weights_fingerprint(dataclasses.replace(TINY, **{k: v}), DIGESTS) for k, v in changed.items()}
    assert len(prints) == len(changed) and loader.weights_fingerprint(TINY, DIGESTS) not in prints
    assert loader.weights_fingerprint(TINY, {"model.embed_tokens.weight": "01" * 16}) != loader.weights_fingerprint(
        TINY, DIGESTS)


def test_the_served_name_and_stop_ids_do_not_count() -> None:
    renamed = dataclasses.replace(TINY, name="other", eos_token_ids=(2, 3))
    assert loader.weights_fingerprint(renamed, DIGESTS) == loader.weights_fingerprint(TINY, DIGESTS)


def test_todays_fingerprints_are_kept() -> None:
    """The values engines of 2026-12-07 on publish (computed with that code): skipping defaults changed none."""
    assert loader.weights_fingerprint(TINY, DIGESTS) == "dc396e3b057bff59"
    assert loader.weights_fingerprint(TINY, DIGESTS, "int8") == "923b1cafc1b48614"
    assert loader.weights_fingerprint(dataclasses.replace(TINY, qk_norm=True), DIGESTS) == "8a2acc947d8e48af"
    scaled = dataclasses.replace(TINY, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    assert loader.weights_fingerprint(scaled, DIGESTS) == "bbe34ef7a974d658"
