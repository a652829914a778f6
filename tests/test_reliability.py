"""Runs that survive what clusters do to them: non-finite numbers, signals, restarts, rewinds, folders shared by
mistake, full disks and bad input. Each test reproduces a failure the trainers used to have."""
import ast
import contextlib
import importlib
import json
import math
import os
import re
import resource
import signal
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

import common
import flow_grpo
from helpers import (ROOT, SMALL, TRAINERS, own, read_metrics, run, small, tiny_argv, torchrun, torchrun_cmd,
                     trained_params, without_timings)

TOY = ["--model", "toy", *SMALL]


def tiny(trainer: str = "flow_grpo") -> list[str]:
    """A small run of `trainer` on the tiny flux pipeline."""
    return [*tiny_argv(trainer, "flux"), *SMALL]


def strict_lines(run_dir) -> list[dict]:
    """metrics.jsonl by the readers' rule (read_metrics), every complete line strict JSON: a bare NaN or inf fails."""
    def refuse(name):
        raise ValueError(f"non-JSON constant {name}")
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):   # a line cut short: the readers skip it
            json.loads(line, parse_constant=refuse)
    return read_metrics(run_dir)


def nan_reward(on_calls, rank=None):
    """A toy reward whose first image is NaN on the given (1-based) scoring calls of this process."""
    class NaNToy(common.ToyReward):
        calls = 0

        def __call__(self, images, prompts, metadata=None):
            r = super().__call__(images, prompts, metadata)
            NaNToy.calls += 1
            if NaNToy.calls in on_calls and (rank is None or os.environ.get("RANK", "0") == str(rank)):
                r[0] = math.nan
            return r
    return NaNToy


# ---- non-finite numbers ----
def test_a_nan_reward_skips_the_steps_it_poisons_and_logs_null(tmp_path, monkeypatch):
    """SMALL: 2 scoring calls per iteration. A NaN on iteration 1's first call makes the global std NaN, so both of
    its optimizer steps are skipped; the run goes on, its weights stay finite and metrics.jsonl stays JSON."""
    monkeypatch.setitem(common.REWARDS, "toy", nan_reward({3}))
    r = tmp_path / "r"
    run(flow_grpo, [*TOY, "--iterations", "3", "--eval-every", "0", "--output-dir", str(r)])
    lines = strict_lines(r)
    assert [m.get("skipped_steps") for m in lines] == [0, 2, 0, None]
    assert lines[1]["reward_mean"] is None and lines[1]["loss"] is None      # NaN written as null
    assert lines[2]["grad_norm"] is not None
    assert all(torch.isfinite(p).all() for p in trained_params(r, 3))


def test_non_finite_steps_in_a_row_stop_the_run_and_the_last_checkpoint_is_intact(tmp_path, monkeypatch):
    r = tmp_path / "r"
    run(flow_grpo, [*TOY, "--iterations", "2", "--eval-every", "0", "--output-dir", str(r)])
    saved = snapshot(r / "checkpoints" / "iter_000002")
    monkeypatch.setitem(common.REWARDS, "toy", nan_reward(set(range(1, 100))))
    with pytest.raises(common.TrainingStopped, match="3 optimizer steps in a row had a NaN or inf gradient norm"):
        run(flow_grpo, [*TOY, "--iterations", "6", "--eval-every", "0", "--output-dir", str(r), "--resume", str(r)])
    assert sorted(p.name for p in (r / "checkpoints").iterdir()) == ["iter_000002", "latest"]
    assert snapshot(r / "checkpoints" / "iter_000002") == saved
    lines = strict_lines(r)                                # iteration 2: both steps skipped and logged; the
    assert [m["iteration"] for m in lines] == [0, 1, 2] and lines[2]["skipped_steps"] == 2  # 3rd stops the run


def test_a_nan_on_one_rank_is_skipped_by_both_and_nobody_hangs(tmp_path):
    """2 gloo ranks, per-group std: rank 1's first micro-batch of iteration 1 gets a NaN reward. The optimizer
    step that holds it is skipped on both ranks (the other one is not), and the replicas stay identical."""
    script = tmp_path / "nan_on_rank1.py"
    script.write_text(f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
                      "import common, flow_grpo\nfrom test_reliability import nan_reward\n"
                      "common.REWARDS['toy'] = nan_reward({3}, rank=1)\n"
                      "common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS)\n")
    r = tmp_path / "r"
    torchrun(str(script), ["--model", "toy", *small(without=("prompts_per_step",)), "--prompts-per-step", "4",
                           "--iterations", "3", "--eval-every", "0", "--no-global-std", "--output-dir", str(r)])
    lines = strict_lines(r)
    assert [m.get("skipped_steps") for m in lines] == [0, 1, 0, None]
    assert lines[-1]["rank_param_diff"] == 0.0


def test_a_learning_rate_that_blows_up_stops_the_run_without_saving(tmp_path):
    r = tmp_path / "r"
    args = common.cli(flow_grpo.Args, [*TOY, "--iterations", "6", "--output-dir", str(r)])
    args.lr = 1e10                                                        # the command line refuses --lr above 1
    with pytest.raises(common.TrainingStopped, match="in a row had a NaN or inf gradient norm"):
        flow_grpo.main(args)
    assert not (r / "checkpoints").exists()
    assert strict_lines(r)[0]["loss"] is None                             # logged, as null


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_group_of_one_is_refused(trainer, tmp_path):
    module = importlib.import_module(trainer)
    with pytest.raises(common.UsageError, match="--group-size 1 must be at least 2"):
        run(module, [*tiny(trainer), "--group-size", "1", "--output-dir", str(tmp_path / "r")])
    assert not (tmp_path / "r").exists()


def test_weights_that_are_not_finite_are_never_saved(tmp_path, monkeypatch):
    """Weights that are not finite when a checkpoint is due (here: every parameter set to inf after the step guard
    has checked the first optimizer step) are refused, not written."""
    real = common.StepGuard.step

    def poisoned(self, optimizer, params, grad_clip):
        out = real(self, optimizer, params, grad_clip)
        for p in params:
            p.data.fill_(math.inf)
        return out

    monkeypatch.setattr(common.StepGuard, "step", poisoned)
    r = tmp_path / "r"
    with pytest.raises(common.TrainingStopped, match="not finite and were not saved"):
        run(flow_grpo, [*tiny(), "--iterations", "1", "--eval-every", "0", "--output-dir", str(r)])
    assert not list(r.glob("checkpoints/iter_*"))


