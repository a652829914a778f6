"""The full-scale path without downloads: the published architectures (parameter counts on `meta`, LoRA targets),
one training iteration at real width and reduced depth per model (the GPU check's CPU mode), and the fixes that
make full-scale runs match the pipelines and the official code (timestep precision, prompt length, fp16 with
loss scaling, EMA warm-up, population std)."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import common
import flow_grpo
import gpu_check
import helpers
from helpers import ROOT, run, tiny_configs, tiny_pipeline

CPU = torch.device("cpu")


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---- the published architectures ----
@pytest.mark.parametrize("family,published", [("flux", 11.9e9), ("sd3", 2.24e9)])
def test_full_depth_transformers_have_the_published_parameter_counts(family, published):
    pipe = common.build_pipeline(family, common.architecture(family), device="meta")
    assert pipe.transformer.device.type == "meta"
    assert n_params(pipe.transformer) == pytest.approx(published, rel=0.01)  # FLUX.1-dev 11.9B, SD3.5-M 2.24B
    assert n_params(pipe.text_encoder) == pytest.approx(123e6, rel=0.01)      # CLIP ViT-L/14's text tower
    t5 = pipe.text_encoder_2 if family == "flux" else pipe.text_encoder_3
    assert n_params(t5) == pytest.approx(4.76e9, rel=0.01)                     # T5 v1.1 XXL's encoder
    if family == "flux":
        assert (len(pipe.transformer.transformer_blocks), len(pipe.transformer.single_transformer_blocks)) == (19, 38)
    else:
        duals = [b.attn2 is not None for b in pipe.transformer.transformer_blocks]
        assert duals == [True] * 13 + [False] * 11                           # SD3.5-M: dual attention in 0..12


def test_flux2_klein_4b_has_the_published_parameter_counts():
    """assets/architectures/flux2: FLUX.2-klein 4B's transformer (5 double and 20 single blocks of 24 heads of 128: 3.9B
    parameters), Qwen3-4B (36 layers of 2560: 4.0B) and the FLUX.2 VAE (84M, its decoder 50M)."""
    pipe = common.build_pipeline("flux2", common.architecture("flux2"), device="meta")
    assert type(pipe).__name__ == "Flux2KleinPipeline" and not pipe.config.is_distilled  # the base model's folder
    assert n_params(pipe.transformer) == pytest.approx(3.876e9, rel=0.001)
    assert (len(pipe.transformer.transformer_blocks), len(pipe.transformer.single_transformer_blocks)) == (5, 20)
    assert n_params(pipe.text_encoder) == pytest.approx(4.022e9, rel=0.001)
    assert (pipe.text_encoder.config.num_hidden_layers, pipe.text_encoder.config.hidden_size) == (36, 2560)
    assert n_params(pipe.vae) == pytest.approx(84.0e6, rel=0.001) and n_params(pipe.vae.decoder) == pytest.approx(
        49.6e6, rel=0.001)
    small = common.architecture("flux2", blocks=2)
    assert small["text_encoder"]["num_hidden_layers"] == 1 and small["transformer"]["num_single_layers"] == 2


def lora_share(family: str, targets=None) -> float:
    """The share of the weights of the linear layers of the transformer's blocks that a LoRA adapts, on the published
    architecture: the model's adapter's targets, or `targets`."""
    transformer = common.build_pipeline(family, common.architecture(family), device="meta").transformer
    common.add_lora(transformer, 4, 4, helpers.lora_targets(family, transformer) if targets is None else targets)
    linears = [m for block in common.transformer_blocks(transformer) for name, m in block.named_modules()
               if isinstance(m, torch.nn.Linear) and "lora_" not in name]        # the model's own, adapted or not
    adapted = {id(m.base_layer) for block in common.transformer_blocks(transformer) for m in block.modules()
               if hasattr(m, "lora_A")}
    return sum(m.weight.numel() for m in linears if id(m) in adapted) / sum(m.weight.numel() for m in linears)


def test_each_lora_adapts_the_share_of_the_blocks_it_means_to():
    """FLUX.2's LoRA adapts every linear layer of every block (the modulations are the root's); FLUX.1's, as diffusers'
    FLUX LoRA script and Flow-GRPO, the double blocks' projections and the single blocks' q, k, v (45% of the blocks'
    linear weights: not the modulations nor the single blocks' MLP); SD3's, as Flow-GRPO's, the joint attention (20%).
    FLUX.1's names on FLUX.2 would match the double blocks' attention alone, 10% (16% of a rank-64 adapter's own
    parameters), without an error: a target list that silently trains a fraction of the model fails here."""
    assert lora_share("flux2") == 1.0
    assert lora_share("flux") == pytest.approx(0.4545, abs=1e-4)
    assert lora_share("sd3") == pytest.approx(0.2028, abs=1e-4)
    assert lora_share("flux2", common.FLUX_LORA_TARGETS) == pytest.approx(0.1026, abs=1e-4)


def lora_layers(transformer) -> set[str]:
    return {name for name, m in transformer.named_modules() if hasattr(m, "lora_A")}


def test_lora_targets_are_the_attention_and_mlp_projections_of_every_block():
    """FLUX: every projection of the double blocks' two streams (attention and MLP) and the single blocks'
    q/k/v; SD3: the joint attention's projections (the last block has no text output), not the dual attention.
    The expected names are spelled out from the architectures, not from the target lists."""
    flux = common.build_pipeline("flux", common.architecture("flux"), device="meta").transformer
    params = common.add_lora(flux, 64, 128, common.FLUX_LORA_TARGETS)
    attn = ["attn.to_q", "attn.to_k", "attn.to_v"]
    joint = attn + ["attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]
    mlp = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
    want = {f"transformer_blocks.{i}.{n}" for i in range(19) for n in joint + mlp}
    want |= {f"single_transformer_blocks.{i}.{n}" for i in range(38) for n in attn}
    assert lora_layers(flux) == want
    assert sum(p.numel() for p in params) == pytest.approx(179e6, rel=0.01)  # rank 64
    assert all(p.requires_grad for p in params) and not any(p.requires_grad for n, p in flux.named_parameters()
                                                              if "lora" not in n)

    sd3 = common.build_pipeline("sd3", common.architecture("sd3"), device="meta").transformer
    common.add_lora(sd3, 32, 64, common.SD3_LORA_TARGETS)
    want = {f"transformer_blocks.{i}.{n}" for i in range(24) for n in joint if not (i == 23 and n == "attn.to_add_out")}
    assert lora_layers(sd3) == want


def test_reduced_depth_keeps_every_width():
    full, small = common.architecture("sd3"), common.architecture("sd3", blocks=2)
    assert full["transformer"]["num_layers"] == 24 and full["transformer"]["dual_attention_layers"] == list(range(13))
    assert small["transformer"] == {**full["transformer"], "num_layers": 2, "dual_attention_layers": [0, 1]}
    assert small["text_encoder_3"] == {**full["text_encoder_3"], "num_layers": 1}
    assert small["vae"] == full["vae"]
    for path, most in [("random:0", 24), ("random:25", 24), ("random:39", 38)]:  # FLUX: 19 double, 38 single blocks
        family = "sd3" if most == 24 else "flux"
        with pytest.raises(common.UsageError, match=f"write random .full depth. or random:N with 1 <= N <= {most}"):
            common.random_depth(path, family)
    assert common.random_depth("random:24", "sd3") == 24 and common.random_depth("random:38", "flux") == 38
    assert common.random_depth("random", "sd3") is None and common.random_depth("/some/folder", "flux") is None


def test_a_bad_random_model_path_stops_before_any_model_loads(tmp_path):
    with pytest.raises(common.UsageError, match="--model-path random:x: write random"):
        run(flow_grpo, ["--model", "sd3", "--model-path", "random:x", "--output-dir", str(tmp_path / "r")])
    assert not (tmp_path / "r").exists()


# ---- one iteration at real width: the GPU check's CPU mode ----
@pytest.mark.slow  # the default suite: the check's report and its computed tables (below)
@pytest.mark.parametrize("family,trainer", [("flux", "flow_grpo"), ("sd3", "v_grpo"), ("flux2", "flow_grpo")])
def test_gpu_check_cpu_mode_trains_the_real_width_models(family, trainer, tmp_path):
    """The one-command GPU check on CPU: reduced depth, real widths, each model in its full-scale dtype (FLUX, FLUX.2
    bf16, SD3 fp16), a --preflight run each, a table of what its one iteration measured; the random-weight PickScore's
    checks FAIL or WARN, as they should. SD3's case is slow: fp16 matrix products run about 80x slower than float32 on
    a CPU without fp16 arithmetic (its fast sibling: test_precision, on the tiny SD3 in fp16)."""
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu_check.py"), "--quick", "--models", family,
                           "--trainers", trainer, "--out", str(out)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (r,) = [json.loads(s) for s in (out / "results.jsonl").read_text().splitlines()]
    assert r["status"] == "ok", r
    assert gpu_check.findings([r]) == [] and proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"| {family} | {trainer} | on | off | 64 |" in proc.stdout
    # the counts are the run's: one prompt, a group of 2, 4 sampling steps
    if family == "flux":         # no CFG, no KL (beta 0): 2 x 4 sampling rows, 2 x int(0.99 * 4) trained
        assert (r["nfe_fwd"], r["nfe_fwd_bwd"]) == (8, 6)
    elif family == "flux2":      # CFG's 2 rows a sample, and a KL (the LoRA off): 16 sampling + 12 reference rows
        assert (r["nfe_fwd"], r["nfe_fwd_bwd"]) == (28, 12)
    else:                        # V-GRPO on SD3 (no CFG at its guidance 1): 2 x 4 sampling rows + 2 x 4 old
        assert (r["nfe_fwd"], r["nfe_fwd_bwd"]) == (16, 8)  # surrogate rows; 2 x 4 (t, eps) pairs with grad
    assert r["s_per_it"] >= r["t_rollout"] + r["t_reward"] + r["t_update"]  # the iteration's clock holds its parts
    assert r["images_per_s"] == pytest.approx(2 / r["s_per_it"])
    report = json.loads((out / f"{family}-{trainer}-ckpt" / "preflight.json").read_text())
    status = {row["check"]: row["status"] for row in report["rows"]}
    assert status["pickscore: right vs shifted prompts"] == "FAIL"                # no prompt read by random weights
    assert "pickscore: right vs shifted prompts" in r["preflight_fails"]
    assert status["gradients finite"] == status["step size, change / weights (L2)"] == "PASS"


@pytest.mark.slow
@pytest.mark.parametrize("family,dtype", [("flux", None), ("sd3", None), ("flux2", "bf16")])
def test_every_trainer_trains_a_saved_real_width_pipeline(family, dtype, tmp_path):
    """As a new user would: the reduced-depth real-width pipeline saved with save_pretrained and read back by
    --model-path (from_pretrained), one iteration of every trainer at 64 px, in a CPU's default dtype (float32) or, for
    FLUX.2-klein (the model a user trains on one GPU), in bf16."""
    pipe = common.build_pipeline(family, common.architecture(family, int(gpu_check.CPU_DEPTH[family][-1])))
    pipe.save_pretrained(tmp_path / "pipe")
    del pipe
    for trainer in gpu_check.TRAINERS:
        module = __import__(trainer)
        argv = gpu_check.trainer_argv(trainer, family, ckpt=True, gpu=False, out=tmp_path / trainer)
        argv[argv.index("--model-path") + 1] = str(tmp_path / "pipe")
        del argv[argv.index("--dtype"):argv.index("--dtype") + 2]     # a CPU's default, fp32, as a new user runs it
        argv += ["--dtype", dtype] if dtype else []
        argv += ["--reward", "jpeg", "--iterations", "1"]
        metrics = run(module, argv)
        assert metrics["iteration"] == 1 and math.isfinite(metrics["time_s"])
        lines = [json.loads(s) for s in (tmp_path / trainer / "metrics.jsonl").read_text().splitlines()]
        assert lines[0]["nfe_fwd_bwd"] > 0 and math.isfinite(lines[0]["loss"])


# ---- full-scale fixes ----
def test_sd3_passes_the_timestep_to_the_transformer_in_float32():
    """In bf16 the transformer would be asked about t = 912 while the step math uses 913.35."""
    adapter = common.SD3Adapter(common.build_pipeline("sd3", tiny_configs("sd3")), CPU, torch.bfloat16, 32, 4.5)
    seen = []
    adapter.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    adapter.velocity(adapter.transformer, adapter.noise(1), torch.tensor(0.91335), adapter.encode(["a cat"]))
    (t,) = seen
    assert t.dtype == torch.float32
    assert torch.equal(t, torch.tensor([0.91335, 0.91335]) * 1000)  # CFG: both branches
    assert t[0].to(torch.bfloat16).float().item() == 912.0            # what bf16 would have passed


def test_sd3_prompts_default_to_128_t5_tokens():
    rt = common.Runtime(0, 1, CPU, torch.float32)
    adapter = common.load_model("sd3", rt, tiny_pipeline("sd3"), resolution=32, guidance_scale=4.5)
    assert adapter.encode(["a cat"])["prompt_embeds"].shape[1] == 77 + 128   # CLIP's 77, then T5's 128
    adapter = common.load_model("sd3", rt, tiny_pipeline("sd3"), resolution=32, guidance_scale=4.5,
                                max_sequence_length=64)
    assert adapter.encode(["a cat"])["prompt_embeds"].shape[1] == 77 + 64


def test_fp16_computes_over_float32_transformer_weights():
    """--dtype fp16: CLIP's text encoders in fp16 (T5: test_precision), the trained transformer in float32 (under fp16
    autocast), the VAE in float32; from a pipeline built in float32 and from a saved one (from_pretrained reads each in
    its dtype)."""
    rt = common.Runtime(0, 1, CPU, torch.float16)
    built = common.SD3Adapter(common.build_pipeline("sd3", tiny_configs("sd3")), CPU, torch.float16, 32, 4.5)
    for adapter in (built, common.load_model("sd3", rt, tiny_pipeline("sd3"), resolution=32, guidance_scale=4.5)):
        pipe = adapter.pipe
        assert {p.dtype for p in pipe.transformer.parameters()} == {torch.float32}
        assert {p.dtype for p in pipe.vae.parameters()} == {torch.float32}
        for enc in (pipe.text_encoder, pipe.text_encoder_2):
            assert {p.dtype for p in enc.parameters()} == {torch.float16}


def test_loss_scaling_steps_like_plain_fp32_and_rides_out_overflows():
    x = torch.linspace(-1, 1, 5)

    def one_step(loss_scaling, scale_loss=1.0, w0=None):
        w = torch.nn.Parameter(torch.ones(5) if w0 is None else w0.clone())
        opt = torch.optim.SGD([w], lr=0.1)
        guard = common.StepGuard(3, CPU, loss_scaling=loss_scaling)
        guard.backward((w * x).sum() * 1e-3 * scale_loss)
        return w, guard, guard.step(opt, [w], 1e9)

    w_plain, _, _ = one_step(False)
    w_scaled, guard, (stepped, _) = one_step(True)
    assert stepped and guard.scaler.get_scale() == 65536.0
    assert torch.equal(w_plain, w_scaled)                     # the scale is a power of two: unscaling is exact

    # fp16 activations: the loss scaled by 65536 overflows fp16 on the way back (65504 is its largest number), so
    # the first step is skipped and the scale halves, without counting as a bad step; the second steps exactly
    w = torch.nn.Parameter(torch.ones(5))
    opt = torch.optim.SGD([w], lr=0.1)
    guard = common.StepGuard(1, CPU, loss_scaling=True)      # a single counted bad step would stop the run
    results = []
    for _ in range(2):
        guard.backward((w.half() * x.half()).sum().float())
        results.append(guard.step(opt, [w], 1e9)[0])
    assert results == [False, True] and guard.scaler.get_scale() == 32768.0
    assert guard.skipped == 1 and guard.in_a_row == 0
    torch.testing.assert_close(w.detach(), 1 - 0.1 * x, rtol=0, atol=1e-7)

    # a non-finite loss is a bad step, scaled or not: the run stops after max_bad of them
    guard = common.StepGuard(3, CPU, loss_scaling=True)
    with pytest.raises(common.TrainingStopped, match="3 optimizer steps in a row"):
        for _ in range(3):
            guard.backward((w * x).sum() * float("nan"))
            guard.step(opt, [w], 1.0)


def test_ema_warm_up_counts_optimizer_steps():
    """The official schedule: after optimizer step n, if (n + 1) % 8 == 0, decay = min((1 + n) / (10 + n), 0.9)."""
    w = torch.nn.Parameter(torch.zeros(3))
    ema = common.EMA([w], decay=0.9, every=8)
    shadow = 0.0
    for n in range(1, 41):
        with torch.no_grad():
            w.fill_(float(n))
        ema.step(n)
        if (n + 1) % 8 == 0:
            decay = min((1 + n) / (10 + n), 0.9)
            shadow = decay * shadow + (1 - decay) * n
    torch.testing.assert_close(ema.shadow[0], torch.full((3,), shadow), rtol=1e-6, atol=0)


def test_ema_without_its_warm_up_is_a_soft_copy_at_its_own_decay():
    w = torch.nn.Parameter(torch.zeros(3))
    ema, shadow = common.EMA([w], decay=0.75, every=1, warmup=False), 0.0
    for n in range(1, 6):
        with torch.no_grad():
            w.fill_(float(n))
        ema.step(n)
        shadow = 0.75 * shadow + 0.25 * n
    torch.testing.assert_close(ema.shadow[0], torch.full((3,), shadow), rtol=1e-6, atol=0)


@pytest.mark.parametrize("global_std", [True, False])
def test_flow_grpo_advantages_use_the_population_std(global_std):
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(0))
    r = rewards.numpy().astype(np.float64).reshape(3, 4)
    std = np.std(r) if global_std else np.std(r, axis=1, keepdims=True)      # numpy's default: population
    want = ((r - r.mean(axis=1, keepdims=True)) / (std + 1e-4)).reshape(-1)
    got = flow_grpo.group_advantages(rewards, 4, global_std)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)


def test_computed_memory_table_adds_up_the_published_sizes():
    """gpu_check --computed for flow_grpo on FLUX: bf16 transformer, T5-XXL and CLIP-L, float32 VAE; a rank-64 LoRA
    held in float32 with its gradient, two AdamW moments and the EMA; PickScore's CLIP-H in float32."""
    rows = [line.split(" | ") for line in gpu_check.computed(["flow_grpo"]).splitlines()[2:]]
    flux = next(r for r in rows if r[0] == "| flux")
    gib = 2**30
    frozen = (11.90e9 + 4.762e9 + 0.1231e9) * 2 + 83.8e6 * 4
    assert float(flux[6].split()[0]) == pytest.approx(frozen / gib, abs=0.06)
    assert float(flux[7].split()[0]) == pytest.approx(179.0e6 * 4 * 5 / gib, abs=0.06)
    assert float(flux[9].split()[0]) == pytest.approx(986e6 * 4 / gib, abs=0.06)  # CLIP ViT-H/14: 986M
    text = (4.762e9 + 0.1231e9) * 2                                              # --offload-encoders
    assert float(flux[10].split()[0]) - float(flux[11].split()[0]) == pytest.approx(text / gib, abs=0.11)


