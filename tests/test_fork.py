"""Forks. tests/likelihood_free.py, the template of a method without a likelihood ratio, is a fork of flow_grpo.py by
the README's recipe (its shared blocks are held verbatim by tests/test_shared_code.py): a method the machinery has never
seen (ODE rollouts, no ratio, no KL, an old policy of its own) that common.py serves unchanged: --preflight passes with
the rows it cannot fill n/a, --resume continues it bitwise with its old policy, it runs with --gradient-checkpointing,
--compile and --fsdp, and it learns on the toy. Then the recipe itself, from each of the four trainers: a copy and its
copied tests under another name, unchanged, test the copy and pass, lint included. Then forks across versions
(tests/fix_copies.py on two forks kept frozen), and a method that changes only flow_grpo.py's loss."""
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import common
import fix_copies
import likelihood_free
from helpers import (ROOT, SMALL, free_port, read_metrics, run, small, straight_and_resumed, torchrun_cmd,
                     trained_params, training_state, without_timings)

BASE = (ROOT / "flow_grpo.py").read_text()
README = (ROOT / "README.md").read_text()
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def load_file(path, monkeypatch):
    """A trainer file outside the checkout imported as the module of its name (it imports common from the checkout)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)
    spec.loader.exec_module(module)
    return module


# ---- the template of a likelihood-free method ----
def test_the_template_passes_the_preflight_with_what_it_does_not_log_not_applicable(tmp_path):
    with pytest.raises(common.TrainingStopped) as stop:
        run(likelihood_free, [*SMALL, "--output-dir", str(tmp_path / "run"), "--preflight"])
    report = json.loads((tmp_path / "run" / "preflight.json").read_text())
    rows = {r["check"]: r for r in report["rows"]}
    assert stop.value.exit_code == 0 and report["passed"], report["rows"]
    assert rows["first update on-policy"]["status"] == "n/a" and not any("ratio" in check for check in rows)
    assert rows["gradients finite"]["status"] == rows["step size, change / weights (L2)"]["status"] == "PASS"
    assert "ratio_dev" not in report["metrics"] and "kl" not in report["metrics"]


def test_the_template_resumes_bitwise_with_its_old_policy(tmp_path):
    """The README's resume check, with a reward that does not tie (toy-soft)."""
    argv = [*SMALL, "--reward", "toy-soft", "--save-every", "1"]
    straight, resumed = straight_and_resumed(likelihood_free, argv, split=1, total=3, tmp_path=tmp_path)
    assert straight == resumed and [m["iteration"] for m in straight] == [0, 1, 2, 3]
    a, b = (training_state(tmp_path / name / "checkpoints" / "iter_000003") for name in ("straight", "split"))
    old_a, old_b = (s["extra"]["old_policy"] for s in (a, b))
    assert len(old_a) == len(a["params"]) and all(torch.equal(x, y) for x, y in zip(old_a, old_b))
    # the old policy is a state of its own: a soft copy that lags the weights, not the weights again
    assert not all(torch.equal(old_a[i], a["params"][str(i)]) for i in range(len(old_a)))


def test_a_fork_that_forgets_its_old_policy_fails_the_resume_check(tmp_path, monkeypatch):
    """The checklist's resume check catches a method state left out of the checkpoint: the template without its
    extra_state resumes its old policy from the weights, and the resumed run parts from the straight one."""
    text = (ROOT / "tests" / "likelihood_free.py").read_text()
    forgetful = tmp_path / "forgetful.py"
    forgetful.write_text(text.replace(',\n                               extra_state={"old_policy": old.shadow})', ")"))
    assert "extra_state" not in forgetful.read_text().split("def main", 1)[1]
    module = load_file(forgetful, monkeypatch)
    straight, resumed = straight_and_resumed(module, [*SMALL, "--reward", "toy-soft"], 1, 3, tmp_path)
    assert straight[0] == resumed[0] and straight[1]["loss"] != resumed[1]["loss"]


def test_a_checkpoint_without_the_old_policy_is_refused(tmp_path):
    """A state/ without the fork's old policy (saved again without it) is the one refusal of a damaged checkpoint."""
    out = tmp_path / "run"
    run(likelihood_free, [*SMALL, "--iterations", "1", "--output-dir", str(out)])
    ckpt = out / "checkpoints" / "iter_000001"
    state = training_state(ckpt)
    del state["extra"]
    import torch.distributed.checkpoint as dcp
    shutil.rmtree(ckpt / "state")
    common.single_process(dcp.save, state, ckpt / "state")
    with pytest.raises(common.UsageError, match=f"{ckpt} is not a checkpoint this code wrote: "):
        run(likelihood_free, [*SMALL, "--iterations", "2", "--resume", str(out), "--output-dir", str(tmp_path / "b")])


