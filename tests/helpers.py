"""Shared test utilities: tiny diffusers pipelines loaded like a saved model, run a trainer in-process with small
sizes."""
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import common

ROOT = Path(__file__).resolve().parents[1]


def find_trainers(root: Path = ROOT) -> list[str]:
    """The trainers: the top-level files carrying the shared-block marker (a forked method joins by being there),
    as module names, the baseline flow_grpo first."""
    names = sorted(p.stem for p in root.glob("*.py") if "# >>> shared: args" in p.read_text())
    return sorted(names, key=lambda name: name != "flow_grpo")


TRAINERS = find_trainers()

# FLUX.1-dev's, SD3.5-Medium's and FLUX.2-klein's structure (guidance embedding, CLIP + T5, dynamic shift; two CLIPs +
# T5, qk-norm, dual attention; Qwen3, 128-channel tokens, a batch-norm VAE) at a few thousand parameters: the sizes set
# over common.architecture's configs (`tiny_configs`).
TINY_CONFIGS = {
    "flux": {
        "transformer": dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                            guidance_embeds=True, axes_dims_rope=(4, 6, 6)),
        "text_encoder": dict(hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2,
                             num_attention_heads=4),
        "text_encoder_2": dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                               relative_attention_max_distance=32, feed_forward_proj="gated-gelu"),
        "vae": dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=16, norm_num_groups=4,
                    sample_size=64, scaling_factor=0.3611, shift_factor=0.1159),
    },
    "sd3": {
        "transformer": dict(sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=96, caption_projection_dim=32,
                            pooled_projection_dim=80, out_channels=16, pos_embed_max_size=32,
                            dual_attention_layers=(0,), qk_norm="rms_norm"),
        "text_encoder": dict(hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2,
                             num_attention_heads=4),
        "text_encoder_2": dict(hidden_size=48, intermediate_size=96, projection_dim=48, num_hidden_layers=2,
                               num_attention_heads=4),
        "text_encoder_3": dict(d_model=96, d_kv=8, d_ff=192, num_layers=2, num_heads=12,
                               relative_attention_num_buckets=8, relative_attention_max_distance=32,
                               feed_forward_proj="gated-gelu"),
        "vae": dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=16, norm_num_groups=4,
                    sample_size=64, scaling_factor=1.5305, shift_factor=0.0609),
    },
    "flux2": {  # a text encoder of 28 layers: the pipeline reads the hidden states after layers 9, 18 and 27
        "transformer": dict(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=16,
                            axes_dims_rope=(4, 4, 4, 4)),
        "text_encoder": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=28, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=8, bos_token_id=None, eos_token_id=None),
        "vae": dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                    sample_size=64),
    },
}

# The smoke-run sizes of a run on a tiny pipeline, set over the trainer's flux / sd3 table (`tiny_argv`).
SMOKE = {
    "reward": "jpeg",
    "prompts": str(common.ASSETS / "prompts.txt"),
    "iterations": 2,
    "eval_every": 1,
    "eval_images": 4,
    "eval_steps": 4,
    "resolution": 32,
    "prompts_per_step": 2,
    "group_size": 2,
    "micro_batch": 2,
    "sample_steps": 4,
    "lora_rank": 4,
    "lora_alpha": 8,
    "ema": False,
    "gradient_checkpointing": False,
    "fsdp": False,
    "threads": 1,
}
_PIPELINES = {}


def own(trainer: str, table: str, default=None):
    """A table of the trainer's own test file, tests/test_<trainer>.py (`default`, else [], without the file or the
    table): what a method needs on top of the tests' sizes (FITS_SMOKE over SMOKE, FITS_SMALL over SMALL) and the
    start-up rows of its flags travel with its test file, so a fork's copy of it brings them."""
    import importlib
    default = [] if default is None else default
    try:
        module = importlib.import_module(f"test_{trainer}")
    except ModuleNotFoundError as e:
        if e.name != f"test_{trainer}":
            raise
        return default
    return getattr(module, table, default)


