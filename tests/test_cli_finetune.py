"""``python -m compiled_psg finetune``: a very short run (tiny model, a few steps) writes its metrics JSON and its
plot, with finite perplexities and a finite epsilon; without transformers/peft it says how to install them."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from cli_runs import keep_threads, read_outputs  # noqa: F401 (keep_threads: autouse)

from compiled_psg.__main__ import main

pytest.importorskip("transformers")
pytest.importorskip("peft")

# one layer, hidden 32: the capture of the LoRA model dominates the run time
QUICK = ["--steps", "3", "--pretrain-steps", "3", "--layers", "1", "--hidden", "32", "--seq-len", "32",
         "--batch-size", "16", "--evals", "1", "--no-progress"]


@pytest.mark.long
def test_finetune_dp_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["finetune", *QUICK, "--epsilon", "4", "--out", str(out)]) == 0
    metrics = read_outputs(out, "perplexity.png")
    final = metrics["final"]
    assert final["steps"] == 3 and metrics["pretrain"]["steps"] == 3
    for key in ("perplexity_before", "perplexity_after"):
        # a byte-level model: between 1 and the vocabulary size for any sane model near its initialization
        assert math.isfinite(final[key]) and 1 < final[key] < 1000, (key, final[key])
    assert final["perplexity_before"] != final["perplexity_after"]  # the LoRA weights moved
    assert math.isfinite(final["epsilon"]) and 3.0 < final["epsilon"] <= 4.0  # sigma calibrated for these 3 steps
    assert metrics["mechanism"]["noise_multiplier"] > 0 and metrics["mechanism"]["max_grad_norm"] == 1.0
    assert 0 < metrics["model"]["trained_parameters"] < metrics["model"]["base_parameters"]  # LoRA only
    corpus = metrics["corpus"]
    assert corpus["private_train_windows"] > 100 and corpus["private_test_windows"] > 10
    assert not set(corpus["public_modules"]) & set(corpus["private_modules"])
    assert [r["step"] for r in metrics["history"]] == [0, 3]
    text = capsys.readouterr().out
    assert "perplexity before fine-tuning" in text and "final: held-out perplexity" in text and "epsilon" in text


def test_finetune_without_hf_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(SystemExit, match=r'pip install -e "\.\[hf\]"'):
        main(["finetune", *QUICK, "--out", str(tmp_path)])


@pytest.mark.parametrize("flags, message", [
    (["--lora-rank", "0"], "argument --lora-rank: must be a positive int, got 0"),
    (["--lora-rank", "-2"], "argument --lora-rank: must be a positive int, got -2"),
    (["--hidden", "12"], "argument --hidden: must be a positive multiple of 8, got 12"),
    (["--layers", "0"], "argument --layers: must be a positive int, got 0"),
    (["--seq-len", "1"], "argument --seq-len: must be an int >= 2, got 1"),
    (["--pretrain-steps", "-1"], "argument --pretrain-steps: must be an int >= 0, got -1"),
    (["--pretrain-batch-size", "0"], "argument --pretrain-batch-size: must be a positive int, got 0"),
    (["--pretrain-lr", "-1"], "argument --pretrain-lr: must be a positive finite number, got -1.0"),
    (["--lr", "inf"], "argument --lr: must be a positive finite number, got inf"),
    (["--momentum", "-0.5"], "argument --momentum: must be a number in [0, 1), got -0.5"),
    (["--evals", "-1"], "argument --evals: must be an int >= 0, got -1"),
    (["--delta", "1"], "argument --delta: must be a number in (0, 1), got 1.0"),
    (["--seed", "4294967296"], "argument --seed: must be an int in [0, 2**32 - 1], got 4294967296"),
    (["--seq-len", "10000000"], "argument --seq-len: 10000000 bytes is longer than the held-out text"),
    (["--pretrain-steps", "0", "--pretrain-lr", "0.1"], "argument --pretrain-lr: has no effect with --pretrain-steps"),
    (["--no-dp", "--delta", "1e-6"], "argument --delta: has no effect with --no-dp"),
    (["--sigma", "1", "--epsilon", "2"], "argument --epsilon: has no effect with --sigma"),
    (["--momentum", "0.5"], "argument --momentum: has no effect with --optimizer adam"),  # Adam: the default
    (["--batch-size", "100000"], "argument --batch-size: 100000 is more than the"),
])
def test_bad_values_are_one_line_usage_errors(flags, message, tmp_path, capsys):
    """Each ended in a traceback (peft's ValueError for r=0 after the pre-training, transformers' validation
    of the width, a NaN loss or a ZeroDivisionError for windows with nothing to predict, torch's "Invalid learning
    rate") or ran on (--lr inf into NaN weights, --evals -1, --momentum -0.5 with the default Adam, which ignores
    it). Each is now argparse's usage error naming the flag: one line, exit code 2, before any training."""
    with pytest.raises(SystemExit) as info:
        main(["finetune", *QUICK, "--out", str(tmp_path / "run"), *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"compiled-psg finetune: error: {message}" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_lora_llama_per_sample_gradients_exact():
    """What the job trains: LoRA on a byte-level Llama built by the job, per-sample gradients against the loop."""
    import warnings

    import peft
    import transformers
    from reference import reference_per_sample

    import compiled_psg as psg
    from compiled_psg._jobs.finetune import build_model, build_parser

    torch.manual_seed(0)
    args = build_parser().parse_args(QUICK)
    base = build_model(args, transformers)
    with warnings.catch_warnings():  # peft calls a method that transformers 5 deprecated
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, where A's gradient vanishes: move off it
            torch.nn.init.normal_(p, std=0.1)
    model.double()
    x = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0))

    def loss(x):
        return model(input_ids=x, labels=x).loss

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert params and all("lora_" in n for n in params)
    got = psg.per_sample(model, backend="eager")(loss)(x)
    ref = reference_per_sample(loss, params, (x,))
    assert set(got) == set(ref)
    for name, r in ref.items():
        assert r.abs().sum() > 0, name
        torch.testing.assert_close(got[name], r, rtol=1e-7, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")
