"""`python common.py evaluate` scores a checkpoint exactly as the trainer's own evaluation did (same prompts, seeds
and weights: the EMA weights when the run kept an EMA), the base model as the iteration-0 evaluation did, under
torchrun as in one process; and it writes a labelled grid with the two models side by side."""
import dataclasses
import importlib
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from PIL import Image

import common
import flow_grpo
from helpers import ROOT, SMALL, TRAINERS, read_metrics, run, small, tiny_argv, tiny_pipeline, torchrun

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
    latest = toy_run / "checkpoints" / "iter_000002"
    assert saved["checkpoints"] == {"base": None, str(toy_run): str(latest.resolve())}
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
    """11 images in batches of 5: rank 1 has 5, so its second batch only pads the collective calls (the reward's)."""
    images = ["--images", "11", "--batch-size", "5", "--threads", "1"]
    one = common.evaluate_main(["--checkpoint", str(toy_run), "--output", str(tmp_path / "one"), *images])
    torchrun("common.py", ["evaluate", "--checkpoint", toy_run, "--output", tmp_path / "two", *images])
    two = json.loads((tmp_path / "two" / "results.json").read_text())["results"]
    assert two[str(toy_run)] == pytest.approx(one[str(toy_run)], abs=1e-9)


def damaged(run_dir, tmp_path, name: str, file: str, data: bytes | None = None):
    """A copy of run_dir named `name` whose latest checkpoint's `file` is cut to half (or replaced by `data`)."""
    copy = tmp_path / name
    shutil.copytree(run_dir, copy)
    path = next((copy / "checkpoints").glob("iter_*")) / file
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2] if data is None else data)
    return str(copy)


