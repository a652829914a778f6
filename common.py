"""What the four trainers share; method logic lives in the trainers, and this file names no method except where a
step comes from (Flow-GRPO's SDE, CPS). Part I is the vocabulary a method is written in, to read beside a paper:
1. flow math, 2. models, 3. rewards, 4. prompts, 5. the training verbs a method section calls. Part II is the
machinery a fork uses without reading (the README states its promises, the tests hold them): 6. runtime and CLI,
7. the training loop, 8. run folders and checkpoints, 9. logging, 10. evaluation, 11. preflight, 12. remote scorers,
13. the models, scorers and prompt sets behind Part I's interfaces; Appendix A, the toy world; B, offline pipelines.

Conventions (rectified flow, diffusers' `sigma`): x_t = (1 - t) x0 + t eps, t in [0, 1], t = 1 is noise, velocity
v = eps - x0, and the sampler runs t from 1 down to 0 on a grid 1 = t_0 > t_1 > ... > t_T = 0.
"""
from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import copy
import dataclasses
import gzip
import hashlib
import importlib.util
import io
import itertools
import json
import logging
import math
import os
import random
import secrets
import shutil
import signal
import socket
import stat
import sys
import textwrap
import threading
import time
import traceback
import urllib.parse
import warnings
from http.client import HTTPConnection, HTTPException, HTTPSConnection
from pathlib import Path


def _stopped(signum, frame):  # a signal with nothing to save (start-up, evaluate, serve-reward): one line, 128 + it
    prog = [Path(sys.argv[0]).name, *sys.argv[1:2]][:1 + (Path(sys.argv[0]).name == "common.py")]
    with contextlib.suppress(Exception):  # stderr closed; a signal while this file loads (no _release_folder yet)
        print(f"{' '.join(prog)}: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        _release_folder()  # a run folder this process made and left empty goes
    os._exit(128 + signum)  # at once, not by an exception, which library code it lands in (a lazy import) may catch


_main = Path(getattr(sys.modules["__main__"], "__file__", "/")).resolve()  # a trainer or common.py: a signal while the
for _signum in (signal.SIGINT, signal.SIGTERM) if _main.parent == Path(__file__).resolve().parent else ():  # libraries
    signal.signal(_signum, _stopped)  # load ends it
import numpy as np  # noqa: E402 - after the handlers: torch takes seconds to load
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from einops import rearrange, repeat  # noqa: E402
from tqdm import tqdm  # noqa: E402

ASSETS = Path(__file__).resolve().parent / "assets"


# ==============================================================================================================
# PART I. THE VOCABULARY: what a method is written in, read beside its paper
# ==============================================================================================================
# ---- 1. Flow math, in float32. The SDE step is Flow-GRPO's [Flow-GRPO Eq. 8, Eq. 9]: the reverse-time SDE with the
#      ODE's marginals, Euler-Maruyama, g = a sqrt(t / (1 - t)); CPS's keeps the marginal's noise [arXiv 2509.05952].
def shift_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Static time shift of SD3: t = s u / (1 + (s - 1) u)."""
    return shift * u / (1 + (shift - 1) * u)


def sd3_sigmas(num_steps: int, shift: float = 3.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The grid of diffusers' FlowMatchEulerDiscreteScheduler with a static shift: T values of u from 1 down
    to shift(1/1000), shifted, then 0 appended. Returns (T+1,) float32."""
    u_min = float(shift_sigmas(torch.tensor(1.0 / num_train_timesteps), shift))
    u = torch.from_numpy(np.linspace(1.0, u_min, num_steps)).float()
    return torch.cat([shift_sigmas(u, shift), torch.zeros(1)])


def flux_sigmas(num_steps: int, image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                base_shift: float = 0.5, max_shift: float = 1.15, mu: float | None = None) -> torch.Tensor:
    """FLUX's resolution-dependent ("dynamic") shift: u = linspace(1, 1/T, T),
    t = e^mu / (e^mu + 1/u - 1), mu linear in the number of image tokens (or given). Returns (T+1,) float32."""
    if mu is None:
        mu = base_shift + (image_seq_len - base_seq_len) * (max_shift - base_shift) / (max_seq_len - base_seq_len)
    u = torch.from_numpy(np.linspace(1.0, 1.0 / num_steps, num_steps).astype(np.float32))
    t = math.exp(mu) / (math.exp(mu) + (1 / u - 1))
    return torch.cat([t.float(), torch.zeros(1)])


def flux2_sigmas(num_steps: int, image_seq_len: int) -> torch.Tensor:
    """FLUX.2's grid: FLUX's shift with an empirical mu linear in the image tokens n and in the steps T (diffusers'
    compute_empirical_mu, BFL's get_schedule), so a 10-step and a 40-step grid lie on different curves."""
    m200, m10 = 0.00016927 * image_seq_len + 0.45666666, 8.73809524e-5 * image_seq_len + 1.89833333
    a = (m200 - m10) / 190.0  # mu(T) through mu(10) = m10 and mu(200) = m200; past 4300 tokens, m200 at any T
    return flux_sigmas(num_steps, image_seq_len, mu=m200 if image_seq_len > 4300 else a * num_steps + m200 - 200 * a)


def uniform_sigmas(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """u = linspace(1, 0, T+1) with a static shift: evenly spaced steps, ending exactly at 0 (the toy's grid)."""
    return shift_sigmas(torch.linspace(1.0, 0.0, num_steps + 1), shift)


def _bcast(t, x: torch.Tensor) -> torch.Tensor:
    """A scalar or per-sample (B,) time, shaped to broadcast against x (B, ...)."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    return t.reshape(-1, *([1] * (x.dim() - 1))) if t.dim() == 1 else t


def x0_prediction(x: torch.Tensor, v: torch.Tensor, t) -> torch.Tensor:
    """One-step jump to t = 0: x0_hat = x_t - t v."""
    return x.float() - _bcast(t, x) * v.float()


def ode_step(x: torch.Tensor, v: torch.Tensor, t, s) -> torch.Tensor:
    """Euler step of dx/dt = v from t to s (< t): x' = x + (s - t) v."""
    return x.float() + (_bcast(s, x) - _bcast(t, x)) * v.float()


@torch.no_grad()
def sample_ode(adapter, net, cond: dict, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """The deterministic Euler sampler over `sigmas` with the adapter's velocity (section 2): the evaluation path."""
    for k in range(len(sigmas) - 1):
        x = ode_step(x, adapter.velocity(net, x, sigmas[k], cond), sigmas[k], sigmas[k + 1])
    return x


def sde_std(t, s, noise_level: float, t_cap: float):
    """The diffusion coefficient g = a sqrt(t / (1 - t)) and the step's std g sqrt(t - s), as float32 tensors. At
    t = 1 the denominator would vanish: it is 1 - t_cap, t_cap = t_1 the grid's second point (as the official code)."""
    t = torch.as_tensor(t, dtype=torch.float32)
    s = torch.as_tensor(s, dtype=torch.float32)
    g = noise_level * torch.sqrt(t / (1 - torch.where(t >= 1, torch.as_tensor(t_cap, dtype=torch.float32), t)))
    return g, g * torch.sqrt(t - s)


def sde_mean_std(x: torch.Tensor, v: torch.Tensor, t, s, noise_level: float, t_cap: float):
    """Mean and std of the Gaussian SDE step from t to s (< t):
        mean = x + [v + g^2 / (2t) (x + (1 - t) v)] (s - t),   std = g sqrt(t - s),
    where x + (1 - t) v is the noise prediction, so the bracket is v - (g^2 / 2) score. With noise_level = 0
    the mean is exactly the Euler step. Returns (mean, std), float32, std shaped to broadcast against x."""
    x, v = x.float(), v.float()
    g, std = sde_std(t, s, noise_level, t_cap)
    tb, sb, gb = _bcast(t, x), _bcast(s, x), _bcast(g, x).to(x.device)
    mean = x + (v + gb**2 / (2 * tb) * (x + (1 - tb) * v)) * (sb - tb)
    return mean, _bcast(std, x).to(x.device)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std) -> torch.Tensor:
    """log N(x; mean, std^2) averaged (not summed) over all but the batch dimension, in float32. The mean
    makes exp(logp_new - logp_old) a per-element geometric-mean ratio, which is why clip ranges of 1e-4 work."""
    x, mean = x.float(), mean.float()
    std = _bcast(std, x)
    lp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


def sde_step(x: torch.Tensor, v: torch.Tensor, t, s, noise_level: float, t_cap: float,
             next_x: torch.Tensor | None = None, generator: torch.Generator | None = None):
    """One SDE step from t to s. If `next_x` is given (training: the stored sample) its log-prob is evaluated;
    otherwise a sample is drawn with `generator`. With noise_level = 0 the log-prob, meaningless, is 0.
    Returns (next_x, log_prob (B,), mean, std), all float32."""
    mean, std = sde_mean_std(x, v, t, s, noise_level, t_cap)
    if next_x is None:
        noise = torch.randn(mean.shape, generator=generator, dtype=torch.float32).to(mean.device)
        next_x = mean + std * noise
    log_prob = gaussian_log_prob(next_x, mean, std) if noise_level > 0 else torch.zeros(len(x), device=x.device)
    return next_x.float(), log_prob, mean, std


def gaussian_kl(mean_p: torch.Tensor, mean_q: torch.Tensor, std) -> torch.Tensor:
    """KL between two Gaussians of equal std, averaged over elements like the log-prob: mean (mp - mq)^2 / 2std^2."""
    return (((mean_p.float() - mean_q.float()) ** 2) / (2 * _bcast(std, mean_p) ** 2)).flatten(1).mean(1)


def cps_mean_std(x: torch.Tensor, v: torch.Tensor, t, s, noise_level: float):
    """Mean and std of a Coefficients-Preserving Sampling step from t to s (< t) [CPS, arXiv 2509.05952]:
        x0_hat = x - t v,   x1_hat = x + (1 - t) v,   std = s sin(a pi / 2),
        mean = (1 - s) x0_hat + sqrt(s^2 - std^2) x1_hat,
    so the next state's noise, sqrt(s^2 - std^2) x1_hat + std eps, has the coefficient s that x_s has (where the
    Flow-GRPO SDE adds more). With a = 0 it is the DDIM step (1 - s) x0_hat + s x1_hat, which is the Euler step;
    at s = 0 the std is 0. Returns (mean, std), float32, std shaped to broadcast against x."""
    x, v = x.float(), v.float()
    tb, sb = _bcast(t, x), _bcast(s, x)
    std = sb * math.sin(noise_level * math.pi / 2)
    mean = (1 - sb) * (x - tb * v) + torch.sqrt(sb**2 - std**2) * (x + (1 - tb) * v)
    return mean, std


def cps_step(x: torch.Tensor, v: torch.Tensor, t, s, noise_level: float, next_x: torch.Tensor | None = None,
             generator: torch.Generator | None = None):
    """One CPS step from t to s, as sde_step: the stored `next_x` scored, or a sample drawn with `generator`. Its
    log-prob is the official code's, -mean (x' - mean)^2 over elements: the Gaussian's without its constants and
    without the 1 / (2 std^2), so a log-ratio is 2 std^2 times the Gaussian's, and a clip range means there what it
    means in the official CPS configs (1e-5). Returns (next_x, log_prob (B,), mean, std), all float32."""
    mean, std = cps_mean_std(x, v, t, s, noise_level)
    if next_x is None:
        next_x = mean + std * torch.randn(mean.shape, generator=generator, dtype=torch.float32).to(mean.device)
    return next_x.float(), -((next_x.float() - mean) ** 2).flatten(1).mean(1), mean, std


# ---- 2. Models: one interface, so trainers never branch on the model; LoRA; the reference policy; the EMA ----
# An adapter (load_model's; section 13, Appendix A) holds frozen encoders and VAE, the trained `transformer`, and knows:
#   encode(prompts) -> cond         prompt embeddings (dict of batched tensors), no grad, reusable
#   noise(n, generator) -> x        initial latents (n, N, C) or (n, C, h, w), float32
#   sigmas(T) -> (T+1,)             the sampling grid, float32, t_0 = 1, t_T = 0
#   velocity(net, x, t, cond) -> v  v_theta in float32, CFG / guidance inside; `net`: trained (DDP-wrapped) or reference
#   decode(x) -> images             (n, 3, H, W) in [0, 1], float32
#   lora_targets, save_lora(dir, state_dict), weights_dtype (the transformer's as loaded, and as published)
MODELS = ("toy", "flux", "sd3", "flux2")
HUB_IDS = {"flux": "black-forest-labs/FLUX.1-dev", "sd3": "stabilityai/stable-diffusion-3.5-medium",
           "flux2": "black-forest-labs/FLUX.2-klein-base-4B"}
FLUX_LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                     "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                     "ff_context.net.2"]
SD3_LORA_TARGETS = FLUX_LORA_TARGETS[:8]
# FLUX.2's: every linear layer of every block (MLPs named linear_in, linear_out; a single block's fused attention-and-
# MLP input, and its output `attn.to_out`, which Flux2Adapter names per block: the suffix picks the double blocks' list)
FLUX2_LORA_TARGETS = SD3_LORA_TARGETS + ["ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                                         "ff_context.linear_out", "attn.to_qkv_mlp_proj"]


def cond_select(cond: dict, idx) -> dict:
    """Rows `idx` of every batched tensor in a conditioning dict."""
    return {k: v[idx] for k, v in cond.items()}


def cond_repeat(cond: dict, n: int) -> dict:
    """Each prompt's conditioning repeated n times in a row (a group of n samples per prompt, prompt-major)."""
    return {k: repeat(v, "b ... -> (b n) ...", n=n) for k, v in cond.items()}


def add_lora(transformer: torch.nn.Module, rank: int, alpha: float, targets: list[str]) -> list[torch.nn.Parameter]:
    """Freezes the transformer and adds a peft LoRA (diffusers' integration: the adapter can be disabled for the
    reference policy and saved in diffusers' format); rank 0 = full fine-tuning. Returns the trainable parameters."""
    if rank <= 0:
        return list(transformer.requires_grad_(True).parameters())
    from peft import LoraConfig
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets))
    params = [p for p in transformer.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return params


@contextlib.contextmanager
def lora_disabled(transformer: torch.nn.Module):
    """The reference policy under LoRA: the same network with its adapter switched off."""
    transformer.disable_adapters()
    try:
        yield transformer
    finally:
        transformer.enable_adapters()


def frozen_copy(module: torch.nn.Module) -> torch.nn.Module:
    """Full fine-tuning's reference policy: a frozen copy, cast and sharded as the trained one (full_finetuning)."""
    return copy.deepcopy(module).eval().requires_grad_(False)


class EMA:
    """Exponential moving average of the trainable parameters: after optimizer step n (from 1), if n + 1 is a multiple
    of `every`, shadow <- d shadow + (1 - d) theta, d = `decay`, or with `warmup` (the official GRPO trainers' schedule)
    d = min((1 + n) / (10 + n), decay); a slow old policy is EMA(params, d, 1, warmup=False). `offload`: on the CPU."""
    swapped = 0  # copies swapped in now, of any EMA: a signal waits until none is (TrainingLoop.stop_if_signalled)

    def __init__(self, params, decay: float = 0.9, every: int = 8, warmup: bool = True, offload: bool = False):
        self.params, self.decay, self.every, self.warmup, self.offload = list(params), decay, every, warmup, offload
        self.shadow = [self.copy(p) for p in self.params]

    def copy(self, p: torch.Tensor) -> torch.Tensor:
        return p.detach().to("cpu", copy=True) if self.offload else p.detach().clone()

    @torch.no_grad()
    def step(self, optimizer_step: int):
        if (optimizer_step + 1) % self.every:
            return
        d = min((1 + optimizer_step) / (10 + optimizer_step), self.decay) if self.warmup else self.decay
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().to(s.device), 1 - d)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self):
        """Temporarily puts the averaged weights into the model (evaluation, checkpoints, a method's old policy)."""
        backup, EMA.swapped = [self.copy(p) for p in self.params], EMA.swapped + 1
        for p, s in zip(self.params, self.shadow):
            p.copy_(s)
        try:
            yield
        finally:
            for p, b in zip(self.params, backup):
                p.copy_(b)
            EMA.swapped -= 1


# ---- 3. Rewards: a scorer maps (images (N, 3, H, W) in [0, 1], prompts, metadata) to (N,) float32 scores; metadata
#      are the prompts' records from the prompt file (GenEval's tags, say), or None. REWARDS (section 13) names them.
REWARD_NORMS = ("sum", "per-reward")


class WeightedReward:
    """Scorers with weights (`terms`: parse_reward_spec's); called, (their weighted sum (N,), {name: scores (N,)}) in
    float32 on `device`. A scorer that fails on any rank stops every rank with the same line (stop_together)."""

    def __init__(self, terms: list[tuple[str, float]], device="cpu", norm: str = "sum"):
        self.terms = [(name, w, RemoteReward(name[len("remote:"):], device) if name.startswith("remote:")
                       else REWARDS[name](device=device)) for name, w in terms]
        self.weights = {name: w for name, w, _ in self.terms}
        self.device, self.norm, self.calls = device, norm, 0  # calls: images scored so far

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None, batch_size: int | None = None):
        """Scores images against prompts (and their records, `metadata`), `batch_size` images per scorer call."""
        self.calls += len(images)
        step = batch_size or max(len(images), 1)
        with stop_together("the reward failed"):  # the weights are intact
            chunks = [{name: fn(images[i:i + step], prompts[i:i + step], None if metadata is None else
                                metadata[i:i + step]).float().to(self.device) for name, _, fn in self.terms}
                      for i in range(0, len(images), step)]
        parts = {name: torch.cat([c[name] for c in chunks]) for name in self.weights}
        return self.total(parts), parts

    def total(self, parts: dict) -> torch.Tensor:
        return sum(w * parts[name] for name, w in self.weights.items())

    def advantages(self, parts: dict, group_advantage) -> torch.Tensor:
        """Advantages by --reward-norm (`norm`): `group_advantage` (rewards of any shape -> advantages) applied to the
        weighted sum of `parts` (sum), or to each part and then summed with the weights (per-reward)."""
        if self.norm == "sum":
            return group_advantage(self.total(parts))
        return sum(w * group_advantage(parts[name]) for name, w in self.weights.items())

    def means(self, parts: dict) -> dict:
        """Each scorer's mean over every rank, for the logs: {"reward_<name>": mean}."""
        return {f"reward_{short_reward_name(name)}": all_reduce_mean(parts[name].float().mean()).item()
                for name in self.weights}


# ---- 4. Prompts: records {"prompt": str, ...metadata} ----
def load_prompts(path: str | None, model: str) -> tuple[list[dict], list[dict]]:
    """(train, eval) records of a prompt set (prompt_set) or file (read_prompt_file: every 10th held out unless the
    records have a "split"); no path: the toy's held-out pairs as both for the toy model, else assets/prompts.txt's."""
    if path is None and model == "toy":
        recs = [{"prompt": toy_prompt(c, s), "color": c, "shape": s} for c, s in TOY_HELD_OUT]
        return recs, recs
    if (path or "").partition("@")[0] in PROMPT_SETS:
        return prompt_set(path, model)
    recs = read_prompt_file(path or str(ASSETS / "prompts.txt"), model)
    if any("split" in r for r in recs):
        train, evals = ([r for r in recs if r.get("split", "train") == split] for split in ("train", "eval"))
    else:
        train, evals = [r for i, r in enumerate(recs) if i % 10] or recs, recs[::10]
    return train, evals or train[:1]


def sample_prompts(records: list[dict], n: int, generator: torch.Generator) -> list[dict]:
    """n records for one iteration: without replacement when the set is large enough."""
    idx = (torch.randperm(len(records), generator=generator)[:n] if n <= len(records)
           else torch.randint(len(records), (n,), generator=generator))
    return [records[i] for i in idx.tolist()]


# ---- 5. The training verbs a method section calls: seeded draws, collectives, gradient accumulation, the step ----
def make_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from integers (seed, rank, iteration, ...), so a resumed run repeats the same draws."""
    # The key count goes in too: SeedSequence alone treats (a, b) and (a, b, 0) as the same entropy.
    state = np.random.SeedSequence([*keys, len(keys)]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state >> 1))


def all_gather_cat(x: torch.Tensor) -> torch.Tensor:
    """Concatenates a tensor of equal shape from every rank (rank order); the tensor itself on one process."""
    if not dist.is_initialized():
        return x
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out)


def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over ranks; the tensor itself on one process."""
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return x


def no_sync(net: torch.nn.Module, skip: bool):
    """skip=True: no gradient sync while accumulating (DDP's no_sync(), FSDP2's set_requires_gradient_sync)."""
    if hasattr(net, "set_requires_gradient_sync"):
        net.set_requires_gradient_sync(not skip)
        return contextlib.nullcontext()
    return net.no_sync() if skip and hasattr(net, "no_sync") else contextlib.nullcontext()


