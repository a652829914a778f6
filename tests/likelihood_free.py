"""A likelihood-free method forked from flow_grpo.py by the README's recipe (Fork a method): the template for a method
without a likelihood ratio, `cp tests/likelihood_free.py my_method.py`. The update is DiffusionNFT's (arXiv
2509.16117), simplified: the rollout is the ODE sampler, keeping only the final samples o; the update fits the
flow-matching target u = eps - o at x_t = (1 - t) o + t eps with two implicit policies around an old one,
v+ = (1 - b) v_old + b v and v- = (1 + b) v_old - b v: r |v+ - u|^2 + (1 - r) |v- - u|^2, r in [0, 1] from the clipped
group advantage, so v moves towards u on good samples and away from it on bad ones. The old policy is a soft copy of
the trained weights (common.EMA without warm-up), checkpointed as the method's own state (extra_state).

Differences from flow_grpo.py: ODE rollouts without log-probs; nft_loss in place of step_loss, and an update of its own
in place of the shared `update` block, which is dropped with `ratio-log` (there is no ratio, no KL and no reference
network); an old policy, stepped after each optimizer step. Every other shared block is kept.

Simplifications / readings:
  1. reward_weight: r = clamp(A, -adv_clip, adv_clip) / (2 adv_clip) + 1/2, the group advantage mapped to [0, 1].
  2. One (t, eps) pair per sample and iteration, t uniform in (0, 1).
  3. The old policy's velocities at those pairs are computed once, before the update, its weights swapped in.

Run: cp tests/likelihood_free.py my_method.py && python my_method.py   (the toy, CPU)
Notation: as flow_grpo.py's; o = samples; b = guidance; r = weight.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange
from tqdm import tqdm

import common
from common import field


# ---- 0. Config: the defaults are the toy run; MODEL_DEFAULTS holds what differs at full scale ----
@dataclass
class Args:
    # --- the likelihood-free method ---
    iterations: int = field(30, "training iterations (rollout + update)", at_least=0, at_most=10**9)
    prompts_per_step: int = field(16, "prompts per iteration, over all ranks", at_least=1, at_most=100_000)
    group_size: int = field(8, "samples per prompt (G)", at_least=2, at_most=100_000)
    micro_batch: int = field(32, "samples per forward pass, in rollout and update alike", at_least=1)
    lr: float = field(3e-4, "AdamW learning rate", at_least=1e-12, at_most=1)
    sample_steps: int = field(10, "ODE steps T of a training rollout", at_least=1, at_most=1000)
    updates_per_rollout: int = field(2, "optimizer steps per iteration, one per minibatch of the rollout", at_least=1)
    guidance: float = field(1.0, "b: how far the implicit policies v+ and v- lie from the old one", at_least=1e-12)
    old_decay: float = field(0.5, "the old policy's decay per optimizer step (0: the weights themselves)",
                             at_least=0, at_most=1)
    adv_clip: float = field(2.0, "advantages are clamped to [-adv_clip, adv_clip], then mapped to [0, 1]",
                            at_least=1e-12)
    global_std: bool = field(False, "advantages divided by the std of all the iteration's rewards (else the group's)")
    reward_norm: str = field("sum", "with several rewards: sum (advantage of their weighted sum) or per-reward (each "
                                    "reward's advantage, then their weighted sum)", choices=common.REWARD_NORMS)
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


# Full scale: flow_grpo.py's settings, where a fork starts from (its method's own go here, one key per line).
MODEL_DEFAULTS = {
    "sd3": {
        "reward": "pickscore",
        "prompts": "pickscore",
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
    },
    "flux": {
        "reward": "pickscore",
        "prompts": "pickscore",
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
    },
}


# ---- 1. Method functions ----
def group_advantages(rewards: torch.Tensor, G: int, global_std: bool) -> torch.Tensor:
    """(R - group mean) / (std + 1e-4) for rewards (N,) in groups of G consecutive rows -> (N,): flow_grpo.py's, a
    population std of all the iteration's rewards on all ranks (global_std) or of the group's own."""
    grouped = rearrange(rewards, "(b g) -> b g", g=G)
    std = common.all_gather_cat(rewards).std(correction=0) if global_std else grouped.std(1, correction=0, keepdim=True)
    return rearrange((grouped - grouped.mean(1, keepdim=True)) / (std + 1e-4), "b g -> (b g)")


def reward_weight(advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """[DiffusionNFT, optimality probability] Reading 1: r = clamp(A, -clip, clip) / (2 clip) + 1/2, in [0, 1]; a
    sample with zero advantage weighs 1/2, which leaves v where v_old is. (n,)."""
    return advantages.clamp(-clip, clip) / (2 * clip) + 0.5


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, r: torch.Tensor, b: float) -> torch.Tensor:
    """[DiffusionNFT, negative-aware fine-tuning] r |v+ - u|^2 + (1 - r) |v- - u|^2 with v+ = (1 - b) v_old + b v and
    v- = (1 + b) v_old - b v, each squared error a mean over the sample's elements. At v = v_old its gradient in v is
    2 b (2 r - 1) (v_old - u): towards u where r > 1/2, away from it where r < 1/2. (n,)."""
    def error(x):
        return rearrange(F.mse_loss(x, target, reduction="none"), "n ... -> n (...)").mean(1)
    return r * error((1 - b) * v_old + b * v) + (1 - r) * error((1 + b) * v_old - b * v)


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
    common.print0(f"ranks {rt.world_size} | prompts/rank B={B} | group G={G} | samples/rank N={N} | micro-batch {mb} "
                  f"| updates/iteration {args.updates_per_rollout} | ODE steps T={T}")

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
    ref = None                                               # no reference network: the method has no KL
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
    old = common.EMA(params, args.old_decay, every=1, warmup=False)  # the old policy, a soft copy of the weights
    # the clock, log, evaluations and checkpoints; --resume loads the old policy too, bitwise
    loop = common.TrainingLoop(args, run, rt, adapter, params, optimizer, ema, eval_prompts, reward_fn, guard,
                               extra_state={"old_policy": old.shadow})
    sigmas = adapter.sigmas(T)                               # (T+1,) t_0 = 1 ... t_T = 0

    # >>> shared: loop
    # reads loop; defines it, metrics
    for it in tqdm(range(run.start, args.iterations + 1), desc=Path(__file__).stem, disable=not rt.is_main):
        metrics = loop.begin(it)                             # evaluation when due; None once the last line is logged
        if metrics is None:
            break
    # <<< shared: loop

        # ---- 3a. Rollout: ODE sampling with the current policy, no grad ----
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
        samples = []                                         # (N, ...) o
        for i in loop.each(range(0, N, mb)):                # a signal stops the run here (README, Fork a method)
            samples.append(common.sample_ode(adapter, net, common.cond_select(cond, slice(i, i + mb)),
                                             adapter.noise(mb, gen), sigmas))
        samples = torch.cat(samples)
        t_rollout = time.time() - tic

        # ---- 3b. Rewards -> group advantages -> each sample's weight r (reading 1) ----
        tic = time.time()
        with torch.no_grad():
            images = torch.cat([adapter.decode(samples[i:i + mb]) for i in range(0, N, mb)])
            rewards, parts = reward_fn(images, [r["prompt"] for r in owners], owners, batch_size=mb)
        advantages = reward_fn.advantages(parts, lambda r: group_advantages(r, G, args.global_std))
        weight = reward_weight(advantages, args.adv_clip)
        t_reward = time.time() - tic

        # ---- 3c. Update: the NFT loss at one (t, eps) pair per sample (reading 2) [DiffusionNFT, simplified] ----
        tic = time.time()
        t = torch.rand(N, generator=gen).to(samples.device)     # (N,)
        eps = adapter.noise(N, gen)                           # (N, ...)
        tb = t.view(-1, *[1] * (samples.dim() - 1))
        x_t = (1 - tb) * samples + tb * eps                   # (N, ...) the forward process at t
        v_old = []                                           # (N, ...) reading 3
        with torch.no_grad(), old.swapped_in():              # a signal here waits until the weights are back
            for i in loop.each(range(0, N, mb)):
                idx = slice(i, i + mb)
                v_old.append(adapter.velocity(net, x_t[idx], t[idx], common.cond_select(cond, idx)))
        v_old = torch.cat(v_old)
        if args.fsdp:  # FSDP2 keeps the root's weights gathered after a forward: the old policy's, stale once swapped
            transformer.reshard()
        transformer.train()
        order = torch.randperm(N // mb, generator=gen)       # shuffled whole micro-batches, as flow_grpo.py's update
        stats = common.UpdateStats()
        for u in loop.each(range(args.updates_per_rollout)):  # a signal before the first optimizer step stops here
            n_step = it * args.updates_per_rollout + u + 1    # this optimizer step's number in the run, from 1
            minibatch = order[u * per_update:(u + 1) * per_update].tolist()  # the step's rollout micro-batches
            for m in minibatch:
                idx = slice(m * mb, (m + 1) * mb)
                with common.no_sync(net, m != minibatch[-1]):  # the step's last backward all-reduces
                    v = adapter.velocity(net, x_t[idx], t[idx], common.cond_select(cond, idx))
                    loss = nft_loss(v, v_old[idx], eps[idx] - samples[idx], weight[idx], args.guidance).mean()
                    guard.backward(loss / len(minibatch))
                stats.add(loss=loss)
            # >>> shared: step
            # reads stats, n_step; defines stepped, grad_norm
            stepped, grad_norm = guard.step(optimizer, params, args.grad_clip)  # skipped if not finite
            stats.stepped(grad_norm)
            if ema and stepped:
                ema.step(n_step)
            # <<< shared: step
            if stepped:
                old.step(n_step)                             # the old policy follows the weights
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

        # >>> shared: loop-end
        # reads loop; defines nothing
        # ---- 3e. Log the line, checkpoint every --save-every iterations ----
        loop.end(metrics)
    return loop.finish()                                     # the final checkpoint
    # <<< shared: loop-end


# ---- 4. Entry point ----
if __name__ == "__main__":
    common.run_cli(main, Args, MODEL_DEFAULTS)
