"""A bad start-up is one line on stderr and exit status 2, never a traceback, and nothing loads or is written
first where the flags alone tell: tables of (flags, the words the line must contain), this file's STARTUP run for
every trainer, and each trainer's own STARTUP rows from its tests/test_<trainer>.py (with the FITS_SMALL flags it
needs at the SMALL sizes), so a forked trainer brings its rows with its test file. {tmp} in a flag is the test's
folder, {tiny-flux} / {tiny-sd3} the tiny pipelines. Then what is not a start-up: a full disk while logging or
writing a grid, prompt files that must be read, an optimizer step that overflows the weights."""
import datetime
import importlib
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import common
from helpers import ROOT, SMALL, TRAINERS, own, tiny_argv


def small_run(trainer: str) -> list[str]:
    """The SMALL sizes, with what the trainer's method needs to fit them."""
    return [*SMALL, *own(trainer, "FITS_SMALL")]


NO_PIPELINE, CHECKPOINTS = "{tmp}/not_a_pipeline", "{tmp}/run0/checkpoints"
STARTUP = [
    (["--seed", "-1"], "--seed -1 must be at least 0"),
    (["--seed", "1e23"], "argument --seed: invalid int value: '1e23'"),
    (["--seed", str(2**64)], f"--seed {2**64} must be at least 0 and at most {2**63 - 1}"),
    (["--model-path", "/nonexistent"], "no toy weights in /nonexistent"),
    (["--model-path", "{tmp}/cut_short"], "cut_short/transformer/config.json is missing or not a JSON object"),
    (["--model", "sd3", "--model-path", "/nonexistent"], "--model-path /nonexistent does not exist"),
    (["--model", "flux", "--model-path", NO_PIPELINE], "is not a diffusers pipeline folder"),
    (["--model", "flux", "--model-path", "{tmp}/cut_short"],
     "cut_short/transformer/config.json is missing or not a JSON object: save the pipeline again"),
    (["--model", "sd3", "--model-path", "{tmp}/no_transformer"],
     "no_transformer/transformer/config.json is missing or not a JSON object"),
    (["--model", "sd3", "--model-path", "{tmp}/bad_index"],
     "bad_index/model_index.json is missing or not a JSON object"),
    (["--model", "sd3", "--model-path", "nobody/no-such-model"],
     "the model repository nobody/no-such-model is not in the hub cache and HF_HUB_OFFLINE is set: download it "
     "with `hf download nobody/no-such-model`, or set HF_HUB_OFFLINE=0"),
    (["--model", "flux", "--model-path", "random:99999999"], "--model-path random:99999999: write random (full depth) "
                                                             "or random:N with 1 <= N <= 38 blocks"),
    (["--model", "sd3", "--model-path", "random:25"], "or random:N with 1 <= N <= 24 blocks"),
    (["--model-path", "random:1"], "no toy weights in random:1"),
    (["--model", "flux", "--resolution", "0"], "--resolution 0 must be at least 16"),
    (["--model", "sd3", "--resolution", "7"], "--resolution 7 must be at least 16"),
    (["--model", "flux", "--resolution", "-16"], "--resolution -16 must be at least 16"),
    (["{tiny-flux}", "--resolution", "24"], "--resolution 24 must be a positive multiple of 16 for FLUX"),
    (["{tiny-sd3}", "--resolution", "40"], "--resolution 40 must be a positive multiple of 16 for SD3"),
    (["--max-sequence-length", "-5"], "--max-sequence-length -5 must be at least 1"),
    (["--max-sequence-length", "0"], "--max-sequence-length 0 must be at least 1"),
    (["--max-sequence-length", "513"], "--max-sequence-length 513 must be at least 1 and at most 512"),
    (["--guidance-scale", "nan"], "--guidance-scale nan must be at least 0"),
    (["--lr", "1e38"], "--lr 1e+38 must be at least 1e-12 and at most 1"),
    (["--lr", "inf"], "--lr inf must be at least 1e-12 and at most 1"),
    (["--guidance-scale", "1e39"], "--guidance-scale 1e+39 must be at least 0"),  # finite, not in float32
    (["--iterations", str(10**20)], f"--iterations {10**20} must be at least 0 and at most 1000000000"),
    (["--model", "sd3", "--resolution", "8192"], "--resolution 8192 must be at least 16 and at most 4096"),
    (["--weight-decay=-inf"], "--weight-decay -inf must be at least 0"),
    (["--time-budget", "nan"], "--time-budget nan must be at least 0"),
    (["--wandb"], "--wandb needs the wandb package: pip install wandb, or drop --wandb"),
    (["--prompts", "{tmp}/deep.jsonl"], "deep.jsonl:1 is not a JSON object"),
    (["--output-dir", ""], "--output-dir '' is empty"),
    (["--resume", ""], "--resume '' is empty"),
    (["--resume", f"{CHECKPOINTS}/iter_000001"], "iter_000001 is not a checkpoint this code wrote: checkpoint.json "
                                                 "does not read (JSONDecodeError"),
    (["--resume", f"{CHECKPOINTS}/iter_000002"], "iter_000002 is not a checkpoint this code wrote: checkpoint.json "
                                                 "has no sha256; pass another checkpoint, or resume from an earlier "
                                                 "one in a new --output-dir"),
    (["--reward", "toy:1e39"], "weight 1e39 for reward 'toy' in --reward 'toy:1e39' is beyond float32"),
    (["--model", "flux", "--reward", "toy"], "--reward toy scores the toy world's shapes, not flux images"),
    (["--model", "sd3", "--reward", "jpeg,toy-soft:0.5"], "scores the toy world's shapes, not sd3 images"),
]


