"""Pro-GRPO (arXiv 2512.15347, "Expand and Prune", CVPR 2026): Flow-GRPO with a cheaper, more diverse group. Many
rewards of a GRPO group cluster near its mean: their advantages are near zero, so those trajectories cost sampling and
backprop and teach almost nothing. Optimal Variance Filtering (OVF) keeps the size-k subset of a group whose rewards
vary most. Pro-GRPO applies it during sampling: it starts an expanded group of G_max SDE trajectories per prompt and,
at a few checkpoint steps, previews each live trajectory's image with a one-step x0-prediction, scores the preview with
the training reward and keeps the OVF subset of the next funnel size (e.g. 48 -> 24 -> 12). The survivors finish, get
their true rewards and advantages over the survivors, and Flow-GRPO's loss trains on their steps.

Differences from flow_grpo.py: `--group-size` is G_max and `--funnel` / `--checkpoints` the schedule; the rollout runs
step-major over the live trajectories (the velocity at z_k serves the preview and the SDE step alike); advantages over
each prompt's survivors; the funnel's work is logged. The update, its loss and KL are flow_grpo.py's (shared blocks).

Simplifications / readings (the paper releases no code), each detailed where it is implemented:
  1. ovf_select: an exact solver, ties going to high rewards; the variance is the population one, as the paper's.
  2. A checkpoint at k previews x0_hat = z_k - t_k v_old(z_k) with the sampler's own velocity (no extra call), scored
     with the training reward (several: their weighted sum); a pruned trajectory's velocity there counts as spent.
  3. survivor_advantages: Flow-GRPO's group form over the K survivors' true rewards, no global std.
  4. Survivors train on all the steps Flow-GRPO trains, those before the checkpoints too (`trained`).
  5. parse_funnel: Static OVF (the paper's validation) is a checkpoint at T; an empty funnel is Flow-GRPO's group.
  6. Initial noises are independent per trajectory; FLUX's checkpoints {3, 4} of 6 steps are the paper's {5, 7} of 10.
  7. flops_vs_flow_grpo: transformer evaluations per sample, a forward 1, forward + backward 3, reference forward 1.

Run: python pro_grpo.py (toy, CPU); python pro_grpo.py --group-size 24 --funnel 12 --checkpoints 10 (toy, Static OVF);
torchrun --nproc_per_node=8 pro_grpo.py --model sd3 (full scale: 48 -> 24 -> 12 at steps 5, 7; README, Recipes).

Notation: as flow_grpo.py's; G_max = group_size; (K_1, ..., K) = funnel, K = funnel[-1]; k_i = checkpoints;
x0_hat = preview; R_hat = proxy rewards; S = alive (trajectory ids, prompt = id // G_max); G_base = baseline_group;
N = trained samples per rank.
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
    # --- Pro-GRPO --- (Flow-GRPO's sampler and loss, then Expand-and-Prune; --group-size is G_max)
    iterations: int = field(30, "training iterations (rollout + update)", at_least=0, at_most=10**9)
    prompts_per_step: int = field(8, "prompts per iteration, over all ranks", at_least=1, at_most=100_000)
    group_size: int = field(16, "expanded group G_max: trajectories started per prompt", at_least=2, at_most=100_000)
    micro_batch: int = field(16, "samples per forward pass, in rollout and update alike", at_least=1)
    lr: float = field(1e-4, "AdamW learning rate", at_least=1e-12, at_most=1)
    sample_steps: int = field(10, "denoising steps T of a training rollout", at_least=1, at_most=1000)
    noise_level: float = field(0.7, "SDE noise level a in g = a sqrt(t / (1 - t))", at_least=1e-12)
    timestep_fraction: float = field(0.99, "train the first int(T * fraction) steps of each trajectory",
                                     at_least=0, at_most=1)
    updates_per_rollout: int = field(2, "optimizer steps per iteration, one per minibatch of the rollout", at_least=1)
    clip_range: float = field(1e-4, "PPO ratio clip epsilon", at_least=0)
    adv_clip: float = field(5.0, "advantages are clamped to [-adv_clip, adv_clip]", at_least=1e-12)
    beta: float = field(0.03, "weight of the KL to the reference (pre-trained) policy", at_least=0)
    reward_norm: str = field("sum", "with several rewards: sum (advantage of their weighted sum, as Flow-GRPO) or "
                                    "per-reward (each reward's advantage, then their weighted sum)",
                             choices=common.REWARD_NORMS)
    funnel: str = field("8,4", "alive trajectories per prompt after each checkpoint, e.g. '24,12', decreasing "
                               "from --group-size; the last is the trained group K; '' = no pruning")
    checkpoints: str = field("5,7", "steps done at each checkpoint, e.g. '5,7' (one per funnel size); a checkpoint "
                                    "at T = --sample-steps filters finished images (Static OVF)")
    baseline_group: int = field(8, "Flow-GRPO group size the FLOPs proxy compares against", at_least=2)
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


# Full scale: what differs from the toy defaults above: the paper's Standard funnel 48 -> 24 -> 12 on Flow-GRPO's
# settings (FLUX's checkpoints: reading 6). The toy expands Flow-GRPO's group of 8 as the paper does 24: 16 -> 8 -> 4.
# FLUX.2-klein (flux2) is this project's choice, as no paper trains it: the SD3.5 recipe (a base model with true CFG,
# as klein's base is) with klein's CFG 4 and its pipeline's 50 steps at evaluation, on one 80 GB GPU: a sixth of the
# prompts an iteration, as many per GPU as the paper's runs on 8 or more (README, Defaults per model).
MODEL_DEFAULTS = {
    "sd3": {
        "reward": "pickscore",
        "prompts": "pickscore",               # Pick-a-Pic prompts, as Flow-GRPO
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
        "group_size": 48,
        "micro_batch": 6,
        "lr": 3e-4,
        "beta": 0.001,
        "funnel": "24,12",
        "baseline_group": 24,
    },
    "flux": {
        "reward": "pickscore",
        "prompts": "pickscore",               # as Flow-GRPO's FLUX config
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
        "group_size": 48,
        "micro_batch": 4,
        "lr": 3e-4,
        "sample_steps": 6,
        "noise_level": 0.9,
        "beta": 0.0,
        "funnel": "24,12",
        "checkpoints": "3,4",
        "baseline_group": 24,
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
        "group_size": 48,                 # on the toy's 8 prompts: one GPU, a sixth of the paper's 48
        "micro_batch": 6,
        "lr": 3e-4,
        "beta": 0.001,
        "funnel": "24,12",
        "baseline_group": 24,
    },
}


# ---- 1. Method functions ----
def ovf_select(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """[Pro-GRPO, OVF] K* = argmax_{|K| = k} Var_K(R), Var_K = (1/k) sum_{i in K} (R_i - mean_K R)^2.
    Some optimal K is the j smallest plus the k - j largest rewards (a member's variance term is convex
    in its value, so swapping it for the smallest or largest excluded value never lowers Var_K): sort,
    then score every j = 0..k in O(1) from prefix sums of R and R^2. Ties go to the smallest j.
    rewards (n,) -> indices (k,) of the kept members, ascending (so a group's order is preserved)."""
    n = len(rewards)
    if not 1 <= k <= n:
        raise ValueError(f"OVF keeps k of n rewards: need 1 <= k={k} <= n={n}")
    r = rewards.detach().double().cpu()
    order = torch.argsort(r, stable=True)
    r = r[order]                                                   # (n,) ascending
    zero = torch.zeros(1, dtype=torch.float64)
    P, Q = torch.cat([zero, r.cumsum(0)]), torch.cat([zero, (r * r).cumsum(0)])  # (n+1,) prefix sums
    j = torch.arange(k + 1)                                        # j smallest + (k - j) largest
    s1 = P[j] + P[n] - P[n - k + j]
    s2 = Q[j] + Q[n] - Q[n - k + j]
    score = k * s2 - s1 ** 2                                       # (k+1,) k^2 Var(S_j): no division, so
    best = int(torch.argmax(score))                                # grid rewards tie exactly; first max = smallest j
    return torch.cat([order[:best], order[n - k + best:]]).sort().values


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


def survivor_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """[Pro-GRPO, advantage] A_i = (R_i - mean_K R) / (std_K R + eps) over each prompt's K survivors only
    ([Flow-GRPO Eq. 4] on the survivors, eps = 1e-4; the loop clamps the result to +-adv_clip, after the sum
    over rewards with --reward-norm per-reward). Reading 3: the survivors' true rewards, not their previews'; the
    std is the population one (np.std, as Flow-GRPO's code); no global std: the paper normalises within the group.
    rewards (B, K) -> (B*K,)."""
    group_mean = rewards.mean(1, keepdim=True)
    std = rewards.std(1, correction=0, keepdim=True)       # population std, as Flow-GRPO's code
    return rearrange((rewards - group_mean) / (std + 1e-4), "b k -> (b k)")


def parse_funnel(funnel: str, checkpoints: str, group_size: int, steps: int) -> tuple[list[int], list[int]]:
    """'24,12' and '5,7' -> ([24, 12], [5, 7]) after checking the schedule; a clear error names the flag. Reading 5:
    checkpoint k = "k steps done"; Static OVF (the paper's validation experiment) is a checkpoint at T, whose
    "preview" is the finished sample and its proxy reward the true one (`--group-size 24 --funnel 12 --checkpoints
    10`); an empty funnel is plain Flow-GRPO with within-group advantages."""
    def ints(text, flag):
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise common.UsageError(f"{flag} {text!r} must be comma-separated integers, e.g. 24,12") from None
    sizes, steps_at = ints(funnel, "--funnel"), ints(checkpoints, "--checkpoints")
    if len(sizes) != len(steps_at):
        raise common.UsageError(f"--funnel {funnel!r} has {len(sizes)} sizes but --checkpoints {checkpoints!r} "
                                f"has {len(steps_at)} steps: give one checkpoint per funnel size")
    chain = [group_size, *sizes]
    if any(b >= a for a, b in zip(chain, chain[1:])) or chain[-1] < 2:
        raise common.UsageError(f"--funnel {funnel!r} must decrease strictly from --group-size {group_size} and "
                                f"end at >= 2 (the advantage needs a std)")
    if any(b <= a for a, b in zip(steps_at, steps_at[1:])) or any(not 0 <= k <= steps for k in steps_at):
        raise common.UsageError(f"--checkpoints {checkpoints!r} must be increasing steps in [0, {steps}] "
                                f"(--sample-steps; {steps} = filter the finished images)")
    return sizes, steps_at


def main(args: Args) -> dict:
    # ---- 2. Setup: every input is checked before a model loads ----
    # >>> shared: validate
    # reads nothing; defines rt
    rt = common.setup_training(args)                         # the flags every trainer has, then torchrun and seeds
    # <<< shared: validate
    sizes, steps_at = parse_funnel(args.funnel, args.checkpoints, args.group_size, args.sample_steps)  # [Pro-GRPO]
    B, G = args.prompts_per_step // rt.world_size, args.group_size  # prompts per rank, expanded group G_max
    K = sizes[-1] if sizes else G                            # trained survivors per prompt
    N = B * K                                                # trained samples per rank per iteration
    mb = args.micro_batch
    per_update = common.micro_batches_per_update(N, mb, args.updates_per_rollout, "trained samples per rank "
                                                 "(prompts-per-step/ranks x last --funnel size)")
    T = args.sample_steps
    T_train = int(T * args.timestep_fraction)                # the official code trains the first int(0.99 T) steps
    if not (0 < args.timestep_fraction <= 1 and T_train >= 1):
        raise common.UsageError(f"--timestep-fraction {args.timestep_fraction} of --sample-steps {T} trains no step")
    funnel_text = " -> ".join(map(str, [G, *sizes])) + (f" at steps {steps_at}" if sizes else "")
    common.print0(f"ranks {rt.world_size} | prompts/rank B={B} | funnel {funnel_text} | trained K={K}, samples/rank "
                  f"N={N} | micro-batch {mb} | updates/iteration {args.updates_per_rollout} | steps T={T}, trained "
                  f"{T_train}")

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
    policy_step = functools.partial(common.sde_step, noise_level=args.noise_level, t_cap=t_cap)  # [Flow-GRPO Eq. 9]
    # FLOPs proxy per trajectory-step (reading 7): forward 1, forward + backward 3, reference forward 1, ours over
    # Flow-GRPO's with --baseline-group trajectories per prompt; the preview decodes and reward calls are logged apart
    # (decodes, reward_calls), not in the ratio: the paper's FLOPs table adds them
    train_cost = 3 + (args.beta > 0)
    baseline_cost = B * args.baseline_group * (T + train_cost * T_train)  # Flow-GRPO, same prompts and steps

    def ref_mu(x, t, s, cond):
        """The step's mu under the reference policy (no grad): LoRA switched off, or the frozen copy."""
        with torch.no_grad(), (common.lora_disabled(transformer) if lora else contextlib.nullcontext()):
            v = adapter.velocity(ref if ref is not None else transformer, x, t, cond)
        return common.sde_mean_std(x, v, t, s, args.noise_level, t_cap)[0]

    def score(x, ids, records):
        """Decodes latents x (n, ...) and scores them against the prompts of trajectories ids: the weighted sum
        (n,) and each reward {name: (n,)}, on CPU."""
        images = torch.cat([adapter.decode(x[i:i + mb]) for i in range(0, len(x), mb)])
        owners = [records[b] for b in (ids // G).tolist()]
        total, parts = reward_fn(images, [r["prompt"] for r in owners], owners, batch_size=mb)
        return total.cpu(), {name: r.cpu() for name, r in parts.items()}

    def group_std(r, n):
        """Mean over prompts of the within-group std of rewards r (B*n,), population form as OVF's Var_K."""
        return rearrange(r, "(b n) -> b n", n=n).std(1, correction=0).mean().item()

    # >>> shared: loop
    # reads loop; defines it, metrics
    for it in tqdm(range(run.start, args.iterations + 1), desc=Path(__file__).stem, disable=not rt.is_main):
        metrics = loop.begin(it)                             # evaluation when due; None once the last line is logged
        if metrics is None:
            break
        # <<< shared: loop

        # ---- 3a. Rollout: expand, SDE-sample step-major [Flow-GRPO Eq. 9], preview + OVF-prune at checkpoints ----
        # >>> shared: iteration-start
        # reads B; defines tic, gen, batch, records, texts
        tic = time.time()
        gen = common.make_generator(args.seed, rt.rank, it)  # every draw of this rank and iteration
        batch = common.sample_prompts(train_prompts, args.prompts_per_step, common.make_generator(args.seed, it))
        records = batch[rt.rank * B:(rt.rank + 1) * B]     # (B,) this rank's prompts with their metadata
        texts = [r["prompt"] for r in records]
        # <<< shared: iteration-start
        cond = adapter.encode(texts)                          # (B, ...) one row per prompt, indexed by alive // G

        diag, t_preview, nfe_sample = {}, 0.0, 0
        transformer.eval()
        with torch.no_grad():
            alive = torch.arange(B * G)                       # (B*G,) [Pro-GRPO, expand] S: ids, prompt-major
            z = adapter.noise(B * G, gen)                     # (B*G, ...) z_0, independent per trajectory
            zs, lps = [z], []                                 # per step: (|S|, ...) and (|S|,), rows = alive
            for k in loop.each(range(T + 1)):                 # a signal stops the run here (README, Fork a method)
                if k < T:  # v(z_k): the SDE step's velocity, and the preview's at a checkpoint (no extra call)
                    v = torch.cat([adapter.velocity(net, z[i:i + mb], sigmas[k],
                                                    common.cond_select(cond, alive[i:i + mb] // G))
                                   for i in range(0, len(alive), mb)])   # (|S|, ...)
                    nfe_sample += len(alive)
                if k in steps_at:
                    tic_p = time.time()
                    n, n_next = len(alive) // B, sizes[steps_at.index(k)]
                    # [Pro-GRPO, preview] x0_hat = z_k - t_k v (at k = T the finished sample: Static OVF); reading 2:
                    # v is the sampler's own (theta_old, no grad, CFG as sampling), spent for the pruned ones too
                    x0_hat = common.x0_prediction(z, v, sigmas[k]) if k < T else z
                    proxy, proxy_parts = score(x0_hat, alive, records)  # (|S|,) R_hat: the training reward on previews
                    # [Pro-GRPO, OVF] per prompt, keep the max-variance subset of size K_{i+1}
                    keep = torch.cat([b * n + ovf_select(proxy[b * n:(b + 1) * n], n_next) for b in range(B)])
                    diag.update({f"ovf{k}_preview_mean": proxy.mean().item(), f"ovf{k}_std_before": group_std(proxy, n),
                                 f"ovf{k}_std_after": group_std(proxy[keep], n_next)})
                    alive, z, proxy = alive[keep], z[keep], proxy[keep]  # pruned: no more steps, no training
                    proxy_parts = {name: r[keep] for name, r in proxy_parts.items()}
                    zs, lps = [x[keep] for x in zs], [x[keep] for x in lps]
                    v = v[keep] if k < T else None
                    t_preview += time.time() - tic_p
                if k == T:
                    break
                z, lp, _, _ = policy_step(z, v, sigmas[k], sigmas[k + 1], generator=gen)
                zs.append(z)
                lps.append(lp)
        latents, log_probs = torch.stack(zs, 1), torch.stack(lps, 1)  # (N, T+1, ...) and (N, T), survivors
        cond = common.cond_select(cond, alive // G)           # (N, ...) the survivors' conditioning, prompt-major
        # reading 4: every micro-batch trains the first T_train steps, those before the checkpoints too, where the
        # rollout's velocities came from micro-batches that also held trajectories pruned later (on CPU the recomputed
        # log-probs match bit for bit, tested; kernels that depend on the batch would put float noise in rho there)
        trained = [range(T_train)] * (N // mb)
        t_rollout = time.time() - tic

        # ---- 3b. Rewards -> advantages over the survivors [Pro-GRPO, advantage] ----
        tic = time.time()
        static = bool(steps_at) and steps_at[-1] == T         # the last filter already scored the finished images
        with torch.no_grad():
            rewards, parts = (proxy, proxy_parts) if static else score(latents[:, -1], alive, records)
        rewards, parts = rewards.to(rt.device), {name: r.to(rt.device) for name, r in parts.items()}
        grouped = rearrange(rewards, "(b k) -> b k", k=K)
        advantages = reward_fn.advantages(parts, lambda r: survivor_advantages(rearrange(r, "(b k) -> b k", k=K)))
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
        zero_std = (grouped.std(1) < 1e-6).float().mean()
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
        if sizes and rewards.std() > 0 and proxy.std() > 0:  # does the last preview predict the final reward?
            diag["preview_corr"] = torch.corrcoef(torch.stack([proxy, rewards.cpu()]))[0, 1].item()
        metrics.update(diag)
        metrics.update({
            "group_std_trained": group_std(rewards, K),       # the clustering diagnostic OVF raises
            "t_preview": t_preview, "nfe_sample": nfe_sample,
            "flops_vs_flow_grpo": (nfe_sample + train_cost * N * T_train) / baseline_cost,
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
