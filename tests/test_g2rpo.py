"""g2rpo.py: the method's pieces against hand computations and brute force, the branch structure of a real rollout,
on-policy exactness, function-evaluation accounting, every model path, a toy learning run, bad input."""
import importlib
import math
import statistics
from pathlib import Path

import pytest
import torch

import common
from helpers import SMALL, model_argv, read_metrics, run, straight_and_resumed, tiny_argv

TRAINER = Path(__file__).stem.removeprefix("test_")          # this file's trainer: test_my_method.py tests my_method
trainer = importlib.import_module(TRAINER)


# Start-up rows of the trainer's own flags, run by tests/test_startup.py: (flags, the words of the one error line).
STARTUP = [
    (["--grid-shift", "0"], "--grid-shift 0.0 must be at least 1e-12"),
    (["--grid-shift", "-1"], "--grid-shift -1.0 must be at least 1e-12"),
    (["--grid-shift", "nan"], "--grid-shift nan must be at least 1e-12"),
]
# What the method needs on top of helpers.SMOKE, the tiny pipelines' smoke runs (helpers.tiny_argv): the LoRA learning
# rate of its SD3 recipe (the smoke runs train a LoRA, not full FLUX).
FITS_SMOKE = {"lr": 1e-4}


def fake_velocity(x, t):
    """A nonlinear stand-in for v_theta(x, t), one t per row: any mix-up of rows, times or shared states shows."""
    t = t.reshape(-1, *[1] * (x.dim() - 1))
    return torch.sin(3 * x) * (1 + t) + t**2


def reference_continuation(z, k, sigmas, stride):
    """The official code's continuation written out for one branch: the schedule t[0..k+1] + t[k+2::stride],
    Euler from index k+1, then the x0-jump z - t v if the schedule ends above 0."""
    sched = torch.cat([sigmas[:k + 2], sigmas[k + 2::stride]])
    x = z.clone()
    for i in range(k + 1, len(sched) - 1):
        x = x + (sched[i + 1] - sched[i]) * fake_velocity(x, sched[i].reshape(1))
    if sched[-1] > 0:
        x = x - sched[-1] * fake_velocity(x, sched[-1].reshape(1))
    return x


# ---- 1. Method functions ----
def test_continuation_grid_matches_hand_examples():
    assert trainer.continuation_grid(16, 0, 1) == list(range(1, 17))
    assert trainer.continuation_grid(16, 0, 2) == [1, 2, 4, 6, 8, 10, 12, 14, 16]
    assert trainer.continuation_grid(16, 1, 2) == [2, 3, 5, 7, 9, 11, 13, 15]  # ends at t_15 > 0: x0-jump there
    assert trainer.continuation_grid(16, 7, 3) == [8, 9, 12, 15]
    assert trainer.continuation_grid(10, 0, 3) == [1, 2, 5, 8]
    assert trainer.continuation_grid(16, 14, 2) == [15, 16]
    assert trainer.continuation_grid(16, 15, 1) == [16]  # the SDE step itself lands on t = 0


def test_continuations_equal_the_official_loop_one_branch_at_a_time():
    """Every row and stride, with the shared first step, equals the official loop run on its own, for every k
    including k = T-2 (one step left) and k = T-1 (the SDE step landed on t = 0)."""
    T, strides = 8, [1, 2, 3]
    sigmas = common.uniform_sigmas(T, 3.0)
    for k in range(T):
        z = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(k))
        out = trainer.continue_ode(lambda x, i, cond: fake_velocity(x, sigmas[i].expand(len(x))), z, {}, k, sigmas,
                                 strides)
        assert out.shape == (5, len(strides), 4, 3)
        for r in range(len(z)):
            for l, s in enumerate(strides):
                torch.testing.assert_close(out[r, l], reference_continuation(z[r], k, sigmas, s), rtol=1e-5, atol=1e-5)


