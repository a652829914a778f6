"""--compile: the transformer's repeated blocks through torch.compile, one compiled code per block class, the LoRA
layers traced inside them. The rollout's forward without grad computes what the update's forward with grad computes,
bit for bit (inductor rounds where eager rounds), so the first update stays exactly on-policy; every graph is compiled
in the run's first iteration; a resume is bitwise. The first compile of a configuration on a machine takes minutes on
2 cores (gcc builds inductor's kernels); inductor's cache (/tmp/torchinductor_<user>) makes the next ones seconds."""
import math

import pytest
import torch

import common
import flow_grpo
from helpers import (ROOT, TRAINERS, read_metrics, run, straight_and_resumed, tiny_argv, tiny_configs, tiny_pipeline,
                     torchrun, trained_params, without_timings)

CPU = torch.device("cpu")


def eager_and_compiled(**blocks):
    """Two tiny FLUX adapters in bf16 with the same weights (seed 0) and the same LoRA, set away from peft's start
    (lora_B = 0) so that it counts; the second's blocks compiled. With two prompts' condition and noise."""
    configs = tiny_configs("flux")
    configs["transformer"].update(**blocks)
    rt = common.Runtime(0, 1, CPU, torch.bfloat16, compile=True)
    eager, compiled = (common.FluxAdapter(common.build_pipeline("flux", configs), CPU, torch.bfloat16, 32)
                       for _ in range(2))
    common.compile_blocks(compiled, rt)
    for adapter in (eager, compiled):
        common.add_lora(adapter.transformer, 4, 8, adapter.lora_targets)
        for i, (name, p) in enumerate(adapter.transformer.named_parameters()):
            if "lora_" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(i))
    cond, x = eager.encode(["a cat", "a dog"]), eager.noise(2, torch.Generator().manual_seed(0))
    compiled.txt_ids = eager.txt_ids                         # the text tokens' positions, set by encode
    return eager, compiled, cond, x


@pytest.mark.slow  # about 30 s of compiling on 2 cores; the default suite: the compiled block below
def test_one_compiled_code_per_block_class_with_the_lora_inside():
    """Three blocks of each FLUX kind: the compiles do not grow with the blocks. The double blocks share one graph, the
    single blocks two (the first one's input has another layout: strides are guarded), with the LoRA on and off. The
    compiled velocity is the eager one with the LoRA's update in it (its weights set away from peft's start, where
    lora_B = 0: the adapter changes the output)."""
    eager, compiled, cond, x = eager_and_compiled(num_layers=3, num_single_layers=3)
    before = common.COMPILING["compiles"]
    with torch.no_grad():
        v_eager, v = (a.velocity(a.transformer, x, torch.tensor(0.7), cond) for a in (eager, compiled))
        with common.lora_disabled(compiled.transformer):
            v_base = compiled.velocity(compiled.transformer, x, torch.tensor(0.7), cond)
    assert common.COMPILING["compiles"] - before == 2 * 3    # (1 double + 2 single) x (LoRA on, off); 6 blocks
    assert torch.equal(v, v_eager)                           # bf16: inductor rounds where eager rounds
    assert not torch.equal(v, v_base)


def test_a_compiled_block_computes_with_grad_what_it_computes_without():
    """The default suite's compile check (the compiled runs and every block class: slow, below and above): a FLUX double
    block with a LoRA in it, compiled in bf16, computes without grad (the rollout's forward) and with grad (the
    update's) the eager velocity bit for bit, each in a graph of its own: under --compile the first update stays
    on-policy."""
    eager, compiled, cond, x = eager_and_compiled(num_single_layers=0)  # one block class: 2 graphs
    before = common.COMPILING["compiles"]
    with torch.no_grad():
        v_eager, v_rollout = (a.velocity(a.transformer, x, torch.tensor(0.7), cond) for a in (eager, compiled))
    v_update = compiled.velocity(compiled.transformer, x, torch.tensor(0.7), cond)
    assert v_update.requires_grad and common.COMPILING["compiles"] - before == 2
    assert torch.equal(v_rollout, v_eager) and torch.equal(v_update.detach(), v_rollout)


