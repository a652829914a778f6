"""The trainer this file is named after (test_flow_grpo.py: flow_grpo.py) end to end: every model path, on-policy
exactness, DDP, resume, LoRA export, bad input, learning. A forked method copies it as tests/test_<its module>.py and
changes nothing to start with (README, Fork a method): the trainer is named by the file's name. The tests of the first
part set sizes, rewards and, where they need one, --lr or --reward-norm (every trainer has them), so they hold for any
fork of flow_grpo.py; the rewards give groups that differ (`toy-soft` where the three levels of `toy` would tie). The
second part tests Flow-GRPO's own settings (the KL weight, the updates per rollout, the SDE window, CPS, the clip
range) and names in each test those it sets: a fork that drops or renames one changes or drops its tests, as it does
the STARTUP rows of its own flags."""
import importlib
import math
from pathlib import Path

import pytest
import torch

import common
from helpers import (SMALL, model_argv, read_metrics, run, small, straight_and_resumed, tiny_argv, tiny_pipeline,
                     torchrun, trained_params)

TRAINER = Path(__file__).stem.removeprefix("test_")          # this file's trainer: test_my_method.py tests my_method
trainer = importlib.import_module(TRAINER)


# Start-up rows of the trainer's own flags, run by tests/test_startup.py: (flags, the words of the one error line).
# They are Flow-GRPO's: a fork changes the rows of the flags it drops or renames.
STARTUP = [
    (["--timestep-fraction", "nan"], "--timestep-fraction nan must be at least 0 and at most 1"),
    (["--timestep-fraction", "inf"], "--timestep-fraction inf must be at least 0 and at most 1"),
    (["--sde-window", "3"], "--sde-window 3 does not fit in --sde-window-range 0,2: need 0 <= LO and W <= HI - LO"),
    # SMALL: 4 steps, so the default range is 0,T//2 = 0,2
    (["--sde-window", "1", "--sde-window-range", "0,4"],
     "--sde-window-range 0,4 reaches past step T - 1 = 3 of --sample-steps 4"),
    (["--sde-window", "1", "--sde-window-range=-1,2"], "does not fit in --sde-window-range -1,2"),
    (["--sde-window", "1", "--sde-window-range", "0:2"], "--sde-window-range '0:2' must be two integers LO,HI"),
    (["--sde-type", "cps", "--noise-level", "1.5"], "--noise-level 1.5 must be in (0, 1] with --sde-type cps"),
    (["--sde-type", "cps", "--timestep-fraction", "1"], "--sde-type cps cannot train the last step"),
    (["--sde-type", "ddim"], "argument --sde-type: invalid choice: 'ddim'"),
]


# ---- Part 1: the trainer, for any fork as it stands ----
@pytest.mark.parametrize("model", ["toy", "flux", "sd3"])
def test_two_iterations_run_with_finite_loss(model, tmp_path):
    run(trainer, [*model_argv(TRAINER, model), "--iterations", "2", "--output-dir", str(tmp_path / "r"), *SMALL])
    lines = read_metrics(tmp_path / "r")
    assert [m["iteration"] for m in lines] == [0, 1, 2]
    for m in lines[:2]:
        assert math.isfinite(m["loss"]) and math.isfinite(m["reward_mean"]) and math.isfinite(m["grad_norm"])
    assert all("eval_reward" in m for m in lines)
    assert ("eval_accuracy" in lines[0]) == (model == "toy")
    assert (tmp_path / "r" / "eval_000000.png").is_file()
    assert (tmp_path / "r" / "checkpoints" / "iter_000002" / "state" / ".metadata").is_file()


@pytest.mark.parametrize("model,extra", [("toy", ["--reward", "toy-soft"]), ("sd3", []), ("flux", [])])
def test_first_update_is_exactly_on_policy(model, extra, tmp_path):
    """Before the first optimizer step the recomputed log-probs equal the rollout's: ratio exactly 1, and
    the KL of the policy to the reference (itself, before any update) exactly 0. The rewards are continuous (toy-soft,
    jpeg): at these sizes the three levels of `toy` can tie every group, and then no step moves the policy."""
    run(trainer, [*model_argv(TRAINER, model), "--iterations", "1", "--eval-every", "0",
                  "--output-dir", str(tmp_path / "r"), *small(without=("eval_every", "threads")), *extra])
    m = read_metrics(tmp_path / "r")[0]
    assert m["ratio_dev_first_update"] == 0.0, "the first update does not recompute the rollout's log-probs: " \
                                               "the same micro-batches, noise, dtype and train / eval mode"
    assert m["kl_first_update"] == 0.0, "before any optimizer step the policy is the reference: their KL must be 0"
    assert m["ratio_dev_max"] > 0.0, "no optimizer step moved the policy (ratio 1 in every update): a zero gradient, " \
                                     "e.g. every group's rewards tied; pass a reward with more levels or larger groups"


def test_resume_equals_straight_run(tmp_path):
    """2 iterations + --resume to 4 gives the same metrics and weights as 4 straight iterations."""
    base = [*tiny_argv(TRAINER, "flux"), "--seed", "3", *SMALL]
    a, b = straight_and_resumed(trainer, base, 2, 4, tmp_path)
    assert a == b and len(a) == 5
    sa, sb = trained_params(tmp_path / "straight", 4), trained_params(tmp_path / "split", 4)
    assert len(sa) == len(sb) > 0 and all(torch.equal(x, y) for x, y in zip(sa, sb))


def test_saved_lora_loads_into_the_diffusers_pipeline(tmp_path):
    run(trainer, [*tiny_argv(TRAINER, "flux"), "--iterations", "2", "--eval-every", "0", "--lr", "1e-2",
                  "--output-dir", str(tmp_path / "r"), *small(without=("eval_every", "threads"))])
    from diffusers import FluxPipeline
    pipe = FluxPipeline.from_pretrained(tiny_pipeline("flux"))
    kw = dict(prompt=["a photo of a cat"], height=32, width=32, num_inference_steps=3, output_type="latent",
              max_sequence_length=512, generator=torch.Generator().manual_seed(0))
    before = pipe(**kw).images
    pipe.load_lora_weights(str(tmp_path / "r" / "checkpoints" / "iter_000002"))
    kw["generator"] = torch.Generator().manual_seed(0)
    after = pipe(**kw).images
    assert (after - before).abs().max() > 1e-4


def test_torchrun_two_ranks_stay_identical(tmp_path):
    stdout = torchrun(f"{TRAINER}.py", [*tiny_argv(TRAINER, "sd3"), "--iterations", "2", "--prompts-per-step", "4",
           "--output-dir", str(tmp_path / "r"), *small(without=("prompts_per_step",))])
    assert "ranks 2 | prompts/rank B=2" in stdout
    last = read_metrics(tmp_path / "r")[-1]
    assert last["rank_param_diff"] == 0.0


# ---- bad input: one clear message that names the fix ----
@pytest.mark.parametrize("flag,value", [("--model", "sdxl"), ("--model", "tiny-flux"), ("--dtype", "fp8"),
                                        ("--reward-norm", "mean")])
def test_a_value_outside_a_closed_set_is_refused_by_the_command_line(flag, value, capsys):
    with pytest.raises(SystemExit):
        common.cli(trainer.Args, [flag, value], trainer.MODEL_DEFAULTS)
    assert f"argument {flag}: invalid choice: '{value}' (choose from" in capsys.readouterr().err


def test_unknown_reward(tmp_path):
    with pytest.raises(ValueError, match="unknown or repeated reward 'aesthetics'.*known rewards: toy, jpeg"):
        run(trainer, [*tiny_argv(TRAINER, "flux"), "--reward", "aesthetics", "--output-dir", str(tmp_path / "r")])


def test_sizes_that_do_not_divide(tmp_path):
    with pytest.raises(ValueError, match="--micro-batch 3 must divide the 4 samples"):
        run(trainer, [*tiny_argv(TRAINER, "flux"), "--micro-batch", "3", "--output-dir", str(tmp_path / "r")])


def test_missing_prompt_file(tmp_path):
    with pytest.raises(common.UsageError, match="prompt file 'nope.txt' does not exist: pass --prompts"):
        run(trainer, [*tiny_argv(TRAINER, "flux"), "--prompts", "nope.txt", "--output-dir", str(tmp_path / "r")])


@pytest.mark.parametrize("damaged", [".metadata", "__0_0.distcp"])
def test_corrupt_checkpoint_is_reported_and_nothing_is_lost(damaged, tmp_path):
    r = tmp_path / "r"
    run(trainer, [*tiny_argv(TRAINER, "flux"), "--iterations", "1", "--output-dir", str(r), *SMALL])
    state = r / "checkpoints" / "iter_000001" / "state" / damaged
    state.write_bytes(state.read_bytes()[:100])
    before = {f: f.read_bytes() for f in r.rglob("*") if f.is_file() and f.name != ".lock"}
    with pytest.raises(common.UsageError, match=f"is not a checkpoint this code wrote: state/{damaged} is not the file "
                                                f"its checkpoint.json's digest names .*resume from an earlier one in a "
                                                f"new --output-dir"):
        run(trainer, [*tiny_argv(TRAINER, "flux"), "--iterations", "2", "--output-dir", str(r),
                      "--resume", str(r), *SMALL])
    assert {f: f.read_bytes() for f in r.rglob("*") if f.is_file() and f.name != ".lock"} == before


def test_existing_run_folder_is_not_overwritten(tmp_path):
    r = tmp_path / "r"
    run(trainer, [*tiny_argv(TRAINER, "flux"), "--iterations", "1", "--output-dir", str(r), *SMALL])
    with pytest.raises(common.UsageError, match="already holds a run: pass --resume"):
        run(trainer, [*tiny_argv(TRAINER, "flux"), "--iterations", "1", "--output-dir", str(r), *SMALL])


def test_toy_held_out_reward_rises(tmp_path):
    """Learning, not just running: 20 short iterations on the toy model, at the trainer's own toy settings (lr, clip
    range, KL weight) and smaller sizes, raise the held-out reward and strict accuracy on 200 fixed-seed images
    (standard errors about 0.02 and 0.035) by several standard errors."""
    run(trainer, ["--iterations", "20", "--eval-every", "20", "--prompts-per-step", "8", "--group-size", "8",
                  "--micro-batch", "16", "--sample-steps", "6", "--eval-images", "200", "--eval-steps", "10",
                  "--threads", "1", "--output-dir", str(tmp_path / "r")])
    first, last = read_metrics(tmp_path / "r")[0], read_metrics(tmp_path / "r")[-1]
    seen = f"held-out reward {first['eval_reward']:.4f} -> {last['eval_reward']:.4f}, strict accuracy " \
           f"{first['eval_accuracy']:.3f} -> {last['eval_accuracy']:.3f} in 20 iterations at the toy defaults of " \
           f"{TRAINER}.Args"
    assert last["eval_reward"] - first["eval_reward"] > 0.08, f"{seen}: a gain of 0.08 or less; calibrate the " \
                                                              f"method's toy defaults (lr, clip range, KL weight)"
    assert last["eval_accuracy"] - first["eval_accuracy"] > 0.15, f"{seen}: an accuracy gain of 0.15 or less; " \
                                                                  f"calibrate the method's toy defaults"


def test_out_of_time():
    now = common.time.time()
    assert common.out_of_time(now - 10, 5, "cpu") and not common.out_of_time(now, 5, "cpu")
    assert not common.out_of_time(now - 1e6, 0, "cpu")                     # 0: no budget


def test_time_budget_ends_the_run_like_its_last_iteration(tmp_path, monkeypatch):
    """--time-budget stops at an iteration boundary with the final evaluation and a checkpoint of the iteration
    reached (here the clock is stubbed to run out before iteration 2 of 50)."""
    calls = []
    monkeypatch.setattr(common, "out_of_time", lambda t0, budget, device: calls.append(budget) or len(calls) > 2)
    r = tmp_path / "r"
    run(trainer, ["--iterations", "50", "--time-budget", "7", "--eval-every", "10", "--output-dir", str(r),
                  *small(without=("eval_every",))])
    lines = read_metrics(r)
    assert calls == [7.0] * 3 and [m["iteration"] for m in lines] == [0, 1, 2]
    assert "eval_reward" in lines[0] and "eval_reward" not in lines[1] and "eval_reward" in lines[2]
    assert (r / "checkpoints" / "latest").read_text() == "iter_000002"
    with pytest.raises(ValueError, match="is at iteration 2, past --iterations 1"):
        run(trainer, ["--iterations", "1", "--output-dir", str(r), "--resume", str(r),
                      *small(without=("eval_every",))])


# ---- Part 2: Flow-GRPO's own settings; each test names those it sets, which a fork that drops them changes ----
@pytest.mark.parametrize("model,extra", [("sd3", ["--beta", "0.01"]), ("flux", ["--beta", "0.01"]),
                                         ("toy", ["--sde-window", "2", "--sde-type", "cps", "--noise-level", "0.8",
                                                 "--reward", "toy-soft"])])
def test_first_update_is_exactly_on_policy_with_a_kl_and_in_the_fast_recipe(model, extra, tmp_path):
    """--beta (the KL to the pre-trained policy: its reference is that policy at the start) and Flow-GRPO-Fast's
    --sde-window / --sde-type / --noise-level: the first update is still exactly on-policy."""
    test_first_update_is_exactly_on_policy(model, extra, tmp_path)


def test_updates_per_rollout_must_divide_the_micro_batches(tmp_path):
    """--updates-per-rollout: optimizer steps per iteration, each on whole rollout micro-batches."""
    with pytest.raises(ValueError, match="--updates-per-rollout 3 must divide"):
        run(trainer, [*tiny_argv(TRAINER, "flux"), "--updates-per-rollout", "3", "--output-dir", str(tmp_path / "r")])


def test_the_ema_updates_once_per_optimizer_step(tmp_path, monkeypatch):
    """common.EMA.step is called once after each optimizer step, with its count 1, 2, ... (never twice with the same
    count, which would apply an update twice), and updates the shadow every `every` steps. Sets
    --updates-per-rollout 2: two optimizer steps per iteration."""
    calls, step = [], common.EMA.step

    def counted(self, n):
        before = [s.clone() for s in self.shadow]
        step(self, n)
        calls.append((n, any(not torch.equal(a, b) for a, b in zip(before, self.shadow))))
    monkeypatch.setattr(common.EMA, "step", counted)
    run(trainer, ["--iterations", "4", "--ema", "--updates-per-rollout", "2", "--eval-every", "0",
                  "--output-dir", str(tmp_path / "r"), *small(without=("eval_every",))])
    assert [n for n, _ in calls] == list(range(1, 9))
    assert [moved for _, moved in calls] == [n == 7 for n in range(1, 9)]  # (7 + 1) % 8 == 0: the shadow moves


# ---- Flow-GRPO-Fast: --sde-window, --sde-window-range, --sde-type, --noise-level, --clip-range, --beta, no CFG ----
FAST = ["--sample-steps", "6", "--sde-window", "2", "--sde-window-range", "0,4", "--micro-batch", "2"]


