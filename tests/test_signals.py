"""A preempted run keeps its work: SIGTERM during the rollout stops at the next rollout micro-batch and saves the
iteration's starting state (the rollout is dropped, no optimizer step has run); during the update, the update
finishes and its result is saved. Either checkpoint resumes bitwise into the run that was never stopped."""
import contextlib
import importlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import common
from helpers import (ROOT, SMALL, SMALL_SIZES, TRAINERS, own, read_metrics, run, small, torchrun, torchrun_cmd,
                     trained_params, without_timings)



def signal_in(phase: str, iteration: int, monkeypatch) -> list:
    """Makes the model send this process SIGTERM at its first velocity call of `phase` ("rollout": without
    gradient, "update": with) in `iteration`; returns the list of the rollout calls of that iteration that
    follow it."""
    load, after = common.load_model, []

    def loaded(*args, **kwargs):
        adapter = load(*args, **kwargs)
        velocity = adapter.velocity

        def signalling(*a, **k):
            loop = common.TrainingLoop.active
            if loop is not None and loop.it == iteration:
                in_phase = torch.is_grad_enabled() == (phase == "update")
                if after or (in_phase and common._SIGNALLED["signum"]):
                    after.append(torch.is_grad_enabled())
                elif in_phase:
                    os.kill(os.getpid(), signal.SIGTERM)
            return velocity(*a, **k)
        adapter.velocity = signalling
        return adapter
    monkeypatch.setattr(common, "load_model", loaded)
    return after


@pytest.mark.parametrize("phase", ["rollout", "update"])
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_signal_saves_the_iteration_it_can_and_resumes_bitwise(trainer, phase, tmp_path, monkeypatch):
    module = importlib.import_module(trainer)
    argv = ["--model", "toy", *SMALL, *own(trainer, "FITS_SMALL"), "--eval-every", "0", "--seed", "3"]
    r = tmp_path / "r"
    after = signal_in(phase, 1, monkeypatch)
    with pytest.raises(SystemExit) as stop:
        common.run_cli(module.main, module.Args, module.MODEL_DEFAULTS, [*argv, "--iterations", "3",
                                                                         "--output-dir", str(r)])
    assert stop.value.code == 128 + signal.SIGTERM
    saved = 1 if phase == "rollout" else 2                  # the rollout is dropped; the update is finished
    assert (r / "checkpoints" / "latest").read_text() == f"iter_{saved:06d}"
    if phase == "rollout":                                  # only the micro-batch under way finishes
        assert 0 < len(after) < SMALL_SIZES["sample_steps"] and not any(after), after
    monkeypatch.undo()
    run(module, [*argv, "--iterations", "3", "--output-dir", str(r), "--resume", str(r)])
    run(module, [*argv, "--iterations", "3", "--output-dir", str(tmp_path / "straight")])
    assert without_timings(read_metrics(r)) == without_timings(read_metrics(tmp_path / "straight"))
    assert all(torch.equal(x, y) for x, y in zip(trained_params(r, 3), trained_params(tmp_path / "straight", 3)))


def test_a_signal_before_the_first_update_of_a_fresh_run_saves_nothing(tmp_path, monkeypatch, capsys):
    import flow_grpo
    argv = ["--model", "toy", *SMALL, "--eval-every", "0", "--iterations", "2", "--output-dir", str(tmp_path / "r")]
    signal_in("rollout", 0, monkeypatch)
    with pytest.raises(SystemExit) as stop:
        common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS, argv)
    assert stop.value.code == 128 + signal.SIGTERM and not (tmp_path / "r" / "checkpoints").exists()
    assert "stopped by SIGTERM before the first optimizer step since the start from the untrained weights, so " \
           "nothing was saved: rerun the same command to start" in capsys.readouterr().err
    monkeypatch.undo()
    run(flow_grpo, argv)                                    # the same command
    assert [m["iteration"] for m in read_metrics(tmp_path / "r")] == [0, 1, 2]


