"""V-GRPO (arXiv 2604.23380): online RL for flow-matching models without an MDP. The whole generation is one action:
rollouts use the plain ODE sampler, and the intractable log-likelihood log pi(o | c) of a final sample o is replaced by
minus its conditional pre-training loss (a weighted ELBO), estimated on N_MC (time, noise) pairs; GRPO then trains with
one importance ratio per sample. What makes this surrogate work where earlier ELBO surrogates (DDPO-IS, FPO) failed is
variance reduction (a prompt's G samples share their pairs, the times are stratified over the sampler's grid, the loss
is an x-prediction MSE divided by its own stop-gradient L1) and step-size control (a small ratio clip, a KL to the
behaviour policy theta_old, a tanh soft-clip of the advantages).

Differences from flow_grpo.py: ODE rollouts keep only the final latents (no SDE, no per-step log-probs); the update's
ratio is elbo_ratio's, one per sample from the surrogate on shared pairs, at N_MC forwards per sample instead of T; the
KL is to theta_old (kl_to_old: no reference network); soft-clipped advantages with the group's unbiased std
(unbiased_group_advantages); the paper's NFE accounting and variance diagnostics are logged.

Simplifications / readings (where the paper leaves a choice), each detailed where it is implemented:
  1. stratified_times: the rollout's own grid without t = 0, in N_MC contiguous strata (or --pair-grid-steps').
  2. pair_losses: each evaluation divides by its own detached L1, so rho = 1 exactly at theta = theta_old.
  3. --updates-per-rollout N_grad minibatches, each sample trained once (NFE_theta = N_MC); N_grad = 1 is on-policy.
  4. kl_to_old: the squared x-prediction difference averaged over elements and pairs, then samples.
  5. soft_clip replaces the +-adv-clip clamp (--soft-clip 0: the clamp).
  6. The settings the paper does not give for FLUX, and SD3.5's stage 1: MODEL_DEFAULTS.
  7. x_predictions: all N_MC pairs of a micro-batch go through one forward; with CFG the surrogate's velocity is CFG's.
  8. draw_pairs: one set per group, the paper's (the official code is reported to share one over the batch).

Run: python v_grpo.py (toy, CPU); python v_grpo.py --model sd3 (one GPU, stage 1 of the SD3.5-M curriculum);
torchrun --nproc_per_node=8 v_grpo.py --model flux (full scale; README, Recipes).
Notation: as flow_grpo.py's; o_i = samples[i]; t_j, eps_j = taus[i, j], eps[i, j]; N_MC = mc_pairs (J in code);
x_hat_ij = x_hat[i, j]; l_ij = pair_losses; L_i(theta) = surrogate[i]; L_i(theta_old) = surrogate_old[i];
eps_clip = clip_range; kappa (the paper's eta) = soft_clip; N_grad = updates_per_rollout; T_pair = pair_grid_steps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import common  # first: a Ctrl-C while torch loads is then one line (common's start-up)
from common import field

import torch
from einops import rearrange, repeat
from tqdm import tqdm


# ---- 0. Config: the defaults are the toy run; MODEL_DEFAULTS holds what differs at full scale ----
@dataclass
class Args:
    # --- V-GRPO ---
    iterations: int = field(20, "training iterations (rollout + update)", at_least=0, at_most=10**9)
    prompts_per_step: int = field(16, "prompts per iteration, over all ranks", at_least=1, at_most=100_000)
    group_size: int = field(8, "samples per prompt (G)", at_least=2, at_most=100_000)
    micro_batch: int = field(32, "samples per forward pass, in rollout and update alike", at_least=1)
    lr: float = field(1e-4, "AdamW learning rate", at_least=1e-12, at_most=1)
    sample_steps: int = field(10, "denoising steps T of a training rollout", at_least=1, at_most=1000)
    mc_pairs: int = field(4, "(t, eps) pairs N_MC per sample in the ELBO surrogate")
    share_pairs: str = field("group", "who shares a set of (t, eps) pairs: group (the G samples of a prompt, as the "
                                      "paper), batch (all samples of the iteration, on every rank, as the official "
                                      "code is reported to), sample (nobody: ablation)",
                             choices=("group", "batch", "sample"))
    stratified: bool = field(True, "one time per contiguous chunk of the grid (else uniform over the grid)")
    pair_grid_steps: int | None = field(None, "times come from adapter.sigmas(T_pair) minus t = 0; default: "
                                                   "sample-steps", at_least=1, at_most=1000)
    self_normalize: bool = field(True, "divide each pair's x-prediction MSE by its stop-gradient L1")
    updates_per_rollout: int = field(2, "gradient steps N_grad per iteration, one per rollout minibatch", at_least=1)
    clip_range: float = field(1e-2, "PPO ratio clip epsilon (inert with one update per rollout)", at_least=0)
    soft_clip: float = field(3.0, "soft-clip kappa: A <- kappa tanh(A / kappa); 0 = clamp to +-adv-clip", at_least=0)
    adv_clip: float = field(5.0, "with --soft-clip 0, advantages are clamped to [-adv_clip, adv_clip]", at_least=0)
    beta: float = field(0.0, "weight of the KL (x-prediction MSE) to the behaviour policy theta_old", at_least=0)
    global_std: bool = field(False, "advantages divided by the std of all the iteration's rewards (else the group's)")
    reward_norm: str = field("sum", "with several rewards: sum (advantage of their weighted sum) or per-reward (each "
                                    "reward's advantage, then their weighted sum, as MixGRPO)",
                             choices=common.REWARD_NORMS)
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


# Full scale: what differs from the toy defaults above, from the paper where it gives them. Reading 6, where it does
# not: for FLUX its SD3.5 LoRA recipe (r 32, alpha 64, lr 3e-4), MixGRPO's protocol (720 px, group 12, 16 ODE steps,
# 300 iterations, rewards normalised one by one and summed), N_grad 2 with clip 1e-2 so the clip is active, and kappa 3
# (its reduced-step FLUX run). MixGRPO's script trains on HPS v2.1, PickScore and ImageReward; that V-GRPO does too is
# our reading (its FLUX baselines are MixGRPO's numbers); ImageReward needs an environment of its own (add
# remote:http://HOST:PORT/imagereward, README, Rewards). SD3 is stage 1 of its SD3.5-M curriculum (no CFG, 40 ODE
# steps, 48 x 24, N_grad 1, kappa 3, no clip or KL) at 512 px (DiffusionNFT's; 720 is unconfirmed) on HPS v2.1 +
# PickScore + CLIP, raw scores summed (Flow-GRPO's way, whose code DiffusionNFT builds on): the weights, the
# normalisation and the CLIP (clipscore is CLIP ViT-L/14; DiffusionNFT fetches LAION's CLIP-H) are unconfirmed.
# FLUX.2-klein (flux2) is this project's choice, as no paper trains it: the SD3.5 recipe (a base model with true CFG,
# as klein's base is) with klein's CFG 4 and its pipeline's 50 steps at evaluation, on one 80 GB GPU: a sixth of the
# prompts an iteration, as many per GPU as the paper's runs on 8 or more (README, Defaults per model).
MODEL_DEFAULTS = {
    "sd3": {
        "reward": "hpsv2,pickscore,clipscore",   # stage 1's rewards (reading 6)
        "prompts": "pickscore",               # stage 1's Pick-a-Pic prompts
        "eval_every": 30,
        "eval_images": 256,
        "eval_steps": 40,
        "resolution": 512,
        "guidance_scale": 1.0,            # no CFG (reading 7)
        "lora_rank": 32,
        "lora_alpha": 64,
        "ema": True,
        "gradient_checkpointing": True,
        "iterations": 150,
        "prompts_per_step": 48,
        "group_size": 24,
        "micro_batch": 8,
        "lr": 3e-4,
        "sample_steps": 40,
        "updates_per_rollout": 1,         # stage 1: fully on-policy, hence the soft-clip
    },
    "flux": {
        "reward": "hpsv2,pickscore",      # MixGRPO's rewards less ImageReward (reading 6)
        "prompts": "hpdv2",                   # HPDv2 prompts (MixGRPO's protocol)
        "eval_every": 30,
        "eval_images": 256,
        "eval_steps": 28,
        "resolution": 720,
        "guidance_scale": 3.5,
        "lora_rank": 32,
        "lora_alpha": 64,
        "ema": True,
        "gradient_checkpointing": True,
        "iterations": 300,
        "prompts_per_step": 32,
        "group_size": 12,
        "micro_batch": 4,
        "lr": 3e-4,
        "sample_steps": 16,
        "reward_norm": "per-reward",      # MixGRPO's protocol: per-reward advantages, summed
    },
    "flux2": {
        "reward": "hpsv2,pickscore,clipscore",
        "prompts": "pickscore",
        "eval_every": 30,
        "eval_images": 256,
        "eval_steps": 50,                 # klein's pipeline's
        "resolution": 512,
        "guidance_scale": 1.0,            # no CFG, as stage 1 (reading 7)
        "lora_rank": 32,
        "lora_alpha": 64,
        "ema": True,
        "gradient_checkpointing": True,
        "iterations": 150,
        "prompts_per_step": 8,            # one GPU: a sixth of the paper's 48 prompts
        "group_size": 24,
        "micro_batch": 8,
        "lr": 3e-4,
        "sample_steps": 40,
        "updates_per_rollout": 1,
    },
}


# ---- 1. Method functions ----
BATCH_PAIRS_KEY = 10**9  # generator key of --share-pairs batch: no rank or iteration number reaches it


def stratified_times(grid: torch.Tensor, n_mc: int, n_sets: int, generator: torch.Generator,
                     stratified: bool = True) -> torch.Tensor:
    """[V-GRPO, stratified timestep sampling] (n_sets, n_mc) times from the sampler's grid without t = 0: its points
    are split into n_mc contiguous strata of near-equal size (tensor_split) and one point is drawn uniformly inside
    each, so every set covers high, middle and low noise (n_mc <= the points: main checks --mc-pairs).
    stratified=False draws n_mc points uniformly over the whole grid. Reading 1: the grid is the rollout's own,
    t_0 = 1 ... t_{T-1} (at t = 0 x_hat = o exactly and the self-normalised loss is 0/0); whether the paper's
    "sampler grid" is a finer one is not stated: --pair-grid-steps T_pair stratifies over adapter.sigmas(T_pair)."""
    points = grid[grid > 0]                                  # (T_pair,) t_0 = 1 > ... > t_{T_pair-1} > 0
    if not stratified:
        return points[torch.randint(len(points), (n_sets, n_mc), generator=generator)]
    strata = torch.arange(len(points)).tensor_split(n_mc)
    idx = torch.stack([c[torch.randint(len(c), (n_sets,), generator=generator)] for c in strata], 1)  # (n_sets, n_mc)
    return points[idx]


def draw_pairs(grid: torch.Tensor, n_mc: int, B: int, G: int, noise_fn, share: str, stratified: bool,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[V-GRPO, group-shared timestep-noise pairs] N_MC pairs (t_j, eps_j) for each of the B*G samples
    (prompt-major). With share="group" the G samples of a prompt get the same pairs, so the differences of
    their surrogates come from the samples o_i, not from Monte-Carlo noise; "batch" gives every sample one
    set, "sample" gives each its own. noise_fn(n, generator) draws n initial-noise-shaped latents.
    Returns taus (B*G, n_mc) and eps (B*G, n_mc, ...). Reading 8: the paper shares one set within a group
    (`--share-pairs group`, the default); its official code is reported to share one set over the whole batch and
    all ranks (`--share-pairs batch`), which we could not check in that code."""
    n_sets = {"group": B, "batch": 1, "sample": B * G}[share]
    taus = stratified_times(grid, n_mc, n_sets, generator, stratified)       # (n_sets, J)
    eps = rearrange(noise_fn(n_sets * n_mc, generator), "(s j) ... -> s j ...", j=n_mc)  # (n_sets, J, ...)
    r = B * G // n_sets                                                      # consecutive samples sharing a set
    return repeat(taus, "s j -> (s r) j", r=r).to(eps.device), repeat(eps, "s j ... -> (s r) j ...", r=r)