def test_the_gpu_check_fails_on_a_preflight_fail_random_weights_do_not_explain():
    def result(fails, status="ok", ckpt=True):
        return {"model": "flux", "trainer": "flow_grpo", "ckpt": ckpt, "status": status, "preflight_fails": fails}
    explained = result(["pickscore: right vs shifted prompts"])
    assert gpu_check.findings([explained, result([])]) == []
    assert gpu_check.findings([explained, result(["pickscore: right vs shifted prompts", "gradients finite"],
                                                 ckpt=False)]) == \
        ["flux flow_grpo (no checkpointing): preflight FAIL gradients finite"]
    assert gpu_check.findings([result(["first update KL"]), result([], "error: CUDA error: out of memory")]) == \
        ["flux flow_grpo: preflight FAIL first update KL", "flux flow_grpo: error: CUDA error: out of memory"]


def test_computed_memory_table_counts_every_scorer_of_the_default_reward():
    """G2RPO scores with HPS v2.1 and DFN5B CLIP-H (two CLIP-H), V-GRPO on SD3 with HPS, PickScore and CLIP-L."""
    rows = [line.split(" | ") for line in gpu_check.computed(["g2rpo", "v_grpo"]).splitlines()[2:]]
    reward = {(r[0].strip("| "), r[1]): r[9] for r in rows}
    clip_h, clip_l = 986.1e6 * 4 / 2**30, 427.6e6 * 4 / 2**30
    for key, gib, names in [(("flux", "g2rpo"), 2 * clip_h, "(hpsv2, clipscore-h)"),
                            (("sd3", "v_grpo"), 2 * clip_h + clip_l, "(hpsv2, pickscore, clipscore)"),
                            (("flux", "v_grpo"), 2 * clip_h, "(hpsv2, pickscore)")]:
        assert float(reward[key].split()[0]) == pytest.approx(gib, abs=0.06) and reward[key].endswith(names), key