@pytest.mark.slow  # about 70 s of compiling on 2 cores; the default suite: the compiled block above
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_compiled_runs_are_on_policy_compile_once_and_resume_bitwise(dtype, tmp_path):
    """flow_grpo on the tiny FLUX with an EMA, gradient checkpointing and an evaluation every iteration: each
    iteration's first update exactly on-policy, every graph compiled in iteration 0 (its evaluation, rollout, update
    and backward), none after; 1 + a resume of 2 iterations is bitwise 3 straight (the resume reuses this process's
    compiled code: the same kernels a new process loads from inductor's cache)."""
    argv = [*tiny_argv("flow_grpo", "flux"), "--compile", "--dtype", dtype, "--threads", "1", "--ema",
            "--gradient-checkpointing", "--eval-images", "3"]
    straight, resumed = straight_and_resumed(flow_grpo, argv, 1, 3, tmp_path)
    lines = read_metrics(tmp_path / "straight")
    assert lines[0]["compiles"] > 0 and lines[0]["compile_s"] > 0
    assert [m["compiles"] for m in lines[1:]] == [0, 0, 0], lines
    assert [m["ratio_dev_first_update"] for m in lines[:3]] == [0.0] * 3
    assert [m["clip_frac_first_update"] for m in lines[:3]] == [0.0] * 3
    assert all(math.isfinite(m["eval_reward"]) for m in lines)
    assert straight == resumed
    a, b = trained_params(tmp_path / "straight", 3), trained_params(tmp_path / "split", 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("family", ["flux", "sd3", "flux2"])
def test_every_trainer_compiled_is_on_policy_in_bf16_and_fp32(trainer, family, tmp_path):
    """Every trainer on the three tiny pipelines, compiled, in float32 and bf16: the first update exactly on-policy, no
    compile after iteration 0."""
    for dtype in ("fp32", "bf16"):
        out = tmp_path / dtype
        run(__import__(trainer), [*tiny_argv(trainer, family), "--compile", "--dtype", dtype, "--threads", "1",
                                  "--iterations", "2", "--eval-every", "1", "--output-dir", str(out)])
        lines = read_metrics(out)
        assert [m["ratio_dev_first_update"] for m in lines[:2]] == [0.0, 0.0], (dtype, lines)
        assert [m["clip_frac_first_update"] for m in lines[:2]] == [0.0, 0.0]
        assert [m["compiles"] for m in lines[1:]] == [0, 0], lines


@pytest.mark.slow
def test_fsdp2_compiled_before_sharding_is_on_policy_and_resumes_bitwise_across_processes(tmp_path):
    """Full fine-tuning sharded by FSDP2 over 2 gloo ranks in bf16, compiled (the blocks' forwards compiled when the
    model loads, before full_finetuning shards them: FSDP2's all-gathers stay outside the compiled code), with
    gradient checkpointing: the first update exactly on-policy, no compile after iteration 0, and 1 + a resume of 2
    iterations, each a new torchrun (the resume loads the compiled kernels from inductor's cache), bitwise 3
    straight."""
    argv = [*tiny_argv("flow_grpo", "flux"), "--lora-rank", "0", "--fsdp", "--compile", "--dtype", "bf16", "--ema",
            "--gradient-checkpointing", "--prompts-per-step", "4", "--eval-every", "2", "--eval-images", "4"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    torchrun("flow_grpo.py", [*argv, "--iterations", "3", "--output-dir", str(straight)])
    torchrun("flow_grpo.py", [*argv, "--iterations", "1", "--output-dir", str(split)])
    torchrun("flow_grpo.py", [*argv, "--iterations", "3", "--output-dir", str(split), "--resume", str(split)])
    lines = read_metrics(straight)
    assert [m["ratio_dev_first_update"] for m in lines[:3]] == [0.0] * 3
    assert lines[0]["compiles"] > 0 and [m["compiles"] for m in lines[1:]] == [0, 0, 0], lines
    assert without_timings(lines) == without_timings(read_metrics(split))
    a, b = trained_params(straight, 3), trained_params(split, 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["toy", "sd3"])
def test_common_evaluate_compiled_scores_as_eager(model, tmp_path):
    """`python common.py evaluate --compile`: the base model's evaluation (float32 on the toy, bf16 on the tiny SD3)
    agrees with the eager one (compiled float32 kernels sum in another order: about 1e-7 apart)."""
    argv = ["--model", model, "--images", "6", "--steps", "4", "--batch-size", "4", "--threads", "1"]
    if model == "sd3":
        argv += ["--model-path", tiny_pipeline("sd3"), "--reward", "jpeg", "--resolution", "32", "--dtype", "bf16",
                 "--prompts", str(common.ASSETS / "prompts.txt")]
    eager = common.evaluate_main([*argv, "--output", str(tmp_path / "eager")])["base"]
    compiled = common.evaluate_main([*argv, "--compile", "--output", str(tmp_path / "compiled")])["base"]
    assert eager.keys() == compiled.keys()
    for key in eager:
        assert compiled[key] == pytest.approx(eager[key], abs=1e-3), key


@pytest.mark.slow
def test_gpu_check_compiled_row_on_cpu(tmp_path):
    """The GPU check's compiled row in its CPU mode: FLUX at real width (one block of each kind) in bf16, a
    --preflight of flow_grpo eager and compiled; the compiled one passes every check the eager one passes (its first
    update exactly on-policy: --preflight FAILs it otherwise) and logs its compile seconds."""
    import json
    import subprocess
    import sys
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu_check.py"), "--quick", "--compiled", "--models",
                           "flux", "--trainers", "flow_grpo", "--out", str(out)], capture_output=True, text=True,
                          timeout=1800)
    rows = [json.loads(s) for s in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["compiled"], r["status"]) for r in rows] == [(False, "ok"), (True, "ok")], rows
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert rows[1]["compile_s"] > 0 and "| flux | flow_grpo | on | on (" in proc.stdout
    report = json.loads((out / "flux-flow_grpo-ckpt-compiled" / "preflight.json").read_text())
    status = {row["check"]: row["status"] for row in report["rows"]}
    assert status["ratio_dev_first_update"] == status["clip_frac_first_update"] == "PASS"