class UpdateStats:
    """An update's statistics, the keys given to `add` after each backward pass, fetched once per optimizer step (one
    sync): metrics() (each key's mean, grad_norm's over the steps that stepped); a key's max / mean, or its step's."""

    def __init__(self):
        self.steps, self.pending, self.grad_norms = [], [], []

    def add(self, **values: torch.Tensor):
        self.pending.append(values)

    def stepped(self, grad_norm: float):
        rows = torch.stack([torch.stack([v.detach().float() for v in d.values()]) for d in self.pending]).tolist()
        self.steps.append([dict(zip(self.pending[0], row)) for row in rows])
        self.pending = []
        self.grad_norms.append(grad_norm)

    def values(self, key: str, step: int | None = None) -> list[float]:
        return [d[key] for d in (self.steps[step] if step is not None else itertools.chain(*self.steps))]

    def max(self, key: str, step: int | None = None) -> float:
        return max(self.values(key, step))

    def mean(self, key: str, step: int | None = None) -> float:
        return float(np.mean(self.values(key, step)))

    def metrics(self) -> dict:
        norms = [n for n in self.grad_norms if math.isfinite(n)] or [math.nan]
        return {**{k: self.mean(k) for k in self.steps[0][0]}, "grad_norm": sum(norms) / len(norms)}


class StepGuard:
    """Backward passes and the optimizer step, skipped on every rank when the gradient norm is NaN / inf on any:
    `max_bad` skips in a row, or weights a step made non-finite, stop the run. `loss_scaling` (fp16): a GradScaler."""
    last: StepGuard | None = None  # the one made last: a TrainingLoop given none keeps its loss scale

    def __init__(self, max_bad: int, device, loss_scaling: bool = False):
        self.max_bad, self.device, self.in_a_row, self.skipped = max_bad, device, 0, 0
        self.scaler = torch.amp.GradScaler(device.type) if loss_scaling else None
        self.losses_finite, StepGuard.last = True, self

    def backward(self, loss: torch.Tensor):
        """loss.backward(); fp16: of the scaled loss."""
        if self.scaler is None:
            return loss.backward()
        self.losses_finite &= bool(torch.isfinite(loss.detach()))
        self.scaler.scale(loss).backward()

    def step(self, optimizer, params: list, grad_clip: float) -> tuple[bool, float]:
        """Clips, then steps if every rank's gradient is finite; zeroes the gradients. Returns (stepped, norm / NaN)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: the norm over all shards
        flags = all_ranks([torch.isfinite(norm.detach()), self.losses_finite], self.device, dist.ReduceOp.MIN)
        stepped, losses_finite = map(bool, flags)
        if stepped:
            optimizer.step()
            if not finite(params, self.device):
                raise TrainingStopped("an optimizer step made the weights non-finite (the update overflowed their "
                                      "dtype), unsaved: resume from the last checkpoint with a smaller --lr")
        if self.scaler is not None:
            self.scaler.update()
            self.losses_finite = True
        optimizer.zero_grad(set_to_none=True)
        overflow = not stepped and self.scaler is not None and losses_finite
        self.in_a_row = 0 if stepped or overflow else self.in_a_row + 1
        self.skipped += not stepped
        if self.in_a_row >= self.max_bad:
            raise TrainingStopped(f"{self.in_a_row} optimizer steps in a row had a NaN or inf gradient norm (a non-"
                                  f"finite reward, loss or gradient) and were skipped, unsaved: resume from the last "
                                  f"checkpoint with a smaller --lr or a fixed reward, or raise --max-bad-steps")
        return stepped, norm.item() if stepped else math.nan


# ==============================================================================================================
# PART II. THE MACHINERY: what a fork uses without reading; the README states its promises, the tests hold them
# ==============================================================================================================
# ---- 6. Runtime and CLI: torchrun, seeds, one-line errors, signals, the dataclass command line, collectives ----
@dataclasses.dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype  # the compute (autocast) dtype, --dtype
    compile: bool = False  # --compile: load_model compiles the transformer's repeated blocks (compile_blocks)
    is_main = property(lambda self: self.rank == 0)
    distributed = property(lambda self: self.world_size > 1)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype: the same on every device
GPU_DTYPES = {"toy": "bf16", "flux": "bf16", "sd3": "fp16", "flux2": "bf16"}  # --dtype's on a GPU (README, Precision)
COMPILING = collections.Counter(compiles=0, compile_s=0.0)  # --compile: the compiles so far and their seconds
_BALANCE = {}  # the cores, their share and the last measurement of a run whose threads are not fixed
_SIGNALLED = {"signum": 0, "blocking": False}  # the first SIGTERM / SIGINT's number; inside an `interruptible` block


def setup_runtime(seed: int, threads: int | None = None, dtype: str | None = None, model: str = "toy",
                  compile: bool = False) -> Runtime:
    """torchrun's ranks (launcher), nccl on GPU, gloo on CPU, seeds per rank; the compute dtype --dtype's, unset
    GPU_DTYPES[model] on a GPU, float32 on a CPU. Checks --compile's needs; says what bf16 costs on a CPU without it."""
    rank, world_size, local_rank = launcher()
    with contextlib.suppress(*() if compile else (UsageError,)):  # torch makes it uncompiled too (diffusers imports
        if cache := os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None):  # dynamo): unusable, its default then
            writable_folder(Path(cache), "TORCHINDUCTOR_CACHE_DIR")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    if compile and not any(map(shutil.which, filter(None, importlib.import_module("torch._inductor.config").cpp.cxx))):
        raise UsageError("--compile needs a C++ compiler (g++, or the one CXX names), not found here: install one, or "
                         "drop --compile")  # inductor's search
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device, backend = torch.device("cpu"), "gloo"
        cpu_threads(threads)
    rt = Runtime(rank, world_size, device, DTYPES[dtype or (GPU_DTYPES[model] if backend == "nccl" else "fp32")],
                 compile)
    if rt.dtype == torch.bfloat16 and backend == "gloo" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        print0(f"--dtype bf16: this CPU ({torch.backends.cpu.get_cpu_capability()}) has neither AVX-512 BF16 nor AMX, "
               f"so its bf16 matrix products are emulated and the run will take many times as long as in float32 "
               f"(--dtype fp32; README, Precision)")
    if world_size > 1 and not dist.is_initialized():  # each rank says it: one alone in a stale shell too
        at, limit, err = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", dist.default_pg_timeout, sys.stderr
        if "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun's agent gathers its workers first; a shell's may wait
            print(f"rank {rank}: waiting for the {world_size} ranks of WORLD_SIZE at {at} (MASTER_ADDR:MASTER_PORT); "
                  f"gives up after {limit.seconds // 60} min without them (a rank other than 0 retries once)", file=err)
        try:
            dist.init_process_group(backend, timeout=limit, device_id=device if backend == "nccl" else None)
        except dist.DistError as e:
            print(f"rank {rank}: the {world_size} ranks did not all join at {at} ({one_line(e)}): launch them with "
                  f"torchrun, or unset RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT", file=err)
            raise SystemExit(2) from None
    random.seed(seed + rank)  # seeds per rank
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)
    return rt


