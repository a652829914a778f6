"""v_grpo.py: the surrogate, pairs, ratio and soft-clip against hand computations; every model path end to end
(on-policy exactness, NFE accounting); held-out learning on the toy model; bad input."""
import importlib
import math
from pathlib import Path

import pytest
import torch

import common
from helpers import SMALL, model_argv, read_metrics, run, small, straight_and_resumed, tiny_argv, torchrun

TRAINER = Path(__file__).stem.removeprefix("test_")          # this file's trainer: test_my_method.py tests my_method
trainer = importlib.import_module(TRAINER)


# Start-up rows of the trainer's own flags, run by tests/test_startup.py: (flags, the words of the one error line).
STARTUP = [
    (["--soft-clip", "nan"], "--soft-clip nan must be at least 0"),
]
# What the method needs on top of helpers.SMOKE, the tiny pipelines' smoke runs (helpers.tiny_argv): two Monte Carlo
# pairs.
FITS_SMOKE = {"mc_pairs": 2}


class ConstantVelocity:
    """A stand-in adapter whose network predicts the same velocity c everywhere, so x_hat = x - t c by hand."""

    def __init__(self, c):
        self.c = c

    def velocity(self, net, x, t, cond):
        return self.c.expand_as(x).clone()


# ---- the surrogate ----
def test_surrogate_matches_a_hand_computation():
    """o = (1, 2), velocity c = (2, 2), two pairs. x - o = t (eps - o - c):
    pair 1, t = 1/2, eps = (3, -1): d = (0, -2.5), MSE 3.125, L1 1.25, l = 2.5;
    pair 2, t = 1/4, eps = (1, 1):  d = (-0.5, -0.75), MSE 0.40625, L1 0.625, l = 0.65;  L = 1.575."""
    o = torch.tensor([[1.0, 2.0]])                                   # (M=1, D=2)
    taus = torch.tensor([[0.5, 0.25]])                               # (M, J=2)
    eps = torch.tensor([[[3.0, -1.0], [1.0, 1.0]]])                  # (M, J, D)
    x_hat = trainer.x_predictions(ConstantVelocity(torch.tensor([2.0, 2.0])), None, o, taus, eps, {})
    torch.testing.assert_close(x_hat, torch.tensor([[[1.0, -0.5], [0.5, 1.25]]]))
    losses = trainer.pair_losses(x_hat, o)
    torch.testing.assert_close(losses, torch.tensor([[2.5, 0.65]]))
    torch.testing.assert_close(losses.mean(1), torch.tensor([1.575]))
    torch.testing.assert_close(trainer.pair_losses(x_hat, o, self_normalize=False), torch.tensor([[3.125, 0.40625]]))
    # the KL to theta_old: every x-prediction moved by (0.1, -0.3) -> mean of squares 0.05
    torch.testing.assert_close(trainer.kl_to_old(x_hat + torch.tensor([0.1, -0.3]), x_hat), torch.tensor([0.05]))


def test_x_predictions_keep_rows_with_their_sample_and_prompt():
    """One forward of M*J rows: row (m, j) must pair o_m with (t_mj, eps_mj) and prompt m. A velocity that
    reads the conditioning checks the rows against a per-row loop."""
    class CondVelocity:
        def velocity(self, net, x, t, cond):
            return x * cond["scale"].view(-1, 1, 1) + t.view(-1, 1, 1)

    torch.manual_seed(0)
    M, J = 3, 4
    o, taus, eps = torch.randn(M, 5, 2), torch.rand(M, J), torch.randn(M, J, 5, 2)
    cond = {"scale": torch.tensor([1.0, 2.0, 3.0])}
    x_hat = trainer.x_predictions(CondVelocity(), None, o, taus, eps, cond)
    for m in range(M):
        for j in range(J):
            t = taus[m, j]
            x = (1 - t) * o[m] + t * eps[m, j]
            torch.testing.assert_close(x_hat[m, j], x - t * (x * cond["scale"][m] + t))