def test_continuation_evaluations_at_the_paper_setting():
    """T = 16, M = 0..7, Lambda = {1, 2}, one branch per k: the paper's count is 92 evaluations at stride 1 plus
    48 steps and 4 x0-jumps at stride 2 = 144; sharing t_{k+1} and t_{k+2} saves 2 per k -> 128."""
    rows, sigmas = [], common.uniform_sigmas(16, 3.0)

    def velocity(x, i, cond):
        rows.append(len(x))
        return fake_velocity(x, sigmas[i].expand(len(x)))

    for k in range(8):
        trainer.continue_ode(velocity, torch.zeros(1, 2), {}, k, sigmas, [1, 2])
    assert sum(rows) == 144 - 16


def test_rollout_forwards_respect_the_micro_batch(tmp_path, monkeypatch):
    """--micro-batch bounds the rows of every transformer call: anchor and update (prompts), continuations
    (branches). 3 prompts x 4 branches with micro-batch 5: continuations of 12 rows go as 5 + 5 + 2."""
    sizes, real = [], common.FluxFamilyAdapter.velocity

    def spy(self, net, x, t, cond):
        sizes.append(len(x))
        return real(self, net, x, t, cond)

    monkeypatch.setattr(common.FluxFamilyAdapter, "velocity", spy)
    run(trainer, ["--model", "toy", "--iterations", "1", "--eval-every", "0", "--output-dir", str(tmp_path / "r"),
                "--prompts-per-step", "3", "--group-size", "4", "--sample-steps", "4", "--micro-batch", "5",
                "--threads", "1"])
    assert max(sizes) == 5 and 2 in sizes and 3 in sizes    # 3: the anchor's and the update's prompt rows


def test_singular_sde_step_is_the_flow_grpo_step_with_only_the_noise_differing():
    t, s, a, G = 0.8, 0.7, 0.7, 4
    z = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1))
    v = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(2))
    nxt, lp, mu, _ = trainer.singular_sde_step(z, v, torch.tensor(t), torch.tensor(s), G, a, 0.9,
                                             common.make_generator(7))
    assert nxt.shape == (2, G, 5, 3) and lp.shape == (2, G)
    g = a * math.sqrt(t / (1 - t))                                        # sigma_t below [Flow-GRPO Eq. 9]
    mean = z + (v + g**2 / (2 * t) * (z + (1 - t) * v)) * (s - t)       # [Flow-GRPO Eq. 9], written out
    std = g * math.sqrt(t - s)
    noise = torch.randn(2 * G, 5, 3, generator=common.make_generator(7)).view(2, G, 5, 3)
    torch.testing.assert_close(nxt, mean[:, None] + std * noise, rtol=1e-5, atol=1e-5)
    hand_lp = (-noise**2 / 2 - math.log(std) - 0.5 * math.log(2 * math.pi)).flatten(2).mean(2)
    torch.testing.assert_close(lp, hand_lp, rtol=1e-5, atol=1e-5)
    assert (nxt[:, 0] != nxt[:, 1]).all()
    torch.testing.assert_close(mu, mean, rtol=1e-5, atol=1e-5)                 # one mean, shared by the branches
    _, lp_again, _, _ = trainer.singular_sde_step(z, v, torch.tensor(t), torch.tensor(s), G, a, 0.9, next_x=nxt)
    assert torch.equal(lp_again, lp)                     # scoring the drawn branches gives back their log-prob


def z_score_by_hand(values):
    m, sd = statistics.mean(values), statistics.stdev(values)  # unbiased std, like the official code
    return [(x - m) / (sd + 1e-8) for x in values]


def test_single_granularity_reduces_to_the_group_advantage():
    r = torch.rand(2, 3, 5, 1, generator=torch.Generator().manual_seed(0))
    A = trainer.mgai_advantages(r)
    assert A.shape == (2, 3, 5)
    for b in range(2):
        for k in range(3):
            assert A[b, k].tolist() == pytest.approx(z_score_by_hand(r[b, k, :, 0].tolist()), rel=1e-5)


def test_advantages_are_summed_over_strides_hand_example():
    # G = 3 branches, stride 1 rewards (0, .5, 1) -> z (-1, 0, 1); stride 2 (1, 1, 0) -> (1, 1, -2) / sqrt(3)
    r = torch.tensor([[0.0, 1.0], [0.5, 1.0], [1.0, 0.0]]).view(1, 1, 3, 2)
    A = trainer.mgai_advantages(r)
    third = 1 / math.sqrt(3)
    assert A.flatten().tolist() == pytest.approx([-1 + third, third, 1 - 2 * third], abs=1e-6)


