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
from helpers import (TRAINERS, read_metrics, run, straight_and_resumed, tiny_argv, tiny_configs, trained_params)

CPU = torch.device("cpu")


def test_one_compiled_code_per_block_class_with_the_lora_inside():
    """Three blocks of each FLUX kind: the compiles do not grow with the blocks. The double blocks share one graph, the
    single blocks two (the first one's input has another layout: strides are guarded), with the LoRA on and off. The
    compiled velocity is the eager one with the LoRA's update in it (its weights set away from peft's start, where
    lora_B = 0: the adapter changes the output)."""
    configs = tiny_configs("flux")
    configs["transformer"].update(num_layers=3, num_single_layers=3)
    rt = common.Runtime(0, 1, CPU, torch.bfloat16, compile=True)
    eager, compiled = (common.FluxAdapter(common.build_pipeline("flux", configs), CPU, torch.bfloat16, 32)
                       for _ in range(2))                    # the same weights (seed 0)
    common.compile_blocks(compiled, rt)
    for adapter in (eager, compiled):
        common.add_lora(adapter.transformer, 4, 8, adapter.lora_targets)
        for i, (name, p) in enumerate(adapter.transformer.named_parameters()):
            if "lora_" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(i))
    cond, x = eager.encode(["a cat", "a dog"]), eager.noise(2, torch.Generator().manual_seed(0))
    compiled.txt_ids = eager.txt_ids                         # the text tokens' positions, set by encode
    before = common.COMPILING["compiles"]
    with torch.no_grad():
        v_eager, v = (a.velocity(a.transformer, x, torch.tensor(0.7), cond) for a in (eager, compiled))
        with common.lora_disabled(compiled.transformer):
            v_base = compiled.velocity(compiled.transformer, x, torch.tensor(0.7), cond)
    assert common.COMPILING["compiles"] - before == 2 * 3    # (1 double + 2 single) x (LoRA on, off); 6 blocks
    assert torch.equal(v, v_eager)                           # bf16: inductor rounds where eager rounds
    assert not torch.equal(v, v_base)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
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
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_every_trainer_compiled_is_on_policy_in_bf16_and_fp32(trainer, family, tmp_path):
    """Every trainer on both tiny pipelines, compiled, in float32 and bf16: the first update exactly on-policy, no
    compile after iteration 0."""
    for dtype in ("fp32", "bf16"):
        out = tmp_path / dtype
        run(__import__(trainer), [*tiny_argv(trainer, family), "--compile", "--dtype", dtype, "--threads", "1",
                                  "--iterations", "2", "--eval-every", "1", "--output-dir", str(out)])
        lines = read_metrics(out)
        assert [m["ratio_dev_first_update"] for m in lines[:2]] == [0.0, 0.0], (dtype, lines)
        assert [m["clip_frac_first_update"] for m in lines[:2]] == [0.0, 0.0]
        assert [m["compiles"] for m in lines[1:]] == [0, 0], lines
