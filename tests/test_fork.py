"""Forks. A method the machinery has never seen: tests/likelihood_free.py, a likelihood-free fork of flow_grpo.py (ODE
rollouts, no ratio, no KL, an old policy of its own). It learns nothing in particular here; what is checked is that
common.py serves it unchanged: --preflight passes with the rows it cannot fill n/a, and --resume continues it bitwise,
its old policy (extra state) included. Then forks across versions (tests/fix_copies.py) and a method that changes only
flow_grpo.py's loss."""
import importlib.util
import json
import re
import shutil
import sys

import pytest
import torch

import common
import fix_copies
import likelihood_free
from helpers import ROOT, SMALL, read_metrics, run, straight_and_resumed, trained_params, training_state

BASE = (ROOT / "flow_grpo.py").read_text()


def test_the_fork_passes_the_preflight_with_what_it_does_not_log_not_applicable(tmp_path):
    with pytest.raises(common.TrainingStopped) as stop:
        run(likelihood_free, ["--output-dir", str(tmp_path / "run"), "--preflight"])
    report = json.loads((tmp_path / "run" / "preflight.json").read_text())
    rows = {r["check"]: r for r in report["rows"]}
    assert stop.value.exit_code == 0 and report["passed"], report["rows"]
    assert rows["first update on-policy"]["status"] == "n/a" and not any("ratio" in check for check in rows)
    assert rows["gradients finite"]["status"] == rows["step size, change / weights (L2)"]["status"] == "PASS"
    assert "ratio_dev" not in report["metrics"] and "kl" not in report["metrics"]


def test_the_fork_resumes_bitwise_with_its_old_policy(tmp_path):
    argv = ["--eval-every", "1", "--save-every", "1"]
    straight, resumed = straight_and_resumed(likelihood_free, argv, split=1, total=3, tmp_path=tmp_path)
    assert straight == resumed and [m["iteration"] for m in straight] == [0, 1, 2, 3]
    a, b = (training_state(tmp_path / name / "checkpoints" / "iter_000003") for name in ("straight", "split"))
    old_a, old_b = (s["extra"]["old_policy"] for s in (a, b))
    assert len(old_a) == len(a["params"]) and all(torch.equal(x, y) for x, y in zip(old_a, old_b))
    # the old policy is a state of its own: a soft copy that lags the weights, not the weights again
    assert not all(torch.equal(old_a[i], a["params"][str(i)]) for i in range(len(old_a)))


def test_a_checkpoint_without_the_old_policy_is_refused(tmp_path):
    """A state/ without the fork's old policy (saved again without it) is the one refusal of a damaged checkpoint."""
    out = tmp_path / "run"
    run(likelihood_free, ["--iterations", "1", "--output-dir", str(out)])
    ckpt = out / "checkpoints" / "iter_000001"
    state = training_state(ckpt)
    del state["extra"]
    import torch.distributed.checkpoint as dcp
    shutil.rmtree(ckpt / "state")
    common.single_process(dcp.save, state, ckpt / "state")
    with pytest.raises(common.UsageError, match=f"{ckpt} is not a checkpoint this code wrote: "):
        run(likelihood_free, ["--iterations", "2", "--resume", str(out), "--output-dir", str(tmp_path / "b")])


# ---- forks across versions: tests/fix_copies.py ----
def load_file(path, monkeypatch):
    """A trainer file outside the checkout imported as the module of its name (it imports common from the checkout)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)
    spec.loader.exec_module(module)
    return module


def outside_blocks(text: str) -> str:
    """The text with every shared block's lines taken out, its markers kept."""
    return re.sub(r"(# >>> shared: ([\w-]+)\n).*?(\s*# <<< shared: \2\n)", r"\1\3", text, flags=re.S)


