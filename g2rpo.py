"""G2RPO (arXiv 2510.01982, "Fine-Grained GRPO for Precise Preference Alignment in Flow Models"): credit assignment
to single denoising steps. All G branches of a prompt share one deterministic ODE trajectory (the anchor) and differ
only by the noise of ONE SDE step at step k (Singular Stochastic Sampling), so a reward difference between branches is
caused by that step's noise alone. Each branch is then finished by the ODE at several step strides lambda
(granularities) and scored at each; the per-(k, lambda) group z-scores are summed over lambda (Multi-Granularity
Advantage Integration, MGAI). The policy is Flow-GRPO's step Gaussian [Flow-GRPO Eq. 9] of that single step; one
PPO-clipped optimizer step per branched k, no KL.

Differences from flow_grpo.py: the rollout (an anchor per prompt, G one-step branches per k, ODE continuations at each
stride: rewards (B, |M|, G, L)); the advantages (MGAI); the update (one optimizer step per k, one forward per prompt
for its G branches); the training grid (a static shift, --grid-shift); no KL by default.

Simplifications / readings (the paper and its official code, bcmi/Granular-GRPO), each detailed where implemented:
  1. parse_granularities: Lambda {1, 2, 3} by default, the paper's headline rows (the released scripts use {1, 2}).
  2. M = the |M| highest-noise steps k = 0 .. |M|-1, |M| = T/2 by default (--sde-steps), as the official indices.
  3. continuation_grid: the official grid; a last point with t > 0 is finished by the x0-jump (one evaluation more).
  4. singular_sde_step: the branches share the anchor's v_theta(z_k), so branching costs no evaluation.
  5. continue_ode: the first step after a branch, the same at every stride, is evaluated once per branch.
  6. A static shift on u = linspace(1, 0, T+1) (3 for flux and sd3, as the official FLUX code; 1 on the toy).
  7. Full-scale rewards HPS v2.1 + DFN5B CLIP-H (MODEL_DEFAULTS), z-scored one by one (--reward-norm per-reward).
  8. The update steps k = 0, 1, ... after all rollouts: only its first step is exactly on-policy.
  9. FLUX trains all 12B parameters at lr 2e-6 with FSDP2, as the paper; SD3.5, not in the paper, a LoRA.
 10. The transformer sees t as is (the official code rounds it to 1/1000); the anchor's own image is only logged.

Run: python g2rpo.py (toy, CPU); torchrun --nproc_per_node=8 g2rpo.py --model flux (the paper's HPS + CLIP run);
python g2rpo.py --model flux --no-fsdp --lora-rank 64 --lora-alpha 128 --lr 1e-4 (one GPU, LoRA; lr our pick).

Notation: as flow_grpo.py's; z_k = anchor[:, k]; z_{k+1}^i = branches[:, k, i]; M = steps 0..n_sde-1 (n_sde = |M| =
sde_steps); Lambda = strides (L of them); R_{k,lambda}^i = rewards[:, k, i, l]; A_k^i = advantages[:, k, i].
"""
from __future__ import annotations