def test_a_signal_while_the_old_policy_is_swapped_in_saves_the_trained_weights(tmp_path, monkeypatch):
    """The old policy's velocities are taken with its weights swapped into the model, under loop.each: a SIGTERM
    there is acted on once the trained weights are back (at the update's first check), so the checkpoint holds them
    and the old policy apart, and resumes bitwise."""
    argv, load, inside = [*SMALL, "--reward", "toy-soft", "--seed", "3"], common.load_model, []

    def loaded(*args, **kwargs):
        adapter = load(*args, **kwargs)
        velocity = adapter.velocity

        def signalling(net, x, t, cond):  # the old policy's pass: a velocity without grad at one t per row
            loop = common.TrainingLoop.active
            if loop is not None and loop.it == 1 and t.dim() == 1 and not common._SIGNALLED["signum"]:
                inside.append([p.clone() for p in loop.params])
                os.kill(os.getpid(), signal.SIGTERM)
            return velocity(net, x, t, cond)
        adapter.velocity = signalling
        return adapter
    monkeypatch.setattr(common, "load_model", loaded)
    r = tmp_path / "r"
    with pytest.raises(SystemExit) as stop:
        common.run_cli(likelihood_free.main, likelihood_free.Args, likelihood_free.MODEL_DEFAULTS,
                       [*argv, "--iterations", "3", "--output-dir", str(r)])
    assert stop.value.code == 128 + signal.SIGTERM and len(inside) == 1
    assert (r / "checkpoints" / "latest").read_text() == "iter_000001"
    assert not all(torch.equal(x, y) for x, y in zip(trained_params(r, 1), inside[0]))  # the old policy's were in
    monkeypatch.undo()
    run(likelihood_free, [*argv, "--iterations", "3", "--output-dir", str(r), "--resume", str(r)])
    run(likelihood_free, [*argv, "--iterations", "3", "--output-dir", str(tmp_path / "straight")])
    assert without_timings(read_metrics(r)) == without_timings(read_metrics(tmp_path / "straight"))
    assert all(torch.equal(x, y) for x, y in zip(trained_params(r, 3), trained_params(tmp_path / "straight", 3)))


def test_the_template_runs_with_gradient_checkpointing_and_a_lora(tmp_path):
    run(likelihood_free, [*SMALL, "--iterations", "2", "--gradient-checkpointing", "--lora-rank", "4", "--lora-alpha",
                          "8", "--output-dir", str(tmp_path / "r")])
    lines = read_metrics(tmp_path / "r")
    assert [m["iteration"] for m in lines] == [0, 1, 2] and all(m["loss"] > 0 for m in lines[:2])
    assert all(torch.isfinite(p).all() for p in trained_params(tmp_path / "r", 2))


