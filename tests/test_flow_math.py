"""The step math against independent references (torch.distributions, the ODE, an analytic flow)."""
import math

import torch

import common


def test_sde_step_at_noise_zero_is_euler_step():
    torch.manual_seed(0)
    sigmas = common.sd3_sigmas(10)
    x, v = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)
    for k in range(10):
        t, s = sigmas[k], sigmas[k + 1]
        sde, _, mean, _ = common.sde_step(x, v, t, s, 0.0, float(sigmas[1]), generator=torch.Generator().manual_seed(1))
        assert torch.equal(sde, common.ode_step(x, v, t, s))
        assert torch.equal(mean, sde)


def test_log_prob_equals_torch_distributions():
    torch.manual_seed(0)
    sigmas = common.sd3_sigmas(10)
    x, v = torch.randn(5, 16, 12), torch.randn(5, 16, 12)
    for k in (0, 3, 9):
        nxt, lp, mean, std = common.sde_step(x, v, sigmas[k], sigmas[k + 1], 0.7, float(sigmas[1]),
                                             generator=torch.Generator().manual_seed(k))
        ref = torch.distributions.Normal(mean.double(), std.double()).log_prob(nxt.double()).flatten(1).mean(1)
        torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)
        # evaluating the stored sample reproduces the sampled log-prob exactly
        _, lp2, _, _ = common.sde_step(x, v, sigmas[k], sigmas[k + 1], 0.7, float(sigmas[1]), next_x=nxt)
        assert torch.equal(lp, lp2)


def test_sde_std_matches_paper_numbers():
    # SD3.5-M, T = 10, a = 0.7 -> std [.70, .74, .54, ...]: the values of Flow-GRPO's official sampler
    sigmas = common.sd3_sigmas(10)
    _, std = common.sde_std(sigmas[:-1], sigmas[1:], 0.7, float(sigmas[1]))
    torch.testing.assert_close(std[:4], torch.tensor([0.70, 0.74, 0.54, 0.45]), atol=6e-3, rtol=0)


def test_kl_of_policy_to_itself_is_zero_and_matches_distributions():
    mean = torch.randn(3, 10)
    assert torch.equal(common.gaussian_kl(mean, mean, 0.3), torch.zeros(3))
    other = mean + 0.1 * torch.randn(3, 10)
    Normal = torch.distributions.Normal
    ref = torch.distributions.kl_divergence(Normal(mean, 0.3), Normal(other, 0.3))
    torch.testing.assert_close(common.gaussian_kl(mean, other, 0.3), ref.mean(1))


def _gaussian_velocity(m, s):
    """Exact velocity E[eps - x0 | x_t = x] for data x0 ~ N(m, s^2) under x_t = (1 - t) x0 + t eps."""
    def v(x, t):
        mu, var = (1 - t) * m, (1 - t) ** 2 * s**2 + t**2
        return -m + (t - (1 - t) * s**2) / var * (x - mu)
    return v


def test_sde_preserves_the_ode_marginals():
    """On a 1-D Gaussian with its analytic velocity field, many SDE trajectories end with the ODE's mean
    and variance (and the data's), within sampling error."""
    m, s, n, T = 1.5, 0.5, 40000, 100
    v = _gaussian_velocity(m, s)
    sigmas = common.uniform_sigmas(T)
    g = torch.Generator().manual_seed(0)
    x_ode = x_sde = torch.randn(n, 1, generator=g)
    for k in range(T):
        t, u = float(sigmas[k]), float(sigmas[k + 1])
        x_ode = common.ode_step(x_ode, v(x_ode, t), t, u)
        x_sde = common.sde_step(x_sde, v(x_sde, t), t, u, 0.7, float(sigmas[1]), generator=g)[0]
    se_mean, se_var = s / math.sqrt(n), s**2 * math.sqrt(2 / n)
    assert abs(x_sde.mean() - m) < 5 * se_mean and abs(x_sde.var() - s**2) < 5 * se_var  # the data's marginal
    # The ODE's own Euler error: on a Gaussian each Euler step is affine, x -> a x + b, so pushing the points 0 and
    # 1 through it gives the ODE's exact output mean (b) and variance (a^2) for unit-Gaussian noise.
    ends = torch.tensor([[0.0], [1.0]])
    for k in range(T):
        t, u = float(sigmas[k]), float(sigmas[k + 1])
        ends = common.ode_step(ends, v(ends, t), t, u)
    b, a = float(ends[0]), float(ends[1] - ends[0])
    assert abs(a**2 - s**2) > se_var / 2                   # at T = 100 the bias is not negligible: it is accounted
    assert abs(x_sde.mean() - x_ode.mean()) < 5 * se_mean + abs(b - m)
    assert abs(x_sde.var() - x_ode.var()) < 5 * se_var + abs(a**2 - s**2)
    # and the noise really is there: a wrong drift (score term dropped) visibly inflates the variance
    x_bad = torch.randn(n, 1, generator=g)
    for k in range(T):
        t, u = float(sigmas[k]), float(sigmas[k + 1])
        _, std = common.sde_std(t, u, 0.7, float(sigmas[1]))
        x_bad = common.ode_step(x_bad, v(x_bad, t), t, u) + std * torch.randn(n, 1, generator=g)
    assert x_bad.var() > s**2 + 20 * se_var