import contextlib
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
    # --- G2RPO ---
    iterations: int = field(30, "training iterations (rollout + update)", at_least=0, at_most=10**9)
    prompts_per_step: int = field(8, "prompts per iteration, over all ranks", at_least=1, at_most=100_000)
    group_size: int = field(8, "branches per prompt and branched step k (G)", at_least=2, at_most=100_000)
    micro_batch: int = field(256, "rows per forward pass: prompts in the anchor and the update, branches in the "
                                  "continuations", at_least=1)
    lr: float = field(1e-4, "AdamW learning rate", at_least=1e-12, at_most=1)
    sample_steps: int = field(8, "denoising steps T of a training rollout", at_least=1, at_most=1000)
    noise_level: float = field(0.7, "SDE noise level a in g = a sqrt(t / (1 - t))", at_least=1e-12)
    sde_steps: int | None = field(None, "|M|: the highest-noise steps k = 0..|M|-1 that branch and train "
                                        "(default T/2)", at_least=1)
    granularities: str = field("1,2,3", "strides Lambda of the ODE continuations: 1,2,3 (paper) or 1,2 (code)")
    grid_shift: float = field(1.0, "static shift s of the training grid (u = linspace(1, 0, T+1) shifted)",
                              at_least=1e-12)
    clip_range: float = field(1e-4, "PPO ratio clip epsilon", at_least=0)
    adv_clip: float = field(5.0, "advantages (summed over strides) are clamped to [-adv_clip, adv_clip]",
                            at_least=1e-12)
    reward_norm: str = field("per-reward", "with several rewards: per-reward (each z-scored, then summed with the "
                                           "weights, as G2RPO) or sum (the weighted sum z-scored)",
                             choices=common.REWARD_NORMS)
    beta: float = field(0.0, "weight of the KL to the reference (pre-trained) policy; G2RPO uses none", at_least=0)
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


# Full scale: what differs from the toy defaults above, from the paper and its official scripts (FLUX: full
# fine-tuning with FSDP2; SD3: LoRA; reading 9). Reading 7: HPS + CLIP are the paper's HPS&CLIP rows [G2RPO, Table 1],
# on which its Lambda and step-count ablations run (`--reward hpsv2` is its HPS-only setting); the CLIP is DFN5B
# CLIP-H, cos(image, text) (official code and README; the paper's text for it was not checked), each reward weighted 1
# and z-scored on its own (--reward-norm sum z-scores their weighted sum instead). SD3.5 gets the same rewards.
# FLUX.2-klein (flux2) is this project's choice, as no paper trains it: the SD3.5 recipe (a base model with true CFG,
# as klein's base is; a LoRA) with klein's CFG 4 and its pipeline's 50 steps at evaluation, on one 80 GB GPU: a quarter
# of the prompts an iteration (README, Defaults per model).
MODEL_DEFAULTS = {
    "sd3": {
        "reward": "hpsv2,clipscore-h",    # HPS + CLIP (reading 7)
        "prompts": "hpdv2",                   # HPDv2 prompts, the paper's
        "eval_every": 30,
        "eval_images": 256,
        "eval_steps": 40,
        "resolution": 512,
        "guidance_scale": 4.5,
        "lora_rank": 32,
        "lora_alpha": 64,
        "gradient_checkpointing": True,
        "iterations": 300,
        "prompts_per_step": 16,
        "group_size": 12,
        "micro_batch": 8,
        "sample_steps": 16,
        "grid_shift": 3.0,
    },
    "flux": {
        "reward": "hpsv2,clipscore-h",    # HPS + CLIP (reading 7)
        "prompts": "hpdv2",                   # HPDv2 prompts, the paper's
        "eval_every": 30,
        "eval_images": 256,
        "eval_steps": 28,
        "resolution": 720,
        "guidance_scale": 3.5,
        "gradient_checkpointing": True,
        "fsdp": True,
        "iterations": 300,
        "prompts_per_step": 16,
        "group_size": 12,
        "micro_batch": 8,
        "lr": 2e-6,
        "sample_steps": 16,
        "grid_shift": 3.0,
    },
    "flux2": {
        "reward": "hpsv2,clipscore-h",    # HPS + CLIP (reading 7)
        "prompts": "hpdv2",
        "eval_every": 30,
        "eval_images": 256,
        "eval_steps": 50,                 # klein's pipeline's
        "resolution": 512,
        "guidance_scale": 4.0,            # the base model's CFG, its pipeline's
        "lora_rank": 32,
        "lora_alpha": 64,
        "gradient_checkpointing": True,
        "iterations": 300,
        "prompts_per_step": 4,            # one GPU: a quarter of the paper's 16 prompts
        "group_size": 12,
        "micro_batch": 8,
        "sample_steps": 16,
        "grid_shift": 3.0,
    },
}