def test_a_signal_in_an_evaluation_of_the_ema_is_acted_on_once_the_trained_weights_are_back(tmp_path, monkeypatch):
    """--ema evaluates the EMA's weights swapped into the model. A SIGTERM during that evaluation, with a check for it
    right there (as a method's loop.each inside its own swapped-in copy, an old policy, makes), waits until the
    weights are swapped back: the checkpoint holds the trained weights, not the EMA's, and resumes bitwise."""
    import flow_grpo
    argv, load, inside = ["--model", "toy", *SMALL, "--ema", "--seed", "3"], common.load_model, []

    def loaded(*args, **kwargs):
        adapter = load(*args, **kwargs)
        velocity = adapter.velocity

        def signalling(*a, **k):
            loop = common.TrainingLoop.active
            swapped = loop is not None and all(torch.equal(p, s) for p, s in zip(loop.params, loop.ema.shadow))
            if swapped and loop.it == 1 and not common._SIGNALLED["signum"]:  # the evaluation of iteration 1
                os.kill(os.getpid(), signal.SIGTERM)
                inside.append([p.clone() for p in loop.params])
                loop.stop_if_signalled(loop.it)
            return velocity(*a, **k)
        adapter.velocity = signalling
        return adapter
    monkeypatch.setattr(common, "load_model", loaded)
    r = tmp_path / "r"
    with pytest.raises(SystemExit) as stop:
        common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS, [*argv, "--iterations", "3",
                                                                                  "--output-dir", str(r)])
    assert stop.value.code == 128 + signal.SIGTERM and len(inside) == 1
    assert (r / "checkpoints" / "latest").read_text() == "iter_000001"
    saved = trained_params(r, 1)
    assert not all(torch.equal(x, y) for x, y in zip(saved, inside[0]))   # the EMA's weights were in the model
    monkeypatch.undo()
    run(flow_grpo, [*argv, "--iterations", "3", "--output-dir", str(r), "--resume", str(r)])
    run(flow_grpo, [*argv, "--iterations", "3", "--output-dir", str(tmp_path / "straight")])
    assert without_timings(read_metrics(r)) == without_timings(read_metrics(tmp_path / "straight"))
    assert all(torch.equal(x, y) for x, y in zip(trained_params(r, 3), trained_params(tmp_path / "straight", 3)))


# Under torchrun: SIGTERM, then SIGKILL after --shutdown-timeout. The rollout's model calls are slowed so that an
# iteration takes longer than that timeout; a stop at the next rollout micro-batch, or after the update, does not.
SLOW = """import os, sys, time, pathlib
sys.path.insert(0, {root!r})
import torch, common, flow_grpo
load, out = common.load_model, pathlib.Path(sys.argv[sys.argv.index("--output-dir") + 1])
updating = set()  # the iterations whose update has begun (a call with gradient)
def slowed(*args, **kwargs):
    adapter = load(*args, **kwargs)
    velocity = adapter.velocity
    def slow(*a, **k):
        loop = common.TrainingLoop.active
        it = loop.it if loop is not None else -1
        if torch.is_grad_enabled():
            updating.add(it)
        phase = "update" if it in updating else "rollout"
        if it == 1 and os.environ["RANK"] == "0":
            (out / f"in-{{phase}}").touch()
        time.sleep(0.8 if phase == "rollout" else 0.05)
        return velocity(*a, **k)
    adapter.velocity = slow
    return adapter
common.load_model = slowed
common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS)
"""


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["rollout", "update"])
def test_sigterm_to_torchrun_within_its_shutdown_timeout_leaves_a_checkpoint_that_resumes_bitwise(phase, tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(SLOW.format(root=str(ROOT)))
    argv = ["--model", "toy", *small(without=("prompts_per_step", "eval_every")), "--prompts-per-step", "4",
            "--eval-every", "0", "--iterations", "3"]
    r = tmp_path / "r"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = torchrun_cmd(script, [*argv, "--output-dir", r])
    cmd.insert(cmd.index("--nproc_per_node=2"), "--shutdown-timeout=5")   # a rollout alone takes 2 x 4 x 0.8 s
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 300
    while not (r / f"in-{phase}").exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    saved = 1 if phase == "rollout" else 2
    assert f"stopped by SIGTERM at iteration {saved}, checkpoint saved" in err, err[-3000:]
    assert "SIGKILL" not in err and (r / "checkpoints" / "latest").read_text() == f"iter_{saved:06d}", err[-3000:]
    torchrun("flow_grpo.py", [*argv, "--output-dir", str(r), "--resume", str(r)])
    torchrun("flow_grpo.py", [*argv, "--output-dir", str(tmp_path / "straight")])
    assert without_timings(read_metrics(r)) == without_timings(read_metrics(tmp_path / "straight"))
    assert all(torch.equal(x, y) for x, y in zip(trained_params(r, 3), trained_params(tmp_path / "straight", 3)))


# ---- the other entry points, and a closed stdout ----
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("command", ["evaluate", "serve-reward"])
def test_a_signal_ends_evaluate_and_serve_reward_in_one_line(command, signum, tmp_path):
    """Nothing to save: one line and exit status 128 + the signal, no KeyboardInterrupt traceback."""
    argv = ["--model", "toy", "--images", "100000", "--output", str(tmp_path / "out")] if command == "evaluate" else \
        ["--reward", "toy", "--port", "0"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "common.py"), command, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
    if command == "evaluate":  # its --output is made before the model loads, the signal handlers before it
        deadline = time.time() + 120
        while not (tmp_path / "out").exists():
            assert time.time() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
    else:
        assert proc.stdout.readline().startswith("serving toy at http://127.0.0.1:")
    time.sleep(1)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    assert err.splitlines()[-1:] == [f"common.py {command}: stopped by {signal.Signals(signum).name}"], err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.parametrize("argv", [["bogus"], []])
def test_an_unknown_command_is_the_usage_and_exit_status_2(argv):
    out = subprocess.run([sys.executable, str(ROOT / "common.py"), *argv], capture_output=True, text=True, env=ENV)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr == "usage: python common.py serve-reward | evaluate | fetch-prompts [--help]\n", out.stderr


def run_with_streams(script: str, argv: list, how: str):
    """Runs `script` with stdout and stderr as `how` says: "closed stdout" (a pipe whose reader has gone before the
    first line), "head -n 2" (both into a pipe whose reader takes two lines and goes), "/dev/full" (stdout onto a
    full disk), "/dev/full twice" (both). Returns (exit status, what stderr read, if anything read it)."""
    full, cmd = open("/dev/full", "w"), [sys.executable, str(ROOT / script), *map(str, argv)]
    read, write = os.pipe()
    try:
        if how == "closed stdout":
            os.close(read)
            out = subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, env=ENV, timeout=300)
            return out.returncode, out.stderr
        if how == "head -n 2":
            proc = subprocess.Popen(cmd, stdout=write, stderr=write, env=ENV)
            with os.fdopen(read) as head:
                lines = [head.readline(), head.readline()]
            assert all(lines), lines
            return proc.wait(timeout=300), ""
        err = full if how == "/dev/full twice" else subprocess.PIPE
        out = subprocess.run(cmd, stdout=full, stderr=err, text=True, env=ENV, timeout=300)
        return out.returncode, out.stderr or ""
    finally:
        os.close(write)
        full.close()