def x_predictions(adapter, net, o: torch.Tensor, taus: torch.Tensor, eps: torch.Tensor, cond: dict) -> torch.Tensor:
    """[V-GRPO, ELBO surrogate] x_ij = (1 - t_j) o_i + t_j eps_j (the forward process applied to the sample) and
    the x-prediction x_hat_ij = x_ij - t_j v(x_ij, t_j, c_i). o (n, ...), taus (n, J), eps (n, J, ...) -> x_hat
    (n, J, ...) in float32. Reading 7: all n*J pairs go through one forward (the ratio couples them, so their
    activations are alive together for one backward anyway); v is the adapter's, so with --guidance-scale > 1 on SD3
    it is the CFG velocity (V-GRPO trains SD3.5 without CFG, the default)."""
    J = taus.shape[1]
    t = rearrange(taus, "i j -> (i j)")                                  # (n*J,) row i*J + j: pair j of sample i
    tb = t.view(-1, *([1] * (o.dim() - 1)))
    x = (1 - tb) * repeat(o, "i ... -> (i j) ...", j=J) + tb * rearrange(eps, "i j ... -> (i j) ...")
    v = adapter.velocity(net, x, t, common.cond_repeat(cond, J))        # cond_repeat: the same (i j) order
    return rearrange(common.x0_prediction(x, v, t), "(i j) ... -> i j ...", j=J)


