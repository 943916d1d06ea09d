"""``python -m compiled_psg train``: a very short run writes its metrics JSON and its plot."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cli_runs import keep_threads, read_outputs  # noqa: F401 (keep_threads: autouse)

from compiled_psg.__main__ import main

QUICK = ["--epochs", "2", "--train-subset", "300", "--batch-size", "64", "--backend", "eager"]


def test_train_dp_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--epsilon", "4", "--out", str(out)]) == 0
    metrics = read_outputs(out, "accuracy.png")
    assert [r["epoch"] for r in metrics["epochs"]] == [1, 2]
    for row in metrics["epochs"]:
        assert 0 <= row["test_accuracy"] <= 1 and row["samples_per_second"] > 0 and row["compile_seconds"] > 0
    final = metrics["final"]
    assert final["epsilon"] <= 4.0 and final["epsilon"] > 3.5  # sigma calibrated for exactly these 2 epochs
    assert final["captures"] == 1 and final["program_builds"] == 1 and final["programs_per_step"] == 1
    assert final["wall_seconds"] > 0
    assert metrics["mechanism"]["noise_multiplier"] > 0 and metrics["dataset"]["train"] == 300
    assert metrics["mechanism"]["sample_rate"] == pytest.approx(64 / 300)
    text = capsys.readouterr().out
    assert "epoch   2  test acc" in text and "samples/s" in text and "compile" in text  # per-epoch lines
    assert "final: test accuracy" in text


def test_train_with_secure_noise(tmp_path):
    """``--secure-rng`` draws the noise and the coins from os.urandom: the job's seeded generator is not passed
    along (make_private refuses a generator it would ignore)."""
    out = tmp_path / "secure"
    assert main(["train", *QUICK[2:], "--epochs", "1", "--epsilon", "4", "--secure-rng", "--no-progress",
                 "--out", str(out)]) == 0
    metrics = read_outputs(out, "accuracy.png")
    assert 0 < metrics["final"]["epsilon"] <= 4.0 and metrics["final"]["captures"] == 1


def test_train_no_dp_baseline(tmp_path):
    out = tmp_path / "baseline"
    assert main(["train", *QUICK, "--no-dp", "--no-progress", "--optimizer", "adam", "--lr", "0.01",
                 "--out", str(out)]) == 0
    metrics = read_outputs(out, "accuracy.png")
    assert metrics["final"]["epsilon"] is None and metrics["mechanism"]["noise_multiplier"] == 0.0
    # red team Q2: the DP flags' defaults and Adam's unused momentum were recorded as settings of the run
    assert all(metrics["config"][k] is None for k in ("epsilon", "delta", "max_grad_norm", "accountant", "momentum"))
    assert metrics["mechanism"]["delta"] is None and metrics["final"]["delta"] is None
    assert metrics["final"]["test_accuracy"] > 0.5  # 2 epochs of plain Adam already learn something


def test_module_entry_point_help():
    result = subprocess.run([sys.executable, "-m", "compiled_psg", "train", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "--epsilon" in result.stdout and "--no-dp" in result.stdout
    result = subprocess.run([sys.executable, "-m", "compiled_psg"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0 and "train" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "0"], "argument --epochs: must be a positive int, got 0"),
    (["--epochs", "-1"], "argument --epochs: must be a positive int, got -1"),
    (["--train-subset", "-5"], "argument --train-subset: must be a positive int, got -5"),
    (["--threads", "-1"], "argument --threads: must be an int >= 0, got -1"),
    (["--epsilon", "0"], "argument --epsilon: must be a positive finite number, got 0.0"),
    (["--out", "/proc/x"], "argument --out: cannot create the folder /proc/x"),
    (["--epsilon", "1e9", "--epochs", "1", "--train-subset", "100"], "target_epsilon=1000000000.0 is met even"),
    (["--delta", "0"], "argument --delta: must be a number in (0, 1), got 0.0"),
    (["--delta", "nan"], "argument --delta: must be a number in (0, 1), got nan"),
    (["--lr", "-0.1"], "argument --lr: must be a positive finite number, got -0.1"),
    (["--momentum", "1"], "argument --momentum: must be a number in [0, 1), got 1.0"),
    (["--seed", "-1"], "argument --seed: must be an int in [0, 2**32 - 1], got -1"),
    (["--train-subset", "5000"], "argument --train-subset: 5000 is more than the 1437 training examples"),
    (["--train-subset", "100", "--batch-size", "101"], "argument --batch-size: 101 is more than the 100 training"),
])
def test_bad_values_are_one_line_usage_errors(flags, message, tmp_path, capsys):
    """Each of these ended in a traceback (dp-accounting's "count must be positive", a ZeroDivisionError,
    NoBracketIntervalFoundError, a FileNotFoundError after the whole run, torch's "Invalid learning rate",
    scikit-learn's InvalidParameterError for the seed) or, for --train-subset -5 and --momentum 1, ran a full
    training. Each is now argparse's usage error: one line, exit code 2, before the training."""
    _assert_usage_error(flags, message, tmp_path, capsys)


def _assert_usage_error(flags: list[str], message: str, tmp_path, capsys) -> None:
    """``train`` with ``flags`` is argparse's one-line usage error ``message``, exit code 2, before any training."""
    with pytest.raises(SystemExit) as info:
        main(["train", "--out", str(tmp_path / "run"), *flags, "--backend", "eager", "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"compiled-psg train: error: {message}" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_explain_save_to_a_folder_that_cannot_be_created_is_a_usage_error(capsys):
    """--save /proc/x/y wrote the report to stdout and then raised FileNotFoundError."""
    with pytest.raises(SystemExit) as info:
        main(["explain", "seed_cnn", "--save", "/proc/x/y"])
    assert info.value.code == 2 and "argument --save: cannot create the folder /proc/x/y" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--no-dp", "--epsilon", "3"], "argument --epsilon: has no effect with --no-dp"),
    (["--no-dp", "--sigma", "1"], "argument --sigma: has no effect with --no-dp"),
    (["--no-dp", "--accountant", "rdp"], "argument --accountant: has no effect with --no-dp"),  # the default
    (["--no-dp", "--max-grad-norm", "2"], "argument --max-grad-norm: has no effect with --no-dp"),
    (["--no-dp", "--secure-rng"], "argument --secure-rng: has no effect with --no-dp"),
    (["--sigma", "1", "--epsilon", "3"], "argument --epsilon: has no effect with --sigma"),
    (["--optimizer", "adam", "--momentum", "0.5"], "argument --momentum: has no effect with --optimizer adam"),
    (["--optimizer", "adamw", "--momentum", "0.9"], "argument --momentum: has no effect with --optimizer adamw"),
])
def test_flags_that_would_do_nothing_are_usage_errors(flags, message, tmp_path, capsys):
    """A flag the others make do nothing (``--momentum`` with Adam, anything DP with ``--no-dp``) was silently
    ignored, and ``metrics.json`` recorded it as a setting of the run."""
    _assert_usage_error(flags, message, tmp_path, capsys)


def test_an_infinite_epsilon_of_a_private_run_is_not_called_non_private(tmp_path, capsys):
    """``--sigma 1e-300`` printed ``sigma=0.000`` and ``epsilon inf (non-private)``, and the plot's axis said
    non-private: the run was private with a noise too small for a finite bound."""
    out = tmp_path / "tiny"
    assert main(["train", "--epochs", "1", "--train-subset", "64", "--batch-size", "64", "--sigma", "1e-300",
                 "--backend", "eager", "--no-progress", "--out", str(out)]) == 0
    metrics = read_outputs(out, "accuracy.png")
    assert metrics["mechanism"]["private"] is True and metrics["mechanism"]["noise_multiplier"] == 1e-300
    assert metrics["final"]["epsilon"] is None  # JSON has no infinity
    assert "given" not in metrics["config"] and metrics["config"]["sigma"] == 1e-300
    assert metrics["config"]["epsilon"] is None and metrics["config"]["momentum"] == 0.9  # not targeted; SGD's
    text = capsys.readouterr().out
    assert "sigma=1e-300" in text and "epsilon inf (the noise is too small for a finite bound)" in text
