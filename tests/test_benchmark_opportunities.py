"""The finder's benchmark, run small: the eager rows carry the gains fusing realized, the
fused step's rows name what covers them, and the printout holds both tables."""

import pytest

from te_lab.benchmarks import opportunities


def test_the_demo_llama_before_and_after_fusing(capsys):
    result = opportunities.run("llama-tiny", layers=1, batch=2, seq=16, steps=1)
    before, after = result["before"], result["after"]
    assert before.mode == "eager" and after.mode == "fused" and before.rows
    assert "candidate modules fused in LlamaLM" in result["fusion"]
    norms = [row for row in before.rows if row.fused_by.startswith("rule rmsnorm matches")]
    assert norms and all(row.realized_gain_ms is not None and row.note.startswith("realized") for row in norms)
    assert not any(row.fused_by.startswith("rule rmsnorm matches") for row in after.rows)
    assert opportunities.main(["--model", "llama-tiny", "--batch", "2", "--seq", "16", "--steps", "1",
                               "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "before fusing, with the gains fusing realized:" in out and "what fusion left:" in out
    assert "fusion opportunities (eager step" in out and "fusion opportunities (fused step" in out


@pytest.mark.slow  # a 49k vocabulary
def test_the_smollm_like_model_builds_with_its_sample():
    model, sample = opportunities.model_and_sample(opportunities.SMOLLM_LIKE, layers=1, batch=1, seq=8)
    assert sample["input_ids"].shape == (1, 8) and model.config.vocab_size == 49152