def pair_losses(x_hat: torch.Tensor, o: torch.Tensor, self_normalize: bool = True) -> torch.Tensor:
    """[V-GRPO, adaptive weighting] l_ij = mean_D (x_hat_ij - o_i)^2 / sg(mean_D |x_hat_ij - o_i|).
    x - o = t (v* - v), so this is the v-loss weighted by t^2, self-normalised: the stop-gradient L1 makes
    every pair's gradient of comparable size across samples and times. (n, J). Reading 2: each evaluation of L
    divides by its own detached L1, so rho = 1 exactly at theta = theta_old; the L1 is floored at 1e-12, so a pair
    with x_hat == o gives 0, not NaN."""
    d = (x_hat - o.unsqueeze(1)).flatten(2)                              # (n, J, D)
    mse = d.pow(2).mean(2)
    if not self_normalize:
        return mse
    return mse / d.abs().mean(2).detach().clamp_min(1e-12)


def elbo_ratio(surrogate: torch.Tensor, surrogate_old: torch.Tensor) -> torch.Tensor:
    """[V-GRPO, objective] rho_i = exp(L_i(theta_old) - L_i(theta)): log pi ~ -L, one ratio per sample with the mean
    over pairs inside the exp. (n,)."""
    return torch.exp(surrogate_old - surrogate)


def clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, clip_range: float) -> torch.Tensor:
    """[Flow-GRPO Eq. 5] The per-sample PPO-clip loss max(-A rho, -A clip(rho, 1 - e, 1 + e)): the negated clipped
    objective, to minimise. (n,)."""
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_range, 1 + clip_range))


def kl_to_old(x_hat: torch.Tensor, x_hat_old: torch.Tensor) -> torch.Tensor:
    """[V-GRPO, KL penalty] D_i = (1/N_MC) sum_j mean_D (x_hat_theta,ij - x_hat_theta_old,ij)^2: the KL to the
    behaviour policy at the kept pairs (reading 4). (n,)."""
    return (x_hat - x_hat_old).pow(2).flatten(2).mean(2).mean(1)


def unbiased_group_advantages(rewards: torch.Tensor, G: int, global_std: bool) -> torch.Tensor:
    """[Flow-GRPO Eq. 4] (R - group mean) / (std + 1e-4) for rewards (N,) in groups of G consecutive rows -> (N,),
    with the unbiased std of the FastVideo / DanceGRPO code V-GRPO builds on (flow_grpo.group_advantages: Flow-GRPO's
    population std), of all the iteration's rewards on all ranks (global_std) or of the group's own (the default: the
    paper's "group z-score")."""
    grouped = rearrange(rewards, "(b g) -> b g", g=G)
    std = common.all_gather_cat(rewards).std() if global_std else grouped.std(1, keepdim=True)
    return rearrange((grouped - grouped.mean(1, keepdim=True)) / (std + 1e-4), "b g -> (b g)")


