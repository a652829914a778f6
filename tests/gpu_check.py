"""The full-scale check: a --preflight run of every trainer on FLUX.1-dev's and SD3.5-Medium's published
architectures with random weights (`--model-path random`, common.build_pipeline: nothing is downloaded), scored by
a random-weight reward model of PickScore's architecture (CLIP ViT-H/14) registered as `pickscore`, so every cost
is real and no reward means anything (its checks FAIL or WARN, as they should). One table of what each preflight
measured in its one iteration (common.preflight): seconds, split into rollout / reward / update as the trainer logs
them, images scored per second and peak memory.

On a GPU, per model: each trainer at its full-scale settings (LoRA, gradient checkpointing, its per-GPU
micro-batch M and dtype) with one prompt per iteration and a reduced group (GROUPS below), at 512 px; then
flow_grpo without gradient checkpointing and flow_grpo under --compile (every trainer with --full; --compiled adds
the compiled runs alone). The measured iteration is its run's first (kernels may still warm up in it: its seconds err
high; a compiled run's also holds its compiles, whose seconds a column gives). Each model runs in its own worker
process; a run that breaks the CUDA context (e.g. an illegal memory access) is recorded with its error, and the same
trainer is retried without gradient checkpointing and with the flash attention kernel off, to show which setting
avoids it.
On CPU the same runs, in the same dtypes (FLUX bf16, SD3 fp16), use the reduced-depth models (random:1 for FLUX,
random:2 for SD3: real widths), 64 px, 32 T5 tokens, micro-batch 1, 4 sampling and evaluation steps, 4 evaluation
images, with checkpointing only and eager unless --compiled: this keeps the path working (a slow test runs it); its
times mean nothing.

  python tests/gpu_check.py --quick            # meant to fit 8 minutes on one H200 (not yet timed there)
  python tests/gpu_check.py --full             # every trainer with and without checkpointing, and compiled
  python tests/gpu_check.py --compiled         # every trainer with checkpointing, eager and compiled
  python tests/gpu_check.py --models sd3 --trainers flow_grpo,g2rpo    # a subset
  python tests/gpu_check.py --computed         # no run: the memory every full-scale run needs before activations
  python tests/gpu_check.py --layouts          # no run: each model's memory per layout (LoRA, full, full + FSDP2)
  python tests/gpu_check.py --precision        # the tiny pipelines in fp32, bf16, fp16: is the first update on-policy?
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from helpers import TRAINERS, lora_targets  # noqa: E402  (found by their marker: a fork joins flow_grpo's group)
FAMILIES = ["flux", "sd3", "flux2"]
CPU_DEPTH = {"flux": "random:1", "sd3": "random:2", "flux2": "random:1"}  # the CPU mode's reduced depths
CUDA_BROKEN = ("CUDA error", "illegal memory access", "CUBLAS_STATUS", "cuDNN error")

def two_micro_batches(M):
    return ["--group-size", 2 * M]


# The reduced group, in units of the trainer's micro-batch M (its per-GPU batch at full scale): two micro-batches
# per prompt, so every trainer's update splits as at full scale (any trainer not listed: two_micro_batches).
# Pro-GRPO expands 4M and prunes to 3M, then 2M; G2RPO branches M ways at 8 sampling steps (its 16-step,
# 12-branch rollout alone takes minutes per prompt).
GROUPS = {
    "pro_grpo": lambda M: ["--group-size", 4 * M, "--funnel", f"{3 * M},{2 * M}", "--baseline-group", 2 * M],
    "g2rpo": lambda M: ["--group-size", max(2, M), "--sample-steps", 8],
}
# CLIP ViT-H/14's published config (laion/CLIP-ViT-H-14-laion2B-s32B-b79K, PickScore_v1's architecture)
CLIP_H = {"text_config": dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                              num_attention_heads=16, hidden_act="gelu", projection_dim=1024),
          "vision_config": dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                                image_size=224, patch_size=14, hidden_act="gelu", projection_dim=1024),
          "projection_dim": 1024}
# CLIP ViT-L/14's (openai/clip-vit-large-patch14: clipscore, and the aesthetic predictor's image tower)
CLIP_L = {"text_config": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                              num_attention_heads=12, hidden_act="quick_gelu", projection_dim=768),
          "vision_config": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                                image_size=224, patch_size=14, hidden_act="quick_gelu", projection_dim=768),
          "projection_dim": 768}
# The preflight rows that FAIL, as they should, on the random-weight scorer: it reads no prompt. Any other FAIL, or a
# run that did not finish, is a finding: the check exits with status 1.
RANDOM_WEIGHT_FAILS = {"pickscore: right vs shifted prompts"}


# ---- one run, inside a worker ----
def trainer_argv(trainer: str, family: str, ckpt: bool, gpu: bool, out: Path) -> list[str]:
    """The command line of one run: the trainer's full-scale defaults for `family`, resized as above."""
    module = importlib.import_module(trainer)
    M = module.MODEL_DEFAULTS[family]["micro_batch"] if gpu else 1
    argv = ["--model", family, "--model-path", "random" if gpu else CPU_DEPTH[family],
            "--eval-every", 0, "--save-every", 0, "--dtype", common.GPU_DTYPES[family],  # on a CPU too
            "--prompts", "pickscore",  # shipped: hpdv2 may not be cached
            "--prompts-per-step", 1, "--micro-batch", M, "--output-dir", out,
            "--gradient-checkpointing" if ckpt else "--no-gradient-checkpointing",
            *GROUPS.get(trainer, two_micro_batches)(M)]
    if module.MODEL_DEFAULTS[family].get("fsdp"):  # one GPU: the LoRA alternative to a sharded full fine-tune
        argv += ["--no-fsdp", "--lora-rank", 64, "--lora-alpha", 128, "--lr", 1e-4]
    if gpu:
        argv += ["--resolution", 512]
    else:
        argv += ["--resolution", 64, "--max-sequence-length", 32, "--threads", 2, "--eval-images", 4, "--eval-steps", 4]
        if "--sample-steps" not in argv:
            argv += ["--sample-steps", 4]
        argv += ["--checkpoints", "2,3"] if trainer == "pro_grpo" else []
    return [str(a) for a in argv]