def test_normaliser_carries_no_gradient():
    """d l / d x_hat must be 2 d / (D sg(mean|d|)): the L1 denominator is a constant. Were it differentiated,
    the gradient would gain - MSE sign(d) / (D L1^2), which this test tells apart."""
    torch.manual_seed(0)
    o = torch.randn(2, 6)
    x_hat = (o.unsqueeze(1) + torch.randn(2, 3, 6)).requires_grad_(True)   # (M=2, J=3, D=6)
    trainer.pair_losses(x_hat, o).sum().backward()
    d = (x_hat - o.unsqueeze(1)).detach()
    D, l1, mse = 6, d.abs().mean(2, keepdim=True), d.pow(2).mean(2, keepdim=True)
    constant_denominator = 2 * d / (D * l1)
    differentiated_denominator = constant_denominator - mse * d.sign() / (D * l1**2)
    torch.testing.assert_close(x_hat.grad, constant_denominator)
    assert (x_hat.grad - differentiated_denominator).abs().max() > 1e-2


# ---- pairs ----
def test_pairs_are_shared_within_each_group():
    noise = lambda n, g: torch.randn((n, 5, 3), generator=g)  # noqa: E731
    grid, B, G, J = common.uniform_sigmas(10), 3, 4, 4
    taus, eps = trainer.draw_pairs(grid, J, B, G, noise, "group", True, torch.Generator().manual_seed(0))
    assert taus.shape == (B * G, J) and eps.shape == (B * G, J, 5, 3)
    for b in range(B):
        first = b * G
        for i in range(first, first + G):
            assert torch.equal(taus[i], taus[first]) and torch.equal(eps[i], eps[first])
        if b:
            assert not torch.equal(eps[first], eps[0])              # another prompt, other pairs
    taus, eps = trainer.draw_pairs(grid, J, B, G, noise, "batch", True, torch.Generator().manual_seed(0))
    assert all(torch.equal(eps[i], eps[0]) and torch.equal(taus[i], taus[0]) for i in range(B * G))
    taus, eps = trainer.draw_pairs(grid, J, B, G, noise, "sample", True, torch.Generator().manual_seed(0))
    assert not torch.equal(eps[1], eps[0])                          # the ablation: nothing shared


def test_times_are_stratified_one_per_chunk_and_uniform_inside_it():
    """uniform_sigmas(10) without t = 0 is 1.0, 0.9, ..., 0.1; 4 contiguous chunks of sizes 3, 3, 2, 2."""
    chunks = [[1.0, 0.9, 0.8], [0.7, 0.6, 0.5], [0.4, 0.3], [0.2, 0.1]]
    n = 6000
    taus = trainer.stratified_times(common.uniform_sigmas(10), 4, n, torch.Generator().manual_seed(0))
    assert taus.shape == (n, 4)
    for j, chunk in enumerate(chunks):
        col = taus[:, j]
        hits = [(col - t).abs().lt(1e-6).sum().item() for t in chunk]
        assert sum(hits) == n                                       # every draw of pair j lies in chunk j
        for h in hits:                                              # uniform inside it, within 5 binomial sd
            p = 1 / len(chunk)
            assert abs(h - n * p) < 5 * math.sqrt(n * p * (1 - p))
    # without stratification some sets put two times in one chunk: the check above can fail
    flat = trainer.stratified_times(common.uniform_sigmas(10), 4, 200, torch.Generator().manual_seed(0),
                                   stratified=False)
    chunk_of = lambda t: next(k for k, c in enumerate(chunks) if any(abs(t - x) < 1e-6 for x in c))  # noqa: E731
    assert any(len({chunk_of(t) for t in row.tolist()}) < 4 for row in flat)


