"""Shared test utilities: run a trainer in-process with small sizes."""
import os
import subprocess
import sys
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parents[1]

# Small sizes for fast in-process runs of any trainer on any model.
SMALL = ["--prompts-per-step", "2", "--group-size", "4", "--micro-batch", "4", "--sample-steps", "4",
         "--eval-images", "8", "--eval-steps", "4", "--eval-every", "1", "--threads", "1"]


def run(module, argv: list[str]) -> dict:
    """Parses argv like the command line and runs module.main in this process; returns its final metrics."""
    args = common.cli(module.Args, argv, module.MODEL_DEFAULTS)
    return module.main(args)


def read_metrics(run_dir) -> list[dict]:
    """metrics.jsonl as its readers take it (common.read_metrics): the last line of each iteration, in order."""
    return common.read_metrics(run_dir)


def straight_and_resumed(module, argv: list[str], split: int, total: int, tmp_path) -> tuple[list[dict], list[dict]]:
    """Runs `total` iterations straight (tmp_path/straight), and `split` then --resume to `total` (tmp_path/split);
    returns both metrics.jsonl without the timings (keys starting with t), which differ between runs."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "split")
    run(module, [*argv, "--iterations", str(total), "--output-dir", straight])
    run(module, [*argv, "--iterations", str(split), "--output-dir", resumed])
    run(module, [*argv, "--iterations", str(total), "--output-dir", resumed, "--resume", resumed])
    drop = lambda ms: [{k: v for k, v in m.items() if not k.startswith("t") or k == "iteration"} for m in ms]  # noqa: E731
    return drop(read_metrics(straight)), drop(read_metrics(resumed))


def torchrun(script: str, argv: list[str], port: int, nproc: int = 2) -> str:
    """Runs a trainer as `nproc` gloo processes under torchrun (one thread each); asserts success, returns stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
           str(ROOT / script), *argv]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout
