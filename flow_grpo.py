"""Flow-GRPO (arXiv 2505.05470): online RL for flow-matching models. The deterministic ODE sampler is replaced by an
SDE with the same marginals, so every denoising step is a Gaussian policy with a tractable log-prob; GRPO then trains
on whole trajectories with per-step PPO-clipped ratios, group-relative advantages and a KL penalty to the pre-trained
model. The official code's speed recipes are modes of it: Flow-GRPO-Fast (`--sde-window`, the SDE and the training on
a few steps) and Coefficients-Preserving Sampling (`--sde-type cps`). It is the baseline the other trainers copy: the
blocks marked `# >>> shared: NAME` are theirs too (README, Fork a method).

Simplifications / readings (vs the paper and the official code), each detailed where it is implemented:
  1. group_advantages: a population std (np.std, as the official code), of all the iteration's rewards or the group's.
  2. ref_mu: the KL is the exact one between the two step Gaussians, element-averaged (the official code's differs
     by a factor per step, so SD3's beta is scaled down).
  3. The update shuffles whole rollout micro-batches, so the first update is bitwise on-policy (ratio 1).
  4. Samples with zero advantage are kept (the SD3 scripts drop them; their loss is zero anyway).
  5. --updates-per-rollout optimizer steps per iteration (official: 2, by gradient accumulation); the EMA steps once per
     optimizer step (the official scripts step it per minibatch with the step count: an effective decay d^k).
  6. sde_window: Flow-GRPO-Fast's window is drawn per rollout micro-batch from the rank's seeded generator.
  7. --sde-type cps takes the official CPS log-prob, -mean (x' - mu)^2, so a clip range means there what it means in
     the official CPS configs (1e-5): its log-ratio is 2 std^2 times the Gaussian's (common.cps_step).

Run:
  python flow_grpo.py                                    # toy model, CPU, a few minutes
  torchrun --nproc_per_node=8 flow_grpo.py --model flux  # full scale, the paper's settings (README, Recipes)
  python flow_grpo.py --sde-window 3 --sde-type cps --noise-level 0.8 --clip-range 1e-5 --beta 0 --lr 1e-4  # Fast, toy

Tags such as [Flow-GRPO Eq. 9] cite equations where they were checked (arXiv v5), else the part of the paper.
Notation: t_k = sigmas[k] (t = 1 is noise); z_k = latents[:, k]; a = noise_level; l = log_prob; rho = ratio;
A = advantages; beta = KL weight; G = group_size; B = prompts per rank; T = sample_steps; N = samples per rank;
mb = micro_batch; W = sde_window, k0 = the first step of a micro-batch's window; mu = a step's mean (mean: an average).
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import common  # first: a Ctrl-C while torch loads is then one line (common's start-up)
from common import field

import torch
from einops import rearrange
from tqdm import tqdm


# ---- 0. Config: the defaults are the toy run; MODEL_DEFAULTS holds what differs at full scale ----
@dataclass
class Args:
    # --- Flow-GRPO ---
    iterations: int = field(30, "training iterations (rollout + update)", at_least=0, at_most=10**9)
    prompts_per_step: int = field(16, "prompts per iteration, over all ranks", at_least=1, at_most=100_000)
    group_size: int = field(8, "samples per prompt (G)", at_least=2, at_most=100_000)
    micro_batch: int = field(32, "samples per forward pass, in rollout and update alike", at_least=1)
    lr: float = field(3e-4, "AdamW learning rate", at_least=1e-12, at_most=1)
    sample_steps: int = field(10, "denoising steps T of a training rollout", at_least=1, at_most=1000)
    noise_level: float = field(0.7, "SDE noise level a in g = a sqrt(t / (1 - t)); with --sde-type cps, a in the "
                                    "std s sin(a pi / 2), in (0, 1]", at_least=1e-12)
    timestep_fraction: float = field(0.99, "train the first int(T * fraction) steps of each trajectory",
                                     at_least=0, at_most=1)
    updates_per_rollout: int = field(2, "optimizer steps per iteration, one per minibatch of the rollout", at_least=1)
    clip_range: float = field(1e-4, "PPO ratio clip epsilon", at_least=0)
    adv_clip: float = field(5.0, "advantages are clamped to [-adv_clip, adv_clip]", at_least=1e-12)
    beta: float = field(0.03, "weight of the KL to the reference (pre-trained) policy", at_least=0)
    global_std: bool = field(True, "advantages divided by the std of all the iteration's rewards (else the group's)")
    reward_norm: str = field("sum", "with several rewards: sum (advantage of their weighted sum, as Flow-GRPO) or "
                                    "per-reward (each reward's advantage, then their weighted sum)",
                             choices=common.REWARD_NORMS)
    sde_type: str = field("flow", "the noisy step: flow (Flow-GRPO's SDE) or cps (Coefficients-Preserving Sampling)",
                          choices=("flow", "cps"))
    sde_window: int = field(0, "Flow-GRPO-Fast: the SDE on W consecutive steps only, drawn per rollout micro-batch, "
                               "the ODE on the rest, and exactly those W steps trained; 0 = the SDE on every step",
                            at_least=0, at_most=1000)
    sde_window_range: str | None = field(None, "LO,HI: each window lies in steps LO to HI - 1, its start drawn in "
                                               "[LO, HI - W]; HI <= T - 1 (default: 0,T//2)")
    # >>> shared: args
    model: str = field("toy", f"model: {', '.join(common.MODELS)}", choices=common.MODELS)
    model_path: str | None = field(None, "hub id or local folder overriding the model's default weights; random: the "
                                         "published architecture with random weights, random:N with N blocks")
    reward: str = field("toy", "reward spec 'name[:weight],...' from: " + ", ".join(common.REWARDS) + "; or a "
                               "scorer served by common.py serve-reward: remote:http://HOST:PORT/NAME[:weight]")
    prompts: str | None = field(None, "prompt file (.txt, or .jsonl with 'prompt'), or a paper's prompt set: " +
                                ", ".join(common.PROMPT_SETS) + " (README, Recipes); toy: leave unset (its grammar)")
    seed: int = field(0, "random seed (each rank adds its rank)", at_least=0, at_most=2**63 - 1)
    time_budget: float = field(0.0, "also stop once training (evaluation excluded) has taken this many seconds; "
                                    "0 = no limit", at_least=0)
    output_dir: str | None = field(None, "run folder (default runs/<method>-<model>-<time>)")
    resume: str | None = field(None, "run or checkpoint folder to continue from; auto: the newest checkpoint in "
                                     "--output-dir, or a fresh start there")
    eval_every: int = field(10, "evaluate every N iterations (and at 0 and the end); 0 = never", at_least=0)
    eval_images: int = field(200, "held-out images per evaluation (prompts cycle, fixed seeds)",
                             at_least=1, at_most=100_000)
    eval_steps: int = field(20, "ODE steps at evaluation", at_least=1, at_most=1000)
    save_every: int = field(50, "checkpoint every N iterations (and at the end and on SIGTERM / SIGINT); 0 = only "
                                "then", at_least=0)
    max_bad_steps: int = field(3, "stop after this many optimizer steps in a row with a NaN / inf gradient norm "
                                  "(each is skipped)", at_least=1)
    wandb: bool = field(False, "also log to Weights & Biases")
    threads: int | None = field(None, "CPU threads (CPU runs only; default: the cores this process may use, shared "
                                      "among torchrun's ranks, less those other processes keep busy)",
                                at_least=1, at_most=1024)
    resolution: int | None = field(None, "image size in pixels (the toy's is 16)",
                                   at_least=16, at_most=4096)
    guidance_scale: float | None = field(None, "CFG scale (sd3, flux2) or guidance embedding (flux); the toy has none",
                                         at_least=0)
    max_sequence_length: int | None = field(None, "prompt tokens (flux, flux2: 512, sd3: 128); longer prompts are cut",
                                            at_least=1, at_most=512)
    dtype: str | None = field(None, "compute dtype on any device: fp32, bf16, or fp16 (autocast over float32 "
                                    "transformer weights, loss scaling); default: on a GPU sd3 fp16, the others bf16; "
                                    "on a CPU fp32", choices=tuple(common.DTYPES))
    offload_encoders: bool = field(False, "keep the text encoders on the CPU between encodes (T5-XXL: 9.5 GB in bf16, "
                                          "Qwen3-4B 8 GB)")
    weight_decay: float = field(1e-4, "AdamW weight decay", at_least=0)
    grad_clip: float = field(1.0, "gradient-norm clip", at_least=1e-12)
    lora_rank: int = field(0, "LoRA rank; 0 = full fine-tuning", at_least=0, at_most=4096)
    lora_alpha: float = field(0.0, "LoRA alpha", at_least=0)
    ema: bool = field(False, "keep an EMA of the trained weights for evaluation and checkpoints")
    gradient_checkpointing: bool = field(False, "recompute activations in the backward pass")
    compile: bool = field(False, "torch.compile each repeated transformer block, once per block class: faster after "
                                 "the first iteration, which compiles (README, Precision)")
    fsdp: bool = field(False, "shard full fine-tuning (--lora-rank 0) over the torchrun processes with FSDP2; "
                              "LoRA runs replicate with DDP")
    preflight: bool = field(False, "run and check one iteration in a temporary folder and project the run's cost, "
                                   "then stop (exit 1 if a check FAILed): writes only preflight.json in the run "
                                   "folder (README, Before a long run)")
    # common.py also reads two fields that each method defines above this block, with its own toy defaults: keep
    # `iterations` and `prompts_per_step` under these names (the loop, the run folder, --preflight read them)
    # <<< shared: args


# Full scale: what differs from the toy defaults above, from [Flow-GRPO App. B.3] and the official configs (beta:
# reading 2; fewer sampling than evaluation steps: [Flow-GRPO §4, Denoising Reduction]). As the official code, SD3.5
# computes in fp16 (--dtype's GPU default) with a 128-token T5 prompt (the pipeline's default is 256).
# FLUX.2-klein (flux2) is this project's choice, as no paper trains it: the SD3.5 recipe (a base model with true CFG,
# as klein's base is) with klein's CFG 4 and its pipeline's 50 steps at evaluation, on one 80 GB GPU: a sixth of the
# prompts an iteration, as many per GPU as the paper's runs on 8 or more (README, Defaults per model).
MODEL_DEFAULTS = {
    "sd3": {
        "reward": "pickscore",
        "prompts": "pickscore",               # Pick-a-Pic prompts, the paper's
        "eval_every": 30,
        "eval_images": 256,
        "eval_steps": 40,
        "resolution": 512,
        "guidance_scale": 4.5,
        "lora_rank": 32,
        "lora_alpha": 64,
        "ema": True,
        "gradient_checkpointing": True,
        "iterations": 1000,
        "prompts_per_step": 48,
        "group_size": 24,
        "micro_batch": 8,
        "beta": 0.001,
    },
    "flux": {
        "reward": "pickscore",
        "prompts": "pickscore",               # as the official FLUX config
        "eval_every": 30,
        "eval_images": 256,
        "eval_steps": 28,
        "resolution": 512,
        "guidance_scale": 3.5,
        "lora_rank": 64,
        "lora_alpha": 128,
        "ema": True,
        "gradient_checkpointing": True,
        "iterations": 1000,
        "prompts_per_step": 48,
        "group_size": 24,
        "micro_batch": 4,
        "sample_steps": 6,
        "noise_level": 0.9,
        "beta": 0.0,
    },
    "flux2": {
        "reward": "pickscore",
        "prompts": "pickscore",
        "eval_every": 30,
        "eval_images": 256,
        "eval_steps": 50,                 # klein's pipeline's
        "resolution": 512,
        "guidance_scale": 4.0,            # the base model's CFG, its pipeline's
        "lora_rank": 32,
        "lora_alpha": 64,
        "ema": True,
        "gradient_checkpointing": True,
        "iterations": 1000,
        "prompts_per_step": 8,            # one GPU: a sixth of the paper's 48 prompts
        "group_size": 24,
        "micro_batch": 8,
        "beta": 0.001,
    },
}


# ---- 1. Method functions (the step math is common.sde_step or common.cps_step; the loop below is the method) ----
def group_advantages(rewards: torch.Tensor, G: int, global_std: bool) -> torch.Tensor:
    """[Flow-GRPO Eq. 4] (R - group mean) / (std + 1e-4) for rewards (N,) in groups of G consecutive rows -> (N,).
    Reading 1: the std is a population one (np.std, as the official code), of all the iteration's rewards on all ranks
    (global_std, the official default) or of the group's own. Each rank owns whole groups: the mean needs no gather."""
    grouped = rearrange(rewards, "(b g) -> b g", g=G)
    std = common.all_gather_cat(rewards).std(correction=0) if global_std else grouped.std(1, correction=0, keepdim=True)
    return rearrange((grouped - grouped.mean(1, keepdim=True)) / (std + 1e-4), "b g -> (b g)")


def clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, clip_range: float) -> torch.Tensor:
    """[Flow-GRPO Eq. 5] The per-sample PPO-clip loss max(-A rho, -A clip(rho, 1 - e, 1 + e)): the negated clipped
    objective, to minimise. (n,)."""
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_range, 1 + clip_range))


def step_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, kl: torch.Tensor, t, s,
              args) -> tuple[torch.Tensor, dict]:
    """[Flow-GRPO Eq. 5] The loss of one denoising step t -> s of a micro-batch, from its log-probs under theta and
    theta_old, advantages and KL to the reference (n,) each: the mean of the clipped policy-gradient term plus beta KL,
    and what the update logs (`stats.add`; the `ratio-log` block reads ratio_dev, clip_frac, kl and approx_kl). The
    shared update calls it for every trained step: a method that changes only the loss changes this function."""
    ratio = torch.exp(log_prob - old_log_prob)
    pg = clipped_objective(ratio, advantages, args.clip_range)
    loss = (pg + args.beta * kl).mean()
    return loss, dict(loss=loss, pg_loss=pg.mean(), kl=kl.mean(), ratio_dev=(ratio - 1).abs().max(),
                      clip_frac=((ratio - 1).abs() > args.clip_range).float().mean(),
                      approx_kl=0.5 * ((log_prob - old_log_prob) ** 2).mean())