def test_a_fork_of_an_earlier_version_runs_after_fix_copies_with_no_hand_edit(tmp_path, monkeypatch, capsys):
    """tests/fork_f476153.py is flow_grpo.py as it was at commit f476153, before TrainingLoop took the step guard and
    the update called step_loss: a method forked then by the README's recipe (0 lines of common.py changed). Its shared
    blocks are stale today; `python tests/fix_copies.py` rewrites them, adds flow_grpo.py's step_loss, which the new
    update calls, and changes nothing else. The fork then passes the shared-code test, trains and resumes bitwise."""
    path, old = tmp_path / "my_method.py", (ROOT / "tests" / "fork_f476153.py").read_text()
    path.write_text(old)
    assert fix_copies.main(["--check", str(path)]) == 1 and path.read_text() == old  # --check writes nothing
    assert fix_copies.main([str(path)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert "my_method.py: updated the shared block 'setup-train' (2 line(s) in, 2 out)" in said
    assert any(line.startswith("my_method.py: added step_loss(), flow_grpo.py's, before main()") for line in said)
    new = path.read_text()
    assert outside_blocks(new).replace(fix_copies.function_source(BASE, "step_loss"), "") == outside_blocks(old)
    assert fix_copies.main(["--check", str(path)]) == 0
    ours, base = fix_copies.shared_blocks(new), fix_copies.shared_blocks(BASE)   # the shared-code test's checks
    assert set(fix_copies.SHARED) <= set(ours) and all(ours[b] == base[b] for b in ours)
    assert not fix_copies.missing_functions(new, BASE)

    fork = load_file(path, monkeypatch)
    straight, resumed = straight_and_resumed(fork, [*SMALL, "--eval-every", "2"], split=1, total=2, tmp_path=tmp_path)
    assert straight == resumed and [m["iteration"] for m in straight] == [0, 1, 2]
    assert all(torch.equal(a, b) for a, b in zip(trained_params(tmp_path / "straight", 2),
                                                  trained_params(tmp_path / "split", 2)))
    assert straight[0]["ratio_dev_first_update"] == 0.0 and straight[-1]["eval_reward"] > 0


def test_fix_copies_keeps_what_a_trainer_dropped_and_names_what_it_cannot_do(tmp_path, capsys):
    """g2rpo.py drops the optional update block: a stale `log` block is rewritten and no update comes back. A trainer
    without a block every trainer needs, or with one flow_grpo.py does not have, is told so and left as it is."""
    g2rpo = (ROOT / "g2rpo.py").read_text()
    stale = tmp_path / "g2rpo.py"
    stale.write_text(g2rpo.replace("**loop.work(),", "**loop.work(), \"stale\": 1,"))
    assert fix_copies.main([str(stale)]) == 0 and stale.read_text() == g2rpo
    assert capsys.readouterr().out == "g2rpo.py: updated the shared block 'log' (1 line(s) in, 1 out)\n"
    odd = tmp_path / "odd.py"
    text = re.sub(r"^ *# [<>]{3} shared: validate\n", "", BASE, flags=re.M)
    odd.write_text(re.sub(r"^( *)(# >>> shared: log\n)", r"\1# >>> shared: mine\n\1\2", text, flags=re.M))
    odd.write_text(re.sub(r"^( *)(# <<< shared: log\n)", r"\1\2\1# <<< shared: mine\n", odd.read_text(), flags=re.M))
    before = odd.read_text()
    assert fix_copies.main(["--check", str(odd)]) == 1 and odd.read_text() == before
    assert capsys.readouterr().out.splitlines() == [
        "odd.py: the shared block 'validate' is missing: copy it from flow_grpo.py by hand",
        "odd.py: 'mine' is not a shared block of flow_grpo.py: remove its markers"]


def test_a_method_that_changes_only_the_loss_changes_step_loss(tmp_path, monkeypatch):
    """A published variant forked from flow_grpo.py: the log-ratio of each step normalised by its std and the policy
    gradient weighted by the step size t - s. Its one change is step_loss, in its method section: every shared block,
    the update too, stays verbatim, and it trains, logging what its loss adds."""
    variant = '''def step_loss(log_prob, old_log_prob, advantages, kl, t, s, args):
    """The variant's loss: each step's log-ratio normalised, the policy gradient weighted by the step size."""
    ratio = torch.exp((log_prob - old_log_prob) / (log_prob - old_log_prob).detach().std().clamp_min(1.0))
    pg = (t - s) * clipped_objective(ratio, advantages, args.clip_range)
    loss = (pg + args.beta * kl).mean()
    return loss, dict(loss=loss, pg_loss=pg.mean(), kl=kl.mean(), ratio_dev=(ratio - 1).abs().max(),
                      clip_frac=((ratio - 1).abs() > args.clip_range).float().mean(), approx_kl=kl.mean() * 0,
                      step_weight=t - s)
'''
    start = BASE.index("def step_loss(")
    end = BASE.index("\n\n\n", start)
    path = tmp_path / "my_variant.py"
    path.write_text(BASE[:start] + variant.rstrip("\n") + BASE[end:])
    assert fix_copies.main(["--check", str(path)]) == 0
    fork = load_file(path, monkeypatch)
    run(fork, [*SMALL, "--iterations", "1", "--output-dir", str(tmp_path / "r")])
    m = read_metrics(tmp_path / "r")[0]
    sigmas = common.uniform_sigmas(4)
    assert m["step_weight"] == pytest.approx(float(sigmas[0] - sigmas[1]), rel=1e-6)  # a toy grid of even steps
    assert m["ratio_dev_first_update"] == 0.0
