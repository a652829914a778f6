"""A CPU run's threads (common.cpu_threads) and its first screen: the threads come from the cores the process may use,
shared among torchrun's ranks, less those another process keeps busy; the default toy run and its resume print no
warning."""
import os
import subprocess
import sys
import time

import pytest
import torch

import common
from helpers import ROOT


@pytest.fixture
def one_thread_after():
    """The suite's one thread, and no balancing hook, after the test."""
    yield
    common.cpu_threads(1)
    assert not common._BALANCE and torch.get_num_threads() == 1


def test_the_threads_are_the_allowed_cores_shared_among_the_local_ranks(monkeypatch, one_thread_after):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5, 7, 9, 11}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    common.cpu_threads()
    assert torch.get_num_threads() == 6 and common._BALANCE
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")              # torchrun's ranks on this machine
    common.cpu_threads()
    assert torch.get_num_threads() == 1 and not common._BALANCE  # nothing to balance
    common.cpu_threads(3)                                       # --threads 3
    assert torch.get_num_threads() == 3 and not common._BALANCE


def test_a_core_another_process_keeps_busy_is_left_to_it(monkeypatch, one_thread_after):
    """A real busy process takes a thread away (fewer still if the machine has other work) at the next balance
    (between iterations), never while modules run (a rollout and its update on the same threads); then, with the busy
    seconds given by hand, the threads follow the cores the others leave, rounded: below half a core is free."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    share = len(os.sched_getaffinity(0))
    if share < 2:
        pytest.skip("one core: nothing to share")
    common.cpu_threads()                                        # its first measurement
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.2)
        torch.nn.Linear(2, 2)(torch.zeros(1, 2))                # a module runs a second later: no change
        assert torch.get_num_threads() == share
        common.balance_threads()                                # the next balance: a core was busy
        assert torch.get_num_threads() <= share - 1
    finally:
        busy.kill()
        busy.wait()
    for others, threads in [(0.0, share), (0.4, share), (0.6, share - 1), (1.0, share - 1), (share, 1)]:
        common._BALANCE["last"] = (time.monotonic() - 2.0, 0.0)  # two seconds ago; the others' busy seconds since:
        monkeypatch.setattr(common, "_busy_seconds", lambda cpus, o=others: 2.0 * o)
        common.balance_threads()
        assert torch.get_num_threads() == threads, others


def test_the_default_run_and_its_resume_print_no_warning(tmp_path):
    """The toy defaults at small sizes (the same imports, evaluation, checkpoint and resume): no line warns."""
    small = ["--prompts-per-step", "2", "--group-size", "4", "--micro-batch", "4", "--eval-images", "4",
             "--eval-every", "1", "--output-dir", str(tmp_path / "run")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for extra in (["--iterations", "1"], ["--iterations", "2", "--resume", str(tmp_path / "run")]):
        out = subprocess.run([sys.executable, str(ROOT / "flow_grpo.py"), *small, *extra], env=env, text=True,
                             capture_output=True, timeout=300)
        lines = (out.stdout + out.stderr).replace("\r", "\n").splitlines()
        assert out.returncode == 0 and not [ln for ln in lines if "warn" in ln.lower()], out.stdout + out.stderr