def test_the_template_passes_compile_to_the_machinery(tmp_path, monkeypatch):
    """--compile reaches load_model through the shared blocks: each repeated block's forward is handed to
    torch.compile (recorded here, not compiled: the compiled run is the slow test below)."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn.__qualname__) or fn)
    monkeypatch.setattr(torch._inductor.config, "emulate_precision_casts", True)  # as compile_blocks sets it once
    run(likelihood_free, [*SMALL, "--iterations", "1", "--compile", "--output-dir", str(tmp_path / "r")])
    assert set(compiled) == {"FluxTransformerBlock.forward", "FluxSingleTransformerBlock.forward"}
    assert [m["iteration"] for m in read_metrics(tmp_path / "r")] == [0, 1]


@pytest.mark.slow  # minutes of compiling on 2 cores with a cold inductor cache; the default suite: the test above
def test_the_template_compiled_compiles_once_and_resumes_bitwise(tmp_path):
    argv = [*SMALL, "--compile", "--reward", "toy-soft", "--eval-images", "4"]
    straight, resumed = straight_and_resumed(likelihood_free, argv, 1, 2, tmp_path)
    lines = read_metrics(tmp_path / "straight")
    assert lines[0]["compiles"] > 0 and [m["compiles"] for m in lines[1:]] == [0, 0]
    assert straight == resumed


def torchrun_template(argv: list[str]) -> str:
    """tests/likelihood_free.py as 2 gloo processes (its `import common` from the checkout)."""
    env = {**ENV, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(torchrun_cmd("tests/likelihood_free.py", argv, port=free_port()), env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


FSDP = ["--prompts-per-step", "4", "--group-size", "4", "--micro-batch", "2", "--sample-steps", "4", "--eval-images",
        "8", "--eval-steps", "4", "--eval-every", "1", "--threads", "1", "--reward", "toy-soft", "--fsdp"]


@pytest.mark.slow  # 2 processes, 20 s; the default suite: test_fsdp.py's FSDP2 resume, the template's other runs
def test_the_template_runs_sharded_with_fsdp(tmp_path):
    """Full fine-tuning sharded over 2 processes: the old policy a soft copy of the local shards, in the checkpoint."""
    stdout = torchrun_template([*FSDP, "--iterations", "2", "--output-dir", str(tmp_path / "r")])
    assert "ranks 2" in stdout
    lines = read_metrics(tmp_path / "r")
    assert [m["iteration"] for m in lines] == [0, 1, 2] and all(m["loss"] > 0 for m in lines[:2])
    state = training_state(tmp_path / "r" / "checkpoints" / "iter_000002")
    assert len(state["extra"]["old_policy"]) == len(state["params"])


@pytest.mark.slow  # three 2-process runs; the default suite: as the sharded run above
def test_the_template_sharded_resumes_bitwise(tmp_path):
    torchrun_template([*FSDP, "--iterations", "2", "--output-dir", str(tmp_path / "straight")])
    torchrun_template([*FSDP, "--iterations", "1", "--output-dir", str(tmp_path / "split")])
    torchrun_template([*FSDP, "--iterations", "2", "--output-dir", str(tmp_path / "split"), "--resume",
                       str(tmp_path / "split")])
    assert without_timings(read_metrics(tmp_path / "split")) == without_timings(read_metrics(tmp_path / "straight"))


def test_the_nft_loss_pulls_towards_good_samples_and_pushes_from_bad_ones():
    """The method's direction, against a hand computation: at v = v_old the gradient of the loss in v is
    2 b (2 r - 1) (v_old - u) / D per element; a few descent steps move v towards u where r = 1, away where r = 0, and
    leave it where r = 1/2."""
    g = torch.Generator().manual_seed(0)
    v_old, u = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    r, b = torch.tensor([1.0, 0.0, 0.5]), 0.7
    v = v_old.clone().requires_grad_(True)
    likelihood_free.nft_loss(v, v_old, u, r, b).sum().backward()
    torch.testing.assert_close(v.grad, 2 * b * (2 * r - 1)[:, None] * (v_old - u) / 4)
    v = v_old.clone().requires_grad_(True)
    opt = torch.optim.SGD([v], lr=0.5)
    for _ in range(5):
        opt.zero_grad()
        likelihood_free.nft_loss(v, v_old, u, r, b).sum().backward()
        opt.step()
    before, after = (v_old - u).norm(dim=1).tolist(), (v.detach() - u).norm(dim=1).tolist()
    assert after[0] < before[0] and after[1] > before[1] and after[2] == pytest.approx(before[2], abs=1e-6)
    assert likelihood_free.reward_weight(torch.tensor([-9.0, 0.0, 1.0]), 2.0).tolist() == [0.0, 0.5, 0.75]


@pytest.mark.slow  # about a minute on 2 cores; the default suite: the loss's direction above
def test_the_template_raises_the_toy_held_out_reward(tmp_path):
    """30 iterations at its toy defaults and flow_grpo's learning test's sizes (200 fixed-seed images: standard errors
    about 0.02 and 0.035). Calibration on 2 cores, seeds 0 and 1: held-out reward +0.128 and +0.115, strict accuracy
    +0.255 and +0.23 (at 15 iterations seed 0 gained +0.048, seed 2 +0.135)."""
    run(likelihood_free, ["--iterations", "30", "--eval-every", "30", "--prompts-per-step", "8", "--group-size", "8",
                          "--micro-batch", "16", "--sample-steps", "6", "--eval-images", "200", "--eval-steps", "10",
                          "--threads", "1", "--output-dir", str(tmp_path / "r")])
    first, last = read_metrics(tmp_path / "r")[0], read_metrics(tmp_path / "r")[-1]
    assert last["eval_reward"] - first["eval_reward"] > 0.08, (first, last)
    assert last["eval_accuracy"] - first["eval_accuracy"] > 0.15, (first, last)


# ---- the recipe from each trainer: a copy and its copied tests, unchanged, under another name ----
COPIES = {"flow_grpo": "my_flow_fork", "pro_grpo": "pruned2", "g2rpo": "x_g2", "v_grpo": "method_four"}
# Each copied file's quickest tests: a run on the toy, a method function, a refused flag (the tiny pipelines' sizes)
QUICK = "(two_iterations_run_with_finite_loss and toy) or closed_set or ovf_matches_brute_force or bad_funnel or " \
        "continuation_grid_matches or bad_input or surrogate_matches or bad_pair_settings"


def copied_checkout(tmp_path):
    """A checkout holding common.py, the assets and, of each trainer, only a copy under another name and its test file
    copied as tests/test_<copy>.py, both unchanged: a copied test that imported its original would fail to import."""
    root = tmp_path / "checkout"
    (root / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "common.py", root)
    (root / "assets").symlink_to(ROOT / "assets")
    for name in ("conftest.py", "helpers.py"):
        shutil.copy(ROOT / "tests" / name, root / "tests")
    for trainer, copy in COPIES.items():
        shutil.copy(ROOT / f"{trainer}.py", root / f"{copy}.py")
        shutil.copy(ROOT / "tests" / f"test_{trainer}.py", root / "tests" / f"test_{copy}.py")
    return root


def lint(root, files) -> subprocess.CompletedProcess:
    """The README's lint line over `files`."""
    line = re.search(r"`(ruff check [^`]*) \.`", README)
    assert line, "README.md names no lint line (`ruff check ... .`)"
    if shutil.which("ruff") is None:
        pytest.skip("ruff is not installed (pip install ruff)")
    return subprocess.run([*line.group(1).split(), *files], cwd=root, capture_output=True, text=True)


