"""G2RPO (arXiv 2510.01982, "Fine-Grained GRPO for Precise Preference Alignment in Flow Models"): credit
assignment to single denoising steps. All G branches of a prompt share one deterministic ODE trajectory (the
anchor) and differ only by the noise of ONE SDE step at step k (Singular Stochastic Sampling), so a reward
difference between branches is caused by that step's noise alone. Each branch is then finished by the ODE at
several step strides lambda (granularities) and scored at each; the per-(k, lambda) group z-scores are summed
over lambda (Multi-Granularity Advantage Integration, MGAI). The policy is the Flow-GRPO step Gaussian of that
single step; one PPO-clipped optimizer step per optimised k, no KL.

Differences from flow_grpo.py:
  1. Rollout: one initial noise per prompt, an ODE anchor over the T-step grid, and for each k in M one SDE step
     per branch from the anchor's z_k (common.sde_step, a = noise_level); every other step is ODE. Flow-GRPO
     samples G independent SDE trajectories instead.
  2. Each branch is continued by the ODE at every stride in Lambda and scored: rewards (B, K, G, L), not (B, G).
  3. Advantages: z-score over the G branches per (prompt, k, lambda, reward model) with the group's own unbiased
     std + 1e-8 (no global std), summed over lambda and reward models, clamped to +-adv_clip.
  4. Update: one optimizer step per k in M (|M| per iteration) instead of --updates-per-rollout; a step's loss
     covers only the branches of that k, and one forward per prompt serves all G branches (they share z_k).
  5. No KL by default (--beta 0); the training grid is u = linspace(1, 0, T+1) with a static shift (--grid-shift).
  6. Flags: --granularities, --sde-steps, --grid-shift added; --timestep-fraction, --updates-per-rollout,
     --global-std removed. Logs the function evaluations of each stage and the method's diagnostics.

Simplifications / readings (the paper and its official code, bcmi/Granular-GRPO, on ambiguous points):
  1. Lambda: a flag. Default {1, 2, 3} at full scale, as the paper's headline rows (Table 1 = the {1,2,3} row
     of the Lambda ablation), and on the toy; the released scripts use {1, 2} (the tiny test models use it).
  2. M = the |M| highest-noise steps k = 0 .. |M|-1 (official indices 0..7 for T = 16; the paper counts the same
     steps down from T). Default |M| = T/2 (--sde-steps).
  3. Continuation grid for (k, lambda): t[0..k+1] + t[k+2::lambda] (official). If its last point has t > 0,
     the image is the x0-jump x0_hat = z - t v from that point, as the issue and the lead specify. The
     official loop stops one evaluation earlier there (it never evaluates the last point of a strided grid
     that ends above 0 and returns the x0-prediction of the point before); on T = 16, Lambda = {1, 2} that is
     4 evaluations per branch out of 144.
  4. Branch step: the mean mu(z_k, v_theta(z_k)) is the same for every branch, and the anchor has already
     evaluated v_theta(z_k), so branching costs no transformer evaluation (the official rollout runs the same
     batch-1 forward G times). The update likewise runs one forward per prompt, like the official batch-1 one.
  5. Continuations share work the official code repeats: every stride takes the same ordinary step
     t_{k+1} -> t_{k+2} and evaluates the same v_theta(z_{k+2}), so those two evaluations are made once per
     branch. All prompts, k, branches and strides are batched together, each row with its own t.
  6. Grid: static shift 3 on u = linspace(1, 0, T+1) for flux and sd3, as the official code does for FLUX
     (no dynamic shift); the toy uses shift 1, which is the toy adapter's own grid. Evaluation keeps the
     model's own sampler (the shared evaluation block), as the paper evaluates with the stock FLUX pipeline.
  7. Several reward models: each is z-scored on its own and the advantages are summed with the --reward
     weights (official: HPS + CLIP summed with weight 1).
  8. Updates run k = 0, 1, ... in order after all rollouts of the iteration, so only the first update of an
     iteration is exactly on-policy (ratio 1); a step's loss is the mean over all branches of all prompts of
     the rank (official: one prompt per GPU), and DDP averages the ranks.
  9. LoRA by default at full scale. The paper fine-tunes all of FLUX (lr 2e-6, FSDP, fp32 master weights);
     the shared setup here is DDP over bf16 weights, where full fine-tuning neither fits a 12B model nor keeps
     lr-2e-6 updates. --lora-rank 0 gives full fine-tuning (the toy default). The LoRA lr 1e-4 is our pick.
 10. The official code feeds the transformer timesteps rounded to 1/1000; we pass t as is. The anchor's own
     image is scored for logging only (anchor_reward), as in the official code.
 11. --micro-batch counts rows per forward: prompts in the anchor and in the update (the same chunks, so the
     first ratio of an iteration is exactly 1), (branch, stride) rows in the continuations.

Run:
  python g2rpo.py                                       # toy model, CPU, a few minutes
  python g2rpo.py --model flux --reward pickscore       # one GPU (~1,800 evaluations per prompt per iteration)
  torchrun --nproc_per_node=8 g2rpo.py --model flux --reward pickscore
  torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=$HOST:29500 g2rpo.py --model flux

Notation: t_k = sigmas[k] (t = 1 is noise); z_k = anchor[:, k]; z_{k+1}^i = branches[:, k, i];
M = steps 0..K-1 (K = |M|, sde_steps); Lambda = strides (L of them); R_{k,lambda}^i = rewards[:, k, i, l];
A_k^i = advantages[:, k, i]; a = eta = noise_level; l = log_prob; rho = ratio; G = group_size;
B = prompts per rank; T = sample_steps.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import common
from common import field


# ---- 0. Config ----
@dataclass
class Args:
    # >>> shared: args
    model: str = field("toy", f"model: {', '.join(common.MODELS)}")
    model_path: str | None = field(None, "hub id or local folder overriding the model's default weights")
    reward: str | None = field(None, "reward spec 'name[:weight],...' from: " + ", ".join(common.REWARDS))
    prompts: str | None = field(None, "prompt file (.txt, or .jsonl with 'prompt'); default: toy grammar or assets/prompts.txt")
    seed: int = field(0, "random seed (each rank adds its rank)")
    iterations: int | None = field(None, "training iterations (rollout + update)")
    time_budget: float = field(0.0, "also stop once training (evaluation excluded) has taken this many seconds; 0 = no limit")
    output_dir: str | None = field(None, "run folder (default runs/<method>-<model>-<time>)")
    resume: str | None = field(None, "run folder or checkpoint folder to continue from")
    eval_every: int | None = field(None, "evaluate every N iterations (and at 0 and the end); 0 = never")
    eval_images: int | None = field(None, "held-out images per evaluation (prompts cycle, fixed seeds)")
    eval_steps: int | None = field(None, "ODE steps at evaluation")
    save_every: int = field(0, "checkpoint every N iterations (and at the end); 0 = only at the end")
    wandb: bool = field(False, "also log to Weights & Biases")
    threads: int = field(2, "CPU threads (CPU runs only)")
    resolution: int | None = field(None, "image size in pixels (flux / sd3)")
    guidance_scale: float | None = field(None, "CFG scale (sd3) or guidance embedding (flux)")
    prompts_per_step: int | None = field(None, "prompts per iteration, over all ranks")
    group_size: int | None = field(None, "samples per prompt (G)")
    micro_batch: int | None = field(None, "samples per forward pass, in rollout and update alike")
    lr: float | None = field(None, "AdamW learning rate")
    weight_decay: float = field(1e-4, "AdamW weight decay")
    grad_clip: float = field(1.0, "gradient-norm clip")
    lora_rank: int | None = field(None, "LoRA rank; 0 = full fine-tuning")
    lora_alpha: float | None = field(None, "LoRA alpha")
    ema: bool | None = field(None, "keep an EMA of the trained weights for evaluation and checkpoints")
    gradient_checkpointing: bool | None = field(None, "recompute activations in the backward pass")
    # <<< shared: args
    # --- G2RPO ---
    sample_steps: int | None = field(None, "denoising steps T of the anchor grid")
    noise_level: float | None = field(None, "noise level a (eta) of the singular SDE step, g = a sqrt(t / (1 - t))")
    sde_steps: int | None = field(None, "|M|: the highest-noise steps k = 0..|M|-1 that branch and train (default T/2)")
    granularities: str | None = field(None, "strides Lambda of the ODE continuations: 1,2,3 (paper) or 1,2 (code)")
    grid_shift: float | None = field(None, "static shift s of the training grid (u = linspace(1, 0, T+1) shifted)")
    clip_range: float = field(1e-4, "PPO ratio clip epsilon")
    adv_clip: float = field(5.0, "advantages (summed over strides) are clamped to [-adv_clip, adv_clip]")
    beta: float | None = field(None, "weight of the KL to the reference (pre-trained) policy; G2RPO uses none")


# Per-model defaults: the paper's settings for flux / sd3 (PAPERS §4.2; LoRA, reading 9), a calibrated CPU run for toy.
MODEL_DEFAULTS = {
    "toy": dict(reward="toy", iterations=30, eval_every=10, eval_images=200, eval_steps=20, prompts_per_step=8,
                group_size=8, micro_batch=256, sample_steps=8, noise_level=0.7, granularities="1,2,3",
                grid_shift=1.0, lr=1e-4, lora_rank=0, lora_alpha=0, beta=0.0, ema=False, gradient_checkpointing=False),
    "tiny-flux": dict(reward="jpeg", iterations=2, eval_every=1, eval_images=4, eval_steps=4, prompts_per_step=2,
                      group_size=2, micro_batch=8, sample_steps=4, noise_level=0.7, granularities="1,2",
                      grid_shift=3.0, lr=3e-4, lora_rank=4, lora_alpha=8, beta=0.0, ema=False,
                      gradient_checkpointing=False, resolution=32, guidance_scale=3.5),
    "tiny-sd3": dict(reward="jpeg", iterations=2, eval_every=1, eval_images=4, eval_steps=4, prompts_per_step=2,
                     group_size=2, micro_batch=8, sample_steps=4, noise_level=0.7, granularities="1,2",
                     grid_shift=3.0, lr=3e-4, lora_rank=4, lora_alpha=8, beta=0.0, ema=False,
                     gradient_checkpointing=False, resolution=32, guidance_scale=4.5),
    "sd3": dict(reward="pickscore", iterations=300, eval_every=30, eval_images=256, eval_steps=40, prompts_per_step=16,
                group_size=12, micro_batch=8, sample_steps=16, noise_level=0.7, granularities="1,2,3", grid_shift=3.0,
                lr=1e-4, lora_rank=32, lora_alpha=64, beta=0.0, ema=False, gradient_checkpointing=True,
                resolution=512, guidance_scale=4.5),
    "flux": dict(reward="pickscore", iterations=300, eval_every=30, eval_images=256, eval_steps=28, prompts_per_step=16,
                 group_size=12, micro_batch=8, sample_steps=16, noise_level=0.7, granularities="1,2,3", grid_shift=3.0,
                 lr=1e-4, lora_rank=64, lora_alpha=128, beta=0.0, ema=False, gradient_checkpointing=True,
                 resolution=720, guidance_scale=3.5),
}


# ---- 1. Method functions ----
def parse_granularities(spec: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]: the strides Lambda, distinct positive integers."""
    try:
        strides = [int(s) for s in spec.split(",")]
        assert strides and min(strides) >= 1 and len(set(strides)) == len(strides)
    except (ValueError, AssertionError):
        raise ValueError(f"--granularities {spec!r} must list distinct positive integers, e.g. 1,2,3") from None
    return strides