def tiny_configs(family: str) -> dict:
    """The published `family` configs with TINY_CONFIGS' sizes, the text encoders' vocabularies cut to the
    tokenizers' own (the assets' tokenizers know a few hundred tokens)."""
    configs = common.architecture(family)
    for name, sizes in TINY_CONFIGS[family].items():
        configs[name].update(sizes)
        if name.startswith("text_encoder"):
            configs[name]["vocab_size"] = len(tokenizer(family, name.replace("text_encoder", "tokenizer")))
    return configs


# Qwen3's chat template for what FLUX.2-klein's pipeline asks of it: user messages, the generation prompt, and the empty
# thinking block that enable_thinking=False adds.
QWEN3_CHAT_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                       "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
                       "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is "
                       "false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def qwen_tokenizer():
    """A byte-level Qwen2 tokenizer built in code: Qwen's 256 byte symbols (no merges, so every byte is a token), its
    special tokens and QWEN3_CHAT_TEMPLATE. assets/architectures/flux2/tokenizer is this, saved with save_pretrained
    (test_models holds the two equal): FLUX.2-klein's offline pipelines tokenize as the real one, byte by byte."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], chat_template=QWEN3_CHAT_TEMPLATE, model_max_length=131072)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]})
    return tok


def lora_targets(family: str, transformer) -> list[str]:
    """The LoRA targets the `family` adapter gives `transformer` (FLUX.2's name each single block's output), for a
    transformer without its adapter (built on meta, say)."""
    import types
    cls = {"flux": common.FluxAdapter, "sd3": common.SD3Adapter, "flux2": common.Flux2Adapter}[family]
    targets = cls.__dict__["lora_targets"]
    return targets.fget(types.SimpleNamespace(transformer=transformer)) if isinstance(targets, property) else targets


def tokenizer(family: str = "flux", name: str = "tokenizer"):
    """One of the assets' tokenizers of common.build_pipeline (CLIP's by default)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(common.ARCHITECTURES / family / name)


def tiny_pipeline(family: str, distilled: bool = False) -> str:
    """The folder of the tiny `family` ("flux", "sd3" or "flux2") pipeline, random weights from seed 0 (FLUX.2's VAE
    statistics too; `distilled`: a step-distilled FLUX.2-klein): built and saved with save_pretrained on first use in
    this process, removed when this process exits (not a forked child). Runs, torchrun workers too, read it with
    --model-path, as a user's saved model."""
    key = family + "-distilled" * distilled
    if key not in _PIPELINES:
        folder = tempfile.mkdtemp(prefix=f"tiny-{key}-")
        atexit.register(_remove_in, os.getpid(), folder)
        pipe = common.build_pipeline(family, tiny_configs(family), seed=0)
        if family == "flux2":  # a trained VAE's batch-norm statistics, which decoding must undo
            g = torch.Generator().manual_seed(0)
            pipe.vae.bn.running_mean.normal_(generator=g)
            pipe.vae.bn.running_var.uniform_(0.5, 2.0, generator=g)
            pipe.register_to_config(is_distilled=distilled)
        pipe.save_pretrained(folder)
        _PIPELINES[key] = folder
    return _PIPELINES[key]


def _remove_in(pid: int, folder: str):
    if os.getpid() == pid:
        shutil.rmtree(folder, ignore_errors=True)


def flags(values: dict) -> list[str]:
    """The command-line flags that set each field in `values` (booleans as --name / --no-name)."""
    out = []
    for key, value in values.items():
        name = "--" + key.replace("_", "-")
        out += [name if value else "--no-" + name[2:]] if isinstance(value, bool) else [name, str(value)]
    return out


def tiny_argv(trainer: str, family: str, drop: tuple[str, ...] = ()) -> list[str]:
    """The argv of a smoke run of `trainer` (a module name, e.g. "flow_grpo") on the tiny `family` pipeline:
    --model family --model-path <tiny_pipeline>, then every key of SMOKE and of the trainer's FITS_SMOKE (`own`) set
    explicitly over the trainer's family table, except the keys in `drop` (those keep the table's value, else the toy
    one)."""
    values = {**SMOKE, **own(trainer, "FITS_SMOKE", {})}
    unknown = set(drop) - set(values)
    assert not unknown, f"tiny_argv: {sorted(unknown)} are not smoke-run settings"
    return ["--model", family, "--model-path", tiny_pipeline(family),
            *flags({k: v for k, v in values.items() if k not in drop})]


