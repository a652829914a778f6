"""--preflight: the toy passes every check, each injected failure FAILs with its advice and exit 1, the projection
is the measured times multiplied out, and the real run then starts in the same folder."""
import json
import math
import os
import re
import subprocess

import pytest
import torch

import common
import flow_grpo
from helpers import ROOT, SMALL, read_metrics, run, tiny_argv, torchrun_cmd

TOY = ["--model", "toy", *SMALL, "--iterations", "3", "--eval-every", "2", "--save-every", "1"]


def preflight(argv: list[str], out) -> tuple[int, dict]:
    """Runs flow_grpo --preflight in this process; returns its exit status and preflight.json."""
    with pytest.raises(common.TrainingStopped) as stop:
        run(flow_grpo, [*argv, "--output-dir", str(out), "--preflight"])
    return stop.value.exit_code, json.loads((out / "preflight.json").read_text())


def rows(report: dict) -> dict:
    return {r["check"]: r for r in report["rows"]}


def failed(report: dict) -> set:
    return {r["check"] for r in report["rows"] if r["status"] == "FAIL"}


def test_the_toy_passes_then_the_real_run_starts_in_the_same_folder(tmp_path):
    out = tmp_path / "run"
    code, report = preflight(TOY, out)
    assert code == 0 and report["passed"] and not failed(report), report["rows"]
    r = rows(report)
    for check in ("weights identical on all ranks", "toy: right vs shifted prompts", "first update max abs(ratio - 1)",
                  "first update KL", "gradients finite", "tensors with a gradient", "parameters moved",
                  "one step's size: max abs(ratio - 1)", "one step's size: approx KL",
                  "gradient norm before clipping (largest)"):
        assert r[check]["status"] == "PASS", r[check]
    assert sorted(os.listdir(out)) == [".lock", "preflight.json"]  # no args.json, metrics or checkpoint (.lock: the
    # folder lock, which names the last holder)
    m, p = report["measured"], report["projection"]
    assert m["overhead"] >= 0.99                                  # model calls are a part of the iteration
    # by hand: --iterations 3 from 0, evaluations at 0, 2 and 3, checkpoints after 1, 2 and at the end
    assert (p["iterations"], p["evaluations"], p["saves"]) == (3, 3, 3)
    assert p["hours"] == pytest.approx((3 * m["iteration_s"] + 3 * m["eval_s"]) / 3600)
    assert p["disk_bytes"] == 3 * p["checkpoint_bytes"]

    run(flow_grpo, [*TOY, "--output-dir", str(out)])              # the real run: a fresh start there
    assert [m["iteration"] for m in read_metrics(out)] == [0, 1, 2, 3]
    assert json.loads((out / "args.json").read_text())["preflight"] is False
    saved = sum(f.stat().st_size for f in (out / "checkpoints" / "iter_000003").rglob("*") if f.is_file())
    assert saved == pytest.approx(p["checkpoint_bytes"], rel=0.05)  # the estimate is the size written

    code, _ = preflight([*TOY, "--resume", "auto"], out)          # a second one keeps the first report
    assert code == 0 and (out / "preflight-1.json").exists()


class Blind:
    """Reads the prompt, says so, but scores the image alone (its brightness)."""
    reads_prompt = True

    def __init__(self, device="cpu"):
        pass

    def __call__(self, images, prompts, metadata=None):
        return images.mean((1, 2, 3))


class Constant(Blind):
    reads_prompt = False

    def __call__(self, images, prompts, metadata=None):
        return torch.zeros(len(images))


@pytest.mark.parametrize("reward,fails,advice", [
    ("blind", {"blind: right vs shifted prompts"}, "the score ignores the prompt"),
    ("const", {"const: spread over images", "groups with all rewards equal"}, "advantage"),
])
def test_a_reward_that_ignores_the_prompt_or_is_constant_fails(reward, fails, advice, monkeypatch, tmp_path):
    monkeypatch.setitem(common.REWARDS, reward, {"blind": Blind, "const": Constant}[reward])
    code, report = preflight([*TOY, "--reward", reward], tmp_path / "run")
    assert code == 1 and failed(report) == fails
    assert all(advice in rows(report)[check]["advice"] for check in fails)