def test_schedules_match_diffusers_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler
    sd3 = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sd3.set_timesteps(10)
    torch.testing.assert_close(common.sd3_sigmas(10, 3.0), sd3.sigmas.float(), atol=1e-6, rtol=0)
    flux = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)
    mu = 0.5 + (1024 - 256) * (1.15 - 0.5) / (4096 - 256)
    import numpy as np
    flux.set_timesteps(sigmas=np.linspace(1.0, 1 / 6, 6), mu=mu)
    torch.testing.assert_close(common.flux_sigmas(6, 1024), flux.sigmas.float(), atol=1e-6, rtol=0)
    # the official grids: FLUX at 512^2, T = 6 -> [1, .904, .790, .652, .484, .273, 0]
    torch.testing.assert_close(common.flux_sigmas(6, 1024), torch.tensor([1, .904, .790, .652, .484, .273, 0]),
                               atol=1.5e-3, rtol=0)


def test_x0_prediction_inverts_the_interpolation():
    x0, eps, t = torch.randn(2, 5), torch.randn(2, 5), torch.tensor([0.3, 0.8])
    xt = (1 - t[:, None]) * x0 + t[:, None] * eps
    torch.testing.assert_close(common.x0_prediction(xt, eps - x0, t), x0)


# ---- Coefficients-Preserving Sampling (CPS) ----
def test_cps_step_by_hand_on_two_elements():
    """t = 0.6, s = 0.4, a = 0.5: x0_hat = x - 0.6 v = (-0.7, -1.3), x1_hat = x + 0.4 v = (1.3, -0.8),
    std = 0.4 sin(pi / 4) = sqrt(0.08), sqrt(s^2 - std^2) = sqrt(0.16 - 0.08) = sqrt(0.08) = 0.2828427125,
    mean = 0.6 x0_hat + 0.2828427125 x1_hat = (-0.42 + 0.3676955262, -0.78 - 0.2262741700)."""
    x, v = torch.tensor([[0.5, -1.0]]), torch.tensor([[2.0, 0.5]])
    mean, std = common.cps_mean_std(x, v, 0.6, 0.4, 0.5)
    torch.testing.assert_close(mean, torch.tensor([[-0.0523044738, -1.0062741700]]), atol=1e-7, rtol=0)
    torch.testing.assert_close(std, torch.tensor(0.2828427125), atol=1e-7, rtol=0)
    # log-prob of a given next state: -mean (x' - mean)^2 = -(0.0523044738^2 + 0.0062741700^2) / 2
    _, lp, _, _ = common.cps_step(x, v, 0.6, 0.4, 0.5, next_x=torch.tensor([[0.0, -1.0]]))
    torch.testing.assert_close(lp, torch.tensor([-0.0013875616]), atol=1e-8, rtol=0)


def test_cps_at_noise_zero_is_the_ddim_step_and_keeps_the_noise_coefficient():
    torch.manual_seed(0)
    sigmas = common.sd3_sigmas(10)
    x, v = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    for k in range(10):
        t, s = sigmas[k], sigmas[k + 1]
        nxt, lp, mean, std = common.cps_step(x, v, t, s, 0.0, generator=torch.Generator().manual_seed(k))
        ddim = (1 - s) * (x - t * v) + s * (x + (1 - t) * v)       # (1 - s) x0_hat + s x1_hat
        assert torch.equal(mean, ddim) and torch.equal(nxt, ddim) and float(std) == 0.0 and torch.equal(lp, 0 * lp)
        torch.testing.assert_close(ddim, common.ode_step(x, v, t, s), atol=1e-5, rtol=0)  # DDIM is Euler, rounded
    # the coefficients, read off the function: x = t, v = 1 makes x0_hat = 0 and x1_hat = 1, so mean = sqrt(s^2 - std^2)
    for a in (0.3, 0.8, 1.0):
        for k in range(9):
            t, s = float(sigmas[k]), float(sigmas[k + 1])
            c1, std = common.cps_mean_std(torch.full((1, 1), t), torch.ones(1, 1), t, s, a)
            torch.testing.assert_close(c1 ** 2 + std ** 2, torch.tensor([[s ** 2]]), atol=1e-6, rtol=0)
            torch.testing.assert_close(std, torch.tensor(s * math.sin(a * math.pi / 2)))


def test_cps_log_ratio_is_the_gaussian_log_ratio_times_two_variances():
    """The official CPS log-prob drops 1 / (2 std^2) and the constants: for two policies at the same step (the same
    std), log N(x'; mu1) - log N(x'; mu2) = (lp1 - lp2) / (2 std^2), element-averaged (torch.distributions)."""
    torch.manual_seed(1)
    sigmas = common.sd3_sigmas(10)
    x, v1 = torch.randn(4, 16, 12), torch.randn(4, 16, 12)
    v2 = v1 + 0.05 * torch.randn(4, 16, 12)
    for k in (0, 3, 8):
        nxt, lp1, mu1, std = common.cps_step(x, v1, sigmas[k], sigmas[k + 1], 0.8,
                                             generator=torch.Generator().manual_seed(k))
        _, lp2, mu2, _ = common.cps_step(x, v2, sigmas[k], sigmas[k + 1], 0.8, next_x=nxt)
        gauss = [torch.distributions.Normal(mu.double(), std.double()).log_prob(nxt.double()).flatten(1).mean(1)
                 for mu in (mu1, mu2)]
        torch.testing.assert_close(gauss[0] - gauss[1], (lp1 - lp2).double() / (2 * std.double() ** 2),
                                   rtol=1e-4, atol=1e-7)
        assert (lp1 - lp2).abs().max() > 0                       # the policies differ: the check can fail
        # the sample is the Gaussian's: the standardised residual has mean 0 and variance 1
        r = ((nxt - mu1) / std).flatten()
        assert abs(r.mean()) < 0.1 and abs(r.var() - 1) < 0.1
