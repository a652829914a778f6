"""The precision of full-scale runs, on CPU: --dtype bf16 (FLUX) and fp16 (SD3: float32 weights under fp16 autocast
with loss scaling) run autocast, the weight dtypes, the loss scaler and FSDP2's mixed precision on any device. Every
trainer computes in its full-scale dtype on the tiny pipelines, exactly on-policy in its first update, and resumes
bitwise (the loss scale included, with overflows forced); full fine-tuning trains float32 master weights and publishes
the base model's dtype; T5 keeps the float32 layers transformers keeps."""
import functools
import math
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import load_file

import common
import flow_grpo
from helpers import (ROOT, TRAINERS, read_metrics, run, straight_and_resumed, tiny_argv, tiny_configs, tiny_pipeline,
                     torchrun, trained_params, training_state)

FULL_SCALE = {"flux": "bf16", "sd3": "fp16", "flux2": "bf16"}   # each model's --dtype on a GPU (common.GPU_DTYPES)
QUIET = ["--eval-every", "0", "--threads", "1"]


def test_each_model_defaults_to_its_full_scale_dtype_on_a_gpu_and_float32_on_a_cpu():
    assert {m: common.GPU_DTYPES[m] for m in FULL_SCALE} == FULL_SCALE
    assert common.setup_runtime(0, 1, None, "sd3").dtype == torch.float32           # this machine: a CPU
    assert common.setup_runtime(0, 1, "fp16", "flux").dtype == torch.float16        # --dtype: the same everywhere


@pytest.mark.parametrize("family,trainer", [(f, t) if f != "flux2" or t == "flow_grpo" else  # FLUX.2 is bf16 as
                                            pytest.param(f, t, marks=pytest.mark.slow)   # FLUX: flow_grpo's alone
                                            for f in FULL_SCALE for t in TRAINERS])