# ---- 1. Method functions ----
def parse_granularities(spec: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]: the strides Lambda, distinct positive integers. Reading 1: the default {1, 2, 3} is the
    paper's headline rows (Table 1 = the {1,2,3} row of the Lambda ablation); the released scripts use {1, 2}."""
    try:
        strides = [int(s) for s in spec.split(",")]
    except ValueError:
        strides = []
    if not strides or min(strides) < 1 or len(set(strides)) != len(strides):
        raise common.UsageError(f"--granularities {spec!r} must list distinct positive integers, e.g. 1,2,3")
    return strides


def continuation_grid(T: int, k: int, stride: int) -> list[int]:
    """Grid indices a branch visits after its SDE step k -> k+1 [G2RPO, MGAI]. The continuation grid is
    t[0..k+1] + t[k+2::stride] (the official one): the ordinary step k+1 -> k+2, then every stride-th index up to T.
    Reading 3: if its last point has t > 0, continue_ode finishes with the x0-jump from there; the official loop
    returns the x0-prediction of the point before instead, one evaluation fewer (4 of 144 per branch at T = 16,
    Lambda = {1, 2})."""
    return [k + 1] + list(range(k + 2, T + 1, stride))


def singular_sde_step(z, v, t, s, group_size: int, noise_level: float, t_cap: float, generator=None, next_x=None):
    """[G2RPO, Singular Stochastic Sampling] G branches from one shared latent per prompt: the SDE step
    [Flow-GRPO Eq. 9] from z_k with the same v_theta(z_k) for every branch, so the branches differ only by their
    noise. z, v: (P, ...); next_x (P, G, ...) is scored if given (training), else drawn with `generator`.
    Returns next latents (P, G, ...), log-probs (P, G), the branches' shared mu (P, ...) and the std. Reading 4:
    the anchor has evaluated v_theta(z_k) already, so branching costs no transformer evaluation (the official
    rollout runs the same batch-1 forward G times); the update likewise runs one forward per prompt."""
    nxt, log_prob, mu, std = common.sde_step(
        repeat(z, "p ... -> (p g) ...", g=group_size), repeat(v, "p ... -> (p g) ...", g=group_size), t, s,
        noise_level, t_cap, next_x=None if next_x is None else rearrange(next_x, "p g ... -> (p g) ..."),
        generator=generator)
    return (rearrange(nxt, "(p g) ... -> p g ...", g=group_size), rearrange(log_prob, "(p g) -> p g", g=group_size),
            rearrange(mu, "(p g) ... -> p g ...", g=group_size)[:, 0], std)


def continue_ode(velocity, z: torch.Tensor, cond: dict, k: int, sigmas: torch.Tensor, strides: list[int]):
    """[G2RPO, MGAI] The ODE continuations to t = 0 of branch latents z (R, ...) at t_{k+1}, one per stride:
    Euler steps over sigmas[continuation_grid(T, k, stride)], then, if the last point visited has t > 0, the
    x0-jump x0_hat = z - t v from there (which is the Euler step to t = 0). All strides take the same first
    step t_{k+1} -> t_{k+2} and evaluate the same v(z_{k+2}), so those are computed once (reading 5; the official
    code repeats them: 151 instead of 183 evaluations per branch at T = 16, Lambda = {1, 2, 3}; 31, not 47, at T = 8).
    velocity(x, i, cond) is v_theta(x, t_i) for rows x with conditioning rows cond. Returns (R, L, ...) at t = 0,
    in the order of `strides`."""
    T = len(sigmas) - 1
    x = z.float()
    if k + 1 < T:                                            # the shared ordinary step t_{k+1} -> t_{k+2}
        x = common.ode_step(x, velocity(x, k + 1, cond), sigmas[k + 1], sigmas[k + 2])
    v_shared = velocity(x, k + 2, cond) if k + 2 < T else None  # the shared evaluation at t_{k+2}
    ends = []
    for stride in strides:
        grid = continuation_grid(T, k, stride)[1:]           # k+2, k+2+stride, ... (<= T)
        y = x
        for n, i in enumerate(grid):
            if i == T:
                break
            s = grid[n + 1] if n + 1 < len(grid) else T     # past the grid's last point: the x0-jump to t = 0
            y = common.ode_step(y, v_shared if n == 0 else velocity(y, i, cond), sigmas[i], sigmas[s])
        ends.append(y)
    return torch.stack(ends, 1)


