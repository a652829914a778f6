"""--preflight: one iteration of the trainer's own main in a temporary folder, judged by what it logs and leaves.
The toy passes and the real run then starts in the same folder; each injected failure FAILs (or WARNs) its row;
the projection is the measured times multiplied out."""
import json
import math
import os
import subprocess

import pytest
import torch

import common
import flow_grpo
from helpers import SMALL, TRAINERS, flags, own, read_metrics, run, torchrun_cmd

TOY = ["--model", "toy", *SMALL, "--iterations", "3", "--eval-every", "2", "--save-every", "1"]


def preflight(argv: list[str], out, module=flow_grpo) -> tuple[int, dict]:
    """Runs `module` --preflight in this process; returns its exit status and preflight.json."""
    with pytest.raises(common.TrainingStopped) as stop:
        run(module, [*argv, "--output-dir", str(out), "--preflight"])
    return stop.value.exit_code, json.loads((out / "preflight.json").read_text())


def rows(report: dict) -> dict:
    return {r["check"]: r for r in report["rows"]}


def failed(report: dict) -> set:
    return {r["check"] for r in report["rows"] if r["status"] == "FAIL"}


def test_the_toy_passes_then_the_real_run_starts_in_the_same_folder(tmp_path):
    out = tmp_path / "run"
    code, report = preflight(TOY, out)
    assert code == 0 and report["passed"], report["rows"]
    r = rows(report)
    for check in ("toy: finite", "toy: spread over images", "toy: right vs shifted prompts", "ratio_dev_first_update",
                  "clip_frac_first_update", "kl_first_update", "gradients finite", "gradient norm before clipping",
                  "step size, change / weights (L2)", "trained tensors that moved", "checkpoints on disk"):
        assert r[check]["status"] == "PASS", r[check]
    assert sorted(os.listdir(out)) == [".lock", "preflight.json"]  # the temporary run is gone (.lock: the folder
    # lock, which names the last holder)
    m, p = report["measured"], report["projection"]
    assert m["iteration_s"] == report["metrics"]["time_s"] > 0       # from the trained iteration's own line
    assert report["metrics"]["iteration"] == 0 and report["metrics"]["skipped_steps"] == 0
    # by hand: --iterations 3 from 0, evaluations at 0, 2 and 3, checkpoints after 1, 2 and at the end
    assert (p["iterations"], p["evaluations"], p["saves"]) == (3, 3, 3)
    assert p["hours"] == pytest.approx((3 * m["iteration_s"] + 3 * m["eval_s"]) / 3600)
    assert r["checkpoints on disk"]["value"] == f"3 x {p['checkpoint_bytes'] / 2**30:.3f} GiB"

    run(flow_grpo, [*TOY, "--output-dir", str(out)])              # the real run: a fresh start there
    assert [m["iteration"] for m in read_metrics(out)] == [0, 1, 2, 3]
    assert json.loads((out / "args.json").read_text())["preflight"] is False
    saved = sum(f.stat().st_size for f in (out / "checkpoints" / "iter_000003").rglob("*") if f.is_file())
    assert saved == pytest.approx(p["checkpoint_bytes"], rel=0.05)  # the temporary run's checkpoint, as large

    first = (out / "preflight.json").read_text()
    code, _ = preflight([*TOY, "--iterations", "5", "--resume", "auto"], out)  # a second one keeps the first report
    assert code == 0 and (out / "preflight.json").read_text() == first
    report = json.loads((out / "preflight-1.json").read_text())
    r = rows(report)                                              # resumed at 3: the KL to the base is not 0
    assert r["kl_first_update"]["status"] == "-" and r["kl_first_update"]["expected"] == "(resumed)"
    assert report["metrics"]["iteration"] == 3 and report["projection"]["iterations"] == 2
    assert [m["iteration"] for m in read_metrics(out)] == [0, 1, 2, 3]  # nothing trained or logged there


class Blind:
    """Scores the image alone (its brightness), ignoring the prompt."""

    def __init__(self, device="cpu"):
        pass

    def __call__(self, images, prompts, metadata=None):
        return images.mean((1, 2, 3))


class Constant(Blind):
    def __call__(self, images, prompts, metadata=None):
        return torch.zeros(len(images))


@pytest.mark.parametrize("reward,fails,advice", [
    ("blind", {"blind: right vs shifted prompts"}, "the score ignores the prompt"),
    ("const", {"const: spread over images"}, "advantage is zero"),
])
def test_a_reward_that_ignores_the_prompt_or_is_constant_fails(reward, fails, advice, monkeypatch, tmp_path):
    monkeypatch.setitem(common.REWARDS, reward, {"blind": Blind, "const": Constant}[reward])
    code, report = preflight([*TOY, "--reward", reward], tmp_path / "run")
    assert code == 1 and failed(report) == fails, report["rows"]
    assert all(advice in rows(report)[check]["advice"] for check in fails)
    if reward == "const":                           # no spread: whether it reads the prompt cannot be told
        assert rows(report)["const: right vs shifted prompts"]["status"] == "n/a"