def clip_h(layers: int | None = None, config: dict = CLIP_H):
    """A transformers CLIPModel of CLIP_H's architecture (or `config`'s), random weights (on the current default
    device); `layers` per tower if given."""
    from transformers import CLIPConfig, CLIPModel
    depth = {"num_hidden_layers": layers} if layers else {}
    return CLIPModel(CLIPConfig(text_config={**config["text_config"], **depth},
                                vision_config={**config["vision_config"], **depth},
                                projection_dim=config["projection_dim"]))


def scorer_params(name: str) -> int:
    """The parameters of registry scorer `name` at its published size (built on meta; GOT-OCR 2.0 by its published
    count); 0 for the rule-based ones and a remote scorer, which holds no memory here."""
    import torch
    with torch.device("meta"):
        if name in ("pickscore", "hpsv2", "clipscore-h"):                   # CLIP-H and fine-tunes of it
            return sum(p.numel() for p in clip_h().parameters())
        if name in ("clipscore", "aesthetic"):
            clip = clip_h(config=CLIP_L)
            towers = [clip] if name == "clipscore" else [clip.vision_model, clip.visual_projection]
            head = sum(a * b + b for a, b in zip([768, 1024, 128, 64, 16], [1024, 128, 64, 16, 1]))
            return sum(p.numel() for m in towers for p in m.parameters()) + (head if name == "aesthetic" else 0)
    return 561_000_000 if name == "ocr" else 0


