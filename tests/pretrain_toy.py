"""Maintainer tool: pre-trains the toy model whose weights ship in assets/toy. Same seed, same weights, bit for bit:

  python tests/pretrain_toy.py                      # 1000 steps, about 4 minutes on 2 CPU cores -> assets/toy
  python tests/pretrain_toy.py --out /tmp/toy       # elsewhere, e.g. to compare with the shipped weights
"""
from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402


def toy_render(color: str, shape: str, half: float) -> np.ndarray:
    """(3, 16, 16) float32 image in [0, 1]: an anti-aliased shape on black."""
    coverage = common.toy_coverage(shape, half)
    return (np.asarray(common.TOY_COLORS[color], np.float32)[:, None, None] * coverage).astype(np.float32)


def toy_pack(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, 16, 16) in [0, 1] -> (B, 64, 12) tokens in [-1, 1]: 2x2 patches, as FLUX packs latents (common.toy_unpack
    inverts it)."""
    return rearrange(images * 2 - 1, "b c (h p) (w q) -> b (h w) (c p q)", p=2, q=2)


def build_toy_modules(seed: int = 0):
    """The toy networks at their shipped sizes, random weights: a FluxTransformer2DModel (2 double + 2 single blocks,
    width 64) on 2x2-packed pixels and a 2-layer CLIPTextModel."""
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tok = common.ToyTokenizer()
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok.vocab), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=tok.max_length, projection_dim=64,
        pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id))
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=12, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=False,
        axes_dims_rope=(4, 6, 6))
    return transformer, text_encoder


@torch.no_grad()
def toy_quick_eval(adapter, net, pairs, per_pair: int = 12, steps: int = 20, seed: int = 1234) -> tuple:
    """(mean reward, strict accuracy) of `per_pair` ODE samples of each (colour, shape) pair."""
    prompts = [common.toy_prompt(c, s) for c, s in pairs for _ in range(per_pair)]
    x = adapter.noise(len(prompts), common.make_generator(seed))
    imgs = adapter.decode(common.sample_ode(adapter, net, adapter.encode(prompts), x, adapter.sigmas(steps)))
    return common.toy_reward(imgs, prompts).mean().item(), common.toy_accuracy(imgs, prompts).mean().item()


def pretrain_toy(argv=None):
    """Pre-trains the toy transformer with the rectified-flow loss on renders of the seen (colour, shape) pairs
    and saves it to assets/toy (`python tests/pretrain_toy.py --help`). The text encoder keeps its random
    initialisation (seed --seed), frozen: a fixed random embedding of the prompt's words is conditioning enough."""
    p = argparse.ArgumentParser(prog="python tests/pretrain_toy.py", description=pretrain_toy.__doc__)
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (cosine decay over them)")
    p.add_argument("--batch-size", type=int, default=64, help="images per step")
    p.add_argument("--lr", type=float, default=1.5e-3, help="AdamW peak learning rate (cosine decay, 100 warm-up)")
    p.add_argument("--ema", type=float, default=0.999, help="EMA decay of the saved weights (warmed up from 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed")
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--out", default=str(common.ASSETS / "toy"), help="output folder")
    p.add_argument("--save-at", default="", help="comma-separated extra steps to save at, into OUT-stepN")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    random.seed(a.seed)  # as common.setup_runtime seeds
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    from tqdm import tqdm
    transformer, text_encoder = build_toy_modules(a.seed)
    adapter = common.ToyAdapter(transformer, text_encoder, torch.device("cpu"))  # freezes the text encoder
    params = list(transformer.parameters())
    ema = common.EMA(params, decay=a.ema, every=1)  # decay warmed up, so the random init washes out
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.01)
    warmup_cosine = lambda s: min(1, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / a.steps))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    seen = sorted(common.TOY_SEEN)
    rng = np.random.default_rng(a.seed)
    save_at = {int(s) for s in a.save_at.split(",") if s}

    def save(folder):
        with ema.swapped_in():
            transformer.save_pretrained(Path(folder) / "transformer")
            text_encoder.save_pretrained(Path(folder) / "text_encoder")
            r_seen = toy_quick_eval(adapter, transformer, seen)
            r_held = toy_quick_eval(adapter, transformer, common.TOY_HELD_OUT)
        print(f"saved {folder}: reward/accuracy seen {r_seen[0]:.3f}/{r_seen[1]:.3f}, "
              f"held-out {r_held[0]:.3f}/{r_held[1]:.3f}", flush=True)

    bar = tqdm(range(a.steps), desc="pretrain-toy", mininterval=5)
    for step in bar:
        idx = rng.integers(len(seen), size=a.batch_size)
        halves = rng.uniform(*common.TOY_HALF_SIZE, size=a.batch_size)
        imgs = torch.from_numpy(np.stack([toy_render(*seen[i], h) for i, h in zip(idx, halves)]))
        x0 = toy_pack(imgs)
        cond = adapter.encode([common.toy_prompt(*seen[i]) for i in idx])
        t = torch.sigmoid(torch.randn(a.batch_size))  # logit-normal times, as SD3 pre-training
        eps = torch.randn_like(x0)
        xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * eps
        loss = F.mse_loss(adapter.velocity(transformer, xt, t, cond), eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema.step(step)
        bar.set_postfix(loss=f"{loss.item():.4f}")
        if step + 1 in save_at:
            save(f"{a.out}-step{step + 1}")
    save(a.out)


if __name__ == "__main__":
    pretrain_toy()