def test_a_lora_outside_the_forward_pass_and_a_nonfinite_gradient_fail(monkeypatch, tmp_path):
    """A LoRA on a module the forward never calls: its B gets no gradient (a fresh LoRA's A gets none while B is 0,
    which passes); then a NaN in one tensor's gradient."""
    load = common.load_model

    def with_unused(*args, **kwargs):
        adapter = load(*args, **kwargs)
        adapter.transformer.unused_proj = torch.nn.Linear(4, 4)
        return adapter
    monkeypatch.setattr(common, "load_model", with_unused)
    monkeypatch.setattr(common.ToyAdapter, "lora_targets", ["attn.to_q", "unused_proj"])
    code, report = preflight([*TOY, "--lora-rank", "4", "--lora-alpha", "8"], tmp_path / "lora")
    r = rows(report)["tensors with a gradient"]
    n = int(r["value"].split("/")[1].split()[0])      # unused_proj's A: exempt while its B, which nothing reaches, is 0
    assert code == 1 and failed(report) == {"tensors with a gradient"}
    assert r["value"] == f"{n - 1}/{n} (1 lora_A exempt while lora_B = 0)"
    assert "no gradient reaches unused_proj.lora_B" in r["advice"] and "the LoRA targets" in r["advice"]

    def nan_gradient(*args, **kwargs):
        adapter = load(*args, **kwargs)
        adapter.transformer.proj_out.weight.register_hook(lambda g: g * math.nan)
        return adapter
    monkeypatch.setattr(common, "load_model", nan_gradient)
    code, report = preflight(TOY, tmp_path / "nan")
    r = rows(report)["gradients finite"]
    n = int(r["value"].split("/")[1])
    assert code == 1 and failed(report) == {"gradients finite", "parameters moved"} and r["value"] == f"{n - 1}/{n}"
    assert "NaN / inf gradients" in r["advice"]


def test_a_learning_rate_that_blows_the_model_up_fails_on_the_step_size(tmp_path):
    """--lr 1: the second optimizer step scores its micro-batches after a first step that wrecked the policy."""
    code, report = preflight([*TOY, "--lr", "1"], tmp_path / "run")
    r = rows(report)
    assert code == 1 and {"one step's size: max abs(ratio - 1)", "one step's size: approx KL"} <= failed(report)
    assert float(r["one step's size: approx KL"]["value"]) > 1e3 and "lower --lr" in r["one step's size: approx KL"][
        "advice"]
    assert r["gradient norm before clipping (largest)"]["status"] == "WARN"


def test_the_sd3_lora_passes_every_gradient_row_naming_the_tensor_no_loss_reaches(tmp_path):
    """SD3's last joint block is context_pre_only: the text stream's output is dropped, so the LoRA on its context
    query gets an exactly zero gradient from any loss. The probe finds it; nothing else is exempt."""
    argv = [*tiny_argv("flow_grpo", "sd3"), "--iterations", "1", "--eval-every", "1", "--lora-rank", "4"]
    code, report = preflight(argv, tmp_path / "run")
    r = rows(report)
    assert r["tensors with a gradient"]["status"] == "PASS", r["tensors with a gradient"]
    assert re.fullmatch(r"(\d+)/\1 \(1 cannot get one: transformer_blocks\.(\d+)\.attn\.add_q_proj\.lora_B.*\)",
                        r["tensors with a gradient"]["value"]), r["tensors with a gradient"]
    assert {"gradients finite", "tensors with a gradient", "parameters moved"}.isdisjoint(failed(report))


def test_a_v_grpo_lora_on_the_toy_counts_the_gradients_of_the_whole_iteration(tmp_path):
    """v_grpo's first optimizer step can hold only tied groups (no gradient at all); the iteration's others do."""
    import v_grpo
    with pytest.raises(common.TrainingStopped) as stop:
        run(v_grpo, ["--lora-rank", "4", "--lora-alpha", "8", "--output-dir", str(tmp_path / "r"), "--preflight"])
    report = json.loads((tmp_path / "r" / "preflight.json").read_text())
    assert stop.value.exit_code == 0 and rows(report)["tensors with a gradient"]["value"] == "60/60"