def test_every_trainer_runs_its_full_scale_dtype_on_policy_and_resumes_bitwise(trainer, family, tmp_path):
    module = __import__(trainer)
    argv = [*tiny_argv(trainer, family), *QUIET, "--dtype", FULL_SCALE[family]]
    seen = set()
    handle = torch.nn.modules.module.register_module_forward_hook(   # the dtype of every Linear's output
        lambda layer, args, out: seen.add(out.dtype) if isinstance(layer, torch.nn.Linear) else None)
    try:
        straight, resumed = straight_and_resumed(module, argv, 1, 2, tmp_path)
    finally:
        handle.remove()
    assert common.DTYPES[FULL_SCALE[family]] in seen, seen          # autocast ran the projections in that dtype
    assert straight == resumed
    assert straight[0]["ratio_dev_first_update"] == 0.0 and straight[0]["clip_frac_first_update"] == 0.0
    assert all(math.isfinite(m["loss"]) for m in straight[:2])
    a, b = trained_params(tmp_path / "straight", 2), trained_params(tmp_path / "split", 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("family", list(FULL_SCALE))
def test_the_full_scale_dtype_changes_what_flow_grpo_computes(family, tmp_path):
    """The same run in float32 and in its full-scale dtype: rewards and losses differ (the half-precision compute is
    real), and the first update is still exactly on-policy."""
    argv = [*tiny_argv("flow_grpo", family), *QUIET, "--iterations", "1"]
    run(flow_grpo, [*argv, "--output-dir", str(tmp_path / "fp32")])
    run(flow_grpo, [*argv, "--dtype", FULL_SCALE[family], "--output-dir", str(tmp_path / "half")])
    fp32, half = (read_metrics(tmp_path / name)[0] for name in ("fp32", "half"))
    assert fp32["reward_mean"] != half["reward_mean"] and fp32["loss"] != half["loss"]
    assert half["ratio_dev_first_update"] == fp32["ratio_dev_first_update"] == 0.0


def test_an_fp16_run_with_overflows_resumes_bitwise_with_its_loss_scale(tmp_path, monkeypatch):
    """An initial loss scale of 2^24 overflows fp16 on the way back: steps are skipped while the scaler backs off.
    The scale and its growth tracker are in the checkpoint, so 2 + a resume of 2 iterations skip the same steps as
    4 straight and end on the same weights."""
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0**24))
    argv = [*tiny_argv("flow_grpo", "sd3"), *QUIET, "--dtype", "fp16"]
    straight, resumed = straight_and_resumed(flow_grpo, argv, 2, 4, tmp_path)
    skipped = [m["skipped_steps"] for m in straight[:4]]
    assert sum(skipped) > 0 and skipped[-1] < 2, skipped              # overflows happened, and steps resumed
    assert [m["skipped_steps"] for m in resumed[:4]] == skipped
    assert straight == resumed
    assert all(m["grad_norm"] is not None for m in straight[:4] if m["skipped_steps"] < 2)   # the steps that stepped
    a, b = trained_params(tmp_path / "straight", 4), trained_params(tmp_path / "split", 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    scaler = training_state(tmp_path / "split" / "checkpoints" / "iter_000002")["scaler"]
    assert scaler["scale"] < 2.0**24                                  # the backed-off scale, not a fresh one


@pytest.mark.parametrize("scale", [math.nan, math.inf, 0.0, -1.0])
def test_a_loss_scale_restored_from_state_is_finite_and_above_zero(scale, tmp_path, capsys):
    """state/ rewritten with the loss scale `scale` and its digest signed into checkpoint.json (as other code could):
    a resume is refused in one line before any step, never a run whose every step overflows."""
    from test_reliability import one_error_line, rewrite_state
    argv = ["--model", "toy", "--dtype", "fp16", *QUIET, "--prompts-per-step", "2", "--group-size", "4",
            "--micro-batch", "4", "--sample-steps", "4", "--save-every", "1"]
    r = tmp_path / "r"
    run(flow_grpo, [*argv, "--iterations", "1", "--output-dir", str(r)])
    ckpt = r / "checkpoints" / "iter_000001"
    assert training_state(ckpt)["scaler"]["scale"] == 2.0**16
    rewrite_state(lambda s: {**s, "scaler": {**s["scaler"], "scale": scale}})(ckpt)
    err = one_error_line(capsys, flow_grpo, [*argv, "--iterations", "2", "--resume", str(r)])
    assert f"error: {ckpt} is not a checkpoint this code wrote: state/ does not load (ValueError: not finite, or an " \
           f"optimizer step or loss scaling this code does not write)" in err, err
    assert [m["iteration"] for m in read_metrics(r)] == [0, 1]


def test_the_mean_gradient_norm_leaves_out_skipped_steps():
    w = torch.nn.Parameter(torch.ones(3))
    opt, guard, stats = torch.optim.SGD([w], lr=0.1), common.StepGuard(3, torch.device("cpu")), common.UpdateStats()
    for scale in (1.0, float("inf"), 3.0):
        guard.backward((w * scale).sum())
        stepped, norm = guard.step(opt, [w], 1e9)
        stats.add(loss=torch.tensor(0.0))
        stats.stepped(norm)
        assert stepped == math.isfinite(scale) and math.isfinite(norm) == stepped
    assert stats.metrics()["grad_norm"] == pytest.approx((math.sqrt(3) + 3 * math.sqrt(3)) / 2)


def test_bf16_full_fine_tuning_trains_float32_master_weights_and_publishes_bf16(tmp_path):
    """G2RPO's FLUX learning rate, 2e-6: bf16 weights would drop most AdamW updates (below half a bf16 ulp); the
    float32 master weights move every tensor the float32 run moves, and the checkpoint publishes the transformer in
    bf16, the dtype the base model was loaded in."""
    argv = [*tiny_argv("flow_grpo", "flux"), *QUIET, "--lora-rank", "0", "--lr", "2e-6", "--iterations", "1"]
    start = [p.detach().float() for p in FluxTransformer2DModel.from_pretrained(
        tiny_pipeline("flux"), subfolder="transformer", dtype=torch.bfloat16).parameters()]
    moved = {}
    for dtype in ("fp32", "bf16"):
        run(flow_grpo, [*argv, "--dtype", dtype, "--output-dir", str(tmp_path / dtype)])
        trained = trained_params(tmp_path / dtype, 1)
        assert {t.dtype for t in trained} == {torch.float32}
        base = start if dtype == "bf16" else [p.detach() for p in FluxTransformer2DModel.from_pretrained(
            tiny_pipeline("flux"), subfolder="transformer").parameters()]
        moved[dtype] = [not torch.equal(t, s) for t, s in zip(trained, base, strict=True)]
    assert sum(moved["fp32"]) > 0.9 * len(start) and moved["bf16"] == moved["fp32"]
    published = load_file(tmp_path / "bf16" / "checkpoints" / "iter_000001" / "transformer" /
                          "diffusion_pytorch_model.safetensors")
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    reread = FluxTransformer2DModel.from_pretrained(tmp_path / "bf16" / "checkpoints" / "iter_000001" / "transformer")
    assert torch.equal(next(reread.parameters()).to(torch.bfloat16), trained[0].to(torch.bfloat16))


def test_bf16_full_fine_tuning_with_a_kl_term_starts_from_a_reference_equal_to_the_policy(tmp_path):
    """Without --fsdp the trained transformer's weights become float32 masters under bf16 autocast; the frozen KL
    reference, copied before, is cast alike, so it computes what the policy computes at the start: the first update's
    KL is exactly 0 (3.7e-5 on this SD3 while the reference kept its bf16 weights)."""
    argv = [*tiny_argv("flow_grpo", "sd3"), *QUIET, "--lora-rank", "0", "--beta", "0.01", "--dtype", "bf16",
            "--iterations", "1", "--output-dir", str(tmp_path / "run")]
    run(flow_grpo, argv)
    (m,) = read_metrics(tmp_path / "run")[:1]
    assert m["kl_first_update"] == 0.0 and m["kl"] > 0 and m["ratio_dev_first_update"] == 0.0


def test_t5_keeps_the_float32_layers_transformers_keeps_under_fp16():
    """transformers loads T5's `wo` projections in float32 under fp16 (they overflow there); so do a pipeline read
    with from_pretrained and one built in code, and _freeze_pipeline keeps them; every other text encoder weight is
    fp16."""
    rt = common.Runtime(0, 1, torch.device("cpu"), torch.float16)
    built = common.SD3Adapter(common.build_pipeline("sd3", tiny_configs("sd3")), rt.device, torch.float16, 32, 4.5)
    loaded = common.load_model("sd3", rt, tiny_pipeline("sd3"), resolution=32, guidance_scale=4.5)
    for adapter in (built, loaded):
        t5 = adapter.pipe.text_encoder_3
        dtypes = {name: p.dtype for name, p in t5.named_parameters()}
        wo = {name for name in dtypes if ".wo." in name}
        assert wo and {dtypes[n] for n in wo} == {torch.float32}
        assert {d for n, d in dtypes.items() if n not in wo} == {torch.float16}
        assert {p.dtype for p in adapter.pipe.text_encoder.parameters()} == {torch.float16}
        assert torch.isfinite(adapter.encode(["a cat"])["prompt_embeds"]).all()


def test_fsdp2_under_bf16_keeps_float32_master_shards_and_a_float32_timestep(tmp_path):
    """2 gloo ranks, SD3 fully fine-tuned under --fsdp in bf16: the master shards are float32, every block computes
    with its weights gathered in bf16, and the timestep reaches the transformer in float32 (FSDP2's policy casts no
    input); a trainer's run is on-policy in its first update, saves float32 and publishes bf16 (its bitwise resume
    under FSDP2: test_fsdp)."""
    script = tmp_path / "fsdp_bf16.py"
    script.write_text(f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
                      "import common, test_precision\nwith common.ends_process():\n"
                      f"    test_precision.fsdp_bf16({str(tmp_path)!r}, {tiny_pipeline('sd3')!r})\n")
    torchrun(str(script), [])
    assert (tmp_path / "fsdp_bf16").read_text() == "2 ranks: float32 shards, bfloat16 blocks, timestep 913.35 float32"
    argv = [*tiny_argv("flow_grpo", "flux"), "--lora-rank", "0", "--fsdp", "--dtype", "bf16", "--prompts-per-step", "4",
            *QUIET, "--iterations", "1", "--output-dir", str(tmp_path / "run")]
    torchrun("flow_grpo.py", argv)
    (m,) = read_metrics(tmp_path / "run")[:1]
    assert m["ratio_dev_first_update"] == 0.0 and math.isfinite(m["loss"])
    assert {t.dtype for t in trained_params(tmp_path / "run", 1)} == {torch.float32}      # the master shards, saved
    published = load_file(tmp_path / "run" / "checkpoints" / "iter_000001" / "transformer" /
                          "diffusion_pytorch_model.safetensors")
    assert {t.dtype for t in published.values()} == {torch.bfloat16}


def fsdp_bf16(folder: str, pipeline: str):
    """Under torchrun: the tiny SD3 (saved in `pipeline`) fully fine-tuned under FSDP2 in bf16 (the test above)."""
    rt = common.setup_runtime(0, 1, "bf16", "sd3")
    adapter = common.load_model("sd3", rt, pipeline, resolution=32, guidance_scale=4.5)
    transformer = adapter.transformer
    common.add_lora(transformer, 0, 0.0, [])
    params = common.full_finetuning(transformer, rt, shard=True)
    shards = {q.to_local().dtype for q in params}
    seen = {"timestep": [], "blocks": set()}
    transformer.register_forward_pre_hook(lambda m, a, kw: seen["timestep"].append(kw["timestep"]), with_kwargs=True)
    for block in common.transformer_blocks(transformer):
        block.register_forward_pre_hook(lambda m, a: seen["blocks"].update(p.dtype for p in m.parameters()))
    v = adapter.velocity(transformer, adapter.noise(1), torch.tensor(0.91335), adapter.encode(["a cat"]))
    (t,) = seen["timestep"]
    assert shards == {torch.float32} and torch.isfinite(v).all()
    assert t.dtype == torch.float32 and torch.equal(t, torch.tensor([0.91335, 0.91335]) * 1000), t
    if rt.is_main:
        (Path(folder) / "fsdp_bf16").write_text(
            f"{rt.world_size} ranks: {', '.join(str(d)[6:] for d in shards)} shards, "
            f"{', '.join(str(d)[6:] for d in seen['blocks'])} blocks, timestep {t[0].item():.2f} {str(t.dtype)[6:]}")
