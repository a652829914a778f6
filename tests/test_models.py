"""The adapters against diffusers' own pipelines on the tiny random-weight models, and the real loaders."""
import pytest
import torch

import common
from helpers import tiny_configs, tiny_pipeline

RT = common.Runtime(0, 1, torch.device("cpu"), torch.float32)
PROMPTS = ["a photo of a cat", "a red car on a street"]


@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_ode_rollout_reproduces_the_diffusers_pipeline(name):
    """Our sampler at noise level 0 gives the pipeline's own latents from the same noise and prompts."""
    guidance = 3.5 if name == "flux" else 4.5
    adapter = common.load_model(name, RT, tiny_pipeline(name), resolution=32, guidance_scale=guidance)
    steps = 5
    x = adapter.noise(len(PROMPTS), torch.Generator().manual_seed(0))
    sigmas = adapter.sigmas(steps)
    z = x
    for k in range(steps):  # the SDE sampler with a = 0, i.e. the evaluation path of every trainer
        v = adapter.velocity(adapter.transformer, z, sigmas[k], adapter.encode(PROMPTS))
        z = common.sde_step(z, v, sigmas[k], sigmas[k + 1], 0.0, float(sigmas[1]))[0]
    ours = z
    kwargs = dict(max_sequence_length=adapter.max_sequence_length)
    ref = adapter.pipe(prompt=PROMPTS, height=32, width=32, num_inference_steps=steps, guidance_scale=guidance,
                       latents=x.clone(), output_type="latent", **kwargs).images
    assert ref.shape == ours.shape
    assert (ours - ref).abs().max().item() <= 1e-5
    assert (x - ref).abs().max().item() > 0.1  # the comparison is not vacuous
    images = adapter.decode(ours)
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1