def continuation_grid(T: int, k: int, stride: int) -> list[int]:
    """Grid indices a branch visits after its SDE step k -> k+1 [G2RPO: MGAI]. The continuation grid is
    t[0..k+1] + t[k+2::stride]: the ordinary step k+1 -> k+2, then every stride-th index up to T."""
    return [k + 1] + list(range(k + 2, T + 1, stride))


def singular_sde_step(z, v, t, s, group_size: int, noise_level: float, t_cap: float, generator):
    """[G2RPO: Singular Stochastic Sampling] G branches from one shared latent per prompt: the Flow-GRPO SDE step
    (Flow-GRPO, ODE-to-SDE conversion, Euler-Maruyama step) from z_k, with the same v_theta(z_k) for every branch, so the branches differ only by
    their noise. z, v: (P, ...) -> next latents (P, G, ...) and log-probs (P, G)."""
    P = len(z)
    nxt, log_prob, _, _ = common.sde_step(z.repeat_interleave(group_size, 0), v.repeat_interleave(group_size, 0),
                                          t, s, noise_level, t_cap, generator=generator)
    return nxt.unflatten(0, (P, group_size)), log_prob.view(P, group_size)


def continue_ode(velocity, z, ks, sigmas, strides: list[int], micro_batch: int):
    """[G2RPO: MGAI] ODE continuations of branch latents z (R, ...), row r at t_{k+1} for k = ks[r], one per
    stride, to t = 0: Euler steps over sigmas[continuation_grid(T, k, stride)]; if the last point visited has
    t > 0, the x0-jump x0_hat = z - t v from there, which is the Euler step to t = 0. The strides share a prefix
    (the step to t_{k+2} and v_theta(z_{k+2})), evaluated once. Evaluation j of every live (row, stride) goes
    through `velocity(x, t (n,), rows (n,))` together, micro_batch rows at a time. Returns (R, L, ...) at t = 0."""
    T, R, L = len(sigmas) - 1, len(z), len(strides)
    # grid points where v is evaluated: all but t_T = 0
    evals = [[[i for i in continuation_grid(T, k, s) if i < T] for s in strides] for k in ks.tolist()]
    J = max(len(e) for row in evals for e in row)
    n_eval = torch.zeros(R, L, dtype=torch.long)                      # (R, L) evaluations of each continuation
    t_eval, t_next = torch.zeros(R, L, J), torch.zeros(R, L, J)       # (R, L, J) t of evaluation j, t it steps to
    n_shared = torch.zeros(R, dtype=torch.long)                       # (R,) leading evaluations equal for all strides
    for r, row in enumerate(evals):
        for l, e in enumerate(row):
            n_eval[r, l] = len(e)
            t_eval[r, l, :len(e)] = sigmas[e]
            t_next[r, l, :len(e[1:])] = sigmas[e[1:]]                 # after the last evaluation: t = 0
        n = 0
        while all(len(e) > n for e in row) and len({e[n] for e in row}) == 1:
            n += 1
        n_shared[r] = n
    n_eval, t_eval, t_next, n_shared = (x.to(z.device) for x in (n_eval, t_eval, t_next, n_shared))
    first = torch.arange(L, device=z.device) == 0                     # (L,) the stride that evaluates shared points
    x = z.float().unsqueeze(1).repeat(1, L, *[1] * (z.dim() - 1))     # (R, L, ...) one copy per stride
    for j in range(J):
        live = n_eval > j                                              # (R, L)
        shared = n_shared > j                                          # (R,) same state and t for every stride
        rows, cols = (live & (first | ~shared[:, None])).nonzero(as_tuple=True)
        v = torch.zeros_like(x)
        for i in range(0, len(rows), micro_batch):
            r, c = rows[i:i + micro_batch], cols[i:i + micro_batch]
            v[r, c] = velocity(x[r, c], t_eval[r, c, j], r)
        v[shared] = v[shared][:, :1]                                   # broadcast the shared evaluation
        x[live] = common.ode_step(x[live], v[live], t_eval[..., j][live], t_next[..., j][live])
    return x


