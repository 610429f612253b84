"""Generation, fused against unfused: greedy tokens identical (batch 1 through the KV
cache, dynamic and static; a left-padded batch through Hugging Face's generate), the
generation benchmark's records, and ``te-lab generate``."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import te_lab
from te_lab.benchmarks import generation
from te_lab.cli import main as cli_main

transformers = pytest.importorskip("transformers")


def hf_llama(layers=2):
    """A tiny random Hugging Face Llama with GQA, and its unfused copy, fused on a sample."""
    model = te_lab.models.huggingface("llama", "tiny", num_layers=layers, seed=3)
    model.eval()
    reference = copy.deepcopy(model)
    sample = torch.randint(1, 250, (2, 12), generator=torch.Generator().manual_seed(5))
    report = te_lab.fuse(model, sample={"input_ids": sample}, progress=False)
    assert {row.rule for row in report.fused} >= {"attention", "gated_mlp", "rmsnorm"}
    return model, reference


@pytest.mark.parametrize("static_cache", [False, True], ids=["dynamic-cache", "static-cache"])
def test_greedy_decoding_at_batch_1_gives_the_unfused_tokens(static_cache):
    model, reference = hf_llama()
    prompt = torch.randint(1, 250, (1, 10), generator=torch.Generator().manual_seed(7))
    fused = generation.generate(model, model, prompt, 8, static_cache=static_cache)
    unfused = generation.generate(reference, reference, prompt, 8, static_cache=static_cache)
    assert fused.tokens.shape == (1, 18) and torch.equal(fused.tokens[:, :10], prompt)
    assert torch.equal(fused.tokens, unfused.tokens)
    # The same tokens as Hugging Face's own greedy generate of the unfused model.
    expected = reference.generate(prompt, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt),
                                  pad_token_id=0)
    assert torch.equal(fused.tokens, expected)
    assert fused.prefill_s > 0 and fused.decode_s > 0


def test_greedy_decoding_of_a_left_padded_batch_gives_the_unfused_tokens():
    model, reference = hf_llama()
    ids = torch.randint(1, 250, (4, 12), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    for row, padding in enumerate((0, 3, 5, 8)):  # left padding of every length
        ids[row, :padding] = 0
        mask[row, :padding] = 0
    options = dict(max_new_tokens=6, do_sample=False, attention_mask=mask, pad_token_id=0)
    with torch.no_grad():
        tokens = model.generate(ids, **options)
        expected = reference.generate(ids, **options)
    assert tokens.shape == (4, 18)
    assert torch.equal(tokens, expected)


def test_a_demo_model_decodes_without_a_cache_the_tokens_of_its_full_forward():
    model = te_lab.models.llama("tiny", seed=1).eval()
    prompt = torch.randint(1, 250, (2, 6), generator=torch.Generator().manual_seed(2))
    result = generation.generate(model, model, prompt, 4)
    sequence = prompt
    with torch.no_grad():
        for _ in range(4):
            sequence = torch.cat([sequence, model(sequence).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(result.tokens, sequence)


def test_the_generation_benchmark_reports_prefill_and_decode_per_mode_with_ratios():
    config = generation.Config(models=("llama-tiny",), batches=(2,), prompts=(8,), new_tokens=4, rounds=3,
                               warmup=0, modes=("eager", "fused"))
    [record] = generation.run(config)
    assert (record["model"], record["batch"], record["prompt"], record["kv_cache"]) == ("llama-tiny", 2, 8, False)
    assert record["fused_modules"] > 0
    for name in ("eager", "fused"):
        mode = record["modes"][name]
        assert mode["error"] is None and mode["tokens_identical_to_eager"] is True
        assert len(mode["prefill_ms"]) == len(mode["decode_ms_per_token"]) == 3
        assert mode["prefill_tokens_per_s"] == pytest.approx(2 * 8 / (sorted(mode["prefill_ms"])[1] / 1000))
        assert mode["decode_tokens_per_s"] == pytest.approx(2 / (sorted(mode["decode_ms_per_token"])[1] / 1000))
    ratios = {(r["contender"], r["over"], r["phase"]): r for r in record["speedups"]}
    assert set(ratios) == {("fused", "eager", "prefill"), ("fused", "eager", "decode")}
    decode = ratios[("fused", "eager", "decode")]
    assert decode["value"] == pytest.approx(sorted(record["modes"]["eager"]["decode_ms_per_token"])[1]
                                            / sorted(record["modes"]["fused"]["decode_ms_per_token"])[1])
    assert decode["interval_low"] <= decode["value"] <= decode["interval_high"]
    table = generation.markdown([record])
    assert len(table) == 4 and table[3].startswith("| llama-tiny | 2 | 8 | fused |") and table[3].endswith("| yes |")
    # The suite's results file holds it as written here.
    jsonschema = pytest.importorskip("jsonschema")
    from te_lab.benchmarks.schema import GENERATION_RESULT

    jsonschema.validate(json.loads(json.dumps(record)), GENERATION_RESULT)


def test_the_generation_benchmark_refuses_bad_options(capsys):
    assert generation.main(["--batches", "0"]) == 2
    assert "--batches: got '0'; expected positive integers" in capsys.readouterr().err
    assert generation.main(["--modes", "fused"]) == 2
    assert "--modes: got 'fused'; expected eager and any of fused, compile, fused+compile" in capsys.readouterr().err


def test_the_key_configuration_is_issue_28s_decode_figure(capsys):
    key = generation.KEY
    assert (key.models, key.batches, key.prompts, key.new_tokens, key.modes) == (
        (generation.HF_LLAMA_24,), (1,), (64,), 32, ("eager", "fused"))
    # Its batch and modes, on a small model: eager and fused rows only, at batch 1.
    assert generation.main(["--key", "--models", "llama-tiny", "--prompts", "4", "--new-tokens", "2",
                            "--rounds", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| llama-tiny")]
    assert [row.split(" | ")[1:4] for row in rows] == [["1", "4", "eager"], ["1", "4", "fused"]]
    with pytest.raises(SystemExit):
        generation.main(["--key", "--quick"])


def test_te_lab_generate_prints_the_tokens_and_tokens_per_s_of_both(capsys):
    assert cli_main(["generate", "--model", "llama-tiny", "--prompt", "5, 17 42", "--max-new-tokens", "3",
                     "--rounds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    tokens = [int(token) for token in out[0].split()]
    assert tokens[:3] == [5, 17, 42] and len(tokens) == 6
    model = te_lab.models.build_model("llama-tiny").eval()
    assert tokens == generation.generate(model, model, torch.tensor([[5, 17, 42]]), 3).tokens[0].tolist()
    assert out[1].startswith(" unfused: prefill ") and out[2].startswith("   fused: prefill ")
    assert out[3].startswith("fused / unfused: prefill ")
    assert out[4] == "tokens identical fused and unfused: yes (3 new tokens)"


def test_te_lab_generate_says_what_a_prompt_without_a_tokenizer_must_be():
    with pytest.raises(SystemExit, match=r"--prompt: this model has no tokenizer, so the prompt is token ids in "
                                         r"\[0, 256\) separated by spaces or commas; got 'hello'"):
        cli_main(["generate", "--model", "llama-tiny", "--prompt", "hello", "--max-new-tokens", "2"])


def test_a_profile_of_generate_shows_prefill_and_decode_apart_and_round_trips():
    model, _ = hf_llama()
    prompt = torch.randint(1, 250, (2, 10), generator=torch.Generator().manual_seed(13))

    def run():
        model.generate(prompt, max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(prompt),
                       pad_token_id=0)

    profile = te_lab.profile_generation(run, model, runs=1)
    prefill, decode = profile.phases["prefill"], profile.phases["decode"]
    for mode in ("eager", "fused"):
        # One forward over the 2 x 10 prompt, then one per new token after the first, a token per row.
        assert (prefill[mode].tokens, prefill[mode].forwards) == (20, 1)
        assert (decode[mode].tokens, decode[mode].forwards) == (8, 4)
        for figures in (prefill[mode], decode[mode]):
            assert figures.ms > 0 and figures.ms_per_token == pytest.approx(figures.ms / figures.tokens)
            assert figures.launches_per_token > 0
            # Every fused module ran in both phases, in both modes (its original, unfused).
            assert set(figures.module_ms) == set(profile.module_kinds) and all(
                ms > 0 for ms in figures.module_ms.values())
    assert set(profile.module_kinds.values()) >= {"attention", "mlp", "norm"}
    assert set(profile.module_gains("decode")) == set(profile.module_kinds.values())
    assert profile.speedup("decode") == pytest.approx(decode["eager"].ms_per_token / decode["fused"].ms_per_token)
    # A decode step of a 2-layer model launches tens of ops, a few per row at least.
    assert decode["eager"].launches_per_token * 2 > 2 * 10
    assert te_lab.GenerationProfile.from_json(profile.to_json()) == profile
    lines = profile.summary().splitlines()
    assert lines[1].startswith("prefill: 20 tokens in 1 forwards; per token eager ")
    assert lines[2].startswith("decode: 8 tokens in 4 forwards; per token eager ")


def test_a_profile_of_generation_leaves_no_profiler_chatter_on_stderr():
    """torch's C++ profiler prints a line on fd 2 as each profiled run starts and stops."""
    code = ("import torch, te_lab\n"
            "model = te_lab.models.llama('tiny', seed=0).eval()\n"
            "prompt = torch.randint(1, 250, (1, 4), generator=torch.Generator().manual_seed(1))\n"
            "te_lab.fuse(model, sample={'input_ids': prompt}, progress=False)\n"
            "te_lab.profile_generation(lambda: [model(prompt) for _ in range(2)], model, runs=1)\n"
            "print('profiled')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and "profiled" in result.stdout, result.stderr[-2000:]
    assert "USDT:" not in result.stderr


def test_profile_generation_refuses_an_unfused_model():
    with pytest.raises(ValueError, match="model is not a model with te_lab fusions"):
        te_lab.profile_generation(lambda: None, te_lab.models.llama("tiny"))


def test_te_profile_generation_profiles_prefill_and_decode_and_draws_their_table(capsys):
    pytest.importorskip("IPython")
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    from te_lab.widgets.generation_view import generation_html

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "te_lab")
    try:
        model = te_lab.models.llama("tiny", seed=0).eval()
        prompt = torch.randint(1, 250, (1, 8), generator=torch.Generator().manual_seed(4))
        te_lab.fuse(model, sample={"input_ids": prompt}, progress=False)
        shell.user_ns.update(model=model, prompt=prompt, generate=generation.generate)
        profile = shell.run_line_magic("te_profile", "--generation --steps 1 -o generate(model, model, prompt, 3)")
        assert isinstance(profile, te_lab.GenerationProfile) and profile.runs == 1
        # Without a KV cache every step reruns the sequence: 1 prefill forward, 2 decode forwards of 1 token each.
        assert (profile.phases["prefill"]["fused"].tokens, profile.phases["decode"]["fused"].forwards) == (8, 2)
        assert "ran the statement 6 times" in capsys.readouterr().out  # warm-up, profiled, timed; two modes
        table = generation_html(profile)
        assert table.count("<tr>") == 3 and "<td>prefill</td><td>8</td><td>1</td>" in table
        assert f"<td>{profile.speedup('decode'):.2f}x</td>" in table
        with pytest.raises(UsageError, match="--html is for the training-step dashboard"):
            shell.run_line_magic("te_profile", "--generation --html x.html generate(model, model, prompt, 3)")
    finally:
        shell.run_line_magic("unload_ext", "te_lab")
        InteractiveShell.clear_instance()
