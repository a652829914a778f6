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
