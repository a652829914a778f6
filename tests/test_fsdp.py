"""--fsdp: full fine-tuning sharded with FSDP2 on 2 gloo ranks trains what DDP trains on the same global batch,
resumes exactly, on the same or another number of ranks and from a DDP checkpoint (one checkpoint format,
torch.distributed.checkpoint's, in both layouts), writes a transformer that from_pretrained reads, and refuses what
it cannot do."""
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


@pytest.mark.slow  # the default suite: a state saved in one layout loaded in another; FSDP2 in bf16 (test_precision)
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
    for run_dir in ("ddp", "fsdp"):                                             # DCP's format in both layouts
        assert (tmp_path / run_dir / "checkpoints" / "iter_000002" / "state" / ".metadata").is_file()


@pytest.mark.slow  # the default suite: a state saved in one layout loaded in another; FSDP2 in bf16 (test_precision)
def test_fsdp_resume_equals_a_straight_run(tmp_path):
    argv = [*tiny_argv("flow_grpo", "flux"), *SIZES, *RUNS["flow_grpo"], "--fsdp", "--ema"]  # the EMA is sharded too
    straight, split = tmp_path / "straight", tmp_path / "split"
    torchrun("flow_grpo.py", [*argv, "--iterations", "3", "--output-dir", str(straight)])
    torchrun("flow_grpo.py", [*argv, "--iterations", "1", "--output-dir", str(split)])
    torchrun("flow_grpo.py", [*argv, "--iterations", "3", "--output-dir", str(split), "--resume", str(split)])
    assert without_timings(read_metrics(straight)) == without_timings(read_metrics(split))
    # every iteration's first update on-policy after an evaluation of the EMA weights: FSDP2 keeps the root's weights
    # gathered after a forward, the EMA's until the evaluation reshards them
    assert [m["ratio_dev_first_update"] for m in read_metrics(straight)[:3]] == [0.0] * 3
    a, b = transformer_at(straight, 3), transformer_at(split, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # the default suite: a training state saved in one layout loads in another (below)
def test_a_ddp_checkpoint_resumes_under_fsdp_and_back(tmp_path):
    """Toy, full fine-tuning, 2 gloo ranks: 1 iteration under DDP, the 2nd resumed under --fsdp, the 3rd under DDP
    again, logs what 3 straight DDP iterations log (to float rounding: FSDP2 reduce-scatters where DDP all-reduces),
    from one checkpoint format."""
    argv = ["--lr", "1e-4", "--prompts-per-step", "4", "--group-size", "4", "--micro-batch", "4", "--sample-steps",
            "4", "--eval-images", "8", "--eval-steps", "4", "--eval-every", "1", "--threads", "1", "--beta", "0.01"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    torchrun("flow_grpo.py", [*argv, "--iterations", "3", "--output-dir", str(straight)])
    for iterations, layout in [(1, []), (2, ["--fsdp"]), (3, [])]:
        torchrun("flow_grpo.py", [*argv, *layout, "--iterations", str(iterations), "--output-dir", str(split),
                                  *(["--resume", str(split)] if iterations > 1 else [])])
    a, b = (without_timings(read_metrics(d)) for d in (straight, split))
    assert [m["iteration"] for m in b] == [0, 1, 2, 3] and [sorted(m) for m in a] == [sorted(m) for m in b]
    for ma, mb in zip(a, b):
        for key in ma:
            assert mb[key] == pytest.approx(ma[key], rel=1e-4, abs=1e-6), (key, ma[key], mb[key])
    assert max(abs(mb["loss"] - ma["loss"]) for ma, mb in zip(a[:3], b[:3])) < 1e-6


def test_a_training_state_saved_in_one_layout_loads_in_another(tmp_path):
    """The parameters, both AdamW moments, AdamW's step, the EMA shadow and a method's extra state that 2 ranks save,
    as FSDP2 shards and as the plain tensors DDP keeps, are what 3 ranks load as FSDP2 shards (from both) and one
    process as plain tensors (from the shards), element for element (full tensors on both sides); a checkpoint saved
    before the first optimizer step loads as one: AdamW without state."""
    script = tmp_path / "reshard.py"
    script.write_text(f"import sys\nfrom pathlib import Path\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
                      "import common, test_fsdp\nwith common.ends_process():\n"
                      "    test_fsdp.reshard(sys.argv[1], Path(sys.argv[2]))\n")
    torchrun(str(script), ["save", str(tmp_path)])
    torchrun(str(script), ["load", str(tmp_path)], nproc=3)
    assert (tmp_path / "loaded").read_text() == "3 ranks: fsdp from fsdp, fsdp from ddp"
    reshard("load-plain", tmp_path)                                # here, one process
    assert (tmp_path / "loaded").read_text() == "1 ranks: ddp from fsdp"


def full_state(params, optimizer, ema) -> dict:
    """Every tensor of the training state, gathered whole."""
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
    moments = {k: [full(optimizer.state[q][k]) for q in params] if optimizer.state else []
               for k in ("exp_avg", "exp_avg_sq", "step")}
    return {"params": [full(q.detach()) for q in params], **moments, "ema": [full(s) for s in ema.shadow]}


def toy_state(rt, layout: str):
    """The toy model fully fine-tuned in `layout` (fsdp: FSDP2 shards; ddp: plain tensors, as DDP keeps them), its
    AdamW and EMA."""
    adapter = common.load_model("toy", rt)
    params = common.full_finetuning(adapter.transformer, rt, shard=True) if layout == "fsdp" else \
        common.add_lora(adapter.transformer, 0, 0.0, [])
    return adapter, params, torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), common.EMA(params, every=1)


def reshard(mode: str, folder):
    """save: for each layout, a checkpoint before any step, 2 AdamW + EMA steps of the toy model on this run's ranks,
    a checkpoint with the weights before the steps as extra state, and the full states (saved.pt), in
    folder/<layout>. load (FSDP2) and load-plain (plain tensors, from the FSDP2 checkpoint): both checkpoints into a
    fresh model, optimizer, EMA and zeroed extra state, compared with saved.pt (the first leaves AdamW without state,
    as it was)."""
    rt = common.setup_runtime(0, 1)
    meta = {"trainer": "flow_grpo", "model": "toy", "lora_rank": 0, "lora_alpha": 0.0, "ema": True, "run": "r"}
    done = []
    for saved_as in ("fsdp", "ddp") if mode != "load-plain" else ("fsdp",):
        layout = saved_as if mode == "save" else "fsdp" if mode == "load" else "ddp"
        adapter, params, optimizer, ema = toy_state(rt, layout)
        where = folder / saved_as
        if mode == "save":
            if rt.is_main:                                                  # a run folder holds its log
                where.mkdir(parents=True)
                (where / "metrics.jsonl").write_text('{"iteration": 0}\n')
            common.save_checkpoint(where, 0, adapter, params, False, optimizer, ema, 0.5, meta, rt)  # no AdamW state
            start = full_state(params, optimizer, ema)
            old = [q.detach().clone() for q in params]                  # in the layout's own kind of tensor
            for step in range(2):
                for q in params:
                    q.grad = torch.sin(7 * q.detach() + step)
                optimizer.step()
                ema.step(step)
            common.save_checkpoint(where, 2, adapter, params, False, optimizer, ema, 12.5, meta, rt, {"old": old})
            state = full_state(params, optimizer, ema)                          # collective: every rank
            if rt.is_main:
                torch.save({"start": start, **state}, where / "saved.pt")
            continue
        saved, fresh = torch.load(where / "saved.pt"), full_state(params, optimizer, ema)
        assert not any(torch.equal(a, b) for a, b in zip(saved["params"], fresh["params"]))  # something to load
        assert all(m.abs().sum() > 0 for m in saved["exp_avg"] + saved["exp_avg_sq"])
        assert not any(torch.equal(a, b) for a, b in zip(saved["ema"], saved["params"]))
        assert common.load_checkpoint(where / "checkpoints" / "iter_000000", params, optimizer, ema) == 0.5
        start, now = saved.pop("start"), full_state(params, optimizer, ema)
        assert not optimizer.state                                                         # AdamW still fresh
        assert all(torch.equal(a, b) for key in ("params", "ema") for a, b in zip(now[key], start[key], strict=True))
        old = [torch.zeros_like(q.detach()) for q in params]
        extra = {"old": old}
        assert common.load_checkpoint(where / "checkpoints" / "iter_000002", params, optimizer, ema, extra) == 12.5
        loaded = full_state(params, optimizer, ema)
        old = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in old]
        assert all(torch.equal(a, b) for a, b in zip(old, start["params"], strict=True))
        assert loaded.keys() == saved.keys()
        for key in ("params", "exp_avg", "exp_avg_sq", "step", "ema"):
            assert len(loaded[key]) == len(saved[key]) == len(params), key
            assert all(torch.equal(a, b) for a, b in zip(loaded[key], saved[key])), key
        done.append(f"{layout} from {saved_as}")
    if rt.is_main and done:
        (folder / "loaded").write_text(f"{rt.world_size} ranks: {', '.join(done)}")


def test_fsdp_refuses_lora_and_a_single_process(tmp_path):
    with pytest.raises(common.UsageError, match="--fsdp shards full fine-tuning over torchrun processes"):
        run(flow_grpo, [*tiny_argv("flow_grpo", "flux"), "--fsdp", "--output-dir", str(tmp_path / "a")])  # LoRA rank 4
    with pytest.raises(common.UsageError, match="launch 2\\+ processes"):
        run(flow_grpo, [*tiny_argv("flow_grpo", "flux"), "--lora-rank", "0", "--fsdp",
                        "--output-dir", str(tmp_path / "b")])