@pytest.mark.parametrize("sde_type", ["flow", "cps"])
def test_the_sde_window_is_the_only_noisy_stored_and_trained_part(sde_type, tmp_path, monkeypatch):
    """Every transformer call is recorded: in the rollout, a step outside the window is exactly Euler (computed
    here), one inside is not; the window (2 steps) starts anew in each micro-batch, in [0, 4 - 2], never on the last
    step; the update recomputes exactly the window's steps (their times), and the first update is on-policy."""
    calls, velocity = [], common.FluxFamilyAdapter.velocity

    def recorded(self, net, x, t, cond):
        v = velocity(self, net, x, t, cond)
        calls.append((torch.is_grad_enabled(), x.clone(), float(t), v.clone()))
        return v
    monkeypatch.setattr(common.FluxFamilyAdapter, "velocity", recorded)
    run(trainer, [*small(without=("sample_steps", "micro_batch")), *FAST, "--iterations", "3", "--eval-every", "0",
                  "--sde-type", sde_type, "--noise-level", "0.8", "--beta", "0", "--reward", "toy-soft",
                  "--output-dir", str(tmp_path / "r")])
    sigmas = common.uniform_sigmas(6)
    rollout = [c for c in calls if not c[0]]
    assert len(rollout) == 3 * 4 * 6                               # 3 iterations x 4 micro-batches x 6 steps
    starts = []
    for b in range(12):                                            # one micro-batch's trajectory at a time
        steps = rollout[b * 6:(b + 1) * 6]
        assert [t for _, _, t, _ in steps] == sigmas[:6].tolist()
        nexts = [x for _, x, _, _ in steps[1:]]
        euler = [torch.equal(x1, x + (sigmas[k + 1] - sigmas[k]) * v)
                 for k, ((_, x, _, v), x1) in enumerate(zip(steps, nexts))]   # steps 0..4; step 5 ends the sample
        noisy = [k for k, e in enumerate(euler) if not e]
        assert len(noisy) == 2 and noisy[1] == noisy[0] + 1 and 0 <= noisy[0] <= 2, noisy
        starts.append(noisy[0])
    assert len(set(starts)) > 1                                    # drawn anew per micro-batch
    trained = [t for grad, _, t, _ in calls if grad]
    assert len(trained) == 3 * 4 * 2                               # 2 steps per micro-batch, once each
    lines = read_metrics(tmp_path / "r")
    assert all(m["nfe_fwd_bwd"] == 8 * 2 and m["nfe_fwd"] == 8 * 6 for m in lines[:3])
    assert {round(t, 6) for t in trained} <= {round(float(t), 6) for t in sigmas[:4]}  # inside [LO, HI) = [0, 4)
    assert all(m["ratio_dev_first_update"] == 0.0 and m["ratio_dev_second_update"] > 0 for m in lines[:3])


def test_a_resumed_fast_run_equals_a_straight_one(tmp_path):
    base = [*tiny_argv(TRAINER, "flux"), "--seed", "5", *small(without=("sample_steps", "micro_batch")), *FAST,
            "--sde-type", "cps", "--noise-level", "0.8", "--clip-range", "1e-5", "--beta", "0"]
    a, b = straight_and_resumed(trainer, base, 2, 3, tmp_path)
    assert a == b and len(a) == 4
    sa, sb = trained_params(tmp_path / "straight", 3), trained_params(tmp_path / "split", 3)
    assert len(sa) == len(sb) > 0 and all(torch.equal(x, y) for x, y in zip(sa, sb))


@pytest.mark.parametrize("guidance,rows", [("1", 1), ("4.5", 2)])
def test_sd3_without_cfg_makes_one_forward_in_rollout_and_update(guidance, rows, tmp_path):
    """--guidance-scale 1 (the official no-CFG Fast configs): one conditional forward per step in the rollout and
    in the update; with CFG each is two rows (unconditional and conditional)."""
    run(trainer, [*tiny_argv(TRAINER, "sd3"), "--guidance-scale", guidance, "--iterations", "1",
                  "--eval-every", "0", "--sde-window", "1", "--sde-window-range", "0,2", "--beta", "0",
                  "--output-dir", str(tmp_path / "r")])
    m = read_metrics(tmp_path / "r")[0]
    samples, steps = 2 * 2, 4                                       # SMOKE: 2 prompts x group 2, 4 steps
    assert m["nfe_fwd"] == rows * samples * steps and m["nfe_fwd_bwd"] == rows * samples * 1
    assert m["ratio_dev_first_update"] == 0.0
