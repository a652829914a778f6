"""CPU threads beside other work: the toy default's seconds per iteration alone, beside one busy process, as each of
two trainers started at once, and as two torchrun ranks, for `--threads 2` (the fixed count runs had before), for
`--threads 1`, and for the default (common.cpu_threads: the cores this process may use, shared among the ranks, less
those other processes keep busy).
Each cell is the median of --repeats runs, interleaved; a run's seconds per iteration leave out its first iteration.

    python tests/benchmark_threads.py                 # about 32 minutes on 2 cores; the README's table
    python tests/benchmark_threads.py --quick         # tiny sizes, one repeat, about 2 minutes (a slow test runs it)
"""
import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONDITIONS = ("alone", "beside one busy process", "two trainers started at once", "two torchrun ranks")
BEHAVIOURS = {"before": ["--threads", "2"], "one thread": ["--threads", "1"], "now": []}
# now / alone (now) at most this; alone: now / before at most this
TARGETS = {"alone": 1.05, "beside one busy process": 1.3, "two trainers started at once": 2.5}
TOY = ["--eval-every", "0", "--save-every", "0", "--iterations", "3"]
QUICK = [*TOY, "--prompts-per-step", "2", "--group-size", "2", "--micro-batch", "2", "--sample-steps", "2",
         "--updates-per-rollout", "1"]
# a user's shell: no OMP_NUM_THREADS (torchrun sets 1 for its ranks), offline
ENV = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "HF_HUB_OFFLINE": "1"}


def seconds_per_iteration(run_dir: Path) -> float:
    """The mean of a run's iterations after its first (warm-up, and the threads' first measurement), from time_s."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    t = [m["time_s"] for m in lines if "loss" in m]  # the iterations that trained
    return (t[-1] - t[0]) / (len(t) - 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(condition: str, argv: list[str], folder: Path) -> float:
    """One cell's run (two for two trainers at once, averaged): its seconds per iteration."""
    launcher = [sys.executable]
    if condition == "two torchrun ranks":
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    runs = [folder / f"run{i}" for i in range(2 if condition == "two trainers started at once" else 1)]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition.startswith("beside") else None
    try:
        procs = [subprocess.Popen([*launcher, str(ROOT / "flow_grpo.py"), *argv, "--output-dir", str(run)], env=ENV,
                                  stdout=subprocess.DEVNULL, stderr=open(folder / f"{run.name}.log", "w"))
                 for run in runs]
        for proc, run in zip(procs, runs):
            if proc.wait():
                sys.exit(f"{condition}, {' '.join(argv)}: exit {proc.returncode}\n"
                         f"{(folder / f'{run.name}.log').read_text()[-2000:]}")
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return statistics.mean(seconds_per_iteration(run) for run in runs)


def table(cells: dict) -> str:
    """cells[condition][behaviour] = [seconds per iteration, ...] -> the Markdown table."""
    med = {c: {b: statistics.median(v) for b, v in row.items()} for c, row in cells.items()}
    alone = med["alone"]
    out = ["| condition | `--threads 2` (before), s/it | `--threads 1`, s/it | default (now), s/it | before, x alone | "
           "now, x alone | target (now) |", "|---|---|---|---|---|---|---|"]
    for c, m in med.items():
        if c == "alone":
            ratio = m["now"] / m["before"]
            target = f"<= {TARGETS[c]:g}x before: {ratio:.2f}x, {'met' if ratio <= TARGETS[c] else 'missed'}"
        elif c in TARGETS:
            ratio = m["now"] / alone["now"]
            target = f"<= {TARGETS[c]:g}x alone: {'met' if ratio <= TARGETS[c] else 'missed'}"
        else:
            target = "-"
        out.append(f"| {c} | {m['before']:.2f} | {m['one thread']:.2f} | {m['now']:.2f} | "
                   f"{m['before'] / alone['before']:.2f} | {m['now'] / alone['now']:.2f} | {target} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes and one repeat")
    ap.add_argument("--repeats", type=int, help="runs per cell (default 3; --quick: 1)")
    ap.add_argument("--json", help="also write every run's seconds per iteration here")
    a = ap.parse_args(argv)
    repeats, sizes = a.repeats or (1 if a.quick else 3), QUICK if a.quick else TOY
    cells = {c: {b: [] for b in BEHAVIOURS} for c in CONDITIONS}
    tic = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            for c in CONDITIONS:
                for b, flags in BEHAVIOURS.items():
                    folder = Path(tmp) / f"{rep}-{c.replace(' ', '_')}-{b}"
                    folder.mkdir()
                    cells[c][b].append(measure(c, [*sizes, *flags], folder))
                    print(f"  {c}, {b}: {cells[c][b][-1]:.2f} s/it", file=sys.stderr, flush=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import torch
    print(f"{time.strftime('%Y-%m-%d')}, {cores} cores ({platform.processor() or platform.machine()}), torch "
          f"{torch.__version__}, {'quick sizes' if a.quick else 'the toy default'}, median of {repeats}, "
          f"{time.time() - tic:.0f} s\n")
    print(table(cells))
    if a.json:
        Path(a.json).write_text(json.dumps(cells, indent=2))
    return cells


if __name__ == "__main__":
    main()
