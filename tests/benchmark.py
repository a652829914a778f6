"""Side-by-side benchmark of the trainers (flow_grpo.py and every file copied from it, found by its shared-block
markers): the same toy task, seeds, evaluation and budgets.

Every trainer runs at its own toy defaults (the defaults of its Args fields), and for every seed twice, each
run a separate process on one CPU thread, `--jobs` of them at a time:
  - equal iterations: `--iterations N`, evaluated every N/4 iterations;
  - equal wall-clock: `--time-budget B` seconds of training (the trainers' time_s: rollouts, rewards and
    updates, evaluation left out), evaluated about four times along the way (the interval comes from the
    method's seconds per iteration in its equal-iteration runs).
The evaluation is the trainers' own: the ODE sampler on the held-out prompts with per-image fixed seeds, a
function of the run's seed, so one seed's "before" is the same for all four methods (checked here). The
work is counted by instrumenting the model (common.instrument: a forward hook on the transformer, a wrapper
on the VAE decode), which each trainer logs per iteration as nfe_fwd, nfe_fwd_bwd, decodes and reward_calls.
Last, as a cost comparison only, each trainer runs a few iterations of its tiny-flux defaults: the real FLUX
pipeline classes at tiny size with random weights, where rewards mean nothing and costs do.

Prints the tables (Markdown) and writes OUT/benchmark.json (the summary and every run's metrics) and
OUT/benchmark.png (held-out reward against iterations, training seconds and transformer evaluations).

  python tests/benchmark.py --budget 60        # the README's Results: about 17 minutes on 2 CPU cores
  python tests/benchmark.py --quick            # every code path at tiny sizes, under 2 minutes
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]


def find_trainers() -> list[str]:
    """The trainers are the top-level files carrying the shared-block markers (a forked method joins by being
    there); the baseline flow_grpo comes first."""
    names = sorted(p.stem for p in ROOT.glob("*.py") if "# >>> shared: args" in p.read_text())
    return sorted(names, key=lambda name: name != "flow_grpo")


METHODS = find_trainers()
PALETTE = [(90, 90, 90), (214, 39, 40), (31, 119, 180), (44, 160, 44), (255, 127, 14), (148, 103, 189),
           (140, 86, 75), (227, 119, 194)]
KNOWN = ["flow_grpo", "v_grpo", "g2rpo", "pro_grpo"]      # the README plot's colours; a fork takes the next one
COLORS = {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(KNOWN + [m for m in METHODS if m not in KNOWN])}
# --quick: tiny sizes that every trainer accepts (Pro-GRPO's funnel has to fit in its group)
QUICK_SIZES = ["--prompts-per-step", "2", "--group-size", "4", "--micro-batch", "4", "--sample-steps", "4",
               "--eval-steps", "4"]
QUICK_EXTRA = {"pro_grpo": ["--group-size", "8", "--funnel", "6,4", "--checkpoints", "2,3"]}


# ---- running the trainers ----
def train(method: str, run_dir: Path, argv: list[str]) -> list[dict]:
    """Runs one trainer in its own process (one thread); returns its metrics.jsonl lines."""
    cmd = [sys.executable, str(ROOT / f"{method}.py"), "--output-dir", str(run_dir), "--threads", "1", *argv]
    log = run_dir.with_suffix(".log")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=run_dir.parent).returncode
    if rc:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}); the end of {log}:\n{log.read_text()[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_all(jobs: list[tuple], n_parallel: int, desc: str) -> list:
    """Runs jobs (method, run_dir, argv) n_parallel at a time, in the order given; returns their metrics."""
    with ThreadPoolExecutor(n_parallel) as pool, tqdm(total=len(jobs), desc=desc) as bar:
        futures = [pool.submit(train, *job) for job in jobs]
        out = []
        try:
            for f in futures:
                out.append(f.result())
                bar.update()
        except BaseException:                               # stop at the first failure: drop the queued runs
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return out


# ---- reading a run ----
def digest(lines: list[dict], run_dir: Path) -> dict:
    """One run's numbers: per-iteration cost, the evaluations as a curve, before and after."""
    steps = [m for m in lines if "nfe_fwd" in m]          # training iterations (the last line only evaluates)
    evals = [m for m in lines if "eval_reward" in m]
    ends = [0.0] + [m["time_s"] for m in steps]             # time_s: training seconds at the end of each iteration
    nfe = [0] + [m["nfe_fwd"] + m["nfe_fwd_bwd"] for m in steps]
    cum = [sum(nfe[:i + 1]) for i in range(len(nfe))]      # evaluations before iteration i
    curve = [{"iteration": m["iteration"], "time_s": ends[m["iteration"]], "nfe": cum[m["iteration"]],
              "reward": m["eval_reward"], "accuracy": m.get("eval_accuracy")} for m in evals]
    mean = lambda key: statistics.fmean(m[key] for m in steps)  # noqa: E731
    args = json.loads((run_dir / "args.json").read_text())
    return {
        "iterations": len(steps), "prompts_per_step": args["prompts_per_step"],
        "s_per_it": statistics.median(b - a for a, b in zip(ends, ends[1:])), "train_s": ends[-1],
        **{k: mean(k) for k in ("nfe_fwd", "nfe_fwd_bwd", "decodes", "reward_calls")},
        "nfe_total": cum[-1], "curve": curve, "before": curve[0] if curve else None,
        "after": curve[-1] if curve else None,
    }


