"""Speed and memory in the run's dtype, eager and under --compile: each trainer on SD3.5-Medium's widths with 2 blocks
(--model-path random:2: real widths, random weights, nothing downloaded; --models flux2: FLUX.2-klein 4B's, 2 double
and 2 single blocks, at MODEL_REAL's smaller sizes) at 64 px, 10 sampling steps, 2 prompts x 8, LoRA rank 32, EMA, the
jpeg reward, the model's CFG, in eager float32, eager bf16 and compiled bf16 (`--dtype bf16 --compile`).
Each run is a process of its own (its peak memory and its compile are its own) of --iterations iterations: the first
(which compiles) is reported apart, the others give the medians. A table row: seconds per iteration and its rollout,
reward and update parts (as the trainer logs them: t_rollout, with V-GRPO's t_surrogate_old, t_reward, t_update), the
first iteration's seconds and its compile seconds, and the peak resident memory of the process (ru_maxrss) and of
each phase (sampled every 5 ms: load is everything before the first rollout; reward is the decodes and the scoring,
a preview's too).

  python tests/benchmark_compile.py                        # 4 trainers x 3 modes, 4 iterations each (README table)
  python tests/benchmark_compile.py --trainers flow_grpo --modes bf16,bf16-compile --iterations 6
  python tests/benchmark_compile.py --models flux2 --trainers flow_grpo --modes bf16,bf16-compile
  python tests/benchmark_compile.py --quick                # the tiny FLUX, flow_grpo, 2 iterations (a slow test)
  python tests/benchmark_compile.py --official CHECKOUT     # flow_grpo beside the official code, Fast and full recipes

--official runs the official Flow-GRPO SD3 trainers (scripts/train_sd3.py, the full recipe, and train_sd3_fast.py,
Fast) from a checkout of its repository at commit 9745241, unmodified, in bf16 (accelerate's mixed precision: float32
transformer weights under autocast) beside flow_grpo eager and compiled in bf16, with the same settings on both sides:
the official configs pickscore_sd3 (full: CFG 4.5, 9 of 10 steps trained, KL 0.01) and pickscore_sd3_fast_nocfg
(Fast: an SDE window of 3 in steps 0-4, CPS at 0.8, clip 1e-5, no CFG, no KL) at the sizes above, both reading one
saved random-weight folder of SD3.5-M's widths, no gradient checkpointing (the official code has none), 2 optimizer
steps an iteration. The official side needs accelerate, ml_collections and absl-py importable (not this project's
requirements) and Python 3.11 or older (its configs import `imp`); its evaluation is skipped, wandb is a no-op,
and its model gets the `.module` its KL reference reads from DDP's wrapper (one process has none).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
MODES = {"fp32": ["--dtype", "fp32"], "bf16": ["--dtype", "bf16"], "bf16-compile": ["--dtype", "bf16", "--compile"]}
REAL = ["--model", "sd3", "--model-path", "random:2", "--resolution", "64", "--sample-steps", "10",
        "--prompts-per-step", "2", "--group-size", "8", "--micro-batch", "8", "--lora-rank", "32", "--lora-alpha", "64",
        "--ema", "--reward", "jpeg", "--prompts", "pickscore", "--eval-every", "0", "--save-every", "0"]
# what a trainer needs on top of REAL to train groups of 8: Pro-GRPO expands 16 and prunes to 12, then 8 (at klein's
# 4 steps below, after steps 2 and 3, as after 5 and 7 of 10)
TRAINER_REAL = {"pro_grpo": ["--group-size", "16", "--funnel", "12,8", "--baseline-group", "8"]}
MODEL_TRAINER_REAL = {("flux2", "pro_grpo"): ["--checkpoints", "2,3"]}
# FLUX.2-klein's 2 double and 2 single blocks are 4x SD3.5-M's 2 in parameters, its 512 text tokens 2.5x the tokens:
# one prompt x 4 in micro-batches of 2 (two updates an iteration, as above), 4 steps, 64 text tokens keep an iteration
# to minutes on 2 cores; a trainer's own needs (TRAINER_REAL) come after
MODEL_REAL = {"flux2": ["--prompts-per-step", "1", "--group-size", "4", "--micro-batch", "2", "--sample-steps", "4",
                        "--max-sequence-length", "64"]}
PHASES = ("load", "rollout", "reward", "update")
# flow_grpo's flags for the official configs --official runs (its other defaults are theirs: noise 0.7, clip 1e-4,
# timestep fraction 0.99, lr 3e-4, advantages clamped at 5, the std over the iteration)
RECIPES = {"full": ["--guidance-scale", "4.5", "--beta", "0.01", "--no-gradient-checkpointing"],
           "fast": ["--guidance-scale", "1", "--sde-window", "3", "--sde-window-range", "0,5", "--sde-type", "cps",
                    "--noise-level", "0.8", "--clip-range", "1e-5", "--beta", "0", "--no-gradient-checkpointing"]}


def argv_of(model: str, trainer: str, mode: str, quick: bool, iterations: int, threads: int, out: Path) -> list[str]:
    """The trainer's command line for one run."""
    if quick:
        from helpers import tiny_argv
        sizes = [*tiny_argv(trainer, "flux"), "--eval-every", "0", "--save-every", "0"]
    else:
        sizes = [*REAL, "--model", model, *MODEL_REAL.get(model, []), *TRAINER_REAL.get(trainer, []),
                 *MODEL_TRAINER_REAL.get((model, trainer), [])]
    return [*sizes, *MODES[mode], "--iterations", str(iterations), "--threads", str(threads), "--output-dir", str(out)]