def sde_window(spec: str | None, W: int, T: int) -> tuple[int, int]:
    """[Flow-GRPO-Fast] --sde-window-range 'LO,HI' (None: 0,T//2) -> (LO, HI - W), the window starts' range, after
    checking that W fits and that the last step stays an ODE step; a UsageError names the flag. The rollout runs the
    SDE on the W steps from a start drawn in that range, the exact Euler step on the rest, and stores and trains only
    the window (its log-probs computed once, in the rollout). Reading 6: the start is drawn per rollout micro-batch (one
    call of the official pipeline) from the rank's seeded generator, not Python's `random` once per call on each rank,
    so a resume is bitwise. HI <= T - 1 keeps the last step, too sharp to train, an ODE step: the official configs'
    ranges do, the official code does not check it. `--timestep-fraction` is unused then, as in the official code."""
    try:
        lo, hi = (int(x) for x in (spec or f"0,{T // 2}").split(","))
    except ValueError:
        raise common.UsageError(f"--sde-window-range {spec!r} must be two integers LO,HI, e.g. 0,5") from None
    if hi > T - 1:
        raise common.UsageError(f"--sde-window-range {lo},{hi} reaches past step T - 1 = {T - 1} of --sample-steps "
                                f"{T}: the last step stays an ODE step (its density is too sharp to train); lower HI")
    if lo < 0 or W > hi - lo:
        raise common.UsageError(f"--sde-window {W} does not fit in --sde-window-range {lo},{hi}: need 0 <= LO and "
                                f"W <= HI - LO (widen the range or shorten the window)")
    return lo, hi - W