def test_the_side_by_side_gives_flow_grpo_the_official_configs_settings():
    """benchmark_compile --official runs flow_grpo with RECIPES' flags beside the official configs pickscore_sd3
    (full) and pickscore_sd3_fast_nocfg (Fast) of Flow-GRPO at commit 9745241, whose settings (config/grpo.py over
    config/base.py, resized as official_worker resizes them) are written out here."""
    import benchmark_compile
    official = {"full": dict(guidance_scale=4.5, beta=0.01, clip_range=1e-4, noise_level=0.7, sde_type="flow",
                             sde_window=0, timestep_fraction=0.99),
                "fast": dict(guidance_scale=1.0, beta=0.0, clip_range=1e-5, noise_level=0.8, sde_type="cps",
                             sde_window=3, sde_window_range="0,5")}
    for recipe, settings in official.items():
        args = common.cli(flow_grpo.Args, [*benchmark_compile.REAL, *benchmark_compile.RECIPES[recipe]],
                          flow_grpo.MODEL_DEFAULTS)
        assert {k: getattr(args, k) for k in settings} == settings
        assert (args.lr, args.adv_clip, args.global_std, args.ema, args.lora_rank, args.lora_alpha) == (
            3e-4, 5.0, True, True, 32, 64)
        assert (args.prompts_per_step, args.group_size, args.micro_batch, args.updates_per_rollout, args.sample_steps,
                args.resolution, args.gradient_checkpointing) == (2, 8, 8, 2, 10, 64, False)


@pytest.mark.parametrize("model", ["sd3", "flux2"])
def test_the_benchmarks_command_lines_pass_every_trainers_checks(model, tmp_path, monkeypatch):
    """Each benchmark_compile run's flags pass its trainer's checks, all made before the model loads (stopped there:
    at klein's sizes one micro-batch once could not take flow_grpo's two updates, found an hour into a run)."""
    import importlib

    import benchmark_compile

    class Loading(Exception):
        pass

    def load_model(*args, **kwargs):
        raise Loading
    monkeypatch.setattr(common, "load_model", load_model)
    for trainer in TRAINERS:
        for mode in benchmark_compile.MODES:
            argv = benchmark_compile.argv_of(model, trainer, mode, False, 2, 1, tmp_path / f"{trainer}-{mode}")
            with pytest.raises(Loading):
                run(importlib.import_module(trainer), argv)


@pytest.mark.slow  # the compiled block above is the default suite's
def test_the_compile_benchmark_quick_mode_runs_every_path(tmp_path):
    """tests/benchmark_compile.py --quick: flow_grpo on the tiny FLUX eager in float32 and bf16 and compiled in bf16,
    each run a process of its own; the table has a row per mode with the phases' seconds and peak memory, the compiled
    run compiled in its first iteration only and stayed on-policy."""
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "benchmark_compile.py"), "--quick", "--out",
                           str(tmp_path / "b")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "b" / "results.json").read_text())
    assert [r["mode"] for r in rows] == ["fp32", "bf16", "bf16-compile"]
    for r in rows:
        assert r["iterations"] == 2 and r["s_per_it"] > 0 and r["ratio_dev_first_update"] == 0.0
        assert 0 < r["peak_load_gib"] <= r["peak_gib"] and r["peak_update_gib"] > 0
    assert rows[2]["compile_s"] > 0 and rows[2]["later_compiles"] == 0
    assert "| flow_grpo | bf16-compile |" in proc.stdout
