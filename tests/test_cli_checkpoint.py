"""``te-lab profile --model PATH`` on a user's own checkpoint: a folder that
``save_pretrained`` wrote is loaded offline, fused with its swaps judged against float64
(the checkpoint made real-like, as pretrained ones are) and profiled; a path that does not
exist, a checkpoint that is not a causal LM and a ``.gguf`` file without the ``gguf``
package are each one error saying what to do."""

import importlib.util
from pathlib import Path

import pytest
import torch

from te_lab import ProfileReport
from te_lab.cli import main
from te_lab.models import CheckpointError, build_model, load_checkpoint
from te_lab.models.real_like import make_real_like

transformers = pytest.importorskip("transformers")



def llama_checkpoint(folder: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = make_real_like(transformers.LlamaForCausalLM(config))
    model.save_pretrained(folder)
    return folder


def test_profile_runs_on_a_saved_checkpoint_folder(tmp_path, capsys):
    folder = llama_checkpoint(tmp_path / "my-llama")
    status = main(["profile", "--model", str(folder), "--batch", "1", "--seq", "16", "--steps", "2",
                   "--json", str(tmp_path / "report.json")])
    out = capsys.readouterr().out
    assert status == 0
    assert "10 of 10 candidate modules fused in LlamaForCausalLM" in out
    report = ProfileReport.from_json((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert report.environment.target == "LlamaForCausalLM"


def test_a_checkpoint_loads_with_its_weights_in_the_dtype_asked(tmp_path):
    folder = llama_checkpoint(tmp_path / "my-llama")
    expected = transformers.LlamaForCausalLM.from_pretrained(folder)
    model = build_model(str(folder), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for (name, p), (_, q) in zip(model.named_parameters(), expected.named_parameters()):
        assert torch.equal(p, q.to(torch.bfloat16)), name


def test_a_missing_path_is_an_option_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["profile", "--model", str(tmp_path / "nowhere")])
    assert "argument --model: checkpoint" in capsys.readouterr().err


def test_a_checkpoint_that_is_not_a_causal_lm_says_so(tmp_path, capsys):
    config = transformers.DistilBertConfig(vocab_size=64, dim=32, hidden_dim=64, n_layers=1, n_heads=2)
    transformers.DistilBertModel(config).save_pretrained(tmp_path / "distilbert")  # an encoder: no causal LM
    with pytest.raises(CheckpointError, match="not a causal language model"):
        load_checkpoint(tmp_path / "distilbert")
    with pytest.raises(SystemExit):
        main(["profile", "--model", str(tmp_path / "distilbert"), "--seq", "8", "--steps", "2"])
    assert "not a causal language model" in capsys.readouterr().err


def test_a_folder_without_config_says_what_to_pass(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_checkpoint(tmp_path / "empty")


@pytest.mark.skipif(importlib.util.find_spec("gguf") is not None, reason="the gguf package is installed here")
def test_a_gguf_file_without_the_gguf_package_says_what_to_install(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="pip install gguf"):
        load_checkpoint(path)
