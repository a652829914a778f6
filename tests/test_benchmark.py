"""The side-by-side benchmark (tests/benchmark.py) in its --quick mode: every trainer goes through both budgets
and the tiny-flux cost run, and what the benchmark reports is what the runs logged."""
import json
import os
import subprocess
import sys

from PIL import Image

from benchmark import METHODS
from helpers import ROOT, read_metrics


def test_quick_benchmark(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "benchmark.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "benchmark.json").read_text())
    runs, budget = data["runs"], data["meta"]["settings"]["budget"]

    # every method: 2 seeds x (equal iterations, equal wall-clock), and one tiny-flux cost run
    assert sorted((r["method"], r["mode"], r["seed"]) for r in runs if r["mode"] != "tiny-flux") == sorted(
        (m, mode, s) for m in METHODS for mode in ("iterations", "clock") for s in (0, 1))
    assert sorted(r["method"] for r in runs if r["mode"] == "tiny-flux") == sorted(METHODS)
    for m in METHODS:
        assert f"| {m} |" in proc.stdout
        assert set(data["summary"]["iterations"][m]) >= {"s_per_it", "nfe_fwd", "reward_before", "gain_per_1k_nfe"}

    # the instrumented counts equal a hand count: flow_grpo at the quick sizes runs N = 2 prompts x 4 samples
    # through T = 4 SDE steps, trains the first 3 of them, and evaluates the reference (KL on) on those 3
    flow = [r for r in runs if r["method"] == "flow_grpo" and r["mode"] == "iterations"]
    assert all((r["nfe_fwd"], r["nfe_fwd_bwd"], r["decodes"], r["reward_calls"]) == (8 * 4 + 8 * 3, 8 * 3, 8, 8)
               for r in flow)

    for r in runs:
        lines = read_metrics(out / r["run_dir"])
        steps = [m for m in lines if "nfe_fwd" in m]
        assert r["iterations"] == len(steps) and r["nfe_total"] == sum(m["nfe_fwd"] + m["nfe_fwd_bwd"] for m in steps)
        if r["mode"] == "tiny-flux":
            assert r["iterations"] == 1 and r["nfe_fwd"] > 0 and r["before"] is None
            continue
        evals = [m for m in lines if "eval_reward" in m]
        assert (r["before"]["reward"], r["after"]["reward"]) == (evals[0]["eval_reward"], evals[-1]["eval_reward"])
        assert r["before"]["iteration"] == 0 and r["after"]["iteration"] == lines[-1]["iteration"] == len(steps)
        if r["mode"] == "clock":  # --time-budget: trained until the budget ran out, then stopped at once
            assert all(m["time_s"] < budget for m in steps[:-1]) and lines[-1]["time_s"] >= budget

    # one seed's evaluation before training is the same for every method (same weights, same noise)
    for s in (0, 1):
        assert len({r["before"]["reward"] for r in runs if r["seed"] == s}) == 1

    img = Image.open(out / "benchmark.png")
    assert img.size == (1680, 500) and len(img.getcolors(1 << 16)) > 20   # three panels with lines, not blank
