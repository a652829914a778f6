"""--fsdp: full fine-tuning sharded with FSDP2 on 2 gloo ranks trains what DDP trains on the same global batch,
resumes exactly, on the same or another number of ranks, writes a transformer that from_pretrained reads, and
refuses what it cannot do."""
import json

import pytest
import torch
from diffusers import FluxTransformer2DModel

import common
import flow_grpo
from helpers import ROOT, read_metrics, run, tiny_argv, tiny_pipeline, torchrun, without_timings

SIZES = ["--lora-rank", "0", "--lr", "1e-3", "--prompts-per-step", "4", "--eval-images", "8", "--eval-every", "1",
         "--threads", "1"]
RUNS = {"flow_grpo": ["--group-size", "4", "--micro-batch", "4", "--sample-steps", "4", "--eval-steps", "4",
                      "--beta", "0.01"],   # a KL term: the frozen reference is sharded too
        "g2rpo": []}                       # its smoke-run sizes: groups of 2, 4 steps, strides {1, 2, 3}


def transformer_at(run_dir, iteration: int) -> dict:
    folder = run_dir / "checkpoints" / f"iter_{iteration:06d}" / "transformer"
    return FluxTransformer2DModel.from_pretrained(folder).state_dict()


@pytest.mark.parametrize("trainer", list(RUNS))
def test_fsdp_trains_what_ddp_trains(trainer, tmp_path):
    """Same global batch, same seeds: the metrics agree to float rounding, and so do the weights (FSDP2
    reduce-scatters the gradients where DDP all-reduces them: the same sums in another order, about 1e-7 apart
    after AdamW)."""
    argv = [*tiny_argv(trainer, "flux"), *SIZES, *RUNS[trainer], "--iterations", "2"]
    torchrun(f"{trainer}.py", [*argv, "--output-dir", str(tmp_path / "ddp")])
    stdout = torchrun(f"{trainer}.py", [*argv, "--fsdp", "--output-dir", str(tmp_path / "fsdp")])
    assert "ranks 2" in stdout
    ddp, fsdp = read_metrics(tmp_path / "ddp"), read_metrics(tmp_path / "fsdp")
    assert ddp[-1]["rank_param_diff"] == 0.0 and "rank_param_diff" not in fsdp[-1]  # shards differ by design
    a, b = ([{k: v for k, v in m.items() if k != "rank_param_diff"} for m in without_timings(lines)]  # DDP only
            for lines in (ddp, fsdp))
    assert [sorted(m) for m in a] == [sorted(m) for m in b]
    for ma, mb in zip(a, b):
        for key in ma:
            # jpeg scores move in whole bytes (1e-3 kB): one image's byte moves a standard error over the 8 evaluation
            # images by up to 1e-3 / 8, while the weights agree to 1e-5
            tolerance = 1e-3 / 8 if key.endswith("_se") else 1e-6
            assert mb[key] == pytest.approx(ma[key], rel=1e-4, abs=tolerance), (key, ma[key], mb[key])
    wa, wb = transformer_at(tmp_path / "ddp", 2), transformer_at(tmp_path / "fsdp", 2)
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    start = FluxTransformer2DModel.from_pretrained(tiny_pipeline("flux"), subfolder="transformer").state_dict()
    assert max((wa[k] - start[k]).abs().max().item() for k in wa) > 1e-3       # and training moved them
    assert (tmp_path / "fsdp" / "checkpoints" / "iter_000002" / "sharded" / ".metadata").is_file()  # DCP's format