def mgai_advantages(rewards: dict[str, torch.Tensor], weights: dict[str, float], adv_clip: float) -> torch.Tensor:
    """[G2RPO: MGAI] rewards[name]: (B, K, G, L). Each (prompt, k, stride) is z-scored over its G branches with the
    unbiased std + 1e-8 (GRPO's group advantage), then summed (not averaged) over the strides and, with their
    weights, over the reward models; clamped to +-adv_clip. Returns A (B, K, G)."""
    total = 0.0
    for name, r in rewards.items():
        z = (r - r.mean(2, keepdim=True)) / (r.std(2, keepdim=True) + 1e-8)
        total = total + weights[name] * z.sum(-1)
    return total.clamp(-adv_clip, adv_clip)


def main(args: Args) -> dict:
    # ---- 2. Setup ----
    rt = common.setup_runtime(args.seed, args.threads)
    W = rt.world_size
    if args.prompts_per_step % W:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must be divisible by the {W} ranks")
    B, G = args.prompts_per_step // W, args.group_size       # prompts per rank, group size
    if G < 2:
        raise ValueError(f"--group-size {G} must be at least 2: advantages are z-scores over a prompt's branches")
    M = args.micro_batch
    if M < 1:
        raise ValueError(f"--micro-batch {M} must be at least 1")
    T = args.sample_steps
    K = T // 2 if args.sde_steps is None else args.sde_steps  # |M|: steps 0..K-1 branch and train
    if not 1 <= K <= T:
        raise ValueError(f"--sde-steps {K} must be between 1 and --sample-steps {T}")
    strides = parse_granularities(args.granularities)
    L = len(strides)
    chunks = [slice(i, min(i + M, B)) for i in range(0, B, M)]  # prompt rows per forward, in rollout and update
    common.print0(f"ranks {W} | prompts/rank B={B} | group G={G} | steps T={T}, branched M=0..{K - 1} | strides "
                  f"{strides} | images/rank {B * K * G * L} | micro-batch {M} | optimizer steps/iteration {K}")

    # >>> shared: setup-model
    reward_fn = common.build_reward(args.reward, rt.device)
    train_prompts, eval_prompts = common.load_prompts(args.prompts, args.model)
    adapter = common.load_model(args.model, rt, args.model_path, args.resolution, args.guidance_scale)
    transformer = adapter.transformer
    lora = args.lora_rank > 0
    params = common.add_lora(transformer, args.lora_rank, args.lora_alpha, adapter.lora_targets)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    # <<< shared: setup-model
    ref = common.frozen_copy(transformer) if args.beta > 0 and not lora else None  # full FT: frozen reference
    # >>> shared: setup-run
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay, eps=1e-8)
    ema = common.EMA(params) if args.ema else None
    run_dir = common.make_run_dir(args.output_dir, Path(__file__).stem, args.model, args.resume)
    start, elapsed = common.load_checkpoint(args.resume, params, optimizer, ema) if args.resume else (0, 0.0)
    if start > args.iterations:
        raise ValueError(f"--resume {args.resume} is at iteration {start}, past --iterations {args.iterations}")
    net = torch.nn.parallel.DistributedDataParallel(transformer) if rt.distributed else transformer
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
    logger = common.Logger(run_dir, rt.is_main, args, args.wandb, start_iteration=start)
    accuracy_fn = common.toy_accuracy if args.model == "toy" else None
    t0 = time.time() - elapsed                               # time_s: training seconds, continued across --resume
    # <<< shared: setup-run
    sigmas = common.uniform_sigmas(T, args.grid_shift)       # (T+1,) t_0 = 1 ... t_T = 0 (reading 6)
    t_cap = float(sigmas[1])                                 # replaces t = 1 in g's denominator
    weights = {name: w for name, w, _ in reward_fn.terms}    # MGAI sums the reward models' advantages

    def ref_mean(x, t, s, cond):
        """Step mean under the reference policy (no grad): LoRA switched off, or the frozen copy."""
        with torch.no_grad(), (common.lora_disabled(transformer) if lora else contextlib.nullcontext()):
            v = adapter.velocity(ref if ref is not None else transformer, x, t, cond)
        return common.sde_step(x, v, t, s, args.noise_level, t_cap, next_x=x)[2]

    # >>> shared: eval
    def run_eval(it):
        with ema.swapped_in() if ema else contextlib.nullcontext():
            res, imgs = common.evaluate(adapter, transformer, eval_prompts, args.eval_images, args.eval_steps,
                                        reward_fn, rt, seed=args.seed, accuracy_fn=accuracy_fn)
        if rt.is_main:
            common.save_image_grid(imgs[:64], run_dir / f"eval_{it:06d}.png")
        return res

    metrics = {}
    for it in tqdm(range(start, args.iterations + 1), desc=Path(__file__).stem, disable=not rt.is_main):
        metrics = {"iteration": it}
        last = it == args.iterations or common.out_of_time(t0, args.time_budget, rt.device)
        if args.eval_every and (it % args.eval_every == 0 or last):
            tic = time.time()
            metrics.update(run_eval(it))
            t0 += time.time() - tic                          # time_s leaves evaluation out
        if last:  # the last line: final evaluation and, under DDP, a check that replicas agree
            if rt.distributed:
                metrics["rank_param_diff"] = common.rank_param_diff(params)
            metrics["time_s"] = time.time() - t0
            logger.log(metrics)
            break
        # <<< shared: eval

        # ---- 3a. Rollout: ODE anchor, singular SDE branches, multi-granularity ODE continuations (no grad) ----
        tic = time.time()
        work_before = {**adapter.counts, "reward_calls": reward_fn.calls}
        gen = common.make_generator(args.seed, rt.rank, it)
        batch = common.sample_prompts(train_prompts, args.prompts_per_step, common.make_generator(args.seed, it))
        prompts = [r["prompt"] for r in batch[rt.rank * B:(rt.rank + 1) * B]]  # (B,) one row per prompt
        cond = adapter.encode(prompts)
        transformer.eval()
        with torch.no_grad():
            # [G2RPO: Singular Stochastic Sampling] one initial noise per prompt, shared by its G branches, and the
            # deterministic ODE anchor from it; keep z_k and v_theta(z_k) for every k in M
            fwd = adapter.counts["fwd"]
            anchor, velocities, finals = [], [], []          # (B, K, ...), (B, K, ...), (B, ...)
            for rows in chunks:
                c = common.cond_select(cond, rows)
                z = adapter.noise(rows.stop - rows.start, gen)
                zs, vs = [], []
                for k in range(T):
                    v = adapter.velocity(net, z, sigmas[k], c)
                    if k < K:
                        zs.append(z), vs.append(v)
                    z = common.ode_step(z, v, sigmas[k], sigmas[k + 1])
                anchor.append(torch.stack(zs, 1)), velocities.append(torch.stack(vs, 1)), finals.append(z)
            anchor, velocities, finals = torch.cat(anchor), torch.cat(velocities), torch.cat(finals)
            nfe_anchor, fwd = adapter.counts["fwd"] - fwd, adapter.counts["fwd"]

            # [G2RPO: Singular Stochastic Sampling] for each k in M, ONE SDE step per branch from the shared z_k; the
            # anchor's v_theta(z_k) gives the step mean, so branching needs no evaluation (reading 4)
            branches = torch.empty(B, K, G, *anchor.shape[2:], device=anchor.device)  # (B, K, G, ...) z_{k+1}^i
            log_probs = torch.empty(B, K, G, device=anchor.device)                     # (B, K, G) l_old
            for rows in chunks:
                for k in range(K):
                    branches[rows, k], log_probs[rows, k] = singular_sde_step(
                        anchor[rows, k], velocities[rows, k], sigmas[k], sigmas[k + 1], G, args.noise_level, t_cap, gen)
            nfe_branch, fwd = adapter.counts["fwd"] - fwd, adapter.counts["fwd"]

            # [G2RPO: MGAI] finish every branch with the ODE at every stride, batched over prompts, k, branches and
            # strides (reading 5)
            ks = torch.arange(K).repeat_interleave(G)         # (K*G,) the step each of a prompt's branches left at
            latents = []                                      # (B, K, G, L, ...) images' latents at t = 0
            for rows in chunks:
                P = rows.stop - rows.start
                c = common.cond_select(cond, rows)
                owner = torch.arange(P, device=anchor.device).repeat_interleave(K * G)  # (P*K*G,) each row's prompt
                vel = lambda x, t, r: adapter.velocity(net, x, t, common.cond_select(c, owner[r]))  # noqa: E731
                latents.append(continue_ode(vel, branches[rows].flatten(0, 2), ks.repeat(P), sigmas, strides, M)
                               .unflatten(0, (P, K, G)))
            latents = torch.cat(latents)
            nfe_continuation = adapter.counts["fwd"] - fwd
        t_rollout = time.time() - tic

        # ---- 3b. Rewards -> multi-granularity advantages [G2RPO: MGAI] ----
        tic = time.time()
        flat, owners = latents.flatten(0, 3), [p for p in prompts for _ in range(K * G * L)]
        parts = {name: [] for name in weights}
        with torch.no_grad():
            for i in range(0, len(flat), M):                  # decode and score in micro-batches; images are not kept
                for name, r in reward_fn(adapter.decode(flat[i:i + M]), owners[i:i + M])[1].items():
                    parts[name].append(r)
            anchor_rewards = torch.cat([reward_fn(adapter.decode(finals[rows]), prompts[rows])[0] for rows in chunks])
        parts = {name: torch.cat(r).to(rt.device).float().view(B, K, G, L) for name, r in parts.items()}
        rewards = sum(weights[name] * r for name, r in parts.items())                   # (B, K, G, L)
        advantages = mgai_advantages(parts, weights, args.adv_clip)                     # (B, K, G)
        t_reward = time.time() - tic

        # ---- 3c. Policy update: one optimizer step per k in M, PPO-clipped ratio of the single SDE step ----
        tic = time.time()
        transformer.train()
        stats = {k: [] for k in ("loss", "pg_loss", "kl", "ratio_dev", "clip_frac", "approx_kl", "grad_norm")}
        for k in range(K):
            for j, rows in enumerate(chunks):
                P = rows.stop - rows.start
                c, z, A = common.cond_select(cond, rows), anchor[rows, k], advantages[rows, k]  # z_k: (P, ...)
                with common.no_sync(net, j < len(chunks) - 1):
                    v = adapter.velocity(net, z, sigmas[k], c)  # one forward per prompt: the G branches share z_k
                    _, lp, mu, std_k = common.sde_step(z.repeat_interleave(G, 0), v.repeat_interleave(G, 0), sigmas[k],
                                                       sigmas[k + 1], args.noise_level, t_cap,
                                                       next_x=branches[rows, k].flatten(0, 1))
                    lp = lp.view(P, G)
                    ratio = torch.exp(lp - log_probs[rows, k])                           # (P, G)
                    # [G2RPO: objective] the clipped surrogate of Flow-GRPO's objective on step k only, no KL by default
                    pg = torch.maximum(-A * ratio, -A * ratio.clamp(1 - args.clip_range, 1 + args.clip_range))
                    kl = common.gaussian_kl(mu[::G], ref_mean(z, sigmas[k], sigmas[k + 1], c), std_k) \
                        if args.beta > 0 else torch.zeros(P, device=pg.device)          # mu is shared by the branches
                    loss = pg.mean() + args.beta * kl.mean()
                    (loss * P / B).backward()                 # the step's loss: mean over all the rank's branches
                stats["loss"].append(loss.item()), stats["pg_loss"].append(pg.mean().item())
                stats["kl"].append(kl.mean().item())
                stats["ratio_dev"].append((ratio - 1).abs().max().item())
                stats["clip_frac"].append(((ratio - 1).abs() > args.clip_range).float().mean().item())
                stats["approx_kl"].append(0.5 * ((lp - log_probs[rows, k]) ** 2).mean().item())
            if k == 0:  # before the first optimizer step the update is on-policy: rho = 1 and KL(theta||theta) = 0
                metrics["ratio_dev_first_update"] = max(stats["ratio_dev"])
                metrics["kl_first_update"] = max(stats["kl"])
            stats["grad_norm"].append(torch.nn.utils.clip_grad_norm_(params, args.grad_clip).item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema:
                ema.step(it * K + k + 1)
        t_update = time.time() - tic

        # ---- 3d. Log ----
        zero_std = torch.stack([(r.std(2) < 1e-6).float().mean() for r in parts.values()]).mean()
        metrics.update({k: sum(v) / len(v) for k, v in stats.items() if v})
        metrics.update({
            "reward_mean": common.all_reduce_mean(rewards.mean()).item(),
            "reward_std": rewards.std().item(),
            **{f"reward_stride{s}": common.all_reduce_mean(rewards[..., l].mean()).item()
               for l, s in enumerate(strides)},
            "anchor_reward": common.all_reduce_mean(anchor_rewards.float().mean().to(rt.device)).item(),
            "zero_std_frac": common.all_reduce_mean(zero_std).item(),
            "adv_abs_mean": advantages.abs().mean().item(),
            "adv_clamp_frac": (advantages.abs() >= args.adv_clip).float().mean().item(),
            "ratio_dev_max": max(stats["ratio_dev"]),
            "t_rollout": t_rollout, "t_reward": t_reward, "t_update": t_update,
            **common.work_done(adapter, reward_fn, work_before),
            "nfe_anchor": nfe_anchor, "nfe_branch": nfe_branch, "nfe_continuation": nfe_continuation,
            "time_s": time.time() - t0,
        })
        metrics["nfe_train"] = metrics["nfe_fwd_bwd"]
        logger.log(metrics)

        # >>> shared: checkpoint
        # ---- 3e. Checkpoint ----
        if args.save_every and (it + 1) % args.save_every == 0 and it + 1 < args.iterations:
            if rt.is_main:
                common.save_checkpoint(run_dir, it + 1, adapter, params, lora, optimizer, ema, time.time() - t0)
            common.barrier()
    if rt.is_main:
        common.save_checkpoint(run_dir, it, adapter, params, lora, optimizer, ema, time.time() - t0)
    common.barrier()
    common.cleanup_runtime()
    return metrics
    # <<< shared: checkpoint


# ---- 4. Entry point ----
if __name__ == "__main__":
    main(common.cli(Args, model_defaults=MODEL_DEFAULTS))
