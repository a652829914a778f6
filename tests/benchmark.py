"""Side-by-side benchmark of the trainers (flow_grpo.py and every file copied from it, found by its shared-block
markers) on the toy task: each tuned the same way, compared on several seeds with its uncertainty, and costed at
full scale. One command runs three phases:

  sweep  Each method's step size, tuned on its own: learning rate x {1/3, 1, 3} of its toy default and clip range
         x {1, 10} of its default (6 configurations; the clip is widened only, since the defaults clip much:
         flow_grpo's clip_frac is 0.3 to 0.5). All four trainers clip a ratio and take several optimizer steps
         per rollout at their toy defaults (flow_grpo, pro_grpo, v_grpo 2; g2rpo one per branched step, 4), so
         the clip range is live in each; a method whose clip_frac is 0 in every sweep run is flagged as inert,
         and a trainer without --clip-range is swept over the learning rate only. Each configuration trains on
         the toy reward for --sweep-budget training seconds on each tuning seed (100, 101) and is scored by its
         final held-out reward, the mean over those seeds. The best is chosen per method, a tie going to the
         default; a configuration with a failed run is not chosen.
  final  The chosen configuration of each method on the reporting seeds (0..4, disjoint from the tuning seeds),
         for each reward: `toy` (three levels, 0 / 0.5 / 1, like GenEval's) and `toy-soft` (continuous, like a
         preference model's; common.toy_soft_reward). The configurations tuned on `toy` are reused for
         `toy-soft`. Each run trains for --final-budget training seconds, evaluated about --evals times along
         the way (the interval from the method's seconds per iteration in the sweep).
  costs  Each trainer's work per iteration at its full-scale FLUX settings (its MODEL_DEFAULTS["flux"] group
         size, funnel, steps, strides, pairs, ...), counted on the tiny FLUX pipeline (tests/helpers.py): the
         real FLUX pipeline classes at tiny size with random weights, whose rewards mean nothing but whose counts
         are those of the full-size settings. 2 prompts per iteration, reported per prompt, per image scored (per
         reward call: what the trainer scores, not prompts x group; G2RPO scores every branch at every stride and
         its anchors, Pro-GRPO its previews too) and per the paper's iteration (its prompts per iteration), next to
         the papers' own cost claims.

Every run is its own process on one CPU thread, --jobs at a time, forked from a server that has done the imports
once (--no-fork: a new interpreter each, ~6 s more a run). Training seconds are the trainers' time_s
(rollouts, rewards, updates; evaluation left out). The evaluation is the trainers' own: the ODE sampler on the
held-out prompts (100 images, 20 steps) with per-image noise fixed by the run's seed, so one seed's "before" is the
same for every method (checked here) and the methods can be compared seed by seed. The work is counted by hooks on
the model (common.instrument) and logged per iteration as nfe_fwd (forwards without grad), nfe_fwd_bwd (forwards
with grad, each followed by a backward), decodes and reward_calls; a forward-equivalent counts a forward as 1 and
a forward+backward as 3.

Statistics: mean +- standard error over seeds (sample std / sqrt(n)). Each method's difference to flow_grpo in
final held-out reward is taken per seed (the same weights and evaluation noise), averaged, and given a 95%
t-interval on n - 1 degrees of freedom: "clear" if the interval excludes 0, else "within noise". A seed's
"before" is the same for every method, so the difference in final reward is also the difference in gain.

Prints the tables (Markdown) and writes OUT/benchmark.json (meta, the grids, every run's configuration, command
line, counts and evaluation curve, the sweep table, the choices, the summaries and the costs) and OUT/benchmark.png
(held-out reward against iterations, forward-equivalents and training seconds; one row per reward; lines the mean
over seeds, shading +- one standard error). --replot redraws both from a benchmark.json without training.

  python tests/benchmark.py --out runs/benchmark      # the README's Results: about 50 minutes on 2 CPU cores
  python tests/benchmark.py --quick                   # every phase at tiny sizes, under 2 minutes
  python tests/benchmark.py --replot assets/benchmark.json --out /tmp/replot
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import math
import multiprocessing.connection
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from helpers import TRAINERS as METHODS  # noqa: E402  (the trainers, found by their marker; flow_grpo first)
from helpers import read_metrics  # noqa: E402

# A variant is a trainer run with flags of its own, benchmarked as a method beside the trainers: name -> (trainer, its
# toy recipe, its full-scale FLUX settings for the cost runs). Flow-GRPO-Fast is flow_grpo.py's official speed recipe:
# the toy recipe is the official one (an SDE window of 3 in steps 0-4 of 10, CPS at 0.8, clip 1e-5, no KL) at lr 1e-4
# (calibrated: README, Toy recipes), the FLUX one the official pickscore_flux_fast config (README, Recipes).
VARIANTS = {"flow_grpo-fast": ("flow_grpo", ["--sde-window", "3", "--sde-type", "cps", "--noise-level", "0.8",
                                             "--clip-range", "1e-5", "--beta", "0", "--lr", "1e-4"],
                               ["--sde-window", "3", "--sde-window-range", "0,3", "--sde-type", "cps",
                                "--noise-level", "0.8", "--clip-range", "1e-5", "--beta", "0", "--no-global-std"])}
RUNS = METHODS + list(VARIANTS)                            # what --methods runs by default
LABELS = {"flow_grpo-fast": "flow_grpo (fast)"}           # how the tables and the plot name a run kind


def script(method: str) -> str:
    """The trainer a method (a trainer or a variant) runs."""
    return VARIANTS[method][0] if method in VARIANTS else method


def label(method: str) -> str:
    return LABELS.get(method, method)

BASELINE = "flow_grpo"
PALETTE = [(90, 90, 90), (214, 39, 40), (31, 119, 180), (44, 160, 44), (255, 127, 14), (148, 103, 189),
           (140, 86, 75), (227, 119, 194)]
KNOWN = ["flow_grpo", "v_grpo", "g2rpo", "pro_grpo", "flow_grpo-fast"]  # the README plot's colours; a fork: the next
COLORS = {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(KNOWN + [m for m in RUNS if m not in KNOWN])}
FWD_BWD = 3                                                # a forward+backward, in forwards
# --quick: tiny sizes that every trainer accepts (Pro-GRPO's funnel has to fit in its group)
QUICK_SIZES = ["--prompts-per-step", "2", "--group-size", "4", "--micro-batch", "4", "--sample-steps", "4"]
QUICK_EXTRA = {"pro_grpo": ["--group-size", "8", "--funnel", "6,4", "--checkpoints", "2,3"],
               "flow_grpo-fast": ["--sde-window", "1", "--sde-window-range", "0,2"]}
# The smoke-run settings (helpers.SMOKE, a trainer's FITS_SMOKE) that the cost runs put back to the FLUX values: those
# that decide the work per prompt. Prompts, resolution, LoRA, lr and the rest change no count (or only scale it).
NOT_STRUCTURE = {"reward", "iterations", "eval_every", "eval_images", "eval_steps", "resolution", "prompts_per_step",
                 "lora_rank", "lora_alpha", "ema", "gradient_checkpointing", "fsdp", "lr", "threads"}
# The papers' own cost claims, quoted; the measured counts stand next to them.
CLAIMS = {"flow_grpo": "the baseline",
          "pro_grpo": "336k vs 453k TFLOPs per epoch against Flow-GRPO's group of 24: 1.35x fewer",
          "v_grpo": "NFE_old = 16 + 4 and NFE_theta = 4 per sample on FLUX",
          "g2rpo": "none in these units",
          "flow_grpo-fast": "the official README's figures: PickScore 19.8 -> 23.9 in about 170 H800 GPU-hours"}
# Two-sided 95% quantiles of Student's t by degrees of freedom; beyond the table, the Cornish-Fisher expansion.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
# For the printed time estimate, measured on 2 CPU cores with 2 runs at a time: a run's start-up and checkpoint
# (forked / a new interpreter), a held-out evaluation (100 images x 20 ODE steps), half an iteration past the
# budget, and a tiny-flux cost run at FLUX group sizes.
STARTUP_S, EVAL_S_PER_IMAGE_STEP, OVERSHOOT_S, COST_RUN_S = {True: 1.0, False: 6.0}, 3.4 / 2000, 2.5, 30.0


def t975(dof: int) -> float:
    if dof in T975:
        return T975[dof]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)


# ---- the trainers' settings ----
@functools.cache
def trainer(method: str) -> tuple[dict, dict]:
    """A method's toy settings (its trainer's Args defaults, with a variant's flags) and its trainer's
    MODEL_DEFAULTS."""
    import common
    module = importlib.import_module(script(method))
    return dataclasses.asdict(common.cli(module.Args, VARIANTS[method][1] if method in VARIANTS else [])), \
        module.MODEL_DEFAULTS


def sig(x: float) -> float:
    return float(f"{x:.3g}")


def grid(method: str, lr_factors: list[float], clip_factors: list[float]) -> list[dict]:
    """The sweep's configurations: lr x lr_factors and, where the trainer has one, clip range x clip_factors,
    both of the toy defaults."""
    args, _ = trainer(method)
    clips = [sig(args["clip_range"] * f) for f in clip_factors] if "clip_range" in args else [None]
    return [{"lr": sig(args["lr"] * f), **({} if c is None else {"clip_range": c})}
            for f in lr_factors for c in clips]


def default_config(method: str) -> dict:
    args, _ = trainer(method)
    return {"lr": sig(args["lr"]), **({"clip_range": sig(args["clip_range"])} if "clip_range" in args else {})}


def config_argv(config: dict) -> list[str]:
    return [a for k, v in config.items() for a in (f"--{k.replace('_', '-')}", repr(v))]


def config_str(config: dict) -> str:
    return ", ".join(f"{'clip' if k == 'clip_range' else k} {v:g}" for k, v in config.items())


def cost_setting(method: str, prompts: int) -> tuple[list[str], dict, dict]:
    """The cost run's argv: the tiny FLUX pipeline at smoke-run sizes, with the FLUX value of every work-deciding
    setting that those sizes replace; those settings (and G2RPO's strides) for the report; the paper's prompts per
    iteration (to scale a prompt's counts to its iteration)."""
    import helpers
    args, model_defaults = trainer(method)
    flux = model_defaults["flux"]
    shrunk = (set(helpers.SMOKE) | set(helpers.own(script(method), "FITS_SMOKE", {}))) - NOT_STRUCTURE
    restored = {k: flux.get(k, args[k]) for k in sorted(shrunk) if k in args and flux.get(k, args[k]) is not None}
    variant = VARIANTS[method][2] if method in VARIANTS else []
    argv = [*helpers.tiny_argv(script(method), "flux", drop=("prompts_per_step", *restored)),
            "--prompts-per-step", str(prompts), *helpers.flags(restored), *variant]
    shown = {**restored, **{k: flux.get(k, args[k]) for k in ("granularities",) if k in args}}
    if variant:                                             # and a variant's own FLUX settings
        import common
        parsed = dataclasses.asdict(common.cli(importlib.import_module(script(method)).Args, ["--model", "flux",
                                                                                             *variant], model_defaults))
        shown.update({k: parsed[k] for k in sorted(f[2:].removeprefix("no-").replace("-", "_") for f in variant
                                                   if f.startswith("--"))})
    return argv, shown, {"prompts_per_step": flux.get("prompts_per_step", args["prompts_per_step"])}


# ---- running the trainers ----
# Every run is a process of its own. Where the platform has it, the processes are forked from a server that has
# imported torch, diffusers, transformers and the trainers once (about 6 s a run otherwise, as long as a quick run's
# training); each run still starts from a clean process and runs the trainer's own entry point.
# The runs are started and waited for from --jobs threads, but multiprocessing's Process is not thread-safe there:
# every start() polls the other children, and a forkserver child's poll reads its exit status from a pipe, so two
# threads polling one child both read, one gets the status and the other the end of the pipe, which it reports as
# exit 255. One lock around every start and poll; a thread waits for its child's end without reading.
FORK = {"context": None, "lock": threading.Lock()}
PRELOAD = ["torch", "numpy", "PIL.Image", "common", "diffusers.models.transformers.transformer_flux",
           "diffusers.pipelines.flux.pipeline_flux", "transformers.models.clip.modeling_clip"]


def _run_in_child(method: str, argv: list[str], log: str, cwd: str):
    """A forked run: `python <method>.py argv` in cwd, its output to log."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    sys.argv = [str(ROOT / f"{method}.py"), *argv]
    module = importlib.import_module(method)
    import common
    try:
        common.run_cli(module.main, module.Args, module.MODEL_DEFAULTS, argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def start_fork_server():
    """Runs every later run as a fork of a server that has imported the trainers (one CPU thread each, offline)."""
    os.environ.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                      PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    this_is_main = getattr(sys.modules["__main__"], "__file__", None) == __file__
    if "forkserver" in multiprocessing.get_all_start_methods() and this_is_main:
        FORK["context"] = multiprocessing.get_context("forkserver")
        FORK["context"].set_forkserver_preload([*PRELOAD, *METHODS])


def train(method: str, run_dir: Path, argv: list[str]) -> tuple[list[dict], float]:
    """Runs one trainer in its own process (one thread); returns its metrics (helpers.read_metrics) and wall-clock
    seconds."""
    argv, method = ["--output-dir", str(run_dir), "--threads", "1", *argv], script(method)
    cmd = [sys.executable, str(ROOT / f"{method}.py"), *argv]
    log = run_dir.parent / f"{run_dir.name}.log"                 # (with_suffix would cut at the "." of "lr0.0003")
    tic = time.time()
    if FORK["context"] is not None:
        proc = FORK["context"].Process(target=_run_in_child, args=(method, argv, str(log), str(run_dir.parent)))
        with FORK["lock"]:
            proc.start()
        multiprocessing.connection.wait([proc.sentinel])
        with FORK["lock"]:
            rc = proc.exitcode
    else:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=run_dir.parent).returncode
    if rc:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}); the end of {log}:\n{log.read_text()[-3000:]}")
    return read_metrics(run_dir), time.time() - tic


def run_all(jobs: list[dict], out: Path, n_parallel: int, desc: str, fatal: bool = True) -> list[dict]:
    """Runs the jobs n_parallel at a time, in the order given; returns each job with its digest. With fatal, the
    first failure stops everything; otherwise a failed run is kept as {"failed": the error's end}."""
    def one(job):
        try:
            lines, wall = train(job["method"], out / job["run_dir"], job["argv"])
        except RuntimeError as e:
            if fatal:
                raise
            return {**job, "failed": str(e)[-1500:]}
        return {**job, "wall_s": wall, **digest(lines, out / job["run_dir"])}

    with ThreadPoolExecutor(n_parallel) as pool, tqdm(total=len(jobs), desc=desc) as bar:
        futures = [pool.submit(one, job) for job in jobs]
        done = []
        try:
            for f in futures:
                done.append(f.result())
                bar.update()
        except BaseException:                               # stop at the first failure: drop the queued runs
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return done


# ---- reading a run ----
def digest(lines: list[dict], run_dir: Path) -> dict:
    """One run's numbers: per-iteration work, and the evaluations as a curve against iterations, training
    seconds, transformer evaluations (nfe) and forward-equivalents (fwd_eq)."""
    steps = [m for m in lines if "nfe_fwd" in m]          # training iterations (the last line only evaluates)
    evals = [m for m in lines if "eval_reward" in m]
    ends = [0.0] + [m["time_s"] for m in steps]             # time_s: training seconds at the end of each iteration
    cum = lambda per_it: [sum(per_it[:i]) for i in range(len(per_it) + 1)]  # noqa: E731  before iteration i
    nfe = cum([m["nfe_fwd"] + m["nfe_fwd_bwd"] for m in steps])
    fwd_eq = cum([m["nfe_fwd"] + FWD_BWD * m["nfe_fwd_bwd"] for m in steps])
    curve = [{"iteration": m["iteration"], "time_s": ends[m["iteration"]], "nfe": nfe[m["iteration"]],
              "fwd_eq": fwd_eq[m["iteration"]], "reward": m["eval_reward"], "reward_se": m.get("eval_reward_se"),
              "accuracy": m.get("eval_accuracy")} for m in evals]
    mean = lambda key: statistics.fmean(m[key] for m in steps) if steps and key in steps[0] else None  # noqa: E731
    args = json.loads((run_dir / "args.json").read_text())
    extra = sorted({k for m in steps for k in m if k.startswith("nfe_") and k not in ("nfe_fwd", "nfe_fwd_bwd")})
    return {
        "iterations": len(steps), "prompts_per_step": args["prompts_per_step"], "group_size": args["group_size"],
        "sample_steps": args.get("sample_steps"),
        "s_per_it": statistics.median(b - a for a, b in zip(ends, ends[1:])) if steps else None, "train_s": ends[-1],
        **{k: mean(k) for k in ("nfe_fwd", "nfe_fwd_bwd", "decodes", "reward_calls", "clip_frac")},
        **{k: mean(k) for k in extra}, "nfe_total": nfe[-1], "fwd_eq_total": fwd_eq[-1], "curve": curve,
        "before": curve[0] if curve else None, "after": curve[-1] if curve else None,
    }


# ---- statistics ----
def mean_se(xs) -> list[float]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return [math.nan, math.nan]
    return [statistics.fmean(xs), statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan]


def paired(a: dict, b: dict) -> dict:
    """a - b over the seeds both have ({seed: value}): mean, standard error and 95% t-interval of the differences,
    and whether that interval excludes 0."""
    seeds = sorted(set(a) & set(b), key=int)
    d = {s: a[s] - b[s] for s in seeds}
    n = len(d)
    mean, se = mean_se(d.values())
    if n < 2:
        return {"n": n, "mean": mean, "se": se, "lo": math.nan, "hi": math.nan, "word": "one seed", "per_seed": d}
    half = t975(n - 1) * se
    lo, hi = mean - half, mean + half
    return {"n": n, "mean": mean, "se": se, "t": t975(n - 1), "lo": lo, "hi": hi,
            "word": "clear" if lo > 0 or hi < 0 else "within noise", "per_seed": d}


def analyze(runs: list[dict], settings: dict) -> dict:
    """Everything the tables and plot show, from the runs alone (so --replot recomputes it): the sweep table and
    choices, the summary per reward and method with paired differences to flow_grpo, and the costs."""
    methods = settings["methods"]
    sweep = {}
    for m in methods:
        rows = []
        for cfg in settings["grids"][m]:
            rs = [r for r in runs if r["phase"] == "sweep" and r["method"] == m and r["config"] == cfg]
            ok = [r for r in rs if "failed" not in r]
            scores = {str(r["seed"]): (None if "failed" in r else r["after"]["reward"]) for r in rs}
            complete = len(ok) == len(settings["tuning_seeds"]) and len(rs) == len(ok)
            rows.append({"config": cfg, "scores": scores, "mean": statistics.fmean(scores.values()) if complete
                         else None, "iterations": statistics.fmean(r["iterations"] for r in ok) if ok else None,
                         "s_per_it": statistics.median(r["s_per_it"] for r in ok) if ok else None,
                         "clip_frac": statistics.fmean(r["clip_frac"] for r in ok) if ok and ok[0]["clip_frac"]
                         is not None else None})
        scored = [row for row in rows if row["mean"] is not None]
        best = max(row["mean"] for row in scored) if scored else None
        default = default_config(m) if "default_configs" not in settings else settings["default_configs"][m]
        winners = [row for row in scored if row["mean"] == best]
        chosen = next((row for row in winners if row["config"] == default), winners[0] if winners else None)
        for row in rows:
            row["default"], row["chosen"] = row["config"] == default, row is chosen
        clip_seen = [row["clip_frac"] for row in rows if row["clip_frac"] is not None]
        sweep[m] = {"rows": rows, "chosen": chosen["config"] if chosen else None,
                    "clip_inert": bool(clip_seen) and max(clip_seen) == 0.0}

    summary = {}
    for reward in settings["rewards"]:
        summary[reward] = {}
        for m in methods:
            rs = [r for r in runs if r["phase"] == "final" and r["method"] == m and r["reward"] == reward]
            if not rs:
                continue
            s = {"config": rs[0]["config"], "seeds": [r["seed"] for r in rs],
                 "iterations": mean_se(r["iterations"] for r in rs), "train_s": mean_se(r["train_s"] for r in rs),
                 "s_per_it": statistics.median(r["s_per_it"] for r in rs),
                 **{k: statistics.fmean(r[k] for r in rs) for k in ("nfe_fwd", "nfe_fwd_bwd", "decodes",
                                                                     "reward_calls")},
                 "eval_every": rs[0]["eval_every"]}
            s["fwd_eq_per_it"] = s["nfe_fwd"] + FWD_BWD * s["nfe_fwd_bwd"]
            for when in ("before", "after"):
                for k in ("reward", "accuracy"):
                    s[f"{k}_{when}"] = mean_se(r[when][k] for r in rs)
            s["after_by_seed"] = {str(r["seed"]): r["after"]["reward"] for r in rs}
            s["clip_frac"] = mean_se(r["clip_frac"] for r in rs)
            summary[reward][m] = s
        if BASELINE in summary[reward]:
            base = summary[reward][BASELINE]["after_by_seed"]
            for m, s in summary[reward].items():
                if m != BASELINE:
                    s["diff_vs_" + BASELINE] = paired(s["after_by_seed"], base)

    costs = {}
    for r in (r for r in runs if r["phase"] == "costs"):
        p, g, paper = r["prompts_per_step"], r["group_size"], r["paper"]
        per_prompt = {k: r[k] / p for k in ("nfe_fwd", "nfe_fwd_bwd", "decodes", "reward_calls")}
        per_prompt["fwd_eq"] = per_prompt["nfe_fwd"] + FWD_BWD * per_prompt["nfe_fwd_bwd"]
        costs[r["method"]] = {"argv": r["argv"], "paper": paper, "settings": r["settings"],
                              "group_size": g, "sample_steps": r["sample_steps"], "per_prompt": per_prompt,
                              "per_image": {k: v / per_prompt["reward_calls"] for k, v in per_prompt.items()},
                              "per_paper_iteration": {k: v * paper["prompts_per_step"] for k, v in per_prompt.items()},
                              "extra_per_prompt": {k: r[k] / p for k in r if k.startswith("nfe_") and k not in
                                                   ("nfe_fwd", "nfe_fwd_bwd", "nfe_total") and r[k] is not None
                                                   and not k.endswith("_per_sample")},
                              "claim": CLAIMS.get(r["method"], "")}
    if BASELINE in costs:
        base = costs[BASELINE]["per_prompt"]["fwd_eq"]
        for c in costs.values():
            c["fwd_eq_per_prompt_vs_baseline"] = c["per_prompt"]["fwd_eq"] / base
    return {"sweep": sweep, "chosen": {m: sweep[m]["chosen"] for m in methods}, "summary": summary, "costs": costs}


# ---- tables ----
def pm(ms, digits=3) -> str:
    return f"{ms[0]:.{digits}f} ± {ms[1]:.{digits}f}" if not math.isnan(ms[1]) else f"{ms[0]:.{digits}f}"


def md(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |"
                                                                                   for r in rows])


def counts_note(m: str, c: dict) -> str:
    """What the counts show, in the claim's units where it has them."""
    s, p = c["per_image"], c["per_prompt"]
    note = f"{s['nfe_fwd']:.3g} fwd + {s['nfe_fwd_bwd']:.3g} fwd+bwd per image scored"
    if "fwd_eq_per_prompt_vs_baseline" in c and m != BASELINE:
        ratio = c["fwd_eq_per_prompt_vs_baseline"]
        note += (f"; {1 / ratio:.2f}x fewer fwd-eq per prompt than {BASELINE}" if ratio < 1 else
                 f"; {ratio:.2f}x {BASELINE}'s fwd-eq per prompt")
    if "nfe_continuation" in c["extra_per_prompt"]:
        note += (f"; {c['extra_per_prompt']['nfe_continuation']:.0f} of the {p['nfe_fwd']:.0f} forwards per prompt "
                 f"are ODE continuations, {p['decodes']:.0f} decodes and reward calls per prompt")
    return note


def tables(analysis: dict, settings: dict) -> str:
    seeds = settings["tuning_seeds"]
    rows = []
    for m, sw in analysis["sweep"].items():
        for row in sw["rows"]:
            rows.append([label(m), config_str(row["config"]) + (" (default)" if row["default"] else ""),
                         *[("failed" if row["scores"].get(str(s)) is None else f"{row['scores'][str(s)]:.3f}")
                           for s in seeds],
                         "" if row["mean"] is None else f"{row['mean']:.3f}",
                         "" if row["iterations"] is None else f"{row['iterations']:.1f}",
                         "" if row["clip_frac"] is None else f"{row['clip_frac']:.2f}",
                         "**chosen**" if row["chosen"] else ""])
    text = [f"### Sweep: {settings['sweep_budget']:g} s of training per run on the toy reward, tuning seeds "
            f"{', '.join(map(str, seeds))}; score = final held-out reward ({settings['eval_images']} images), mean "
            f"over the tuning seeds; the chosen configuration is reused for every reward",
            md(["method", "configuration", *[f"seed {s}" for s in seeds], "mean", "iterations", "clip_frac",
                ""], rows)]
    inert = [m for m, sw in analysis["sweep"].items() if sw["clip_inert"]]
    if inert:
        text.append(f"clip range inert (clip_frac 0 in every sweep run): {', '.join(inert)}")
    for reward, summ in analysis["summary"].items():
        rows = []
        for m, s in summ.items():
            d = s.get("diff_vs_" + BASELINE)
            diff = "" if d is None else (f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] {d['word']}"
                                         if d["n"] > 1 else f"{d['mean']:+.3f}")
            rows.append([label(m), config_str(s["config"]), pm(s["iterations"], 1), f"{s['s_per_it']:.2f}",
                         f"{s['fwd_eq_per_it']:.0f}", f"{pm(s['reward_before'])} -> {pm(s['reward_after'])}",
                         f"{pm(s['accuracy_before'])} -> {pm(s['accuracy_after'])}", diff])
        n = len(next(iter(summ.values()))["seeds"]) if summ else 0
        text += [f"### Reward `{reward}`: {settings['final_budget']:g} s of training per run, {n} seeds "
                 f"({', '.join(map(str, settings['seeds']))}), {settings['eval_images']} held-out images, the "
                 f"configurations chosen on `{settings['rewards'][0]}`; mean ± standard error over seeds",
                 md(["method", "configuration", "iterations", "s/it (median)", "fwd-eq/it", "reward before -> after",
                     "accuracy before -> after", f"difference to {BASELINE} [95% CI], paired by seed"], rows)]
    if analysis["costs"]:
        rows = []
        for m, c in analysis["costs"].items():
            p, q, pi = c["paper"], c["per_prompt"], c["per_paper_iteration"]
            counted = ", ".join(f"{k} {v}" for k, v in c["settings"].items() if k != "micro_batch") or (
                f"tiny-flux smoke sizes: group_size {c['group_size']}, sample_steps {c['sample_steps']}")
            cells = [f"{q[k]:.0f} ({pi[k] / 1000:.1f}k)" for k in ("nfe_fwd", "nfe_fwd_bwd", "fwd_eq", "decodes",
                                                                      "reward_calls")]
            rows.append([label(m), f"{p['prompts_per_step']}", counted, *cells, c["claim"], counts_note(m, c)])
        text += [f"### Cost at full-scale FLUX settings, counted on tiny-flux ({settings['cost_prompts']} prompts x "
                 f"{settings['cost_iterations']} iterations): per prompt (per paper iteration: x its prompts per "
                 f"iteration); fwd-eq = fwd + {FWD_BWD} fwd+bwd",
                 md(["method", "prompts per paper iteration", "FLUX settings counted", "fwd", "fwd+bwd", "fwd-eq",
                     "decodes", "reward calls", "paper's claim", "the counts"], rows)]
    return "\n\n".join(text)


# ---- the plot (Pillow) ----
def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    raw = (hi - lo) / n or 1.0
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def band(curves: list[list[tuple]], points: int = 40) -> tuple[list, list, list, list]:
    """Seeds' curves (x, y) interpolated onto one x grid up to the shortest: grid, mean, mean - SE, mean + SE."""
    end = min(c[-1][0] for c in curves)
    xs = [end * i / (points - 1) for i in range(points)]

    def interp(c, x):
        for (xa, ya), (xb, yb) in zip(c, c[1:]):
            if xa <= x <= xb:
                return ya if xb == xa else ya + (yb - ya) * (x - xa) / (xb - xa)
        return c[-1][1]
    ys = [[interp(c, x) for c in curves] for x in xs]
    mean = [statistics.fmean(y) for y in ys]
    se = [statistics.stdev(y) / math.sqrt(len(y)) if len(y) > 1 else 0.0 for y in ys]
    return xs, mean, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)]