class Broken(Blind):
    def __call__(self, images, prompts, metadata=None):
        raise RuntimeError("the scorer's server answered 503")


def test_a_failing_scorer_writes_the_table_with_its_row(monkeypatch, tmp_path):
    monkeypatch.setitem(common.REWARDS, "broken", Broken)
    code, report = preflight([*TOY, "--reward", "broken"], tmp_path / "run")
    r = rows(report)["rewards scored"]
    assert code == 1 and failed(report) == {"rewards scored"} and "503" in r["value"]
    assert rows(report)["weights identical on all ranks"]["status"] == "PASS"   # the rows before it


class BrokenInTheRollout(Blind):
    def __call__(self, images, prompts, metadata=None):
        if hasattr(common.Preflight.active, "unreachable"):        # the measured iteration has begun
            raise RuntimeError("the scorer's server answered NaN")
        return images.mean((1, 2, 3))


def test_a_scorer_failing_in_the_measured_iteration_writes_the_table_too(monkeypatch, tmp_path):
    monkeypatch.setitem(common.REWARDS, "broken", BrokenInTheRollout)
    with pytest.raises(SystemExit) as stop:                       # run_cli: the failure reaches TrainingLoop
        common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS,
                       [*TOY, "--reward", "broken", "--output-dir", str(tmp_path / "run"), "--preflight"])
    report = json.loads((tmp_path / "run" / "preflight.json").read_text())
    assert stop.value.code == 1 and failed(report) == {"rewards scored", "broken: right vs shifted prompts"}
    assert "NaN" in rows(report)["rewards scored"]["value"] and "images finite" in rows(report)


def test_a_checkpoint_slower_than_the_launchers_grace_warns_with_the_flag_to_pass(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "0.001")
    code, report = preflight(TOY, tmp_path / "run")
    r = rows(report)["signal to checkpoint, s (worst)"]
    assert code == 0 and r["status"] == "WARN" and "--shutdown-timeout" in r["advice"] and "--signal=TERM@" in r[
        "advice"]
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "3600")
    code, report = preflight(TOY, tmp_path / "run2")
    assert rows(report)["signal to checkpoint, s (worst)"]["status"] == "PASS"


WRAPPER = """import os, sys
sys.path.insert(0, {root!r})
import torch
import common, flow_grpo
load = common.load_model
def other_weights(*args, **kwargs):
    adapter = load(*args, **kwargs)
    if os.environ["RANK"] == "1":
        with torch.no_grad():
            next(adapter.text_encoder.parameters()).add_(0.01)
    return adapter
common.load_model = other_weights
common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS)
"""


def test_a_rank_with_other_weights_fails_under_torchrun(tmp_path):
    script = tmp_path / "other_weights.py"
    script.write_text(WRAPPER.format(root=str(ROOT)))
    out = tmp_path / "run"
    argv = [*TOY, "--micro-batch", "2", "--reward", "toy-soft", "--output-dir", out, "--preflight"]  # 2 ranks
    proc = subprocess.run(torchrun_cmd(script, argv), capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1 and "preflight FAILED 1 check(s)" in proc.stderr, proc.stdout[-3000:] + proc.stderr
    report = json.loads((out / "preflight.json").read_text())
    assert failed(report) == {"weights identical on all ranks"}
    assert rows(report)["replicas agree after the update"]["status"] == "PASS"   # DDP broadcast the transformer
    assert "FAIL weights identical on all ranks: a rank loaded other weights" in proc.stdout
    assert rows(report)["ranks x device"]["value"].startswith("2 x CPU")


def test_the_readme_gives_the_base_model_ranges_the_check_uses():
    text = (ROOT / "README.md").read_text()
    table = dict(re.findall(r"^\| `(\w+)` \|[^|]*\| ([\d.]+ - [\d.]+) \|", text, re.M))
    assert table == {k: f"{lo:g} - {hi:g}" for k, (lo, hi) in common.BASE_RANGES.items()}