def findings(results: list[dict]) -> list[str]:
    """What makes the check fail: each run that did not finish, each preflight FAIL not in RANDOM_WEIGHT_FAILS."""
    return [f"{r['model']} {r['trainer']}{'' if r['ckpt'] else ' (no checkpointing)'}"
            f"{' (compiled)' if r.get('compiled') else ''}: {what}" for r in results
            for what in ([r["status"]] if r["status"] != "ok" else
                         [f"preflight FAIL {f}" for f in r["preflight_fails"] if f not in RANDOM_WEIGHT_FAILS])]


def random_pickscore():
    """PickScore's scorer (its preprocessing, logit and scale) on clip_h with random weights: full depth on a GPU,
    one layer per tower on CPU; common's offline CLIP tokenizer. The workers register it as the reward "pickscore"."""
    import torch
    from transformers import CLIPTokenizer

    import common

    class RandomPickScore(common.PickScore):

        def __init__(self, device="cpu"):  # builds instead of downloading (no super().__init__)
            self.device, self.dtype, self.max_length = torch.device(device), torch.float32, 77
            with torch.device(device):
                self.model = clip_h(None if self.device.type == "cuda" else 1).eval().requires_grad_(False)
            self.tokenizer = CLIPTokenizer.from_pretrained(common.ARCHITECTURES / "flux" / "tokenizer")
            self.image_config = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224},
                                 "image_mean": [0.48145466, 0.4578275, 0.40821073],
                                 "image_std": [0.26862954, 0.26130258, 0.27577711]}
    return RandomPickScore


def one_run(family: str, trainer: str, ckpt: bool, flash: bool, compiled: bool, gpu: bool, out: Path) -> dict:
    """One --preflight run of `trainer` (trainer_argv); its preflight.json gives the columns."""
    import torch

    import common
    torch.backends.cuda.enable_flash_sdp(flash)
    module = importlib.import_module(trainer)
    run_dir = out / (f"{family}-{trainer}-{'ckpt' if ckpt else 'nockpt'}{'' if flash else '-noflash'}"
                     f"{'-compiled' if compiled else ''}")
    args = common.cli(module.Args, [*trainer_argv(trainer, family, ckpt, gpu, run_dir), "--reward", "pickscore",
                                    "--preflight", *(["--compile"] if compiled else [])], module.MODEL_DEFAULTS)
    gc.collect()                                                  # the last run's models (adapters hold cycles)
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        module.main(args)
    except common.TrainingStopped:                                # the preflight's own stop, exit 0 or 1
        if not (run_dir / "preflight.json").exists():
            raise
    report = json.loads((run_dir / "preflight.json").read_text())
    m, line = report["measured"], report["metrics"]
    fails = [r["check"] for r in report["rows"] if r["status"] == "FAIL"]
    return {"model": family, "trainer": trainer, "ckpt": ckpt, "flash": flash, "compiled": compiled, "status": "ok",
            "resolution": args.resolution, "group": args.group_size, "micro_batch": args.micro_batch,
            "lora_rank": args.lora_rank, "dtype": args.dtype, "sample_steps": args.sample_steps,
            "peak_gib": m["peak_bytes"] / 2**30, "s_per_it": m["iteration_s"],
            "t_rollout": line["t_rollout"] + line.get("t_surrogate_old", 0.0), "t_reward": line["t_reward"],
            "t_update": line["t_update"], "compile_s": line.get("compile_s"),
            "images_per_s": line["reward_calls"] / m["iteration_s"],
            "nfe_fwd": line["nfe_fwd"], "nfe_fwd_bwd": line["nfe_fwd_bwd"], "preflight_fails": fails}