def soft_clip(advantages: torch.Tensor, kappa: float) -> torch.Tensor:
    """[V-GRPO, advantage soft-clipping] A <- kappa tanh(A / kappa): linear near 0, saturating at +-kappa. On-policy
    the gradient is mean_i A_i grad L_i and raising a loss has no floor, so large |A| must not dominate."""
    return kappa * torch.tanh(advantages / kappa)


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
    J = args.mc_pairs
    T_pair = args.pair_grid_steps or T                       # adapter.sigmas(T_pair) has T_pair points above t = 0
    if not 1 <= J <= T_pair:
        raise common.UsageError(f"--mc-pairs {J} must be between 1 and the {T_pair} grid points above t = 0: change "
                                f"it, --pair-grid-steps or --sample-steps")
    common.print0(f"ranks {rt.world_size} | prompts/rank B={B} | group G={G} | samples/rank N={N} | micro-batch {mb} "
                  f"({N // mb} per rollout) | updates/iteration {args.updates_per_rollout} | ODE steps T={T} | pairs "
                  f"N_MC={J} over {T_pair} grid points, shared per {args.share_pairs}")

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
    ref = None  # no reference network: V-GRPO's KL is to theta_old, whose x-predictions are kept after the rollout
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
    pair_grid = adapter.sigmas(T_pair)                       # (T_pair+1,) the grid the pair times are drawn from

    # >>> shared: loop
    # reads loop; defines it, metrics
    for it in tqdm(range(run.start, args.iterations + 1), desc=Path(__file__).stem, disable=not rt.is_main):
        metrics = loop.begin(it)                             # evaluation when due; None once the last line is logged
        if metrics is None:
            break
        # <<< shared: loop

        # ---- 3a. Rollout: ODE sampling with the current policy (theta_old = theta), no grad [V-GRPO, one action] ----
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
        transformer.eval()
        samples = []                                         # (N, ...) o_i
        for i in loop.each(range(0, N, mb)):                # a signal stops the run here (README, Fork a method)
            samples.append(common.sample_ode(adapter, net, common.cond_select(cond, slice(i, i + mb)),
                                             adapter.noise(mb, gen), sigmas))
        samples = torch.cat(samples)
        t_rollout = time.time() - tic

        # [V-GRPO, group-shared timestep-noise pairs; ELBO surrogate] pairs drawn per prompt (or batch); then
        # L(theta_old) once, without grad, on those pairs (N_MC forwards per sample), keeping x_hat_old for the KL.
        tic = time.time()
        pair_gen = common.make_generator(args.seed, it, BATCH_PAIRS_KEY) if args.share_pairs == "batch" else gen
        taus, eps = draw_pairs(pair_grid, J, B, G, adapter.noise, args.share_pairs, args.stratified, pair_gen)
        surrogate_old, x_hat_old = [], []                    # (N,) and (N, J, ...)
        with torch.no_grad():
            for i in loop.each(range(0, N, mb)):
                idx = slice(i, i + mb)
                x_hat = x_predictions(adapter, net, samples[idx], taus[idx], eps[idx], common.cond_select(cond, idx))
                surrogate_old.append(pair_losses(x_hat, samples[idx], args.self_normalize).mean(1))
                if args.beta > 0:
                    x_hat_old.append(x_hat)
        surrogate_old = torch.cat(surrogate_old)
        x_hat_old = torch.cat(x_hat_old) if x_hat_old else None
        t_surrogate_old = time.time() - tic

        # ---- 3b. Rewards -> group-relative advantages, optionally soft-clipped [V-GRPO, advantage soft-clipping] ----
        tic = time.time()
        with torch.no_grad():
            images = torch.cat([adapter.decode(samples[i:i + mb]) for i in range(0, N, mb)])
            rewards, parts = reward_fn(images, [r["prompt"] for r in owners], owners, batch_size=mb)
        advantages = reward_fn.advantages(parts, lambda r: unbiased_group_advantages(r, G, args.global_std))
        if args.soft_clip > 0:
            advantages = soft_clip(advantages, args.soft_clip)
        else:
            advantages = advantages.clamp(-args.adv_clip, args.adv_clip)
        t_reward = time.time() - tic

        # ---- 3c. Policy update: a clipped ratio per sample, KL to theta_old [V-GRPO, objective] ----
        tic = time.time()
        transformer.train()
        order = torch.randperm(N // mb, generator=gen)       # shuffle whole micro-batches: the first is on-policy
        stats = common.UpdateStats()
        # reading 3: N_grad minibatches, one optimizer step each, as flow_grpo.py: every sample is trained once per
        # iteration, so NFE_theta = N_MC per sample whatever N_grad (the paper's "4 per gradient step"); with N_grad
        # = 1 the update is fully on-policy: rho = 1, the clip and KL inert, the gradient mean_i A_i grad L_i
        for u in loop.each(range(args.updates_per_rollout)):  # a signal before the first optimizer step stops here
            n_step = it * args.updates_per_rollout + u + 1    # this optimizer step's number in the run, from 1
            minibatch = order[u * per_update:(u + 1) * per_update].tolist()  # the step's rollout micro-batches
            for m in minibatch:
                idx = slice(m * mb, (m + 1) * mb)
                c, A = common.cond_select(cond, idx), advantages[idx]
                with common.no_sync(net, m != minibatch[-1]):  # the step's last backward all-reduces
                    x_hat = x_predictions(adapter, net, samples[idx], taus[idx], eps[idx], c)     # (mb, J, ...)
                    surrogate = pair_losses(x_hat, samples[idx], args.self_normalize).mean(1)     # (mb,) L(theta)
                    ratio = elbo_ratio(surrogate, surrogate_old[idx])
                    pg = clipped_objective(ratio, A, args.clip_range)
                    kl = kl_to_old(x_hat, x_hat_old[idx]) if args.beta > 0 else torch.zeros_like(pg)
                    loss = (pg + args.beta * kl).mean()
                    guard.backward(loss / len(minibatch))
                stats.add(loss=loss, pg_loss=pg.mean(), kl=kl.mean(), ratio_dev=(ratio - 1).abs().max(),
                          clip_frac=((ratio - 1).abs() > args.clip_range).float().mean(),
                          approx_kl=0.5 * ((surrogate - surrogate_old[idx]) ** 2).mean(), surrogate=surrogate.mean())
            # >>> shared: step
            # reads stats, n_step; defines stepped, grad_norm
            stepped, grad_norm = guard.step(optimizer, params, args.grad_clip)  # skipped if not finite
            stats.stepped(grad_norm)
            if ema and stepped:
                ema.step(n_step)
            # <<< shared: step
        t_update = time.time() - tic

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
        L_old = rearrange(surrogate_old, "(b g) -> b g", g=G)
        metrics.update({
            "adv_abs_max": advantages.abs().max().item(),
            # the paper's variance diagnostics: spread of L(theta_old) over the batch and within groups
            "surrogate_old": surrogate_old.mean().item(),
            "surrogate_cv": (surrogate_old.std() / surrogate_old.mean()).item(),
            "surrogate_group_cv": (L_old.std(1) / L_old.mean(1)).mean().item(),
            "t_surrogate_old": t_surrogate_old,
            # the paper's NFE accounting per sample: NFE_old = T + N_MC, NFE_theta = N_MC (CFG rows count twice)
            "nfe_old_per_sample": metrics["nfe_fwd"] / N, "nfe_theta_per_sample": metrics["nfe_fwd_bwd"] / N,
        })

        # >>> shared: loop-end
        # reads loop; defines nothing
        # ---- 3e. Log the line, checkpoint every --save-every iterations ----
        loop.end(metrics)
    return loop.finish()                                     # the final checkpoint
    # <<< shared: loop-end


# ---- 4. Entry point ----
if __name__ == "__main__":
    common.run_cli(main, Args, MODEL_DEFAULTS)