def test_toy_adapter_shapes_and_grid():
    adapter = common.load_model("toy", RT)
    assert torch.equal(adapter.sigmas(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    cond = adapter.encode(["a red circle", "a blue cross"])
    x = adapter.noise(2, torch.Generator().manual_seed(0))
    v = adapter.velocity(adapter.transformer, x, 0.5, cond)
    assert v.shape == x.shape == (2, 64, 12)
    assert adapter.decode(x).shape == (2, 3, 16, 16)


@pytest.mark.filterwarnings("error::FutureWarning")
@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_real_loader_reads_a_saved_pipeline(name):
    """--model flux/sd3 --model-path DIR load a pipeline saved to a folder with from_pretrained: it computes what
    the pipeline it was saved from computes, and the load asks for nothing deprecated (diffusers' own FutureWarning
    for torch_dtype, renamed dtype in 0.40)."""
    adapter_cls = common.FluxAdapter if name == "flux" else common.SD3Adapter
    adapter = adapter_cls(common.build_pipeline(name, tiny_configs(name), seed=0), RT.device, RT.dtype, 32, 4.0)
    loaded = common.load_model(name, RT, path=tiny_pipeline(name), resolution=32, guidance_scale=4.0)
    x = adapter.noise(1, torch.Generator().manual_seed(0))
    cond_a, cond_b = adapter.encode(PROMPTS[:1]), loaded.encode(PROMPTS[:1])
    torch.testing.assert_close(loaded.velocity(loaded.transformer, x, 0.7, cond_b),
                               adapter.velocity(adapter.transformer, x, 0.7, cond_a), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_the_real_loader_reads_the_transformer_before_anything_else(name, monkeypatch):
    """diffusers reads a pipeline's components in an order that changes with Python's string hashing, and reading a
    transformer peaks at a few times its file (3.7 GiB for SD3.5-M's widths at 2 blocks, a 1.7 GB file): read first,
    that peak meets an otherwise empty process, the same in every run."""
    import diffusers
    import diffusers.pipelines.pipeline_utils as pipeline_utils
    order, load_sub_model = [], pipeline_utils.load_sub_model
    monkeypatch.setattr(pipeline_utils, "load_sub_model", lambda *a, **k: order.append(k["name"]) or load_sub_model(
        *a, **k))
    net_cls = diffusers.FluxTransformer2DModel if name == "flux" else diffusers.SD3Transformer2DModel
    read = net_cls.from_pretrained.__func__
    monkeypatch.setattr(net_cls, "from_pretrained", classmethod(lambda cls, *a, **k: order.append("the transformer")
                                                                or read(cls, *a, **k)))
    common.load_model(name, RT, tiny_pipeline(name), resolution=32, guidance_scale=4.5)
    assert order[0] == "the transformer" and "transformer" not in order and {"vae", "text_encoder"} <= set(order)


@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_the_attention_output_projections_read_contiguous_inputs(name):
    """diffusers hands attention's image and text halves to to_out / to_add_out as slices of one tensor; a matmul
    cannot fold such a slice into one product, and on CPU it then copies the weight once per row (-16% of a LoRA
    step's time at SD3.5-M widths once they are contiguous). load_model makes them contiguous, under a LoRA too; the
    velocity stays diffusers' own pipeline's (test_ode_rollout_reproduces_the_diffusers_pipeline)."""
    adapter = common.load_model(name, RT, tiny_pipeline(name), resolution=32, guidance_scale=4.5)
    common.add_lora(adapter.transformer, 4, 4.0, adapter.lora_targets)
    layouts = []
    for module_name, module in adapter.transformer.named_modules():
        if module_name.endswith(("attn.to_out.0.base_layer", "attn.to_add_out.base_layer")):
            module.register_forward_pre_hook(lambda _, args: layouts.append(args[0].is_contiguous()))
    adapter.velocity(adapter.transformer, adapter.noise(2), 0.5, adapter.encode(PROMPTS))
    assert len(layouts) >= 2 and all(layouts), layouts


@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_offloaded_text_encoders_go_to_the_device_only_to_encode(name, monkeypatch):
    """--offload-encoders: every text encoder is sent to the compute device (a torch.device) for the encode and back
    to "cpu" after it, and the conditioning is the same as with the encoders kept on the device."""
    kept = common.load_model(name, RT, tiny_pipeline(name), resolution=32, guidance_scale=4.5)
    offloaded = common.load_model(name, RT, tiny_pipeline(name), resolution=32, guidance_scale=4.5,
                                  offload_encoders=True)
    encoders = [m for n, m in offloaded.pipe.components.items() if n.startswith("text_encoder")]
    moves = []
    for i, enc in enumerate(encoders):
        to = enc.to
        monkeypatch.setattr(enc, "to", lambda *a, i=i, to=to, **k: (moves.append((i, a[0])), to(*a, **k))[1])
    want, got = kept.encode(PROMPTS), offloaded.encode(PROMPTS)
    n = len(encoders)
    assert [i for i, _ in moves] == list(range(n)) * 2
    assert all(d == RT.device and isinstance(d, torch.device) for _, d in moves[:n])
    assert [d for _, d in moves[n:]] == ["cpu"] * n
    for key in want:
        assert torch.equal(want[key], got[key])


# ---- FLUX.2-klein ----
def flux2_latents_as_tokens(pipe, latents: torch.Tensor) -> torch.Tensor:
    """The pipeline's output_type="latent" (VAE latents, its batch-norm statistics undone) back to the adapter's
    tokens, by the pipeline's own functions: 2x2 patches folded, the statistics applied, packed."""
    bn, eps = pipe.vae.bn, pipe.vae.config.batch_norm_eps
    x = pipe._patchify_latents(latents)
    return pipe._pack_latents((x - bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(bn.running_var.view(1, -1, 1, 1)
                                                                                   + eps))


@pytest.mark.parametrize("distilled", [False, True])
def test_flux2_ode_sampling_reproduces_the_klein_pipeline(distilled):
    """FLUX.2-klein base (CFG 4, the empty prompt as negative) and step-distilled (no CFG: its pipeline ignores the
    scale): the Euler sampler (the SDE step at noise level 0) from the adapter's noise ends where the pipeline ends from
    the same noise, latents and decoded images alike. The pipeline makes the CFG's two calls apart, the adapter one."""
    import diffusers
    from einops import rearrange
    adapter = common.load_model("flux2", RT, tiny_pipeline("flux2", distilled), resolution=32)
    assert adapter.cfg is not distilled and adapter.guidance_scale == (1.0 if distilled else 4.0)
    steps, cond = 5, adapter.encode(PROMPTS)
    x = adapter.noise(len(PROMPTS), torch.Generator().manual_seed(0))
    sigmas, z = adapter.sigmas(steps), x
    for k in range(steps):
        z = common.sde_step(z, adapter.velocity(adapter.transformer, z, sigmas[k], cond), sigmas[k], sigmas[k + 1], 0.0,
                            float(sigmas[1]))[0]
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(tiny_pipeline("flux2", distilled))  # untouched by the adapter
    call = dict(prompt=PROMPTS, height=32, width=32, num_inference_steps=steps, guidance_scale=4.0,
                latents=rearrange(x, "n (h w) c -> n c h w", h=2))
    ref = flux2_latents_as_tokens(pipe, pipe(**call, output_type="latent").images)
    assert (z - ref).abs().max().item() <= 1e-5 and (x - ref).abs().max().item() > 0.1
    images = pipe(**call, output_type="pt").images
    assert (adapter.decode(z) - images).abs().max().item() <= 1e-5 and images.shape == (2, 3, 32, 32)
    assert pipe.vae.bn.running_var.std() > 0.1  # the statistics are not the identity's


def test_flux2_text_embeddings_are_the_pipelines_without_the_states_it_drops():
    """The adapter encodes as the pipeline's encode_prompt (the chat template without thinking, 512 tokens, the hidden
    states after layers 9, 18 and 27 side by side), to the bit; the text encoder's body then keeps those three states
    and no logits are computed, where the pipeline's call keeps every layer's state and every token's logits
    (FLUX.2-klein 4B, 48 prompts in bf16: 4.7 GB of hidden states and 7.5 GB of logits)."""
    adapter = common.load_model("flux2", RT, tiny_pipeline("flux2"), resolution=32)
    states, logits = [], []
    adapter.pipe.text_encoder.model.register_forward_hook(lambda module, args, out: states.append(out.hidden_states))
    adapter.pipe.text_encoder.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.shape))
    ours = adapter.encode(PROMPTS)["prompt_embeds"]              # the negative first (CFG), then the prompts
    assert len(states) == 2 and not logits
    theirs, text_ids = adapter.pipe.encode_prompt(PROMPTS, device=RT.device)
    assert torch.equal(ours, theirs) and ours.shape == (2, 512, 3 * 16) and torch.equal(adapter.txt_ids, text_ids[0])
    (_, kept, full), layers = states, adapter.pipe.text_encoder.config.num_hidden_layers
    assert [k for k, h in enumerate(kept) if h is not None] == [9, 18, 27]
    assert len(full) == layers + 1 and None not in full and logits == [(2, 512, adapter.pipe.text_encoder.vocab_size)]


@pytest.mark.parametrize("resolution", [256, 512, 1024, 2048])
def test_flux2_grid_is_the_klein_pipelines_at_every_size_and_step_count(resolution):
    """FLUX.2's shift mu depends on the image's tokens and on the step count (compute_empirical_mu): the adapter's grid
    at each image size and step count a run uses (training's 4 or 10, evaluation's 28 or 50) is what the klein pipeline
    sets its scheduler to, so that a 10-step training grid and a 50-step evaluation grid lie on different curves. 2048
    px (16,384 tokens) takes the branch above 4,300 tokens, where mu no longer depends on the steps."""
    import diffusers
    import numpy as np
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(tiny_pipeline("flux2"))
    adapter = common.Flux2Adapter(pipe, RT.device, RT.dtype, resolution)
    n = (resolution // 16) ** 2
    for steps in (4, 10, 28, 50):
        pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(n, steps))
        torch.testing.assert_close(adapter.sigmas(steps), pipe.scheduler.sigmas, atol=1e-7, rtol=0)
    assert torch.allclose(adapter.sigmas(10), adapter.sigmas(50)[::5], atol=1e-6) == (n > 4300)  # one curve or two


def test_a_flux2_scheduler_without_dynamic_shifting_is_refused(tmp_path):
    """A FLUX.2 pipeline whose scheduler config does not ask for dynamic shifting would sample on a static shift's
    grid: it is named in one line, not trained."""
    import diffusers
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(tiny_pipeline("flux2"))
    pipe.scheduler.register_to_config(use_dynamic_shifting=False)
    pipe.save_pretrained(tmp_path / "static")
    with pytest.raises(common.UsageError, match=f"{tmp_path / 'static'}: its scheduler config does not ask for dynamic "
                                                f"shifting"):
        common.load_model("flux2", RT, str(tmp_path / "static"), resolution=32)


def test_a_step_distilled_flux2_takes_its_defaults_from_is_distilled():
    """The trainers' flux2 defaults are the base model's (CFG 4, 10 sampling and 50 evaluation steps); a pipeline whose
    model_index.json says is_distilled gets 4 steps without CFG, and a CFG scale above 1 is refused for it."""
    import flow_grpo
    base, step_distilled = (common.cli(flow_grpo.Args, ["--model", "flux2", "--model-path", tiny_pipeline("flux2", d)],
                                       flow_grpo.MODEL_DEFAULTS) for d in (False, True))
    assert (base.guidance_scale, base.sample_steps, base.eval_steps) == (4.0, 10, 50)
    assert (step_distilled.guidance_scale, step_distilled.sample_steps, step_distilled.eval_steps) == (1.0, 4, 4)
    assert common.cli(flow_grpo.Args, ["--model", "flux2", "--model-path", tiny_pipeline("flux2", True),
                                       "--sample-steps", "6"], flow_grpo.MODEL_DEFAULTS).sample_steps == 6
    with pytest.raises(common.UsageError, match="is step-distilled .is_distilled., which takes no CFG: pass "
                                                "--guidance-scale 1"):
        common.load_model("flux2", RT, tiny_pipeline("flux2", True), resolution=32, guidance_scale=4.0)


def test_the_shipped_qwen_tokenizer_is_the_one_built_in_code():
    """assets/architectures/flux2/tokenizer, which FLUX.2's offline pipelines read, is tests/helpers.py's qwen_tokenizer
    saved: the same ids for text, special tokens and the chat template's output, byte by byte."""
    from transformers import AutoTokenizer

    import helpers
    shipped = AutoTokenizer.from_pretrained(common.ARCHITECTURES / "flux2" / "tokenizer")
    built = helpers.qwen_tokenizer()
    texts = [t.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False) for t in (shipped, built) for p in [*PROMPTS, "café ☕"]]
    assert texts[:3] == texts[3:] and texts[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = [t(texts[:3], padding="max_length", max_length=64)["input_ids"] for t in (shipped, built)]
    assert ids[0] == ids[1] and len(set(ids[0][2])) > 10 and shipped.pad_token == built.pad_token == "<|endoftext|>"
    assert len(shipped) == len(built) == 256 + 5