# ---- one run, in a worker process ----
def sample_memory(state: dict, peaks: dict):
    """Keeps peaks[state["phase"]] the highest resident memory seen in that phase, every 5 ms, until state["stop"]."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as statm:
        while not state["stop"]:
            statm.seek(0)
            rss = int(statm.read().split()[1]) * page
            peaks[state["phase"]] = max(peaks[state["phase"]], rss)
            time.sleep(0.005)


def in_phase(state: dict, name: str, fn):
    """`fn`, marking state["phase"] `name` while it runs."""
    def wrapped(*args, **kwargs):
        before, state["phase"] = state["phase"], name
        try:
            return fn(*args, **kwargs)
        finally:
            state["phase"] = before
    return wrapped


def worker(trainer: str, mode: str, argv: list[str], result: Path):
    """Runs the trainer in this process with the phases marked (the transformer's train() / eval(), the decodes and
    the reward calls) and the resident memory sampled; writes the run's row to `result`."""
    import common
    module = importlib.import_module(trainer)
    state, peaks = {"phase": "load", "stop": False}, dict.fromkeys(PHASES, 0)

    load_model = common.load_model

    def marked_load_model(*args, **kwargs):
        adapter = load_model(*args, **kwargs)
        train = adapter.transformer.train

        def marked_train(mode=True):
            state["phase"] = "update" if mode else "rollout"
            return train(mode)
        adapter.transformer.train = marked_train
        adapter.decode = in_phase(state, "reward", adapter.decode)
        return adapter
    common.load_model = marked_load_model
    common.WeightedReward.__call__ = in_phase(state, "reward", common.WeightedReward.__call__)
    thread = threading.Thread(target=sample_memory, args=(state, peaks), daemon=True)
    thread.start()
    tic = time.time()
    args = common.cli(module.Args, argv, module.MODEL_DEFAULTS)
    module.main(args)
    wall = time.time() - tic
    state["stop"] = True
    thread.join()
    out = Path(argv[argv.index("--output-dir") + 1])
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    lines = [m for m in lines if "loss" in m]                       # the iterations that trained
    seconds = [b["time_s"] - a["time_s"] for a, b in zip(lines, lines[1:])]
    rollout = [m["t_rollout"] + m.get("t_surrogate_old", 0.0) for m in lines]
    row = {"model": args.model, "trainer": trainer, "mode": mode, "iterations": len(lines), "wall_s": wall,
           "first_s": lines[0]["time_s"], "compile_s": lines[0].get("compile_s", 0.0),
           "later_compiles": sum(m.get("compiles", 0) for m in lines[1:]),
           "s_per_it": statistics.median(seconds), "rollout": statistics.median(rollout[1:]),
           "reward": statistics.median(m["t_reward"] for m in lines[1:]),
           "update": statistics.median(m["t_update"] for m in lines[1:]),
           "ratio_dev_first_update": lines[0].get("ratio_dev_first_update"),
           "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
           **{f"peak_{p}_gib": peaks[p] / 2**30 for p in PHASES}}
    result.write_text(json.dumps(row))