def main(args: Args) -> dict:
    # ---- 2. Setup: every input is checked before a model loads ----
    # >>> shared: validate
    # reads nothing; defines rt
    rt = common.setup_training(args)                         # the flags every trainer has, then torchrun and seeds
    # <<< shared: validate
    B, G = args.prompts_per_step // rt.world_size, args.group_size  # prompts per rank, group size
    N = B * G                                                # samples per rank per iteration
    mb = args.micro_batch
    per_update = common.micro_batches_per_update(N, mb, args.updates_per_rollout)
    T = args.sample_steps
    T_train = int(T * args.timestep_fraction)                # the official code trains the first int(0.99 T) steps
    if not (0 < args.timestep_fraction <= 1 and T_train >= 1):
        raise common.UsageError(f"--timestep-fraction {args.timestep_fraction} of --sample-steps {T} trains no step")
    cps = args.sde_type == "cps"
    if cps and args.noise_level > 1:
        raise common.UsageError(f"--noise-level {args.noise_level} must be in (0, 1] with --sde-type cps (its std is "
                                f"s sin(a pi / 2)); the official CPS configs use 0.8")
    if args.sde_window:                                      # [Flow-GRPO-Fast] train exactly the window's steps
        starts, T_train = sde_window(args.sde_window_range, args.sde_window, T), args.sde_window
    elif cps and T_train == T:
        raise common.UsageError(f"--sde-type cps cannot train the last step (its std is 0 at t = 0): lower "
                                f"--timestep-fraction {args.timestep_fraction} below 1, or pass --sde-window")
    window = f", SDE window {args.sde_window} starting in {list(range(starts[0], starts[1] + 1))}" \
        if args.sde_window else ""
    common.print0(f"ranks {rt.world_size} | prompts/rank B={B} | group G={G} | samples/rank N={N} | micro-batch {mb} "
                  f"({N // mb} per rollout) | updates/iteration {args.updates_per_rollout} | steps T={T}, trained "
                  f"{T_train}{window} | {args.sde_type} step")

    # >>> shared: setup-run
    # reads nothing; defines train_prompts, eval_prompts, reward_terms, run
    train_prompts, eval_prompts = common.load_prompts(args.prompts, args.model)
    reward_terms = common.parse_reward_spec(args.reward)    # a bad --reward is refused before the run folder
    if args.preflight:                                       # every check above passed: one iteration, checked (README)
        return common.preflight(main, args)
    run = common.prepare_run(args, rt, Path(__file__).stem)  # the folder, and the checkpoint that --resume continues
    # <<< shared: setup-run
    # >>> shared: setup-model
    # reads nothing; defines reward_fn, adapter, transformer, params
    reward_fn = common.WeightedReward(reward_terms, rt.device, args.reward_norm)
    adapter = common.load_model(args.model, rt, args.model_path, args.resolution, args.guidance_scale,
                                args.max_sequence_length, args.offload_encoders)
    common.instrument(adapter)                               # the work counters every iteration logs (nfe_fwd, ...)
    transformer = adapter.transformer
    params = common.add_lora(transformer, args.lora_rank, args.lora_alpha, adapter.lora_targets)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    # <<< shared: setup-model
    lora = args.lora_rank > 0
    ref = common.frozen_copy(transformer) if args.beta > 0 and not lora else None  # full FT: frozen reference
    # >>> shared: setup-train
    # reads ref; defines params, optimizer, ema, net, guard
    if args.lora_rank == 0:  # full fine-tuning: float32 master weights; --fsdp shards them and the reference per block
        params = common.full_finetuning(transformer, rt, ref, shard=args.fsdp)
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay, eps=1e-8)
    ema = common.EMA(params, offload=args.lora_rank == 0 and not args.fsdp) if args.ema else None  # full: CPU memory
    net = torch.nn.parallel.DistributedDataParallel(transformer) if rt.distributed and not args.fsdp else transformer
    guard = common.StepGuard(args.max_bad_steps, rt.device,  # skips non-finite steps on every rank; fp16: loss scaling
                             loss_scaling=rt.dtype == torch.float16)
    # <<< shared: setup-train
    # the clock, log, evaluations and checkpoints; --resume loads into params, optimizer, EMA and the loss scale (a
    # method's own tensors too, passed as extra_state={"name": tensors})
    loop = common.TrainingLoop(args, run, rt, adapter, params, optimizer, ema, eval_prompts, reward_fn, guard)
    sigmas = adapter.sigmas(T)                               # (T+1,) t_0 = 1 ... t_T = 0
    t_cap = float(sigmas[1])                                 # replaces t = 1 in g's denominator
    # the policy's noisy step from t to s, (next_x, log_prob, mu, std), and its (mu, std) alone
    if cps:                                                  # [CPS] std = s sin(a pi / 2), log-prob: reading 7
        policy_step = functools.partial(common.cps_step, noise_level=args.noise_level)
        policy_mean_std = functools.partial(common.cps_mean_std, noise_level=args.noise_level)
    else:                                                    # [Flow-GRPO Eq. 9]
        policy_step = functools.partial(common.sde_step, noise_level=args.noise_level, t_cap=t_cap)
        policy_mean_std = functools.partial(common.sde_mean_std, noise_level=args.noise_level, t_cap=t_cap)

    def ref_mu(x, t, s, cond):
        """The step's mu under the reference policy (no grad): LoRA switched off, or the frozen copy. Reading 2: the KL
        of the update is the exact one between the two step Gaussians [Flow-GRPO §4, closed-form KL], element-averaged
        like the log-prob, mean (mu - mu_ref)^2 / (2 std^2) with std = g sqrt(h); the official code divides by 2 g^2
        (no h), which only rescales beta per step (SD3's beta default is scaled down accordingly)."""
        with torch.no_grad(), (common.lora_disabled(transformer) if lora else contextlib.nullcontext()):
            v = adapter.velocity(ref if ref is not None else transformer, x, t, cond)
        return policy_mean_std(x, v, t, s)[0]

    # >>> shared: loop
    # reads loop; defines it, metrics
    for it in tqdm(range(run.start, args.iterations + 1), desc=Path(__file__).stem, disable=not rt.is_main):
        metrics = loop.begin(it)                             # evaluation when due; None once the last line is logged
        if metrics is None:
            break
        # <<< shared: loop

        # ---- 3a. Rollout: SDE sampling with the current policy (theta_old = theta), no grad [Flow-GRPO Eq. 9] ----
        # >>> shared: iteration-start
        # reads B; defines tic, gen, batch, records, texts
        tic = time.time()
        gen = common.make_generator(args.seed, rt.rank, it)  # every draw of this rank and iteration
        batch = common.sample_prompts(train_prompts, args.prompts_per_step, common.make_generator(args.seed, it))
        records = batch[rt.rank * B:(rt.rank + 1) * B]     # (B,) this rank's prompts with their metadata
        texts = [r["prompt"] for r in records]
        # <<< shared: iteration-start
        owners = [r for r in records for _ in range(G)]      # (N,) prompt-major: a group is G consecutive rows
        cond = common.cond_repeat(adapter.encode(texts), G)
        latents, log_probs, finals = [], [], []              # (N, T_sde+1, ...), (N, T_sde), (N, ...) z_T
        trained = []                                         # per micro-batch: the grid steps of its stored ones
        transformer.eval()
        with torch.no_grad():
            for i in loop.each(range(0, N, mb)):            # a signal stops the run here (README, Fork a method)
                c = common.cond_select(cond, slice(i, i + mb))
                # [Flow-GRPO-Fast] the window: W steps from k0, drawn anew for each rollout micro-batch
                k0 = int(torch.randint(starts[0], starts[1] + 1, (1,), generator=gen)) if args.sde_window else 0
                sde_steps = range(k0, k0 + args.sde_window) if args.sde_window else range(T)
                z = adapter.noise(mb, gen)
                zs, lps = [], []
                for k in range(T):
                    v = adapter.velocity(net, z, sigmas[k], c)
                    if k == k0:
                        zs.append(z)
                    if k in sde_steps:                       # [Flow-GRPO Eq. 9] or [CPS]: its sample and log-prob
                        z, lp, _, _ = policy_step(z, v, sigmas[k], sigmas[k + 1], generator=gen)
                        zs.append(z)
                        lps.append(lp)
                    else:                                    # [Flow-GRPO-Fast] outside the window: the exact ODE
                        z = common.ode_step(z, v, sigmas[k], sigmas[k + 1])
                latents.append(torch.stack(zs, 1))
                log_probs.append(torch.stack(lps, 1))
                finals.append(z)
                trained.append(sde_steps[:T_train])
        latents, log_probs, finals = torch.cat(latents), torch.cat(log_probs), torch.cat(finals)
        t_rollout = time.time() - tic

        # ---- 3b. Rewards -> group-relative advantages [Flow-GRPO Eq. 4] ----
        tic = time.time()
        with torch.no_grad():
            images = torch.cat([adapter.decode(finals[i:i + mb]) for i in range(0, N, mb)])
            rewards, parts = reward_fn(images, [r["prompt"] for r in owners], owners, batch_size=mb)
        advantages = reward_fn.advantages(parts, lambda r: group_advantages(r, G, args.global_std))
        advantages = advantages.clamp(-args.adv_clip, args.adv_clip)
        t_reward = time.time() - tic

        # ---- 3c. Policy update: PPO-clipped ratio per step, KL to the reference [Flow-GRPO Eq. 5] ----
        # >>> shared: update
        # reads N, mb, loop, per_update, cond, advantages, trained, latents, sigmas, policy_step, ref_mu, log_probs;
        #   defines tic, order, stats, u, n_step, minibatch, m, idx, c, A, j, k, sync, z, z_next, v, lp, mu, std_k, kl,
        #   loss, logged, stepped, grad_norm, t_update
        tic = time.time()
        transformer.train()
        order = torch.randperm(N // mb, generator=gen)       # shuffle whole micro-batches: the first is on-policy
        stats = common.UpdateStats()
        for u in loop.each(range(args.updates_per_rollout)):  # a signal before the first optimizer step stops here
            n_step = it * args.updates_per_rollout + u + 1    # this optimizer step's number in the run, from 1
            minibatch = order[u * per_update:(u + 1) * per_update].tolist()  # the step's rollout micro-batches
            for m in minibatch:
                idx = slice(m * mb, (m + 1) * mb)
                c, A = common.cond_select(cond, idx), advantages[idx]
                for j, k in enumerate(trained[m]):          # the j-th stored step is step k of the grid
                    sync = m == minibatch[-1] and j == len(trained[m]) - 1  # the step's last backward all-reduces
                    z, z_next = latents[idx, j], latents[idx, j + 1]
                    with common.no_sync(net, not sync):
                        v = adapter.velocity(net, z, sigmas[k], c)
                        _, lp, mu, std_k = policy_step(z, v, sigmas[k], sigmas[k + 1], next_x=z_next)
                        kl = common.gaussian_kl(mu, ref_mu(z, sigmas[k], sigmas[k + 1], c), std_k) \
                            if args.beta > 0 else torch.zeros_like(lp)
                        loss, logged = step_loss(lp, log_probs[idx, j], A, kl, sigmas[k], sigmas[k + 1], args)
                        guard.backward(loss / (len(minibatch) * len(trained[m])))  # one step's activations alive
                    stats.add(**logged)
            # >>> shared: step
            # reads stats, n_step; defines stepped, grad_norm
            stepped, grad_norm = guard.step(optimizer, params, args.grad_clip)  # skipped if not finite
            stats.stepped(grad_norm)
            if ema and stepped:
                ema.step(n_step)
            # <<< shared: step
        t_update = time.time() - tic
        # <<< shared: update

        # ---- 3d. Metrics ----
        zero_std = (rearrange(rewards, "(b g) -> b g", g=G).std(1) < 1e-6).float().mean()
        # >>> shared: log
        # reads stats, rewards, parts, zero_std, t_rollout, t_reward, t_update, loop; defines nothing
        metrics.update(stats.metrics())                      # each key's mean over the backward passes; grad_norm
        metrics.update({
            "reward_mean": common.all_reduce_mean(rewards.mean()).item(),
            "reward_std": rewards.std().item(),
            **reward_fn.means(parts),
            "zero_std_frac": common.all_reduce_mean(zero_std).item(),
            "t_rollout": t_rollout, "t_reward": t_reward, "t_update": t_update,
            **loop.work(),                                   # the iteration's work: nfe_fwd, reward_calls, ...
        })
        # <<< shared: log
        # >>> shared: ratio-log
        # reads stats; defines nothing
        metrics.update(ratio_dev_max=stats.max("ratio_dev"), ratio_dev_first_update=stats.max("ratio_dev", step=0),
                       clip_frac_first_update=stats.mean("clip_frac", step=0),  # the first optimizer step is
                       kl_first_update=stats.max("kl", step=0))                 # exactly on-policy
        if len(stats.steps) > 1:                             # its micro-batches scored after one step: that step's size
            metrics.update(ratio_dev_second_update=stats.max("ratio_dev", step=1),
                           approx_kl_second_update=stats.mean("approx_kl", step=1))
        # <<< shared: ratio-log

        # >>> shared: loop-end
        # reads loop; defines nothing
        # ---- 3e. Log the line, checkpoint every --save-every iterations ----
        loop.end(metrics)
    return loop.finish()                                     # the final checkpoint
    # <<< shared: loop-end


# ---- 4. Entry point ----
if __name__ == "__main__":
    common.run_cli(main, Args, MODEL_DEFAULTS)