def test_advantages_weights_and_flat_groups():
    one_hot = torch.zeros(40)
    one_hot[0] = 1.0                                     # z = (1 - 1/40) / sqrt(1/40) = 6.17 per stride
    flat = torch.full((40,), 0.5)                        # no signal: exactly zero advantage
    r = torch.stack([one_hot, one_hot], -1).view(1, 1, 40, 2)
    assert trainer.mgai_advantages(r)[0, 0, 0].item() == pytest.approx(2 * 39 / 40 / math.sqrt(1 / 40), rel=1e-5)
    r_flat = torch.stack([flat, flat], -1).view(1, 1, 40, 2)
    assert (trainer.mgai_advantages(r_flat) == 0).all()
    # two reward models (--reward-norm per-reward, G2RPO's default): their z-scores summed with the --reward weights
    r1 = torch.tensor([0.0, 0.5, 1.0]).view(1, 1, 3, 1)
    r2 = torch.tensor([2.0, 0.0, 1.0]).view(1, 1, 3, 1)
    reward_fn = common.WeightedReward([("toy", 1.0), ("toy-soft", 0.5)], norm="per-reward")
    A = reward_fn.advantages({"toy": r1, "toy-soft": r2}, trainer.mgai_advantages)
    assert A.flatten().tolist() == pytest.approx([-1 + 0.5, 0 - 0.5, 1 + 0], abs=1e-6)


# ---- the trainer ----
def test_rollout_branches_share_the_anchor_latent_bit_for_bit(tmp_path, monkeypatch):
    """Spy on common.sde_step during a real rollout: every branch of a prompt starts from the same z_k, bit for
    bit, with the same velocity, and that z_k is the ODE anchor from the prompt's one initial noise."""
    calls, real = [], common.sde_step

    def spy(x, v, t, s, *args, next_x=None, generator=None):
        if next_x is None:  # the rollout's branch steps (the update passes next_x)
            calls.append((x.clone(), v.clone(), float(t)))
        return real(x, v, t, s, *args, next_x=next_x, generator=generator)

    monkeypatch.setattr(common, "sde_step", spy)
    run(trainer, ["--model", "toy", "--iterations", "1", "--output-dir", str(tmp_path / "r"), *SMALL,
                "--eval-every", "0", "--sde-steps", "3"])
    P, G, T = 2, 4, 4                                    # SMALL: 2 prompts, group 4, 4 steps
    assert [t for _, _, t in calls] == pytest.approx(common.uniform_sigmas(T)[:3].tolist())
    adapter = common.load_model("toy", common.setup_runtime(0, 1))
    z = adapter.noise(P, common.make_generator(0, 0, 0))  # the rollout's first draw: one noise per prompt
    batch = common.sample_prompts(common.load_prompts(None, "toy")[0], P, common.make_generator(0, 0))
    cond, sigmas = adapter.encode([r["prompt"] for r in batch]), common.uniform_sigmas(T)
    for k, (x, v, _) in enumerate(calls):
        x, v = x.view(P, G, -1), v.view(P, G, -1)
        assert torch.equal(x, x[:, :1].expand_as(x)) and torch.equal(v, v[:, :1].expand_as(v))
        torch.testing.assert_close(x[:, 0], common.sample_ode(adapter, adapter.transformer, cond, z, sigmas[:k + 1])
                                   .flatten(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model,cfg,extra", [
    ("toy", 1, ["--beta", "0.01", "--micro-batch", "1"]),  # full fine-tuning: frozen reference; one prompt per forward
    ("flux", 1, ["--beta", "0.01"]),                       # LoRA: reference = adapter switched off
    ("sd3", 2, []),                                        # CFG: two rows per evaluation; no KL
])
def test_two_iterations_exact_first_update_and_work_accounting(model, cfg, extra, tmp_path):
    """Two iterations on every model path. Before the first optimizer step of an iteration the ratio is exactly 1
    (and, with a KL, before any update the KL to the reference is exactly 0; after one, on the toy, it is not); the
    work split adds up to the hand count."""
    run(trainer, [*model_argv(TRAINER, model), "--iterations", "2", "--output-dir", str(tmp_path / "r"), *SMALL,
                "--granularities", "1,2", *extra])
    lines = read_metrics(tmp_path / "r")
    assert [m["iteration"] for m in lines] == [0, 1, 2]
    assert all("eval_reward" in m for m in lines) and ("eval_accuracy" in lines[0]) == (model == "toy")
    if "--beta" in extra:
        assert lines[0]["kl_first_update"] == 0.0
    if model == "toy":  # full fine-tuning moves the policy off its frozen copy: the check above can fail
        assert lines[1]["kl_first_update"] > 0.0
    B, G, T, K, L = 2, 4, 4, 2, 2
    # per branch, T = 4, Lambda = {1, 2}: k = 0 evaluates t_1, t_2 (shared) and t_3 (stride 1 only) = 3;
    # k = 1 evaluates t_2, t_3, shared (stride 2 ends at t_3 and jumps to 0 as stride 1 steps there) = 2
    continuation = B * G * (3 + 2)
    for m in lines[:2]:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and math.isfinite(m["reward_mean"])
        assert m["ratio_dev_first_update"] == 0.0
        assert m["ratio_dev_max"] > 0.0  # later updates are off-policy: the check can fail
        assert m["nfe_anchor"] == cfg * B * T
        assert m["nfe_continuation"] == cfg * continuation
        reference = cfg * B * K if "--beta" in extra else 0  # one reference forward per prompt and k
        assert m["nfe_fwd"] == m["nfe_anchor"] + m["nfe_continuation"] + reference
        assert m["nfe_fwd_bwd"] == cfg * B * K               # one forward per prompt and k
        assert m["decodes"] == m["reward_calls"] == B * K * G * L + B  # every (k, branch, stride) + the anchors
    assert (tmp_path / "r" / "checkpoints" / "iter_000002" / "state" / ".metadata").is_file()


