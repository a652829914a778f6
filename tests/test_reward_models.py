"""The in-process reward models, each loaded through its real code path from tiny random weights saved like the hub:
HPSv2 and CLIPScoreH (open_clip checkpoints mapped into CLIPModel) against a plain-torch forward written from the
open_clip keys themselves; the LAION aesthetic score against its published head computed by hand; ImageReward's
wrapper, whose package needs an environment of its own. Also: every trainer's full-scale default reward is made
of in-process registry scorers."""
import importlib
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common
import helpers
from helpers import TRAINERS

V_WIDTH, T_WIDTH, EMBED, HEADS, LAYERS, PATCH, IMAGE, CONTEXT = 32, 24, 16, 4, 2, 8, 32, 77
OPENAI_MEAN, OPENAI_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
PROMPTS = ["a photo of a cat", "a red car", "a dog on a beach at sunset, zebra " * 12]  # the last one is truncated


def _open_clip_state(vocab: int) -> dict:
    """Random weights in open_clip's CLIP layout; every tensor distinct (layer norms not at 1 / 0), so that a
    swapped, transposed or misplaced weight changes the output."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape, scale=1.0: torch.randn(*shape, generator=g) * scale  # noqa: E731
    sd = {}

    def norm(name, width):
        sd[f"{name}.weight"], sd[f"{name}.bias"] = 1 + rand(width, scale=0.3), rand(width, scale=0.3)

    def linear(name, fan_out, fan_in, bias=0.1):  # name + weight / bias; attn.in_proj_ + ... is the packed one
        sd[name + "weight"], sd[name + "bias"] = rand(fan_out, fan_in, scale=fan_in ** -0.5), rand(fan_out, scale=bias)

    def blocks(prefix, width):
        for i in range(LAYERS):
            p = f"{prefix}transformer.resblocks.{i}."
            norm(p + "ln_1", width)
            linear(p + "attn.in_proj_", 3 * width, width, bias=0.3)
            linear(p + "attn.out_proj.", width, width)
            norm(p + "ln_2", width)
            linear(p + "mlp.c_fc.", 4 * width, width)
            linear(p + "mlp.c_proj.", width, 4 * width)

    sd["visual.conv1.weight"] = rand(V_WIDTH, 3, PATCH, PATCH, scale=0.1)
    sd["visual.class_embedding"] = rand(V_WIDTH, scale=0.5)
    sd["visual.positional_embedding"] = rand((IMAGE // PATCH) ** 2 + 1, V_WIDTH, scale=0.5)
    norm("visual.ln_pre", V_WIDTH)
    blocks("visual.", V_WIDTH)
    norm("visual.ln_post", V_WIDTH)
    sd["visual.proj"] = rand(V_WIDTH, EMBED, scale=V_WIDTH ** -0.5)
    sd["token_embedding.weight"] = rand(vocab, T_WIDTH, scale=0.5)
    sd["positional_embedding"] = rand(CONTEXT, T_WIDTH, scale=0.5)
    blocks("", T_WIDTH)
    norm("ln_final", T_WIDTH)
    sd["text_projection"] = rand(T_WIDTH, EMBED, scale=T_WIDTH ** -0.5)
    sd["logit_scale"] = torch.tensor(math.log(100.0))
    return sd


def _save_checkpoint(folder, state: dict, prefix: str = "module."):
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {prefix + k: v for k, v in state.items()}}, folder / "HPS_v2.1_compressed.pt")


def _save_processor(folder, tok, eos_token_id: int):
    """A CLIP-H-like config (exact GELU, layer norm eps 1e-5) at tiny sizes, with its tokenizer and image processor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPProcessor
    CLIPConfig(text_config=dict(vocab_size=len(tok), hidden_size=T_WIDTH, intermediate_size=4 * T_WIDTH,
                                num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=CONTEXT,
                                hidden_act="gelu", bos_token_id=tok.bos_token_id, eos_token_id=eos_token_id,
                                pad_token_id=tok.pad_token_id),
               vision_config=dict(hidden_size=V_WIDTH, intermediate_size=4 * V_WIDTH, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, image_size=IMAGE, patch_size=PATCH, hidden_act="gelu"),
               projection_dim=EMBED).save_pretrained(folder)
    proc = CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE},
                              image_mean=OPENAI_MEAN, image_std=OPENAI_STD)
    CLIPProcessor(image_processor=proc, tokenizer=tok).save_pretrained(folder)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tokenizer, the open_clip weights, and processor folders whose config pools text at the argmax token id
    (eos_token_id 2, as configs written before transformers PR 24773) or at the first end-of-text id."""
    root, tok = tmp_path_factory.mktemp("hps"), helpers.tokenizer()
    state = _open_clip_state(len(tok))
    for name, eos in [("argmax", 2), ("eos", tok.eos_token_id)]:
        _save_processor(root / name, tok, eos)
    return root, tok, state


def quick_gelu(x):
    """open_clip's QuickGELU, x sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


def _block(x, p: dict, prefix: str, causal: bool, act=F.gelu):
    """One open_clip residual attention block on (L, N, D), with nn.MultiheadAttention's packed projection."""
    w = lambda name: p[prefix + name]  # noqa: E731
    h = F.layer_norm(x, x.shape[-1:], w("ln_1.weight"), w("ln_1.bias"), eps=1e-5)
    mask = torch.full((len(x), len(x)), float("-inf")).triu(1) if causal else None
    h = F.multi_head_attention_forward(h, h, h, x.shape[-1], HEADS, w("attn.in_proj_weight"), w("attn.in_proj_bias"),
                                       None, None, False, 0.0, w("attn.out_proj.weight"), w("attn.out_proj.bias"),
                                       training=False, need_weights=False, attn_mask=mask)[0]
    x = x + h
    h = F.layer_norm(x, x.shape[-1:], w("ln_2.weight"), w("ln_2.bias"), eps=1e-5)
    return x + F.linear(act(F.linear(h, w("mlp.c_fc.weight"), w("mlp.c_fc.bias"))),
                        w("mlp.c_proj.weight"), w("mlp.c_proj.bias"))


def _open_clip_cosine(p: dict, pixels: torch.Tensor, tokens: torch.Tensor, act=F.gelu) -> torch.Tensor:
    """open_clip's encode_image / encode_text from the raw keys (MLP activation `act`), then hpsv2's diagonal of
    normalised features."""
    x = F.conv2d(pixels, p["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)  # (N, patches, D)
    x = torch.cat([p["visual.class_embedding"].expand(len(x), 1, -1), x], dim=1) + p["visual.positional_embedding"]
    x = F.layer_norm(x, x.shape[-1:], p["visual.ln_pre.weight"], p["visual.ln_pre.bias"], eps=1e-5).transpose(0, 1)
    for i in range(LAYERS):
        x = _block(x, p, f"visual.transformer.resblocks.{i}.", causal=False, act=act)
    x = F.layer_norm(x[0], x.shape[-1:], p["visual.ln_post.weight"], p["visual.ln_post.bias"], eps=1e-5)
    image = x @ p["visual.proj"]
    t = (p["token_embedding.weight"][tokens] + p["positional_embedding"]).transpose(0, 1)
    for i in range(LAYERS):
        t = _block(t, p, f"transformer.resblocks.{i}.", causal=True, act=act)
    t = F.layer_norm(t.transpose(0, 1), t.shape[-1:], p["ln_final.weight"], p["ln_final.bias"], eps=1e-5)
    text = t[torch.arange(len(t)), tokens.argmax(dim=-1)] @ p["text_projection"]
    return (F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).T).diagonal()


def _open_clip_tokens(tok) -> torch.Tensor:
    """open_clip's tokens of PROMPTS: start, words, end-of-text (the largest id), zeros up to 77; truncated to 77 with
    the end kept."""
    ids = tok(PROMPTS, truncation=True, max_length=CONTEXT)["input_ids"]
    assert len(ids[2]) == CONTEXT and ids[2][-1] == tok.eos_token_id == len(tok) - 1
    return torch.tensor([row + [0] * (CONTEXT - len(row)) for row in ids])


@pytest.mark.parametrize("config,prefix", [("eos", "module."), ("argmax", "")])
def test_hpsv2_equals_the_open_clip_forward_of_its_checkpoint(world, config, prefix, tmp_path):
    root, tok, state = world
    _save_checkpoint(tmp_path / "ckpt", state, prefix)
    scorer = common.HPSv2(model_id=str(tmp_path / "ckpt"), processor_id=str(root / config))
    assert common.REWARDS["hpsv2"] is common.HPSv2
    images = torch.rand(3, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    scores = scorer(images, PROMPTS)
    tokens = _open_clip_tokens(tok)
    pixels = common.clip_preprocess(images, {"size": {"shortest_edge": IMAGE}, "image_mean": OPENAI_MEAN,
                                             "crop_size": {"height": IMAGE, "width": IMAGE}, "image_std": OPENAI_STD})
    expected = _open_clip_cosine(state, pixels, tokens)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert scores.shape == (3,) and scores.dtype == torch.float32 and expected.std() > 0.05  # not a degenerate case


def test_clipscore_h_equals_the_open_clip_forward_of_its_checkpoint(world, tmp_path):
    """apple/DFN5B-CLIP-ViT-H-14's layout: a bare open_clip state dict in open_clip_pytorch_model.bin, QuickGELU MLPs
    (the processor's config says GELU, as CLIP-H's does), and open_clip's "squash" resize of the whole image to
    IMAGE x IMAGE without a crop, here from a non-square image."""
    root, tok, state = world
    (tmp_path / "dfn").mkdir()
    torch.save(state, tmp_path / "dfn" / "open_clip_pytorch_model.bin")
    scorer = common.CLIPScoreH(model_id=str(tmp_path / "dfn"), processor_id=str(root / "eos"))
    assert common.REWARDS["clipscore-h"] is common.CLIPScoreH
    images = torch.rand(3, 3, 40, 56, generator=torch.Generator().manual_seed(2))
    scores = scorer(images, PROMPTS)
    squashed = F.interpolate(images, size=(IMAGE, IMAGE), mode="bicubic", antialias=True).clamp(0, 1)
    pixels = (squashed - torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1)) / torch.tensor(OPENAI_STD).view(1, 3, 1, 1)
    expected = _open_clip_cosine(state, pixels, _open_clip_tokens(tok), act=quick_gelu)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert scores.shape == (3,) and scores.dtype == torch.float32 and expected.std() > 0.05
    gelu = _open_clip_cosine(state, pixels, _open_clip_tokens(tok))
    assert (expected - gelu).abs().max() > 1e-4  # 10x the tolerance: a GELU model would fail


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("model", ["sd3", "flux"])
def test_the_full_scale_default_reward_is_made_of_in_process_scorers(trainer, model):
    terms = common.parse_reward_spec(importlib.import_module(trainer).MODEL_DEFAULTS[model]["reward"])
    assert terms and all(name in common.REWARDS and name != "imagereward" for name, _ in terms), terms


@pytest.mark.parametrize("change,named", [
    ("drop transformer.resblocks.1.attn.in_proj_bias", "'text_model.encoder.layers.1.self_attn.k_proj.bias'"),
    ("add visual.attn_pool.weight", "'module.visual.attn_pool.weight'"),
    ("drop every key of text layer 1", "'text_model.encoder.layers.1.layer_norm1.bias'"),
])
def test_hpsv2_names_a_missing_or_unexpected_checkpoint_key(world, change, named, tmp_path):
    root, _, state = world
    state = dict(state)
    if change.startswith("drop every"):
        state = {k: v for k, v in state.items() if not k.startswith("transformer.resblocks.1.")}
    elif change.startswith("drop"):
        del state[change.split()[1]]
    else:
        state[change.split()[1]] = torch.zeros(1)
    _save_checkpoint(tmp_path / "ckpt", state)
    with pytest.raises(ValueError, match=re.escape(named)):
        common.HPSv2(model_id=str(tmp_path / "ckpt"), processor_id=str(root / "eos"))


def test_aesthetic_is_the_published_head_on_the_normalised_clip_image_embedding(tmp_path):
    """A tiny CLIP vision tower saved like openai/clip-vit-large-patch14 and a head saved in the published file's
    layout (Sequential with dropouts: layers.0, .2, .4, .6, .7). Reference: CLIPModel's own image features, then
    the five affine maps by hand, no activation between them."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection
    torch.manual_seed(0)
    config = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=16)
    CLIPVisionModelWithProjection(config).save_pretrained(tmp_path / "clip")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                       image_mean=OPENAI_MEAN, image_std=OPENAI_STD).save_pretrained(tmp_path / "clip")
    sizes = [16, 1024, 128, 64, 16, 1]
    head = {}
    for layer, (i, o) in zip([0, 2, 4, 6, 7], zip(sizes, sizes[1:])):
        head[f"layers.{layer}.weight"], head[f"layers.{layer}.bias"] = torch.randn(o, i) / i ** 0.5, torch.randn(o)
    (tmp_path / "head").mkdir()
    torch.save(head, tmp_path / "head" / "sac+logos+ava1-l14-linearMSE.pth")
    scorer = common.Aesthetic(model_id=str(tmp_path / "head"), clip_id=str(tmp_path / "clip"))
    images = torch.rand(3, 3, 40, 48, generator=torch.Generator().manual_seed(1))
    scores = scorer(images, ["ignored"] * 3)
    clip = CLIPVisionModelWithProjection.from_pretrained(tmp_path / "clip")
    pixels = common.clip_preprocess(images, CLIPImageProcessor.from_pretrained(tmp_path / "clip").to_dict())
    x = clip(pixel_values=pixels).image_embeds
    x = x / x.norm(dim=-1, keepdim=True)
    for layer in [0, 2, 4, 6, 7]:
        x = x @ head[f"layers.{layer}.weight"].T + head[f"layers.{layer}.bias"]
    torch.testing.assert_close(scores, x.squeeze(-1), rtol=1e-5, atol=1e-5)
    assert scores.shape == (3,) and scores.dtype == torch.float32


def test_imagereward_asks_for_its_own_environment_and_scores_each_image_with_its_prompt(monkeypatch):
    """The image-reward package needs transformers<4.56, so here: without it, one line that says
    where it runs; with a stand-in module of its API (load(name, device) -> model.score(prompt, PIL image)), each
    image goes as 8-bit RGB with its own prompt."""
    import sys
    import types

    from PIL import Image
    monkeypatch.setitem(sys.modules, "ImageReward", None)  # import fails, as it does beside transformers>=4.56
    with pytest.raises(common.UsageError, match="remote:http://HOST:PORT/imagereward"):
        common.ImageRewardScore()
    calls = []

    class Model:
        def score(self, prompt, image):
            assert isinstance(image, Image.Image) and image.mode == "RGB"
            calls.append((prompt, np.asarray(image).copy()))
            return len(prompt) + np.asarray(image).mean() / 255
    fake = types.ModuleType("ImageReward")
    fake.load = lambda name, device: Model() if name == "ImageReward-v1.0" and device == "cpu" else None
    monkeypatch.setitem(sys.modules, "ImageReward", fake)
    images = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    scores = common.ImageRewardScore()(images, ["a", "bb", "ccc"])
    eight_bit = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    assert [c[0] for c in calls] == ["a", "bb", "ccc"] and all((c[1] == e).all() for c, e in zip(calls, eight_bit))
    torch.testing.assert_close(scores, torch.tensor([n + e.mean() / 255 for n, e in zip([1, 2, 3], eight_bit)],
                                                    dtype=torch.float32))