PANEL_W, PANEL_H, HEADER_H = 560, 460, 60


def plot(rows: list[list[dict]], path: Path, title: str, subtitle: str):
    """A grid of panels (rows x columns), each {"title", "xlabel", "curves": {method: [[(x, y), ...] per seed]}}."""
    from PIL import Image, ImageDraw, ImageFont
    W, H, L, R, T, B = PANEL_W, PANEL_H, 70, 20, 50, 60                # one panel and its margins
    try:
        font, small = ImageFont.load_default(size=17), ImageFont.load_default(size=14)
    except TypeError:                                       # Pillow < 10.1: the bitmap font
        font = small = ImageFont.load_default()

    def pixels(ox, oy, xmax, ylo, yhi):
        """A panel's maps from data to pixel coordinates."""
        return (lambda x: ox + L + (x / xmax) * (W - L - R),
                lambda y: oy + H - B - (y - ylo) / (yhi - ylo) * (H - T - B))

    img = Image.new("RGB", (W * max(len(r) for r in rows), H * len(rows) + HEADER_H), "white")
    draw = ImageDraw.Draw(img)
    draw.text((12, 8), title, fill="black", font=font)
    draw.text((12, 32), subtitle, fill=(90, 90, 90), font=small)
    for i, panels in enumerate(rows):
        for j, panel in enumerate(panels):
            ox, oy = j * W, HEADER_H + i * H
            series = [(m, band(c)) for m, c in panel["curves"].items() if c]
            if not series:
                continue
            xmax = max(b[0][-1] for _, b in series) or 1.0
            ylo, yhi = min(min(b[2]) for _, b in series), max(max(b[3]) for _, b in series)
            ylo, yhi = ylo - 0.05 * (yhi - ylo + 1e-3), yhi + 0.05 * (yhi - ylo + 1e-3)
            X, Y = pixels(ox, oy, xmax, ylo, yhi)
            draw.rectangle([X(0), Y(yhi), X(xmax), Y(ylo)], outline="black")
            for t in nice_ticks(0, xmax):
                draw.line([X(t), Y(ylo), X(t), Y(ylo) + 5], fill="black")
                tick = f"{t / 1000:g}k" if xmax >= 10000 and t else f"{t:g}"
                draw.text((X(t), Y(ylo) + 8), tick, fill="black", font=small, anchor="mt")
            for t in nice_ticks(ylo, yhi):
                draw.line([X(0) - 5, Y(t), X(0), Y(t)], fill="black")
                draw.line([X(0), Y(t), X(xmax), Y(t)], fill=(230, 230, 230))
                draw.text((X(0) - 8, Y(t)), f"{t:.2f}", fill="black", font=small, anchor="rm")
            draw.text((ox + L + (W - L - R) / 2, oy + H - 22), panel["xlabel"], fill="black", font=font, anchor="mm")
            draw.text((ox + L, oy + T - 26), panel["title"], fill="black", font=font)
            shade = Image.new("RGBA", img.size, (0, 0, 0, 0))
            sd = ImageDraw.Draw(shade)
            for m, (xs, _, lo, hi) in series:
                sd.polygon([(X(x), Y(y)) for x, y in zip(xs, hi)] + [(X(x), Y(y)) for x, y in zip(xs[::-1], lo[::-1])],
                           fill=COLORS[m] + (50,))
            img.paste(Image.alpha_composite(img.convert("RGBA"), shade).convert("RGB"))
            draw = ImageDraw.Draw(img)
            for m, (xs, mean, _, _) in series:
                draw.line([(X(x), Y(y)) for x, y in zip(xs, mean)], fill=COLORS[m], width=3, joint="curve")
            if j == 0:                                      # legend, top left inside the first panel of a row
                for k, (m, _) in enumerate(series):
                    lx, ly = X(0) + 12, Y(yhi) + 12 + 20 * k
                    draw.line([lx, ly, lx + 24, ly], fill=COLORS[m], width=4)
                    draw.text((lx + 30, ly), label(m), fill="black", font=small, anchor="lm")
    img.save(path)