def worker(family: str, runs: list[list], gpu: bool, out: Path):
    """Runs `runs` ([trainer, ckpt, flash, compiled]) in this process, appending each result to out/results.jsonl;
    exits 3 once the CUDA context is broken (the parent starts a new worker for the rest)."""
    import common
    common.REWARDS["pickscore"] = random_pickscore()             # every run scores with it: --reward pickscore
    for trainer, ckpt, flash, compiled in runs:
        try:
            result = one_run(family, trainer, ckpt, flash, compiled, gpu, out)
        except Exception as e:  # noqa: BLE001 - recorded in the table, then the next run
            result = {"model": family, "trainer": trainer, "ckpt": ckpt, "flash": flash, "compiled": compiled,
                      "status": f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        if any(s in result["status"] for s in CUDA_BROKEN):
            sys.exit(3)


# ---- the parent: plans the runs, restarts workers, prints the table ----
def plan(trainers: list[str], full: bool, gpu: bool, compiled: bool = False) -> list[list]:
    """[trainer, checkpointing, flash attention, --compile] per run: every trainer with checkpointing; without it,
    and with it under --compile, flow_grpo on a GPU (every trainer with --full; compiled, with --compiled)."""
    runs = [[t, True, True, False] for t in trainers]
    runs += [[t, False, True, False] for t in trainers if full or (gpu and t == "flow_grpo")]
    return runs + [[t, True, True, True] for t in trainers if full or compiled or (gpu and t == "flow_grpo")]


def run_family(family: str, runs: list[list], a, out: Path) -> list[dict]:
    """Runs the family's runs in workers, a new worker after one dies; a run that broke CUDA gets its
    fallbacks queued (no checkpointing; no flash attention)."""
    results, todo = [], list(runs)
    while todo:
        before = len(read_results(out))
        cmd = [sys.executable, __file__, "--worker", family, "--runs", json.dumps(todo), "--out", str(out)] + \
            (["--cpu"] if a.cpu else [])
        proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
        new = read_results(out)[before:]
        if proc.returncode and len(new) < len(todo) and (not new or new[-1]["status"] == "ok"):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
            trainer, ckpt, flash, compiled = todo[len(new)]
            new.append({"model": family, "trainer": trainer, "ckpt": ckpt, "flash": flash, "compiled": compiled,
                        "status": f"error: worker died (exit {proc.returncode}): {tail}"})
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(new[-1]) + "\n")
        results += new
        todo = todo[len(new):]
        for r in new:
            if r["status"] != "ok" and any(s in r["status"] for s in (*CUDA_BROKEN, "worker died")):
                for fallback in ([r["trainer"], False, True, r["compiled"]], [r["trainer"], r["ckpt"], False,
                                                                               r["compiled"]]):
                    if fallback not in runs and fallback != [r["trainer"], r["ckpt"], r["flash"], r["compiled"]]:
                        runs.append(fallback)
                        todo.append(fallback)
    return results


def read_results(out: Path) -> list[dict]:
    path = out / "results.jsonl"
    return [json.loads(s) for s in path.read_text().splitlines()] if path.exists() else []


def markdown(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |"
                                                                                  for r in rows])


def versions() -> str:
    import diffusers
    import torch
    import transformers
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    cuda = f" cuda {torch.version.cuda}" if torch.cuda.is_available() else ""
    return (f"{time.strftime('%Y-%m-%d')}, {device}, torch {torch.__version__}{cuda}, diffusers "
            f"{diffusers.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}")


def table(results: list[dict]) -> str:
    head = ["model", "trainer", "checkpointing", "--compile (s compiling)", "px", "group (M)", "LoRA", "dtype",
            "peak GiB", "s/it", "rollout",
            "reward", "update", "img/s", "status", "preflight FAILs"]
    rows = []
    for r in results:
        ok = r["status"] == "ok"

        def f(key, digits=2, r=r, ok=ok):
            return f"{r[key]:.{digits}f}" if ok and r.get(key) is not None else "-"
        compiled = (f"on ({f('compile_s', 0)})" if r.get("compiled") else "off")
        rows.append([r["model"], r["trainer"], ("on" if r["ckpt"] else "off") + ("" if r["flash"] else ", no flash"),
                     compiled, str(r.get("resolution", "-")), f"{r['group']} ({r['micro_batch']})" if ok else "-",
                     str(r.get("lora_rank", "-")), r.get("dtype", "-"), f("peak_gib", 1), f("s_per_it"),
                     f("t_rollout"), f("t_reward"), f("t_update"), f("images_per_s"), r["status"],
                     ", ".join(r["preflight_fails"]) or "none" if ok else "-"])
    return markdown(head, rows)