def launcher() -> tuple[int, int, int]:
    """torchrun's RANK, WORLD_SIZE and LOCAL_RANK (one process without them), checked as flags are (README)."""
    v = {**dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"), **os.environ}  # unset: one process
    for rank, size in [("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")]:
        if not (v[rank].isdecimal() and v[size].isdecimal() and int(v[rank]) < int(v[size])):
            raise UsageError(f"{rank}={v[rank]} and {size}={v[size]}: torchrun sets integers, 0 <= {rank} < {size}; "
                             f"launch with torchrun, or unset those left in the shell")
    port = os.environ.get("MASTER_PORT", "")
    if int(v["WORLD_SIZE"]) > 1 and not ("MASTER_ADDR" in os.environ and port.isdecimal() and 0 < int(port) < 65536):
        raise UsageError(f"WORLD_SIZE={v['WORLD_SIZE']} without torchrun's MASTER_ADDR and MASTER_PORT (a port "
                         f"1-65535; MASTER_PORT={port!r}): launch with torchrun, or unset WORLD_SIZE")
    return int(v["RANK"]), int(v["WORLD_SIZE"]), int(v["LOCAL_RANK"])


def cpu_threads(threads: int | None = None):
    """A CPU run's intra-op threads: `threads`, else its share of the cores less those others keep busy (README)."""
    _BALANCE.clear()
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    share = threads or max(1, len(cpus) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(share)
    if not threads and share > 1 and Path("/proc/stat").is_file():
        _BALANCE.update(cpus=cpus, share=share, last=None)
        balance_threads()  # the first measurement: the next call, a second or more later, sets the threads


def balance_threads():
    """Sets the threads between iterations and evaluation batches, so a rollout and its update share them (README)."""
    now, last = time.monotonic(), _BALANCE.get("last")
    if not _BALANCE or last is not None and now - last[0] < 1.0:
        return
    _BALANCE["last"] = now, _busy_seconds(_BALANCE["cpus"])
    if last is not None:
        others = (_BALANCE["last"][1] - last[1]) / (now - last[0])  # cores kept busy by other processes
        torch.set_num_threads(max(1, min(_BALANCE["share"], int(len(_BALANCE["cpus"]) - others + 0.5))))


def _busy_seconds(cpus: set) -> float:
    """Seconds the cores `cpus` have been busy since boot, less this process's CPU seconds: other processes'."""
    ticks = 0  # /proc/stat: user nice system (idle iowait) irq softirq steal
    for line in Path("/proc/stat").read_text().splitlines():
        name, *v = line.split()
        if name[3:].isdigit() and name.startswith("cpu") and int(name[3:]) in cpus:
            ticks += sum(map(int, v[:3])) + sum(map(int, v[5:8]))
    return ticks / os.sysconf("SC_CLK_TCK") - sum(os.times()[:2])


def print0(*args, **kwargs):
    with contextlib.suppress(UsageError):  # on rank 0, and where torchrun's variables do not fit (to show why)
        if launcher()[0]:
            return
    print(*args, **kwargs, flush=True)


class _Stream:
    """stdout or stderr of a command: a write that fails (reader gone, disk full) stops the printing, not the run."""

    def __init__(self, stream: io.TextIOBase | None):  # None: closed at start (>&-, 2>&-); /dev/null then takes its
        self.stream = stream or open(os.devnull, "w")  # free descriptor (stdout first), which no later file can take

    def __getattr__(self, name):  # flush, fileno, isatty, encoding, ...: each write has flushed, or failed
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError:  # EPIPE, ENOSPC: what is buffered goes to /dev/null too
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
        return len(text)


@contextlib.contextmanager
def ends_process():
    """Around an entry point: under torchrun the process ends here with the block's exit status (os._exit), since
    the group's destructor and interpreter exit deadlock or abort on a gloo worker thread that still needs the GIL."""
    code = 0
    try:
        yield
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        raise
    except BaseException:
        code = 1
        if dist.is_initialized():
            traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


class UsageError(ValueError):
    """Bad input: the message says which flag or file to change. `python <trainer>.py` prints it as one line."""


class TrainingStopped(RuntimeError):
    """The run ended early on purpose, saying what was saved and how to go on; `save_state`: the weights are intact."""

    def __init__(self, message: str, exit_code: int = 1, save_state: bool = False):
        super().__init__(message)
        self.exit_code, self.save_state = exit_code, save_state


def check_flag(name: str, value, at_least: float | None = None, at_most: float | None = None):
    """A UsageError naming --name unless `value` is None (unset) or a number within the bounds and float32's range."""
    big = float(torch.finfo(torch.float32).max)
    lo, hi = max(-big, -big if at_least is None else at_least), min(big, big if at_most is None else at_most)
    if value is None or isinstance(value, (int, float)) and lo <= value <= hi:
        return
    number = isinstance(value, (int, float)) and value == value  # NaN is not
    low = f"at least {at_least}" if lo > -big else f"at least {-big:.2g}, float32's lowest" * (number and value < lo)
    high = f"at most {at_most}" if hi < big else f"at most {big:.2g}, float32's largest" * (number and value > hi)
    bounds = " and ".join(filter(None, (low, high))) or "a number"
    raise UsageError(f"--{name.replace('_', '-')} {value} must be {bounds}{'' if number else ' (it is not a number)'}")


def run_cli(main, args_cls, model_defaults: dict, argv: list[str] | None = None):
    """`python <trainer>.py`: main on its command line; a signal asks for a checkpoint and stop; errors are one line."""
    handlers = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    TrainingLoop.active, _SIGNALLED["signum"] = None, 0
    streams = sys.stdout, sys.stderr = _Stream(sys.stdout), _Stream(sys.stderr)
    with ends_process():
        try:
            with one_line_errors(Path(sys.argv[0]).name):
                try:
                    main(cli(args_cls, argv, model_defaults))
                except Exception as e:
                    if TrainingLoop.active is None or isinstance(e, UsageError):
                        raise
                    TrainingLoop.active.after_failure(e)
        finally:
            TrainingLoop.active, _SIGNALLED["signum"], (sys.stdout, sys.stderr) = None, 0, (s.stream for s in streams)
            for s, h in handlers.items():
                signal.signal(s, h)
            _release_folder()


@contextlib.contextmanager
def one_line_errors(prog: str):
    """A UsageError or TrainingStopped as one line (`report`) and exit status 2 or the stop's own, no traceback."""
    try:
        yield
    except UsageError as e:
        report(f"{prog}: error: {e}", 2)
    except TrainingStopped as e:
        report(f"{prog}: {e}", e.exit_code)


def report(line: str, exit_code: int):
    """Prints `line` on rank 0 and exits; each rank also writes it to its torchrun error file, as the root cause."""
    print0(line, file=sys.stderr)
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    sys.exit(exit_code)


def _on_signal(signum, frame):
    """A first SIGTERM / SIGINT asks for a checkpoint and stop (or ends an `interruptible` block); a second exits."""
    name = signal.Signals(signum).name
    if TrainingLoop.active is None and not _SIGNALLED["blocking"]:  # starting (or ending): nothing to save
        _stopped(signum, frame)
    if _SIGNALLED["signum"]:  # a second signal: stop now
        print(f"\n{name} received again: stopping at once, without a checkpoint", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    _SIGNALLED["signum"] = signum
    print(f"\n{name} received: the run will checkpoint and stop at the next safe point (send it again to stop "
          f"at once)", file=sys.stderr, flush=True)
    if _SIGNALLED["blocking"]:
        raise TrainingStopped(f"{name} received during a blocking call")


@contextlib.contextmanager
def interruptible():
    """A main-thread block that may wait long (a remote scorer): a signal before or during it raises TrainingStopped."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers run in the main thread only
        yield
        return
    if _SIGNALLED["signum"]:
        raise TrainingStopped(f"{signal.Signals(_SIGNALLED['signum']).name} received before a blocking call")
    _SIGNALLED["blocking"] = True
    try:
        yield
    finally:
        _SIGNALLED["blocking"] = False


def signalled(device) -> int:
    """The number of a SIGTERM / SIGINT received by any rank since the start, else 0; all ranks agree."""
    return int(all_ranks([_SIGNALLED["signum"]], device, dist.ReduceOp.MAX)[0])


def field(default, help: str, **kwargs):
    """A dataclass field with a help string, shown by `--help`; `at_least` / `at_most` bound a number (cli checks)."""
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


class Parser(argparse.ArgumentParser):
    """argparse reporting a bad command line in one line ("prog: error: ...", exit status 2), without the usage."""

    def error(self, message):
        report(f"{self.prog}: error: {message}", 2)


def cli(args_cls, argv: list[str] | None = None, model_defaults: dict | None = None):
    """The command line as `args_cls` (a dataclass of toy defaults), its unset fields and --help from --model's entry
    of `model_defaults`; numbers within their field's bounds (check_flag), no empty value of a flag unset by default."""
    doc = " ".join((sys.modules["__main__"].__doc__ or "").split("\n\n")[0].split())
    fields = {f.name: f for f in dataclasses.fields(args_cls)}
    pre = Parser(add_help=False)
    pre.add_argument("--model", default=fields["model"].default)
    pre.add_argument("--model-path")
    model, path = vars(pre.parse_known_args(argv)[0]).values()
    parser = Parser(description=f"{doc} Defaults shown are those of --model {model}.")
    table = {**(model_defaults or {}).get(model, {}), **distilled_defaults(model, path)}
    defaults = {k: v for k, v in table.items() if k in fields}
    for f in fields.values():
        default, typ = defaults.get(f.name, f.default), str(f.type).replace(" | None", "")
        help_ = f.metadata.get("help", "") + ("" if default is None else f" (default: {default})")
        kind = {"action": argparse.BooleanOptionalAction} if typ == "bool" else \
            {"type": {"int": int, "float": float}.get(typ, str), "choices": f.metadata.get("choices")}
        parser.add_argument("--" + f.name.replace("_", "-"), default=default, help=help_, **kind)
    values = vars(parser.parse_args(argv))
    for f in fields.values():
        value = values[f.name]
        if value == "" and f.default is None:
            raise UsageError(f"--{f.name.replace('_', '-')} '' is empty: pass a value or leave the flag out")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            check_flag(f.name, value, f.metadata.get("at_least"), f.metadata.get("at_most"))
    if values.get("prompts") in PROMPT_SETS:  # args.json records the set's revision
        values["prompts"] += "@" + REVISIONS[HPDV2 if values["prompts"] == "hpdv2" else FLOW_GRPO]
    return args_cls(**values)


# Collectives: each is the identity (or a no-op) on one process.
def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    box = [obj]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ranks(values: list, device, op) -> list[float]:
    """A few numbers reduced over ranks with `op` (dist.ReduceOp.MAX: any rank's flag, MIN: every rank's)."""
    t = torch.tensor([float(v) for v in values], device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t.tolist()


@contextlib.contextmanager
def stop_together(what: str):
    """A block every rank runs: an exception in it on any rank stops every rank with the same line, none waiting."""
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then all stop
        error = str(e) if isinstance(e, TrainingStopped) else f"{type(e).__name__}: {e}"
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((f"on rank {r}: {m}" for r, m in enumerate(errors) if m), None)
    if error:
        raise TrainingStopped(f"{what} {error}", save_state=True)


def rank_param_diff(params: list[torch.Tensor]) -> float:
    """Largest difference across ranks of per-tensor sums and sums of squares in float64 (0.0: replicas identical)."""
    fp = torch.stack([v for t in params for v in (t.detach().double().sum(), t.detach().double().square().sum())])
    on_cpu = not dist.is_initialized() or dist.get_backend() == "gloo"
    allfp = all_gather_cat(fp.cpu() if on_cpu else fp).view(-1, len(fp))
    return (allfp.max(0).values - allfp.min(0).values).max().item()


def out_of_time(t0: float, budget: float, device) -> bool:
    """--time-budget: True on every rank once `budget` s (0: never) have passed since t0 on any."""
    return budget > 0 and bool(all_ranks([time.time() - t0 >= budget], device, dist.ReduceOp.MAX)[0])


# ---- 7. The training loop around the method: its guards, work counters, FSDP2 ----
def micro_batches_per_update(n: int, micro_batch: int, updates: int,
                             samples: str = "samples per rank (prompts-per-step/ranks x group-size)") -> int:
    """Micro-batches per optimizer step for n samples per rank, `updates` steps; a UsageError unless both divide."""
    if n % micro_batch:
        raise UsageError(f"--micro-batch {micro_batch} must divide the {n} {samples}")
    if (n // micro_batch) % updates:
        raise UsageError(f"--updates-per-rollout {updates} must divide the {n // micro_batch} micro-batches per "
                         f"rank; change it or --micro-batch")
    return n // micro_batch // updates


def setup_training(args) -> Runtime:
    """Checks before a model loads what the flags' bounds (cli) do not, then those that depend on the ranks."""
    if args.lora_rank:
        check_flag("lora_alpha", args.lora_alpha, at_least=1e-12)
    check_model(args.model, args.model_path, args.reward)
    if args.wandb and importlib.util.find_spec("wandb") is None:
        raise UsageError("--wandb needs the wandb package: pip install wandb, or drop --wandb")
    rt = setup_runtime(args.seed, args.threads, args.dtype, args.model, args.compile)
    if args.prompts_per_step % rt.world_size:
        raise UsageError(f"--prompts-per-step {args.prompts_per_step} must be divisible by the {rt.world_size} ranks")
    if args.fsdp and (args.lora_rank or rt.world_size < 2):
        raise UsageError("--fsdp shards full fine-tuning over torchrun processes: pass --lora-rank 0 and "
                         "launch 2+ processes (a LoRA run replicates with DDP: drop --fsdp)")
    return rt


def check_model(name: str, path: str | None, reward: str | None = None):
    """Refuses, before anything loads, a --model-path without weights of --model `name` and a --reward that does not
    fit the model or whose files are not in the hub cache while offline."""
    from huggingface_hub import constants, try_to_load_from_cache
    names = {n for n, _ in parse_reward_spec(reward)} if reward is not None else set()
    if name != "toy" and names & {"toy", "toy-soft"}:
        raise UsageError(f"--reward {reward} scores the toy world's shapes, not {name} images: pass --model toy or "
                         f"another --reward")
    repo, configs = path or HUB_IDS.get(name), []
    if (path or "").startswith("random") and name != "toy":
        random_depth(path, name)
    elif name == "toy":
        root = Path(path) if path else ASSETS / "toy"
        if not (root / "transformer").is_dir():
            raise UsageError(f"no toy weights in {root} (transformer/): run `python tests/pretrain_toy.py --out "
                             f"{root}` or fix --model-path")
        repo, configs = root, [root / "transformer" / "config.json"]
    elif Path(repo).exists():
        if not (Path(repo) / "model_index.json").is_file():
            raise UsageError(f"--model-path {repo} is not a diffusers pipeline folder (no model_index.json): pass a "
                             f"folder saved with save_pretrained, a hub id, or random")
        configs = [Path(repo) / "model_index.json", Path(repo) / "transformer" / "config.json"]
    elif repo.startswith(("/", ".", "~")) or repo.count("/") != 1:
        raise UsageError(f"--model-path {repo} does not exist: pass a pipeline folder, a hub id (owner/name) or random")
    elif constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(repo, "model_index.json"), str):
        raise UsageError(f"the model repository {repo} is not in the hub cache and HF_HUB_OFFLINE is set: download it "
                         f"with `hf download {repo}`, or set HF_HUB_OFFLINE=0")
    for config in configs:
        with contextlib.suppress(OSError, ValueError, RecursionError):  # missing, not UTF-8, not JSON, nested too deep
            if isinstance(json.loads(config.read_text()), dict):
                continue
        raise UsageError(f"--model-path {repo}: {config} is missing or not a JSON object: save the pipeline again "
                         f"(save_pretrained) or download it again")
    check_scorer_files(names)


class TrainingLoop:
    """What a trainer's loop does around its method (the shared `loop` and `loop-end` blocks): the clock, evaluations,
    the log, checkpoints (--resume's loaded; a method's `extra_state`: name -> tensors), work counts, signal checks."""
    active: TrainingLoop | None = None  # the loop of the run under way in this process

    def __init__(self, args, run: Run, rt: Runtime, adapter, params: list, optimizer, ema: EMA | None,
                 eval_prompts: list[dict], reward_fn, guard: StepGuard | None = None, extra_state: dict | None = None):
        self.args, self.run, self.rt, self.adapter, self.params = args, run, rt, adapter, params
        self.guard = guard or StepGuard.last or StepGuard(args.max_bad_steps, rt.device, rt.dtype == torch.float16)
        self.optimizer, self.ema, self.scaler, self.extra_state = optimizer, ema, self.guard.scaler, extra_state
        self.eval_prompts, self.reward_fn = eval_prompts, reward_fn
        elapsed = load_checkpoint(run.checkpoint, params, optimizer, ema, extra_state, self.scaler) \
            if run.checkpoint else 0.0
        args_file = run.dir / "args.json"  # the run's first writes, every check passed and the checkpoint loaded:
        if rt.is_main and (run.checkpoint is not None or args_file.exists()):  # a restart, or a checkpoint continued
            append_line(run.dir / "metrics.jsonl", {"resumed": {"from_iteration": run.start, "checkpoint": str(
                run.checkpoint.resolve()) if run.checkpoint else None, "args": run.config}})
        if rt.is_main and not args_file.exists():  # the first start
            write_atomic(args_file, own_json(run.config))
        self.t0, self.wandb = time.time() - elapsed, None
        if rt.is_main and args.wandb:
            import wandb
            self.wandb = wandb.init(project="flow-rl", config=dataclasses.asdict(args), name=run.dir.name)
        self.it, self.metrics, self.dirty = run.start, {}, False
        self.saved = run.start if (run.dir / "checkpoints" / f"iter_{run.start:06d}").exists() else None  # in place
        optimizer.register_step_pre_hook(lambda *_: setattr(self, "dirty", True))  # iteration self.it has stepped
        TrainingLoop.active, self.compiled = self, dict(COMPILING)

    def seconds(self) -> float:
        """Training seconds so far (the log's time_s)."""
        return time.time() - self.t0

    def save(self, iteration: int):
        """Checkpoints the state after `iteration` iterations (not finite: refused) unless it was saved last."""
        if iteration != self.saved:
            save_checkpoint(self.run.dir, iteration, self.adapter, self.params, self.args.lora_rank > 0, self.optimizer,
                            self.ema, self.seconds(), self.run.meta, self.rt, self.extra_state, self.scaler)
        self.saved = iteration

    def each(self, items, count: str | None = None):
        """The items of a rollout or update loop, each after a check for SIGTERM / SIGINT on any rank (README, Fork a
        method); `count`: the loop's transformer rows without grad are logged under that key (nfe_anchor, say)."""
        before = work_snapshot(self.adapter, self.reward_fn, self.guard)
        for item in items:
            self.stop_if_signalled(self.it)
            yield item
        if count:
            self.metrics[count] = work_done(self.adapter, self.reward_fn, before, self.guard)["nfe_fwd"]

    def work(self) -> dict:
        """The work of the iteration so far, evaluation left out: nfe_fwd, nfe_fwd_bwd, decodes, reward_calls, ..."""
        return work_done(self.adapter, self.reward_fn, self.work_before, self.guard)

    def stop_if_signalled(self, it: int):
        """After SIGTERM / SIGINT on any rank: checkpoint the state at the start of iteration `it` (none before the
        run's first optimizer step) and stop; once the iteration has stepped, or in EMA.swapped_in, not yet."""
        signum = 0 if self.dirty or EMA.swapped else signalled(self.rt.device)
        if not signum:
            return
        name, code = signal.Signals(signum).name, 128 + signum
        if it == self.run.start:  # the state it started from
            raise self.unsaved(f"stopped by {name} before the first optimizer step", code)
        self.save(it)
        raise TrainingStopped(f"stopped by {name} at iteration {it}, checkpoint saved; continue with --resume "
                              f"{self.run.dir}", exit_code=code)

    def unsaved(self, what: str, exit_code: int) -> TrainingStopped:
        """The stop of a run that has not stepped since it started: nothing to save, the same command goes on."""
        start = self.run.checkpoint.name if self.run.checkpoint else "the untrained weights"
        return TrainingStopped(f"{what} since the start from {start}, so nothing was saved: rerun the same command to "
                               f"{'continue' if self.run.checkpoint else 'start'}", exit_code)

    def after_failure(self, e: Exception):
        """Ends a run that `e` stopped with a TrainingStopped saying what was kept: re-raised unless the weights are
        intact; then the iteration's starting state is checkpointed if it has not stepped, else the newest is named."""
        stopped = isinstance(e, TrainingStopped)
        if not (e.save_state if stopped else not self.rt.distributed):  # the weights are not intact
            raise e
        what, code = (str(e) if stopped else f"{type(e).__name__}: {e}"), getattr(e, "exit_code", 1)
        if not stopped:
            traceback.print_exception(e)
        if not self.dirty and self.it == self.run.start:  # the state it started from: nothing new to save
            signum = signalled(self.rt.device)
            raise self.unsaved(f"{what}; no optimizer step had run", 128 + signum if signum else code)
        if not self.dirty:
            self.stop_if_signalled(self.it)
            self.save(self.it)
            raise TrainingStopped(f"{what}; checkpoint iter_{self.it:06d} saved: continue with --resume {self.run.dir}",
                                  code)
        newest = newest_checkpoint(self.run.dir)
        raise TrainingStopped(f"{what}; iteration {self.it} had begun its update, so its state was not saved: " +
                              (f"the newest checkpoint is {newest.name}, continue with --resume {self.run.dir}"
                               if newest else "there is no checkpoint yet: start over in a new --output-dir"))

    def log(self, metrics: dict):
        """Rank 0: the line in metrics.jsonl (NaN, inf: null), on stdout above the progress bar, in W&B if asked."""
        if not self.rt.is_main:
            return
        if self.args.compile:  # --compile: the compiles since the last line and their seconds (README, Metrics)
            metrics.update({k: v - self.compiled[k] for k, v in COMPILING.items()})
            self.compiled = dict(COMPILING)
        metrics = {k: (None if not math.isfinite(v) else round(v, 6)) if isinstance(v, float) else v
                   for k, v in metrics.items()}
        append_line(self.run.dir / "metrics.jsonl", metrics)
        keys = ["reward_mean", "eval_reward", "eval_accuracy", "loss", "skipped_steps", "time_s"]
        with tqdm.external_write_mode():  # above the progress bar
            print0(f"it {metrics['iteration']:5d} " + " ".join(f"{k}={metrics[k]:.4g}" for k in keys
                                                              if isinstance(metrics.get(k), (int, float))))
        if self.wandb is not None:
            self.wandb.log(metrics, step=metrics["iteration"])

    def evaluate(self, it: int) -> dict:
        """Held-out evaluation (of the EMA weights, if kept) and its grid eval_NNNNNN.png, off the clock."""
        a, tic = self.args, time.time()
        self.adapter.transformer.eval()  # as the rollout: --compile's graphs are the same at every evaluation
        with self.ema.swapped_in() if self.ema else contextlib.nullcontext():
            res, rows = evaluate(self.adapter, self.adapter.transformer, self.eval_prompts, a.eval_images,
                                 a.eval_steps, self.reward_fn, self.rt, seed=a.seed,
                                 accuracy_fn=toy_accuracy if a.model == "toy" else None)
        if a.fsdp:  # FSDP2 keeps the root's weights gathered after a forward: the EMA's, stale once swapped back
            self.adapter.transformer.reshard()
        if self.rt.is_main:
            save_image_grid(rows, self.run.dir / f"eval_{it:06d}.png")
        self.t0 += time.time() - tic
        return res

    def begin(self, it: int) -> dict | None:
        """Starts iteration `it` (signal check, evaluation if due): its metrics, or None once the last is logged."""
        a, self.it, self.metrics, self.dirty = self.args, it, {"iteration": it}, False
        self.stop_if_signalled(it)
        balance_threads()
        last = it == a.iterations or out_of_time(self.t0, a.time_budget, self.rt.device)
        if a.eval_every and (it % a.eval_every == 0 or last):
            self.metrics.update(self.evaluate(it))
        self.work_before = work_snapshot(self.adapter, self.reward_fn, self.guard)
        if not last:
            return self.metrics
        if self.rt.distributed and not a.fsdp:
            self.metrics["rank_param_diff"] = rank_param_diff(self.params)
        self.metrics["time_s"] = self.seconds()
        self.log(self.metrics)
        return None

    def end(self, metrics: dict):
        """Logs the iteration's line and checkpoints every --save-every iterations."""
        metrics["time_s"] = self.seconds()
        self.log(metrics)
        done, a = self.it + 1, self.args
        if a.save_every and done % a.save_every == 0 and done < a.iterations:
            self.save(done)

    def finish(self) -> dict:
        """The final checkpoint; returns the last metrics line."""
        self.save(self.it)
        _release_folder()
        if self.wandb is not None:
            self.wandb.finish()
        return self.metrics


def finite(tensors, device) -> bool:
    """True if every tensor of `tensors` (nested lists and dicts; FSDP2: its local shard) is finite on every rank."""
    flags = [torch.isfinite(x.detach().to_local() if hasattr(x, "to_local") else x.detach()).all()
             for x in torch.utils._pytree.tree_leaves(tensors) if isinstance(x, torch.Tensor)]
    ok = bool(torch.stack([f.to(device) for f in flags]).all()) if flags else True  # one sync (AdamW's step: CPU)
    return bool(all_ranks([ok], device, dist.ReduceOp.MIN)[0])


def instrument(adapter):
    """Counts the transformer's rows with and without grad and the decodes in `adapter.counts` (README, Metrics)."""
    counts = adapter.counts = collections.Counter()

    def hook(module, args, kwargs, out):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        counts["nfe_fwd_bwd" if torch.is_grad_enabled() else "nfe_fwd"] += x.shape[0]

    adapter.transformer.register_forward_hook(hook, with_kwargs=True)
    adapter.decode = lambda x, decode=adapter.decode: counts.update(decodes=x.shape[0]) or decode(x)  # counted
    return adapter


def work_snapshot(adapter, reward_fn, guard) -> dict:
    """The work counted so far: adapter.counts, images scored, steps skipped."""
    return {**adapter.counts, "reward_calls": reward_fn.calls, "skipped_steps": guard.skipped}


def work_done(adapter, reward_fn, before: dict, guard) -> dict:
    """The work since `before` (a work_snapshot): of an iteration, or of a phase of it (a rollout's anchors)."""
    now = work_snapshot(adapter, reward_fn, guard)
    return {k: now.get(k, 0) - before.get(k, 0) for k in ("nfe_fwd", "nfe_fwd_bwd", "decodes", "reward_calls",
                                                           "skipped_steps")}


def transformer_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks: FLUX's double and single blocks, SD3's joint blocks (the toy's are FLUX's)."""
    return [b for name in ("transformer_blocks", "single_transformer_blocks") for b in getattr(transformer, name, [])]


def full_finetuning(transformer: torch.nn.Module, rt: Runtime, ref=None, shard: bool = False) -> list:
    """--lora-rank 0: float32 master weights, cast a block at a time, and `ref`'s (unsharded, its linear layers' in the
    compute dtype, as autocast casts the policy's: half the memory); `shard` (--fsdp): FSDP2 per block and root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=rt.dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    warnings.filterwarnings("ignore", "Mismatch dtype between input and weight")  # RMSNorm's float32 weight: unfused
    for module in (m for m in (transformer, ref) if m is not None):
        for block in transformer_blocks(module) + [module]:
            if module is transformer or not shard:  # what is not sharded yet: this block, or the root's own layers
                for q in (q for q in block.parameters() if not hasattr(q, "to_local")):
                    q.data = q.data.to(torch.float32)
            if shard:
                fully_shard(block, mp_policy=mp)
    for linear in (m for m in (ref.modules() if ref is not None and not shard else []) if type(m) is torch.nn.Linear):
        linear.weight.data = linear.weight.data.to(rt.dtype)
    return [q for q in transformer.parameters() if q.requires_grad]


# ---- 8. Run folders and checkpoints ----
@dataclasses.dataclass
class Run:
    """A run: folder, `meta` (what --resume must match), `config` (args.json), checkpoint (None: fresh), iteration."""
    dir: Path
    meta: dict
    config: dict
    checkpoint: Path | None = None
    start: int = 0


def prepare_run(args, rt: Runtime, trainer: str) -> Run:
    """Decides the run folder and the checkpoint --resume continues before any model loads, and claims the folder
    until the run ends (rank 0 decides; every rank gets its answer or its UsageError; README, Outputs and metrics)."""
    meta = {"trainer": trainer, **{k: getattr(args, k) for k in ("model", "lora_rank", "lora_alpha", "ema")}}
    try:
        run = _prepare_run(args, meta, rt.world_size) if rt.is_main else None
    except UsageError as e:
        run = e
    run = broadcast_object(run)
    if isinstance(run, UsageError):
        raise run
    return run


def _prepare_run(args, meta: dict, world_size: int) -> Run:
    output_dir, resume, checkpoint, start = args.output_dir, args.resume, None, 0
    if resume == "auto":
        if output_dir is None:
            raise UsageError("--resume auto continues the run in --output-dir: pass it on every restart")
        checkpoint = newest_checkpoint(Path(output_dir))
    elif resume:
        checkpoint = find_checkpoint(resume)
    if checkpoint is not None:
        start = check_checkpoint(checkpoint, meta, world_size)
        if start > args.iterations:
            raise UsageError(f"--resume {resume} is at iteration {start}, past --iterations {args.iterations}: raise "
                             f"--iterations")
    source = checkpoint.parent.parent if checkpoint is not None and checkpoint.parent.name == "checkpoints" else None
    run_dir = Path(output_dir) if output_dir is not None else source
    if run_dir is None:  # a new default folder, claimed by creating it: two runs started in one second get two folders
        writable_folder(Path("runs"), "--output-dir")  # a read-only working folder
        while True:
            run_dir = Path("runs") / f"{meta['trainer']}-{meta['model']}-{time.strftime('%Y%m%d-%H%M%S')}-" \
                                     f"{secrets.token_hex(3)}"
            with contextlib.suppress(FileExistsError):
                run_dir.mkdir(parents=True)
                break
    new = output_dir is None and source is None or not run_dir.exists()
    writable_folder(run_dir, "--output-dir")
    lock = _hold_folder(run_dir, new)
    with contextlib.suppress(ValueError):  # the identity of the run in run_dir, which a moved folder keeps
        meta["run"] = read_own_json(run_dir / "args.json").get("run")
    log = run_dir / "metrics.jsonl"  # a run is there: checkpoints/, or a logged line besides resume markers
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    if (run_dir / "checkpoints").is_dir() or any(line.strip() and not line.startswith('{"resumed"') for line in lines):
        if checkpoint is None and resume != "auto":
            raise UsageError(f"{run_dir} already holds a run: pass --resume {run_dir} to continue it, or a new "
                             f"--output-dir")
        if checkpoint is not None and (source is None or source.resolve() != run_dir.resolve()):
            raise UsageError(f"{run_dir} already holds another run: continue {checkpoint} in a new or empty "
                             f"--output-dir (nothing in {run_dir} is moved or deleted)")
        top = newest_checkpoint(run_dir, complete=False)  # past the start: an older checkpoint or an incomplete one
        if top is not None and top.name != getattr(checkpoint, "name", None):
            raise UsageError(f"{top} is past iteration {start}, where this run would start: move it out of "
                             f"{top.parent} if it is incomplete, else continue {checkpoint or 'the run'} in a new or "
                             f"empty --output-dir (nothing in {run_dir} is moved or deleted)")
        if checkpoint is not None:  # in place: the run's log begins with the lines it was saved after; its args.json
            info = checkpoint_info(checkpoint)
            if file_sha256(log, info["log_bytes"]) != info["log_sha256"]:
                raise not_written_here(checkpoint, f"{log} does not begin with the lines logged before it was saved "
                                                   f"(a copy's checkpoint, or an edited log)")
            meta["run"] = run_settings(checkpoint, info, f"continue {checkpoint} in a new --output-dir")["run"]
    meta["run"] = meta.get("run") or secrets.token_hex(8)
    os.ftruncate(lock, 0)
    os.write(lock, f"{os.getpid()} {socket.gethostname()}\n".encode())
    for stale in (run_dir / "checkpoints").glob(".tmp-*"):  # left by a write that was killed
        shutil.rmtree(stale, ignore_errors=True)
    return Run(run_dir, meta, {**dataclasses.asdict(args), "run": meta["run"]}, checkpoint, start)


def writable_folder(folder: Path, flag: str):
    """Makes `folder` if need be and probes that a file can be written there; a UsageError names `flag`."""
    import tempfile
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder, buffering=0) as probe:  # never left behind, even if the write fails
            probe.write(b"ok")
    except OSError as e:
        raise UsageError(f"cannot write to {flag} {folder} ({e.strerror or e}): pass a writable folder") from None


_HELD = []  # (the open .lock of the run folder this process holds, the folder if this process made it)


def _hold_folder(run_dir: Path, new: bool) -> int:
    """Locks run_dir until released (flock on .lock: a regular file, never a followed link, naming the holder's pid and
    host); one held elsewhere is refused. A `new` folder goes when released empty (a refusal leaves no folder)."""
    import fcntl
    _release_folder()
    path = run_dir / ".lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise IsADirectoryError(21, "not a regular file")
    except OSError as e:  # a link (ELOOP), a folder (EISDIR) or anything else in the lock's place
        raise UsageError(f"{path} is not the run's lock file ({e.strerror or e}): remove it, or pass another "
                         f"--output-dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 300).decode(errors="replace").split() or ["?", "?"]
        os.close(fd)
        raise UsageError(f"{run_dir} is in use by another run (pid {holder[0]} on host {holder[-1]}): wait for it to "
                         f"end or stop it, or pass another --output-dir") from None
    _HELD.append((fd, run_dir if new else None))
    return fd


def _release_folder():
    while _HELD:
        fd, made = _HELD.pop()
        with contextlib.suppress(OSError):  # a folder it made that holds only its lock
            made and [p.name for p in made.iterdir()] == [".lock"] and ((made / ".lock").unlink() or made.rmdir())
        os.close(fd)


def find_checkpoint(path: str, flag: str = "--resume") -> Path:
    """A checkpoint folder, or a run folder's newest complete checkpoint (`latest` is for people: it is not read)."""
    p = newest_checkpoint(Path(path)) or Path(path)
    if not (p / "checkpoint.json").is_file():
        raise UsageError(f"{flag} {path}: no checkpoint there; pass a run folder or one of its "
                         f"checkpoints/iter_* folders")
    return p


def newest_checkpoint(run_dir: Path, complete: bool = True) -> Path | None:
    """A run folder's highest-numbered checkpoints/iter_N with a checkpoint.json (complete=False: or not), or None."""
    found = [p for p in (run_dir / "checkpoints").glob("iter_*") if p.name[5:].isascii() and p.name[5:].isdigit()
             and (p / "checkpoint.json").is_file() >= complete]
    return max(found, key=lambda p: int(p.name[5:]), default=None)


def own_json(record: dict) -> str:
    """`record` as JSON with its sha256, so that read_own_json tells a file edited, damaged or written by other code."""
    return json.dumps({**record, "sha256": _sha256(record)}, indent=2)


def _sha256(record) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def file_sha256(path: Path, size: int = -1) -> str:
    """The sha256 of a file's first `size` bytes (-1: all of it), else what is wrong, which no sha256 equals."""
    try:
        if not path.is_file():  # missing, a folder, a FIFO (whose read would wait)
            raise OSError(f"{path.name} is not a regular file")
        with open(path, "rb") as f:
            return hashlib.file_digest(io.BytesIO(f.read(size)) if size >= 0 else f, "sha256").hexdigest()
    except OSError as e:
        return one_line(e)


# What this code reads back from its own JSON files: key -> the types (or values) it may hold, or an int's range.
NUMBER, TEXT, FLAG, COUNT = (int, float), (str,), (bool,), range(1, 2**31)
CHECKPOINT_KEYS = {"trainer": TEXT, "model": TEXT, "run": TEXT, "lora_rank": range(4097), "lora_alpha": NUMBER,
                   "ema": FLAG, "iteration": range(10**9 + 1), "elapsed": NUMBER, "world_size": COUNT,
                   "optimizer_stepped": FLAG, "tensors": COUNT, "loss_scale": FLAG, "files": (dict,),
                   "log_bytes": range(2**63), "log_sha256": TEXT}
PUBLISHED = {True: ["pytorch_lora_weights.safetensors"],  # a checkpoint's published weights: LoRA (True) or full
             False: ["transformer/config.json", "transformer/diffusion_pytorch_model.safetensors"]}
ARGS_KEYS = {"run": TEXT, "model_path": (str, None), "reward": TEXT, "prompts": (str, None), "dtype": (None, *DTYPES),
             "eval_images": (int,), "eval_steps": (int,), "seed": (int,), "resolution": (int, None),
             "guidance_scale": (*NUMBER, None), "max_sequence_length": (int, None)}  # those evaluate reads


def read_own_json(path: Path, keys: dict | None = None) -> dict:
    """The record own_json wrote to `path`, its `keys` holding what they may, else a ValueError saying what failed."""
    try:
        if path.exists() and not path.is_file():  # a FIFO would block
            raise OSError(f"{path.name} is not a regular file")
        record = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # missing, not UTF-8, not JSON, nested too deep
        raise ValueError(f"does not read ({one_line(e)})") from None
    if not isinstance(record, dict):
        raise ValueError(f"is a JSON {type(record).__name__}, not an object")
    digest = record.pop("sha256", None)
    if digest != _sha256(record):
        raise ValueError("does not match its sha256 (edited or damaged)" if digest else "has no sha256")
    for key, allowed in (keys or {}).items():  # signed again after an edit, or by other code
        value = record.get(key)
        if not (type(value) is int and value in allowed if isinstance(allowed, range) else type(value) in allowed or
                value in allowed) or type(value) in NUMBER and not 0 <= value < math.inf:  # numbers finite, >= 0
            raise ValueError(f"holds {key} {value!r}, not a value this code writes")
    return record


def not_written_here(checkpoint: Path, why: str) -> UsageError:
    """The one refusal of a checkpoint this code did not write, or that was changed since."""
    return UsageError(f"{checkpoint} is not a checkpoint this code wrote: {why}; pass another checkpoint, or resume "
                      f"from an earlier one in a new --output-dir")


def checkpoint_info(checkpoint: Path) -> dict:
    """A checkpoint's checkpoint.json as save_checkpoint wrote it, in its iteration's folder, its digest naming the
    files a save writes (state/: DCP's, one a rank; the published weights), else not_written_here."""
    try:
        info = read_own_json(checkpoint / "checkpoint.json", CHECKPOINT_KEYS)
        if checkpoint.name != f"iter_{info['iteration']:06d}":
            raise ValueError(f"names iteration {info['iteration']}, not that of its folder's name")
        files = {"state/.metadata", *PUBLISHED[info["lora_rank"] > 0], *(f"state/__{r}_0.distcp" for r in range(
            info["world_size"]))}
        if set(info["files"]) != files or not all(type(h) is str and len(h) == 64 and h.isalnum() for h in info[
                "files"].values()):  # a sha256 each, not what file_sha256 says of a file it cannot read
            raise ValueError("holds a digest that does not name the files a save writes, each by its sha256")
        return info
    except ValueError as e:
        raise not_written_here(checkpoint, f"checkpoint.json {e}") from None


def check_checkpoint(checkpoint: Path, meta: dict, world_size: int) -> int:
    """Refuses a checkpoint of another trainer or flags than `meta`, naming each; notes new ranks; its iteration."""
    info = checkpoint_info(checkpoint)
    differ = [k for k in meta if info[k] != meta[k] and (k != "lora_alpha" or meta["lora_rank"])]
    if differ:  # what to pass: the trainer's file, --ema / --no-ema, --flag value
        flags = [f"{info[k]}.py" if k == "trainer" else f"--{'' if info[k] else 'no-'}{k}" if isinstance(info[k], bool)
                 else f"--{k.replace('_', '-')} {info[k]}" for k in differ]
        raise UsageError(f"checkpoint {checkpoint} was trained with {', '.join(f'{k} {info[k]}' for k in differ)}, "
                         f"this run has {', '.join(f'{k} {meta[k]}' for k in differ)}: resume with the same trainer "
                         f"and flags ({' '.join(flags)})")
    if info["world_size"] != world_size:
        print0(f"checkpoint {checkpoint.name} was trained on {info['world_size']} ranks and this run has "
               f"{world_size}: each rank now takes 1/{world_size} of --prompts-per-step with its own seeds, so the "
               f"run continues from the same state but its rollouts differ from those of an unbroken "
               f"{info['world_size']}-rank run")
    return info["iteration"]


def one_line(e: BaseException) -> str:
    """An exception's type and first message line (of a torch.distributed.checkpoint failure, the first rank's)."""
    e = next(iter(getattr(e, "failures", {}).values()), e)   # CheckpointException: {rank: WrappedException}
    e = getattr(e, "exc", e)
    e = e[0] if isinstance(e, tuple) else e                   # (exception, its frames)
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


def training_state(params: list, optimizer, ema: EMA | None, extra_state: dict | None = None, scaler=None) -> dict:
    """What torch.distributed.checkpoint saves and loads in place, in either layout (plain tensors or FSDP2 shards):
    trainable tensors by position, their AdamW state (if stepped), the EMA's shadow, `extra_state`, the GradScaler."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    holder = torch.nn.ParameterList(params)
    state = {"params": get_model_state_dict(holder),
             "optimizer": get_optimizer_state_dict(holder, optimizer) if optimizer is not None else None,
             "ema": {str(i): s for i, s in enumerate(ema.shadow)} if ema is not None else None,
             "extra": extra_state or None, "scaler": scaler}  # a Stateful: DCP calls state_dict(), load_state_dict()
    return {k: v for k, v in state.items() if v is not None}


def save_checkpoint(run_dir: Path, iteration: int, adapter, params: list, lora: bool, optimizer, ema: EMA | None,
                    elapsed: float, meta: dict, rt: Runtime, extra_state: dict | None = None, scaler=None) -> Path:
    """Writes run_dir/checkpoints/iter_NNNNNN on every rank, whole or not at all, never over one there (README): the
    published weights (the EMA's if kept), state/, checkpoint.json; none if not finite or a rank fails."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    final = Path(run_dir) / "checkpoints" / f"iter_{iteration:06d}"
    if not finite([params, ema and ema.shadow, optimizer and optimizer.state, extra_state], rt.device):
        raise TrainingStopped(f"the weights after iteration {iteration} are not finite and were not saved: "
                              f"--resume {run_dir} with a smaller --lr")
    if broadcast_object(final.exists()):  # a save never replaces a folder
        raise TrainingStopped(f"{final} is already there, so iteration {iteration} was not saved: move it out of "
                              f"{final.parent} and --resume {run_dir}")
    kept, token = newest_checkpoint(run_dir), broadcast_object(secrets.token_hex(8))
    folder = final.parent / f".tmp-{final.name}-{token}"
    sharded, stepped, error = any(hasattr(q, "to_local") for q in params), bool(optimizer.state), None
    try:
        if rt.is_main:
            folder.mkdir(parents=True)
    except OSError as e:
        error = one_line(e)
    if all_ranks([error is None], rt.device, dist.ReduceOp.MIN)[0]:
        try:
            state = training_state(params, optimizer if stepped else None, ema, extra_state, scaler)
            single_process(dcp.save, state, folder / "state")
            with ema.swapped_in() if ema is not None else contextlib.nullcontext():
                if rt.is_main and lora:
                    from peft.utils import get_peft_model_state_dict
                    adapter.save_lora(folder, get_peft_model_state_dict(adapter.transformer))
                elif not lora:  # FSDP2 (collective): rank 0 gets the whole transformer
                    weights = get_model_state_dict(adapter.transformer, options=StateDictOptions(
                        full_state_dict=True, cpu_offload=True)) if sharded else adapter.transformer.state_dict()
                    if rt.is_main:  # float32 master weights, published as the base model loads
                        _save_transformer(adapter.transformer, weights, folder / "transformer", adapter.weights_dtype)
            digest = checkpoint_digest(folder)  # every file written, hashed once
            if rt.is_main:
                for path in folder.rglob("*.safetensors"):  # safetensors writes 0600: the umask's mode, as the folder's
                    path.chmod(stat.S_IMODE(folder.stat().st_mode) & 0o666)
                log = Path(run_dir) / "metrics.jsonl"  # the lines logged so far, which a resume in place extends
                info = {**meta, "iteration": iteration, "elapsed": elapsed, "world_size": rt.world_size,
                        "optimizer_stepped": stepped, "tensors": len(params), "loss_scale": scaler is not None,
                        "files": digest, "log_bytes": log.stat().st_size, "log_sha256": file_sha256(log)}
                (folder / "checkpoint.json").write_text(own_json(info))
        except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - a full disk: OSError, SafetensorError...
            error = one_line(e)
    if not all_ranks([error is None], rt.device, dist.ReduceOp.MIN)[0]:  # a failure on any rank stops every rank
        if rt.is_main:
            shutil.rmtree(folder, ignore_errors=True)
        raise TrainingStopped(f"could not write the checkpoint of iteration {iteration} to {final.parent}, whose "
                              f"newest kept is {kept.name if kept else 'none'} ({error or 'on another rank'}); free "
                              f"disk space or pass another --output-dir and --resume the last checkpoint there")
    if rt.is_main:
        os.replace(folder, final)
        write_atomic(final.parent / "latest", final.name)
    if dist.is_initialized():
        dist.barrier()
    return final


def checkpoint_digest(folder: Path, names: list[str] | None = None, info: dict | None = None) -> dict:
    """{path: sha256} of a checkpoint's files, hashed by the ranks in shares (a save: each the files it wrote; a load:
    every ranks-th of `names`); with `info`, a file not the one its checkpoint.json names is not_written_here."""
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = names[rank::ranks] if names is not None else sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                                                               if p.is_file() and p.name.startswith(f"__{rank}_")
                                                               or not rank and p.is_file() and p.name[:2] != "__")
    digest = {name: file_sha256(folder / name) for name in mine}
    parts = [None] * ranks if dist.is_initialized() else [digest]
    if dist.is_initialized():
        dist.all_gather_object(parts, digest)
    digest = {name: h for part in parts for name, h in part.items()}
    for name in (name for name in names or () if info is not None and digest[name] != info["files"][name]):
        raise not_written_here(folder, f"{name} is not the file its checkpoint.json's digest names (changed since, or "
                               f"another's)")
    return digest


def single_process(save_or_load, state: dict, folder: Path):
    """dcp.save or dcp.load of `state` in `folder`; in one process told so (no_dist), which DCP warns of anyway. The
    tracebacks DCP logs (on the root logger) for a metadata file it cannot read are dropped: its error says it."""
    one, root, drop = not dist.is_initialized(), logging.getLogger(), lambda record: False
    with warnings.catch_warnings():
        if one:
            warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        root.addFilter(drop)
        try:
            return save_or_load(state, checkpoint_id=folder, no_dist=one)
        finally:
            root.removeFilter(drop)


def _save_transformer(model: torch.nn.Module, weights: dict, folder: Path, dtype: torch.dtype):
    """save_pretrained's files from a full state dict (FSDP2's too: the original class's config), in `dtype`."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True)
    original = next(c for c in type(model).__mro__ if "FSDP" not in c.__name__ and hasattr(c, "from_pretrained"))
    config = {"_class_name": original.__name__, **{k: v for k, v in model.config.items() if not k.startswith("_")}}
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=list))
    save_file({k: v.to("cpu", dtype).contiguous() for k, v in weights.items()},
              folder / "diffusion_pytorch_model.safetensors")


def load_checkpoint(checkpoint: Path, params: list, optimizer, ema: EMA | None, extra_state: dict | None = None,
                    scaler=None) -> float:
    """Restores what training_state names in place from state/ (else not_written_here); returns the training seconds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    info = checkpoint_info(checkpoint)
    optimizer = optimizer if info["optimizer_stepped"] else None  # no AdamW state saved: it stays fresh
    scaler = scaler if info["loss_scale"] else None               # none saved (another --dtype): it starts fresh
    state = training_state(params, optimizer, ema, extra_state, scaler)
    fresh = scaler.state_dict() if scaler is not None else {}
    checkpoint_digest(checkpoint, sorted(info["files"]), info)  # before a byte is loaded
    try:
        if info["tensors"] != len(params):  # DCP loads a subset without complaint: fewer would take the first ones
            raise ValueError(f"it holds {info['tensors']} trainable tensors and this model {len(params)}")
        saved = dcp.FileSystemReader(checkpoint / "state").read_metadata().state_dict_metadata  # nothing left unread
        if (saved := sorted({k.split(".")[0] for k in saved})) != sorted({*state, *["scaler"] * info["loss_scale"]}):
            raise ValueError(f"it holds {', '.join(saved)}, not what checkpoint.json and this run name")
        single_process(dcp.load, state, checkpoint / "state")
        steps = [float(s["step"]) for s in state.get("optimizer", {}).get("state", {}).values() if "step" in s]
        now = scaler.state_dict() if scaler is not None else {}  # a fresh GradScaler's settings, a scale in (0, inf)
        if not finite(state, params[0].device) or any(s < 0 or s % 1 for s in steps) or now and not (0 < now.pop(
                "scale") < math.inf and 0 <= now.pop("_growth_tracker") < now["growth_interval"] and now == {
                k: fresh[k] for k in now}):
            raise ValueError("not finite, or an optimizer step or loss scaling this code does not write")
        if optimizer is not None:
            set_optimizer_state_dict(torch.nn.ParameterList(params), optimizer, state["optimizer"])
    except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - missing, truncated, another model's
        raise not_written_here(checkpoint, f"state/ does not load ({one_line(e)})") from None
    return float(info["elapsed"])


# ---- 9. Logging (TrainingLoop.log) and labelled image grids ----
def append_line(path: Path, record: dict):
    """Appends `record` as one strict JSON line, after ending a line a kill cut short; a failed write is undone."""
    line = json.dumps(record, allow_nan=False).encode() + b"\n"
    if path.exists() and not path.is_file():  # a FIFO or a folder in its place
        raise write_failed(path, OSError(f"{path.name} is not a regular file"))
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        if end and os.pread(fd, 1, end - 1) != b"\n":
            line = b"\n" + line
        try:
            while line:
                line = line[os.write(fd, line):]
        except OSError as e:
            os.ftruncate(fd, end)
            raise write_failed(path, e) from None
    finally:
        os.close(fd)


def write_atomic(path: Path, data: str | bytes):
    """Writes `path` complete or not at all (a temporary file renamed into place); a failure stops the run."""
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_failed(path, e) from None


def write_failed(path: Path, e: OSError) -> TrainingStopped:
    return TrainingStopped(f"could not write {path} ({e.strerror or e}): free disk space, then --resume the run from "
                           f"its last checkpoint (evaluate: run it again)")


def save_image_grid(rows: list[tuple[str, torch.Tensor]], path: Path, groups: list[str] | None = None):
    """One PNG: a row per prompt (on its left) of its images ((n, 3, H, W) in [0, 1]) in equal `groups` (titles)."""
    from PIL import Image, ImageDraw, ImageFont
    if not rows:
        return
    h, w = rows[0][1].shape[-2:]
    th = h * max(1, 128 // h) if h < 128 else min(h, 256)       # tile size
    tw, pad, label_w, top = round(w * th / h), 4, 200, 20 if groups else 0
    cols = max(len(images) for _, images in rows)
    per_group = math.ceil(cols / len(groups)) if groups else cols

    def x_of(c):  # a column's left edge: a wider gap between groups
        return label_w + pad + c * (tw + pad) + (c // per_group) * 4 * pad

    canvas = Image.new("RGB", (x_of(cols - 1) + tw + pad, top + len(rows) * (th + pad) + pad), "white")
    draw, font, resample = ImageDraw.Draw(canvas), ImageFont.load_default(), Image.NEAREST if th >= h else Image.BICUBIC
    for g, title in enumerate(groups or []):
        draw.text((x_of(g * per_group), 4), title, fill="black", font=font)
    for r, (prompt, images) in enumerate(rows):
        y = top + r * (th + pad) + pad
        draw.multiline_text((pad, y), "\n".join(textwrap.wrap(prompt, 32)[:th // 12]), fill="black", font=font)
        for c, im in enumerate(_to_uint8(images).permute(0, 2, 3, 1).numpy()):
            canvas.paste(Image.fromarray(im).resize((tw, th), resample), (x_of(c), y))
    canvas.save(buf := io.BytesIO(), format="PNG")
    write_atomic(path, buf.getvalue())


def _to_uint8(images: torch.Tensor) -> torch.Tensor:
    return (images.detach().float().nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8).cpu()


# ---- 10. Evaluation, also from the command line (`python common.py evaluate`) ----
@torch.no_grad()
def evaluate(adapter, net, records: list[dict], num_images: int, steps: int, reward_fn, runtime: Runtime,
             seed: int = 0, batch_size: int = 16, accuracy_fn=None, grid: tuple[int, int] = (16, 8)):
    """Held-out ODE evaluation split over ranks, image i with prompt i mod len(records) and noise of (seed, i) for any
    ranks or batch size: (metrics (README, Metrics), the grid's rows [(prompt, images (n, 3, H, W))])."""
    sigmas, names = adapter.sigmas(steps), list(reward_fn.weights)
    mine = list(range(runtime.rank, num_images, runtime.world_size))
    P, (max_rows, max_cols) = len(records), grid
    shown = {i for i in range(min(num_images, P * max_cols)) if i % P < max_rows}
    scores, kept = {}, {}  # image index -> [weighted sum, *scorers, accuracy]; image index -> uint8 image for the grid
    batches = range(0, -(-num_images // runtime.world_size), batch_size)  # as many batches on every rank (FSDP)
    with tqdm(batches, desc="evaluate", leave=True, disable=not runtime.is_main) as bar:
        for i in bar:
            balance_threads()
            chunk = mine[i: i + batch_size]  # none on a rank with one image fewer: a batch that counts nothing, so
            recs = [records[j % P] for j in chunk or [0]]  # that every rank makes the same collective calls (FSDP's
            prompts = [r["prompt"] for r in recs]  # forwards, the reward's error check)
            x = torch.cat([adapter.noise(1, make_generator(seed, j)) for j in chunk]) if chunk else adapter.noise(1)
            imgs = adapter.decode(sample_ode(adapter, net, adapter.encode(prompts), x, sigmas))
            total, parts = reward_fn(imgs, prompts, recs)
            if not chunk:
                continue
            accuracy = accuracy_fn(imgs, prompts) if accuracy_fn else torch.zeros(len(chunk))
            columns = torch.stack([total, *[parts[n] for n in names], accuracy.to(total.device).float()], 1)
            scores.update(zip(chunk, columns.double().cpu().tolist()))
            kept.update({j: im for j, im in zip(chunk, _to_uint8(imgs)) if j in shown})
    if dist.is_initialized():
        gathered = [None] * runtime.world_size
        dist.all_gather_object(gathered, (scores, kept))
        scores = {j: v for part, _ in gathered for j, v in part.items()}
        kept = {j: im for _, part in gathered for j, im in part.items()}
    table = np.array([scores[j] for j in sorted(scores)])  # (images, columns), float64, in image order
    out = {}
    for c, key in enumerate(["reward"] + [short_reward_name(name) for name in names]):
        out[f"eval_{key}"] = float(table[:, c].mean())
        out[f"eval_{key}_se"] = float(table[:, c].std(ddof=1) / math.sqrt(len(table))) if len(table) > 1 else 0.0
    if accuracy_fn is not None:
        out["eval_accuracy"] = float(table[:, -1].mean())
    rows = [(records[r]["prompt"], torch.stack([kept[j] for j in sorted(kept) if j % P == r]).float() / 255)
            for r in range(min(P, max_rows)) if any(j % P == r for j in kept)]
    return out, rows


# What `common.py evaluate` uses for the base model when no trained run says otherwise: the trainers' (reward, steps).
EVAL_DEFAULTS = {"toy": ("toy", 20), "flux": ("pickscore", 28), "sd3": ("pickscore", 40), "flux2": ("pickscore", 50)}
# Its numeric flags -> (at least, at most), the trainers' bounds (images: --eval-images, steps: --eval-steps).
EVAL_BOUNDS = {"images": (1, 100_000), "steps": (1, 1000), "seed": (0, 2**63 - 1), "resolution": (16, 4096),
               "guidance_scale": (0, None), "max_sequence_length": (1, 512), "threads": (1, 1024),
               "batch_size": (1, None)}


def evaluate_main(argv=None) -> dict:
    """`python common.py evaluate`: scores the base model or trained checkpoints on held-out prompts as the trainers
    evaluate, prints each reward's mean +- standard error, writes results.json and grid.png. Works under torchrun."""
    ap = Parser(prog="common.py evaluate", description=evaluate_main.__doc__)
    ap.add_argument("--checkpoint", action="append", default=[], help="a run folder (its latest checkpoint), a "
                    "checkpoints/iter_* folder, or base (untrained); twice to compare two (default: base)")
    ap.add_argument("--model", choices=MODELS, help="default: the checkpoint's")
    ap.add_argument("--model-path", help="default: the run's")
    ap.add_argument("--reward", help="as the trainers' --reward (default: the run's)")
    ap.add_argument("--prompts", help="as the trainers' --prompts, its held-out split scored (default: the run's)")
    ap.add_argument("--all-prompts", action="store_true", help="score the training prompts too (all of a file or set)")
    ap.add_argument("--images", type=int, help="images in all, prompts cycling (default: the run's --eval-images)")
    ap.add_argument("--steps", type=int, help="ODE steps (default: the run's --eval-steps)")
    ap.add_argument("--seed", type=int, help="image i's noise is seeded by (seed, i) (default: the run's)")
    for flag, kind in [("--resolution", int), ("--guidance-scale", float), ("--max-sequence-length", int)]:
        ap.add_argument(flag, type=kind, help="default: the run's, else the model's")
    ap.add_argument("--dtype", choices=list(DTYPES), help="as the trainers' --dtype (default: the run's)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--compile", action="store_true", help="as the trainers' --compile")
    ap.add_argument("--threads", type=int, help="CPU threads (CPU runs only; default: as the trainers')")
    ap.add_argument("--output", help="a new folder for results.json and grid.png (default: evals/<model>-<time>)")
    with ends_process(), one_line_errors(ap.prog), contextlib.ExitStack() as on_exit:
        return _evaluate_main(ap.parse_args(argv), on_exit)


def _evaluate_main(a, on_exit: contextlib.ExitStack) -> dict:
    if len(a.checkpoint) > 2:
        raise UsageError("--checkpoint compares at most two models side by side")
    entries = []  # (label, checkpoint folder or None, its checkpoint.json, its run's args.json)
    for spec in a.checkpoint or ["base"]:
        checkpoint = None if spec == "base" else find_checkpoint(spec, "--checkpoint")
        info = checkpoint_info(checkpoint) if checkpoint else {}
        entries.append((spec, checkpoint, info, run_settings(checkpoint, info) if checkpoint else {}))
    if len(entries) == 2 and len({checkpoint and checkpoint.resolve() for _, checkpoint, _, _ in entries}) == 1:
        raise UsageError(f"--checkpoint {a.checkpoint[0]} and --checkpoint {a.checkpoint[1]} are the same model: pass "
                         f"two different ones")
    run = next((config for _, ckpt, _, config in entries if ckpt is not None), {})
    models = {info["model"] for _, ckpt, info, _ in entries if ckpt is not None} | ({a.model} if a.model else set())
    if len(models) > 1:
        raise UsageError(f"the checkpoints and --model name different models ({', '.join(sorted(models))}): "
                         f"compare models of one base")
    if not models:
        raise UsageError("pass --model for the base model, or --checkpoint with a trained run")
    model = models.pop()

    def pick(flag, fallback=None):  # the flag, else the run's setting (args.json), else `fallback`
        value = getattr(a, flag)
        return value if value is not None else run.get({"images": "eval_images", "steps": "eval_steps"}.get(
            flag, flag), fallback)
    reward_spec = pick("reward", EVAL_DEFAULTS[model][0])
    steps = pick("steps", distilled_defaults(model, pick("model_path")).get("eval_steps", EVAL_DEFAULTS[model][1]))
    images, seed, dtype = pick("images", 64), pick("seed", 0), pick("dtype")
    for flag, (low, high) in EVAL_BOUNDS.items():
        check_flag(flag, pick(flag), low, high)
    check_model(model, pick("model_path"), reward_spec)
    train, held_out = load_prompts(pick("prompts"), model)
    records = list({id(r): r for r in train + held_out}.values()) if a.all_prompts else held_out
    out_dir = Path(a.output or Path("evals") / f"{model}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):  # every rank, before a model loads
        raise UsageError(f"--output {out_dir} is {'not empty' if out_dir.is_dir() else 'a file'}: pass a new "
                         f"folder (nothing is overwritten)")
    rt = setup_runtime(seed, a.threads, dtype, model, a.compile)  # checks torchrun's env
    if not out_dir.exists() and rt.is_main:  # removed if it stays empty (a full disk, a refusal after a model loads)
        on_exit.callback(lambda: out_dir.is_dir() and (next(out_dir.iterdir(), None) or out_dir.rmdir()))
    writable_folder(out_dir, "--output")
    reward_fn, results, rows = WeightedReward(parse_reward_spec(reward_spec), rt.device), {}, []
    for label, checkpoint, info, _ in entries:
        adapter = load_model(model, rt, pick("model_path"), pick("resolution"), pick("guidance_scale"),
                             pick("max_sequence_length"))
        if checkpoint is not None:
            load_trained_weights(adapter, checkpoint, info)
        adapter.transformer.eval()
        results[label], grid = evaluate(adapter, adapter.transformer, records, images, steps, reward_fn, rt, seed=seed,
                                        batch_size=a.batch_size, accuracy_fn=toy_accuracy if model == "toy" else None)
        rows.append(grid)
        del adapter
    if rt.is_main:
        names = ["reward"] + [short_reward_name(n) for n in reward_fn.weights]
        print0(f"{model}, {images} images of {len(records)} prompts, {steps} ODE steps, seed {seed}, "
               f"reward {reward_spec}")
        for label, m in results.items():
            for name in names:
                print0(f"  {label:<40} {name:<20} {m[f'eval_{name}']:.4f} +- {m[f'eval_{name}_se']:.4f}")
            if "eval_accuracy" in m:
                print0(f"  {label:<40} {'accuracy':<20} {m['eval_accuracy']:.4f}")
        summary = {"model": model, "reward": reward_spec, "prompts": pick("prompts"), "all_prompts": a.all_prompts,
                   "checkpoints": {label: ckpt and str(ckpt.resolve()) for label, ckpt, _, _ in entries},
                   "prompt_count": len(records), "images": images, "steps": steps, "seed": seed, "results": results}
        write_atomic(out_dir / "results.json", json.dumps(summary, indent=2))
        merged = [(prompt, torch.cat([r[i][1] for r in rows])) for i, (prompt, _) in enumerate(rows[0])]
        save_image_grid(merged, out_dir / "grid.png", groups=list(results) if len(rows) > 1 else None)
        print0(f"wrote {out_dir / 'results.json'} and {out_dir / 'grid.png'}")
    return results


def run_settings(checkpoint: Path, info: dict, fix: str | None = None) -> dict:
    """The args.json of a checkpoint's run as its trainer wrote it, with the checkpoint's run identity, else one refusal
    naming it and `fix`; without a fix (evaluate), none there is {} and the fix is to pass the settings as flags."""
    path = checkpoint.parent.parent / "args.json"
    if fix is None and not path.exists():
        return {}
    try:
        record = read_own_json(path, ARGS_KEYS)
        if record["run"] != info["run"]:
            raise ValueError("is another run's (not the run identity of its checkpoints)")
        return record
    except ValueError as e:
        fix = fix or "move it aside and pass the run's settings as flags (--model-path, --reward, --steps, ...)"
        raise UsageError(f"{path} is not a run's args.json this code wrote: it {e}; {fix}") from None


def load_trained_weights(adapter, checkpoint: Path, info: dict):
    """Loads a checkpoint's published weights (the EMA's if kept) into adapter.transformer, else not_written_here."""
    from safetensors.torch import load_file
    lora = info["lora_rank"] > 0
    checkpoint_digest(checkpoint, PUBLISHED[lora], info)
    path = checkpoint / ("pytorch_lora_weights.safetensors" if lora else "transformer")
    try:  # an edited transformer/config.json: another architecture, whose weights do not fit
        weights = load_file(path) if lora else type(adapter.transformer).from_pretrained(path).state_dict()
        lora or adapter.transformer.load_state_dict(weights)
    except Exception as e:  # noqa: BLE001 - safetensors, diffusers and torch raise many kinds for a damaged file
        raise not_written_here(checkpoint, f"{path.name} does not load ({one_line(e)})") from None
    if not lora:
        return
    from peft import set_peft_model_state_dict
    add_lora(adapter.transformer, info["lora_rank"], info["lora_alpha"], adapter.lora_targets)
    result = set_peft_model_state_dict(adapter.transformer, {k.removeprefix("transformer."): v
                                                            for k, v in weights.items()})
    if result.unexpected_keys:
        raise UsageError(f"checkpoint {checkpoint}'s LoRA does not fit this model (e.g. "
                         f"{result.unexpected_keys[0]}): pass the --model-path it was trained on")


# ---- 11. Preflight (--preflight): one iteration of the trainer's main, judged by what it leaves; the run's cost ----
PROMPT_SE = 2.0                      # right prompts must beat shifted ones by this many standard errors
PROMPT_FREE = {"jpeg", "aesthetic"}  # the scorers that read no prompt; every other one must be prompt-sensitive
ON_POLICY_TOL = {"cpu": 0.0}  # *_first_update at a fresh start: 0 on CPU; a GPU: *_frac_first_update alone, 0
STEP_LIMIT = 1.0  # |theta_after - theta_before| / |theta_before| of the iteration; toy: 0.0007-0.005, --lr 1: 20-36
GRAD_WARN = 100   # a gradient norm this many times --grad-clip: clipping hides a loss or learning rate far off


def _row(check, value, expected="", ok=None, advice="", warn=False) -> tuple:
    """A row (check, value, expected, status, advice): ok None is "-", "n/a" not logged, False FAIL (WARN if `warn`)."""
    status = ok if isinstance(ok, str) else "-" if ok is None else "PASS" if ok else "WARN" if warn else "FAIL"
    return check, str(value), expected, status, advice if status in ("FAIL", "WARN") else ""


def preflight(main, args):
    """The flags' checks and run folder as the run takes them, then `main` on a copy of `args`, one iteration from the
    run's start in a folder inside the run's; the table, a new preflight.json, TrainingStopped (exit 1 on a FAIL)."""
    from importlib.metadata import version
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    rt = setup_training(args)
    run = prepare_run(args, rt, Path(main.__code__.co_filename).stem)
    dev, tmp, before, extra, cuda = rt.device, run.dir / ".preflight-run", {}, {}, rt.device.type == "cuda"
    if broadcast_object(tmp.is_symlink()):  # the temporary run would write through it, and be deleted there
        raise UsageError(f"{tmp} is a link: remove it (--preflight runs in a folder of that name, then deletes it)")
    held, _HELD[:] = _HELD[:], []  # the run folder stays locked: the temporary run's prepare_run releases what it holds
    total = torch.cuda.get_device_properties(dev).total_memory if cuda else os.sysconf("SC_PAGE_SIZE") * \
        os.sysconf("SC_PHYS_PAGES")
    name = torch.cuda.get_device_name(dev) if cuda else f"CPU, threads {torch.get_num_threads()}"
    rows = [_row("ranks x device", f"{rt.world_size} x {name}, {total / 2**30:.0f} GiB, {str(rt.dtype)[6:]}"),
            _row("versions", ", ".join(f"{p} {version(p)}" for p in ("torch", "diffusers", "transformers", "peft")))]

    def first_step(optimizer, *_):  # the trained tensors (FSDP2: this rank's shards) before the first step, on the CPU
        if not before:
            before.update({id(p): (p.to_local() if hasattr(p, "to_local") else p).detach().to("cpu", copy=True)
                           for g in optimizer.param_groups for p in g["params"]})
    hook = register_optimizer_step_pre_hook(first_step)  # every optimizer's
    try:
        if rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a preflight that was killed
        main(dataclasses.replace(args, preflight=False, output_dir=str(tmp), iterations=run.start + 1, eval_every=0,
                                 save_every=0, wandb=False, time_budget=0.0,
                                 resume=str(run.checkpoint) if run.checkpoint else None))
        rows += _judge(TrainingLoop.active, args, run, before, total, extra)
    except TrainingStopped as e:  # a scorer failed or the steps went non-finite, on every rank
        if signalled(dev):
            raise TrainingStopped("preflight stopped by a signal; nothing was trained or saved", e.exit_code) from None
        rows.append(_row("ran to its end", str(e), "yes", False, "fix what stopped it (a scorer: it or its server)"))
    finally:
        hook.remove()
        TrainingLoop.active = None  # run_cli saves nothing of the temporary run
        if rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        _HELD.extend(held)
    fails = int(all_ranks([sum(r[3] == "FAIL" for r in rows)], dev, dist.ReduceOp.MAX)[0])
    names = (run.dir / f"preflight{f'-{i}' if i else ''}.json" for i in itertools.count())
    path = broadcast_object(next(p for p in names if not p.exists()) if rt.is_main else None)  # keeps older ones
    if rt.is_main:  # preflight.json, and the table with each FAIL's and WARN's advice on a line
        table = [dict(zip(("check", "value", "expected", "status", "advice"), r)) for r in rows]
        write_atomic(path, json.dumps({"passed": not fails, "rows": table, **extra}, indent=2))
        print("\n".join(["| check | value | expected | status |", "|---|---|---|---|"] + [
            f"| {c} | {v} | {e} | {s} |" for c, v, e, s, _ in rows] + [f"{s} {c}: {x}" for c, _, _, s, x in rows if x]))
    raise TrainingStopped(f"preflight {f'FAILED {fails} check(s)' if fails else 'passed'}; report in {path}; nothing "
                          f"was trained or saved", exit_code=1 if fails else 0)


def _judge(loop, a, run, before: dict, total: int, extra: dict) -> list:
    """The rows of the iteration `loop` ran, from its log, weights, checkpoint and an evaluation batch; into `extra`."""
    from resource import RUSAGE_SELF, getrusage  # ru_maxrss: kB on Linux
    rt, dev, tmp = loop.rt, loop.rt.device, loop.run.dir
    if rt.is_main:  # the trained iteration's line (the last is the end's) and the checkpoint's size; it goes first
        line = json.loads((tmp / "metrics.jsonl").read_text().splitlines()[-2])
        size = sum(f.stat().st_size for f in newest_checkpoint(tmp).rglob("*") if f.is_file())
        shutil.rmtree(tmp / "checkpoints")
    line, size = broadcast_object((line, size) if rt.is_main else None)
    num = lambda key: math.nan if line.get(key) is None else line[key]  # noqa: E731  (null: NaN or inf)
    (rows, eval_s), fresh = _reward_rows(loop, a), run.checkpoint is None
    for key in [k for k in line if k.endswith("_first_update")] or ["first update on-policy"]:
        tol = 0.0 if key.endswith("_frac_first_update") else ON_POLICY_TOL.get(dev.type)
        judged = fresh and tol is not None
        ok = "n/a" if key not in line else num(key) <= tol if judged else None
        rows.append(_row(key, f"{num(key):.3g}", f"<= {tol:g}" if judged else "(GPU kernels)" if fresh else
                         "(resumed)", ok, "the update does not reproduce the rollout within the run's clip range: "
                         "the same micro-batches, dtype, train / eval mode; the reference is the starting policy"))
    norm, skipped, fp16, clip = num("grad_norm"), line.get("skipped_steps") or 0, rt.dtype == torch.float16, a.grad_clip
    rows += [_row("gradients finite", f"norm {norm:.3g}, {skipped} step(s) skipped", "finite, 0 skipped",
                  math.isfinite(norm) and not skipped if "grad_norm" in line else "n/a", "NaN / inf gradients: a non-"
                  "finite reward or loss, --lr or --dtype" + "; or fp16's loss scaler backing off" * fp16, warn=fp16),
             _row("gradient norm before clipping", f"{norm:.3g}", f"<= {GRAD_WARN} x clip {clip:g}",
                  not norm > GRAD_WARN * clip if "grad_norm" in line else "n/a", f"{norm / clip:.3g}x the clip: the "
                  f"loss or the rewards are far off in scale, or --lr is", warn=True)]
    moved, d2, n2 = [], 0.0, 0.0
    for p in loop.params:
        x = (p.to_local() if hasattr(p, "to_local") else p).detach().cpu()
        b = before.get(id(p), x)  # no optimizer step: nothing moved
        moved.append(not torch.equal(x, b))
        d2, n2 = d2 + (x.double() - b.double()).square().sum().item(), n2 + b.double().square().sum().item()
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else getrusage(RUSAGE_SELF).ru_maxrss * 1024
    *moved, peak = all_ranks(moved + [peak], dev, dist.ReduceOp.MAX)
    d2, n2 = all_ranks([d2, n2], dev, dist.ReduceOp.SUM)  # DDP replicas and FSDP2 shards alike
    index = {id(q): name for name, q in loop.adapter.transformer.named_parameters()}
    still = [index.get(id(p), str(i)) for i, (p, m) in enumerate(zip(loop.params, moved)) if not m]
    step = math.sqrt(d2 / n2) if n2 > 0 else math.inf
    it_s = line["time_s"] - (checkpoint_info(run.checkpoint)["elapsed"] if run.checkpoint else 0.0)
    iters, free, every = a.iterations - run.start, shutil.disk_usage(run.dir).free, a.eval_every
    evals = sum(1 for i in range(run.start, a.iterations + 1) if every and (i % every == 0 or i == a.iterations))
    saves = 1 + sum(1 for i in range(run.start + 1, a.iterations) if a.save_every and i % a.save_every == 0)
    hours = (iters * it_s + evals * eval_s) / 3600
    rows += [_row("step size, change / weights (L2)", f"{step:.3g}", f"< {STEP_LIMIT:g}", step < STEP_LIMIT,
                  "the iteration's optimizer steps moved the weights too far: lower --lr"),
             _row("trained tensors that moved", f"{len(moved) - len(still)}/{len(moved)}", "all", not still,
                  f"unchanged: {', '.join(still[:3])}{', ...' * (len(still) > 3)}. Fine for a fresh LoRA's lora_A "
                  f"(lora_B = 0), SD3's last add_q_proj (no loss reaches it); else not in the forward", warn=True),
             _row("peak memory per device", f"{peak / 2**30:.2f} GiB of {total / 2**30:.0f}", "< 90%",
                  peak < 0.9 * total, "little room: lower --micro-batch, or pass --gradient-checkpointing or "
                  "--offload-encoders", warn=True),
             _row("whole run", f"{hours:.3g} h, {hours * rt.world_size:.3g} device-hours",
                  f"{iters} iterations x {it_s:.3g} s, {evals} evaluations x {eval_s:.3g} s"),
             _row("checkpoints on disk", f"{saves} x {size / 2**30:.3f} GiB", f"<= {free / 2**30:.1f} GiB free",
                  saves * size <= free, "free disk space, raise --save-every or pass another --output-dir")]
    extra.update(metrics=line, measured=dict(iteration_s=it_s, eval_s=eval_s, peak_bytes=peak, total_bytes=total),
                 projection=dict(iterations=iters, evaluations=evals, saves=saves, hours=hours, checkpoint_bytes=size))
    return rows


def _reward_rows(loop, a) -> tuple[list, float]:
    """Each scorer on one timed evaluation batch (the EMA weights if kept): finite, spread and, outside PROMPT_FREE,
    higher with the images' own prompts than with the next image's; and the seconds of a whole evaluation."""
    rt, n, tic = loop.rt, min(a.eval_images, 16 * loop.rt.world_size), time.perf_counter()  # one batch per rank
    with loop.ema.swapped_in() if loop.ema else contextlib.nullcontext():
        _, batch = evaluate(loop.adapter, loop.adapter.transformer, loop.eval_prompts, n, a.eval_steps,
                            loop.reward_fn, rt, seed=a.seed, grid=(n, n))  # every image, by prompt
    eval_s = (time.perf_counter() - tic) * a.eval_images / n
    images, records = torch.cat([im for _, im in batch]), {r["prompt"]: r for r in loop.eval_prompts}
    own = [p for p, im in batch for _ in im]
    shifted = [batch[(r + 1) % len(batch)][0] for r, (_, im) in enumerate(batch) for _ in im]
    right, wrong = (loop.reward_fn(images, p, [records[q] for q in p])[1] for p in (own, shifted))
    rows = []
    for name in loop.reward_fn.weights:
        key, s, w = short_reward_name(name), right[name].double().cpu(), wrong[name].double().cpu()
        one, d = len(s) < 2, s - w  # one image (--eval-images 1): no spread to measure
        spread, se = (math.nan, math.nan) if one else (s.std().item(), d.std().item() / math.sqrt(len(d)))
        ok = spread > 1e-6 and len(batch) > 1
        rows += [_row(f"{key}: finite", f"{int(torch.isfinite(s).sum())}/{len(s)}", "all",
                      bool(torch.isfinite(s).all()), "the scorer returns NaN / inf: check its weights and inputs"),
                 _row(f"{key}: spread over images", f"{spread:.3g}", "> 0", "n/a" if one else spread > 1e-6,
                      "every image gets the same score, so every advantage is zero: check the scorer's weights")]
        rows += [] if name in PROMPT_FREE else [_row(
            f"{key}: right vs shifted prompts", f"{s.mean():.4g} vs {w.mean():.4g} ({d.mean() / max(se, 1e-12):+.1f} "
            f"SE)", f">= +{PROMPT_SE:g} SE", d.mean().item() > max(0, PROMPT_SE * se) if ok else "n/a",
            "the score ignores the prompt: check the scorer's tokenizer and text input")]
    return rows, eval_s


# ---- 12. Remote scorers and the reward server (`python common.py serve-reward`) ----
class RemoteReward:
    """A scorer over HTTP (protocol: README, Rewards): each call POSTs one JSON batch, retrying a failed try (no whole
    answer in `timeout` s, HTTP 5xx, not JSON) `retries` times; anything else wrong stops the run at once."""

    def __init__(self, url: str, device="cpu", timeout: float = 120.0, retries: int = 3, backoff: float = 2.0):
        self.url, self.device, self.timeout, self.retries, self.backoff = url, device, timeout, retries, backoff

    def __call__(self, images, prompts, metadata=None):
        encoded = []
        for im in _to_uint8(images).permute(0, 2, 3, 1).numpy():
            np.save(buf := io.BytesIO(), im)
            encoded.append(base64.b64encode(buf.getvalue()).decode())
        body = json.dumps({"prompts": list(prompts), "metadata": None if metadata is None else list(metadata),
                           "images": encoded}).encode()
        expected = f'{{"scores": [{len(encoded)} finite numbers]}}'
        with interruptible():
            for attempt in range(self.retries + 1):
                status, raw = 0, b""
                try:
                    status, raw = _post(self.url, body, self.timeout)
                    if status < 400:
                        reply = json.loads(raw, parse_int=float)  # every number a float: 10**400 is inf
                        break
                    failure = f"answered HTTP {status}: {raw.decode(errors='replace')[:300]}"
                except (OSError, HTTPException) as e:  # refused, reset, cut short, past the deadline
                    failure = f"did not answer ({type(e).__name__}: {e})"
                except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep
                    failure = f"sent {raw[:200].decode(errors='replace')!r}"
                if 400 <= status < 500:  # the request itself is wrong: retrying cannot help
                    raise TrainingStopped(f"reward server {self.url} {failure}")
                if attempt == self.retries:
                    raise TrainingStopped(f"reward server {self.url} {failure} ({attempt + 1} tries, a "
                                          f"{self.timeout:g} s deadline each); expected {expected}: check that it "
                                          f"runs (python common.py serve-reward) at the URL in --reward")
                time.sleep(self.backoff * 2 ** attempt)
        scores = reply.get("scores") if isinstance(reply, dict) else None
        ok = isinstance(scores, list) and len(scores) == len(encoded) and all(type(x) is float for x in scores)
        scores = torch.tensor(scores if ok else [], dtype=torch.float32)
        if not ok or not torch.isfinite(scores).all():  # after the cast: 1e39 is inf in float32
            raise TrainingStopped(f"reward server {self.url} sent {raw[:200].decode(errors='replace')!r} for "
                                  f"{len(encoded)} images: expected {expected}")
        return scores.to(self.device)


def _post(url: str, body: bytes, timeout: float) -> tuple[int, bytes]:
    """(HTTP status, reply body) of a JSON POST within `timeout` seconds in all, else TimeoutError. A socket's timeout
    restarts with each read (a trickling server never trips it), so a timer shuts the connection at the deadline."""
    u = urllib.parse.urlsplit(url)
    conn = (HTTPSConnection if u.scheme == "https" else HTTPConnection)(u.netloc, timeout=timeout)
    deadline = time.monotonic() + timeout
    conn.connect()  # within the socket's timeout; the timer shuts the socket itself, which http.client sets

    def shut(sock):  # from the timer's thread: a read blocked on it returns; a closed or unopened one (None) is left
        with contextlib.suppress(OSError, AttributeError):
            sock.shutdown(socket.SHUT_RDWR)
    timer = threading.Timer(deadline - time.monotonic(), shut, [conn.sock])  # conn.sock to None for a reply that
    timer.start()  # will close (HTTP/1.0), then read through the reply
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a server that answers before it reads all
            conn.request("POST", u.path, body, {"Content-Type": "application/json"})  # (HTTP 413): its answer counts
        reply = conn.getresponse()
        status, raw = reply.status, reply.read()
    except (OSError, HTTPException):
        if time.monotonic() < deadline:
            raise
    finally:
        timer.cancel()
        conn.close()
    if time.monotonic() >= deadline:  # whatever came: a shut connection may read as a reply that ended
        raise TimeoutError(f"no complete reply within {timeout:g} s")
    return status, raw


def serve_reward(argv=None):
    """`python common.py serve-reward --reward NAME --port N`: serves a registry scorer at http://HOST:PORT/NAME for
    RemoteReward, so a scorer with its own environment runs there (the protocol and its answers: README, Rewards)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    ap = Parser(prog="common.py serve-reward", description=serve_reward.__doc__.split("\n")[0])
    ap.add_argument("--reward", required=True, choices=list(REWARDS))
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other machines")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-request-mb", type=float, default=1024, help="larger requests are refused (HTTP 413)")
    ap.add_argument("--timeout", type=float, default=60, help="seconds a client may send nothing before it is dropped")
    a = ap.parse_args(argv)
    lock = threading.Lock()  # one batch at a time on the model

    class Handler(BaseHTTPRequestHandler):
        timeout = a.timeout  # of each read and write: past it the standard library drops the client with one line

        def do_POST(self):
            if self.path.rstrip("/").rsplit("/", 1)[-1] != a.reward:
                return self.reply(404, {"error": f"this server scores {a.reward!r}: POST to /{a.reward}"})
            size = (n := self.headers.get("Content-Length", "")).isascii() and n.isdigit() and len(n) < 16 and int(n)
            if size > a.max_request_mb * 2**20:
                return self.reply(413, {"error": f"{size} bytes is more than --max-request-mb {a.max_request_mb:g}"})
            raw = self.rfile.read(size)  # none or not a decimal number (size False): empty, a 400 below
            try:  # after the read, whose timeout must drop the client; anything undecodable is the client's error
                batch = json.loads(raw)
                x = np.stack([np.load(io.BytesIO(base64.b64decode(s, validate=True))) for s in batch["images"]])
                prompts, metadata = batch["prompts"], batch.get("metadata")
                if not (x.dtype == np.uint8 and x.ndim == 4 and x.shape[3] == 3 and isinstance(prompts, list)
                        and len(prompts) == len(x) and all(isinstance(p, str) for p in prompts)
                        and (metadata is None or isinstance(metadata, list) and len(metadata) == len(x))):
                    raise ValueError("expected uint8 (H, W, 3) images, a prompt string each, metadata null or one each")
            except Exception as e:  # noqa: BLE001
                return self.reply(400, {"error": f"{type(e).__name__}: {e}"})
            try:
                with lock, torch.no_grad():
                    scores = scorer(torch.from_numpy(x).permute(0, 3, 1, 2) / 255, prompts, metadata).float().tolist()
            except Exception as e:  # noqa: BLE001 - the client retries a 5xx, then stops its run
                return self.reply(500, {"error": f"{type(e).__name__}: {e}"})
            self.reply(200, {"scores": scores})

        def reply(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_request(self, *args):  # no line per request; errors (a timeout, a malformed request) keep theirs
            pass

    with one_line_errors(ap.prog):  # a UsageError: one line, exit status 2
        check_flag("timeout", a.timeout, at_least=1e-3, at_most=1e9)  # a socket's timeout holds up to 9.2e9 s
        check_flag("max_request_mb", a.max_request_mb, at_least=1e-3)
        try:
            torch.empty(1, device=a.device)
        except Exception as e:  # noqa: BLE001 - not a device, or none here ("cuda" without CUDA: every request a 500)
            raise UsageError(f"--device {a.device} cannot be used ({one_line(e)}): pass cpu or a GPU here") from None
        try:
            server = ThreadingHTTPServer((a.host, a.port), Handler)  # before the scorer loads: a busy port at once
        except (OSError, OverflowError) as e:  # busy, a bad host, a port outside 0-65535
            raise UsageError(f"cannot serve at {a.host}:{a.port} ({e}): pass another --port or --host") from None
        check_scorer_files([a.reward])
        scorer = REWARDS[a.reward](device=a.device)
    server.handle_error = lambda _, client: print0(f"{client[0]}: {one_line(sys.exc_info()[1])}", file=sys.stderr)
    print0(f"serving {a.reward} at http://{a.host}:{server.server_address[1]}/{a.reward}")
    server.serve_forever()


# ---- 13. Behind Part I's interfaces: the model adapters, the scorers, the prompt sets, and how they load ----
def load_model(name: str, rt: Runtime, path: str | None = None, resolution: int | None = None,
               guidance_scale: float | None = None, max_sequence_length: int | None = None,
               offload_encoders: bool = False):
    """The adapter for --model `name`; `path` overrides the hub id or shipped weights (from_pretrained), or is
    random / random:N for the published architecture with random weights (Appendix B). None: the adapter's default."""
    import diffusers as d
    if name == "toy":
        from transformers import CLIPTextModel
        root = Path(path) if path else ASSETS / "toy"
        return compile_blocks(ToyAdapter(d.FluxTransformer2DModel.from_pretrained(root / "transformer"),
                                         CLIPTextModel.from_pretrained(root / "text_encoder"), rt.device, rt.dtype), rt)
    cls, net_cls, adapter_cls = {"flux": (d.FluxPipeline, d.FluxTransformer2DModel, FluxAdapter),
                                 "sd3": (d.StableDiffusion3Pipeline, d.SD3Transformer2DModel, SD3Adapter),
                                 "flux2": (d.Flux2KleinPipeline, d.Flux2Transformer2DModel, Flux2Adapter)}[name]
    if path and path.startswith("random"):
        pipe = build_pipeline(name, architecture(name, random_depth(path, name)), device=rt.device, dtype=rt.dtype)
    else:  # read in the dtypes _freeze_pipeline keeps, so nothing is rounded on the way (torch_dtype before 0.40);
        key = "dtype" if tuple(map(int, d.__version__.split(".")[:2])) >= (0, 40) else "torch_dtype"  # the
        # transformer first: the peak of its read (a few times its file) meets nothing else
        net = net_cls.from_pretrained(path or HUB_IDS[name], subfolder="transformer", **{key: weight_dtype(rt.dtype)})
        pipe = cls.from_pretrained(path or HUB_IDS[name], transformer=net, **{key: {"vae": torch.float32,
                                                                                     "default": rt.dtype}})
    for module_name, module in pipe.transformer.named_modules():  # attention's image and text halves, slices of one
        if module_name.endswith(("attn.to_out.0", "attn.to_add_out")):  # tensor, contiguous: matmul folds them (on CPU,
            module.register_forward_pre_hook(lambda _, a: (a[0].contiguous(), *a[1:]))  # else a weight copy per row)
    settings = {"resolution": resolution, "guidance_scale": guidance_scale, "max_sequence_length": max_sequence_length}
    return compile_blocks(adapter_cls(pipe, rt.device, rt.dtype, offload_encoders=offload_encoders,
                                      **{k: v for k, v in settings.items() if v is not None}), rt)


def weight_dtype(dtype: torch.dtype) -> torch.dtype:
    """The frozen transformer's dtype: float32 under fp16 (autocast over float32, as SD3.5's recipes train), else it."""
    return torch.float32 if dtype == torch.float16 else dtype


def compile_blocks(adapter, rt: Runtime):
    """--compile: each repeated block's forward through torch.compile, one code per block class, static shapes, traced
    at its first call (LoRA inside, FSDP2's hooks out); inductor rounds as eager: no-grad and grad forwards agree."""
    if rt.compile and not torch._inductor.config.emulate_precision_casts:  # once per process
        torch._inductor.config.emulate_precision_casts = True
        torch._dynamo.on_compile_start(lambda _: COMPILING.update(compiles=1, compile_s=-time.perf_counter()))
        torch._dynamo.on_compile_end(lambda _: COMPILING.update(compile_s=time.perf_counter()))  # lazy backwards too
    for block in transformer_blocks(adapter.transformer) if rt.compile else []:
        block.forward = torch.compile(type(block).forward, dynamic=False, recompile_limit=64).__get__(block)
    return adapter


def autocast(device: torch.device, dtype: torch.dtype):
    """Autocast to the compute dtype (bf16, fp16) on any device, CPU included; float32 runs without it."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


class Adapter:
    """What every adapter shares: the velocity, its model's call (`_forward`) under autocast, in float32; with `cfg`,
    classifier-free guidance, the empty prompt's conditioning (`negative`) and the prompt's in one batch."""
    cfg, guidance_scale = False, None

    def velocity(self, net, x, t, cond):
        t = torch.as_tensor(t, dtype=torch.float32, device=self.device).expand(len(x))
        if self.cfg:  # [negative, prompt] in one batch, as SD3's pipeline (FLUX.2's makes two calls)
            x, t = torch.cat([x, x]), torch.cat([t, t])
            cond = {k: torch.cat([self.negative[k].expand_as(v), v]) for k, v in cond.items()}
        with autocast(self.device, self.dtype):  # t in float32: the transformer rounds it, as the pipelines do
            out = self._forward(net, x.to(self.weights_dtype), t, cond).float()
        if not self.cfg:
            return out
        uncond, text = out.chunk(2)
        return uncond + self.guidance_scale * (text - uncond)


class FluxFamilyAdapter(Adapter):
    """Shared by FLUX and the toy model: a FluxTransformer2DModel on packed 2x2 latent tokens, no CFG."""

    def _forward(self, net, x, t, cond):  # the guidance embedding of a guidance-distilled model
        guidance = torch.full_like(t, float(self.guidance_scale)) if self.transformer.config.guidance_embeds else None
        return net(hidden_states=x, timestep=t, guidance=guidance, txt_ids=self.txt_ids, img_ids=self.img_ids,
                   pooled_projections=cond["pooled"], encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]


class PipelineAdapter(Adapter):
    """What FLUX, SD3 and FLUX.2 share: a diffusers pipeline, every module frozen (_freeze_pipeline) until add_lora;
    CFG (`cfg`) at a scale above 1, unless the model has none."""

    cfg = property(lambda self: self.guidance_scale > 1)

    def __init__(self, pipe, device, dtype, resolution: int, guidance_scale: float, max_sequence_length: int,
                 offload_encoders: bool, multiple: int = 16):
        if resolution % multiple or resolution <= 0:
            raise UsageError(f"--resolution {resolution} must be a positive multiple of {multiple} for {self.name}")
        _freeze_pipeline(pipe, device, dtype, offload_encoders)
        self.pipe, self.transformer, self.vae = pipe, pipe.transformer, pipe.vae
        self.device, self.dtype, self.resolution, self.weights_dtype = device, dtype, resolution, weight_dtype(dtype)
        self.guidance_scale, self.max_sequence_length = guidance_scale, max_sequence_length
        self.offload_encoders, self.negative = offload_encoders, None

    @torch.no_grad()
    def encode(self, prompts):
        """--offload-encoders: the text encoders on the compute device for an encode only (T5-XXL: 9.5 GB in bf16)."""
        moved = [m for name, m in self.pipe.components.items() if name.startswith("text_encoder") and m is not None
                 and self.offload_encoders]
        for m in moved:
            m.to(self.device)
        try:
            if self.negative is None and self.cfg:
                self.negative = self._encode([""])
            return self._encode(prompts)
        finally:
            for m in moved:
                m.to("cpu")

    @torch.no_grad()
    def decode(self, latents):
        """VAE latents (SD3's as sampled) -> images in [0, 1], float32, undoing the VAE's scaling and shift if any."""
        c = self.vae.config
        latents = latents.float() / c.get("scaling_factor", 1.0) + (c.get("shift_factor") or 0.0)
        return (self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)

    def save_lora(self, path, state_dict):
        type(self.pipe).save_lora_weights(path, transformer_lora_layers=state_dict)


class FluxAdapter(FluxFamilyAdapter, PipelineAdapter):
    """FLUX.1-dev: guidance-distilled (guidance embedding, no CFG), packed 2x2 latent tokens, dynamic shift."""

    lora_targets, cfg, name = FLUX_LORA_TARGETS, False, "FLUX"

    def __init__(self, pipe, device, dtype, resolution: int = 512, guidance_scale: float = 3.5,
                 max_sequence_length: int = 512, offload_encoders: bool = False):
        super().__init__(pipe, device, dtype, resolution, guidance_scale, max_sequence_length, offload_encoders,
                         2 * pipe.vae_scale_factor)
        self.h = resolution // pipe.vae_scale_factor  # latent side before packing
        self.channels, self.txt_ids = self.transformer.config.in_channels // 4, None  # txt_ids: _encode's
        self.img_ids = pipe._prepare_latent_image_ids(1, self.h // 2, self.h // 2, device, dtype)

    def _encode(self, prompts):
        embeds, pooled, self.txt_ids = self.pipe.encode_prompt(prompts, prompt_2=None, device=self.device,
                                                               max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled": pooled}

    def noise(self, n, generator=None):
        x = torch.randn((n, self.channels, self.h, self.h), generator=generator)
        return self.pipe._pack_latents(x, n, self.channels, self.h, self.h).to(self.device)

    def sigmas(self, num_steps):
        c = self.pipe.scheduler.config
        return flux_sigmas(num_steps, (self.h // 2) ** 2, c.base_image_seq_len, c.max_image_seq_len, c.base_shift,
                           c.max_shift)

    @torch.no_grad()
    def decode(self, x):
        return super().decode(self.pipe._unpack_latents(x.float(), self.resolution, self.resolution,
                                                        self.pipe.vae_scale_factor))


class SD3Adapter(PipelineAdapter):
    """SD 3.5 Medium: CFG with the empty prompt as negative (one batch, as the pipeline), static shift 3, t * 1000."""

    lora_targets, name = SD3_LORA_TARGETS, "SD3"

    def __init__(self, pipe, device, dtype, resolution: int = 512, guidance_scale: float = 4.5,
                 max_sequence_length: int = 128, offload_encoders: bool = False):
        super().__init__(pipe, device, dtype, resolution, guidance_scale, max_sequence_length, offload_encoders,
                         pipe.vae_scale_factor * pipe.transformer.config.patch_size)
        self.h, self.channels = resolution // pipe.vae_scale_factor, self.transformer.config.in_channels

    def _encode(self, prompts):
        embeds, _, pooled, _ = self.pipe.encode_prompt(prompts, None, None, do_classifier_free_guidance=False,
                                                       device=self.device, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled": pooled}

    def noise(self, n, generator=None):
        return torch.randn((n, self.channels, self.h, self.h), generator=generator).to(self.device)

    def sigmas(self, num_steps):
        return sd3_sigmas(num_steps, self.pipe.scheduler.config.shift)

    def _forward(self, net, x, t, cond):  # the timestep in float32, as the pipeline: bf16 makes 913.35 912
        return net(hidden_states=x, timestep=t * 1000, encoder_hidden_states=cond["prompt_embeds"],
                   pooled_projections=cond["pooled"], return_dict=False)[0]


def distilled_defaults(model: str, path: str | None) -> dict:
    """A step-distilled FLUX.2-klein's defaults over MODEL_DEFAULTS["flux2"] (the base model's): 4 steps without CFG,
    where --model-path's model_index.json says is_distilled; {} else, or unread (check_model names what is wrong)."""
    with contextlib.suppress(Exception):
        if model == "flux2" and path and not path.startswith("random") and json.loads(Path(hub_file(
                path, "model_index.json")).read_text()).get("is_distilled") is True:
            return {"guidance_scale": 1.0, "sample_steps": 4, "eval_steps": 4}
    return {}


class Flux2Adapter(PipelineAdapter):
    """FLUX.2-klein: Qwen3's layers 9, 18 and 27 side by side, tokens of 2x2 patches of 32 VAE channels scaled by a
    batch norm's statistics, 4-axis position ids, a shift of image size and step count; CFG unless step-distilled."""

    name = "FLUX.2"
    lora_targets = property(lambda self: FLUX2_LORA_TARGETS + [  # each single block's to_out by name
        f"single_transformer_blocks.{i}.attn.to_out" for i in range(len(self.transformer.single_transformer_blocks))])

    def __init__(self, pipe, device, dtype, resolution: int = 512, guidance_scale: float | None = None,
                 max_sequence_length: int = 512, offload_encoders: bool = False):
        f, distilled, where = 2 * pipe.vae_scale_factor, pipe.config.is_distilled, pipe.name_or_path or "the model"
        if not pipe.scheduler.config.use_dynamic_shifting:  # its grid would be a static shift's
            raise UsageError(f"{where}: its scheduler config does not ask for dynamic shifting, which FLUX.2's "
                             f"sampling grid is (common.flux2_sigmas): pass FLUX.2-klein's own --model-path")
        if distilled and (guidance_scale or 1) > 1:
            raise UsageError(f"--guidance-scale {guidance_scale}: {where} is step-distilled (is_distilled), which "
                             f"takes no CFG: pass --guidance-scale 1")
        super().__init__(pipe, device, dtype, resolution, guidance_scale or (1.0 if distilled else 4.0),
                         max_sequence_length, offload_encoders, f)
        self.h, depth = resolution // f, pipe.text_encoder.config.num_hidden_layers  # latent tokens per side
        self.text_layers = [min(k, depth) for k in (9, 18, 27)]  # the pipeline's; random:N's 1-layer encoder's last
        self.img_ids = pipe._prepare_latent_ids(torch.empty(1, 1, self.h, self.h))[0].to(device)       # (h h, 4)
        self.txt_ids = pipe._prepare_text_ids(torch.empty(1, max_sequence_length, 1))[0].to(device)    # (L, 4)

    def _encode(self, prompts):
        """The pipeline's encode_prompt (Qwen3's chat template without thinking, max_sequence_length tokens, the states
        of text_layers side by side) by the causal LM's body alone: 3 states, no logits (the pipeline keeps 37, 512)."""
        tok, encoder = self.pipe.tokenizer, self.pipe.text_encoder
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False) for p in prompts]
        ids = tok(texts, return_tensors="pt", padding="max_length", truncation=True,
                  max_length=self.max_sequence_length).to(encoder.device)
        states = encoder.model(input_ids=ids.input_ids, attention_mask=ids.attention_mask, use_cache=False,
                               output_hidden_states=self.text_layers).hidden_states
        return {"prompt_embeds": torch.cat([states[k] for k in self.text_layers], -1)}  # (B, L, 3 x hidden)

    def noise(self, n, generator=None):  # as the pipeline draws it, (n, 128, h, h) patchified, then packed
        x = torch.randn((n, self.transformer.config.in_channels, self.h, self.h), generator=generator)
        return rearrange(x, "n c h w -> n (h w) c").to(self.device)

    def sigmas(self, num_steps):
        return flux2_sigmas(num_steps, self.h**2)

    def _forward(self, net, x, t, cond):  # no guidance embedding, no pooled text
        return net(hidden_states=x, timestep=t, encoder_hidden_states=cond["prompt_embeds"], txt_ids=self.txt_ids,
                   img_ids=self.img_ids, return_dict=False)[0]

    @torch.no_grad()
    def decode(self, x):  # tokens -> the batch norm's statistics undone -> the 2x2 patches unfolded -> the VAE
        bn, eps = self.vae.bn, self.vae.config.batch_norm_eps
        x = rearrange(x.float(), "n (h w) c -> n c h w", h=self.h)
        x = x * torch.sqrt(bn.running_var + eps)[:, None, None] + bn.running_mean[:, None, None]
        return super().decode(self.pipe._unpatchify_latents(x))


def _freeze_pipeline(pipe, device, dtype, offload_encoders: bool = False):
    """Every module frozen and cast (_cast) on `device`, but the text encoders on the CPU with offload_encoders."""
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            offload = offload_encoders and name.startswith("text_encoder")
            module.requires_grad_(False).eval().to("cpu" if offload else device)
            _cast(module, {"vae": torch.float32, "transformer": weight_dtype(dtype)}.get(name, dtype))


class ToyReward:
    """The toy world's 0.5 colour + 0.5 shape: rule-based (toy_reward), or `soft`, continuous (toy_soft_reward)."""

    def __init__(self, device="cpu", soft: bool = False):
        self.device, self.score = device, toy_soft_reward if soft else toy_reward

    def __call__(self, images, prompts, metadata=None):
        return self.score(images, prompts).to(self.device)


class JpegCompressibility:
    """Minus the JPEG size in kB at quality 95 (compressibility): a simple, model-free reward."""

    def __init__(self, device="cpu"):
        self.device = device

    def __call__(self, images, prompts, metadata=None):
        sizes = []
        for im in pil_images(images):
            im.save(buf := io.BytesIO(), format="JPEG", quality=95)
            sizes.append(-buf.tell() / 1000)
        return torch.tensor(sizes, dtype=torch.float32, device=self.device)


CLIP_H, CLIP_L = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "openai/clip-vit-large-patch14"


class _CLIPSimilarity:
    """logit_scale.exp() * cos(image, text) / divisor by a CLIPModel, of the class's model and processor by default."""

    divisor, model_id, processor_id = 1.0, CLIP_L, None

    def __init__(self, model_id: str | None = None, processor_id: str | None = None, device="cpu", dtype=torch.float32):
        from transformers import CLIPProcessor
        model_id, processor_id = model_id or self.model_id, processor_id or self.processor_id
        processor = CLIPProcessor.from_pretrained(processor_id or model_id)
        self.tokenizer, self.image_config = processor.tokenizer, processor.image_processor.to_dict()
        self.model = self._load(model_id, processor_id, dtype).eval().requires_grad_(False).to(device)
        self.device, self.dtype = torch.device(device), dtype
        self.max_length = self.model.config.text_config.max_position_embeddings

    def _load(self, model_id: str, processor_id: str | None, dtype: torch.dtype):
        from transformers import CLIPModel
        return CLIPModel.from_pretrained(model_id, dtype=dtype)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        return clip_preprocess(images, self.image_config)

    @torch.no_grad()
    def cosine(self, images, prompts) -> torch.Tensor:
        """cos(image embedding, text embedding) of each pair, (N,) float32 on the scorer's device."""
        pixels = self.preprocess(images.to(self.device)).to(self.dtype)
        text = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.max_length,
                              return_tensors="pt").to(self.device)
        # transformers 4 returns the projected embedding; 5, an output object holding it as pooler_output
        img, txt = self.model.get_image_features(pixel_values=pixels), self.model.get_text_features(**text)
        img, txt = (e if isinstance(e, torch.Tensor) else e.pooler_output for e in (img, txt))
        return F.cosine_similarity(img.float(), txt.float(), dim=-1)

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None):
        return self.model.logit_scale.float().exp() * self.cosine(images, prompts) / self.divisor


class PickScore(_CLIPSimilarity):
    """PickScore_v1 (CLIP-H tuned on human preferences), 100 cos / 26 as GRPO trainers scale it, CLIP-H's processor."""

    divisor, model_id, processor_id = 26.0, "yuvalkirstain/PickScore_v1", CLIP_H


class CLIPScore(_CLIPSimilarity):
    """CLIP ViT-L/14, 100 cos / 30: the official GRPO trainers' clipscore (not Hessel et al.'s 2.5 max(cos, 0))."""

    divisor = 30.0


class HPSv2(_CLIPSimilarity):
    """HPS v2.1: cos(image, text) as the hpsv2 package scores it; its open_clip checkpoint as a CLIP-H CLIPModel."""

    model_id, filename, processor_id = "xswu/HPSv2", "HPS_v2.1_compressed.pt", CLIP_H
    quick_gelu = False  # the MLP activation the checkpoint was trained with: GELU, or (True) open_clip's QuickGELU

    def __init__(self, model_id: str | None = None, filename: str | None = None, **kwargs):
        self.filename = filename or self.filename
        super().__init__(model_id, **kwargs)

    def _load(self, model_id: str, processor_id: str | None, dtype: torch.dtype):
        return openclip_model(hub_file(model_id, self.filename), processor_id, self.quick_gelu, dtype)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        return normalise(resize_max_size(images, self.image_config["crop_size"]["height"]), self.image_config)

    def __call__(self, images, prompts, metadata=None):
        return self.cosine(images, prompts)


class CLIPScoreH(HPSv2):
    """DFN5B CLIP-H (the papers' CLIP reward): cos(image, text), loaded as HPSv2, resized without a crop ("squash")."""

    model_id, filename, quick_gelu = "apple/DFN5B-CLIP-ViT-H-14", "open_clip_pytorch_model.bin", True
    preprocess = _CLIPSimilarity.preprocess

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.image_config["size"] = dict.fromkeys(("height", "width"), self.image_config["crop_size"]["height"])


class Aesthetic:
    """LAION's aesthetic predictor v2: its linear MLP head on CLIP-L/14's L2-normalised image embedding; no prompt."""

    def __init__(self, model_id="camenduru/improved-aesthetic-predictor", filename="sac+logos+ava1-l14-linearMSE.pth",
                 clip_id=CLIP_L, device="cpu", dtype=torch.float32):
        from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection
        self.image_config = CLIPImageProcessor.from_pretrained(clip_id).to_dict()
        self.clip = CLIPVisionModelWithProjection.from_pretrained(clip_id, dtype=dtype).eval().requires_grad_(False)
        lin, drop, dim = torch.nn.Linear, torch.nn.Identity, self.clip.config.projection_dim  # the file's `layers`
        self.head = torch.nn.Sequential(lin(dim, 1024), drop(), lin(1024, 128), drop(), lin(128, 64), drop(),
                                        lin(64, 16), lin(16, 1))
        state = torch.load(hub_file(model_id, filename), map_location="cpu", weights_only=True)
        self.head.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
        self.clip.to(device), self.head.eval().requires_grad_(False).to(device)
        self.device, self.dtype = torch.device(device), dtype

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None):
        pixels = clip_preprocess(images.to(self.device), self.image_config).to(self.dtype)
        embedding = self.clip(pixel_values=pixels).image_embeds.float()
        return self.head(embedding / embedding.norm(dim=-1, keepdim=True)).squeeze(-1)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions turning a into b."""
    if len(a) < len(b):
        a, b = b, a
    row = list(range(len(b) + 1))  # row[j]: distance between the prefix of a read so far and b[:j]
    for i, ca in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (ca != cb))
    return row[-1]


def ocr_reward(recognised: str, prompt: str) -> float:
    """The official OcrScorer's reward 1 - d / len(target) in [0, 1]; target: the prompt's text after its first double
    quote up to the next (else the whole prompt), both lower-cased without whitespace; d = 0 if the target is in the
    recognised text, else min(their edit distance, len(target)). An empty target scores 1 (the official code fails)."""
    target = prompt.split('"')[1] if '"' in prompt else prompt
    target, text = ("".join(s.split()).lower() for s in (target, recognised))
    return 1.0 if target in text else 1.0 - min(edit_distance(text, target), len(target)) / len(target)


class OCRScore:
    """ocr_reward(text read, prompt), read by GOT-OCR 2.0, not the official PaddleOCR; `last_texts`: the last call's."""

    def __init__(self, model_id="stepfun-ai/GOT-OCR-2.0-hf", device="cpu", dtype=torch.float32, max_new_tokens=128):
        from transformers import GotOcr2ForConditionalGeneration, GotOcr2Processor
        self.processor = GotOcr2Processor.from_pretrained(model_id, backend="pil")
        self.model = GotOcr2ForConditionalGeneration.from_pretrained(model_id, dtype=dtype)
        self.model = self.model.eval().requires_grad_(False).to(device)
        self.device, self.max_new_tokens, self.last_texts = torch.device(device), max_new_tokens, []

    @torch.no_grad()
    def recognise(self, images: torch.Tensor) -> list[str]:
        """The text read in each image (N,3,H,W) in [0, 1]: GOT-OCR 2.0's greedy, batched read (8-bit, PIL backend) up
        to max_new_tokens or <|im_end|> / <|endoftext|>, passed explicitly: its generation config sets no end token."""
        tok, vision = self.processor.tokenizer, self.model.config.vision_config
        stop = [i for i in tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
                if i is not None and i != tok.unk_token_id]
        patches = -(-(vision.image_size // vision.patch_size) // 4)  # the projector's two stride-2 convolutions: 16
        inputs = self.processor(pil_images(images), num_image_tokens=patches ** 2, return_tensors="pt").to(self.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        out = self.model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=self.max_new_tokens,
                                  eos_token_id=stop, pad_token_id=stop[0] if tok.pad_token_id is None else
                                  tok.pad_token_id)
        return self.processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> torch.Tensor:
        self.last_texts = self.recognise(images)
        scores = [ocr_reward(text, prompt) for text, prompt in zip(self.last_texts, prompts, strict=True)]
        return torch.tensor(scores, dtype=torch.float32, device=self.device)


class ImageRewardScore:
    """ImageReward v1.0's raw score by the `image-reward` package, one image at a time, in an environment of its own."""

    def __init__(self, model_id="ImageReward-v1.0", device="cpu", dtype=torch.float32):
        try:
            import ImageReward
        except ImportError as e:
            raise UsageError(f"imagereward needs the image-reward package and transformers<4.56 ({e}); serve it from "
                             f"an environment of its own (README, Rewards) and pass --reward "
                             f"remote:http://HOST:PORT/imagereward") from None
        self.model, self.device = ImageReward.load(model_id, device=str(device)), device

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None):
        scores = [float(self.model.score(prompt, im)) for prompt, im in zip(prompts, pil_images(images))]
        return torch.tensor(scores, dtype=torch.float32, device=self.device)


REWARDS = {"toy": ToyReward, "jpeg": JpegCompressibility, "pickscore": PickScore, "clipscore": CLIPScore,
           "clipscore-h": CLIPScoreH, "hpsv2": HPSv2, "aesthetic": Aesthetic, "ocr": OCRScore,
           "imagereward": ImageRewardScore, "toy-soft": lambda device="cpu": ToyReward(device, soft=True)}


def short_reward_name(name: str) -> str:
    """A metrics key for a --reward term: the registry name, or remote_NAME for remote:http://HOST:PORT/NAME."""
    return f"remote_{name.rsplit('/', 1)[-1]}" if name.startswith("remote:") else name


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """'pickscore:1.0,clipscore:0.5' -> [('pickscore', 1.0), ('clipscore', 0.5)]; a bare name has weight 1.
    A remote scorer is named by its URL, remote:http://HOST:PORT/NAME, with an optional :WEIGHT after NAME."""
    out = {}
    for part in [p.strip() for p in (spec or "").split(",")]:
        if part.lower().startswith("remote:"):
            head, _, last = part[len("remote:"):].rpartition("/")
            last, _, w = last.partition(":")
            name, bad = f"remote:{head}/{last}", True
            with contextlib.suppress(ValueError):  # an unclosed [, a port that is not a number in 1-65535
                url = urllib.parse.urlsplit(name[7:])
                bad = not url.hostname or url.port == 0
            if bad or not (head.startswith(("http://", "https://")) and head.count("/") >= 2 and last) or name in out:
                raise UsageError(f"bad or repeated remote reward {part!r} in --reward {spec!r}; write "
                                 f"remote:http://HOST:PORT/NAME[:WEIGHT] (a PORT in 1-65535)")
        else:
            name, _, w = part.partition(":")
            name = name.strip().lower()
            if name not in REWARDS or name in out:
                raise UsageError(f"unknown or repeated reward {name!r} in --reward {spec!r}; "
                                 f"known rewards: {', '.join(REWARDS)}, or remote:http://HOST:PORT/NAME")
        out[name] = math.nan
        with contextlib.suppress(ValueError):
            out[name] = float(w) if w else 1.0
        if not math.isfinite(out[name]):
            raise UsageError(f"bad weight {w!r} for reward {name!r} in --reward {spec!r}; use name:number")
        if abs(out[name]) > torch.finfo(torch.float32).max:
            raise UsageError(f"weight {w} for reward {name!r} in --reward {spec!r} is beyond float32, where rewards "
                             f"are summed: use a smaller weight")
    return list(out.items())


def hub_file(repo_or_folder: str, filename: str) -> str:
    """A file of a hub repository (downloaded once into the hub cache), or of a local folder."""
    if Path(repo_or_folder).is_dir():
        return str(Path(repo_or_folder) / filename)
    from huggingface_hub import hf_hub_download
    return hf_hub_download(repo_or_folder, filename)


SCORER_FILES = {PickScore: (("yuvalkirstain/PickScore_v1", "config.json"), (CLIP_H, "preprocessor_config.json")),
                CLIPScore: ((CLIP_L, "config.json"),), HPSv2: (("xswu/HPSv2", "HPS_v2.1_compressed.pt"),
                                                              (CLIP_H, "config.json")),
                CLIPScoreH: (("apple/DFN5B-CLIP-ViT-H-14", "open_clip_pytorch_model.bin"), (CLIP_H, "config.json")),
                Aesthetic: (("camenduru/improved-aesthetic-predictor", "sac+logos+ava1-l14-linearMSE.pth"),
                            (CLIP_L, "config.json")), OCRScore: (("stepfun-ai/GOT-OCR-2.0-hf", "config.json"),)}


def check_scorer_files(names):
    """Refuses, while HF_HUB_OFFLINE is set, a scorer of `names` whose SCORER_FILES are not in the hub cache."""
    from huggingface_hub import constants, try_to_load_from_cache
    for name in names if constants.HF_HUB_OFFLINE else ():
        for repo, filename in SCORER_FILES.get(REWARDS.get(name), ()):
            if not isinstance(try_to_load_from_cache(repo, filename), str):
                raise UsageError(f"--reward {name} needs {repo} ({filename}), not in the hub cache while offline "
                                 f"(HF_HUB_OFFLINE): download it with `hf download {repo}`, or set HF_HUB_OFFLINE=0")


def pil_images(images: torch.Tensor) -> list:
    """(N,3,H,W) in [0, 1] -> N 8-bit RGB PIL images."""
    from PIL import Image
    return [Image.fromarray(a) for a in _to_uint8(images).permute(0, 2, 3, 1).numpy()]


def clip_preprocess(images: torch.Tensor, config: dict) -> torch.Tensor:
    """CLIPImageProcessor's steps on [0, 1] tensors on their device, from its to_dict() config: bicubic antialiased
    resize (to height x width, or of the shortest side), centre crop (floor offsets, as transformers), normalise."""
    x, size, crop = images.float(), config["size"], config["crop_size"]
    if size.get("height") is not None:
        size = (size["height"], size["width"])
    else:
        s, (h, w) = size["shortest_edge"], x.shape[-2:]
        size = (s, int(s * w / h)) if h <= w else (int(s * h / w), s)
    x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    (ch, cw), (h, w) = (crop["height"], crop["width"]), x.shape[-2:]
    return normalise(x[..., (h - ch) // 2:(h - ch) // 2 + ch, (w - cw) // 2:(w - cw) // 2 + cw], config)


def resize_max_size(images: torch.Tensor, size: int) -> torch.Tensor:
    """open_clip's ResizeMaxSize (hpsv2's preprocessing) on [0, 1] tensors: a bicubic antialiased resize of the longer
    side to `size`, the other to round(side * scale), then zeros padded around it to size x size (odd: bottom right)."""
    (h, w), scale = images.shape[-2:], size / max(images.shape[-2:])
    new = (round(h * scale), round(w * scale))
    x = F.interpolate(images.float(), size=new, mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    ph, pw = size - new[0], size - new[1]
    return F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))


def normalise(x: torch.Tensor, config: dict) -> torch.Tensor:
    """(x - image_mean) / image_std per channel, from an image processor's to_dict() config."""
    mean, std = (torch.tensor(config[k], device=x.device).view(1, -1, 1, 1) for k in ("image_mean", "image_std"))
    return (x - mean) / std


# open_clip CLIP -> transformers CLIPModel names: outside the residual blocks, then inside one ({}: q, k, v of in_proj)
_OPENCLIP_TOP = {"visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight", "logit_scale": "logit_scale",
                 "visual.class_embedding": "vision_model.embeddings.class_embedding",
                 "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
                 "visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight",
                 "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
                 "positional_embedding": "text_model.embeddings.position_embedding.weight"} | {
    f"{a}.{p}": f"{b}.{p}" for a, b in [("visual.ln_pre", "vision_model.pre_layrnorm"),
                                        ("visual.ln_post", "vision_model.post_layernorm"),
                                        ("ln_final", "text_model.final_layer_norm")] for p in ("weight", "bias")}
_OPENCLIP_BLOCK = {"attn.in_proj_weight": "self_attn.{}_proj.weight", "attn.in_proj_bias": "self_attn.{}_proj.bias"} | {
    f"{a}.{p}": f"{b}.{p}" for a, b in [("ln_1", "layer_norm1"), ("attn.out_proj", "self_attn.out_proj"),
                                        ("ln_2", "layer_norm2"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")]
    for p in ("weight", "bias")}


def openclip_model(path: str, config_id: str, quick_gelu: bool, dtype: torch.dtype):
    """The open_clip checkpoint at `path` (tensors, or {"state_dict": ...} as HPS saves them; weights_only) as a
    transformers CLIPModel of `config_id`'s architecture: packed in_proj [q; k; v] rows split, `x @ proj` matrices
    transposed into Linear weights, `module.` dropped; a weight missing or extra is a ValueError naming it."""
    from transformers import CLIPConfig, CLIPModel
    ckpt, state = torch.load(path, map_location="cpu", weights_only=True), {}
    for key, value in ckpt.get("state_dict", ckpt).items():
        name = key.removeprefix("module.")
        tower, _, rest = name.partition("transformer.resblocks.")
        index, _, inner = rest.partition(".")
        if name in _OPENCLIP_TOP:
            state[_OPENCLIP_TOP[name]] = value.t().contiguous() if name in ("visual.proj", "text_projection") else value
        elif tower in ("visual.", "") and index.isdigit() and inner in _OPENCLIP_BLOCK:
            target = f"{'vision' if tower else 'text'}_model.encoder.layers.{int(index)}.{_OPENCLIP_BLOCK[inner]}"
            for part, chunk in zip("qkv", value.chunk(3)) if inner.startswith("attn.in_proj") else [("", value)]:
                state[target.format(part)] = chunk
        else:
            state[key] = value  # unknown: named as it is by the check below
    config = CLIPConfig.from_pretrained(config_id)
    if quick_gelu:
        config.text_config.hidden_act = config.vision_config.hidden_act = "quick_gelu"
    with torch.device("meta"):  # the architecture only: CLIP-H's own weights are never downloaded
        model = CLIPModel(config)
    expected = set(model.state_dict())
    if wrong := sorted(expected - set(state)) + sorted(set(state) - expected):
        raise ValueError(f"{path}: {wrong[0]!r} is missing from the checkpoint or not in the CLIPModel of "
                         f"{config_id} ({len(wrong)} keys differ)")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    for emb in (model.vision_model.embeddings, model.text_model.embeddings):  # non-persistent: in no state dict
        emb.position_ids = torch.arange(emb.position_ids.shape[-1]).expand(1, -1)
    if meta := [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]:
        raise RuntimeError(f"openclip_model: {meta[0]!r}, new in this transformers' CLIPModel, was not loaded")
    return model


def read_prompt_file(path: str, model: str) -> list[dict]:
    """A UTF-8 prompt file's records (.txt or .jsonl in any case, .gz gzipped, a BOM skipped), else a UsageError naming
    file and line: unreadable, a bad .jsonl line or split, a toy prompt without colour or shape, no training prompts."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"prompt file {path!r} does not exist: pass --prompts with a .txt (one prompt a line) or "
                         f".jsonl (objects with a 'prompt' key) file")
    try:
        text = (gzip.decompress(p.read_bytes()) if p.suffix.lower() == ".gz" else p.read_bytes()).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UsageError(f"prompt file {path!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                         f"{e.start}): save it as UTF-8") from None
    except (OSError, EOFError) as e:  # a .gz cut short or not gzip
        raise UsageError(f"prompt file {path!r} does not read as gzip ({one_line(e)}): write it again") from None
    recs = []
    for n, ln in enumerate(text.split("\n"), 1):  # at \n alone: a JSON string may hold U+2028, U+0085, ...
        if not ln.strip():
            continue
        rec = {"prompt": ln.strip()}
        if p.name.lower().removesuffix(".gz").endswith(".jsonl"):
            rec = None
            with contextlib.suppress(json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep
                rec = json.loads(ln)
            if not (isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and rec["prompt"].strip()):
                raise UsageError(f"{path}:{n} is not a JSON object with a non-empty string 'prompt' key")
            if rec.get("split", "train") not in ("train", "eval"):
                raise UsageError(f"{path}:{n} has split {rec['split']!r}: use 'train' or 'eval' (or leave it out)")
        if model == "toy" and not all(toy_parse(rec["prompt"], strict=False)):  # checked now, not when the reward runs
            raise UsageError(f"{path}:{n}: {rec['prompt']!r} is not a toy prompt: name one of the colours "
                             f"{list(TOY_COLORS)} and one of the shapes {list(TOY_SHAPES)}")
        recs.append(rec)
    if not recs:
        raise UsageError(f"prompt file {path!r} holds no prompts")
    if any("split" in r for r in recs) and not any(r.get("split", "train") == "train" for r in recs):
        raise UsageError(f"prompt file {path!r} has no training prompts: mark some 'split': 'train' (records without "
                         f"a split train too)")
    return recs


# --prompts NAME -> (train, held-out), each (path, git blob id): shipped gzipped in assets/prompt_sets (the id of its
# bytes before gzip), else Flow-GRPO's fetched; HPDv2's (file,) fetched
RAW_GITHUB, FLOW_GRPO, HPDV2 = "https://raw.githubusercontent.com", "yifan123/flow_grpo", "ymhao/HPDv2"
REVISIONS = {FLOW_GRPO: "9745241cf1101407e9b518dd4f10498092150522", HPDV2: "bb0f2563e451e11c3f376b2ba93615db00e042e1"}
PROMPT_SETS = {"pickscore": (("pickscore/train.txt.gz", "a437bd921c03fbc00c4e7ce148ae2d28fcd6e49b"),
                             ("pickscore/test.txt.gz", "45f05231b969fb5f74c8debd606b22cd3be27f8e")),
               "hpdv2": (("train.json",), ("test.json",)),
               "ocr": (("dataset/ocr/train.txt", "3ce0521b77b0a9031191d66ecc36ebaaf27a3922"),
                       ("ocr/test.txt.gz", "8deb4f8d8f2e863f45353354243669b3c991a6a2")),
               "geneval": (("dataset/geneval/train_metadata.jsonl", "0b97e8a6802c08fc7537cd00c76ae79c851bddcb"),
                           ("geneval/test_metadata.jsonl.gz", "27cdaf5cc1356fe15aeadbb8df55682ca74228f0")),
               "drawbench": (("drawbench/train.txt.gz", "c24820ee4cbadd948f6db5b45fb52d6fc4370894"),
                             ("drawbench/test.txt.gz", "8d96e7cf7017ce6ce299a6eec96e21467a2ac7aa"))}


def prompt_set(spec: str, model: str) -> tuple[list[dict], list[dict]]:
    """--prompts NAME (NAME@REVISION in args.json): its (train, eval) records; HPDv2's records give their prompts."""
    name, _, rev = spec.partition("@")
    if rev not in ("", revision := REVISIONS[HPDV2 if name == "hpdv2" else FLOW_GRPO]) or model == "toy":
        raise UsageError(f"--prompts {spec}: " + ("the toy model's prompts are its own: leave --prompts out" if model
                                                  == "toy" else f"this code reads {revision}: pass --prompts {name}"))
    files = [prompt_file(name, revision, source) for source in PROMPT_SETS[name]]
    if name != "hpdv2":
        return read_prompt_file(files[0], model), read_prompt_file(files[1], model)
    try:  # a JSON list of records (image pairs), each with its "prompt"; neither split empty
        sets = [list(dict.fromkeys(r["prompt"] for r in json.loads(Path(f).read_text()))) for f in files]
        if not all(sets) or not all(isinstance(p, str) and p.strip() for s in sets for p in s):
            raise ValueError("an empty split or prompt")
        return tuple([{"prompt": p} for p in s] for s in sets)
    except (OSError, ValueError, RecursionError, TypeError, KeyError):
        raise UsageError(f"{' or '.join(files)} is not HPDv2's list of records, each with a non-empty string 'prompt' "
                         f"(both splits holding some): delete it") from None


def prompt_file(name: str, revision: str, source: tuple) -> str:
    """A set's file: shipped, or in the hub cache, else fetched there; checked at every use against its git blob id
    (pinned; a shipped file's before gzip) or its hash (HPDv2's: the hub keeps a file under it, its size checked on the
    download; a cache copied without links keeps the blob of the same bytes, under that hash)."""
    import urllib.request
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache
    path, hub = Path(constants.HF_HUB_CACHE, "prompt-sets", FLOW_GRPO, revision, source[0]), dict(
        repo_id=HPDV2, filename=source[0], repo_type="dataset", revision=revision)
    shipped = source[0].endswith(".gz")  # in assets/prompt_sets; the fetched are not gzipped
    try:
        if shipped:
            path = ASSETS / "prompt_sets" / source[0]
        elif name == "hpdv2":  # an unreachable hub: one line at once, not after retries (offline: LocalEntryNotFound)
            if not constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(**hub), str):
                get_hf_file_metadata(hf_hub_url(**hub))
            path = Path(hf_hub_download(**hub))
        elif path.exists() or constants.HF_HUB_OFFLINE:
            path.stat()  # offline, a file not cached: FileNotFoundError
        else:
            data = urllib.request.urlopen(f"{RAW_GITHUB}/{FLOW_GRPO}/{revision}/{source[0]}", timeout=60).read()
            if source[1] not in content_ids(data):
                raise ValueError(f"not git blob {source[1]}")
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, data)
    except Exception as e:  # noqa: BLE001 - urllib, http.client (IncompleteRead: cut short), the hub raise many kinds
        why = "not in the hub cache while offline" if constants.HF_HUB_OFFLINE else f"not fetched ({one_line(e)})"
        raise UsageError(f"--prompts {name} needs {source[0]}, {why}: fetch it with `HF_HUB_OFFLINE=0 python common.py "
                         f"fetch-prompts {name}` (a failed download keeps nothing)") from None
    ids = ()
    with contextlib.suppress(OSError, EOFError):  # a FIFO in its place is not read (it would wait); gzip cut short
        ids = content_ids((gzip.decompress if shipped else bytes)(path.read_bytes())) if path.is_file() else ()
    pinned = source[1] if name != "hpdv2" else path.resolve().name if path.is_symlink() else next(
        (i for i in ids if (path.parents[2] / "blobs" / i).is_file()), "the hub's blob of its bytes")
    if pinned not in ids:
        raise UsageError(f"--prompts {name}: {path} is not the file pinned ({pinned}), changed or damaged since: " + (
            "restore it (git checkout -- assets/prompt_sets)" if shipped else
            f"delete it, then fetch it with `HF_HUB_OFFLINE=0 python common.py fetch-prompts {name}`"))
    return str(path)


def content_ids(data: bytes) -> tuple[str, str]:
    """The ids of a file's bytes: its git blob id (Flow-GRPO's pins) and sha256 (the hub's name of an LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(), hashlib.sha256(data).hexdigest()


# ---- Appendix A. The toy world: "a red triangle" on a 16x16 canvas, a rule-based reward with partial credit ----
TOY_COLORS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.25, 1.0),
              "yellow": (1.0, 1.0, 0.0), "white": (1.0, 1.0, 1.0)}
TOY_SHAPES = ("circle", "square", "triangle", "cross")
TOY_SIZE = 16                 # pixels per side
TOY_HALF_SIZE = (0.28, 0.40)  # shape half-size as a fraction of the canvas, drawn uniformly
# Pre-training sees each colour with two shapes; RL trains and evaluates on the other 10 pairs, which it must compose.
TOY_SEEN = {(c, TOY_SHAPES[(i + j) % 4]) for i, c in enumerate(TOY_COLORS) for j in (0, 1)}
TOY_PAIRS = [(c, s) for c in TOY_COLORS for s in TOY_SHAPES]
TOY_HELD_OUT = [p for p in TOY_PAIRS if p not in TOY_SEEN]


def toy_prompt(color: str, shape: str) -> str:
    return f"a {color} {shape}"


def toy_parse(prompt: str, strict: bool = True) -> tuple[str | None, str | None]:
    """The first colour and shape word of a prompt, each None if absent (strict: a ValueError)."""
    words = prompt.lower().split()
    color, shape = next((w for w in words if w in TOY_COLORS), None), next((w for w in words if w in TOY_SHAPES), None)
    if strict and (color is None or shape is None):
        raise ValueError(f"toy prompt {prompt!r} must name one of the colours {list(TOY_COLORS)} and one of the "
                         f"shapes {list(TOY_SHAPES)}")
    return color, shape


def toy_coverage(shape: str, half: float, size: int = TOY_SIZE, supersample: int = 4) -> np.ndarray:
    """Fraction of each pixel covered by a centred shape of half-size `half` (fraction of the canvas)."""
    c = (np.arange(size * supersample) + 0.5) / (size * supersample) * 2 - 1  # pixel centres in [-1, 1], y downwards
    y, x = np.meshgrid(c, c, indexing="ij")
    h = 2 * half
    masks = {"circle": x**2 + y**2 <= h**2, "square": np.maximum(np.abs(x), np.abs(y)) <= 0.85 * h,
             "triangle": (y >= -h) & (y <= h) & (np.abs(x) <= (y + h) / 2),  # apex up, base down
             "cross": ((np.abs(x) <= h / 3) & (np.abs(y) <= h)) | ((np.abs(y) <= h / 3) & (np.abs(x) <= h))}
    if shape not in masks:
        raise ValueError(f"unknown toy shape {shape!r}")
    return masks[shape].reshape(size, supersample, size, supersample).mean((1, 3))


def _toy_templates(halves) -> np.ndarray:
    """(shapes, sizes, 16*16): each shape's pixel coverage at each half-size."""
    return np.stack([np.stack([toy_coverage(s, h).ravel() for h in halves]) for s in TOY_SHAPES])


_TOY_MASKS = _toy_templates(np.linspace(0.2, 0.48, 15)) > 0.5  # toy_classify's, wider than the drawn sizes


def toy_classify(images: torch.Tensor) -> tuple[list[str | None], list[str | None]]:
    """(colour, shape) of images (N, 3, 16, 16) in [0, 1]. Foreground: brightest channel > 0.5. Colour: the palette
    entry nearest the mean foreground colour; shape: the template (any size) of best IoU if >= 0.5; None if absent."""
    palette, colors, shapes = np.asarray(list(TOY_COLORS.values())), [], []
    for im in images.detach().float().cpu().numpy():
        fg = im.max(0) > 0.5
        if fg.sum() == 0:
            colors.append(None), shapes.append(None)
            continue
        colors.append(list(TOY_COLORS)[int(np.argmin(((palette - im[:, fg].mean(1)) ** 2).sum(1)))])
        m = fg.ravel()
        iou = ((_TOY_MASKS & m).sum(-1) / np.maximum((_TOY_MASKS | m).sum(-1), 1)).max(1)  # best size per shape
        shapes.append(TOY_SHAPES[int(iou.argmax())] if iou.max() >= 0.5 else None)
    return colors, shapes


def toy_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """GenEval-like partial credit: 0.5 for the right colour + 0.5 for the right shape. (N,) float32."""
    colors, shapes = toy_classify(images)
    r = [0.5 * (c == tc) + 0.5 * (s == ts) for c, s, (tc, ts) in zip(colors, shapes, map(toy_parse, prompts))]
    return torch.tensor(r, dtype=torch.float32)


def toy_accuracy(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Strict accuracy: 1 if both colour and shape are right, else 0. (N,) float32."""
    return (toy_reward(images, prompts) == 1.0).float()


_TOY_SOFT_MASKS = torch.tensor(_toy_templates(np.linspace(*TOY_HALF_SIZE, 25)), dtype=torch.float32)  # every 0.005
_TOY_PALETTE_GAP = min(math.dist(a, b) for a, b in itertools.combinations(TOY_COLORS.values(), 2))  # 1.0


def toy_soft_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """toy_reward made continuous, like a preference model's score: 0.5 colour + 0.5 shape, each in [0, 1]. (N,).
    With w the brightest channel per pixel (the shape's coverage: every palette colour is drawn at full brightness):
      colour = max(0, 1 - |c_hat - c| / d), c_hat = sum_p x_p w_p / sum_p w_p^2 (x = c_hat w, least squares), c the
               prompt's colour, d = 1 the smallest gap between palette colours;
      shape  = max(0, (IoU - 0.5) / 0.5), the best soft IoU sum_p min(w_p, m_p) / sum_p max(w_p, m_p) with the
               prompt's shape m at the drawn sizes (at 0.5 or less toy_classify sees no shape either).
    A render of the target scores 0.98 to 1, a circle asked to be a square 0.84, another colour 0.5, a blank 0."""
    target = [toy_parse(p) for p in prompts]
    x = images.detach().float().cpu().nan_to_num(0.0).clamp(0, 1).flatten(2)           # (N, 3, P)
    w = x.amax(1)                                                                       # (N, P)
    c_hat = (x * w[:, None]).sum(-1) / (w ** 2).sum(-1, keepdim=True).clamp_min(1e-12)  # (N, 3)
    c = torch.tensor([TOY_COLORS[tc] for tc, _ in target], dtype=torch.float32)
    colour = (1 - (c_hat - c).norm(dim=1) / _TOY_PALETTE_GAP).clamp(0, 1)
    m = _TOY_SOFT_MASKS[[TOY_SHAPES.index(ts) for _, ts in target]]                    # (N, sizes, P)
    iou = (torch.minimum(w[:, None], m).sum(-1) / torch.maximum(w[:, None], m).sum(-1)).amax(1)
    shape = ((iou - 0.5) / 0.5).clamp(0, 1)
    return 0.5 * colour + 0.5 * shape


class ToyTokenizer:
    """Word-level tokenizer for the toy grammar: <bos> words <eos> <pad>..., unknown words <unk>. The eos id is not
    2: CLIPTextModel pools at the first eos_token_id, but at argmax(input_ids) when eos_token_id == 2."""

    specials, max_length = ["<pad>", "<bos>", "<unk>", "<eos>"], 8
    pad_id, bos_id, unk_id, eos_id = range(4)
    vocab = {w: i for i, w in enumerate([*specials, "a", "an", "the", *TOY_COLORS, *TOY_SHAPES])}

    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((len(prompts), self.max_length), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            toks = [self.vocab.get(w, self.unk_id) for w in p.lower().split()][: self.max_length - 2]
            ids[i, : len(toks) + 2] = torch.tensor([self.bos_id, *toks, self.eos_id])
        return ids, (ids != self.pad_id).long()


def toy_unpack(tokens: torch.Tensor) -> torch.Tensor:
    """Tokens (B, 64, 12) in [-1, 1], 2x2 patches as FLUX packs latents, back to images (B, 3, 16, 16) in [0, 1]."""
    return ((rearrange(tokens, "b (h w) (c p q) -> b c (h p) (w q)", h=TOY_SIZE // 2, p=2, q=2) + 1) / 2).clamp(0, 1)


class ToyAdapter(FluxFamilyAdapter):
    """The toy world's model: pixels packed 2x2 are the latents, so decode is unpacking; float32 weights."""

    lora_targets, weights_dtype = FLUX_LORA_TARGETS, torch.float32

    def __init__(self, transformer, text_encoder, device, dtype=torch.float32):
        self.text_encoder = text_encoder.to(device).eval().requires_grad_(False)
        self.transformer, self.tokenizer = transformer.to(device), ToyTokenizer()
        self.device, self.dtype, self.resolution = device, dtype, TOY_SIZE
        rows, cols = torch.meshgrid(torch.arange(TOY_SIZE // 2.0), torch.arange(TOY_SIZE // 2.0), indexing="ij")
        self.img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).flatten(0, 1).to(device)  # (N, 3) as FLUX
        self.txt_ids = torch.zeros(self.tokenizer.max_length, 3, device=device)

    @torch.no_grad()
    def encode(self, prompts):
        ids, mask = self.tokenizer(prompts)
        out = self.text_encoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        return {"prompt_embeds": out.last_hidden_state.float(), "pooled": out.pooler_output.float()}

    def noise(self, n, generator=None):
        return torch.randn((n, (TOY_SIZE // 2) ** 2, 12), generator=generator).to(self.device)

    def sigmas(self, num_steps):
        return uniform_sigmas(num_steps)  # unshifted: at 16x16 pixels there is no resolution to shift for

    @torch.no_grad()
    def decode(self, x):
        return toy_unpack(x.float())

    def save_lora(self, path, state_dict):
        from diffusers.loaders.lora_pipeline import FluxLoraLoaderMixin  # FluxPipeline warns without torchvision
        FluxLoraLoaderMixin.save_lora_weights(path, transformer_lora_layers=state_dict)


# ---- Appendix B. Offline pipelines: the real classes with random weights ----
# --model-path random / random:N: the published pipelines from assets/architectures/<family>/, without weights (README)
ARCHITECTURES = ASSETS / "architectures"


def architecture(family: str, blocks: int | None = None) -> dict:
    """{component: config} of the published "flux", "sd3" or "flux2" pipeline; `blocks`: that many transformer blocks of
    each kind (SD3's dual attention in its first 13) and 1-layer text encoders, widths unchanged."""
    configs = {p.parent.name: json.loads(p.read_text()) for p in (ARCHITECTURES / family).glob("*/config.json")}
    if blocks:
        t = configs["transformer"]
        t.update({k: blocks for k in ("num_layers", "num_single_layers") if k in t})
        if t.get("dual_attention_layers"):
            t["dual_attention_layers"] = list(range(min(blocks, len(t["dual_attention_layers"]))))
        for name, config in configs.items():
            if name.startswith("text_encoder"):  # a saved Qwen3 config lists a layer type per layer
                config["num_layers" if "d_model" in config else "num_hidden_layers"] = 1
                config.pop("layer_types", None)
    return configs


def build_pipeline(family: str, configs: dict, seed: int = 0, device="cpu", dtype=torch.float32):
    """The `family` pipeline built from `configs` (`architecture`'s, or any sizes), random weights from `seed` on
    `device` ("meta": shapes only) in the dtypes _freeze_pipeline keeps for `dtype`; tokenizers, scheduler: assets."""
    folder = ARCHITECTURES / family
    index = json.loads((folder / "model_index.json").read_text())
    classes = {name: getattr(importlib.import_module(v[0]), v[1]) for name, v in index.items()
               if isinstance(v, list) and v[0]}
    parts = {name: cls.from_pretrained(folder / name) for name, cls in classes.items() if name not in configs}
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        for name in sorted(configs, key=lambda n: (n != "transformer", n)):  # each cast as built: one float32 at a time
            cls, config = classes[name], configs[name]
            module = cls.from_config(config) if hasattr(cls, "from_config") else cls(cls.config_class(**config))
            dtype_kept = {"transformer": weight_dtype(dtype), "vae": torch.float32}.get(name, dtype)
            parts[name] = _cast(module, dtype_kept).eval()
    return getattr(importlib.import_module("diffusers"), index["_class_name"])(**parts)


def random_depth(model_path: str | None, family: str) -> int | None:
    """N of --model-path random:N, None for random or another path; refused if malformed or past `family`'s depth."""
    if not (model_path or "").startswith("random"):
        return None
    depth = model_path.removeprefix("random:")
    most = max(architecture(family)["transformer"].get(k, 0) for k in ("num_layers", "num_single_layers"))
    if model_path != "random" and not (depth.isdecimal() and 1 <= int(depth) <= most):
        raise UsageError(f"--model-path {model_path}: write random (full depth) or random:N with 1 <= N <= {most} "
                         f"blocks")
    return int(depth) if model_path != "random" else None


def _cast(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module`'s floating tensors in `dtype`, but those transformers keeps float32 under fp16 (T5's `wo`)."""
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or [] if dtype == torch.float16 else [])
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if t.is_floating_point():  # tensor by tensor: no round trip, and diffusers' no-op cast warning never raised
            t.data = t.data.to(torch.float32 if keep & set(name.split(".")) else dtype)
    for m in module.modules():  # a buffer that is a view (SD3's pos_embed) would keep its float32 base alive: copied
        m._buffers.update({k: b.clone() for k, b in m._buffers.items() if b is not None and b._base is not None})
    return module


if __name__ == "__main__":
    fetch = Parser(prog="common.py fetch-prompts", description="fetch prompt sets into the hub cache, for offline use")
    fetch.add_argument("sets", nargs="+", choices=list(PROMPT_SETS), metavar="NAME", help=", ".join(PROMPT_SETS))
    commands = {"serve-reward": serve_reward, "evaluate": evaluate_main, "fetch-prompts": lambda argv: [print(
        n, "prompts, train and held out:", *map(len, load_prompts(n, "sd3"))) for n in fetch.parse_args(argv).sets]}
    if not (sys.argv[1:2] and sys.argv[1] in commands):
        report("usage: python common.py serve-reward | evaluate | fetch-prompts [--help]", 2)
    sys.stdout, sys.stderr = _Stream(sys.stdout), _Stream(sys.stderr)  # SIGTERM and SIGINT: _stopped, set on import
    with one_line_errors(f"common.py {sys.argv[1]}"):
        commands[sys.argv[1]](sys.argv[2:])
