"""The side-by-side benchmark (tests/benchmark.py). Its --quick mode runs every phase for every trainer: what it
reports is what the runs logged, the sweep's choice is its best configuration, the paired differences come from
the per-seed rewards, and --replot reproduces the tables from the JSON. Its statistics and settings are checked
on their own."""
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
from PIL import Image

import benchmark
from benchmark import RUNS
from helpers import ROOT, read_metrics, tiny_pipeline


def tables_of(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("|", "### "))]


# slow: the whole benchmark at tiny sizes; its parts (the interval, the choice, the cost runs) are checked below
@pytest.mark.slow
def test_quick_benchmark(tmp_path):
    out = tmp_path / "bench"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "benchmark.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    failed = [ln for ln in proc.stderr.splitlines() if " failed (exit " in ln]     # which run, with its exit status
    assert proc.returncode == 0, "\n".join([proc.stdout[-3000:], *failed, proc.stderr[-3000:]])
    data = json.loads((out / "benchmark.json").read_text())
    runs, settings = data["runs"], data["meta"]["settings"]
    assert set(data) == {"meta", "runs", "sweep", "chosen", "summary", "costs"}
    assert {"command", "date", "wall_s", "machine", "torch", "estimate_s"} <= set(data["meta"])
    sweep = [r for r in runs if r["phase"] == "sweep"]
    final = [r for r in runs if r["phase"] == "final"]
    failed_runs = [f"{r['run_dir']}: {r['failed']}" for r in runs if "failed" in r]
    assert not failed_runs, "\n".join(failed_runs)

    # the sweep: every configuration of every method on each tuning seed, the toy reward, lr x {1, 3}
    assert settings["tuning_seeds"] == [100, 101] and settings["rewards"] == ["toy", "toy-soft"]
    for m in RUNS:
        default = settings["default_configs"][m]
        assert settings["grids"][m] == [default, {**default, "lr": float(f"{3 * default['lr']:.3g}")}]
    assert sorted((r["method"], json.dumps(r["config"]), r["seed"]) for r in sweep) == sorted(
        (m, json.dumps(c), s) for m in RUNS for c in settings["grids"][m] for s in (100, 101))
    assert all(r["reward"] == "toy" for r in sweep)

    # the choice is the best mean final reward over the tuning seeds, a tie going to the default
    for m in RUNS:
        means = [(statistics.fmean(r["after"]["reward"] for r in sweep if r["method"] == m and r["config"] == c), c)
                 for c in settings["grids"][m]]
        best = max(v for v, _ in means)
        default = settings["default_configs"][m]
        expected = default if dict((json.dumps(c), v) for v, c in means)[json.dumps(default)] == best else next(
            c for v, c in means if v == best)
        assert data["chosen"][m] == expected
        assert all(r["config"] == expected for r in final if r["method"] == m)
        assert sum(row["chosen"] for row in data["sweep"][m]["rows"]) == 1

    # the final runs: the chosen configuration, both rewards, seeds 0 and 1, disjoint from the tuning seeds
    assert sorted((r["method"], r["reward"], r["seed"]) for r in final) == sorted(
        (m, rw, s) for m in RUNS for rw in ("toy", "toy-soft") for s in (0, 1))
    budget = settings["final_budget"]
    for r in final:
        lines = read_metrics(out / r["run_dir"])
        steps = [m for m in lines if "nfe_fwd" in m]
        evals = [m for m in lines if "eval_reward" in m]
        assert r["iterations"] == len(steps) and len(r["curve"]) == len(evals) >= 2
        assert (r["before"]["reward"], r["after"]["reward"]) == (evals[0]["eval_reward"], evals[-1]["eval_reward"])
        assert all(m["time_s"] < budget for m in steps[:-1]) and lines[-1]["time_s"] >= budget
        # forward-equivalents: a forward+backward counted as 3 forwards, summed over the iterations before
        for p in r["curve"]:
            assert p["fwd_eq"] == sum(m["nfe_fwd"] + 3 * m["nfe_fwd_bwd"] for m in steps[:p["iteration"]])
            assert p["time_s"] == (steps[p["iteration"] - 1]["time_s"] if p["iteration"] else 0.0)
        # 8 images under the three-level reward give multiples of 1/16; the continuous one does not
        on_grid = [abs(m["eval_reward"] * 16 - round(m["eval_reward"] * 16)) < 1e-6 for m in evals]
        assert all(on_grid) if r["reward"] == "toy" else not all(on_grid)
        assert f"eval_{r['reward']}" in evals[0]

    # one seed's evaluation before training is the same for every method and configuration
    for s in (0, 1, 100, 101):
        for rw in ("toy", "toy-soft"):
            assert len({r["before"]["reward"] for r in runs if r["seed"] == s and r["reward"] == rw}) <= 1

    # the instrumented counts equal a hand count: flow_grpo at the quick sizes runs N = 2 prompts x 4 samples
    # through T = 4 SDE steps, trains the first 3 of them, and evaluates the reference (KL on) on those 3; its
    # Fast variant trains the one step of its window, without a KL
    for r in (r for r in runs if r["method"] == "flow_grpo" and r["phase"] != "costs"):
        assert (r["nfe_fwd"], r["nfe_fwd_bwd"], r["decodes"], r["reward_calls"]) == (8 * 4 + 8 * 3, 8 * 3, 8, 8)
    for r in (r for r in runs if r["method"] == "flow_grpo-fast" and r["phase"] != "costs"):
        assert (r["nfe_fwd"], r["nfe_fwd_bwd"], r["decodes"], r["reward_calls"]) == (8 * 4, 8 * 1, 8, 8)

    # the paired differences, by hand from the raw runs: per seed, then a t-interval on 1 degree of freedom
    for rw in ("toy", "toy-soft"):
        after = {(r["method"], r["seed"]): r["after"]["reward"] for r in final if r["reward"] == rw}
        for m in RUNS[1:]:
            d = [after[m, s] - after["flow_grpo", s] for s in (0, 1)]
            mean, se = statistics.fmean(d), abs(d[0] - d[1]) / 2      # sd / sqrt(2) for two values
            got = data["summary"][rw][m]["diff_vs_flow_grpo"]
            assert got["mean"] == pytest.approx(mean) and got["se"] == pytest.approx(se)
            assert (got["lo"], got["hi"]) == pytest.approx((mean - 12.706 * se, mean + 12.706 * se))
            assert got["word"] == ("clear" if got["lo"] > 0 or got["hi"] < 0 else "within noise")
            assert f"{got['mean']:+.3f} [{got['lo']:+.3f}, {got['hi']:+.3f}] {got['word']}" in proc.stdout
        s = data["summary"][rw]["flow_grpo"]
        a = [after["flow_grpo", 0], after["flow_grpo", 1]]
        assert s["reward_after"] == pytest.approx([statistics.fmean(a), statistics.stdev(a) / math.sqrt(2)])

    # the costs: one tiny-flux run per method, counts per prompt = counts per iteration / prompts
    costs = [r for r in runs if r["phase"] == "costs"]
    assert sorted(r["method"] for r in costs) == sorted(RUNS)
    for r in costs:
        c = data["costs"][r["method"]]
        assert c["per_prompt"]["nfe_fwd"] == r["nfe_fwd"] / r["prompts_per_step"] > 0
        assert c["per_prompt"]["fwd_eq"] == pytest.approx((r["nfe_fwd"] + 3 * r["nfe_fwd_bwd"]) / r["prompts_per_step"])
        # per image scored: what the trainer scores (its reward calls), not prompts x group
        assert c["per_image"]["nfe_fwd"] == pytest.approx(r["nfe_fwd"] / r["reward_calls"])
        assert f"{c['per_image']['nfe_fwd']:.3g} fwd + {c['per_image']['nfe_fwd_bwd']:.3g} fwd+bwd per image " \
               f"scored" in proc.stdout
        assert f"| {benchmark.label(r['method'])} | {c['paper']['prompts_per_step']} |" in proc.stdout

    img = Image.open(out / "benchmark.png")
    assert img.size == (3 * benchmark.PANEL_W, 2 * benchmark.PANEL_H + benchmark.HEADER_H)
    assert len(img.getcolors(1 << 16)) > 20                        # panels with lines and bands, not blank

    # --replot: the same tables and a plot again, from the JSON alone
    replot = subprocess.run([sys.executable, str(ROOT / "tests" / "benchmark.py"), "--replot",
                             str(out / "benchmark.json"), "--out", str(tmp_path / "replot")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert replot.returncode == 0, replot.stdout[-3000:] + replot.stderr[-3000:]
    assert tables_of(replot.stdout) == tables_of(proc.stdout) and len(tables_of(proc.stdout)) > 30
    assert Image.open(tmp_path / "replot" / "benchmark.png").size == img.size

    # a forked run is the trainer's own run: a new interpreter with the same options logs the same numbers for the
    # iterations the budgeted run trained (as many as this machine's speed gave it: one at least)
    r = next(r for r in final if r["method"] == "g2rpo" and r["reward"] == "toy-soft")
    forked = [m for m in read_metrics(out / r["run_dir"]) if "loss" in m]
    argv = [a if a != str(budget) else "0" for a in r["argv"]]  # no time budget: the iterations the run reached
    argv[argv.index("--iterations") + 1] = str(len(forked))
    subprocess.run([sys.executable, str(ROOT / "g2rpo.py"), "--output-dir", str(tmp_path / "fresh"), "--threads", "1",
                    *argv], capture_output=True, timeout=300, env=env, check=True)
    fresh = [m for m in read_metrics(tmp_path / "fresh") if "loss" in m]
    assert len(fresh) == len(forked) >= 1 and r["iterations"] == len(forked)
    for a, b in zip(fresh, forked):
        keys = [k for k in a if k in b and not k.startswith("t")]
        assert len(keys) > 20 and {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_paired_interval_and_t_quantiles():
    assert benchmark.t975(4) == 2.776 and benchmark.t975(30) == pytest.approx(2.042, abs=2e-3)
    assert benchmark.t975(200) == pytest.approx(1.972, abs=2e-3)
    # differences 1, 2, 3: mean 2, sd 1, se 1/sqrt 3, t(2) = 4.303: [-0.484, 4.484], within noise
    d = benchmark.paired({"0": 1.0, "1": 2.0, "2": 3.0, "9": 5.0}, {"0": 0.0, "1": 0.0, "2": 0.0})
    assert d["n"] == 3 and d["mean"] == 2.0 and d["se"] == pytest.approx(1 / math.sqrt(3))
    assert (d["lo"], d["hi"]) == pytest.approx((2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)))
    assert d["word"] == "within noise"
    # the same offset on every seed is clear however noisy the seeds are; a sign flip is not
    assert benchmark.paired({"0": 0.9, "1": 0.3, "2": 0.61}, {"0": 0.8, "1": 0.2, "2": 0.5})["word"] == "clear"
    assert benchmark.paired({"0": 0.9, "1": 0.1}, {"0": 0.8, "1": 0.2})["word"] == "within noise"


def sweep_run(method, config, seed, reward=None):
    run = {"phase": "sweep", "method": method, "config": config, "seed": seed, "iterations": 3, "s_per_it": 1.0,
           "clip_frac": 0.0}
    return {**run, "failed": "exit 1"} if reward is None else {**run, "after": {"reward": reward}}


def test_sweep_choice_ties_go_to_the_default_and_failures_lose():
    a, b, c = {"lr": 1e-4}, {"lr": 3e-4}, {"lr": 1e-3}
    settings = {"methods": ["m"], "grids": {"m": [a, b, c]}, "default_configs": {"m": b}, "tuning_seeds": [100, 101],
                "rewards": []}
    runs = [sweep_run("m", a, 100, 0.8), sweep_run("m", a, 101, 0.7), sweep_run("m", b, 100, 0.7),
            sweep_run("m", b, 101, 0.8), sweep_run("m", c, 100, 0.9), sweep_run("m", c, 101)]
    out = benchmark.analyze(runs, settings)
    assert out["chosen"]["m"] == b                                   # a ties with the default b; c failed once
    rows = out["sweep"]["m"]["rows"]
    assert [r["mean"] for r in rows] == pytest.approx([0.75, 0.75, None]) and out["sweep"]["m"]["clip_inert"]
    runs[2] = sweep_run("m", b, 100, 0.69)
    assert benchmark.analyze(runs, settings)["chosen"]["m"] == a


def test_cost_runs_use_the_papers_flux_group_sizes():
    """The cost runs on the tiny FLUX pipeline put back the FLUX values that the smoke-run sizes replace."""
    want = {"flow_grpo": {"group_size": 24, "sample_steps": 6},
            "pro_grpo": {"group_size": 48, "funnel": "24,12", "checkpoints": "3,4", "sample_steps": 6},
            "g2rpo": {"group_size": 12, "sample_steps": 16, "granularities": "1,2,3"},
            "v_grpo": {"group_size": 12, "sample_steps": 16, "mc_pairs": 4},
            "flow_grpo-fast": {"group_size": 24, "sample_steps": 6, "sde_window": 3, "sde_window_range": "0,3",
                               "sde_type": "cps", "noise_level": 0.8, "clip_range": 1e-5, "global_std": False}}
    papers = {"flow_grpo": 48, "pro_grpo": 48, "g2rpo": 16, "v_grpo": 32, "flow_grpo-fast": 48}
    for m, settings in want.items():
        argv, shown, paper = benchmark.cost_setting(m, 2)
        assert argv[:4] == ["--model", "flux", "--model-path", tiny_pipeline("flux")]
        assert paper["prompts_per_step"] == papers[m]
        assert shown.items() >= settings.items(), (m, shown)
        for k, v in {**shown, "prompts_per_step": 2}.items():
            if isinstance(v, bool):                                 # a switch: --name or --no-name
                assert argv.count(f"--{'' if v else 'no-'}{k.replace('_', '-')}") == 1, (m, k)
            elif k != "granularities":                              # the Args default, not shrunk: not passed
                flag = "--" + k.replace("_", "-")
                value = argv[argv.index(flag) + 1]
                assert argv.count(flag) == 1 and (value == str(v) or isinstance(v, float) and float(value) == v), (m, k)


@pytest.mark.slow
def test_the_threads_benchmark_prints_its_table(capsys):
    """tests/benchmark_threads.py --quick: every condition and behaviour measured once, its seconds per iteration in
    the table (the times and targets mean nothing at these sizes)."""
    import benchmark_threads
    cells = benchmark_threads.main(["--quick"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0][2:] for line in table[1:]] == list(benchmark_threads.CONDITIONS)
    for line, (condition, row) in zip(table[1:], cells.items()):
        assert all(len(runs) == 1 and runs[0] > 0 for runs in row.values()), condition
        assert line.split(" | ")[1:4] == [f"{row[b][0]:.2f}" for b in ("before", "one thread", "now")]
