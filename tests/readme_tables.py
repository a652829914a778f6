"""The README's table of defaults, generated from the trainers themselves: one row per model and trainer, each
cell the effective default of a setting (the `Args` field's default, replaced by the trainer's
`MODEL_DEFAULTS[model]` for the full-scale models), and the images the trainer scores per iteration at those settings,
counted by running it (`images_scored`). tests/test_readme.py checks that README.md holds every trainer's rows.

  python tests/readme_tables.py                      # print the table
  python tests/readme_tables.py --write              # replace the table in README.md with it (every trainer: minutes)
  python tests/readme_tables.py --write my_method    # write my_method's rows alone, the others as they are (seconds)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import helpers  # noqa: E402
from helpers import TRAINERS  # noqa: E402

README = ROOT / "README.md"
BASELINE = "flow_grpo"
MODELS = ("toy", "sd3", "flux", "flux2")
# The method settings that have a column of their own; every other field after the shared block goes in the
# last column, as flags.
COLUMNS = {"iterations", "prompts_per_step", "group_size", "micro_batch", "lr", "sample_steps", "noise_level",
           "updates_per_rollout", "clip_range", "beta"}
HEADER = ("| model | trainer | px | steps: sample / eval | guidance | SDE noise a | prompts x group (micro-batch) "
          "| images scored / iteration | updates / clip | fine-tuning | lr | KL weight beta | dtype "
          "| EMA / grad. ckpt | reward | prompts | iterations | eval every / images | the method's other defaults |")


def shared_fields() -> list[str]:
    """The Args fields of the shared block, the same in every trainer (flow_grpo.py's copy)."""
    text = (ROOT / f"{BASELINE}.py").read_text()
    block = text.split("# >>> shared: args\n")[1].split("# <<< shared: args")[0]
    return re.findall(r"^ +(\w+): ", block, flags=re.M)


def effective_defaults(module, model: str) -> dict:
    """What `python <trainer>.py --model MODEL` runs with: the Args defaults, then MODEL_DEFAULTS[model]."""
    values = {f.name: f.default for f in dataclasses.fields(module.Args)}
    return {**values, "model": model, **(module.MODEL_DEFAULTS.get(model, {}) if model != "toy" else {})}


def fmt(value) -> str:
    """A number as Python prints it, exponents without a leading zero (2e-6)."""
    return re.sub(r"e([-+])0*(\d)", r"e\1\2", f"{value:g}") if isinstance(value, float) else str(value)


def flags(values: dict, names: list[str]) -> str:
    """Settings as command-line flags: --name value, --name / --no-name for a switch; a None (derived) is left out."""
    out = []
    for name in names:
        flag, value = "--" + name.replace("_", "-"), values[name]
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            out.append(f"{flag} {fmt(value)}")
    return f"`{' '.join(out)}`" if out else "-"


def images_scored(module, d: dict) -> int:
    """The images the trainer scores in one iteration at the settings `d` (its logged reward_calls), which is not
    always prompts x group: g2rpo scores every branch at every stride and its anchors, pro_grpo its previews. The
    count depends on the method's settings, not on the model: counted on the toy with those settings, for the
    fewest prompts that its sizes accept, then scaled to --prompts-per-step."""
    argv = tuple(helpers.flags({f.name: d[f.name] for f in dataclasses.fields(module.Args) if d[f.name] is not None
                                and f.name not in {*shared_fields(), "iterations", "prompts_per_step"}}))
    for prompts in (p for p in range(1, d["prompts_per_step"] + 1) if d["prompts_per_step"] % p == 0):
        try:
            return scored(module.__name__, argv, prompts) * d["prompts_per_step"] // prompts
        except common.UsageError:                     # sizes that do not divide these prompts: more prompts
            continue
    raise ValueError(f"{module.__name__} runs at none of the divisors of --prompts-per-step {d['prompts_per_step']}")


@functools.cache
def scored(trainer: str, argv: tuple, prompts: int) -> int:
    """reward_calls of one toy iteration of `trainer` with `argv` and `prompts` prompts, its output kept quiet."""
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        helpers.run(importlib.import_module(trainer), [*argv, "--iterations", "1", "--eval-every", "0", "--threads",
                                                       "1", "--prompts-per-step", str(prompts), "--output-dir",
                                                       f"{out}/run"])
        return json.loads(Path(out, "run", "metrics.jsonl").read_text().splitlines()[0])["reward_calls"]


def guidance(model: str, scale: float | None) -> str:
    if model == "toy" or scale is None:
        return "none"
    if model in ("sd3", "flux2"):
        return f"CFG {fmt(scale)}" if scale > 1 else "none (CFG 1)"
    return f"embedding {fmt(scale)}"


def row(trainer: str, model: str) -> str:
    module = importlib.import_module(trainer)
    d = effective_defaults(module, model)
    get = {name: fmt(value) for name, value in d.items()}.get   # "-": a setting the trainer does not have
    onoff = {True: "on", False: "off"}
    tuning = f"LoRA r {d['lora_rank']}, alpha {fmt(d['lora_alpha'])}" if d["lora_rank"] else \
        "full" + (" + FSDP2" if d["fsdp"] else "")
    other = [f.name for f in dataclasses.fields(module.Args) if f.name not in set(shared_fields()) | COLUMNS]
    cells = [model, f"`{trainer}`", common.TOY_SIZE if model == "toy" else d["resolution"],
             f"{d['sample_steps']} / {d['eval_steps']}", guidance(model, d["guidance_scale"]),
             get("noise_level", "-"), f"{d['prompts_per_step']} x {d['group_size']} ({d['micro_batch']})",
             images_scored(module, d),
             f"{get('updates_per_rollout', '-')} / {get('clip_range', '-')}", tuning, get("lr"), get("beta", "-"),
             d["dtype"] or common.GPU_DTYPES[model], f"{onoff[d['ema']]} / {onoff[d['gradient_checkpointing']]}",
             f"`{d['reward']}`", "the toy's" if model == "toy" else f"`{d['prompts']}`", d["iterations"],
             f"{d['eval_every']} / {d['eval_images']}", flags(d, other)]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def defaults_table(trainers: list[str] = TRAINERS) -> str:
    rows = [row(trainer, model) for model in MODELS for trainer in trainers]
    return "\n".join([HEADER, "|" + "---|" * HEADER.count(" | ") + "---|", *rows]) + "\n"


def write_readme(path: Path = README, trainers: list[str] | None = None) -> None:
    """Replaces the table that starts with HEADER in `path` by the current one; with `trainers`, only their rows (the
    other rows as they are, in the trainers' order within each model): what a fork runs, its rows alone."""
    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == HEADER)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    if trainers is None:
        table = defaults_table()
    else:
        kept = {m.groups(): line.rstrip("\n") for line in lines[start + 2:end]
                if (m := re.match(r"\| (\w+) \| `(\w+)` \|", line))}
        rows = [row(t, model) if t in trainers else kept.get((model, t)) for model in MODELS for t in TRAINERS]
        table = "\n".join([HEADER, "|" + "---|" * HEADER.count(" | ") + "---|", *filter(None, rows)]) + "\n"
    path.write_text("".join(lines[:start]) + table + "".join(lines[end:]))


if __name__ == "__main__":
    args = sys.argv[1:]
    if unknown := sorted(set(args) - {"--write"} - set(TRAINERS)):
        sys.exit(f"tests/readme_tables.py: {', '.join(unknown)}: not a trainer of this checkout (one of "
                 f"{', '.join(TRAINERS)}) nor --write")
    named = [a for a in args if a != "--write"] or None
    if "--write" in args:
        write_readme(trainers=named)
    else:
        print(defaults_table(named or TRAINERS), end="")
