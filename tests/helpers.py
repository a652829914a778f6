"""Shared test utilities: run a trainer in-process with small sizes."""
import json
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
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