def mgai_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """[G2RPO, MGAI] rewards (B, |M|, G, L) -> A (B, |M|, G): each (prompt, k, stride) z-scored over its G branches
    with the unbiased std + 1e-8 (GRPO's group advantage), then summed, not averaged, over the strides. Several
    reward models: WeightedReward.advantages sums theirs with the weights (or z-scores their weighted sum)."""
    z = (rewards - rewards.mean(2, keepdim=True)) / (rewards.std(2, keepdim=True) + 1e-8)
    return z.sum(-1)


def clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, clip_range: float) -> torch.Tensor:
    """[Flow-GRPO Eq. 5] The per-sample PPO-clip loss max(-A rho, -A clip(rho, 1 - e, 1 + e)): the negated clipped
    objective, to minimise. (n,)."""
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_range, 1 + clip_range))


def main(args: Args) -> dict:
    # ---- 2. Setup: every input is checked before a model loads ----
    # >>> shared: validate
    # reads nothing; defines rt
    rt = common.setup_training(args)                         # the flags every trainer has, then torchrun and seeds
    # <<< shared: validate
    B, G = args.prompts_per_step // rt.world_size, args.group_size  # prompts per rank, group size
    mb = args.micro_batch
    T = args.sample_steps
    n_sde = T // 2 if args.sde_steps is None else args.sde_steps  # |M|: steps 0..n_sde-1 branch and train (reading
    # 2: the official indices 0..7 for T = 16; the paper counts the same steps down from T)
    if not 1 <= n_sde <= T:
        raise common.UsageError(f"--sde-steps {n_sde} must be between 1 and --sample-steps {T}")
    strides = parse_granularities(args.granularities)
    L = len(strides)
    micro_batches = [slice(i, min(i + mb, B)) for i in range(0, B, mb)]  # prompt rows per forward, rollout and update
    common.print0(f"ranks {rt.world_size} | prompts/rank B={B} | group G={G} | steps T={T}, branched M=0..{n_sde - 1} "
                  f"| strides {strides} | images/rank {B * n_sde * G * L} | micro-batch {mb} | optimizer "
                  f"steps/iteration {n_sde}")

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
    sigmas = common.uniform_sigmas(T, args.grid_shift)       # (T+1,) t_0 = 1 ... t_T = 0 (reading 6)
    t_cap = float(sigmas[1])                                 # replaces t = 1 in g's denominator

    def ref_mu(x, t, s, cond):
        """The step's mu under the reference policy (no grad): LoRA switched off, or the frozen copy."""
        with torch.no_grad(), (common.lora_disabled(transformer) if lora else contextlib.nullcontext()):
            v = adapter.velocity(ref if ref is not None else transformer, x, t, cond)
        return common.sde_mean_std(x, v, t, s, args.noise_level, t_cap)[0]

    def branch_velocity(x, i, cond):
        """v_theta(x, t_i) for branch rows x with their conditioning rows, mb rows per forward."""
        return torch.cat([adapter.velocity(net, x[r:r + mb], sigmas[i], common.cond_select(cond, slice(r, r + mb)))
                          for r in range(0, len(x), mb)])

    # >>> shared: loop
    # reads loop; defines it, metrics
    for it in tqdm(range(run.start, args.iterations + 1), desc=Path(__file__).stem, disable=not rt.is_main):
        metrics = loop.begin(it)                             # evaluation when due; None once the last line is logged
        if metrics is None:
            break
        # <<< shared: loop

        # ---- 3a. Rollout: ODE anchor, singular SDE branches, multi-granularity ODE continuations (no grad) ----
        # >>> shared: iteration-start
        # reads B; defines tic, gen, batch, records, texts
        tic = time.time()
        gen = common.make_generator(args.seed, rt.rank, it)  # every draw of this rank and iteration
        batch = common.sample_prompts(train_prompts, args.prompts_per_step, common.make_generator(args.seed, it))
        records = batch[rt.rank * B:(rt.rank + 1) * B]     # (B,) this rank's prompts with their metadata
        texts = [r["prompt"] for r in records]
        # <<< shared: iteration-start
        cond = adapter.encode(texts)                          # (B, ...) one row per prompt
        transformer.eval()
        with torch.no_grad():
            # [G2RPO, Singular Stochastic Sampling] one initial noise per prompt, shared by its G branches, and the
            # deterministic ODE anchor from it; keep z_k and v_theta(z_k) for every k in M
            anchor, velocities, finals = [], [], []          # (B, n_sde, ...), (B, n_sde, ...), (B, ...)
            for rows in loop.each(micro_batches, count="nfe_anchor"):  # its forwards logged as nfe_anchor; a signal
                c = common.cond_select(cond, rows)                     # stops the run here (README, Fork a method)
                z = adapter.noise(rows.stop - rows.start, gen)
                zs, vs = [], []
                for k in range(T):
                    v = adapter.velocity(net, z, sigmas[k], c)
                    zs.append(z)
                    vs.append(v)
                    z = common.ode_step(z, v, sigmas[k], sigmas[k + 1])
                anchor.append(torch.stack(zs[:n_sde], 1))
                velocities.append(torch.stack(vs[:n_sde], 1))
                finals.append(z)
            anchor, velocities, finals = torch.cat(anchor), torch.cat(velocities), torch.cat(finals)

            # [G2RPO, Singular Stochastic Sampling] for each k in M, ONE SDE step per branch from the shared z_k; the
            # anchor's v_theta(z_k) gives the step mean, so branching needs no evaluation (reading 4)
            branches = torch.empty(B, n_sde, G, *anchor.shape[2:], device=anchor.device)  # (B, n_sde, G, ...) z_{k+1}^i
            log_probs = torch.empty(B, n_sde, G, device=anchor.device)                     # (B, n_sde, G) l_old
            for rows in micro_batches:
                for k in range(n_sde):
                    branches[rows, k], log_probs[rows, k], _, _ = singular_sde_step(
                        anchor[rows, k], velocities[rows, k], sigmas[k], sigmas[k + 1], G, args.noise_level, t_cap, gen)

            # [G2RPO, MGAI] finish every branch with the ODE at every stride (reading 5), one k at a time
            branch_cond = common.cond_repeat(cond, G)         # (B*G, ...) a row per branch, prompt-major
            continued = torch.empty(B, n_sde, G, L, *anchor.shape[2:], device=anchor.device)  # at t = 0
            for k in loop.each(range(n_sde), count="nfe_continuation"):
                z = rearrange(branches[:, k], "b g ... -> (b g) ...")
                ends = continue_ode(branch_velocity, z, branch_cond, k, sigmas, strides)
                continued[:, k] = rearrange(ends, "(b g) l ... -> b g l ...", g=G)
        t_rollout = time.time() - tic

        # ---- 3b. Rewards -> multi-granularity advantages [G2RPO, MGAI] ----
        tic = time.time()
        flat = rearrange(continued, "b k g l ... -> (b k g l) ...")
        owners = [r for r in records for _ in range(n_sde * G * L)]  # the prompt (record) of each row of flat
        parts = {name: [] for name in reward_fn.weights}
        with torch.no_grad():
            for i in range(0, len(flat), mb):                  # decode and score in micro-batches; images are not kept
                rows_i = owners[i:i + mb]
                for name, r in reward_fn(adapter.decode(flat[i:i + mb]), [o["prompt"] for o in rows_i],
                                         rows_i)[1].items():
                    parts[name].append(r)
            anchor_rewards = torch.cat([reward_fn(adapter.decode(finals[rows]), texts[rows], records[rows])[0]
                                        for rows in micro_batches])  # logged, not trained on (reading 10)
        parts = {name: rearrange(torch.cat(r), "(b k g l) -> b k g l", k=n_sde, g=G, l=L) for name, r in parts.items()}
        rewards = reward_fn.total(parts)                                                # (B, n_sde, G, L)
        advantages = reward_fn.advantages(parts, mgai_advantages).clamp(-args.adv_clip, args.adv_clip)  # (B, n_sde, G)
        t_reward = time.time() - tic

        # ---- 3c. Policy update: one optimizer step per k in M, PPO-clipped ratio of the single SDE step ----
        tic = time.time()
        transformer.train()
        stats = common.UpdateStats()
        # reading 8: k = 0, 1, ... after all rollouts, so only the first step is exactly on-policy; a step's loss is
        # the mean over all the rank's branches (official: one prompt per GPU), and DDP averages the ranks
        for k in loop.each(range(n_sde)):                    # a signal before the first optimizer step stops here
            n_step = it * n_sde + k + 1                      # this optimizer step's number in the run, from 1
            for rows in micro_batches:
                P = rows.stop - rows.start
                c, z, A = common.cond_select(cond, rows), anchor[rows, k], advantages[rows, k]  # z_k: (P, ...)
                with common.no_sync(net, rows != micro_batches[-1]):  # the step's last backward all-reduces
                    v = adapter.velocity(net, z, sigmas[k], c)  # one forward per prompt: the G branches share z_k
                    _, lp, mu, std_k = singular_sde_step(z, v, sigmas[k], sigmas[k + 1], G, args.noise_level, t_cap,
                                                         next_x=branches[rows, k])     # (P, G) log-probs, mu (P, ...)
                    ratio = torch.exp(lp - log_probs[rows, k])                           # (P, G)
                    # [Flow-GRPO Eq. 5] the clipped objective on step k only, no KL by default [G2RPO, objective]
                    pg = clipped_objective(ratio, A, args.clip_range)
                    kl = common.gaussian_kl(mu, ref_mu(z, sigmas[k], sigmas[k + 1], c), std_k) \
                        if args.beta > 0 else torch.zeros(P, device=pg.device)
                    loss = pg.mean() + args.beta * kl.mean()
                    guard.backward(loss * P / B)             # the step's loss: mean over all the rank's branches
                stats.add(loss=loss, pg_loss=pg.mean(), kl=kl.mean(), ratio_dev=(ratio - 1).abs().max(),
                          clip_frac=((ratio - 1).abs() > args.clip_range).float().mean(),
                          approx_kl=0.5 * ((lp - log_probs[rows, k]) ** 2).mean())
            # >>> shared: step
            # reads stats, n_step; defines stepped, grad_norm
            stepped, grad_norm = guard.step(optimizer, params, args.grad_clip)  # skipped if not finite
            stats.stepped(grad_norm)
            if ema and stepped:
                ema.step(n_step)
            # <<< shared: step
        t_update = time.time() - tic

        # ---- 3d. Metrics ----
        zero_std = torch.stack([(r.std(2) < 1e-6).float().mean() for r in parts.values()]).mean()
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
        metrics.update({
            **{f"reward_stride{s}": common.all_reduce_mean(rewards[..., l].mean()).item()
               for l, s in enumerate(strides)},
            "anchor_reward": common.all_reduce_mean(anchor_rewards.float().mean().to(rt.device)).item(),
            "adv_abs_mean": advantages.abs().mean().item(),
            "adv_clamp_frac": (advantages.abs() >= args.adv_clip).float().mean().item(),
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