def draw(runs: list[dict], settings: dict, path: Path):
    axes = [("iteration", "iteration"), ("fwd_eq", f"forward-equivalents (fwd + {FWD_BWD} fwd+bwd)"),
            ("time_s", "training seconds (1 CPU thread)")]
    rows = []
    for reward in settings["rewards"]:
        final = [r for r in runs if r["phase"] == "final" and r["reward"] == reward]
        rows.append([{"title": f"reward {reward}", "xlabel": xlabel,
                      "curves": {m: [[(p[x], p["reward"]) for p in r["curve"]] for r in final if r["method"] == m]
                                 for m in settings["methods"]}} for x, xlabel in axes])
    plot(rows, path, f"Toy model: held-out reward of each method's tuned configuration, {settings['final_budget']:g} "
                     f"s of training, {len(settings['seeds'])} seeds, {settings['eval_images']} held-out images",
         "lines: mean over seeds; shaded: ± one standard error over seeds; each curve up to the shortest run")


# ---- main ----
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPU cores, {platform.system()}"


def fractions(text: str) -> list[float]:
    return [float(Fraction(x.strip())) for x in text.split(",")]


def report(data: dict, out: Path) -> str:
    """Recomputes the analysis from the runs, prints the tables, draws the plot; returns the tables."""
    analysis = analyze(data["runs"], data["meta"]["settings"])
    text = tables(analysis, data["meta"]["settings"])
    print("\n" + text)
    draw(data["runs"], data["meta"]["settings"], out / "benchmark.png")
    data.update(analysis)
    return text