@pytest.mark.parametrize("script,how", [("flow_grpo.py", "head -n 2"), ("common.py", "/dev/full twice"), *[
    pytest.param(*case, marks=pytest.mark.slow)  # the default suite: EPIPE and ENOSPC on both streams (the two above)
    for case in [("flow_grpo.py", "closed stdout"), ("flow_grpo.py", "/dev/full"), ("common.py", "closed stdout")]]])
def test_a_closed_or_full_stdout_or_stderr_stops_the_printing_not_the_run(script, how, tmp_path):
    """Every print (tqdm's bars on stderr too) fails with EPIPE or ENOSPC: the run (or evaluation) goes on to its end,
    exit status 0, without a traceback."""
    argv = ["evaluate", "--model", "toy", "--images", "4", "--output", tmp_path / "out"] if script == "common.py" \
        else ["--model", "toy", *SMALL, "--iterations", "2", "--output-dir", tmp_path / "r"]
    code, err = run_with_streams(script, argv, how)
    assert code == 0 and "Traceback" not in err and "Error" not in err, err[-3000:]
    if script == "common.py":
        assert (tmp_path / "out" / "results.json").is_file() and (tmp_path / "out" / "grid.png").is_file()
    else:
        assert (tmp_path / "r" / "checkpoints" / "latest").read_text() == "iter_000002"
        assert [m["iteration"] for m in read_metrics(tmp_path / "r")] == [0, 1, 2]


def closed(cmd: list, streams: str, **kwargs) -> subprocess.CompletedProcess:
    """Runs `cmd` with stdout (">&-"), stderr ("2>&-") or both closed, as daemons and some schedulers start jobs:
    Python then has no sys.stdout / sys.stderr (None), unlike a pipe whose reader has gone."""
    return subprocess.run(["sh", "-c", f'exec "$@" {streams}', "sh", *map(str, cmd)], capture_output=True, text=True,
                          env=ENV, timeout=300, **kwargs)


@pytest.mark.parametrize("trainer", [pytest.param(t, marks=pytest.mark.slow) if t != "flow_grpo" else t
                                     for t in TRAINERS])
