"""A likelihood-free method forked from flow_grpo.py, for the tests of the shared machinery (not a trainer: it lives in
tests/, where trainers are not looked for). The rollout is the ODE; the update needs no likelihood ratio: a
reward-weighted flow-matching loss between two implicit policies built from the trained velocity and an old one, as
DiffusionNFT's (arXiv 2509.16117), simplified: v+ = (1 - b) v_old + b v, v- = (1 + b) v_old - b v, the loss
r |v+ - u|^2 + (1 - r) |v- - u|^2 with u = eps - x0 and r in [0, 1] from the clipped group advantage. The old policy
is a soft copy of the weights (common.EMA without warm-up), checkpointed as the method's own state (extra_state). It
logs no ratio and no KL: tests/test_fork.py runs it through --preflight and --resume.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange

import common
import flow_grpo
from common import field


@dataclass
class Args(flow_grpo.Args):
    # --- the likelihood-free method ---
    iterations: int = field(2, "training iterations", at_least=0)
    prompts_per_step: int = field(2, "prompts per iteration, over all ranks", at_least=1)
    group_size: int = field(4, "samples per prompt", at_least=2)
    micro_batch: int = field(4, "samples per forward pass", at_least=1)
    sample_steps: int = field(4, "ODE steps of a rollout", at_least=1)
    eval_images: int = field(16, "held-out images per evaluation", at_least=1)
    eval_steps: int = field(10, "ODE steps at evaluation", at_least=1)
    threads: int | None = field(1, "CPU threads", at_least=1)
    guidance: float = field(1.0, "b: how far the implicit policies lie from the old one", at_least=1e-12)
    old_decay: float = field(0.5, "the old policy's decay per optimizer step", at_least=0, at_most=1)


MODEL_DEFAULTS: dict = {}


def flow_matching_error(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error of a velocity against the flow-matching target. (n,)."""
    return rearrange(F.mse_loss(v, target, reduction="none"), "n ... -> n (...)").mean(1)


def main(args: Args) -> dict:
    rt = common.setup_training(args)
    B, G = args.prompts_per_step // rt.world_size, args.group_size
    N, mb, T = B * G, args.micro_batch, args.sample_steps
    per_update = common.micro_batches_per_update(N, mb, args.updates_per_rollout)
    train_prompts, eval_prompts = common.load_prompts(args.prompts, args.model)
    reward_terms = common.parse_reward_spec(args.reward)
    if args.preflight:                                       # the run's checks passed (README, Before a long run)
        return common.preflight(main, args)
    run = common.prepare_run(args, rt, Path(__file__).stem)
    reward_fn = common.WeightedReward(reward_terms, rt.device, args.reward_norm)
    adapter = common.load_model(args.model, rt, args.model_path)
    common.instrument(adapter)
    transformer = adapter.transformer
    params = common.add_lora(transformer, args.lora_rank, args.lora_alpha, adapter.lora_targets)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    old = common.EMA(params, decay=args.old_decay, every=1, warmup=False)   # the old policy, a soft copy
    guard = common.StepGuard(args.max_bad_steps, rt.device, loss_scaling=rt.dtype == torch.float16)
    loop = common.TrainingLoop(args, run, rt, adapter, params, optimizer, None, eval_prompts, reward_fn, guard,
                               extra_state={"old_policy": old.shadow})
    net = torch.nn.parallel.DistributedDataParallel(transformer) if rt.distributed else transformer
    sigmas, b = adapter.sigmas(T), args.guidance
    for it in range(run.start, args.iterations + 1):
        metrics = loop.begin(it)
        if metrics is None:
            break
        tic = time.time()
        gen = common.make_generator(args.seed, rt.rank, it)
        records = common.sample_prompts(train_prompts, args.prompts_per_step,
                                        common.make_generator(args.seed, it))[rt.rank * B:(rt.rank + 1) * B]
        owners = [r for r in records for _ in range(G)]
        cond = common.cond_repeat(adapter.encode([r["prompt"] for r in records]), G)
        transformer.eval()
        finals = torch.cat([common.sample_ode(adapter, net, common.cond_select(cond, slice(i, i + mb)),
                                              adapter.noise(mb, gen), sigmas) for i in loop.each(range(0, N, mb))])
        t_rollout, tic = time.time() - tic, time.time()
        with torch.no_grad():
            rewards, parts = reward_fn(adapter.decode(finals), [r["prompt"] for r in owners], owners, batch_size=mb)
        advantages = reward_fn.advantages(parts, lambda r: flow_grpo.group_advantages(r, G, False))
        r = (advantages.clamp(-args.adv_clip, args.adv_clip) / (2 * args.adv_clip) + 0.5).to(rt.device)  # in [0, 1]
        t_reward, tic = time.time() - tic, time.time()
        transformer.train()
        stats = common.UpdateStats()
        for u in loop.each(range(args.updates_per_rollout)):
            n_step = it * args.updates_per_rollout + u + 1
            minibatch = list(range(u * per_update, (u + 1) * per_update))
            for m in minibatch:
                idx = slice(m * mb, (m + 1) * mb)
                x0, c = finals[idx], common.cond_select(cond, idx)
                t = torch.rand(mb, generator=gen).to(rt.device)
                eps = torch.randn(x0.shape, generator=gen).to(rt.device)
                xt = (1 - t.view(-1, *[1] * (x0.dim() - 1))) * x0 + t.view(-1, *[1] * (x0.dim() - 1)) * eps
                with torch.no_grad(), old.swapped_in():
                    v_old = adapter.velocity(transformer, xt, t, c)
                with common.no_sync(net, m != minibatch[-1]):
                    v = adapter.velocity(net, xt, t, c)
                    loss = (r[idx] * flow_matching_error((1 - b) * v_old + b * v, eps - x0)
                            + (1 - r[idx]) * flow_matching_error((1 + b) * v_old - b * v, eps - x0)).mean()
                    guard.backward(loss / len(minibatch))
                stats.add(loss=loss)
            stepped, grad_norm = guard.step(optimizer, params, args.grad_clip)
            stats.stepped(grad_norm)
            if stepped:
                old.step(n_step)
        t_update = time.time() - tic
        metrics.update(stats.metrics())
        metrics.update({"reward_mean": common.all_reduce_mean(rewards.mean()).item(), **reward_fn.means(parts),
                        "t_rollout": t_rollout, "t_reward": t_reward, "t_update": t_update,
                        **loop.work()})
        loop.end(metrics)
    return loop.finish()


if __name__ == "__main__":
    common.run_cli(main, Args, MODEL_DEFAULTS)