def main(argv=None):
    tic = time.time()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default runs/benchmark-<time>)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (each on one CPU thread)")
    ap.add_argument("--methods", default=",".join(RUNS), help="comma-separated trainers and variants")
    ap.add_argument("--rewards", default="toy,toy-soft", help="rewards of the final runs (the sweep uses the first)")
    ap.add_argument("--lr-factors", default="1/3,1,3", help="sweep: learning rates as multiples of the default")
    ap.add_argument("--clip-factors", default="1,10", help="sweep: clip ranges as multiples of the default")
    ap.add_argument("--tuning-seeds", default="100,101", help="sweep seeds, disjoint from the reporting seeds")
    ap.add_argument("--sweep-budget", type=float, default=40.0, help="training seconds per sweep run")
    ap.add_argument("--seeds", type=int, default=5, help="reporting seeds of the final runs (0, 1, ...)")
    ap.add_argument("--final-budget", type=float, default=60.0, help="training seconds per final run")
    ap.add_argument("--evals", type=int, default=4, help="held-out evaluations along a final run (after the first)")
    ap.add_argument("--eval-images", type=int, default=100, help="held-out images per evaluation")
    ap.add_argument("--eval-steps", type=int, default=20, help="ODE steps per evaluation image")
    ap.add_argument("--cost-prompts", type=int, default=2, help="prompts per iteration of the tiny-flux cost runs")
    ap.add_argument("--cost-iterations", type=int, default=2, help="iterations of the tiny-flux cost runs")
    ap.add_argument("--quick", action="store_true", help="every phase at tiny sizes: lr x {1, 3}, 2 tuning and 2 "
                    "reporting seeds, budgets of 1 and 2 s, 8 evaluation images, the trainers' tiny-flux smoke sizes")
    ap.add_argument("--no-fork", action="store_true", help="start every run as a new interpreter, not a fork of a "
                    "pre-imported server (slower: the imports take about 6 s a run)")
    ap.add_argument("--dry-run", action="store_true", help="print the grids, the run counts and the time estimate; "
                    "run nothing")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="redraw the plot and reprint the tables of a benchmark.json (into --out), without training")
    a = ap.parse_args(argv)
    if a.replot:
        data = json.loads(Path(a.replot).read_text())
        out = Path(a.out or Path(a.replot).parent).resolve()
        out.mkdir(parents=True, exist_ok=True)
        stored = data.get("chosen")
        report(data, out)
        if stored is not None and stored != data["chosen"]:
            raise SystemExit(f"the choices recomputed from the runs, {data['chosen']}, differ from the stored {stored}")
        print(f"\n{out}/benchmark.png redrawn from {a.replot}")
        return data
    if a.quick:
        a.lr_factors, a.clip_factors, a.tuning_seeds, a.seeds = "1,3", "1", "100,101", 2
        a.sweep_budget, a.final_budget, a.evals, a.eval_images, a.eval_steps, a.cost_iterations = 1.0, 2.0, 2, 8, 4, 1
    methods = [m.strip() for m in a.methods.split(",")]
    rewards = [r.strip() for r in a.rewards.split(",")]
    tuning_seeds = [int(s) for s in a.tuning_seeds.split(",")]
    seeds = list(range(a.seeds))
    if unknown := [m for m in methods if m not in RUNS]:
        ap.error(f"--methods: unknown {unknown}; choose from {', '.join(RUNS)}")
    if set(tuning_seeds) & set(seeds):
        ap.error(f"--tuning-seeds {tuning_seeds} must differ from the reporting seeds {seeds}")
    if min(a.seeds, a.jobs, a.evals, a.cost_prompts, a.cost_iterations) < 1 or min(a.sweep_budget,
                                                                                   a.final_budget) <= 0:
        ap.error("--seeds, --jobs, --evals, --cost-* and the budgets must be positive")
    out = Path(a.out or f"runs/benchmark-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if (out / "runs").exists() and any((out / "runs").iterdir()):
        ap.error(f"--out {out} already holds a benchmark; pass a new folder")
    grids = {m: grid(m, fractions(a.lr_factors), fractions(a.clip_factors)) for m in methods}
    settings = {**vars(a), "methods": methods, "rewards": rewards, "tuning_seeds": tuning_seeds, "seeds": seeds,
                "grids": grids, "default_configs": {m: default_config(m) for m in methods}}
    toy_argv = ["--eval-images", str(a.eval_images), "--eval-steps", str(a.eval_steps), "--iterations", "1000000",
                *(QUICK_SIZES if a.quick else [])]
    extra = lambda m: [*VARIANTS.get(m, (0, []))[1], *(QUICK_EXTRA.get(m, []) if a.quick else [])]  # noqa: E731
    if not a.no_fork:
        start_fork_server()
    startup, eval_s = STARTUP_S[FORK["context"] is not None], EVAL_S_PER_IMAGE_STEP * a.eval_images * a.eval_steps
    n_sweep, n_final = sum(map(len, grids.values())) * len(tuning_seeds), len(methods) * len(seeds) * len(rewards)
    est = {"sweep": n_sweep * (startup + a.sweep_budget + OVERSHOOT_S + 2 * eval_s) / a.jobs,
           "final": n_final * (startup + a.final_budget + OVERSHOOT_S + (a.evals + 1.5) * eval_s) / a.jobs,
           "costs": len(methods) * (startup + 1 if a.quick else COST_RUN_S) / a.jobs}
    print(f"{n_sweep} sweep runs, {n_final} final runs, {len(methods)} cost runs, {a.jobs} at a time: about "
          f"{sum(est.values()) / 60:.0f} minutes (sweep {est['sweep'] / 60:.0f}, final {est['final'] / 60:.0f}, costs "
          f"{est['costs'] / 60:.0f}; from a run's start-up, evaluations and budget measured on 2 CPU cores)")
    if a.dry_run:
        for m in methods:
            print(f"{m}: {' | '.join(config_str(c) for c in grids[m])}; costs: {' '.join(cost_setting(m, 2)[0])}")
        return None
    (out / "runs").mkdir(parents=True, exist_ok=True)

    def job(phase, m, seed, reward, config, argv, **kw):
        name = "-".join([phase, m] + ([reward] if reward else []) + ([config_str(config).replace(", ", "-")
                                                                      .replace(" ", "")] if config else [])
                        + ([f"seed{seed}"] if seed is not None else []))
        return {"phase": phase, "method": m, "reward": reward, "seed": seed, "config": config,
                "run_dir": f"runs/{name}", "argv": argv, **kw}

    # 1. sweep, on the first reward
    runs = run_all([job("sweep", m, s, rewards[0], cfg, [*toy_argv, *extra(m), *config_argv(cfg), "--seed", str(s),
                                                          "--reward", rewards[0], "--time-budget", str(a.sweep_budget),
                                                          "--eval-every", "1000000"])
                    for m in methods for cfg in grids[m] for s in tuning_seeds], out, a.jobs, "sweep", fatal=False)
    chosen = analyze(runs, settings)["chosen"]
    if missing := [m for m, c in chosen.items() if c is None]:
        raise RuntimeError(f"no sweep configuration of {missing} completed; see the logs under {out / 'runs'}")
    s_per_it = {m: statistics.median(r["s_per_it"] for r in runs if r["phase"] == "sweep" and r["method"] == m
                                     and r["config"] == chosen[m] and "failed" not in r) for m in methods}
    overhead = statistics.fmean(r["wall_s"] - r["train_s"] - 2 * eval_s for r in runs if "failed" not in r)
    left = (n_final * (overhead + a.final_budget + (a.evals + 1.5) * eval_s) / a.jobs + est["costs"]) / 60
    print(f"chosen: {'; '.join(f'{m} {config_str(c)}' for m, c in chosen.items())}. About {left:.0f} minutes left.")

    # 2. final runs of the chosen configurations, every reward; about `evals` evaluations along each
    every = {m: max(1, round(a.final_budget / s_per_it[m] / a.evals)) for m in methods}
    runs += run_all([job("final", m, s, reward, chosen[m],
                         [*toy_argv, *extra(m), *config_argv(chosen[m]), "--seed", str(s), "--reward", reward,
                          "--time-budget", str(a.final_budget), "--eval-every", str(every[m])], eval_every=every[m])
                     for reward in rewards for m in methods for s in seeds], out, a.jobs, "final")

    # 3. costs at full-scale FLUX settings on tiny-flux (in --quick, the trainers' own tiny-flux smoke sizes)
    import helpers
    cost_jobs = []
    for m in methods:
        argv_m, shown, paper = cost_setting(m, a.cost_prompts)
        if a.quick:
            argv_m, shown = [*helpers.tiny_argv(script(m), "flux"), *(VARIANTS[m][2] if m in VARIANTS else [])], {}
        cost_jobs.append(job("costs", m, None, None, None, [*argv_m, "--iterations", str(a.cost_iterations),
                                                           "--eval-every", "0"], paper=paper, settings=shown))
    runs += run_all(cost_jobs, out, a.jobs, "costs")

    # every method starts from the same weights and evaluates one seed on the same noise: the same "before"
    for s in tuning_seeds + seeds:
        for reward in rewards:
            before = {r["before"]["reward"] for r in runs if r["seed"] == s and r["reward"] == reward
                      and "failed" not in r}
            if len(before) > 1:
                raise RuntimeError(f"seed {s}, {reward}: the evaluations before training differ across runs: {before}")

    wall = time.time() - tic
    import torch
    meta = {"command": " ".join(["python", "tests/benchmark.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d"), "wall_s": wall, "estimate_s": est, "machine": machine(),
            "python": platform.python_version(), "torch": torch.__version__, "settings": settings}
    data = {"meta": meta, "runs": runs}
    report(data, out)
    (out / "benchmark.json").write_text(json.dumps(data, indent=1))
    print(f"\n{out}/benchmark.json, {out}/benchmark.png; {wall:.0f} s in all on {meta['machine']}")
    print(f"command: {meta['command']}")
    return data


if __name__ == "__main__":
    main()