def test_each_trainer_forks_by_the_recipe_its_copied_tests_testing_the_copy(tmp_path):
    """Quick tests of each copied test file (every file collected), then the README's lint over the copies."""
    root = copied_checkout(tmp_path)
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests", "-k", QUICK],
                         cwd=root, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-3000:]
    for copy in COPIES.values():                             # each copied file ran two of its tests or more
        passed = re.findall(rf"^tests/test_{copy}\.py::.* PASSED", out.stdout, flags=re.M)
        assert len(passed) >= 2, out.stdout[-3000:]
    files = [f"{c}.py" for c in COPIES.values()] + [f"tests/test_{c}.py" for c in COPIES.values()]
    linted = lint(root, files)
    assert linted.returncode == 0, linted.stdout + linted.stderr


@pytest.mark.slow  # every copied test file whole (the slow ones left out): many minutes
def test_each_trainer_forks_by_the_recipe_whole_test_files(tmp_path):
    root = copied_checkout(tmp_path)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=root,
                         env=ENV, capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-3000:]


# ---- forks across versions: tests/fix_copies.py ----
def outside_blocks(text: str) -> str:
    """The text with every shared block's lines taken out, its markers kept."""
    return re.sub(r"(# >>> shared: ([\w-]+)\n).*?(\s*# <<< shared: \2\n)", r"\1\3", text, flags=re.S)


