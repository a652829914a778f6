"""Fuzzes the trainers' start-up: random flags (numbers at and past their bounds, NaN, inf, words), prompt files
(empty, not UTF-8, malformed JSON lines), --resume targets (missing, a file, a damaged checkpoint, another trainer's
run, damaged run folders continued in place) and --model-path values (missing, a file, an empty folder, a corrupt
pipeline), each start-up in a fresh process with a time limit. Every case must end in a clean refusal (exit 2, one
`error:` line, no traceback), run (exit 0) or stop in one line once it has begun (an unreachable remote scorer); a
traceback or a hang is reported.

    python tests/fuzz_startup.py --cases 200 --seed 0          # a table of outcomes per trainer, exit 1 on any bad
"""
import argparse
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from helpers import TRAINERS  # noqa: E402

QUICK = ["--model", "toy", "--prompts-per-step", "2", "--group-size", "4", "--micro-batch", "4", "--sample-steps", "4",
         "--eval-images", "4", "--eval-steps", "2", "--eval-every", "0", "--threads", "1", "--iterations", "1"]
FITS = {"pro_grpo": ["--funnel", "3,2", "--checkpoints", "1,2", "--micro-batch", "2"]}  # a group of 4
NUMBERS = ["0", "-1", "1", "2", "3", "1e-13", "1e39", "-1e39", "nan", "inf", "-inf", "1e9", "0.5", "x", "", "3,2",
           "100000000", "1.5"]
FLAGS = ["--prompts-per-step", "--group-size", "--micro-batch", "--sample-steps", "--eval-images", "--eval-steps",
         "--eval-every", "--iterations", "--lr", "--grad-clip", "--beta", "--noise-level", "--lora-rank",
         "--lora-alpha", "--seed", "--threads", "--save-every", "--time-budget", "--max-bad-steps", "--resolution",
         "--timestep-fraction", "--updates-per-rollout", "--clip-range", "--adv-clip", "--weight-decay",
         "--sde-window", "--sde-window-range", "--sde-type", "--funnel", "--checkpoints", "--granularities",
         "--mc-pairs", "--soft-clip", "--reward", "--reward-norm", "--dtype", "--guidance-scale"]
REWARDS = ["toy", "toy:2", "toy:1e39", "toy:nan", "toy,toy", "jpeg", "pickscore", "clipscore", "hpsv2", "aesthetic",
           "nope", "remote:http://127.0.0.1:9/x", "remote:ftp://x", "toy:-1", "", "remote:http://[::1/x",
           "remote:http://127.0.0.1:99999/x"]


def fixtures(tmp: Path, python: str) -> dict:
    """Files the cases point at: prompt files, checkpoints (one made by a real run, damaged copies), model paths."""
    prompts = {"empty.txt": b"", "latin1.txt": b"caf\xe9\n", "bad.jsonl": b'{"prompt": 5}\n', "ok.txt":
               b"a red circle\na blue square\n", "not_toy.txt": b"a photo of a cat\n", "eval_only.jsonl":
               b'{"prompt": "a red circle", "split": "eval"}\n'}
    for name, data in prompts.items():
        (tmp / name).write_bytes(data)
    run = tmp / "run"
    subprocess.run([python, str(ROOT / "flow_grpo.py"), *QUICK, "--output-dir", str(run)], capture_output=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600, check=True)
    ckpt = Path("checkpoints", "iter_000001")
    damaged = {"bad_json": lambda d: (d / ckpt / "checkpoint.json").write_text("{"),
               "negative": lambda d: (d / ckpt / "checkpoint.json").write_text(json.dumps(
                   {**json.loads((d / ckpt / "checkpoint.json").read_text()), "iteration": -5})),
               "no_state": lambda d: [f.unlink() for f in (d / ckpt / "state").iterdir()],
               "metadata": lambda d: (d / ckpt / "state" / ".metadata").write_bytes(b"garbage"),
               "flipped_bit": lambda d: flip_last_bit(d / ckpt / "state" / "__0_0.distcp"),
               "published_bit": lambda d: flip_last_bit(d / ckpt / "transformer" / "config.json"),
               "renamed": lambda d: (d / ckpt).rename(d / "checkpoints" / "iter_000003"),
               "incomplete_next": lambda d: (d / "checkpoints" / "iter_000002").mkdir(),
               "no_args": lambda d: (d / "args.json").unlink(),
               "fifo_args": lambda d: (d / "args.json").unlink() or os.mkfifo(d / "args.json"),
               "fifo_log": lambda d: (d / "metrics.jsonl").unlink() or os.mkfifo(d / "metrics.jsonl")}
    targets = [str(run), str(run / ckpt), str(tmp / "nowhere"), str(tmp / "ok.txt"), "auto"]
    in_place = []  # damaged run folders, resumed in place (--output-dir the folder itself)
    for name, damage in damaged.items():
        copy = tmp / f"run_{name}"
        subprocess.run(["cp", "-r", str(run), str(copy)], check=True)
        damage(copy)
        targets.append(str(copy / ckpt) if (copy / ckpt).is_dir() else str(copy))
        in_place.append(str(copy))
    (tmp / "empty_dir").mkdir()
    pipe = tmp / "corrupt_pipe"
    (pipe / "transformer").mkdir(parents=True)
    (pipe / "model_index.json").write_text("{}")
    (pipe / "transformer" / "config.json").write_text("{")
    models = [str(tmp / "nowhere"), str(tmp / "ok.txt"), str(tmp / "empty_dir"), str(pipe), "random:x", "random:0",
              "owner/name", "a/b/c"]
    return {"prompts": [str(tmp / n) for n in prompts], "resume": targets, "in_place": in_place, "model_path": models}