# ---- --computed: what a full-scale run holds before activations ----
def computed(trainers: list[str]) -> str:
    """Per model and trainer at its full-scale defaults, from the published architectures built on `meta`: the
    frozen weights in their dtypes, the trained parameters with their gradient, AdamW moments and EMA in float32
    (under FSDP2 divided over 8 GPUs), a frozen reference copy under full fine-tuning with a KL (float32 unless
    sharded), and each scorer of the trainer's default --reward in float32 (scorer_params). Then an estimate of the
    activations of one forward+backward under gradient checkpointing (every trainer backpropagates one forward at a
    time): each block keeps its input, R rows x (image + text tokens) x width in 16-bit, and the block being
    recomputed holds about 16 times that; R is the rows of a training forward (the micro-batch; x2 for SD3's CFG; x
    the (t, eps) pairs for V-GRPO)."""
    import torch

    import common
    head = ["model", "trainer", "GPUs", "px", "prompts x group (M)", "LoRA, dtype", "frozen weights",
            "trained + grad + AdamW (+ EMA)", "reference", "reward models", "before activations",
            "with --offload-encoders", "activations, checkpointed (estimate)", "peak",
            "s/it, img/s per GPU", "source"]
    rows = []
    for family in FAMILIES:
        for trainer in trainers:
            module = importlib.import_module(trainer)                # the settings `--model family` runs
            d = vars(common.cli(module.Args, ["--model", family], module.MODEL_DEFAULTS))
            d["dtype"] = d["dtype"] or common.GPU_DTYPES[family]     # a GPU's default
            dtype = common.DTYPES[d["dtype"]]
            pipe = common.build_pipeline(family, common.architecture(family), device="meta", dtype=dtype)
            transformer = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
            text = sum(p.numel() * p.element_size() for name, m in pipe.components.items()
                       if name.startswith("text_encoder") for p in m.parameters())
            frozen = sum(p.numel() * p.element_size() for m in pipe.components.values()
                         if isinstance(m, torch.nn.Module) for p in m.parameters())
            reference = reference_bytes(pipe.transformer, dtype)  # before a LoRA wraps its linear layers
            trained = common.add_lora(pipe.transformer, d.get("lora_rank", 0), d.get("lora_alpha", 1),
                                      lora_targets(family, pipe.transformer))
            n = sum(p.numel() for p in trained)
            full = d.get("lora_rank", 0) == 0                      # the transformer is the trained state
            ema_here = d.get("ema") and (not full or d.get("fsdp"))  # full, unsharded: the EMA in CPU memory
            state = n * 4 * (4 + bool(ema_here))                   # param (fp32 master), grad, 2 moments, EMA
            frozen -= transformer if full else 0
            ref = (transformer if d.get("fsdp") else reference) if full and d.get("beta", 0) > 0 else 0
            gpus = 8 if d.get("fsdp") else 1                       # FSDP2 shards the state over one node's 8
            state, ref = state / gpus, ref / gpus
            gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
            scorers = [name for name, _ in common.parse_reward_spec(d["reward"])]
            reward = sum(scorer_params(name) for name in scorers) * 4
            cfg = 2 if family != "flux" and d.get("guidance_scale", 1) > 1 else 1
            rows_grad = d["micro_batch"] * cfg * d.get("mc_pairs", 1)
            config = pipe.transformer.config
            tokens = (d["resolution"] // 16) ** 2 + (77 + 128 if family == "sd3" else 512)
            width = config.num_attention_heads * config.attention_head_dim
            blocks = len(common.transformer_blocks(pipe.transformer))
            activations = rows_grad * tokens * width * 2 * (blocks + 16)
            rows.append([family, trainer, "8 (FSDP2)" if d.get("fsdp") else "any (DDP)", str(d["resolution"]),
                         f"{d['prompts_per_step']} x {d['group_size']} ({d['micro_batch']})",
                         f"{d.get('lora_rank') or 'full'}, {d['dtype']}", gib(frozen),
                         f"{gib(state)} ({n / 1e6:.0f}M)", gib(ref) if ref else "-",
                         f"{gib(reward)} ({', '.join(scorers)})",
                         gib(frozen + state + ref + reward), gib(frozen - text + state + ref + reward),
                         f"{gib(activations)} ({rows_grad} rows)", "unmeasured",
                         "unmeasured", "computed"])
    return markdown(head, rows)


def reference_bytes(transformer, dtype) -> int:
    """A full fine-tune's KL reference without FSDP2: linear weights in the compute dtype, the rest float32."""
    import torch
    linear = {id(m.weight) for m in transformer.modules() if type(m) is torch.nn.Linear}
    return sum(p.numel() * (torch.finfo(dtype).bits // 8 if id(p) in linear else 4) for p in transformer.parameters())


def layouts() -> str:
    """Per model, in its GPU dtype, the bytes each layout holds per GPU before activations and reward models: the
    trained state (float32 weights, gradient and AdamW's two moments: 16 bytes a parameter; the LoRA's at the model's
    full-scale rank), the EMA (4 bytes a parameter, --ema; in CPU memory under full fine-tuning without --fsdp), a KL
    reference (--beta > 0: under full fine-tuning a frozen copy of the transformer, its linear weights in the compute
    dtype without --fsdp, sharded in the loaded dtype with it; under LoRA the same network with the adapter off), the
    frozen weights (the text encoders and VAE, and the transformer under LoRA). FSDP2 shards over 8 GPUs; without it
    every process holds everything."""
    import torch

    import common
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    rows = []
    for family in FAMILIES:
        module = importlib.import_module("flow_grpo")
        d = vars(common.cli(module.Args, ["--model", family], module.MODEL_DEFAULTS))
        dtype = common.DTYPES[common.GPU_DTYPES[family]]
        pipe = common.build_pipeline(family, common.architecture(family), device="meta", dtype=dtype)
        n = sum(p.numel() for p in pipe.transformer.parameters())
        loaded = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
        rest = sum(p.numel() * p.element_size() for name, m in pipe.components.items()
                   if isinstance(m, torch.nn.Module) and name != "transformer" for p in m.parameters())
        reference = reference_bytes(pipe.transformer, dtype)
        lora = sum(p.numel() for p in common.add_lora(pipe.transformer, d["lora_rank"], d["lora_alpha"],
                                                      lora_targets(family, pipe.transformer)))
        for layout, trained, gpus, ref in [(f"LoRA r{d['lora_rank']} (DDP)", lora, 1, 0),
                                           ("full, no --fsdp (DDP)", n, 1, reference),
                                           ("full, --fsdp over 8", n, 8, loaded)]:
            frozen = rest + (loaded if trained == lora else 0)
            state, ref = trained * 16 / gpus, ref / gpus
            ema = 0 if "no --fsdp" in layout else trained * 4 / gpus         # full, unsharded: in CPU memory
            rows.append([family, common.GPU_DTYPES[family], layout, f"{trained / 1e6:,.0f}M", gib(state),
                         gib(ema) if ema else f"({gib(trained * 4)} in CPU memory)",
                         gib(ref) if ref else "- (adapter off)", gib(frozen),
                         gib(state + frozen), gib(state + ema + ref + frozen)])
    return markdown(["model", "dtype", "layout", "trained parameters", "weights + grad + AdamW", "EMA",
                     "KL reference", "frozen weights", "total, no EMA nor KL", "total, with both"], rows)


def one_gpu(family: str = "flux2", trainer: str = "flow_grpo") -> str:
    """`family` on one GPU in its GPU dtype, as computed() counts (the trainer's defaults: a LoRA; full fine-tuning
    with --lora-rank 0), at 512 and 1024 px: each layout's bytes per trained parameter and GiB per part, with an EMA
    and a KL reference (full fine-tuning: the EMA in CPU memory, the reference's linear weights in the compute dtype)
    and the default reward's scorers in float32, the text encoder on the GPU (or off it: --offload-encoders), and the
    activations of a training forward under gradient checkpointing (computed's estimate) at the micro-batch given."""
    import common
    module = importlib.import_module(trainer)
    d = vars(common.cli(module.Args, ["--model", family], module.MODEL_DEFAULTS))
    dtype = common.DTYPES[common.GPU_DTYPES[family]]
    pipe = common.build_pipeline(family, common.architecture(family), device="meta", dtype=dtype)
    n, config = sum(p.numel() for p in pipe.transformer.parameters()), pipe.transformer.config
    loaded = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    text = sum(p.numel() * p.element_size() for name, m in pipe.components.items() if name.startswith("text_encoder")
               for p in m.parameters())
    vae = sum(p.numel() * p.element_size() for p in pipe.vae.parameters())
    reference = reference_bytes(pipe.transformer, dtype)
    lora = sum(p.numel() for p in common.add_lora(pipe.transformer, d["lora_rank"], d["lora_alpha"],
                                                  lora_targets(family, pipe.transformer)))
    reward = sum(scorer_params(name) for name, _ in common.parse_reward_spec(d["reward"])) * 4
    width, blocks = config.num_attention_heads * config.attention_head_dim, len(common.transformer_blocks(
        pipe.transformer))
    gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
    rows = []
    lora_layout = f"LoRA r{d['lora_rank']}"
    for layout, px, micro_batch, offload in [(lora_layout, 512, 8, False), (lora_layout, 1024, 8, False),
                                             ("full", 512, 4, True), ("full", 1024, 2, True)]:
        full = layout == "full"
        trained, per = (n, 16 + 2) if full else (lora, 16 + 4)  # + the reference's 2 bytes, or the EMA's 4
        frozen = vae + (0 if offload else text) + (0 if full else loaded)
        rows_grad = micro_batch * (2 if d["guidance_scale"] > 1 else 1)
        activations = rows_grad * ((px // 16) ** 2 + 512) * width * 2 * (blocks + 16)
        extra = reference if full else trained * 4               # the reference, or the LoRA's EMA
        total = trained * 16 + extra + frozen + reward + activations
        parts = "16 + reference 2; EMA 4 in CPU memory" if full else "16 + EMA 4"
        rows.append([layout, str(px), f"{micro_batch} ({rows_grad} rows)", "off" if offload else "on",
                     f"{trained / 1e6:,.0f}M", f"{per} ({parts})", gib(trained * 16), gib(extra), gib(frozen),
                     gib(reward), gib(activations), gib(total)])
    return markdown(["layout", "px", "micro-batch (CFG rows)", "text encoder on GPU", "trained parameters",
                     "GPU bytes per trained parameter", "weights + grad + AdamW", "EMA or reference", "frozen weights",
                     "reward model", "activations, checkpointed (estimate)", "total GiB"], rows)


def precision(trainers: list[str], families: list[str]) -> str:
    """The on-policy table: one iteration of each trainer on the tiny pipelines (tests/helpers.py) in each --dtype, on
    this machine's device: the first update's ratio deviation and clip fraction (0: it reproduces the rollout's
    log-probs), the second update's (the size of one optimizer step) and the rollout's mean reward."""
    import tempfile

    from helpers import read_metrics, run, tiny_argv
    keys = ["ratio_dev_first_update", "clip_frac_first_update", "ratio_dev_second_update", "reward_mean"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            for trainer in trainers:
                for dtype in common.DTYPES:
                    out = Path(tmp) / f"{family}-{trainer}-{dtype}"
                    argv = ["--dtype", dtype, "--iterations", "1", "--eval-every", "0", "--output-dir", str(out)]
                    run(importlib.import_module(trainer), [*tiny_argv(trainer, family), *argv])
                    m = read_metrics(out)[0]
                    rows.append([family, f"`{trainer}`", dtype, *(f"{m[k]:.3g}" if m.get(k) is not None else "-"
                                                                  for k in keys)])
    head = ["model", "trainer", "dtype", *(f"`{k}`" for k in keys)]
    return markdown(head, rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the default: every trainer with checkpointing, "
                                                           "flow_grpo without too on a GPU")
    ap.add_argument("--full", action="store_true", help="every trainer without checkpointing too, and compiled")
    ap.add_argument("--compiled", action="store_true", help="every trainer compiled too, with checkpointing")
    ap.add_argument("--models", default=",".join(FAMILIES), help="comma-separated: flux, sd3, flux2")
    ap.add_argument("--trainers", default=",".join(TRAINERS), help="comma-separated trainers")
    ap.add_argument("--out", default=None, help="output folder (default runs/gpu-check-<time>)")
    ap.add_argument("--cpu", action="store_true", help="the CPU mode even when a GPU is present")
    ap.add_argument("--computed", action="store_true", help="print the computed memory table and stop")
    ap.add_argument("--layouts", action="store_true", help="print the memory of each model's layouts (LoRA, full "
                                                             "fine-tuning with and without --fsdp) and stop")
    ap.add_argument("--precision", action="store_true", help="print the on-policy table of the tiny pipelines in each "
                                                               "dtype on this device and stop")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--runs", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    families = [m.strip() for m in a.models.split(",")]
    trainers = [t.strip() for t in a.trainers.split(",")]
    if bad := [m for m in families if m not in FAMILIES] + [t for t in trainers if t not in TRAINERS]:
        ap.error(f"unknown {bad}: --models takes {', '.join(FAMILIES)}; --trainers takes {', '.join(TRAINERS)}")
    if a.computed:
        print(computed(trainers))
        return None
    if a.layouts:
        print(f"{layouts()}\n\nFLUX.2-klein 4B on one GPU, flow_grpo's defaults (its LoRA, or --lora-rank 0), an EMA "
              f"and a KL reference:\n\n{one_gpu()}")
        return None
    if a.precision:
        print(f"Measured {versions()}; the tiny pipelines of tests/helpers.py, one iteration each.\n\n"
              f"{precision(trainers, families)}")
        return None
    import torch
    gpu = torch.cuda.is_available() and not a.cpu
    if a.worker:
        return worker(a.worker, json.loads(a.runs), gpu, Path(a.out))
    a.cpu = not gpu
    out = Path(a.out or f"runs/gpu-check-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if (out / "results.jsonl").exists():
        ap.error(f"--out {out} already holds a check; pass a new folder")
    out.mkdir(parents=True, exist_ok=True)
    tic = time.time()
    results = []
    for family in families:
        results += run_family(family, plan(trainers, a.full, gpu, a.compiled), a, out)
        print(f"{family}: {len(results)} runs done, {time.time() - tic:.0f} s", flush=True)
    mode = "full depth, 512 px" if gpu else "CPU: reduced depth (random:1 / random:2), 64 px; times mean nothing"
    text = f"Measured {versions()}; {mode}; one --preflight iteration per run.\n\n{table(results)}"
    print("\n" + text)
    (out / "gpu_check.md").write_text(text + "\n")
    print(f"\n{out}/gpu_check.md, {out}/results.jsonl; {time.time() - tic:.0f} s in all")
    if bad := findings(results):
        print("\nFAILED, not explained by random weights:\n" + "\n".join(bad))
    return results


if __name__ == "__main__":
    sys.exit(1 if findings(main() or []) else 0)