def make_files(tmp: Path):
    """The files the table names: a folder that is not a pipeline, pipelines with a damaged or missing config, a
    .jsonl nested 100,000 deep, a run whose checkpoints have a corrupt checkpoint.json and one naming an unknown
    model."""
    (tmp / "not_a_pipeline").mkdir()
    (tmp / "not_a_pipeline" / "config.json").write_text("{}")
    (tmp / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    for name, index, config in [("cut_short", "{}", '{"_class_name": "Flux'), ("no_transformer", "{}", None),
                                ("bad_index", "[]", "{}")]:  # a truncated config, none, an index not an object
        (tmp / name / "transformer").mkdir(parents=True)
        (tmp / name / "model_index.json").write_text(index)
        if config is not None:
            (tmp / name / "transformer" / "config.json").write_text(config)
    for name, info in [("iter_000001", '{"model": "toy", "iter'), ("iter_000002", '{"model": "sdxl", "iteration": 2}')]:
        folder = tmp / "run0" / "checkpoints" / name
        folder.mkdir(parents=True)
        (folder / "training_state.pt").write_bytes(b"")
        (folder / "checkpoint.json").write_text(info)


def one_line(capsys, module, argv: list[str], code: int = 2) -> str:
    """Runs the trainer's command line; asserts the exit status `code` and one line on stderr (besides the progress
    bars of a pipeline being read), no traceback."""
    with pytest.raises(SystemExit) as stop:
        common.run_cli(module.main, module.Args, module.MODEL_DEFAULTS, argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not re.search(r"\| *\d+/\d+ \[", ln)]  # not tqdm's
    assert stop.value.code == code and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


CASES = [(trainer, flags, words) for trainer in TRAINERS for flags, words in [*STARTUP, *own(trainer, "STARTUP")]]


@pytest.mark.parametrize("trainer,flags,words", CASES, ids=[f"{t} {' '.join(f)}" for t, f, _ in CASES])
def test_a_bad_startup_is_one_line(trainer, flags, words, tmp_path, capsys, monkeypatch):
    module = importlib.import_module(trainer)
    monkeypatch.setitem(os.environ, "HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setitem(sys.modules, "wandb", None)                # `import wandb` fails as if it were not installed
    make_files(tmp_path)
    tiny = {f"{{tiny-{f}}}": tiny_argv(trainer, f) for f in ("flux", "sd3") if f"{{tiny-{f}}}" in flags}
    capsys.readouterr()                                             # what building a tiny pipeline printed
    argv = [a for f in flags for a in tiny.get(f, [f.replace("{tmp}", str(tmp_path))])]
    out = tmp_path / "out"
    err = one_line(capsys, module, [*small_run(trainer), "--output-dir", str(out), *argv])
    assert "error: " in err and words in err, err
    assert tiny or not out.exists()                                 # refused before the run folder was made


LAUNCHER = [
    ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_RANK=0 and LOCAL_WORLD_SIZE=0: torchrun sets integers, 0 <= LOCAL_RANK < "
                                "LOCAL_WORLD_SIZE; launch with torchrun, or unset those left in the shell"),
    ({"RANK": "1"}, "RANK=1 and WORLD_SIZE=1: torchrun sets integers, 0 <= RANK < WORLD_SIZE"),  # a stale RANK
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 without torchrun's MASTER_ADDR and MASTER_PORT (a port 1-65535; "
                          "MASTER_PORT=''): launch with torchrun, or unset WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, "(a port 1-65535; MASTER_PORT='99999')"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}, "(a port 1-65535; MASTER_PORT='0')"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "x"}, "WORLD_SIZE=2 without"),
    ({"RANK": "x"}, "RANK=x and WORLD_SIZE=1: torchrun sets integers"),
    ({"WORLD_SIZE": "2.0"}, "RANK=0 and WORLD_SIZE=2.0: torchrun sets integers"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 and LOCAL_WORLD_SIZE=1: torchrun sets integers"),
]


@pytest.mark.parametrize("env,words", LAUNCHER, ids=[" ".join(f"{k}={v}" for k, v in e.items()) for e, _ in LAUNCHER])
def test_the_launchers_variables_each_earn_one_line(env, words, tmp_path, capsys, monkeypatch):
    """A variable left in a shell, or WORLD_SIZE without torchrun: one line on stderr (whatever RANK says), before
    anything is written."""
    module = importlib.import_module(TRAINERS[0])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    err = one_line(capsys, module, [*small_run(TRAINERS[0]), "--output-dir", str(out)])
    assert "error: " in err and words in err, err
    assert not out.exists()


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_a_rank_waiting_for_the_others_says_what_it_waits_for_then_gives_up_in_one_line(capsys, monkeypatch):
    """A full set of torchrun's variables left in a shell, no other rank (not torchrun's worker): at once one line says
    what this rank waits for (the world size, the address and port) and how long; at that limit (here 1 s, shortened),
    one line and exit status 2 (before: no line of ours, for 30 minutes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])                  # nothing listens there
    env = {**ENV, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    env.pop("TORCHELASTIC_RUN_ID", None)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    proc = subprocess.Popen([sys.executable, "-c", "import common; common.setup_runtime(0, 1)"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line, deadline = "", time.time() + 60  # the imports, then at once
        while not line.startswith("rank 1:"):
            assert select.select([proc.stderr], [], [], max(0.0, deadline - time.time()))[0], "no line within 60 s"
            line = proc.stderr.readline()
            assert line, proc.wait()
        assert line.strip() == f"rank 1: waiting for the 2 ranks of WORLD_SIZE at 127.0.0.1:{port} (MASTER_ADDR:" \
                               f"MASTER_PORT); gives up after 30 min without them (a rank other than 0 retries once)"
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.communicate()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(common.dist, "default_pg_timeout", datetime.timedelta(seconds=1))
    with pytest.raises(SystemExit) as stop:
        common.setup_runtime(0, 1)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rank")]
    assert stop.value.code == 2 and not common.dist.is_initialized() and len(err) == 2, err
    assert err[1].startswith(f"rank 1: the 2 ranks did not all join at 127.0.0.1:{port} (DistNetworkError: ") and \
        err[1].endswith("): launch them with torchrun, or unset RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"), err


def test_an_unusable_inductor_cache_is_one_line_under_compile_and_costs_nothing_without(tmp_path, capsys,
                                                                                       monkeypatch):
    """TORCHINDUCTOR_CACHE_DIR under a file: torch makes that folder when diffusers imports it, compiled or not
    (before: a traceback in every trainer and evaluate); without --compile the run goes on."""
    (tmp_path / "a_file").write_text("")
    cache = tmp_path / "a_file" / "cache"
    argv = [sys.executable, ROOT / "flow_grpo.py", "--model", "toy", *SMALL, "--iterations", "1", "--eval-every", "0"]
    done = subprocess.run([*map(str, argv), "--output-dir", str(tmp_path / "r")], capture_output=True, text=True,
                          env={**ENV, "TORCHINDUCTOR_CACHE_DIR": str(cache)}, timeout=300)
    assert done.returncode == 0 and (tmp_path / "r" / "checkpoints" / "latest").is_file(), done.stderr[-2000:]
    module = importlib.import_module(TRAINERS[0])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    err = one_line(capsys, module, [*small_run(TRAINERS[0]), "--compile", "--output-dir", str(tmp_path / "out")])
    assert f"error: cannot write to TORCHINDUCTOR_CACHE_DIR {cache} (Not a directory): pass a writable folder" in err
    assert not (tmp_path / "out").exists()


def test_compile_without_a_cxx_compiler_is_one_line_before_anything_loads(tmp_path, capsys, monkeypatch):
    """Before: a traceback once the model had loaded, saying to rerun the same command."""
    import torch._inductor.config
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", (None, str(tmp_path / "no-such-g++")))
    monkeypatch.setattr(common, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for trainer in TRAINERS:
        err = one_line(capsys, importlib.import_module(trainer), [*small_run(trainer), "--compile", "--output-dir",
                                                                  str(tmp_path / "out")])
        assert "error: --compile needs a C++ compiler (g++, or the one CXX names), not found here: install one, or " \
               "drop --compile" in err, err
    with pytest.raises(SystemExit) as stop:
        common.evaluate_main(["--model", "toy", "--compile", "--output", str(tmp_path / "out")])
    assert stop.value.code == 2 and "--compile needs a C++ compiler" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bf16_on_a_cpu_without_native_bf16_says_it_will_be_slow(tmp_path):
    """oneDNN limited to AVX2 stands in for a processor without AVX-512 BF16 or AMX (lscpu: no avx512_bf16, no
    amx_bf16), where a bf16 matrix product is emulated, about 85x slower than float32's: one line at the start, and
    none in float32 or where bf16 is native."""
    code = "import common; common.setup_runtime(0, 1, {!r})"
    avx2 = {**ENV, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    said = [subprocess.run([sys.executable, "-c", code.format(dtype)], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=120).stdout for dtype, env in [("bf16", avx2), ("fp32", avx2)]]
    assert said == ["--dtype bf16: this CPU (AVX2) has neither AVX-512 BF16 nor AMX, so its bf16 matrix products are "
                    "emulated and the run will take many times as long as in float32 (--dtype fp32; README, "
                    "Precision)\n", ""], said
    import torch
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    here = subprocess.run([sys.executable, "-c", code.format("bf16")], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=120).stdout
    assert (here == "") == native, here


def test_a_working_folder_that_cannot_be_written_names_output_dir(tmp_path, capsys, monkeypatch):
    """Without --output-dir a run makes runs/ in the working folder; where it cannot (a read-only one, or one removed
    since): one line naming --output-dir."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    module = importlib.import_module(TRAINERS[0])
    err = one_line(capsys, module, small_run(TRAINERS[0]))
    assert "error: cannot write to --output-dir runs (No such file or directory): pass a writable folder" in err, err


def test_a_forked_trainer_brings_its_rows_with_its_test_file(tmp_path, monkeypatch):
    (tmp_path / "test_my_method.py").write_text('STARTUP = [(["--my-flag", "0"], "--my-flag 0 must be at least 1")]\n'
                                                'FITS_SMALL = ["--group-size", "8"]\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert own("my_method", "STARTUP") == [(["--my-flag", "0"], "--my-flag 0 must be at least 1")]
    assert small_run("my_method") == [*SMALL, "--group-size", "8"] and own("no_such_method", "STARTUP") == []
    assert ("pro_grpo", ["--baseline-group", "0"], "--baseline-group 0 must be at least 2") in CASES


def full_disk_after(monkeypatch, name: str, good_writes: int):
    """os.write to a file called `name` succeeds `good_writes` times, then writes half its bytes and fails as on a
    full disk (ENOSPC)."""
    real, calls = os.write, []

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(name):
            calls.append(fd)
            if len(calls) > good_writes:
                real(fd, data[:len(data) // 2])
                raise OSError(28, "No space left on device")
        return real(fd, data)
    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_full_disk_while_logging_stops_in_one_line_and_no_line_is_cut(trainer, tmp_path, capsys, monkeypatch):
    module = importlib.import_module(trainer)
    full_disk_after(monkeypatch, "metrics.jsonl", good_writes=1)      # iteration 0's line, then the disk is full
    out = tmp_path / "run"
    err = one_line(capsys, module, [*small_run(trainer), "--iterations", "2", "--eval-every", "0", "--output-dir",
                                    str(out)], 1)
    assert f"could not write {out / 'metrics.jsonl'} (No space left on device): free disk space" in err
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(line)["iteration"] for line in text.splitlines()] == [0]


def test_a_full_disk_while_writing_an_evaluation_grid_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    module = importlib.import_module(TRAINERS[0])
    real = Path.write_bytes

    def write_bytes(self, data):
        if ".png" in self.name:
            real(self, data[:100])
            raise OSError(28, "No space left on device")
        return real(self, data)
    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    out = tmp_path / "run"
    err = one_line(capsys, module, [*small_run(TRAINERS[0]), "--iterations", "1", "--output-dir", str(out)], 1)
    assert f"could not write {out / 'eval_000000.png'} (No space left on device)" in err
    assert not list(out.glob("*.png*"))                               # neither the grid nor its temporary file


@pytest.mark.parametrize("name", ["bom.jsonl", "BOM.JSONL", "bom.txt"])
def test_a_byte_order_mark_and_an_upper_case_suffix_are_read(name, tmp_path):
    lines = ['{"prompt": "a red circle"}', '{"prompt": "a blue square", "split": "eval"}']
    if name.endswith(".txt"):
        lines = ["a red circle", "a blue square"]
    (tmp_path / name).write_bytes("\ufeff".encode() + "\n".join(lines).encode())
    train, evals = common.load_prompts(str(tmp_path / name), "toy")
    assert {r["prompt"] for r in train + evals} == {"a red circle", "a blue square"}


@pytest.mark.parametrize("name", ["p.jsonl", "p.txt"])
def test_prompt_files_are_split_at_newlines_alone(name, tmp_path):
    """JSON Lines (and text) split at \n only: a prompt may hold U+2028, U+2029, U+0085, form feeds (valid JSON, as
    json.dumps(..., ensure_ascii=False) writes them); \r\n line ends are read too."""
    odd = "a red circle\u2028\u2029\x85\x0c\x1c under a sky"
    lines = [json.dumps({"prompt": odd}, ensure_ascii=False), json.dumps({"prompt": "a blue square", "split": "eval"})]
    if name.endswith(".txt"):
        lines = [odd, "a blue square"]
    (tmp_path / name).write_text("\r\n".join(lines) + "\r\n", encoding="utf-8", newline="")
    train, evals = common.load_prompts(str(tmp_path / name), "toy")
    assert odd in [r["prompt"] for r in train + evals] and "a blue square" in [r["prompt"] for r in train + evals]


def test_a_step_that_overflows_the_weights_stops_the_run():
    """A finite gradient and learning rate whose update is not finite in the weights' float32: stopped at once."""
    import torch
    p = torch.nn.Parameter(torch.full((4,), 3e38))
    opt = torch.optim.SGD([p], lr=1e38)
    guard = common.StepGuard(3, torch.device("cpu"))
    (-p.sum()).backward()                                             # gradient -1: the step adds lr = 1e38
    with pytest.raises(common.TrainingStopped, match="made the weights non-finite"):
        guard.step(opt, [p], grad_clip=10.0)
