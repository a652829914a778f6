"""Multi-node: two torchrun "nodes" on loopback (c10d rendezvous on 127.0.0.1, one process each) train exactly what
one node with two processes trains: the same metrics and the same weights, bit for bit."""
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, free_port, read_metrics, small, tiny_argv, trained_params, without_timings

ARGV = ["--iterations", "2", "--prompts-per-step", "4", *small(without=("prompts_per_step",))]


def launch(launcher_args: list[str], out, env) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher_args, str(ROOT / "flow_grpo.py"),
           *tiny_argv("flow_grpo", "sd3"), *ARGV, "--output-dir", str(out)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow  # the default suite: two torchrun ranks on one node stay identical (each trainer's tests)
def test_two_nodes_on_loopback_train_what_one_node_with_two_processes_trains(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    one = tmp_path / "one_node"
    finish(launch(["--nproc_per_node=2", f"--master_port={free_port()}"], one, env))
    two = tmp_path / "two_nodes"
    rdzv = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "--rdzv-id=loopback"]
    nodes = [launch([*rdzv, f"--node-rank={r}"], two, env) for r in (0, 1)]
    stdout = [finish(p) for p in nodes]
    assert "ranks 2 | prompts/rank B=2" in stdout[0] + stdout[1]

    a, b = read_metrics(one), read_metrics(two)
    assert without_timings(a) == without_timings(b)
    assert b[-1]["rank_param_diff"] == 0.0                       # the two nodes' replicas agree
    assert all(m["grad_norm"] > 0 for m in b[:-1])                # the weights did move
    for x, y in zip(trained_params(one, 2), trained_params(two, 2), strict=True):
        assert torch.equal(x, y)