def test_bad_input_is_one_line_before_any_model_loads(toy_run, tmp_path, capsys, monkeypatch):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("kept")
    (tmp_path / "a_file").write_text("kept")
    latest = str(toy_run / "checkpoints" / "iter_000002")
    monkeypatch.setattr(common, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for argv, message in [
        (["--threads", "1"], "pass --model for the base model"),
        (["--checkpoint", str(tmp_path)], "no checkpoint there"),
        (["--checkpoint", str(toy_run), "--model", "sd3"], "different models"),
        (["--checkpoint", str(toy_run), "--output", str(tmp_path / "full")], "is not empty"),
        (["--checkpoint", str(toy_run), "--output", str(tmp_path / "a_file")], "--output " + str(tmp_path / "a_file")
         + " is a file: pass a new folder"),
        (["--checkpoint", str(toy_run), "--output", "/proc/x"], "cannot write to --output /proc/x"),
        (["--checkpoint", str(toy_run), "--reward", "nope"], "unknown or repeated reward 'nope'"),
        (["--checkpoint", str(toy_run), "--checkpoint", latest], f"--checkpoint {toy_run} and --checkpoint {latest} "
                                                                  f"are the same model"),
        (["--model", "sd3", "--checkpoint", "base", "--checkpoint", "base"], "are the same model"),
        (["--model", "flux", "--reward", "toy"], "scores the toy world's shapes, not flux images"),
        (["--model", "sd3", "--model-path", "/nonexistent"], "--model-path /nonexistent does not exist"),
        (["--checkpoint", str(toy_run), "--guidance-scale", "nan"], "--guidance-scale nan must be at least 0 (it is "
                                                                      "not a number)"),
        (["--checkpoint", str(toy_run), "--seed", "-1"], "--seed -1 must be at least 0"),
        (["--checkpoint", str(toy_run), "--steps", "100000000"], "--steps 100000000 must be at least 1 and at most "
                                                                   "1000"),
        (["--checkpoint", str(toy_run), "--images", "1000000"], "--images 1000000 must be at least 1 and at most "
                                                                "100000"),
        (["--checkpoint", str(toy_run), "--batch-size", "0"], "--batch-size 0 must be at least 1"),
        (["--checkpoint", str(toy_run), "--threads", "5000"], "--threads 5000 must be at least 1 and at most 1024"),
        (["--checkpoint", str(toy_run), "--steps", "x"], "argument --steps: invalid int value: 'x'"),
        (["--checkpoint", damaged(toy_run, tmp_path, "corrupt", "checkpoint.json")],
         "iter_000002 is not a checkpoint this code wrote: checkpoint.json does not read (JSONDecodeError: "),
        (["--checkpoint", damaged(toy_run, tmp_path, "unknown", "checkpoint.json", b'{"model": "sdxl", '
                                  b'"iteration": 2}')], "iter_000002 is not a checkpoint this code wrote: "
                                                        "checkpoint.json has no sha256; pass another checkpoint"),
        (["--checkpoint", damaged(toy_run, tmp_path, "edited", "checkpoint.json", edited(toy_run, "checkpoint.json",
                                                                                        lora_rank=4))],
         "iter_000002 is not a checkpoint this code wrote: checkpoint.json does not match its sha256"),
    ]:
        with pytest.raises(SystemExit) as e:
            common.evaluate_main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, (argv, err)
    assert (tmp_path / "full" / "x").read_text() == "kept" and (tmp_path / "a_file").read_text() == "kept"


def test_a_stale_launcher_variable_is_one_line_and_leaves_no_output_folder(toy_run, tmp_path, capsys, monkeypatch):
    for name, value in [("RANK", "1"), ("LOCAL_WORLD_SIZE", "0"), ("WORLD_SIZE", "2")]:
        with monkeypatch.context() as m:
            m.setenv(name, value)
            with pytest.raises(SystemExit) as e:
                common.evaluate_main(["--checkpoint", str(toy_run), "--output", str(tmp_path / "eval")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.splitlines()) == 1 and f"{name}={value}" in err, err
        assert not (tmp_path / "eval").exists()


def test_evaluates_bounds_are_the_trainers():
    for trainer in TRAINERS:
        fields = {f.name: f.metadata for f in dataclasses.fields(importlib.import_module(trainer).Args)}
        for flag, bounds in common.EVAL_BOUNDS.items():
            key = {"images": "eval_images", "steps": "eval_steps"}.get(flag, flag)
            if key in fields:
                assert (fields[key].get("at_least"), fields[key].get("at_most")) == bounds, flag


def edited(run_dir, file: str, **changes) -> bytes:
    """The JSON of run_dir's `file` (args.json, or its latest checkpoint's checkpoint.json) with `changes`, its sha256
    left as it was: still well-formed and well-typed."""
    path = run_dir / file if file == "args.json" else next((run_dir / "checkpoints").glob("iter_*")) / file
    return json.dumps({**json.loads(path.read_text()), **changes}, indent=2).encode()


@pytest.mark.parametrize("data,why", [
    (b'{"model": "toy", "eval_steps": 4', "does not read (JSONDecodeError: Expecting ',' delimiter"),
    (b"", "does not read (JSONDecodeError: Expecting value"),
    (b"[1, 2, 3]", "is a JSON list, not an object"),
    (b'{"eval_steps": 100000000}', "has no sha256"),
    (lambda run_dir: edited(run_dir, "args.json", eval_steps=3), "does not match its sha256 (edited or damaged)"),
    (lambda run_dir: edited(run_dir, "args.json", reward="jpeg"), "does not match its sha256 (edited or damaged)"),
    (lambda run_dir: signed(run_dir, "args.json", dtype="fp8"), "holds dtype 'fp8', not a value this code writes"),
    (lambda run_dir: signed(run_dir, "args.json", eval_images=None), "holds eval_images None, not a value"),
    (lambda run_dir: signed(run_dir, "args.json", resolution="big"), "holds resolution 'big', not a value"),
    (lambda run_dir: signed(run_dir, "args.json", run="0" * 16), "is another run's (not the run identity of its "
                                                                 "checkpoints)"),
])
def test_a_damaged_args_json_is_one_line_and_nothing_is_written(data, why, toy_run, tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(toy_run, run_dir)
    (run_dir / "args.json").write_bytes(data(run_dir) if callable(data) else data)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    monkeypatch.setattr(common, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        common.evaluate_main(["--checkpoint", str(run_dir), "--output", str(tmp_path / "eval")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{run_dir / 'args.json'} is not a run's args.json this code wrote: it {why}" in err, err
    assert err.endswith("; move it aside and pass the run's settings as flags (--model-path, --reward, --steps, "
                        "...)\n"), err
    assert before == {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert not (tmp_path / "eval").exists()


def test_rank_0_shows_the_evaluations_progress(toy_run, tmp_path, capsys):
    common.evaluate_main(["--checkpoint", str(toy_run), "--output", str(tmp_path / "e"), "--threads", "1",
                          "--batch-size", "4"])
    err = capsys.readouterr().err
    assert "evaluate:" in err and " 0/3 [" in err, err                 # 12 images in batches of 4


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    run(flow_grpo, ["--iterations", "0", "--eval-every", "0", "--lora-rank", "4", "--lora-alpha", "8",
                    "--output-dir", str(out)])
    return out


def resigned(run_dir: str) -> str:
    """run_dir with its latest checkpoint's digest of the files there now signed into checkpoint.json, as other code
    could: files that its digest names but that do not load."""
    checkpoint = next((Path(run_dir) / "checkpoints").glob("iter_*"))
    info = common.read_own_json(checkpoint / "checkpoint.json")
    info["files"] = common.checkpoint_digest(checkpoint, sorted(info["files"]))
    (checkpoint / "checkpoint.json").write_text(common.own_json(info))
    return run_dir


def scaled(path, factor: float):
    weights = safetensors.torch.load_file(path)
    safetensors.torch.save_file({k: v * factor for k, v in weights.items()}, path)


def flip_a_bit(path):
    weights = safetensors.torch.load_file(path)
    weights[sorted(weights)[0]].view(-1).view(torch.int32)[0] ^= 1  # still finite
    safetensors.torch.save_file(weights, path)


def changed(run_dir, tmp_path, name: str, change) -> str:
    """A copy of run_dir named `name`, change(its latest checkpoint's folder) applied."""
    copy = tmp_path / name
    shutil.copytree(run_dir, copy)
    change(next((copy / "checkpoints").glob("iter_*")))
    return str(copy)


def test_published_weights_that_are_not_the_checkpoints_are_one_line(toy_run, lora_run, tmp_path, capsys):
    """checkpoint.json's digest covers the published weights, all evaluate reads: before, another run's transformer/,
    a flipped bit or a LoRA scaled by 3 were scored under the checkpoint's name; a damaged file signed into the digest
    again is refused as a file that does not load."""
    other = tmp_path / "other"
    run(flow_grpo, [*TOY, "--seed", "5", "--output-dir", str(other)])
    weights, lora = "transformer/diffusion_pytorch_model.safetensors", "pytorch_lora_weights.safetensors"
    for run_dir, why in [
        (changed(toy_run, tmp_path, "another", lambda c: shutil.rmtree(c / "transformer") or shutil.copytree(
            other / "checkpoints" / c.name / "transformer", c / "transformer")), f"{weights} is not the file"),
        (changed(toy_run, tmp_path, "bit", lambda c: flip_a_bit(c / weights)), f"{weights} is not the file"),
        (changed(lora_run, tmp_path, "x3", lambda c: scaled(c / lora, 3.0)), f"{lora} is not the file"),
        (damaged(toy_run, tmp_path, "cut", weights), f"{weights} is not the file its checkpoint.json's digest names "
                                                     f"(changed since, or another's)"),
        (resigned(damaged(toy_run, tmp_path, "full", weights)), "transformer does not load ("),
        (resigned(damaged(lora_run, tmp_path, "lora", lora)), f"{lora} does not load ("),
    ]:
        with pytest.raises(SystemExit) as e:
            common.evaluate_main(["--checkpoint", run_dir, "--images", "2", "--steps", "1", "--threads", "1",
                                  "--output", str(tmp_path / "eval")])
        err = capsys.readouterr().err
        errors = [ln for ln in err.splitlines() if "error:" in ln]        # besides the progress of loading a model
        assert e.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert f"is not a checkpoint this code wrote: {why}" in errors[0] and not (tmp_path / "eval").exists(), err


def test_an_output_folder_on_a_full_disk_is_one_line_and_left_as_it_was(toy_run, tmp_path):
    """The write probe of --output fails (a file size limit of 0 bytes stands in for a full disk): one line, and the
    folder it made is gone (before: left empty)."""
    out = subprocess.run([sys.executable, str(ROOT / "common.py"), "evaluate", "--checkpoint", str(toy_run),
                          "--output", str(tmp_path / "eval")], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120,
                         preexec_fn=lambda: (signal.signal(signal.SIGXFSZ, signal.SIG_IGN),
                                             resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"cannot write to --output {tmp_path / 'eval'} (File too large): pass a writable folder" in out.stderr
    assert os.listdir(tmp_path) == []


def test_a_failing_reward_is_one_line(toy_run, tmp_path, capsys, monkeypatch):
    def fail(self, images, prompts, metadata=None):
        raise common.TrainingStopped("reward server http://x/y answered HTTP 400: bad batch")
    monkeypatch.setattr(common.ToyReward, "__call__", fail)
    with pytest.raises(SystemExit) as e:
        common.evaluate_main(["--checkpoint", str(toy_run), "--output", str(tmp_path / "e"), "--threads", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == ("common.py evaluate: the reward failed reward server http://x/y answered HTTP 400: "
                                    "bad batch")


@pytest.mark.parametrize("family", ["flux", "sd3", "flux2", "flux2-distilled"])
def test_a_base_model_without_a_run_takes_the_models_defaults(family, tmp_path, monkeypatch):
    """The base model's evaluation without a run: the model's resolution, guidance and prompt length, and its steps
    (a step-distilled FLUX.2-klein's: 4, without CFG)."""
    seen = {}
    real = common.load_model

    def spy(*args, **kwargs):
        adapter = seen["adapter"] = real(*args, **kwargs)
        return adapter
    monkeypatch.setattr(common, "load_model", spy)
    model, distilled = family.removesuffix("-distilled"), family.endswith("-distilled")
    steps, evaluate = [], common.evaluate
    monkeypatch.setattr(common, "evaluate", lambda *args, **kwargs: steps.append(args[4]) or evaluate(*args, **kwargs))
    results = common.evaluate_main(["--model", model, "--model-path", tiny_pipeline(model, *[distilled] * distilled),
                                    "--reward", "jpeg", "--images", "1", "--threads", "1", "--output",
                                    str(tmp_path / "e")])
    adapter = seen["adapter"]
    assert math.isfinite(results["base"]["eval_jpeg"])
    assert (adapter.resolution, adapter.guidance_scale, adapter.max_sequence_length, steps) == {
        "flux": (512, 3.5, 512, [28]), "sd3": (512, 4.5, 128, [40]), "flux2": (512, 4.0, 512, [50]),
        "flux2-distilled": (512, 1.0, 512, [4])}[family]


def signed(run_dir, file: str, **changes) -> bytes:
    """edited(), then signed again as this code signs it: a file this code could have written."""
    record = {k: v for k, v in json.loads(edited(run_dir, file, **changes)).items() if k != "sha256"}
    return common.own_json(record).encode()


@pytest.mark.parametrize("changes,message", [
    ({"eval_images": 0}, "error: --images 0 must be at least 1"),
    ({"eval_steps": 0}, "error: --steps 0 must be at least 1"),
    ({"eval_steps": 10**6}, "error: --steps 1000000 must be at least 1 and at most 1000"),
    ({"resolution": 8}, "error: --resolution 8 must be at least 16 and at most 4096"),
])
def test_the_values_of_a_runs_args_json_pass_the_flags_checks(changes, message, toy_run, tmp_path, capsys,
                                                              monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(toy_run, run_dir)
    (run_dir / "args.json").write_bytes(signed(run_dir, "args.json", **changes))
    monkeypatch.setattr(common, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        common.evaluate_main(["--checkpoint", str(run_dir), "--output", str(tmp_path / "eval")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "eval").exists()


def test_a_refusal_once_the_model_has_loaded_is_one_line_and_leaves_no_output_folder(toy_run, tmp_path, capsys):
    """transformer/config.json edited to another architecture and signed into the digest again: the weights do not
    fit."""
    run_dir = tmp_path / "run"
    shutil.copytree(toy_run, run_dir)
    config = next((run_dir / "checkpoints").glob("iter_*")) / "transformer" / "config.json"
    values = json.loads(config.read_text())
    key = next(k for k in ("num_layers", "num_single_layers", "joint_attention_dim") if k in values)
    config.write_text(json.dumps({**values, key: values[key] + 1}))
    resigned(str(run_dir))
    with pytest.raises(SystemExit) as e:
        common.evaluate_main(["--checkpoint", str(run_dir), "--output", str(tmp_path / "eval"), "--images", "2",
                              "--steps", "1", "--threads", "1"])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert e.value.code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert "is not a checkpoint this code wrote: transformer does not load (" in errors[0], err
    assert not (tmp_path / "eval").exists()


def fifo_folder_or_not_utf8(path, kind: str):
    path.unlink()
    if kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "a folder":
        path.mkdir()
    else:
        path.write_bytes(b"\xff\xfe{iter")


@pytest.mark.parametrize("file,kind", [  # checkpoints/latest's cases evaluate: the FIFO alone in the default suite
    pytest.param(f, k, marks=[pytest.mark.slow] if f == "checkpoints/latest" and k != "a FIFO" else [])
    for f in ["args.json", "checkpoints/iter_000002/checkpoint.json", "checkpoints/latest"]
    for k in ["a FIFO", "a folder", "not UTF-8"]])
def test_a_file_that_is_a_fifo_a_folder_or_not_utf8_is_one_line_never_a_hang(file, kind, toy_run, tmp_path):
    """checkpoints/latest is for people, never read: whatever is there, the newest checkpoint is evaluated."""
    run_dir = tmp_path / "run"
    shutil.copytree(toy_run, run_dir)
    fifo_folder_or_not_utf8(run_dir / file, kind)
    out = subprocess.run([sys.executable, str(ROOT / "common.py"), "evaluate", "--checkpoint", str(run_dir),
                          "--output", str(tmp_path / "eval"), "--images", "2", "--steps", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if file == "checkpoints/latest":
        assert out.returncode == 0 and (tmp_path / "eval" / "results.json").is_file(), out.stderr
        assert json.loads((tmp_path / "eval" / "results.json").read_text())["checkpoints"] == {
            str(run_dir): str((run_dir / "checkpoints" / "iter_000002").resolve())}
        return
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("common.py evaluate: error: "), out.stderr
    assert not (tmp_path / "eval").exists()
