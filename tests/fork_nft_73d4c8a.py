"""DiffusionNFT (arXiv 2509.16117), simplified: a likelihood-free fork of flow_grpo.py as written at commit 73d4c8a,
by the README's recipe of then, kept frozen for tests/test_fork.py (never edit it: it stands for a fork written two
releases ago). The rollout is the ODE; the update fits the flow-matching target u = eps - x0 of each sample with two
implicit policies around an old one, v+ = (1 - b) v_old + b v and v- = (1 + b) v_old - b v, weighted by r in [0, 1]
from the clipped group advantage: r |v+ - u|^2 + (1 - r) |v- - u|^2. The old policy is a soft copy of the weights.

As such forks were then: the update and ratio-log blocks dropped, the step block's lines rewritten without its markers
(the old policy steps with the optimizer), the TrainingLoop built inside the setup-train block (so the old policy is
not checkpointed: a resume restarts it from the weights).
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


@dataclass
class Args:
    # >>> shared: args
    model: str = field("toy", f"model: {', '.join(common.MODELS)}", choices=common.MODELS)
    model_path: str | None = field(None, "hub id or local folder overriding the model's default weights; random: the "
                                         "published architecture with random weights, random:N with N blocks")
    reward: str = field("toy", "reward spec 'name[:weight],...' from: " + ", ".join(common.REWARDS) + "; or a "
                               "scorer served by common.py serve-reward: remote:http://HOST:PORT/NAME[:weight]")
    prompts: str | None = field(None, "prompt file (.txt, or .jsonl with 'prompt'); default: toy grammar or "
                                      "assets/prompts.txt")
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
    resolution: int | None = field(None, "image size in pixels (flux / sd3; the toy's is 16)",
                                   at_least=16, at_most=4096)
    guidance_scale: float | None = field(None, "CFG scale (sd3) or guidance embedding (flux); the toy has none",
                                         at_least=0)
    max_sequence_length: int | None = field(None, "T5 prompt tokens (flux: 512, sd3: 128); longer prompts are cut",
                                            at_least=1, at_most=512)
    dtype: str = field("bf16", "GPU compute dtype: bf16, or fp16 (autocast over float32 transformer weights, loss "
                               "scaling); CPU runs compute in float32", choices=tuple(common.DTYPES))
    offload_encoders: bool = field(False, "keep the text encoders on the CPU between encodes (T5-XXL: 9.5 GB in bf16)")
    weight_decay: float = field(1e-4, "AdamW weight decay", at_least=0)
    grad_clip: float = field(1.0, "gradient-norm clip", at_least=1e-12)
    lora_rank: int = field(0, "LoRA rank; 0 = full fine-tuning", at_least=0, at_most=4096)
    lora_alpha: float = field(0.0, "LoRA alpha", at_least=0)
    ema: bool = field(False, "keep an EMA of the trained weights for evaluation and checkpoints")
    gradient_checkpointing: bool = field(False, "recompute activations in the backward pass")
    fsdp: bool = field(False, "shard full fine-tuning (--lora-rank 0) over the torchrun processes with FSDP2; "
                              "LoRA runs replicate with DDP")
    preflight: bool = field(False, "run and check one iteration in a temporary folder and project the run's cost, "
                                   "then stop (exit 1 if a check FAILed): writes only preflight.json in the run "
                                   "folder (README, Before a long run)")
    # <<< shared: args
    # --- DiffusionNFT ---
    iterations: int = field(30, "training iterations (rollout + update)", at_least=0, at_most=10**9)
    prompts_per_step: int = field(16, "prompts per iteration, over all ranks", at_least=1, at_most=100_000)
    group_size: int = field(8, "samples per prompt (G)", at_least=2, at_most=100_000)
    micro_batch: int = field(32, "samples per forward pass, in rollout and update alike", at_least=1)
    lr: float = field(1e-4, "AdamW learning rate", at_least=1e-12, at_most=1)
    sample_steps: int = field(10, "ODE steps T of a training rollout", at_least=1, at_most=1000)
    updates_per_rollout: int = field(2, "optimizer steps per iteration, one per minibatch of the rollout", at_least=1)
    adv_clip: float = field(2.0, "advantages are clipped to [-adv_clip, adv_clip], then mapped to [0, 1]",
                            at_least=1e-12)
    global_std: bool = field(False, "advantages divided by the std of all the iteration's rewards (else the group's)")
    reward_norm: str = field("sum", "with several rewards: sum (advantage of their weighted sum) or per-reward (each "
                                    "reward's advantage, then their weighted sum)", choices=common.REWARD_NORMS)
    guidance: float = field(1.0, "b: how far the implicit policies lie from the old one", at_least=1e-12)
    old_decay: float = field(0.5, "the old policy's decay per optimizer step", at_least=0, at_most=1)


MODEL_DEFAULTS: dict = {}


def group_advantages(rewards: torch.Tensor, G: int, global_std: bool) -> torch.Tensor:
    """(R - group mean) / (std + 1e-4) for rewards (N,) in groups of G consecutive rows -> (N,)."""
    grouped = rearrange(rewards, "(b g) -> b g", g=G)
    std = common.all_gather_cat(rewards).std(correction=0) if global_std else grouped.std(1, correction=0, keepdim=True)
    return rearrange((grouped - grouped.mean(1, keepdim=True)) / (std + 1e-4), "b g -> (b g)")


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, r: torch.Tensor, b: float) -> torch.Tensor:
    """r |v+ - u|^2 + (1 - r) |v- - u|^2 per sample, each a mean over elements. (n,)."""
    def error(x):
        return rearrange(F.mse_loss(x, target, reduction="none"), "n ... -> n (...)").mean(1)
    return r * error((1 - b) * v_old + b * v) + (1 - r) * error((1 + b) * v_old - b * v)


def main(args: Args) -> dict:
    # >>> shared: validate
    if args.preflight:                                       # one iteration of this main, checked (README)
        return common.preflight(main, args)
    rt = common.setup_training(args)                         # the flags every trainer has, then torchrun and seeds
    W = rt.world_size
    # <<< shared: validate
    B, G = args.prompts_per_step // W, args.group_size
    N, mb, T = B * G, args.micro_batch, args.sample_steps
    per_update = common.micro_batches_per_update(N, mb, args.updates_per_rollout)
    common.print0(f"ranks {W} | prompts/rank B={B} | group G={G} | ODE steps T={T}")

    # >>> shared: setup-run
    train_prompts, eval_prompts = common.load_prompts(args.prompts, args.model)
    reward_terms = common.parse_reward_spec(args.reward)    # a bad --reward is refused before the run folder
    run = common.prepare_run(args, rt, Path(__file__).stem)  # the folder, and the checkpoint that --resume continues
    # <<< shared: setup-run
    # >>> shared: setup-model
    reward_fn = common.WeightedReward(reward_terms, rt.device, args.reward_norm)
    adapter = common.load_model(args.model, rt, args.model_path, args.resolution, args.guidance_scale,
                                args.max_sequence_length, args.offload_encoders)
    common.instrument(adapter)                               # the work counters every iteration logs (nfe_fwd, ...)
    transformer = adapter.transformer
    params = common.add_lora(transformer, args.lora_rank, args.lora_alpha, adapter.lora_targets)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    # <<< shared: setup-model
    ref = None                                               # no reference network: no KL
    # >>> shared: setup-train
    if args.fsdp:  # the trained transformer (float32 master weights) and any frozen reference, sharded per block
        params = common.fully_shard_model(transformer, rt, ref)
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay, eps=1e-8)
    ema = common.EMA(params) if args.ema else None
    loop = common.TrainingLoop(args, run, rt, adapter, params, optimizer, ema, eval_prompts, reward_fn)
    net = torch.nn.parallel.DistributedDataParallel(transformer) if rt.distributed and not args.fsdp else transformer
    guard = common.StepGuard(args.max_bad_steps, rt.device,  # skips non-finite steps on every rank; fp16: loss scaling
                             loss_scaling=rt.dtype == torch.float16)
    # <<< shared: setup-train
    old = common.EMA(params, decay=args.old_decay, every=1, warmup=False)   # the old policy, a soft copy
    sigmas = adapter.sigmas(T)

    # >>> shared: loop
    for it in tqdm(range(run.start, args.iterations + 1), desc=Path(__file__).stem, disable=not rt.is_main):
        metrics = loop.begin(it)                             # evaluation when due; None once the last line is logged
        if metrics is None:
            break
        # <<< shared: loop

        # >>> shared: iteration-start
        tic = time.time()
        work_before = common.work_snapshot(adapter, reward_fn, guard)
        gen = common.make_generator(args.seed, rt.rank, it)  # every draw of this rank and iteration
        batch = common.sample_prompts(train_prompts, args.prompts_per_step, common.make_generator(args.seed, it))
        records = batch[rt.rank * B:(rt.rank + 1) * B]     # (B,) this rank's prompts with their metadata
        texts = [r["prompt"] for r in records]
        # <<< shared: iteration-start
        owners = [r for r in records for _ in range(G)]
        cond = common.cond_repeat(adapter.encode(texts), G)
        transformer.eval()
        samples = []
        with torch.no_grad():
            for i in range(0, N, mb):
                loop.stop_if_signalled(it)                   # a signal drops the rollout
                samples.append(common.sample_ode(adapter, net, common.cond_select(cond, slice(i, i + mb)),
                                                 adapter.noise(mb, gen), sigmas))
        samples = torch.cat(samples)
        t_rollout = time.time() - tic

        tic = time.time()
        with torch.no_grad():
            images = torch.cat([adapter.decode(samples[i:i + mb]) for i in range(0, N, mb)])
            rewards, parts = reward_fn(images, [r["prompt"] for r in owners], owners, batch_size=mb)
        advantages = reward_fn.advantages(parts, lambda r: group_advantages(r, G, args.global_std))
        weight = advantages.clamp(-args.adv_clip, args.adv_clip) / (2 * args.adv_clip) + 0.5   # r in [0, 1]
        t_reward = time.time() - tic

        loop.stop_if_signalled(it)                           # before the first optimizer step: drop the rollout
        tic = time.time()
        transformer.train()
        order = torch.randperm(N // mb, generator=gen)
        stats = common.UpdateStats()
        for u in range(args.updates_per_rollout):
            n_step = it * args.updates_per_rollout + u + 1
            chunk = order[u * per_update:(u + 1) * per_update].tolist()
            for m in chunk:
                idx = slice(m * mb, (m + 1) * mb)
                x0, c = samples[idx], common.cond_select(cond, idx)
                t = torch.rand(mb, generator=gen).to(x0.device)
                eps = adapter.noise(mb, gen)
                tb = t.view(-1, *[1] * (x0.dim() - 1))
                xt = (1 - tb) * x0 + tb * eps
                with torch.no_grad(), old.swapped_in():
                    v_old = adapter.velocity(transformer, xt, t, c)
                with common.no_sync(net, m != chunk[-1]):
                    v = adapter.velocity(net, xt, t, c)
                    loss = nft_loss(v, v_old, eps - x0, weight[idx], args.guidance).mean()
                    guard.backward(loss / len(chunk))
                stats.add(loss=loss)
            stepped, grad_norm = guard.step(optimizer, params, args.grad_clip)  # skipped if not finite
            stats.stepped(grad_norm)
            if stepped:
                old.step(n_step)
        t_update = time.time() - tic

        zero_std = (rearrange(rewards, "(b g) -> b g", g=G).std(1) < 1e-6).float().mean()
        # >>> shared: log
        metrics.update(stats.metrics())                      # each key's mean over the backward passes; grad_norm
        metrics.update({
            "reward_mean": common.all_reduce_mean(rewards.mean()).item(),
            "reward_std": rewards.std().item(),
            **reward_fn.means(parts),
            "zero_std_frac": common.all_reduce_mean(zero_std).item(),
            "t_rollout": t_rollout, "t_reward": t_reward, "t_update": t_update,
            **common.work_done(adapter, reward_fn, work_before, guard),
        })
        # <<< shared: log

        # >>> shared: loop-end
        # ---- 3e. Log the line, checkpoint every --save-every iterations ----
        loop.end(metrics)
    return loop.finish()                                     # the final checkpoint
    # <<< shared: loop-end


if __name__ == "__main__":
    common.run_cli(main, Args, MODEL_DEFAULTS)