def test_one_gpu_holds_flux2_klein_4b_full_fine_tuning_with_its_ema_and_kl_reference():
    """gpu_check --layouts' one-GPU table for FLUX.2-klein 4B, from the published sizes: full fine-tuning's 16 bytes a
    parameter (3.876B), its KL reference in bf16 (2 bytes) and its EMA in CPU memory, the text encoder off the GPU,
    PickScore's CLIP-H in float32 and the checkpointed activations (16-bit block inputs of 5 + 20 blocks and one block's
    recompute, 16 x that, of width 3,072) fit an 80 GB GPU's 78 GiB at 512 px (micro-batch 4, CFG: 8 rows) and at 1024
    px (micro-batch 2); the LoRA holds Qwen3-4B (8.04 GB) and the transformer (7.75 GB) in bf16 besides."""
    rows = {(r[0].strip("| "), r[1], r[2].split()[0]): r for r in
            (line.split(" | ") for line in gpu_check.one_gpu().splitlines()[2:])}
    gib, n = 2**30, 3.876e9
    for px, micro_batch in [(512, 4), (1024, 2)]:
        r = rows[("full", str(px), str(micro_batch))]
        activations = 2 * micro_batch * ((px // 16) ** 2 + 512) * 3072 * 2 * (25 + 16)
        total = (n * 16 + n * 2 + 84.0e6 * 4 + 986.1e6 * 4 + activations) / gib
        assert r[5].startswith("18 (") and float(r[-1].strip(" |")) == pytest.approx(total, abs=0.2) and total < 78
    assert gpu_check.one_gpu() in (ROOT / "README.md").read_text()           # the README's table is this one
    lora = rows[("LoRA r32", "512", "8")]
    assert float(lora[8]) == pytest.approx((7.751e9 + 8.045e9 + 84.0e6 * 4) / gib, abs=0.1)  # frozen: bf16, VAE fp32