# ---- run folders: a folder only grows ----
def snapshot(folder) -> dict:
    """Every file under `folder`: its path and bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def markers(run_dir) -> list[dict]:
    return [json.loads(ln)["resumed"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if "resumed" in ln]


def test_resuming_appends_a_marker_and_changes_nothing_else(tmp_path):
    r = tmp_path / "r"
    run(flow_grpo, [*tiny(), "--iterations", "2", "--output-dir", str(r)])
    before = snapshot(r)
    run(flow_grpo, [*tiny(), "--iterations", "3", "--output-dir", str(r), "--resume", str(r)])
    after = snapshot(r)
    new = {k for k in after if k not in before}
    assert new == {k for k in after if k.startswith("checkpoints/iter_000003/")} | {"eval_000003.png"} and new
    assert {k: after[k] for k in before if k not in ("metrics.jsonl", "checkpoints/latest")} == \
        {k: v for k, v in before.items() if k not in ("metrics.jsonl", "checkpoints/latest")}
    assert after["checkpoints/latest"] == b"iter_000003"
    grown = after["metrics.jsonl"].removeprefix(before["metrics.jsonl"]).decode().splitlines()
    assert after["metrics.jsonl"].startswith(before["metrics.jsonl"]) and len(grown) == 3
    ckpt = r / "checkpoints" / "iter_000002"
    assert json.loads(grown[0]) == {"resumed": {"from_iteration": 2, "checkpoint": str(ckpt.resolve()),
                                                "args": common.read_own_json(r / "args.json") | {"iterations": 3,
                                                                                                "resume": str(r)}}}
    assert [json.loads(ln)["iteration"] for ln in grown[1:]] == [2, 3]
    assert [m["iteration"] for m in read_metrics(r)] == [0, 1, 2, 3]
    assert read_metrics(r)[2] == json.loads(grown[1])                   # the last line of an iteration counts
    assert not (r / "args_history.jsonl").exists()


def test_resume_into_another_runs_folder_is_refused_and_an_empty_one_starts_its_own_history(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    run(flow_grpo, [*tiny(), "--iterations", "2", "--output-dir", str(a)])
    run(flow_grpo, [*tiny(), "--iterations", "1", "--output-dir", str(b)])
    before, before_a = snapshot(b), snapshot(a)
    with pytest.raises(common.UsageError, match=re.escape(f"{b} already holds another run: continue ") +
                       ".*in a new or empty --output-dir \\(nothing in .* is moved or deleted\\)"):
        run(flow_grpo, [*tiny(), "--iterations", "3", "--output-dir", str(b), "--resume", str(a)])
    assert snapshot(b) == before
    run(flow_grpo, [*tiny(), "--iterations", "3", "--output-dir", str(c), "--resume", str(a)])
    assert snapshot(a) == before_a
    assert [m["iteration"] for m in read_metrics(c)] == [2, 3]        # not a's lines: its marker names a's checkpoint
    assert markers(c) == [{"from_iteration": 2, "checkpoint": str((a / "checkpoints" / "iter_000002").resolve()),
                           "args": common.read_own_json(c / "args.json")}]


def test_rewinding_into_the_same_folder_is_refused_and_an_empty_one_continues_the_older_checkpoint(tmp_path):
    r, elsewhere = tmp_path / "r", tmp_path / "rewound"
    run(flow_grpo, [*tiny(), "--iterations", "4", "--save-every", "2", "--output-dir", str(r)])
    before, ckpt2 = snapshot(r), r / "checkpoints" / "iter_000002"
    for out in ([], ["--output-dir", str(r)]):
        with pytest.raises(common.UsageError, match=re.escape(f"{r / 'checkpoints' / 'iter_000004'} is past iteration "
                                                              f"2, where this run would start: move it out of ") +
                           ".* else continue " + re.escape(f"{ckpt2} in a new or empty --output-dir (nothing in {r} "
                                                           f"is moved or deleted)")):
            run(flow_grpo, [*tiny(), "--iterations", "3", *out, "--resume", str(ckpt2)])
    assert snapshot(r) == before
    elsewhere.mkdir()                                                      # empty
    run(flow_grpo, [*tiny(), "--iterations", "3", "--output-dir", str(elsewhere), "--resume", str(ckpt2)])
    assert snapshot(r) == before
    assert [m["iteration"] for m in read_metrics(elsewhere)] == [2, 3]
    assert [m["from_iteration"] for m in markers(elsewhere)] == [2]
    assert (elsewhere / "checkpoints" / "latest").read_text() == "iter_000003"


def test_a_cut_last_line_is_skipped_and_the_next_line_starts_on_its_own(tmp_path):
    r = tmp_path / "r"
    run(flow_grpo, [*tiny(), "--iterations", "2", "--output-dir", str(r)])
    with open(r / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "loss": 0.0')                           # a kill mid-write
    run(flow_grpo, [*tiny(), "--iterations", "3", "--output-dir", str(r), "--resume", str(r)])
    lines = (r / "metrics.jsonl").read_text().splitlines()
    cut = lines.index('{"iteration": 3, "loss": 0.0')                     # kept, on a line of its own
    assert "resumed" in json.loads(lines[cut + 1])
    assert [m["iteration"] for m in strict_lines(r)] == [0, 1, 2, 3] and "eval_reward" in strict_lines(r)[3]


def test_a_checkpoint_is_never_replaced_and_stale_temporary_folders_are_cleaned(tmp_path, monkeypatch):
    """--time-budget with --save-every 1 saves iteration 2 twice (periodic, then final): the run saves it once. A save
    onto a folder already there stops, naming it, and leaves it as it was. A temporary folder left by a killed write
    is removed at the next start."""
    calls = []
    monkeypatch.setattr(common, "out_of_time", lambda t0, budget, device: calls.append(budget) or len(calls) > 2)
    r = tmp_path / "r"
    run(flow_grpo, [*tiny(), "--iterations", "50", "--time-budget", "9", "--save-every", "1", "--output-dir", str(r)])
    ckpt = r / "checkpoints" / "iter_000002"
    assert (r / "checkpoints" / "latest").read_text() == "iter_000002" and (ckpt / "checkpoint.json").is_file()
    before = {f: f.stat().st_mtime_ns for f in ckpt.rglob("*")}
    message = f"{ckpt} is already there, so iteration 2 was not saved: move it out of {ckpt.parent} and --resume {r}"
    with pytest.raises(common.TrainingStopped, match=re.escape(message)):
        common.save_checkpoint(r, 2, None, [], True, None, None, 0.0, {}, common.setup_runtime(0, 1))
    assert {f: f.stat().st_mtime_ns for f in ckpt.rglob("*")} == before
    (r / "checkpoints" / ".tmp-killed").mkdir()
    monkeypatch.undo()
    run(flow_grpo, [*tiny(), "--iterations", "3", "--output-dir", str(r), "--resume", str(r)])
    assert not list((r / "checkpoints").glob(".tmp-*"))


def test_a_full_disk_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    r = tmp_path / "r"
    run(flow_grpo, [*tiny(), "--iterations", "1", "--output-dir", str(r)])

    def disk_full(*a, **k):
        raise RuntimeError("basic_ios::clear: iostream error")
    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(common.TrainingStopped, match="could not write the checkpoint of iteration 2 .*free disk"):
        run(flow_grpo, [*tiny(), "--iterations", "2", "--output-dir", str(r), "--resume", str(r)])
    assert sorted(p.name for p in (r / "checkpoints").iterdir()) == ["iter_000001", "latest"]
    assert (r / "checkpoints" / "latest").read_text() == "iter_000001"


def test_a_full_disk_at_the_published_weights_is_one_line_and_a_retry_takes_a_new_name(tmp_path, capsys, monkeypatch):
    """state/ fits, then the transformer's safetensors file fills the disk (safetensors' own error): one line naming
    the disk error and the newest checkpoint kept, nothing half written left; each try writes under a new name."""
    from safetensors import SafetensorError
    r = tmp_path / "r"
    run(flow_grpo, [*TOY, "--iterations", "1", "--eval-every", "0", "--output-dir", str(r)])
    tries = []

    def disk_full(tensors, filename, *a, **k):
        tries.append(Path(filename).parent.parent.name)
        Path(filename).write_bytes(b"\0" * 100)
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                              'left on device" })')
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(SystemExit) as stop:
        common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS,
                       [*TOY, "--iterations", "2", "--eval-every", "0", "--resume", str(r)])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback" not in err and "FileExistsError" not in err, err
    assert f"could not write the checkpoint of iteration 2 to {r / 'checkpoints'}, whose newest kept is " \
           f"iter_000001 (SafetensorError: Error while serializing: IoError(Os {{ code: 28, kind: StorageFull" in err
    assert sorted(os.listdir(r / "checkpoints")) == ["iter_000001", "latest"]
    with pytest.raises(SystemExit):                        # the same again: another temporary name
        common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS,
                       [*TOY, "--iterations", "2", "--eval-every", "0", "--resume", str(r)])
    assert len(tries) == 2 and tries[0] != tries[1] and all(t.startswith(".tmp-iter_000002-") for t in tries), tries
    assert sorted(os.listdir(r / "checkpoints")) == ["iter_000001", "latest"]


def test_a_refused_start_on_a_full_disk_leaves_nothing(tmp_path):
    """The write probe of --output-dir fails (a file size limit of 0 bytes stands in for a full disk): one line, and
    the folder is left as it was."""
    (tmp_path / "r").mkdir()
    out = subprocess.run([sys.executable, str(ROOT / "flow_grpo.py"), *TOY, "--output-dir", str(tmp_path / "r")],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                         preexec_fn=lambda: (signal.signal(signal.SIGXFSZ, signal.SIG_IGN),
                                             resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"cannot write to --output-dir {tmp_path / 'r'} (File too large): pass a writable folder" in out.stderr
    assert os.listdir(tmp_path / "r") == []


def test_default_run_folders_are_unique(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rt = common.setup_runtime(0, 1)
    dirs = [common.prepare_run(flow_grpo.Args(), rt, "flow_grpo").dir for _ in range(3)]  # within one second
    assert len(set(dirs)) == 3 and all(d.name.startswith("flow_grpo-toy-") for d in dirs)
    assert os.listdir(dirs[2]) == [".lock"] and not any(d.exists() for d in dirs[:2])  # released, made and left empty
    common._release_folder()
    assert os.listdir("runs") == []


def test_resume_auto_starts_fresh_then_continues(tmp_path):
    r = tmp_path / "r"
    run(flow_grpo, [*tiny(), "--iterations", "2", "--output-dir", str(r), "--resume", "auto"])
    run(flow_grpo, [*tiny(), "--iterations", "3", "--output-dir", str(r), "--resume", "auto"])
    assert [m["iteration"] for m in read_metrics(r)] == [0, 1, 2, 3]
    with pytest.raises(common.UsageError, match="--resume auto continues the run in --output-dir"):
        run(flow_grpo, [*tiny(), "--resume", "auto"])


@pytest.mark.parametrize("module,flags,differ", [
    ("v_grpo", [], "trainer flow_grpo, this run has trainer v_grpo: resume with the same trainer and flags "
                   "(flow_grpo.py)"),
    ("flow_grpo", ["--lora-alpha", "16"], "lora_alpha 8.0, this run has lora_alpha 16.0: resume with the same "
                                          "trainer and flags (--lora-alpha 8.0)"),
    ("flow_grpo", ["--lora-rank", "8", "--lora-alpha", "8"], "lora_rank 4, this run has lora_rank 8: resume with the "
                                                             "same trainer and flags (--lora-rank 4)"),
    ("flow_grpo", ["--ema"], "ema False, this run has ema True: resume with the same trainer and flags (--no-ema)"),
    ("flow_grpo", lambda: tiny_argv("flow_grpo", "sd3"), "model flux, this run has model sd3: resume with the same "
                                                         "trainer and flags (--model flux)"),
    ("flow_grpo", ["--lora-rank", "8", "--ema"], "lora_rank 4, ema False, this run has lora_rank 8, ema True: resume "
                                                 "with the same trainer and flags (--lora-rank 4 --no-ema)"),
])
def test_resume_refuses_a_checkpoint_that_does_not_match(module, flags, differ, tmp_path, capsys):
    a = tmp_path / "a"
    run(flow_grpo, [*tiny(), "--iterations", "1", "--output-dir", str(a)])
    before = snapshot(a)
    mod = importlib.import_module(module)
    err = one_error_line(capsys, mod, [*tiny(module), "--iterations", "2", "--resume", str(a),
                                       *(flags() if callable(flags) else flags)])
    assert f"error: checkpoint {a / 'checkpoints' / 'iter_000001'} was trained with {differ}\n" in err, err
    assert snapshot(a) == before


def test_a_folder_with_a_corrupt_checkpoint_json_is_refused(tmp_path, capsys):
    a = tmp_path / "a"
    run(flow_grpo, [*tiny(), "--iterations", "1", "--output-dir", str(a)])
    (a / "checkpoints" / "iter_000001" / "checkpoint.json").write_text('{"trainer": "flow_grpo"')
    message = f"{a / 'checkpoints' / 'iter_000001'} is not a checkpoint this code wrote: checkpoint.json does not " \
              f"read (JSONDecodeError: "
    with pytest.raises(common.UsageError, match=re.escape(message)):
        run(flow_grpo, [*tiny(), "--iterations", "2", "--resume", str(a)])
    err = one_error_line(capsys, flow_grpo, [*tiny(), "--iterations", "2", "--resume", str(a), "--output-dir",
                                             str(tmp_path / "b")])
    assert message in err
    with pytest.raises(SystemExit):
        common.evaluate_main(["--checkpoint", str(a), "--output", str(tmp_path / "eval")])
    assert message in capsys.readouterr().err and not (tmp_path / "eval").exists()


def test_trainable_tensors_that_do_not_fit_are_refused_in_one_line(tmp_path):
    a = tmp_path / "a"
    run(flow_grpo, [*tiny(), "--iterations", "1", "--output-dir", str(a)])
    saved = trained_params(a, 1)
    wrong = [torch.nn.Parameter(t) for t in [torch.zeros(8, *saved[0].shape[1:]), *map(torch.zeros_like, saved[1:])]]
    refused = "is not a checkpoint this code wrote: state/ does not load ("
    with pytest.raises(common.UsageError, match=re.escape(refused) + r"ValueError: Size mismatch") as e:
        common.load_checkpoint(a / "checkpoints" / "iter_000001", wrong, torch.optim.AdamW(wrong), None)
    assert "\n" not in str(e.value)
    with pytest.raises(common.UsageError, match=re.escape(f"{refused}ValueError: it holds {len(saved)} trainable "
                                                          f"tensors and this model 1)")):
        common.load_checkpoint(a / "checkpoints" / "iter_000001", saved[:1], None, None)


def test_a_methods_extra_state_is_saved_and_restored_bitwise(tmp_path):
    """TrainingLoop's extra_state (a tensor, a list of tensors) goes into state/ with the rest and loads back in
    place, bit for bit; a checkpoint without the extra state a run expects is refused in one line."""
    rt, meta = common.setup_runtime(0, 1), {"trainer": "flow_grpo", "model": "toy", "lora_rank": 0, "lora_alpha": 0.0,
                                            "ema": False, "run": "r"}
    adapter = common.load_model("toy", rt)
    params = common.add_lora(adapter.transformer, 0, 0.0, [])
    optimizer = torch.optim.AdamW(params)
    old = torch.randn(5, 3, dtype=torch.float64)                          # dtypes are kept: float64, int64
    pair = [torch.randn(4), torch.arange(6, dtype=torch.int64)]
    for run_dir in (tmp_path / "a", tmp_path / "b"):                   # a run folder holds its log
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text('{"iteration": 0}\n')
    with_extra = common.save_checkpoint(tmp_path / "a", 1, adapter, params, False, optimizer, None, 2.5, meta, rt,
                                        {"old": old, "pair": pair})
    without = common.save_checkpoint(tmp_path / "b", 1, adapter, params, False, optimizer, None, 2.5, meta, rt)
    into = {"old": torch.zeros_like(old), "pair": [torch.zeros_like(t) for t in pair]}
    same = into["old"], *into["pair"]
    assert common.load_checkpoint(with_extra, params, optimizer, None, into) == 2.5
    assert all(a is b for a, b in zip((into["old"], *into["pair"]), same, strict=True))   # in place
    assert torch.equal(into["old"], old) and all(torch.equal(a, b) for a, b in zip(into["pair"], pair, strict=True))
    with pytest.raises(common.UsageError, match=re.escape(f"{without} is not a checkpoint this code wrote: state/ "
                                                          f"does not load (ValueError: it holds params, not ")) as e:
        common.load_checkpoint(without, params, optimizer, None, into)
    assert "\n" not in str(e.value)


def test_a_refused_resume_leaves_the_folder_as_it_was(tmp_path, capsys, monkeypatch):
    """A resume past --iterations is refused in one line before anything is written (args.json, a resume marker);
    a bad flag leaves no run folder, not even a default one."""
    r = tmp_path / "r"
    run(flow_grpo, [*TOY, "--iterations", "3", "--eval-every", "0", "--output-dir", str(r)])
    before = snapshot(r)
    err = one_error_line(capsys, flow_grpo, [*TOY, "--iterations", "1", "--resume", str(r)])
    assert f"--resume {r} is at iteration 3, past --iterations 1: raise --iterations" in err
    assert snapshot(r) == before
    monkeypatch.chdir(tmp_path)
    for flags, _ in BAD_FLAGS:
        one_error_line(capsys, flow_grpo, [*TOY, *flags])
    assert sorted(os.listdir(tmp_path)) == ["r"]


@pytest.fixture(scope="module")
def run_at_3(tmp_path_factory):
    r = tmp_path_factory.mktemp("at3") / "r"
    run(flow_grpo, [*TOY, "--iterations", "3", "--eval-every", "0", "--output-dir", str(r)])
    return r


def rewrite_state(keep):
    """A damage: state/ saved again with torch.distributed.checkpoint, holding keep(its training state), and its
    digest signed into checkpoint.json, as other code could: a state/ that checkpoint.json names but that does not
    load."""
    def damage(checkpoint):
        import torch.distributed.checkpoint as dcp
        from helpers import training_state
        state = keep(training_state(checkpoint))
        shutil.rmtree(checkpoint / "state")
        common.single_process(dcp.save, state, checkpoint / "state")
        resign(checkpoint)
    return damage


def resign(checkpoint, **changes):
    """checkpoint.json with `changes` and the digest of the files there now, signed again as other code could."""
    info = {**common.read_own_json(checkpoint / "checkpoint.json"), **changes}
    info["files"] = common.checkpoint_digest(checkpoint, sorted(info["files"]))
    (checkpoint / "checkpoint.json").write_text(common.own_json(info))


def signed(checkpoint, key, value=None):
    """checkpoint.json with `key` set to `value` (None: left out) and signed again, as other code could."""
    info = {**common.read_own_json(checkpoint / "checkpoint.json"), key: value}
    (checkpoint / "checkpoint.json").write_text(common.own_json({k: v for k, v in info.items() if v is not None}))


def flip_a_bit(checkpoint):
    """A bit flipped in the tensor file: every number still finite (the lowest bit of the last byte's mantissa)."""
    path = checkpoint / "state" / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def write(name, data):
    return lambda checkpoint: (checkpoint / name).write_bytes(data(checkpoint / name) if callable(data) else data)


def edit(key, value):
    """A damage: checkpoint.json with `key` set to `value`, still JSON (its sha256 left as it was)."""
    return write("checkpoint.json", lambda p: json.dumps({**json.loads(p.read_text()), key: value}).encode())


STATE, JSON = "state/ does not load (", "checkpoint.json "
DIGEST = "{} is not the file its checkpoint.json's digest names (changed since, or another's)"
NOT_WRITTEN = STATE + "ValueError: not finite, or an optimizer step or loss scaling this code does not write)"
NOT_NAMED = JSON + "holds a digest that does not name the files a save writes, each by its sha256"
WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


def published_bit_flipped(checkpoint):
    """A bit flipped in the published weights, which a resume does not read but evaluate does: still finite."""
    path = checkpoint / WEIGHTS
    weights = safetensors.torch.load_file(path)
    key = sorted(weights)[0]
    weights[key].view(-1).view(torch.int32)[0] ^= 1
    safetensors.torch.save_file(weights, path)


def an_earlier_versions(checkpoint):
    """checkpoint.json as the previous version wrote it: a digest of state/ alone, under "state"."""
    info = common.read_own_json(checkpoint / "checkpoint.json")
    info["state"] = {k[6:]: v for k, v in info.pop("files").items() if k.startswith("state/")}
    (checkpoint / "checkpoint.json").write_text(common.own_json(info))


def digest_with(change):
    """checkpoint.json signed again with its digest changed by change(files)."""
    return lambda c: signed(c, "files", change(dict(common.read_own_json(c / "checkpoint.json")["files"])))


DAMAGES = {
    "only an iteration": (rewrite_state(lambda s: {"iteration": 1}), STATE + "ValueError: it holds iteration, not "
                                                                             "what checkpoint.json and this run name)"),
    "no params": (rewrite_state(lambda s: {"optimizer": s["optimizer"]}), STATE + "ValueError: it holds optimizer, not "
                                                                                  "what checkpoint.json and this run "
                                                                                  "name)"),
    "no parameter groups": (rewrite_state(lambda s: {**s, "optimizer": {"state": s["optimizer"]["state"]}}),
                            STATE + "RuntimeError: Missing key in checkpoint state_dict: optimizer.param_groups.0"),
    "no optimizer state": (rewrite_state(lambda s: {**s, "optimizer": {**s["optimizer"], "state": {}}}),
                           STATE + "RuntimeError: Missing key in checkpoint state_dict: optimizer.state.0"),
    "optimizer tensors of another shape": (rewrite_state(lambda s: {**s, "optimizer": {**s["optimizer"], "state": {
        **s["optimizer"]["state"], "0": {**s["optimizer"]["state"]["0"], "exp_avg": torch.zeros(3)}}}}),
        STATE + "ValueError: Size mismatch"),
    "no state": (lambda checkpoint: shutil.rmtree(checkpoint / "state"), DIGEST.format("state/.metadata")),
    "a NaN in state/": (rewrite_state(lambda s: {**s, "params": {**s["params"], "0": s["params"]["0"].index_fill(
        0, torch.tensor([0]), math.nan)}}), NOT_WRITTEN),
    "AdamW's step -5": (rewrite_state(lambda s: {**s, "optimizer": {**s["optimizer"], "state": {
        k: {**v, "step": torch.tensor(-5.0)} for k, v in s["optimizer"]["state"].items()}}}), NOT_WRITTEN),
    "AdamW's step 1.5": (rewrite_state(lambda s: {**s, "optimizer": {**s["optimizer"], "state": {
        k: {**v, "step": torch.tensor(1.5)} for k, v in s["optimizer"]["state"].items()}}}), NOT_WRITTEN),
    "a bit flipped in state/": (flip_a_bit, DIGEST.format("state/__0_0.distcp")),
    "a bit flipped in the published weights": (published_bit_flipped, DIGEST.format(WEIGHTS)),
    "no published weights": (lambda checkpoint: shutil.rmtree(checkpoint / "transformer"),
                             DIGEST.format("transformer/config.json")),
    "a truncated .metadata": (write("state/.metadata", lambda p: p.read_bytes()[:1000]),
                              DIGEST.format("state/.metadata")),
    "a garbage .metadata": (write("state/.metadata", b"\x80\x04garbage"), DIGEST.format("state/.metadata")),
    "a truncated tensor file": (write("state/__0_0.distcp", lambda p: p.read_bytes()[:p.stat().st_size // 2]),
                                DIGEST.format("state/__0_0.distcp")),
    "a FIFO for a tensor file": (lambda c: (c / "state" / "__0_0.distcp").unlink() or os.mkfifo(
        c / "state" / "__0_0.distcp"), DIGEST.format("state/__0_0.distcp")),
    "no checkpoint.json": (lambda checkpoint: (checkpoint / "checkpoint.json").unlink(), "no checkpoint there"),
    "checkpoint.json an array": (write("checkpoint.json", b"[1, 2, 3]"), JSON + "is a JSON list, not an object"),
    "checkpoint.json empty": (write("checkpoint.json", b""), JSON + "does not read (JSONDecodeError: Expecting value"),
    "checkpoint.json not UTF-8": (write("checkpoint.json", b'{"model": "caf\xe9"}'), JSON + "does not read ("
                                                                                         "UnicodeDecodeError"),
    "checkpoint.json without its sha256": (write("checkpoint.json", lambda p: json.dumps({
        k: v for k, v in json.loads(p.read_text()).items() if k != "sha256"}).encode()), JSON + "has no sha256"),
    **{f"checkpoint.json with {key} {value!r}": (edit(key, value), JSON + "does not match its sha256")
       for key, value in [("iteration", 2), ("iteration", -5), ("world_size", 0), ("elapsed", -1.0),
                          ("lora_rank", -4), ("iteration", "3"), ("ema", True), ("sha256", "0" * 64)]},
    **{f"checkpoint.json signed again with {key} {value!r}": (lambda c, key=key, value=value: signed(c, key, value),
                                                             JSON + f"holds {key} {value!r}, not a value this code "
                                                                    f"writes") for key, value in [
        ("iteration", "3"), ("iteration", 1.5), ("iteration", -5), ("iteration", True), ("elapsed", "abc"),
        ("elapsed", math.nan), ("elapsed", math.inf), ("lora_alpha", -1.0), ("ema", 0), ("files", []),
        ("log_bytes", 2**70), ("world_size", 0), ("tensors", 0), ("lora_rank", 5000), ("iteration", 10**10),
        ("world_size", 1.0)]},
    **{f"checkpoint.json signed again without {key}": (lambda c, key=key: signed(c, key), JSON + f"holds {key} None")
       for key in ("model", "trainer", "world_size", "files", "loss_scale")},
    "a checkpoint of an earlier version (a digest of state/ alone)": (an_earlier_versions, JSON + "holds files None"),
    "checkpoint.json signed again with an empty digest": (digest_with(lambda f: {}), NOT_NAMED),
    "checkpoint.json signed again with a digest without the weights": (digest_with(
        lambda f: {k: v for k, v in f.items() if k != WEIGHTS}), NOT_NAMED),
    "checkpoint.json signed again with a digest naming one more file": (digest_with(
        lambda f: {**f, "state/__1_0.distcp": "0" * 64}), NOT_NAMED),
    "checkpoint.json signed again with a digest of what a missing file reads as": (
        lambda c: (c / "state" / "__0_0.distcp").unlink() or digest_with(lambda f: {**f, "state/__0_0.distcp": (
            common.file_sha256(c / "state" / "__0_0.distcp"))})(c), NOT_NAMED),
    "checkpoint.json signed again with optimizer_stepped false": (lambda c: signed(c, "optimizer_stepped", False),
                                                                 STATE + "ValueError: it holds optimizer, params, not "
                                                                         "what checkpoint.json and this run name)"),
    "checkpoint.json signed again with loss_scale true": (lambda c: signed(c, "loss_scale", True),
                                                          STATE + "ValueError: it holds optimizer, params, not what "
                                                                  "checkpoint.json and this run name)"),
    "checkpoint.json signed again with iteration 7": (lambda c: signed(c, "iteration", 7), JSON + "names iteration 7, "
                                                      "not that of its folder's name"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_one_line_naming_it_and_nothing_is_written(damage, run_at_3, tmp_path, capsys):
    r = tmp_path / "r"
    shutil.copytree(run_at_3, r)
    ckpt = r / "checkpoints" / "iter_000003"
    harm, message = DAMAGES[damage]
    harm(ckpt)
    before = snapshot(r)
    err = one_error_line(capsys, flow_grpo, [*TOY, "--iterations", "5", "--resume", str(r)])
    if message != "no checkpoint there":
        assert f"error: {ckpt} is not a checkpoint this code wrote: {message}" in err, err
        assert err.endswith("; pass another checkpoint, or resume from an earlier one in a new --output-dir\n"), err
    assert message in err and snapshot(r) == before and sorted(os.listdir(r / "checkpoints")) == ["iter_000003",
                                                                                                "latest"]


def scaler_state(**changes):
    return rewrite_state(lambda s: {**s, "scaler": {**s["scaler"], **changes}})


LOSS_SCALING = {"a growth factor of inf": (scaler_state(growth_factor=math.inf), NOT_WRITTEN),
                "a growth factor of 3": (scaler_state(growth_factor=3.0), NOT_WRITTEN),
                "a backoff factor of 0": (scaler_state(backoff_factor=0.0), NOT_WRITTEN),
                "a growth interval of 0": (scaler_state(growth_interval=0), NOT_WRITTEN),
                "a loss scale of 0": (scaler_state(scale=0.0), NOT_WRITTEN),
                "checkpoint.json signed again with loss_scale false": (
                    lambda c: signed(c, "loss_scale", False), STATE + "ValueError: it holds optimizer, params, scaler, "
                                                                      "not what checkpoint.json and this run name)")}


@pytest.mark.parametrize("damage", LOSS_SCALING)
def test_loss_scaling_this_code_does_not_write_is_refused(damage, tmp_path_factory, tmp_path, capsys):
    """fp16's GradScaler state in state/ is a fresh GradScaler's settings and a scale in (0, inf), or the checkpoint
    is refused: before, a growth factor of inf was loaded, trained on and saved again."""
    fp16 = ["--dtype", "fp16", *TOY, "--eval-every", "0"]
    saved = tmp_path_factory.getbasetemp() / "fp16-run"
    if not saved.exists():
        run(flow_grpo, [*fp16, "--iterations", "1", "--output-dir", str(saved)])
    r = tmp_path / "r"
    shutil.copytree(saved, r)
    ckpt = r / "checkpoints" / "iter_000001"
    harm, message = LOSS_SCALING[damage]
    harm(ckpt)
    before = snapshot(r)
    err = one_error_line(capsys, flow_grpo, [*fp16, "--iterations", "2", "--resume", str(r)])
    assert f"error: {ckpt} is not a checkpoint this code wrote: {message}" in err and snapshot(r) == before, err


def test_a_refused_resume_into_a_new_folder_leaves_no_folder(run_at_3, tmp_path, capsys):
    """The refusal comes once the model has loaded (state/ is checked then): the new --output-dir it made, which
    held only its .lock, is gone, and the checkpoint's folder is as it was."""
    r = tmp_path / "r"
    shutil.copytree(run_at_3, r)
    flip_a_bit(r / "checkpoints" / "iter_000003")
    before = snapshot(r)
    err = one_error_line(capsys, flow_grpo, [*TOY, "--iterations", "5", "--resume", str(r), "--output-dir",
                                             str(tmp_path / "new")])
    assert "is not a checkpoint this code wrote" in err and snapshot(r) == before
    assert sorted(os.listdir(tmp_path)) == ["r"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two runs of the same model and flags, a checkpoint at each of iterations 1-3."""
    folder = tmp_path_factory.mktemp("two")
    for name in ("a", "b"):
        run(flow_grpo, [*TOY, "--iterations", "3", "--save-every", "1", "--eval-every", "0", "--output-dir",
                        str(folder / name)])
    return folder


def another_runs_state(r, other):
    shutil.rmtree(r / "checkpoints" / "iter_000003" / "state")
    shutil.copytree(other / "checkpoints" / "iter_000003" / "state", r / "checkpoints" / "iter_000003" / "state")


def an_earlier_state(r, other):
    shutil.rmtree(r / "checkpoints" / "iter_000003" / "state")
    (r / "checkpoints" / "iter_000003" / "state").symlink_to(r / "checkpoints" / "iter_000002" / "state")


def a_copied_checkpoint(r, other):
    shutil.rmtree(r / "checkpoints" / "iter_000003")
    shutil.copytree(other / "checkpoints" / "iter_000003", r / "checkpoints" / "iter_000003")


def a_rollback(r, other):
    """An older checkpoint copied to a newer name."""
    shutil.copytree(r / "checkpoints" / "iter_000001", r / "checkpoints" / "iter_000004")


LIES = {"another run's state/": (another_runs_state, "iter_000003", DIGEST.format("state/.metadata")),
        "a link to an earlier state/": (an_earlier_state, "iter_000003", DIGEST.format("state/.metadata")),
        "a checkpoint copied from another run": (a_copied_checkpoint, "iter_000003", "{r}/metrics.jsonl does not "
                                                 "begin with the lines logged before it was saved (a copy's "
                                                 "checkpoint, or an edited log)"),
        "an older checkpoint copied to a newer name": (a_rollback, "iter_000004", "checkpoint.json names iteration 1, "
                                                                                 "not that of its folder's name")}


@pytest.mark.parametrize("lie,resume", [(lie, resume) for lie in LIES for resume in ("auto", "run")])
def test_a_checkpoint_folder_that_lies_is_one_line_and_nothing_is_written(lie, resume, two_runs, tmp_path, capsys):
    """What checkpoint.json points at is checked too: state/ against its digest, the folder's name is its iteration,
    and continuing in place, the run's metrics.jsonl begins with the log it was saved after; neither folder is
    written."""
    r, other = tmp_path / "a", tmp_path / "b"
    shutil.copytree(two_runs / "a", r)
    shutil.copytree(two_runs / "b", other)
    harm, name, message = LIES[lie]
    harm(r, other)
    before, before_other = snapshot(r), snapshot(other)
    flags = ["--resume", "auto", "--output-dir", str(r)] if resume == "auto" else ["--resume", str(r)]
    err = one_error_line(capsys, flow_grpo, [*TOY, "--iterations", "5", *flags])
    assert f"error: {r / 'checkpoints' / name} is not a checkpoint this code wrote: " \
           f"{message.format(r=r)}" in err, err
    assert snapshot(r) == before and snapshot(other) == before_other


def test_a_run_folder_moved_or_copied_whole_resumes(two_runs, tmp_path):
    """`latest` is for people: deleted or naming anything, the run resumes from its newest complete checkpoint."""
    moved, copied = tmp_path / "moved", tmp_path / "copied"
    shutil.copytree(two_runs / "a", moved)
    shutil.copytree(two_runs / "a", copied)
    (moved / "checkpoints" / "latest").unlink()
    (copied / "checkpoints" / "latest").write_text("../../b/checkpoints/iter_000002")
    run(flow_grpo, [*TOY, "--iterations", "4", "--eval-every", "0", "--resume", "auto", "--output-dir", str(moved)])
    run(flow_grpo, [*TOY, "--iterations", "4", "--eval-every", "0", "--resume", str(copied)])
    for r in (moved, copied):
        assert (r / "checkpoints" / "latest").read_text() == "iter_000004"
        assert [m["iteration"] for m in read_metrics(r)] == [0, 1, 2, 3, 4]
        assert [m["from_iteration"] for m in markers(r)] == [3]


def a_copy_trained_on(r, tmp_path) -> Path:
    """A copy of run folder r that trained on one iteration past r's newest checkpoint, 3."""
    copy = tmp_path / "copy"
    shutil.copytree(r, copy)
    run(flow_grpo, [*TOY, "--iterations", "4", "--eval-every", "0", "--resume", str(copy)])
    return copy


def test_a_copy_that_trained_on_cannot_hand_its_checkpoint_back_to_the_original(two_runs, tmp_path, capsys):
    """The copy's iter_000004 put into the original: its metrics.jsonl lacks the copy's lines, so the checkpoint is
    refused there in one line; a new --output-dir continues it."""
    r = tmp_path / "r"
    shutil.copytree(two_runs / "a", r)
    copy = a_copy_trained_on(r, tmp_path)
    shutil.copytree(copy / "checkpoints" / "iter_000004", r / "checkpoints" / "iter_000004")
    before = snapshot(r)
    for flags in (["--resume", str(r)], ["--resume", "auto", "--output-dir", str(r)]):
        err = one_error_line(capsys, flow_grpo, [*TOY, "--iterations", "5", *flags])
        assert f"error: {r / 'checkpoints' / 'iter_000004'} is not a checkpoint this code wrote: " \
               f"{r / 'metrics.jsonl'} does not begin with the lines logged before it was saved" in err, err
    assert snapshot(r) == before
    run(flow_grpo, [*TOY, "--iterations", "5", "--eval-every", "0", "--resume", str(r), "--output-dir",
                    str(tmp_path / "new")])
    assert [m["iteration"] for m in read_metrics(tmp_path / "new")] == [4, 5]


def damage_args(r, other, kind):
    path = r / "args.json"
    if kind == "cut short":
        path.write_bytes(path.read_bytes()[:100])
    elif kind == "another run's":
        shutil.copy(other / "args.json", path)
    else:
        path.unlink()
        if kind == "a folder":
            path.mkdir()
        elif kind == "a FIFO":
            os.mkfifo(path)


@pytest.mark.parametrize("kind,why", [("deleted", "does not read (FileNotFoundError"),
                                      ("cut short", "does not read (JSONDecodeError"),
                                      ("a folder", "does not read (OSError: args.json is not a regular file)"),
                                      ("a FIFO", "does not read (OSError: args.json is not a regular file)"),
                                      ("another run's", "is another run's (not the run identity of its checkpoints)")])
def test_a_damaged_args_json_is_one_line_naming_it_not_the_checkpoints(kind, why, two_runs, tmp_path, capsys):
    """The run's checkpoints are intact: the line names args.json; the newest continues in a new --output-dir."""
    r = tmp_path / "r"
    shutil.copytree(two_runs / "a", r)
    damage_args(r, two_runs / "b", kind)
    ckpt = r / "checkpoints" / "iter_000003"
    for flags in (["--resume", str(r)], ["--resume", "auto", "--output-dir", str(r)]):
        err = one_error_line(capsys, flow_grpo, [*TOY, "--iterations", "5", *flags])
        assert f"error: {r / 'args.json'} is not a run's args.json this code wrote: it {why}" in err, err
        assert err.endswith(f"; continue {ckpt} in a new --output-dir\n") and "not a checkpoint" not in err, err
    assert sorted(os.listdir(r / "checkpoints")) == ["iter_000001", "iter_000002", "iter_000003", "latest"]
    assert [m["iteration"] for m in read_metrics(r)] == [0, 1, 2, 3]
    run(flow_grpo, [*TOY, "--iterations", "4", "--eval-every", "0", "--resume", str(r), "--output-dir",
                    str(tmp_path / "new")])
    assert [m["iteration"] for m in read_metrics(tmp_path / "new")] == [3, 4]


@pytest.mark.parametrize("resume", ["auto", "run"])
def test_an_incomplete_checkpoint_past_the_start_is_one_line_naming_it_and_nothing_is_written(resume, two_runs,
                                                                                            tmp_path, capsys):
    """An interrupted copy (iter_000003 without its checkpoint.json): the run would start at iteration 2 and its
    save of iteration 3 could not be written; refused before anything is written, naming the folder to move."""
    r = tmp_path / "r"
    shutil.copytree(two_runs / "a", r)
    (r / "checkpoints" / "iter_000003" / "checkpoint.json").unlink()
    before = snapshot(r)
    flags = ["--resume", "auto", "--output-dir", str(r)] if resume == "auto" else ["--resume", str(r)]
    err = one_error_line(capsys, flow_grpo, [*TOY, "--iterations", "5", *flags])
    assert f"error: {r / 'checkpoints' / 'iter_000003'} is past iteration 2, where this run would start: move it " \
           f"out of {r / 'checkpoints'} if it is incomplete, else continue {r / 'checkpoints' / 'iter_000002'} in a " \
           f"new or empty --output-dir (nothing in {r} is moved or deleted)\n" in err, err
    assert snapshot(r) == before
    shutil.rmtree(r / "checkpoints" / "iter_000003")                    # moved out: the run goes on from 2
    run(flow_grpo, [*TOY, "--iterations", "3", "--eval-every", "0", *flags])
    assert (r / "checkpoints" / "iter_000003" / "checkpoint.json").is_file()


def test_the_newest_checkpoint_is_the_highest_numbered_complete_one(tmp_path):
    """Numbers past 999999 sort as numbers, a folder without checkpoint.json or not named iter_ + digits is not one."""
    names = {"iter_999999": True, "iter_1000000": True, "iter_2000000": False, "iter_3000000x": True, "iter_": True}
    for name, complete in names.items():
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        if complete:
            (tmp_path / "checkpoints" / name / "checkpoint.json").write_text("{}")
    assert common.newest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "iter_1000000"
    assert common.newest_checkpoint(tmp_path, complete=False) == tmp_path / "checkpoints" / "iter_2000000"
    assert common.find_checkpoint(str(tmp_path)) == tmp_path / "checkpoints" / "iter_1000000"
    assert common.newest_checkpoint(tmp_path / "nowhere") is None


def test_non_finite_extra_state_is_never_saved(tmp_path):
    """The guard that keeps non-finite weights out of a checkpoint covers all it holds: a method's extra_state too."""
    rt, meta = common.setup_runtime(0, 1), {"trainer": "flow_grpo", "model": "toy", "lora_rank": 0, "lora_alpha": 0.0,
                                            "ema": False, "run": "r"}
    adapter = common.load_model("toy", rt)
    params = common.add_lora(adapter.transformer, 0, 0.0, [])
    for extra in ({"old": torch.tensor([1.0, math.nan])}, {"pair": [torch.zeros(2), torch.tensor([math.inf])]}):
        with pytest.raises(common.TrainingStopped, match="after iteration 1 are not finite and were not saved"):
            common.save_checkpoint(tmp_path / "a", 1, adapter, params, False, torch.optim.AdamW(params), None, 2.5,
                                   meta, rt, extra)
    assert not (tmp_path / "a" / "checkpoints").exists()


@pytest.mark.parametrize("kind", ["a FIFO", "a folder"])
def test_a_metrics_jsonl_that_is_not_a_file_is_one_line(kind, run_at_3, tmp_path, capsys):
    """Continuing in place: the checkpoint's log is not there, refused at the start (never a read that waits); a new
    run in a folder holding only that: its first write stops it."""
    r, new = tmp_path / "r", tmp_path / "new"
    shutil.copytree(run_at_3, r)
    new.mkdir()
    for folder in (r, new):
        (folder / "metrics.jsonl").unlink(missing_ok=True)
        os.mkfifo(folder / "metrics.jsonl") if kind == "a FIFO" else (folder / "metrics.jsonl").mkdir()
    err = one_error_line(capsys, flow_grpo, [*TOY, "--iterations", "5", "--resume", str(r)])
    assert f"error: {r / 'checkpoints' / 'iter_000003'} is not a checkpoint this code wrote: {r / 'metrics.jsonl'} " \
           f"does not begin with the lines logged before it was saved" in err, err
    assert sorted(os.listdir(r / "checkpoints")) == ["iter_000003", "latest"]
    with pytest.raises(SystemExit) as stop:
        common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS, [*TOY, "--output-dir", str(new)])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback" not in err, err
    assert f": could not write {new / 'metrics.jsonl'} (metrics.jsonl is not a regular file)" in err, err


def test_checkpoints_are_written_with_the_process_umask(tmp_path):
    """Readable by the group and others as any other file the run writes (safetensors makes its files 0600)."""
    for umask, folders, files, lora in [(0o022, 0o755, 0o644, []), (0o027, 0o750, 0o640, ["--lora-rank", "4"])]:
        old = os.umask(umask)
        try:
            run(flow_grpo, [*TOY, "--iterations", "1", "--eval-every", "0", *lora, "--lora-alpha", "8",
                            "--output-dir", str(tmp_path / str(umask))])
        finally:
            os.umask(old)
        paths = list((tmp_path / str(umask) / "checkpoints").rglob("*"))
        assert any(p.is_dir() for p in paths) and any(p.is_file() for p in paths)
        assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in paths} == \
            {p.name: folders if p.is_dir() else files for p in paths}


# ---- signals ----
def wait_for_lines(run_dir, n, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        path = run_dir / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"the run did not log {n} lines in time (exit {proc.poll()})")


@pytest.mark.slow  # the default suite: test_signals resumes each trainer bitwise after a SIGTERM in either phase
def test_sigterm_checkpoints_and_the_resumed_run_equals_a_straight_one(tmp_path):
    argv = [*TOY, "--iterations", "12", "--eval-every", "4", "--seed", "5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, str(ROOT / "flow_grpo.py"), *argv, "--output-dir", str(r)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for_lines(r, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    last = err.strip().splitlines()[-1]
    assert "stopped by SIGTERM at iteration" in last and f"--resume {r}" in last and "Traceback" not in err
    stopped_at = int(last.split("at iteration ")[1].split(",")[0])
    assert 2 <= stopped_at < 12 and (r / "checkpoints" / f"iter_{stopped_at:06d}").is_dir()
    run(flow_grpo, [*argv, "--output-dir", str(r), "--resume", str(r)])
    run(flow_grpo, [*argv, "--output-dir", str(tmp_path / "straight")])
    assert without_timings(read_metrics(r)) == without_timings(read_metrics(tmp_path / "straight"))
    assert all(torch.equal(x, y) for x, y in zip(trained_params(r, 12), trained_params(tmp_path / "straight", 12)))


@pytest.mark.slow  # the default suite: one process's SIGTERM, and a failure on one rank stopping both
def test_sigterm_to_torchrun_stops_both_ranks_with_a_checkpoint_that_resumes_exactly(tmp_path):
    argv = ["--model", "toy", *small(without=("prompts_per_step", "eval_every")), "--prompts-per-step", "4",
            "--iterations", "12", "--eval-every", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = tmp_path / "r"
    cmd = torchrun_cmd("flow_grpo.py", [*argv, "--output-dir", r])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for_lines(r, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "stopped by SIGTERM at iteration" in err, err[-3000:]
    stopped_at = int(err.split("stopped by SIGTERM at iteration ")[1].split(",")[0])
    assert (r / "checkpoints" / f"iter_{stopped_at:06d}").is_dir()
    torchrun("flow_grpo.py", [*argv, "--output-dir", str(r), "--resume", str(r)])
    torchrun("flow_grpo.py", [*argv, "--output-dir", str(tmp_path / "straight")])
    assert without_timings(read_metrics(r)) == without_timings(read_metrics(tmp_path / "straight"))
    assert all(torch.equal(x, y) for x, y in zip(trained_params(r, 12), trained_params(tmp_path / "straight", 12)))


def run_in_background(tmp_path, script: str, argv: list) -> tuple[subprocess.Popen, object]:
    """Runs `script` (Python, with the checkout and tests/ on its path) with argv in a process whose stderr goes to
    a file; returns the process and the file."""
    path = tmp_path / "script.py"
    path.write_text(f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n{script}")
    err = open(tmp_path / "stderr.txt", "w+")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, str(path), *map(str, argv)], stdout=subprocess.DEVNULL, stderr=err,
                            env=env, text=True), err


def wait_for(condition, proc, timeout=120):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline and proc.poll() is None, f"timed out (exit {proc.poll()})"
        time.sleep(0.1)


def test_sigterm_during_a_reward_call_that_never_returns_stops_in_one_line(tmp_path):
    """The reward server takes requests and never answers (a 600 s deadline): SIGTERM cuts the call short and the
    run stops as at any safe point, no traceback; in iteration 0 there is nothing new to save."""
    from test_rewards import fake_server
    hang = threading.Event()
    server = fake_server(lambda body: hang.wait(60) and {})
    r = tmp_path / "r"
    with server as url:
        proc, err = run_in_background(tmp_path, "import common, flow_grpo\ncommon.RemoteReward.__init__.__defaults__ = "
                                      "('cpu', 600.0, 3, 2.0)\ncommon.run_cli(flow_grpo.main, flow_grpo.Args, "
                                      "flow_grpo.MODEL_DEFAULTS)\n",
                                      [*TOY, "--eval-every", "0", "--reward", f"remote:{url}", "--output-dir", r])
        wait_for(lambda: server.bodies, proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        hang.set()
    text = open(err.name).read()
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in text, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("script.py: the reward failed ") and "SIGTERM" in last and last.endswith(
        "no optimizer step had run since the start from the untrained weights, so nothing was saved: rerun the same "
        "command to start"), text
    assert not (r / "checkpoints").exists()


def test_a_second_signal_stops_at_once_in_one_line(tmp_path):
    """A reward that takes 60 s: the first SIGTERM asks for a stop at the next safe point, the second ends the
    process at once (exit status 128 + 15), with one line and no traceback."""
    proc, err = run_in_background(tmp_path, "import time, common, flow_grpo\n"
                                  "class Slow(common.ToyReward):\n"
                                  "    def __call__(self, *a):\n"
                                  "        print('scoring', file=sys.stderr, flush=True)\n"
                                  "        time.sleep(60)\n"
                                  "common.REWARDS['toy'] = Slow\n"
                                  "common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS)\n",
                                  [*TOY, "--output-dir", tmp_path / "r"])
    wait_for(lambda: "scoring" in open(err.name).read(), proc)
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received:" in open(err.name).read(), proc)
    tic = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    text = open(err.name).read()
    assert proc.returncode == 128 + signal.SIGTERM and time.time() - tic < 10 and "Traceback" not in text, text
    assert text.strip().splitlines()[-1] == "SIGTERM received again: stopping at once, without a checkpoint"


def test_an_error_after_an_optimizer_step_saves_nothing_and_names_the_newest_checkpoint(tmp_path, capsys,
                                                                                        monkeypatch):
    """SMALL: 2 optimizer steps per iteration; the 3rd (iteration 1's first) raises after changing the weights, so
    iteration 1's starting state is gone: nothing is saved, the line names iteration 1's checkpoint."""
    real, calls = torch.optim.AdamW.step, []

    def step(self, *a, **k):
        real(self, *a, **k)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the device fell off the bus")
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    r = tmp_path / "r"
    with pytest.raises(SystemExit) as stop:
        common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS,
                       [*TOY, "--iterations", "3", "--eval-every", "0", "--save-every", "1", "--output-dir", str(r)])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback" in err                     # an unexpected error keeps its traceback
    assert err.strip().splitlines()[-1].endswith(
        ": RuntimeError: the device fell off the bus; iteration 1 had begun its update, so its state was not saved: "
        f"the newest checkpoint is iter_000001, continue with --resume {r}")
    assert sorted(p.name for p in (r / "checkpoints").iterdir()) == ["iter_000001", "latest"]


def test_an_error_before_the_update_checkpoints_the_iterations_starting_state(tmp_path, capsys, monkeypatch):
    real = flow_grpo.group_advantages
    calls = []

    def fail_in_iteration_1(*a):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("out of RAM")
        return real(*a)
    monkeypatch.setattr(flow_grpo, "group_advantages", fail_in_iteration_1)
    r = tmp_path / "r"
    with pytest.raises(SystemExit) as stop:
        common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS,
                       [*TOY, "--iterations", "3", "--eval-every", "0", "--output-dir", str(r)])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.strip().splitlines()[-1].endswith(
        f": MemoryError: out of RAM; checkpoint iter_000001 saved: continue with --resume {r}"), err
    assert (r / "checkpoints" / "latest").read_text() == "iter_000001"


class BrokenReward(common.ToyReward):
    def __call__(self, images, prompts, metadata=None):
        raise MemoryError("out of RAM")


def test_an_error_before_the_first_optimizer_step_saves_nothing_and_the_same_command_goes_on(tmp_path, capsys,
                                                                                             monkeypatch):
    """Before its first optimizer step a run holds the weights it started from (untrained, or the checkpoint it
    resumed): nothing is written (a full fine-tune's checkpoint is tens of GB) and the same command, rerun, starts
    over or continues, however many times it failed."""
    r = tmp_path / "r"
    fresh = [*TOY, "--iterations", "2", "--eval-every", "0", "--output-dir", str(r)]
    resume = [*TOY, "--iterations", "3", "--eval-every", "0", "--resume", str(r)]
    for argv, start in [(fresh, "the untrained weights"), (resume, "iter_000002")]:
        for _ in range(2):
            with monkeypatch.context() as m, pytest.raises(SystemExit) as stop:
                m.setitem(common.REWARDS, "toy", BrokenReward)
                common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS, argv)
            last = capsys.readouterr().err.strip().splitlines()[-1]
            assert stop.value.code == 1 and last.endswith(
                f": the reward failed MemoryError: out of RAM; no optimizer step had run since the start from "
                f"{start}, so nothing was saved: rerun the same command to {'start' if argv is fresh else 'continue'}")
            assert sorted(p.name for p in r.glob("checkpoints/*")) == ([] if argv is fresh else
                                                                      ["iter_000002", "latest"])
        run(flow_grpo, argv)
    assert [m["iteration"] for m in read_metrics(r)] == [0, 1, 2, 3]
    assert sorted(p.name for p in r.glob("checkpoints/*")) == ["iter_000002", "iter_000003", "latest"]


# ---- one writer per run folder ----
HOLDER = """import common, flow_grpo
args = flow_grpo.Args(model="toy", output_dir=sys.argv[1], resume="auto", iterations=100)  # as a trainer would
common.prepare_run(args, common.setup_runtime(0, 1), "flow_grpo")
print("holding", file=sys.stderr, flush=True)
sys.stdin.read()
"""


def test_a_folder_held_by_a_live_run_is_refused_naming_it_and_is_free_once_it_dies(tmp_path, capsys, monkeypatch):
    r = tmp_path / "r"
    holder, err = run_in_background(tmp_path, HOLDER, [r])
    wait_for(lambda: "holding" in open(err.name).read(), holder)
    before = snapshot(r)
    with monkeypatch.context() as m:
        m.setattr(common, "load_model", lambda *a: pytest.fail("a model loaded"))
        for extra in ([], ["--resume", "auto"]):
            message = one_error_line(capsys, flow_grpo, [*TOY, "--output-dir", str(r), *extra])
            assert f"{r} is in use by another run (pid {holder.pid} on host {socket.gethostname()}): wait for it " \
                   f"to end or stop it, or pass another --output-dir" in message
    assert snapshot(r) == before
    holder.kill()                                                            # as a crash: nothing is cleaned up
    holder.wait()
    run(flow_grpo, [*TOY, "--iterations", "1", "--output-dir", str(r)])
    assert [m["iteration"] for m in read_metrics(r)] == [0, 1]
    holder, err = run_in_background(tmp_path, HOLDER, [r])                  # a finished run lets go of its folder
    wait_for(lambda: "holding" in open(err.name).read(), holder)
    holder.kill()
    holder.wait()


@pytest.mark.parametrize("lock", ["a link", "a folder"])
def test_a_lock_that_is_not_a_file_is_refused_in_one_line_and_followed_nowhere(lock, tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / "victim.txt").write_text("kept")
    if lock == "a link":
        (d / ".lock").symlink_to("victim.txt")
    else:
        (d / ".lock").mkdir()
    before = snapshot(d)
    err = one_error_line(capsys, flow_grpo, [*TOY, "--output-dir", str(d)])
    assert f"{d / '.lock'} is not the run's lock file" in err and "remove it, or pass another --output-dir" in err
    assert snapshot(d) == before and sorted(os.listdir(d)) == [".lock", "victim.txt"]
    assert (d / ".lock").is_symlink() == (lock == "a link")


# ---- a checkpoint resumed on another number of ranks ----
def test_a_checkpoint_resumed_on_another_number_of_ranks_says_what_changes(tmp_path, capsys):
    argv = ["--model", "toy", *small(without=("prompts_per_step",)), "--prompts-per-step", "4", "--eval-every", "0"]
    r = tmp_path / "r"
    torchrun("flow_grpo.py", [*argv, "--iterations", "1", "--output-dir", str(r)])
    capsys.readouterr()
    run(flow_grpo, [*argv, "--iterations", "2", "--output-dir", str(r), "--resume", str(r)])
    out = capsys.readouterr().out
    assert "checkpoint iter_000001 was trained on 2 ranks and this run has 1: each rank now takes 1/1 of " \
           "--prompts-per-step with its own seeds" in out, out
    info = [json.loads((r / "checkpoints" / f"iter_00000{i}" / "checkpoint.json").read_text()) for i in (1, 2)]
    assert [i["world_size"] for i in info] == [2, 1]
    run(flow_grpo, [*argv, "--iterations", "3", "--output-dir", str(r), "--resume", str(r)])
    assert "was trained on" not in capsys.readouterr().out                 # the same number: nothing to say


# ---- bad input: one line that names the fix, before any model loads ----
def bad_prompt_files(tmp_path) -> list[tuple[str, str]]:
    """(path, expected message) for malformed prompt files."""
    cases = {
        "latin1.txt": (b"a red circle\ncaf\xe9 au lait\n", "is not UTF-8 text"),
        "empty.txt": (b"\n  \n", "holds no prompts"),
        "blank_then_bad.jsonl": (b'{"prompt": "a red circle"}\n\n\n{"text": "x"}\n', ":4 is not a JSON object"),
        "not_a_string.jsonl": (b'{"prompt": 5}\n', ":1 is not a JSON object with a non-empty string"),
        "eval_only.jsonl": (b'{"prompt": "a red circle", "split": "eval"}\n', "has no training prompts"),
        "bad_split.jsonl": (b'{"prompt": "a red circle", "split": "val"}\n', "split 'val': use 'train' or 'eval'"),
        "not_toy.txt": (b"a red circle\na photo of a cat\n", ":2: 'a photo of a cat' is not a toy prompt"),
    }
    out = []
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        out.append((str(tmp_path / name), message))
    return out


BAD_FLAGS = [
    (["--group-size", "0"], "--group-size 0 must be at least 2"),
    (["--micro-batch", "0"], "--micro-batch 0 must be at least 1"),
    (["--prompts-per-step", "-2"], "--prompts-per-step -2 must be at least 1"),
    (["--eval-images", "0"], "--eval-images 0 must be at least 1"),
    (["--sample-steps", "0"], "--sample-steps 0 must be at least 1"),
    (["--iterations", "-1"], "--iterations -1 must be at least 0"),
    (["--lr", "nan"], "--lr nan must be at least 1e-12 and at most 1 (it is not a number)"),
    (["--grad-clip", "1e39"], "--grad-clip 1e+39 must be at least 1e-12 and at most 3.4e+38, float32's largest"),
    (["--weight-decay=-1e39"], "--weight-decay -1e+39 must be at least 0"),
    (["--max-bad-steps", "0"], "--max-bad-steps 0 must be at least 1"),
    (["--reward", "aesthetics"], "unknown or repeated reward 'aesthetics'"),
    (["--reward", "toy:nan"], "bad weight 'nan' for reward 'toy'"),
    (["--resume", "no/such/run"], "--resume no/such/run: no checkpoint there"),
]
METHOD_FLAGS = {
    "flow_grpo": [(["--updates-per-rollout", "0"], "--updates-per-rollout 0 must be at least 1"),
                  (["--sample-steps", "1"], "--timestep-fraction 0.99 of --sample-steps 1 trains no step"),
                  (["--timestep-fraction", "0"], "--timestep-fraction 0.0 of --sample-steps 4 trains no step"),
                  (["--noise-level", "0", "--beta", "0.1"], "--noise-level 0.0 must be at least")],
    "pro_grpo": [(["--timestep-fraction", "0"], "--timestep-fraction 0.0 of --sample-steps 4 trains no step"),
                 (["--funnel", "8,9"], "--funnel '8,9' must decrease strictly")],
    "v_grpo": [(["--updates-per-rollout", "0"], "--updates-per-rollout 0 must be at least 1"),
               (["--mc-pairs", "0"], "--mc-pairs 0 must be between 1")],
    "g2rpo": [(["--granularities", "0"], "--granularities '0' must list distinct positive integers"),
              (["--noise-level", "0"], "--noise-level 0.0 must be at least")],
}


def one_error_line(capsys, module, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        common.run_cli(module.main, module.Args, module.MODEL_DEFAULTS, argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert "Traceback" not in err and len([ln for ln in err.splitlines() if "error:" in ln]) == 1, err
    return err


@pytest.mark.parametrize("trainer", TRAINERS)
def test_bad_input_gives_one_clear_line_and_no_traceback(trainer, tmp_path, capsys):
    module = importlib.import_module(trainer)
    out = ["--output-dir", str(tmp_path / "never"), *own(trainer, "FITS_SMALL")]
    cases = [(["--prompts", path], message) for path, message in bad_prompt_files(tmp_path)]
    cases += BAD_FLAGS + METHOD_FLAGS.get(trainer, [])
    for flags, message in cases:
        err = one_error_line(capsys, module, [*TOY, *out, *flags])
        assert message in err, (flags, err)
    assert not (tmp_path / "never").exists()                             # refused before anything was written
    (tmp_path / "a_file").write_text("x")
    err = one_error_line(capsys, module, [*TOY, *own(trainer, "FITS_SMALL"), "--output-dir",
                                          str(tmp_path / "a_file" / "run")])
    assert f"cannot write to --output-dir {tmp_path / 'a_file' / 'run'} (Not a directory): pass a writable " \
           f"folder" in err


def test_the_real_entry_point_prints_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "g2rpo.py"), "--micro-batch", "0", "--output-dir",
                          str(tmp_path / "r")], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    errors = [ln for ln in out.stderr.splitlines() if "error" in ln.lower()]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert errors == ["g2rpo.py: error: --micro-batch 0 must be at least 1"], out.stderr


@pytest.mark.parametrize("script,argv,message", [
    ("flow_grpo.py", [*TOY, "--micro-batch", "0"], "flow_grpo.py: error: --micro-batch 0 must be at least 1"),
    pytest.param("flow_grpo.py", [*TOY, "--micro-batch", "x"],  # slow: argparse's line, the same path as the others
                 "flow_grpo.py: error: argument --micro-batch: invalid int value", marks=pytest.mark.slow),
    ("common.py", ["evaluate", "--model", "toy", "--steps", "0"],
     "common.py evaluate: error: --steps 0 must be at least 1"),
])
def test_under_torchrun_the_workers_line_is_the_root_cause(script, argv, message, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(torchrun_cmd(script, [*argv, "--output-dir" if script != "common.py" else "--output",
                                               tmp_path / "r"]),
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    cause = out.stderr.split("Root Cause")[-1]
    assert out.returncode != 0 and f"traceback : {message}" in cause and "<N/A>" not in cause, out.stderr[-3000:]
    assert not (tmp_path / "r").exists()


def test_validation_never_uses_assert():
    """`python -O` strips asserts: no check of the project's own code may rely on one."""
    for path in [ROOT / "common.py", *(ROOT / f"{t}.py" for t in TRAINERS)]:
        tree = ast.parse(path.read_text())
        assert not [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)], path.name
