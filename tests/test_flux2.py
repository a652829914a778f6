"""FLUX.2-klein (--model flux2) through the machinery, on the tiny random-weight pipeline saved and read back as a
user's (tests/helpers.py), in its full-scale dtype (bf16): full fine-tuning with its EMA and KL reference on the Fast
recipe resumed bitwise and scored by `common.py evaluate`; fp16; --preflight (slow: DDP, FSDP2, --compile). Every
trainer in bf16, resumed bitwise: tests/test_precision.py (flow_grpo's in the default suite); the adapter against the
klein pipeline, its grid, its text embeddings: tests/test_models.py; the published architecture and its LoRA:
tests/test_full_scale.py."""
import json
import math

import pytest
import torch

import common
import flow_grpo
from helpers import read_metrics, run, straight_and_resumed, tiny_argv, torchrun, trained_params, training_state

BF16 = ["--dtype", "bf16", "--threads", "1"]


def test_full_fine_tuning_with_its_ema_and_kl_reference_resumes_bitwise_and_evaluates(tmp_path):
    """Full fine-tuning in bf16 with an EMA and a KL reference, the layout of klein-4B on one GPU (the EMA in CPU
    memory, the reference's linear weights in bf16), on the Fast recipe's window and CPS step: the first update exactly
    on-policy with a KL of 0 to the reference, 1 iteration + --resume equal to 2 straight, the EMA a state of its own;
    `common.py evaluate` scores the published transformer (the EMA's) as the trainer's last evaluation did."""
    argv = [*tiny_argv("flow_grpo", "flux2"), *BF16, "--lora-rank", "0", "--ema", "--beta", "0.01", "--sde-window",
            "2", "--sde-type", "cps", "--noise-level", "0.8", "--clip-range", "1e-3", "--eval-every", "2"]
    straight, resumed = straight_and_resumed(flow_grpo, argv, 1, 2, tmp_path)
    assert straight == resumed and [m["iteration"] for m in straight] == [0, 1, 2]
    assert straight[0]["kl_first_update"] == 0.0 and straight[1]["kl"] > 0
    assert [m["ratio_dev_first_update"] for m in straight[:2]] == [0.0, 0.0]
    assert all(torch.equal(a, b) for a, b in zip(trained_params(tmp_path / "straight", 2),
                                                  trained_params(tmp_path / "split", 2), strict=True))
    state = training_state(tmp_path / "straight" / "checkpoints" / "iter_000002")
    assert not all(torch.equal(state["ema"][i], state["params"][i]) for i in state["ema"])
    ref = reference_dtypes(argv)
    assert ref["linear"] == {torch.bfloat16} and ref["other"] == {torch.float32}
    results = common.evaluate_main(["--checkpoint", str(tmp_path / "straight"), "--output", str(tmp_path / "eval"),
                                    "--threads", "1"])
    (scored,) = results.values()
    assert scored["eval_reward"] == pytest.approx(straight[-1]["eval_reward"], abs=1e-6)


def reference_dtypes(argv: list[str]) -> dict:
    """The dtypes of the KL reference full_finetuning keeps for the run of `argv`: its Linear weights, the rest."""
    args = common.cli(flow_grpo.Args, argv, flow_grpo.MODEL_DEFAULTS)
    rt = common.setup_runtime(0, 1, args.dtype, "flux2")
    adapter = common.load_model("flux2", rt, args.model_path, args.resolution)
    ref = common.frozen_copy(adapter.transformer)
    common.full_finetuning(adapter.transformer, rt, ref)
    linear = {n + ".weight" for n, m in ref.named_modules() if type(m) is torch.nn.Linear}
    return {"linear": {p.dtype for n, p in ref.named_parameters() if n in linear},
            "other": {p.dtype for n, p in ref.named_parameters() if n not in linear}}