def test_a_closed_stdout_and_stderr_stop_the_printing_not_the_run(trainer, tmp_path):
    """flow_grpo runs to its end with either stream closed (before: `>&-` died before the run folder was made, `2>&-`
    exited 1 silently), the others (slow) with both; a refusal keeps its exit status 2 (every trainer: below)."""
    base = [sys.executable, ROOT / f"{trainer}.py", "--model", "toy", *SMALL, *own(trainer, "FITS_SMALL"),
            "--iterations", "1", "--eval-every", "1", "--eval-images", "2"]
    for streams in [">&-", "2>&-"] if trainer == "flow_grpo" else [">&- 2>&-"]:
        r = tmp_path / streams.replace(">&-", "x").replace(" ", "")
        out = closed([*base, "--output-dir", r], streams)
        assert out.returncode == 0, (streams, out.stderr[-2000:])
        assert (r / "checkpoints" / "latest").read_text() == "iter_000001", streams
        assert [m["iteration"] for m in read_metrics(r)] == [0, 1], streams
        assert out.stdout == "" if streams.startswith(">&-") else "it " in out.stdout, out.stdout


@pytest.mark.parametrize("trainer", [pytest.param(t, marks=pytest.mark.slow) if t != "flow_grpo" else t
                                     for t in TRAINERS])  # the same common.cli in every trainer
def test_a_refusal_with_closed_streams_keeps_its_exit_status(trainer, tmp_path):
    refused = closed([sys.executable, ROOT / f"{trainer}.py", "--seed", "-1", "--output-dir", tmp_path / "never"],
                     ">&- 2>&-")
    assert refused.returncode == 2 and not (tmp_path / "never").exists()


def test_evaluate_serve_reward_and_fetch_prompts_run_on_with_closed_streams(tmp_path):
    """evaluate writes results.json (before: it evaluated everything and died first), fetch-prompts reads a shipped
    set, serve-reward answers a request; a refusal keeps exit status 2."""
    common_py, out = [sys.executable, ROOT / "common.py"], tmp_path / "out"
    done = closed([*common_py, "evaluate", "--model", "toy", "--images", "2", "--output", out], ">&-")
    assert done.returncode == 0 and (out / "results.json").is_file() and (out / "grid.png").is_file(), done
    assert closed([*common_py, "fetch-prompts", "drawbench"], "2>&-").returncode == 0
    assert closed([*common_py, "evaluate", "--model", "toy", "--images", "0"], ">&- 2>&-").returncode == 2
    assert closed([*common_py, "fetch-prompts", "bogus"], ">&- 2>&-").returncode == 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["sh", "-c", 'exec "$@" >&- 2>&-', "sh", *map(str, common_py), "serve-reward", "--reward",
                             "jpeg", "--port", str(port)], env=ENV)
    try:
        scores, deadline = None, time.time() + 120
        while scores is None:
            assert proc.poll() is None and time.time() < deadline, proc.returncode
            with contextlib.suppress(common.TrainingStopped):
                scores = common.RemoteReward(f"http://127.0.0.1:{port}/jpeg", timeout=10, retries=0)(
                    torch.rand(2, 3, 8, 8), ["a", "b"])
            time.sleep(0.2)
        assert scores.shape == (2,) and torch.isfinite(scores).all()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


STARTING = """import sys, time, pathlib
sys.path.insert(0, {root!r})
import common, flow_grpo
load = common.load_model
def slow(*args, **kwargs):  # the run folder is made; the model is loading
    pathlib.Path({flag!r}).touch()
    time.sleep(60)
common.load_model = slow
common.run_cli(flow_grpo.main, flow_grpo.Args, flow_grpo.MODEL_DEFAULTS)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_at_any_moment_of_start_up_is_one_line_and_leaves_no_folder_it_made(signum, tmp_path):
    """While the libraries load (before: a 30-line KeyboardInterrupt traceback, or SIGABRT), and once the run folder
    is made while the model loads (before: a line, then the stop once the model had loaded): one line, exit status
    128 + the signal, and the new run folder, which held only its lock, gone."""
    name = signal.Signals(signum).name
    for delay in (0.3, 1.0):  # importing torch takes seconds
        out = tmp_path / f"run{delay}"
        proc = subprocess.Popen([sys.executable, ROOT / "flow_grpo.py", "--model", "toy", *SMALL, "--output-dir", out],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        time.sleep(delay)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signum and err.splitlines() == [f"flow_grpo.py: stopped by {name}"], err
        assert not out.exists()
    script, flag, out = tmp_path / "script.py", tmp_path / "loading", tmp_path / "run"
    script.write_text(STARTING.format(root=str(ROOT), flag=str(flag)))
    proc = subprocess.Popen([sys.executable, script, "--model", "toy", *SMALL, "--output-dir", out],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 120
    while not flag.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    assert (out / ".lock").is_file()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum and err.splitlines()[-1:] == [f"script.py: stopped by {name}"], err
    assert "Traceback" not in err and not out.exists()
