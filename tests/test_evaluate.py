"""`python common.py evaluate` scores a checkpoint exactly as the trainer's own evaluation did (same prompts, seeds
and weights: the EMA weights when the run kept an EMA), the base model as the iteration-0 evaluation did, under
torchrun as in one process; and it writes a labelled grid with the two models side by side."""
import json
import math

import pytest
from PIL import Image

import common
import flow_grpo
from helpers import SMALL, read_metrics, run, small, tiny_argv, torchrun

# the toy reward is a multiple of 1/(2n): a continuous second reward tells base and trained weights apart
TOY = ["--reward", "toy,jpeg:0.01", "--iterations", "2", "--lr", "3e-3", *small(without=("eval_images", "eval_every")),
       "--eval-images", "12", "--eval-every", "2"]


def logged(values: dict, line: dict):
    """The evaluate numbers against a metrics.jsonl line (rounded to 6 decimals by the logger)."""
    for key, value in line.items():
        if key.startswith("eval_"):
            assert values[key] == pytest.approx(value, abs=2e-6), key


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy") / "run"
    run(flow_grpo, [*TOY, "--output-dir", str(out)])
    return out


def test_base_and_checkpoint_equal_the_trainers_own_evaluations(toy_run, tmp_path):
    first, last = read_metrics(toy_run)[0], read_metrics(toy_run)[-1]
    assert {"eval_toy", "eval_jpeg", "eval_reward_se", "eval_toy_se", "reward_toy", "reward_jpeg"} <= {*first, *last}
    results = common.evaluate_main(["--checkpoint", "base", "--checkpoint", str(toy_run), "--model", "toy",
                                    "--output", str(tmp_path / "eval"), "--threads", "1"])
    logged(results["base"], first)                           # iteration 0 is evaluated before any update
    logged(results[str(toy_run)], last)
    assert results["base"]["eval_jpeg"] != results[str(toy_run)]["eval_jpeg"]
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert saved["results"] == results and saved["steps"] == 4 and saved["images"] == 12 and saved["seed"] == 0
    # one row per held-out prompt (10 toy pairs), each with both models' images of that prompt side by side
    grid = Image.open(tmp_path / "eval" / "grid.png")
    assert grid.height >= 10 * 128 and grid.width >= 200 + 2 * 2 * 128


def test_standard_errors_by_hand(toy_run, tmp_path, monkeypatch):
    """The standard error is the sample std over images / sqrt(n): recompute it from the per-image scores."""
    seen = []
    real = common.WeightedReward.__call__

    def spy(self, images, prompts, metadata=None, batch_size=None):
        total, parts = real(self, images, prompts, metadata, batch_size)
        seen.append(parts["jpeg"])
        return total, parts
    monkeypatch.setattr(common.WeightedReward, "__call__", spy)
    results = common.evaluate_main(["--checkpoint", str(toy_run), "--output", str(tmp_path / "e"), "--threads", "1",
                                    "--batch-size", "5"])[str(toy_run)]
    import torch
    jpeg = torch.cat(seen).double()
    assert len(jpeg) == 12
    assert results["eval_jpeg"] == pytest.approx(jpeg.mean().item(), rel=1e-9)
    assert results["eval_jpeg_se"] == pytest.approx(jpeg.std().item() / math.sqrt(12), rel=1e-6)


def test_a_lora_checkpoint_with_ema_on_a_tiny_pipeline(tmp_path):
    out = tmp_path / "run"
    run(flow_grpo, [*tiny_argv("flow_grpo", "sd3"), "--ema", "--iterations", "4", "--lr", "0.05", *SMALL,
                    "--updates-per-rollout", "2",
                    "--output-dir", str(out)])
    results = common.evaluate_main(["--checkpoint", str(out), "--output", str(tmp_path / "eval"), "--threads", "1"])
    first, last = read_metrics(out)[0], read_metrics(out)[-1]
    assert abs(first["eval_reward"] - last["eval_reward"]) > 1e-4  # the LoRA moved the evaluation: it must load
    logged(results[str(out)], last)


def test_evaluate_under_torchrun_equals_one_process(toy_run, tmp_path):
    one = common.evaluate_main(["--checkpoint", str(toy_run), "--output", str(tmp_path / "one"), "--threads", "1"])
    torchrun("common.py", ["evaluate", "--checkpoint", toy_run, "--output", tmp_path / "two", "--threads", "1"])
    two = json.loads((tmp_path / "two" / "results.json").read_text())["results"]
    assert two[str(toy_run)] == pytest.approx(one[str(toy_run)], abs=1e-9)


def test_bad_input_is_one_line_before_any_model_loads(toy_run, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("kept")
    for argv, message in [
        (["--threads", "1"], "pass --model for the base model"),
        (["--checkpoint", str(tmp_path)], "no checkpoint there"),
        (["--checkpoint", str(toy_run), "--model", "sd3"], "different models"),
        (["--checkpoint", str(toy_run), "--output", str(tmp_path / "full")], "is not empty"),
        (["--checkpoint", str(toy_run), "--reward", "nope"], "unknown or repeated reward 'nope'"),
    ]:
        with pytest.raises(SystemExit) as e:
            common.evaluate_main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err, argv
    assert (tmp_path / "full" / "x").read_text() == "kept"