def test_a_lora_outside_the_forward_pass_warns_naming_it_and_a_nan_gradient_fails(monkeypatch, tmp_path):
    """A LoRA on a module the forward never calls: its tensors never move, a WARN naming them (the other lora_A
    move in the second optimizer step, once lora_B is not 0). Then a NaN in one tensor's gradient."""
    load = common.load_model

    def with_unused(*args, **kwargs):
        adapter = load(*args, **kwargs)
        adapter.transformer.unused_proj = torch.nn.Linear(4, 4)
        return adapter
    monkeypatch.setattr(common, "load_model", with_unused)
    monkeypatch.setattr(common.ToyAdapter, "lora_targets", ["attn.to_q", "unused_proj"])
    code, report = preflight([*TOY, "--lora-rank", "4", "--lora-alpha", "8"], tmp_path / "lora")
    r = rows(report)["trained tensors that moved"]
    n = int(r["value"].split("/")[1])
    assert code == 0 and not failed(report) and r["status"] == "WARN" and r["value"] == f"{n - 2}/{n}"
    assert r["advice"].startswith("unchanged: unused_proj.lora_A.default.weight, unused_proj.lora_B.default.weight.")

    def nan_gradient(*args, **kwargs):
        adapter = load(*args, **kwargs)
        adapter.transformer.proj_out.weight.register_hook(lambda g: g * math.nan)
        return adapter
    monkeypatch.setattr(common, "load_model", nan_gradient)
    code, report = preflight(TOY, tmp_path / "nan")
    r = rows(report)["gradients finite"]
    assert code == 1 and failed(report) == {"gradients finite"} and r["value"] == "norm nan, 2 step(s) skipped"
    assert "NaN / inf gradients" in r["advice"]
    assert rows(report)["trained tensors that moved"]["value"].startswith("0/")  # both steps were skipped


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_learning_rate_far_too_large_fails_on_the_step_size(trainer, tmp_path):
    fit = flags(own(trainer, "FITS_SMOKE", {}))  # a fork of flow_grpo needs nothing on top
    argv = ["--model", "toy", *SMALL, *fit, "--micro-batch", "2", "--lr", "1"]  # fits all
    code, report = preflight(argv, tmp_path / "run", __import__(trainer))
    r = rows(report)["step size, change / weights (L2)"]
    assert code == 1 and "step size, change / weights (L2)" in failed(report) and "lower --lr" in r["advice"]
    assert float(r["value"]) >= 2 * common.STEP_LIMIT


def test_what_a_method_does_not_log_is_not_applicable(monkeypatch, tmp_path):
    """A trainer that logs no gradient norm (UpdateStats' grad_norm dropped here) gets its gradient rows n/a, and a
    first-update row for each *_first_update key it logs (a method that logs none: tests/test_fork.py)."""
    metrics = common.UpdateStats.metrics
    monkeypatch.setattr(common.UpdateStats, "metrics", lambda self: {
        k: v for k, v in metrics(self).items() if k != "grad_norm"})
    code, report = preflight(TOY, tmp_path / "run")
    r = rows(report)
    assert code == 0 and r["gradients finite"]["status"] == r["gradient norm before clipping"]["status"] == "n/a"
    assert r["ratio_dev_first_update"]["status"] == r["kl_first_update"]["status"] == "PASS"
    assert "first update on-policy" not in r


def test_one_evaluation_image_has_no_spread_to_judge(tmp_path, recwarn):
    """--eval-images 1: the spread over images and the prompt test are n/a (not a FAIL), and nothing warns."""
    code, report = preflight([*TOY, "--eval-images", "1"], tmp_path / "run")
    r = rows(report)
    assert code == 0 and report["passed"] and not failed(report), report["rows"]
    assert r["toy: spread over images"]["status"] == r["toy: right vs shifted prompts"]["status"] == "n/a"
    assert r["toy: finite"]["status"] == "PASS" and not [w for w in recwarn if "degrees of freedom" in str(w.message)]


