"""The toy world's continuous reward, toy-soft (common.toy_soft_reward): the toy task with a reward that has no
ties, as a preference model's, next to the three-level toy reward."""
import numpy as np
import pytest
import torch

import common
import flow_grpo
import pretrain_toy
from helpers import SMALL, read_metrics, run

soft = common.toy_soft_reward


def render(color, shape, half=0.34, scale=1.0):
    return torch.from_numpy(pretrain_toy.toy_render(color, shape, half))[None] * scale


def test_renders_score_near_one_and_the_template_sizes_exactly_one():
    for color, shape in common.TOY_PAIRS:
        halves = np.linspace(*common.TOY_HALF_SIZE, 37)          # between the templates' sizes too
        imgs = torch.cat([render(color, shape, h) for h in halves])
        r = soft(imgs, [common.toy_prompt(color, shape)] * len(halves))
        assert r.min() >= 0.97 and r.max() <= 1.0, (color, shape, r.min())
        assert torch.equal(r[::3], torch.ones(len(halves[::3])))  # every 0.005: a template size


def test_hand_checked_values():
    # wrong palette colour, right shape: |red - yellow| = 1 = the palette gap, colour term 0, shape term 1
    assert soft(render("red", "square"), ["a yellow square"]).item() == 0.5
    assert soft(render("red", "square"), ["a green square"]).item() == 0.5   # |red - green| = sqrt 2: clamped at 0
    # orange, (1, 0.5, 0), asked for red: c_hat = (1, 0.5, 0), distance 0.5, colour term 0.5
    img = render("red", "square")
    img[:, 1] = 0.5 * img[:, 0]
    assert soft(img, ["a red square"]).item() == pytest.approx(0.75, abs=1e-6)
    # dimmed to 3/4: the colour is still exact; soft IoU with its own template = sum(0.75 m) / sum(m) = 0.75,
    # shape term (0.75 - 0.5) / 0.5 = 0.5
    assert soft(render("blue", "cross", 0.34, 0.75), ["a blue cross"]).item() == pytest.approx(0.75, abs=1e-6)
    assert soft(torch.zeros(1, 3, 16, 16), ["a red circle"]).item() == 0.0   # nothing drawn: 0 + 0
    # a circle asked to be a square: colour 1, shape (IoU - 0.5) / 0.5 with IoU the best over the drawn sizes
    m = render("white", "circle")[0, 0].flatten()
    iou = max((torch.minimum(m, t).sum() / torch.maximum(m, t).sum()).item() for t in
              (torch.from_numpy(common.toy_coverage("square", h)).flatten() for h in np.linspace(0.28, 0.40, 25)))
    assert 0.8 < iou < 0.9
    assert soft(render("red", "circle"), ["a red square"]).item() == pytest.approx(0.5 + (iou - 0.5), abs=1e-5)


def test_right_image_beats_wrong_shape_wrong_colour_and_blank():
    for color, shape in common.TOY_HELD_OUT:
        prompt = [common.toy_prompt(color, shape)]
        right = soft(render(color, shape), prompt).item()
        others = [soft(render(color, s), prompt).item() for s in common.TOY_SHAPES if s != shape]
        others += [soft(render(c, shape), prompt).item() for c in common.TOY_COLORS if c != color]
        assert right >= 0.97 and max(others) <= 0.9 and soft(torch.zeros(1, 3, 16, 16), prompt).item() == 0.0


def test_score_varies_continuously():
    # shrinking below the drawn sizes (rendered finer than toy_render's 4x4 subpixels, whose own steps are coarse):
    # the score falls step by step from 1 to 0.5, where the toy reward jumps
    halves = np.arange(0.28, 0.149, -0.005)
    imgs = torch.stack([torch.from_numpy(common.toy_coverage("triangle", h, supersample=16)).float().expand(3, 16, 16)
                        for h in halves])
    r = soft(imgs, ["a white triangle"] * len(halves))
    steps = r[1:] - r[:-1]
    assert (steps <= 1e-6).all() and r[0] == 1.0 and r[-1] == 0.5 and steps.min() > -0.06
    assert len(set(r.tolist())) > 15                               # many levels, not three
    # mixing red into yellow: c_hat = (1, t, 0), score 1 - t / 2 exactly for the red prompt
    t = torch.linspace(0, 1, 11)
    imgs = render("red", "circle").repeat(11, 1, 1, 1)
    imgs[:, 1] = t[:, None, None] * imgs[:, 0]
    assert torch.allclose(soft(imgs, ["a red circle"] * 11), 1 - t / 2, atol=1e-6)
    # dimming to k: falls with the brightness until the soft IoU reaches 0.5 (score 0.5 + 0.5 (k - 0.5) / 0.5 = k
    # while the own-size template fits best)
    k = torch.linspace(1, 0.55, 10)
    r = soft(render("white", "square") * k[:, None, None, None], ["a white square"] * 10)
    assert ((r[1:] - r[:-1]) < 0).all() and torch.allclose(r[:6], k[:6], atol=1e-6)


def test_values_in_unit_interval_for_any_input():
    g = torch.Generator().manual_seed(0)
    imgs = torch.cat([torch.rand(64, 3, 16, 16, generator=g), 3 * torch.randn(64, 3, 16, 16, generator=g),
                      torch.full((1, 3, 16, 16), float("nan")), torch.ones(1, 3, 16, 16)])
    prompts = [common.toy_prompt(*common.TOY_PAIRS[i % 20]) for i in range(len(imgs))]
    r = soft(imgs, prompts)
    assert r.shape == (len(imgs),) and r.dtype == torch.float32 and torch.isfinite(r).all()
    assert r.min() >= 0 and r.max() <= 1
    assert torch.equal(r, soft(imgs, prompts))                     # deterministic


def test_registered_and_trains(tmp_path):
    fn = common.WeightedReward([("toy-soft", 1.0)])
    imgs = torch.cat([render("red", "cross"), render("red", "cross", 0.34, 0.75)])
    total, parts = fn(imgs, ["a red cross"] * 2, None)
    assert torch.allclose(total, torch.tensor([1.0, 0.75])) and torch.equal(parts["toy-soft"], total)
    run(flow_grpo, [*SMALL, "--reward", "toy-soft", "--iterations", "1", "--output-dir", str(tmp_path / "r")])
    evals = [m for m in read_metrics(tmp_path / "r") if "eval_reward" in m]
    assert len(evals) == 2 and all(m["eval_reward"] == m["eval_toy-soft"] and 0 < m["eval_reward"] < 1 for m in evals)
    # 8 images under the three-level reward would give a multiple of 1/16
    assert "eval_accuracy" in evals[0] and all(abs(m["eval_reward"] * 16 - round(m["eval_reward"] * 16)) > 1e-3
                                               for m in evals)