def mean_std(xs) -> tuple[float, float]:
    xs = [x for x in xs if x is not None]
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (math.nan, 0.0)


def summarize(runs: list[dict]) -> dict:
    """Mean and std over seeds of one method in one mode."""
    s = {"seeds": len(runs), "s_per_it": statistics.median(r["s_per_it"] for r in runs)}
    for k in ("iterations", "train_s", "nfe_fwd", "nfe_fwd_bwd", "decodes", "reward_calls", "nfe_total"):
        s[k] = statistics.fmean(r[k] for r in runs)
    s["nfe_per_prompt"] = (s["nfe_fwd"] + s["nfe_fwd_bwd"]) / runs[0]["prompts_per_step"]
    if runs[0]["before"] is None:                          # cost runs: no evaluation
        return s
    for when in ("before", "after"):
        for k in ("reward", "accuracy"):
            s[f"{k}_{when}"] = mean_std(r[when][k] for r in runs)
    s["gain_per_1k_nfe"] = mean_std((r["after"]["reward"] - r["before"]["reward"]) / r["nfe_total"] * 1000
                                    for r in runs)
    return s


def reach(runs: list[dict], methods: list[str], target_method: str = "flow_grpo") -> dict:
    """The first evaluation of each method's equal-iteration runs (mean over seeds; all seeds evaluate at the
    same iterations) whose mean held-out reward reaches target_method's final one."""
    def mean_curve(m):
        rs = [r for r in runs if r["method"] == m and r["mode"] == "iterations"]
        return [{k: statistics.fmean(r["curve"][i][k] for r in rs) for k in ("iteration", "time_s", "nfe", "reward")}
                for i in range(min(len(r["curve"]) for r in rs))]
    target = mean_curve(target_method)[-1]["reward"]
    return {"target": target, **{m: next((p for p in mean_curve(m) if p["reward"] >= target), None) for m in methods}}


# ---- tables ----
def pm(ms, digits=3) -> str:
    return f"{ms[0]:.{digits}f} ± {ms[1]:.{digits}f}"


def table(summary: dict, mode: str) -> str:
    if mode == "tiny-flux":
        head = ["method", "s/it (median)", "fwd/it", "fwd+bwd/it", "decodes/it", "reward calls/it"]
        rows = [[m, f"{s['s_per_it']:.2f}", f"{s['nfe_fwd']:.0f}", f"{s['nfe_fwd_bwd']:.0f}", f"{s['decodes']:.0f}",
                 f"{s['reward_calls']:.0f}"] for m, s in summary.items()]
    else:
        head = ["method", "iterations", "s/it (median)", "fwd/it", "fwd+bwd/it", "evals/prompt", "decodes/it",
                "reward calls/it", "reward before -> after", "accuracy before -> after", "reward gain / 1k evals"]
        rows = [[m, f"{s['iterations']:.1f}", f"{s['s_per_it']:.2f}", f"{s['nfe_fwd']:.0f}", f"{s['nfe_fwd_bwd']:.0f}",
                 f"{s['nfe_per_prompt']:.0f}", f"{s['decodes']:.0f}", f"{s['reward_calls']:.0f}",
                 f"{pm(s['reward_before'])} -> {pm(s['reward_after'])}",
                 f"{pm(s['accuracy_before'])} -> {pm(s['accuracy_after'])}", pm(s["gain_per_1k_nfe"], 4)]
                for m, s in summary.items()]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# ---- the plot (Pillow) ----