def model_argv(trainer: str, model: str) -> list[str]:
    """--model toy, or a smoke run on the tiny flux / sd3 pipeline (`tiny_argv`)."""
    return ["--model", "toy"] if model == "toy" else tiny_argv(trainer, model)


# Small sizes for fast in-process runs of any trainer on any model: SMALL, or small(without=...) naming what it
# leaves to the trainer's own defaults.
SMALL_SIZES = {"prompts_per_step": 2, "group_size": 4, "micro_batch": 4, "sample_steps": 4, "eval_images": 8,
               "eval_steps": 4, "eval_every": 1, "threads": 1}


def small(without: tuple[str, ...] = ()) -> list[str]:
    """The flags of SMALL_SIZES except the keys in `without`."""
    assert set(without) <= set(SMALL_SIZES), f"small: {sorted(set(without) - set(SMALL_SIZES))} are not in SMALL"
    return flags({k: v for k, v in SMALL_SIZES.items() if k not in without})


SMALL = small()


def run(module, argv: list[str]) -> dict:
    """Parses argv like the command line and runs module.main in this process; returns its final metrics."""
    args = common.cli(module.Args, argv, module.MODEL_DEFAULTS)
    return module.main(args)


def read_metrics(run_dir) -> list[dict]:
    """A run's metrics.jsonl as its readers take it, one record per iteration, in order: the last logged for it (a
    resumed run logs again from its checkpoint's iteration). Resume markers and lines cut short by a kill are
    skipped."""
    last = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(m, dict) and isinstance(m.get("iteration"), int):
            last[m["iteration"]] = m
    return [last[i] for i in sorted(last)]


def straight_and_resumed(module, argv: list[str], split: int, total: int, tmp_path) -> tuple[list[dict], list[dict]]:
    """Runs `total` iterations straight (tmp_path/straight), and `split` then --resume to `total` (tmp_path/split);
    returns both metrics.jsonl without the timings, which differ between runs."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "split")
    run(module, [*argv, "--iterations", str(total), "--output-dir", straight])
    run(module, [*argv, "--iterations", str(split), "--output-dir", resumed])
    run(module, [*argv, "--iterations", str(total), "--output-dir", resumed, "--resume", resumed])
    return without_timings(read_metrics(straight)), without_timings(read_metrics(resumed))


def without_timings(lines: list[dict]) -> list[dict]:
    """Metrics lines without the wall-clock keys (t_rollout, t_update, ..., time_s) and --compile's (compiles,
    compile_s: a run in a process that has compiled them already compiles nothing), which differ between runs."""
    return [{k: v for k, v in m.items() if not (k.startswith(("t_", "compile")) or k == "time_s")} for m in lines]


def training_state(checkpoint) -> dict:
    """A checkpoint's training state (its state/ folder, torch.distributed.checkpoint's format) read whole in this
    process: {"params": {"0": tensor, ...}, "optimizer": ..., "ema": ...}, as common.training_state names them."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as folder:
        dcp_to_torch_save(Path(checkpoint) / "state", Path(folder) / "state.pt")
        return torch.load(Path(folder) / "state.pt", weights_only=False)


def trained_params(run_dir, iteration: int) -> list:
    """The exact trainable tensors a run saved at `iteration`."""
    params = training_state(Path(run_dir) / "checkpoints" / f"iter_{iteration:06d}")["params"]
    return [params[str(i)] for i in range(len(params))]


def free_port() -> int:
    """A TCP port free on this machine now, for torchrun's rendezvous: tests never share one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(script, argv: list[str], nproc: int = 2, port: int | None = None) -> list[str]:
    """The command that runs `script` (a path, or a file name in the checkout) as `nproc` processes under torchrun
    on one machine, on a free port unless `port` is given."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={port or free_port()}", str(ROOT / script), *map(str, argv)]


def torchrun(script, argv: list[str], nproc: int = 2) -> str:
    """Runs `script` as `nproc` gloo processes under torchrun (one thread each); asserts success, returns stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = torchrun_cmd(script, argv, nproc)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout
