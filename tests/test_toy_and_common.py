"""The toy world's renderer and reward, prompts, rewards and the CLI."""
import dataclasses
import importlib
import json

import numpy as np
import pytest
import torch

import common
import helpers
import pretrain_toy


def _renders(pairs, halves=(0.28, 0.34, 0.40)):
    imgs = [pretrain_toy.toy_render(c, s, h) for c, s in pairs for h in halves]
    prompts = [common.toy_prompt(c, s) for c, s in pairs for _ in halves]
    return torch.from_numpy(np.stack(imgs)), prompts


def test_toy_reward_reads_back_every_render():
    imgs, prompts = _renders(common.TOY_PAIRS)
    assert torch.equal(common.toy_reward(imgs, prompts), torch.ones(len(prompts)))
    assert torch.equal(common.toy_accuracy(imgs, prompts), torch.ones(len(prompts)))


def test_toy_reward_gives_partial_credit():
    imgs, _ = _renders([("red", "circle")], halves=(0.34,))
    assert common.toy_reward(imgs, ["a blue circle"]).item() == 0.5   # right shape, wrong colour
    assert common.toy_reward(imgs, ["a red cross"]).item() == 0.5     # right colour, wrong shape
    assert common.toy_reward(imgs, ["a green square"]).item() == 0.0
    assert common.toy_accuracy(imgs, ["a red cross"]).item() == 0.0
    assert common.toy_reward(torch.zeros(1, 3, 16, 16), ["a red circle"]).item() == 0.0  # nothing drawn
    assert common.toy_reward(torch.full((1, 3, 16, 16), 0.9), ["a white square"]).item() == 0.5  # a white frame


def test_toy_split_holds_out_ten_pairs_each_colour_seen_twice():
    assert len(common.TOY_HELD_OUT) == 10 and len(common.TOY_SEEN) == 10
    for c in common.TOY_COLORS:
        assert sum(p[0] == c for p in common.TOY_SEEN) == 2
    with pytest.raises(ValueError, match="must name one of the colours"):
        common.toy_parse("a purple circle")


def test_toy_pack_roundtrip_and_tokenizer():
    imgs, _ = _renders([("blue", "cross")])
    torch.testing.assert_close(common.toy_unpack(pretrain_toy.toy_pack(imgs)), imgs)
    tok = common.ToyTokenizer()
    ids, mask = tok(["a red circle", "a magenta blob"])
    assert tok.eos_id != 2 and ids[0, 4] == tok.eos_id and ids[1, 2] == tok.unk_id
    assert mask.sum(1).tolist() == [5, 5]


def test_toy_packing_is_fluxs_latent_packing():
    """The toy packs pixels into tokens exactly as FluxPipeline packs latents (the shipped weights depend on it)."""
    from diffusers import FluxPipeline
    imgs = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pretrain_toy.toy_pack(imgs), FluxPipeline._pack_latents(imgs * 2 - 1, 2, 3, 16, 16))
    tokens = torch.randn(2, 64, 12, generator=torch.Generator().manual_seed(1))
    unpacked = FluxPipeline._unpack_latents(tokens, 16, 16, 1)
    assert torch.equal(common.toy_unpack(tokens), ((unpacked + 1) / 2).clamp(0, 1))


def test_load_prompts_text_jsonl_and_errors(tmp_path):
    (tmp_path / "p.txt").write_text("\n".join(f"prompt {i}" for i in range(20)) + "\n")
    train, evals = common.load_prompts(str(tmp_path / "p.txt"), "sd3")
    assert len(train) == 18 and len(evals) == 2 and not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    rows = [{"prompt": "a", "split": "train"}, {"prompt": "b", "split": "eval", "tag": 1}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    train, evals = common.load_prompts(str(tmp_path / "p.jsonl"), "sd3")
    assert [r["prompt"] for r in train] == ["a"] and evals == [rows[1]]
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(common.UsageError, match="bad.jsonl:1 is not a JSON object with a non-empty string 'prompt'"):
        common.load_prompts(str(tmp_path / "bad.jsonl"), "sd3")
    toy_train, toy_eval = common.load_prompts(None, "toy")
    assert [r["prompt"] for r in toy_train] == [common.toy_prompt(c, s) for c, s in common.TOY_HELD_OUT]


def test_reward_spec_parsing_and_weighting():
    assert common.parse_reward_spec("toy:0.5, jpeg") == [("toy", 0.5), ("jpeg", 1.0)]
    for bad, msg in [("pickscore:x", "bad weight 'x'"), ("toy,toy", "unknown or repeated reward 'toy'"),
                     ("", "unknown or repeated reward ''")]:
        with pytest.raises(ValueError, match=msg):
            common.parse_reward_spec(bad)
    imgs, prompts = _renders([("red", "circle")], halves=(0.3,))
    total, parts = common.WeightedReward(common.parse_reward_spec("toy:2,jpeg:0.5"))(imgs, prompts)
    torch.testing.assert_close(total, 2 * parts["toy"] + 0.5 * parts["jpeg"])
    flat, noisy = torch.zeros(1, 3, 32, 32), torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    jpeg = common.JpegCompressibility()
    assert jpeg(flat, [""]) > jpeg(noisy, [""])


def _tiny_clip(path):
    """A tiny random CLIP saved like a hub repo, to load PickScore / CLIPScore through from_pretrained."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor
    tok = helpers.tokenizer()
    torch.manual_seed(0)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4,
                                        image_size=32, patch_size=8), projection_dim=16)
    CLIPModel(cfg).save_pretrained(path)
    proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=proc, tokenizer=tok).save_pretrained(path)


@pytest.mark.parametrize("cls,divisor", [(common.PickScore, 26.0), (common.CLIPScore, 30.0)])
def test_clip_rewards_equal_the_models_own_logits(cls, divisor, tmp_path):
    from transformers import CLIPModel, CLIPProcessor
    _tiny_clip(tmp_path / "clip")
    kwargs = {"processor_id": str(tmp_path / "clip")} if cls is common.PickScore else {}
    scorer = cls(model_id=str(tmp_path / "clip"), **kwargs)
    imgs = torch.rand(3, 3, 48, 40, generator=torch.Generator().manual_seed(0))
    prompts = ["a photo of a cat", "a red car", "a dog on a beach at sunset"]
    scores = scorer(imgs, prompts)
    # independent reference: CLIPModel.forward's logits on the same preprocessed pixels
    model, proc = CLIPModel.from_pretrained(tmp_path / "clip"), CLIPProcessor.from_pretrained(tmp_path / "clip")
    text = proc.tokenizer(prompts, padding="max_length", max_length=77, return_tensors="pt")
    pixels = common.clip_preprocess(imgs, proc.image_processor.to_dict())
    logits = model(pixel_values=pixels, **text).logits_per_image.diagonal() / divisor
    torch.testing.assert_close(scores, logits, rtol=1e-5, atol=1e-5)
    assert scores.shape == (3,) and scores.dtype == torch.float32


def test_cli_help_lists_every_field(capsys):
    import flow_grpo
    with pytest.raises(SystemExit):
        common.cli(flow_grpo.Args, ["--help"], flow_grpo.MODEL_DEFAULTS)
    out = capsys.readouterr().out
    for f in flow_grpo.Args.__dataclass_fields__:
        assert "--" + f.replace("_", "-") in out
    args = common.cli(flow_grpo.Args, ["--model", "sd3", "--no-ema", "--lr", "1e-5"], flow_grpo.MODEL_DEFAULTS)
    assert args.ema is False and args.lr == 1e-5 and args.group_size == 24 and args.guidance_scale == 4.5


def test_cli_defaults_are_the_toy_run_and_the_model_table_overrides_them():
    import flow_grpo
    toy = flow_grpo.Args()
    assert common.cli(flow_grpo.Args, [], flow_grpo.MODEL_DEFAULTS) == toy     # no flags: the Args fields
    flux = common.cli(flow_grpo.Args, ["--model", "flux"], flow_grpo.MODEL_DEFAULTS)
    for name, default in dataclasses.asdict(toy).items():
        expected = flow_grpo.MODEL_DEFAULTS["flux"].get(name, default)
        if name == "prompts":  # a prompt set is recorded with its revision
            expected += "@" + common.REVISIONS[common.FLOW_GRPO]
        assert getattr(flux, name) == ("flux" if name == "model" else expected), name


@pytest.mark.parametrize("trainer", helpers.TRAINERS)
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_tiny_argv_is_the_family_at_smoke_run_sizes(trainer, family):
    """The tests' smoke runs: the trainer's flux / sd3 table, every smoke-run size and the trainer's own set over
    it, then the command line; a dropped size keeps the table's value."""
    module = importlib.import_module(trainer)
    table, smoke = module.MODEL_DEFAULTS[family], {**helpers.SMOKE, **helpers.own(trainer, "FITS_SMOKE", {})}
    args = common.cli(module.Args, [*helpers.tiny_argv(trainer, family), "--iterations", "5"], module.MODEL_DEFAULTS)
    assert (args.model, args.model_path) == (family, helpers.tiny_pipeline(family))
    assert args.iterations == 5                                                     # the command line wins
    assert args.guidance_scale == table["guidance_scale"]                           # the family's settings
    assert all(getattr(args, k) == v for k, v in smoke.items() if k != "iterations"), vars(args)
    assert any(table.get(k, v) != v for k, v in smoke.items())                     # the sizes do replace some
    dropped = common.cli(module.Args, helpers.tiny_argv(trainer, family, drop=("resolution",)), module.MODEL_DEFAULTS)
    assert dropped.resolution == table["resolution"] != smoke["resolution"]


def test_cli_help_shows_the_defaults_of_the_chosen_model(capsys):
    import flow_grpo
    for model, noise in [("toy", 0.7), ("flux", 0.9)]:
        with pytest.raises(SystemExit):
            common.cli(flow_grpo.Args, ["--model", model, "--help"], flow_grpo.MODEL_DEFAULTS)
        out = " ".join(capsys.readouterr().out.split())
        assert f"Defaults shown are those of --model {model}" in out
        assert f"--noise-level NOISE_LEVEL SDE noise level a in g = a sqrt(t / (1 - t)); with --sde-type cps, a in " \
               f"the std s sin(a pi / 2), in (0, 1] (default: {noise})" in out
        assert "--sde-window SDE_WINDOW Flow-GRPO-Fast:" in out and "(default: 0,T//2)" in out