def test_fsdp_resume_equals_a_straight_run(tmp_path):
    argv = [*tiny_argv("flow_grpo", "flux"), *SIZES, *RUNS["flow_grpo"], "--fsdp", "--ema"]  # the EMA is sharded too
    straight, split = tmp_path / "straight", tmp_path / "split"
    torchrun("flow_grpo.py", [*argv, "--iterations", "3", "--output-dir", str(straight)])
    torchrun("flow_grpo.py", [*argv, "--iterations", "1", "--output-dir", str(split)])
    torchrun("flow_grpo.py", [*argv, "--iterations", "3", "--output-dir", str(split), "--resume", str(split)])
    assert without_timings(read_metrics(straight)) == without_timings(read_metrics(split))
    a, b = transformer_at(straight, 3), transformer_at(split, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp_state_saved_on_2_ranks_loads_on_3(tmp_path):
    """The parameters, both AdamW moments, AdamW's step and the EMA (shadow and count) that 2 ranks save are what
    3 ranks load, element for element (full tensors gathered on both sides), and a checkpoint saved before the
    first optimizer step loads as one: AdamW without state."""
    script = tmp_path / "reshard.py"
    script.write_text(f"import sys\nfrom pathlib import Path\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
                      "import test_fsdp\ntest_fsdp.reshard(sys.argv[1], Path(sys.argv[2]))\n")
    torchrun(str(script), ["save", str(tmp_path)])
    torchrun(str(script), ["load", str(tmp_path)], nproc=3)
    assert (tmp_path / "loaded").read_text() == "3 ranks"


def full_state(params, optimizer, ema) -> dict:
    """Every tensor of the training state, gathered whole."""
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
    moments = {k: [full(optimizer.state[q][k]) for q in params] if optimizer.state else []
               for k in ("exp_avg", "exp_avg_sq", "step")}
    return {"params": [full(q.detach()) for q in params], **moments, "ema": [full(s) for s in ema.shadow],
            "ema_updates": ema.num_updates}


def reshard(mode: str, folder):
    """save: a checkpoint before any step, 2 AdamW + EMA steps of the toy model sharded on this run's ranks, a
    checkpoint, and the full states (saved.pt). load: both checkpoints into a fresh sharded model, optimizer and
    EMA, compared with saved.pt (the first leaves AdamW without state, as it was)."""
    rt = common.setup_runtime(0, 1)
    adapter = common.load_model("toy", rt)
    params = common.fully_shard_model(adapter.transformer, rt)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    ema = common.EMA(params, every=1)
    meta = {"trainer": "flow_grpo", "model": "toy", "lora_rank": 0, "lora_alpha": 0.0, "ema": True, "fsdp": True}
    if mode == "save":
        common.save_checkpoint(folder, 0, adapter, params, False, optimizer, ema, 0.5, meta, rt)  # no AdamW state yet
        start = full_state(params, optimizer, ema)
        for step in range(2):
            for q in params:
                q.grad = torch.sin(7 * q.detach() + step)
            optimizer.step()
            ema.step(step)
        common.save_checkpoint(folder, 2, adapter, params, False, optimizer, ema, 12.5, meta, rt)
        state = full_state(params, optimizer, ema)
        if rt.is_main:
            torch.save({"start": start, **state}, folder / "saved.pt")
    else:
        saved, fresh = torch.load(folder / "saved.pt"), full_state(params, optimizer, ema)
        assert not any(torch.equal(a, b) for a, b in zip(saved["params"], fresh["params"]))  # something to load
        assert all(m.abs().sum() > 0 for m in saved["exp_avg"] + saved["exp_avg_sq"]) and saved["ema_updates"] == 2
        assert not any(torch.equal(a, b) for a, b in zip(saved["ema"], saved["params"]))
        assert common.load_checkpoint(folder / "checkpoints" / "iter_000000", params, optimizer, ema) == 0.5
        start, now = saved.pop("start"), full_state(params, optimizer, ema)
        assert not optimizer.state and now["ema_updates"] == start["ema_updates"] == 0       # AdamW still fresh
        assert all(torch.equal(a, b) for key in ("params", "ema") for a, b in zip(now[key], start[key], strict=True))
        checkpoint = folder / "checkpoints" / "iter_000002"
        assert common.load_checkpoint(checkpoint, params, optimizer, ema) == 12.5
        loaded = full_state(params, optimizer, ema)
        assert loaded.keys() == saved.keys() and loaded["ema_updates"] == 2
        for key in ("params", "exp_avg", "exp_avg_sq", "step", "ema"):
            assert len(loaded[key]) == len(saved[key]) == len(params), key
            assert all(torch.equal(a, b) for a, b in zip(loaded[key], saved[key])), key
        if rt.is_main:
            (folder / "loaded").write_text(f"{rt.world_size} ranks")
    common.cleanup_runtime()


def test_fsdp_refuses_lora_a_single_process_and_a_mismatched_checkpoint(tmp_path):
    with pytest.raises(common.UsageError, match="--fsdp shards full fine-tuning over torchrun processes"):
        run(flow_grpo, [*tiny_argv("flow_grpo", "flux"), "--fsdp", "--output-dir", str(tmp_path / "a")])  # LoRA rank 4
    with pytest.raises(common.UsageError, match="launch 2\\+ processes"):
        run(flow_grpo, [*tiny_argv("flow_grpo", "flux"), "--lora-rank", "0", "--fsdp",
                        "--output-dir", str(tmp_path / "b")])
    ckpt = tmp_path / "c" / "checkpoints" / "iter_000001"
    ckpt.mkdir(parents=True)
    meta = {"trainer": "flow_grpo", "model": "flux", "lora_rank": 0, "lora_alpha": 0.0, "ema": False}
    (ckpt / "checkpoint.json").write_text(json.dumps({**meta, "fsdp": True, "iteration": 1}))
    with pytest.raises(common.UsageError, match="was trained with --fsdp: pass --fsdp to resume it"):
        common.check_checkpoint(ckpt, {**meta, "fsdp": False})
    assert common.check_checkpoint(ckpt, {**meta, "fsdp": True}) == 1

