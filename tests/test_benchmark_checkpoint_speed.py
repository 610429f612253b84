"""The 135M-shaped checkpoint benchmark, run small: every case timed in both modes, the
ratios with their intervals, greedy tokens compared, the ceiling from a real profile."""

import pytest

pytest.importorskip("transformers")

from te_lab.benchmarks import checkpoint_speed  # noqa: E402


@pytest.mark.slow  # a 49k vocabulary
def test_one_layer_run_times_every_case_and_reports_the_ceiling():
    result = checkpoint_speed.run(layers=1, train=[(1, 16)], decode=[1], prompt=4, new_tokens=2, rounds=2,
                                  profile_steps=1)
    assert [row["case"] for row in result["rows"]] == ["training step 1 x 16", "greedy decode batch 1, 2 tokens"]
    for row in result["rows"]:
        assert row["eager_ms"] > 0 and row["fused_ms"] > 0
        assert row["speedup"] == pytest.approx(row["eager_ms"] / row["fused_ms"])
        assert row["low"] <= row["speedup"] <= row["high"]
    assert result["tokens_identical"] == {1: True}
    assert "candidate modules fused in LlamaForCausalLM" in result["fusion"]
    ceiling = result["ceiling"]
    assert ceiling is not None and ceiling.ceiling_step_ms <= ceiling.eager_step_ms
    text = "\n".join(checkpoint_speed.markdown(result))
    assert "| training step 1 x 16 |" in text and ceiling.verdict() in text


def test_sizes_are_parsed_and_bad_ones_named():
    assert checkpoint_speed._sizes("4x256,2x128") == [(4, 256), (2, 128)]
    with pytest.raises(Exception, match="expected sizes like 4x256,2x128, got '4by256'"):
        checkpoint_speed._sizes("4by256")