def flip_last_bit(path: Path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def case(rng: random.Random, trainer: str, fx: dict, tmp: Path, i: int) -> list[str]:
    argv = [*QUICK, *FITS.get(trainer, []), "--output-dir", str(tmp / f"out{i}")]
    for _ in range(rng.randint(0, 2)):
        kind = rng.random()
        if kind < 0.5:
            flag = rng.choice(FLAGS)
            argv += [flag, rng.choice(REWARDS if flag == "--reward" else NUMBERS)]
        elif kind < 0.65:
            argv += ["--prompts", rng.choice(fx["prompts"])]
        elif kind < 0.78:
            argv += ["--resume", rng.choice(fx["resume"])]
        elif kind < 0.85:
            folder = rng.choice(fx["in_place"])
            argv += ["--resume", rng.choice([folder, "auto"]), "--output-dir", folder]
        else:
            argv += ["--model", rng.choice(["flux", "sd3", "toy"]), "--model-path", rng.choice(fx["model_path"])]
    return argv


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a start-up counts as hung")
    a = ap.parse_args()
    rng, tmp = random.Random(a.seed), Path(tempfile.mkdtemp(prefix="fuzz-"))
    fx = fixtures(tmp, sys.executable)
    counts, bad = collections.Counter(), []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for i in range(a.cases):
        trainer = TRAINERS[i % len(TRAINERS)]
        argv = case(rng, trainer, fx, tmp, i)
        try:
            out = subprocess.run([sys.executable, str(ROOT / f"{trainer}.py"), *argv], capture_output=True, text=True,
                                 env=env, timeout=a.timeout, cwd=tmp)
            errors = [ln for ln in out.stderr.splitlines() if ": error: " in ln]
            if "Traceback" in out.stderr:
                outcome = "traceback"
            elif out.returncode == 0:
                outcome = "ran"
            elif out.returncode == 2 and len(errors) == 1:
                outcome = "refused"
            elif out.stderr.strip().splitlines()[-1:] and out.stderr.strip().splitlines()[-1].startswith(
                    f"{trainer}.py: "):
                outcome = "stopped"                          # a run that began and stopped in one line
            else:
                outcome = f"exit {out.returncode}"
        except subprocess.TimeoutExpired:
            outcome, out = "hung", None
        counts[trainer, outcome] += 1
        if outcome not in ("ran", "refused", "stopped"):
            bad.append((trainer, argv, outcome, out.stderr[-2000:] if out else ""))
        print(f"{i:4d} {trainer:10s} {outcome:10s} {' '.join(argv[len(QUICK):])}", flush=True)
    outcomes = sorted({o for _, o in counts})
    print("\n| trainer | " + " | ".join(outcomes) + " |\n|---|" + "---|" * len(outcomes))
    for t in TRAINERS:
        print(f"| {t} | " + " | ".join(str(counts[t, o]) for o in outcomes) + " |")
    for trainer, argv, outcome, err in bad:
        print(f"\n{trainer} {outcome}: {' '.join(argv)}\n{err}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