def test_times_never_hit_zero():
    grid = common.sd3_sigmas(4)                                      # 4 points above 0, then 0
    taus = trainer.stratified_times(grid, 4, 50, torch.Generator().manual_seed(0))
    assert (taus > 0).all() and torch.equal(taus, grid[:4].expand(50, 4))  # one point per chunk of size 1


# ---- ratio, clip, soft-clip ----
def test_ratio_is_exactly_one_at_theta_old_and_on_policy_gradient_is_advantage_weighted():
    """At theta = theta_old, rho = 1 and d loss / d L_i = A_i / M: the update is REINFORCE on -L."""
    surrogate = torch.tensor([0.3, 1.2, 0.7], requires_grad=True)
    A = torch.tensor([1.5, -0.5, 0.0])
    ratio = trainer.elbo_ratio(surrogate, surrogate.detach().clone())
    pg = trainer.clipped_objective(ratio, A, 0.01)
    assert torch.equal(ratio, torch.ones(3))
    pg.mean().backward()
    torch.testing.assert_close(surrogate.grad, A / 3)


def test_clip_stops_the_gradient_only_on_the_clipped_side():
    """rho = 1.1 > 1 + 0.01: with A = +1 the clipped term is the minimum (no gradient); with A = -1 the
    unclipped one is, and d(-A rho)/dL = A rho = -1.1."""
    surrogate = torch.tensor([0.5, 0.5], requires_grad=True)
    old = surrogate.detach() + math.log(1.1)
    ratio = trainer.elbo_ratio(surrogate, old)
    pg = trainer.clipped_objective(ratio, torch.tensor([1.0, -1.0]), 0.01)
    torch.testing.assert_close(ratio, torch.tensor([1.1, 1.1]))
    torch.testing.assert_close(pg, torch.tensor([-1.01, 1.1]))
    pg.sum().backward()
    torch.testing.assert_close(surrogate.grad, torch.tensor([0.0, -1.1]))


def test_soft_clip_formula():
    A = torch.tensor([-10.0, -1.0, 0.0, 1e-3, 0.5, 10.0])
    out = trainer.soft_clip(A, 3.0)
    torch.testing.assert_close(out, torch.tensor([3 * math.tanh(a / 3) for a in A.tolist()]))
    assert out.abs().max() < 3.0 and torch.all(out[1:] > out[:-1])      # bounded by kappa, monotone
    assert abs(out[3].item() - 1e-3) < 1e-9                             # linear near 0
    torch.testing.assert_close(trainer.soft_clip(-A, 3.0), -out)         # odd


# ---- end to end ----
@pytest.mark.parametrize("model,extra", [
    ("toy", []),
    ("flux", ["--share-pairs", "batch"]),
    ("sd3", ["--share-pairs", "sample", "--no-stratified", "--no-self-normalize"]),
])
def test_two_iterations_exactly_on_policy_first_update_and_paper_nfe(model, extra, tmp_path):
    """2 iterations of 2 gradient steps with the KL on: the first step is exactly on-policy (rho = 1, KL = 0),
    the second is not; the work per sample is the paper's NFE_old = T + N_MC and NFE_theta = N_MC."""
    run(trainer, [*model_argv(TRAINER, model), "--iterations", "2", "--output-dir", str(tmp_path / "r"), *SMALL,
                 "--updates-per-rollout", "2", "--beta", "0.3", *extra])
    lines = read_metrics(tmp_path / "r")
    assert [m["iteration"] for m in lines] == [0, 1, 2]
    J = common.cli(trainer.Args, model_argv(TRAINER, model), trainer.MODEL_DEFAULTS).mc_pairs
    for m in lines[:2]:
        assert all(math.isfinite(m[k]) for k in ("loss", "reward_mean", "grad_norm", "surrogate_old", "kl"))
        assert m["ratio_dev_first_update"] == 0.0 and m["kl_first_update"] == 0.0
        assert m["nfe_old_per_sample"] == 4 + J and m["nfe_theta_per_sample"] == J   # SMALL: T = 4
        assert m["decodes"] == m["reward_calls"] == 8
    # later steps are off-policy, so the exactness checks above can fail (a zero-advantage first minibatch
    # moves the weights only by weight decay: look over both iterations, the second has Adam momentum)
    assert max(m["ratio_dev_max"] for m in lines[:2]) > 0.0
    assert all("eval_reward" in m for m in lines)
    assert ("eval_accuracy" in lines[0]) == (model == "toy")
    assert (tmp_path / "r" / "checkpoints" / "iter_000002" / "state" / ".metadata").is_file()