def official_worker(recipe: str, checkout: str, model: str, iterations: int, threads: int, out: Path, result: Path):
    """Runs the official trainer of `recipe` ("full" or "fast") from `checkout` in this process for `iterations`
    epochs, an epoch timed from its first rollout call to the next epoch's (the rollout: the pipeline calls), with the
    resident memory sampled; writes its row to `result`."""
    import types

    import accelerate  # noqa: F401  (these look for wandb by its import spec, which the no-op below lacks)
    import diffusers  # noqa: F401
    import peft  # noqa: F401
    import torch
    sys.path[:0] = [checkout, os.path.join(checkout, "scripts")]
    sys.modules["wandb"] = wandb = types.ModuleType("wandb")
    wandb.init = wandb.log = wandb.Image = lambda *a, **k: None
    torch.set_num_threads(threads)
    from config import grpo
    train = importlib.import_module({"full": "train_sd3", "fast": "train_sd3_fast"}[recipe])
    config = {"full": grpo.pickscore_sd3, "fast": grpo.pickscore_sd3_fast_nocfg}[recipe]()
    config.pretrained.model, config.resolution, config.sample.num_steps = model, 64, 10
    config.sample.train_batch_size = config.sample.num_image_per_prompt = config.train.batch_size = 8  # a call: 1 x 8
    config.sample.num_batches_per_epoch, config.train.gradient_accumulation_steps = 2, 1  # 2 x 8, 2 optimizer steps
    config.mixed_precision, config.reward_fn = "bf16", {"jpeg_compressibility": 1.0}
    config.dataset, config.logdir, config.save_freq = os.path.join(checkout, "dataset/pickscore"), str(out), 10**9
    train.FLAGS = types.SimpleNamespace(config=config)

    class Accelerator(train.Accelerator):  # its KL reference reads DDP's `transformer.module`: one process has no DDP
        def prepare(self, *args, **kwargs):
            prepared = super().prepare(*args, **kwargs)
            for m in prepared:
                if isinstance(m, torch.nn.Module) and not hasattr(m, "module"):
                    object.__setattr__(m, "module", m)  # an attribute, not a submodule
            return prepared
    train.Accelerator = Accelerator
    train.eval = lambda *a, **k: None                    # its first evaluation would be the whole held-out split
    state, peaks, marks, rollouts = {"phase": "load", "stop": False}, dict.fromkeys(PHASES, 0), [], []
    pipeline, per = train.pipeline_with_logprob, config.sample.num_batches_per_epoch

    def timed_pipeline(*args, **kwargs):
        tic, state["phase"] = time.time(), "rollout"
        if len(rollouts) % per == 0:                    # an epoch's first rollout call
            marks.append(tic)
            if len(marks) > iterations:
                raise KeyboardInterrupt                 # its loop has no end: stop as the next epoch starts
        try:
            return pipeline(*args, **kwargs)
        finally:
            rollouts.append(time.time() - tic)
            state["phase"] = "update"
    train.pipeline_with_logprob = timed_pipeline
    thread = threading.Thread(target=sample_memory, args=(state, peaks), daemon=True)
    thread.start()
    try:
        train.main(None)
    except KeyboardInterrupt:
        pass
    state["stop"] = True
    thread.join()
    seconds = [b - a for a, b in zip(marks, marks[1:])]
    rollout = [sum(rollouts[i:i + per]) for i in range(0, per * len(seconds), per)]
    row = {"trainer": "official", "mode": recipe, "iterations": len(seconds), "first_s": seconds[0],
           "compile_s": 0.0, "s_per_it": statistics.median(seconds[1:]), "rollout": statistics.median(rollout[1:]),
           "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
           **{f"peak_{p}_gib": peaks[p] / 2**30 for p in PHASES}}
    result.write_text(json.dumps(row))


# ---- the parent: one worker per run, the table ----
def versions() -> str:
    import diffusers
    import torch
    import transformers
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return (f"{time.strftime('%Y-%m-%d')}, {len(os.sched_getaffinity(0))} CPU cores ({cpu}), "
            f"torch {torch.__version__}, diffusers {diffusers.__version__}, transformers {transformers.__version__}, "
            f"Python {platform.python_version()}")