def test_resume_equals_straight_run(tmp_path):
    base = [*tiny_argv(TRAINER, "flux"), "--seed", "3", *SMALL]
    a, b = straight_and_resumed(trainer, base, 1, 3, tmp_path)
    assert a == b and len(a) == 4


@pytest.mark.slow  # 45 s; the default suite: the other trainers' learning tests, and G2RPO's math and resume here
def test_toy_held_out_reward_rises(tmp_path):
    """A CI-sized G2RPO run on the toy world (8 prompts x 8 branches, T = 6, 30 iterations; ~40 s on 2 cores):
    held-out reward and strict accuracy over 200 fixed-seed images (standard errors ~0.02 and ~0.035).
    Measured rises: +0.13 / +0.26; the thresholds are about 4 standard errors."""
    run(trainer, ["--model", "toy", "--iterations", "30", "--eval-every", "30", "--eval-images", "200",
                "--prompts-per-step", "8", "--sample-steps", "6", "--threads", "1",
                "--output-dir", str(tmp_path / "r")])
    first, last = read_metrics(tmp_path / "r")[0], read_metrics(tmp_path / "r")[-1]
    assert last["eval_reward"] - first["eval_reward"] > 0.08
    assert last["eval_accuracy"] - first["eval_accuracy"] > 0.15


# ---- bad input: one clear message that names the fix ----
@pytest.mark.parametrize("flags,message", [
    (["--granularities", "0,2"], "--granularities '0,2' must list distinct positive integers"),
    (["--granularities", "1,1"], "--granularities '1,1' must list distinct positive integers"),
    (["--granularities", "one"], "--granularities 'one' must list distinct positive integers"),
    (["--sde-steps", "5", "--sample-steps", "4"], "--sde-steps 5 must be between 1 and --sample-steps 4"),
    (["--group-size", "1"], "--group-size 1 must be at least 2"),
    (["--micro-batch", "0"], "--micro-batch 0 must be at least 1"),
])
def test_bad_input(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        run(trainer, [*tiny_argv(TRAINER, "flux"), "--output-dir", str(tmp_path / "r"), *flags])