@pytest.mark.parametrize("clip,fails", [("1e-4", False), ("4e-6", True)])
def test_where_kernels_do_not_reproduce_the_rollout_the_runs_own_clip_range_judges(clip, fails, monkeypatch, tmp_path):
    """On a device with no exact tolerance (a GPU; here ON_POLICY_TOL emptied), every recomputed log-prob shifted by
    1e-5 (a first ratio of exp(1e-5), as kernels that do not reproduce the rollout): the deviation and the KL are
    information, and clip_frac_first_update FAILs where the run's --clip-range is below the deviation (a recipe that
    would clip from its first step), whatever the default clip range."""
    monkeypatch.setattr(common, "ON_POLICY_TOL", {})
    step_loss = flow_grpo.step_loss
    monkeypatch.setattr(flow_grpo, "step_loss", lambda lp, *rest: step_loss(lp + 1e-5, *rest))
    code, report = preflight([*TOY, "--clip-range", clip], tmp_path / "run")
    r = rows(report)
    assert r["ratio_dev_first_update"]["status"] == r["kl_first_update"]["status"] == "-"
    assert float(r["ratio_dev_first_update"]["value"]) == pytest.approx(1e-5, rel=0.01)
    assert r["clip_frac_first_update"]["status"] == ("FAIL" if fails else "PASS") and code == int(fails)
    assert failed(report) == ({"clip_frac_first_update"} if fails else set())


class Broken(Blind):
    def __call__(self, images, prompts, metadata=None):
        raise RuntimeError("the scorer's server answered 503")


def test_a_failing_scorer_writes_the_table_with_its_row(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(common.REWARDS, "broken", Broken)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:                       # run_cli: the command line's exit status
        common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS,
                       [*TOY, "--reward", "broken", "--output-dir", str(out), "--preflight"])
    report = json.loads((out / "preflight.json").read_text())
    r = rows(report)["ran to its end"]
    assert stop.value.code == 1 and failed(report) == {"ran to its end"} and "503" in r["value"]
    assert sorted(os.listdir(out)) == [".lock", "preflight.json"]
    assert "| ran to its end | the reward failed RuntimeError: the scorer's server answered 503 |" in \
        capsys.readouterr().out


def test_a_v_grpo_lora_passes(tmp_path):
    import v_grpo
    code, report = preflight(["--lora-rank", "4", "--lora-alpha", "8"], tmp_path / "r", v_grpo)
    assert code == 0 and not failed(report), report["rows"]


def test_a_preflight_passes_under_torchrun(tmp_path):
    out = tmp_path / "run"
    argv = [*TOY, "--micro-batch", "2", "--reward", "toy-soft", "--output-dir", out, "--preflight"]  # 2 ranks
    proc = subprocess.run(torchrun_cmd("flow_grpo.py", argv), capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and "preflight passed" in proc.stderr, proc.stdout[-3000:] + proc.stderr
    report = json.loads((out / "preflight.json").read_text())
    assert not failed(report) and rows(report)["ranks x device"]["value"].startswith("2 x CPU, threads 1")
    assert sorted(os.listdir(out)) == [".lock", "preflight.json"]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_flag_the_method_refuses_leaves_nothing_with_or_without_preflight(trainer, tmp_path, capsys, monkeypatch):
    """The method's own checks (a --prompts file, --micro-batch, --sde-window, ...) run before --preflight
    claims a run folder, as before a run does: one line, and neither --output-dir nor a default runs/ folder."""
    import importlib
    module = importlib.import_module(trainer)
    monkeypatch.chdir(tmp_path)
    bad = [["--prompts", str(tmp_path / "missing.txt")]] + {
        "flow_grpo": [["--sde-window", "99"], ["--micro-batch", "3"]], "pro_grpo": [["--funnel", "8,9"]],
        "v_grpo": [["--micro-batch", "3"]], "g2rpo": [["--granularities", "0"]]}.get(trainer, [["--micro-batch", "3"]])
    for flags_ in bad:
        for out in (["--output-dir", str(tmp_path / "new")], []):
            for preflight_ in (["--preflight"], []):
                with pytest.raises(SystemExit) as stop:
                    common.run_cli(module.main, module.Args, module.MODEL_DEFAULTS,
                                   ["--model", "toy", *SMALL, *flags_, *out, *preflight_])
                err = capsys.readouterr().err
                assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, (flags_, out, preflight_, err)
                assert os.listdir(tmp_path) == [], (flags_, out, preflight_, os.listdir(tmp_path))


def test_a_preflight_run_folder_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, capsys):
    """Before: the temporary run wrote its .lock, args.json and metrics.jsonl through the link into its target."""
    out, target = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    target.mkdir()
    (target / "kept").write_text("kept")
    (out / ".preflight-run").symlink_to(target)
    with pytest.raises(SystemExit) as stop:
        common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS, [*TOY, "--output-dir", str(out),
                                                                                  "--preflight"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and err.endswith(
        f": error: {out / '.preflight-run'} is a link: remove it (--preflight runs in a folder of that name, then "
        f"deletes it)\n"), err
    assert os.listdir(target) == ["kept"] and sorted(os.listdir(out)) == [".lock", ".preflight-run"]