def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    raw = (hi - lo) / n or 1.0
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def band(curves: list[list[tuple]], points: int = 40) -> tuple[list, list, list, list]:
    """Seeds' curves (x, y) interpolated onto one x grid up to the shortest: grid, mean, min, max."""
    end = min(c[-1][0] for c in curves)
    xs = [end * i / (points - 1) for i in range(points)]

    def interp(c, x):
        for (xa, ya), (xb, yb) in zip(c, c[1:]):
            if xa <= x <= xb:
                return ya if xb == xa else ya + (yb - ya) * (x - xa) / (xb - xa)
        return c[-1][1]
    ys = [[interp(c, x) for c in curves] for x in xs]
    return xs, [statistics.fmean(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def plot(panels: list[dict], path: Path, title: str):
    from PIL import Image, ImageDraw, ImageFont
    W, H, L, R, T, B = 560, 460, 70, 20, 50, 60                # one panel and its margins
    try:
        font, small = ImageFont.load_default(size=17), ImageFont.load_default(size=14)
    except TypeError:                                       # Pillow < 10.1: the bitmap font
        font = small = ImageFont.load_default()
    def pixels(ox, oy, xmax, ylo, yhi):
        """A panel's maps from data to pixel coordinates."""
        return (lambda x: ox + L + (x / xmax) * (W - L - R),
                lambda y: oy + H - B - (y - ylo) / (yhi - ylo) * (H - T - B))

    img = Image.new("RGB", (W * len(panels), H + 40), "white")
    draw = ImageDraw.Draw(img)
    draw.text((12, 8), title, fill="black", font=font)
    for p, panel in enumerate(panels):
        ox, oy = p * W, 40
        series = [(m, band(c)) for m, c in panel["curves"].items()]
        xmax = max(b[0][-1] for _, b in series) or 1.0
        ylo, yhi = min(min(b[2]) for _, b in series), max(max(b[3]) for _, b in series)
        ylo, yhi = ylo - 0.05 * (yhi - ylo + 1e-3), yhi + 0.05 * (yhi - ylo + 1e-3)
        X, Y = pixels(ox, oy, xmax, ylo, yhi)
        draw.rectangle([X(0), Y(yhi), X(xmax), Y(ylo)], outline="black")
        for t in nice_ticks(0, xmax):
            draw.line([X(t), Y(ylo), X(t), Y(ylo) + 5], fill="black")
            label = f"{t / 1000:g}k" if xmax >= 10000 and t else f"{t:g}"
            draw.text((X(t), Y(ylo) + 8), label, fill="black", font=small, anchor="mt")
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
        for i, m in enumerate(panel["curves"]):                  # legend, top left inside the axes
            lx, ly = X(0) + 12, Y(yhi) + 12 + 20 * i
            draw.line([lx, ly, lx + 24, ly], fill=COLORS[m], width=4)
            draw.text((lx + 30, ly), m, fill="black", font=small, anchor="lm")
    draw.text((12, 8 + 20),
              "lines: mean over seeds; shaded: min to max over seeds; y: held-out reward (ODE, fixed seeds)",
              fill=(90, 90, 90), font=small)
    img.save(path)


# ---- main ----
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPU cores, {platform.system()}"



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--budget", type=float, default=60.0, help="training seconds per equal-wall-clock run")
    ap.add_argument("--iterations", type=int, default=8, help="iterations per equal-iteration run")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per method (0, 1, ...)")
    ap.add_argument("--eval-images", type=int, default=100, help="held-out images per evaluation")
    ap.add_argument("--tiny-iterations", type=int, default=3, help="iterations of the tiny-flux cost runs")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (each on one CPU thread)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated trainers")
    ap.add_argument("--out", default=None, help="output folder (default runs/benchmark-<time>)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes: 2 seeds, 2 iterations, a 3 s budget, 8 evaluation images")
    a = ap.parse_args(argv)
    if a.quick:
        a.iterations, a.seeds, a.budget, a.eval_images, a.tiny_iterations = 2, 2, 3.0, 8, 1
    methods = [m.strip() for m in a.methods.split(",")]
    if unknown := [m for m in methods if m not in METHODS]:
        ap.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    if a.seeds < 1 or a.iterations < 1 or a.budget <= 0 or a.jobs < 1:
        ap.error("--seeds, --iterations, --budget and --jobs must be positive")
    out = Path(a.out or f"runs/benchmark-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if (out / "runs").exists() and any((out / "runs").iterdir()):
        ap.error(f"--out {out} already holds a benchmark; pass a new folder")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    sizes = QUICK_SIZES if a.quick else []
    common_argv = ["--eval-images", str(a.eval_images), *sizes]
    extra = lambda m: QUICK_EXTRA.get(m, []) if a.quick else []  # noqa: E731
    seeds = range(a.seeds)
    tic = time.time()

    def job(m, mode, seed, argv):
        name = f"{m}-{mode}" + ("" if seed is None else f"-seed{seed}")
        return {"method": m, "mode": mode, "seed": seed, "run_dir": f"runs/{name}", "argv": argv}

    def run(jobs, desc):
        results = run_all([(j["method"], out / j["run_dir"], j["argv"]) for j in jobs], a.jobs, desc)
        return [{**j, **digest(lines, out / j["run_dir"])} for j, lines in zip(jobs, results)]

    # 1. equal iterations, and the tiny-flux cost runs
    runs = run([job(m, "iterations", s, [*common_argv, *extra(m), "--seed", str(s), "--iterations", str(a.iterations),
                                         "--eval-every", str(max(1, a.iterations // 4))])
                for m in methods for s in seeds]
               + [job(m, "tiny-flux", None, ["--model", "tiny-flux", "--iterations", str(a.tiny_iterations),
                                             "--eval-every", "0"]) for m in methods], "equal iterations + tiny-flux")

    # 2. equal wall-clock: about four evaluations along the way, from the method's seconds per iteration
    s_per_it = {m: statistics.median(r["s_per_it"] for r in runs if r["method"] == m and r["mode"] == "iterations")
                for m in methods}
    runs += run([job(m, "clock", s, [*common_argv, *extra(m), "--seed", str(s), "--iterations", "1000000",
                                     "--time-budget", str(a.budget),
                                     "--eval-every", str(max(1, round(a.budget / s_per_it[m] / 4)))])
                 for m in methods for s in seeds], "equal wall-clock")

    # every method starts from the same weights and evaluates one seed on the same noise: the same "before"
    for s in seeds:
        before = {(r["before"]["reward"], r["before"]["accuracy"]) for r in runs if r["seed"] == s}
        if len(before) != 1:
            raise RuntimeError(f"seed {s}: the evaluations before training differ across runs: {before}")

    summary = {mode: {m: summarize([r for r in runs if r["method"] == m and r["mode"] == mode]) for m in methods}
               for mode in ("iterations", "clock", "tiny-flux")}
    titles = {"iterations": f"Toy, {a.iterations} iterations each ({a.seeds} seeds, {a.eval_images} held-out images)",
              "clock": f"Toy, {a.budget:g} s of training each ({a.seeds} seeds, {a.eval_images} held-out images)",
              "tiny-flux": f"tiny-flux (random weights), {a.tiny_iterations} iterations: costs only"}
    text = "\n\n".join(f"### {titles[mode]}\n\n{table(summary[mode], mode)}" for mode in summary)
    if "flow_grpo" in methods:
        summary["reach"] = reach(runs, methods)
        rows = [f"| {m} | " + (f"{p['iteration']:.0f} | {p['nfe']:.0f} | {p['time_s']:.0f} |" if p else
                               f"not within {a.iterations} | | |")
                for m, p in summary["reach"].items() if m != "target"]
        text += (f"\n\n### First evaluation reaching flow_grpo's reward after {a.iterations} iterations "
                 f"({summary['reach']['target']:.3f}, mean over seeds)\n\n"
                 "| method | iteration | transformer evaluations | training seconds |\n|---|---|---|---|\n"
                 + "\n".join(rows))
    print("\n" + text)
    wall = time.time() - tic
    import torch
    meta = {"command": " ".join(["python", "tests/benchmark.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d"), "wall_s": wall, "machine": machine(),
            "python": platform.python_version(), "torch": torch.__version__, "settings": vars(a)}
    (out / "benchmark.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    curves = lambda mode, x: {m: [[(p[x], p["reward"]) for p in r["curve"]] for r in runs  # noqa: E731
                                  if r["method"] == m and r["mode"] == mode] for m in methods}
    plot([{"title": f"equal iterations ({a.iterations})", "xlabel": "iteration",
           "curves": curves("iterations", "iteration")},
          {"title": f"equal wall-clock ({a.budget:g} s)", "xlabel": "training seconds (1 CPU thread)",
           "curves": curves("clock", "time_s")},
          {"title": f"equal wall-clock ({a.budget:g} s)", "xlabel": "transformer evaluations (fwd + fwd+bwd)",
           "curves": curves("clock", "nfe")}],
         out / "benchmark.png", f"Toy model, {a.seeds} seeds, {a.eval_images} held-out images per evaluation")
    print(f"\n{out}/benchmark.json, {out}/benchmark.png; {wall:.0f} s in all on {meta['machine']}")
    return {"meta": meta, "summary": summary, "runs": runs}


if __name__ == "__main__":
    main()