def test_an_ema_in_cpu_memory_averages_as_one_on_the_device():
    """EMA(offload=True), full fine-tuning's on one GPU: its shadow and a swap's backup are CPU copies, never the
    weights themselves, and it averages and swaps in exactly as the EMA kept beside the weights."""
    weights = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    emas = [common.EMA(weights, every=1, offload=offload) for offload in (False, True)]
    for step in range(1, 4):
        with torch.no_grad():
            for p in weights:
                p.add_(torch.randn_like(p))
        for ema in emas:
            ema.step(step)
    for a, b in zip(*(ema.shadow for ema in emas), strict=True):
        assert torch.equal(a, b) and b.device.type == "cpu"
    kept = [p.detach().clone() for p in weights]
    with emas[1].swapped_in():
        assert all(torch.equal(p, s) for p, s in zip(weights, emas[0].shadow))
    assert all(torch.equal(p, k) for p, k in zip(weights, kept))
    assert all(s.data_ptr() != p.data_ptr() for s, p in zip(emas[1].shadow, weights))


def test_a_lora_in_fp16_passes_the_preflight(tmp_path):
    """fp16 (autocast over float32 frozen weights, loss scaling) on klein's tiny pipeline, through --preflight: every
    check passes, the first update among them."""
    with pytest.raises(common.TrainingStopped) as stop:
        run(flow_grpo, [*tiny_argv("flow_grpo", "flux2"), "--dtype", "fp16", "--threads", "1", "--preflight",
                        "--output-dir", str(tmp_path / "r")])
    report = json.loads((tmp_path / "r" / "preflight.json").read_text())
    assert stop.value.exit_code == 0 and report["passed"], report["rows"]
    status = {r["check"]: r["status"] for r in report["rows"]}
    assert status["ratio_dev_first_update"] == status["kl_first_update"] == "PASS"


@pytest.mark.slow  # the default suite: DDP on the tiny SD3 (test_flow_grpo), flow_grpo on klein (above)
def test_ddp_over_two_ranks_keeps_the_replicas_identical(tmp_path):
    """A LoRA on 2 gloo ranks in bf16: DDP's replicas end equal, and the first update is on-policy on each rank."""
    torchrun("flow_grpo.py", [*tiny_argv("flow_grpo", "flux2"), *BF16, "--prompts-per-step", "4", "--iterations",
                              "1", "--eval-every", "1", "--output-dir", str(tmp_path / "r")])
    first, last = read_metrics(tmp_path / "r")
    assert first["ratio_dev_first_update"] == 0.0 and last["rank_param_diff"] == 0.0
    assert math.isfinite(last["eval_reward"])


@pytest.mark.slow  # the default suite: DDP above, FSDP2 on the tiny FLUX.1 (test_fsdp)
def test_fsdp2_full_fine_tuning_with_the_kl_reference_resumes_bitwise(tmp_path):
    """FSDP2 over 2 gloo ranks in bf16, each FLUX.2 double and single block a unit, the reference sharded alike:
    on-policy first updates, 1 + a resume of 1 iteration bitwise 2 straight."""
    argv = [*tiny_argv("flow_grpo", "flux2"), *BF16, "--lora-rank", "0", "--fsdp", "--beta", "0.01", "--ema",
            "--prompts-per-step", "4", "--eval-every", "0"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    torchrun("flow_grpo.py", [*argv, "--iterations", "2", "--output-dir", str(straight)])
    torchrun("flow_grpo.py", [*argv, "--iterations", "1", "--output-dir", str(split)])
    torchrun("flow_grpo.py", [*argv, "--iterations", "2", "--output-dir", str(split), "--resume", str(split)])
    lines = read_metrics(straight)
    assert [m["ratio_dev_first_update"] for m in lines[:2]] == [0.0, 0.0] and lines[0]["kl_first_update"] == 0.0
    assert [{k: v for k, v in m.items() if not k.startswith("t_") and k != "time_s"} for m in lines] == \
        [{k: v for k, v in m.items() if not k.startswith("t_") and k != "time_s"} for m in read_metrics(split)]
    assert all(torch.equal(a, b) for a, b in zip(trained_params(straight, 2), trained_params(split, 2), strict=True))