def table(rows: list[dict]) -> str:
    head = ["model", "trainer", "mode", "s/it", "rollout", "reward", "update", "x eager bf16",
            "first iteration (compile)", "peak GiB", *(f"{p} GiB" for p in PHASES)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = next((b for b in rows if (b["model"], b["trainer"], b["mode"]) == (r["model"], r["trainer"], "bf16")),
                    None)
        speed = f"{r['s_per_it'] / base['s_per_it']:.2f}" if base else "-"
        first = f"{r['first_s']:.1f} ({r['compile_s']:.1f})" if r["mode"].endswith("compile") else f"{r['first_s']:.1f}"
        out.append("| " + " | ".join([r["model"], r["trainer"], r["mode"], f"{r['s_per_it']:.2f}",
                                      f"{r['rollout']:.2f}", f"{r['reward']:.2f}", f"{r['update']:.2f}", speed,
                                      first, f"{r['peak_gib']:.2f}",
                                      *(f"{r[f'peak_{p}_gib']:.2f}" for p in PHASES)]) + " |")
    return "\n".join(out)


def side_table(rows: list[dict]) -> str:
    """The --official table: each recipe's official row first, ours against it."""
    head = ["recipe", "run", "s/it", "rollout", "rest (reward, update)", "x official", "first iteration (compile)",
            "peak GiB", "load GiB", "rollout GiB", "rest GiB"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = next(b for b in rows if b["recipe"] == r["recipe"] and b["trainer"] == "official")
        first = f"{r['first_s']:.1f} ({r['compile_s']:.1f})" if r["mode"].endswith("compile") else f"{r['first_s']:.1f}"
        run = "official" if r["trainer"] == "official" else f"ours, {r['mode']}"
        cells = [r["s_per_it"], r["rollout"], r["s_per_it"] - r["rollout"], r["s_per_it"] / base["s_per_it"]]
        peaks = [r["peak_gib"], r["peak_load_gib"], r["peak_rollout_gib"],
                 max(r["peak_reward_gib"], r["peak_update_gib"])]
        out.append("| " + " | ".join([r["recipe"], run, *(f"{c:.2f}" for c in cells), first,
                                      *(f"{c:.2f}" for c in peaks)]) + " |")
    return "\n".join(out)


def run_worker(name: str, cmd: list[str], out: Path, env: dict) -> dict:
    """Runs one worker process (its output in OUT/name.log) and returns its row; exits on a failure."""
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"{name}: exit {proc.returncode}; its log: {out / f'{name}.log'}\n"
                 + (out / f"{name}.log").read_text()[-3000:])
    return json.loads((out / f"{name}.json").read_text())


def side_by_side(checkout: str, iterations: int, threads: int, out: Path, env: dict) -> str:
    """--official: each recipe run by the official code, then by flow_grpo in eager and compiled bf16; the table."""
    model = out / "sd3-random2"                       # the one folder both sides load (float32, as saved)
    if not (model / "model_index.json").exists():
        proc = subprocess.run([sys.executable, "-c", "import sys, common; common.build_pipeline('sd3', common."
                               "architecture('sd3', 2)).save_pretrained(sys.argv[1])", str(model)], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"saving the random-weight SD3.5-M widths to {model} failed:\n{proc.stderr[-3000:]}")
    rows, tic = [], time.time()
    for recipe in RECIPES:
        runs = {"official": [sys.executable, __file__, "--official-worker", recipe, checkout, str(model),
                             str(iterations), str(threads), str(out / f"{recipe}-official"),
                             str(out / f"{recipe}-official.json")]}
        for mode in ("bf16", "bf16-compile"):
            argv = [*REAL, *RECIPES[recipe], "--model-path", str(model), *MODES[mode], "--iterations", str(iterations),
                    "--threads", str(threads), "--output-dir", str(out / f"{recipe}-{mode}")]
            runs[mode] = [sys.executable, __file__, "--worker", "flow_grpo", mode, str(out / f"{recipe}-{mode}.json"),
                          *argv]
        for mode, cmd in runs.items():
            rows.append({**run_worker(f"{recipe}-{mode}", cmd, out, env), "recipe": recipe})
            print(f"{recipe}, {mode}: {rows[-1]['s_per_it']:.2f} s/it, {time.time() - tic:.0f} s so far", flush=True)
    return (f"Measured {versions()}, --threads {threads}; SD3.5-M widths, 2 blocks, 64 px, 10 steps, 2 prompts x 8, "
            f"LoRA r32, EMA, jpeg, no gradient checkpointing; {iterations} iterations per run, the first apart, "
            f"medians of the rest; {time.time() - tic:.0f} s in all.\n\n{side_table(rows)}")


def main(argv=None) -> list[dict]:
    from helpers import TRAINERS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="sd3", help="comma-separated: sd3, flux2")
    ap.add_argument("--trainers", default=",".join(TRAINERS), help="comma-separated trainers")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--iterations", type=int, default=4, help="per run; the first is reported apart (at least 2)")
    ap.add_argument("--threads", type=int, help="each run's --threads (default: the cores this process may use; "
                                                 "--quick: 1, as the tests' tiny runs)")
    ap.add_argument("--quick", action="store_true", help="flow_grpo on the tiny FLUX, 2 iterations: every path")
    ap.add_argument("--out", default=None, help="output folder (default runs/benchmark-compile-<time>)")
    ap.add_argument("--official", metavar="CHECKOUT", help="a checkout of the official Flow-GRPO code at 9745241: "
                                                           "flow_grpo beside it, Fast and full recipes (above)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:                             # --worker TRAINER MODE RESULT, then the trainer's argv
        return worker(argv[1], argv[2], argv[4:], Path(argv[3]))
    if argv[:1] == ["--official-worker"]:                    # RECIPE CHECKOUT MODEL ITERATIONS THREADS OUT RESULT
        return official_worker(argv[1], argv[2], argv[3], int(argv[4]), int(argv[5]), Path(argv[6]), Path(argv[7]))
    a = ap.parse_args(argv)
    trainers = ["flow_grpo"] if a.quick else [t.strip() for t in a.trainers.split(",")]
    modes = [m.strip() for m in a.modes.split(",")]
    models = ["flux"] if a.quick else [m.strip() for m in a.models.split(",")]
    iterations = 2 if a.quick else a.iterations
    a.threads = a.threads or (1 if a.quick else len(os.sched_getaffinity(0)))
    if bad := [t for t in trainers if t not in TRAINERS] + [m for m in modes if m not in MODES] + [
            m for m in models if m not in ("sd3", "flux2", "flux")]:
        ap.error(f"unknown {bad}: --trainers takes {', '.join(TRAINERS)}; --modes {', '.join(MODES)}; --models sd3, "
                 f"flux2")
    if iterations < 2:
        ap.error("--iterations must be at least 2: the first is reported apart")
    out = Path(a.out or f"runs/benchmark-compile-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if a.official:
        text = side_by_side(str(Path(a.official).resolve()), iterations, a.threads, out, env)
        print("\n" + text)
        (out / "side_by_side.md").write_text(text + "\n")
        return []
    rows, tic = [], time.time()
    for model, trainer, mode in ((m, t, d) for m in models for t in trainers for d in modes):
        name = f"{model}-{trainer}-{mode}"
        cmd = [sys.executable, __file__, "--worker", trainer, mode, str(out / f"{name}.json"),
               *argv_of(model, trainer, mode, a.quick, iterations, a.threads, out / name)]
        rows.append(run_worker(name, cmd, out, env))
        print(f"{name}: {rows[-1]['s_per_it']:.2f} s/it, {time.time() - tic:.0f} s so far", flush=True)
    sizes = {"sd3": "SD3.5-M widths, 2 blocks (random:2), 10 steps, 2 prompts x 8",
             "flux2": "FLUX.2-klein 4B widths, 2 double and 2 single blocks (random:2), 4 steps, 1 prompt x 4 in micro-"
                      "batches of 2, 64 text tokens"}
    setting = ("the tiny FLUX of tests/helpers.py, smoke sizes" if a.quick else
               f"{'; '.join(sizes[m] for m in models)}; 64 px, LoRA r32, EMA, jpeg, the model's CFG")
    text = (f"Measured {versions()}, --threads {a.threads}; {setting}; {iterations} iterations per run, the first "
            f"apart, medians of the rest; {time.time() - tic:.0f} s in all.\n\n{table(rows)}")
    print("\n" + text)
    (out / "benchmark_compile.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