def test_resume_equals_straight_run(tmp_path):
    """The pairs come from keyed generators (batch mode: one key for all ranks), so --resume repeats them."""
    base = [*tiny_argv(TRAINER, "flux"), "--seed", "3", "--share-pairs", "batch", *SMALL]
    a, b = straight_and_resumed(trainer, base, 1, 3, tmp_path)
    assert a == b and len(a) == 4


def test_torchrun_two_ranks_stay_identical(tmp_path):
    """Two ranks, each with its own prompts and one shared set of pairs (--share-pairs batch): DDP must keep the
    replicas equal through the single surrogate forward and backward per micro-batch."""
    stdout = torchrun(f"{TRAINER}.py", [*tiny_argv(TRAINER, "flux"), "--iterations", "2", "--prompts-per-step", "4",
           "--share-pairs", "batch", "--output-dir", str(tmp_path / "r"),
           *small(without=("prompts_per_step", "eval_every")), "--eval-every", "0"])
    assert "ranks 2 | prompts/rank B=2" in stdout
    last = read_metrics(tmp_path / "r")[-1]
    assert last["rank_param_diff"] == 0.0


@pytest.mark.slow  # 25 s; the default suite: flow_grpo's learning test, and V-GRPO's surrogate and resume here
def test_toy_held_out_reward_rises(tmp_path):
    """A CI-sized V-GRPO run on the toy model: held-out reward and strict accuracy over 200 fixed-seed images
    rise well beyond their sampling noise (binomial sd of the accuracy <= 0.035 at 200 images)."""
    run(trainer, ["--model", "toy", "--iterations", "6", "--eval-every", "6", "--micro-batch", "64",
                 "--eval-steps", "10", "--threads", "1", "--output-dir", str(tmp_path / "r")])
    lines = read_metrics(tmp_path / "r")
    first, last = lines[0], lines[-1]
    assert first["iteration"] == 0 and last["iteration"] == 6
    assert last["eval_reward"] - first["eval_reward"] > 0.08, (first, last)
    assert last["eval_accuracy"] - first["eval_accuracy"] > 0.15, (first, last)


# ---- bad input: one clear message that names the fix ----
def test_bad_pair_settings(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run(trainer, [*tiny_argv(TRAINER, "flux"), "--share-pairs", "prompt", "--output-dir", str(tmp_path / "r")])
    assert "argument --share-pairs: invalid choice: 'prompt' (choose from 'group', 'batch', 'sample')" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match="--mc-pairs 5 must be between 1 and the 4 grid points.*--pair-grid-steps"):
        run(trainer, [*tiny_argv(TRAINER, "flux"), "--mc-pairs", "5", "--output-dir", str(tmp_path / "r")])
    assert not (tmp_path / "r").exists()                            # refused before anything is written


def test_sizes_that_do_not_divide(tmp_path):
    with pytest.raises(ValueError, match="--micro-batch 3 must divide the 4 samples"):
        run(trainer, [*tiny_argv(TRAINER, "flux"), "--micro-batch", "3", "--output-dir", str(tmp_path / "r")])
    with pytest.raises(ValueError, match="--updates-per-rollout 3 must divide"):
        run(trainer, [*tiny_argv(TRAINER, "flux"), "--updates-per-rollout", "3", "--output-dir", str(tmp_path / "r")])