def test_a_fork_of_an_earlier_version_runs_after_fix_copies_with_no_hand_edit(tmp_path, monkeypatch, capsys):
    """tests/fork_f476153.py is flow_grpo.py as it was at commit f476153, before TrainingLoop took the step guard and
    the update called step_loss: a method forked then by the README's recipe (0 lines of common.py changed). Its shared
    blocks are stale today; `python tests/fix_copies.py` rewrites them, keeps its W (the world size, which the
    `validate` block no longer binds) after that block, calls its step and ref_mean under the blocks' names now, adds
    flow_grpo.py's step_loss, which the new update calls, and changes nothing else. The fork then passes the
    shared-code test, trains and resumes bitwise."""
    path, old = tmp_path / "my_method.py", (ROOT / "tests" / "fork_f476153.py").read_text()
    path.write_text(old)
    assert fix_copies.main(["--check", str(path)]) == 1 and path.read_text() == old  # --check writes nothing
    assert capsys.readouterr().out.splitlines()[-1] == "tests/fix_copies.py --check: nothing was written"
    assert fix_copies.main([str(path)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert "my_method.py: updated the shared block 'setup-train' (4 line(s) in, 3 out), these out:" in said
    assert "my_method.py: kept `W = rt.world_size` after the shared block 'validate': the block no longer binds W, " \
           "which main() reads" in said
    assert any(line.startswith("my_method.py: added `policy_step = step` after line ") for line in said)
    assert any(line.startswith("my_method.py: added `ref_mu = ref_mean` after line ") for line in said)
    assert "my_method.py: added step_loss(), flow_grpo.py's, before main(): yours to change" in said
    new = path.read_text()
    added = [fix_copies.function_source(BASE, "step_loss"), "    policy_step = step\n", "    ref_mu = ref_mean\n",
             "    W = rt.world_size\n"]
    stripped = outside_blocks(new)
    for a in added:
        stripped = stripped.replace(a, "", 1)
    assert stripped == outside_blocks(old).replace("    W = rt.world_size\n", "", 1)   # nothing else outside
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


def test_an_older_likelihood_free_fork_runs_after_fix_copies_with_no_hand_edit(tmp_path, monkeypatch, capsys):
    """tests/fork_nft_73d4c8a.py is a likelihood-free fork (DiffusionNFT's update) written against flow_grpo.py at
    commit 73d4c8a, as such forks were: update and ratio-log dropped, the step block's lines kept without its markers
    (its old policy steps after them), its TrainingLoop built inside setup-train, its blocks two releases stale. After
    fix_copies the `step` block is back where its code was (the old policy's step after it), the TrainingLoop line the
    new setup-train block lacks is kept after it, as is its W; it passes the shared-code test and trains."""
    path, old = tmp_path / "nft.py", (ROOT / "tests" / "fork_nft_73d4c8a.py").read_text()
    path.write_text(old)
    assert fix_copies.main([str(path)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"nft\.py: restored the shared block 'step' over lines \d+-\d+, which start as it does",
                        said[0]), said
    assert any(line.startswith("nft.py: kept `loop = common.TrainingLoop(") for line in said)
    assert "    - work_before = common.work_snapshot(adapter, reward_fn, guard)" in said  # printed as it went
    new = path.read_text()
    assert new.index("# <<< shared: step") < new.index("old.step(n_step)")  # its own step follows the block's
    ours, base = fix_copies.shared_blocks(new), fix_copies.shared_blocks(BASE)
    assert set(ours) == set(fix_copies.SHARED) and all(ours[b] == base[b] for b in ours)
    assert fix_copies.main(["--check", str(path)]) == 0 and not fix_copies.undefined(new)
    fork = load_file(path, monkeypatch)
    run(fork, [*SMALL, "--iterations", "2", "--output-dir", str(tmp_path / "r")])
    lines = read_metrics(tmp_path / "r")
    assert [m["iteration"] for m in lines] == [0, 1, 2] and all(m["loss"] > 0 and m["nfe_fwd"] > 0 for m in lines[:2])


def test_fix_copies_keeps_what_a_trainer_dropped(tmp_path, capsys):
    """g2rpo.py drops the optional update block: a stale `log` block is rewritten, its line out printed, and no update
    comes back."""
    g2rpo = (ROOT / "g2rpo.py").read_text()
    stale = tmp_path / "g2rpo.py"
    stale.write_text(g2rpo.replace("**loop.work(),", "**loop.work(), \"stale\": 1,"))
    assert fix_copies.main([str(stale)]) == 0 and stale.read_text() == g2rpo
    assert capsys.readouterr().out.splitlines() == [
        "g2rpo.py: updated the shared block 'log' (1 line(s) in, 1 out), these out:",
        "    - **loop.work(), \"stale\": 1,                                   # the iteration's work: nfe_fwd, "
        "reward_calls, ..."]


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
    run(fork, [*small(), "--iterations", "1", "--output-dir", str(tmp_path / "r")])
    m = read_metrics(tmp_path / "r")[0]
    sigmas = common.uniform_sigmas(4)
    assert m["step_weight"] == pytest.approx(float(sigmas[0] - sigmas[1]), rel=1e-6)  # a toy grid of even steps
    assert m["ratio_dev_first_update"] == 0.0
