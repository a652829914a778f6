"""README.md against the code: its table of defaults is the one tests/readme_tables.py generates from the trainers,
and its metrics tables document exactly the keys each trainer logs. The trainers are found by their shared-block
marker, so a forked method is held to the same README."""
import dataclasses
import importlib
import json
import re

import pytest

import common
import readme_tables
from helpers import ROOT, TRAINERS, run

README = (ROOT / "README.md").read_text()
# Logged only in special cases the toy run below does not take: the weights' spread across DDP ranks (last line of
# a multi-process DDP run); the compiles and their seconds (--compile).
SPECIAL_CASES = {"rank_param_diff", "compiles", "compile_s"}
# One iteration on the toy at small sizes that every trainer's own toy settings fit, with an evaluation before and
# after it, so that every per-iteration and every evaluation key is logged.
ONE_ITERATION = ["--iterations", "1", "--eval-every", "1", "--prompts-per-step", "2", "--micro-batch", "4",
                 "--eval-images", "8", "--eval-steps", "4", "--threads", "1"]


def test_the_defaults_table_is_generated_from_the_code():
    """The rows of every trainer README.md lists are the code's, and it lists the four this project ships; a forked
    method's rows are checked from when `python tests/readme_tables.py --write` writes them in."""
    listed = [t for t in TRAINERS if f"| toy | `{t}` |" in README]
    missing = sorted({"flow_grpo", "pro_grpo", "g2rpo", "v_grpo"} - set(listed))
    assert not missing, f"README.md's defaults table has no rows of {', '.join(missing)}: run `python " \
                        f"tests/readme_tables.py --write` (it writes the table from the trainers)"
    table = readme_tables.defaults_table(listed)
    assert table in README, f"README.md's defaults table is out of date: run `python tests/readme_tables.py --write` " \
                            f"(it writes the table from the trainers). The code's table:\n{table}"


def test_the_images_scored_are_counted_not_prompts_times_group():
    """The toy rows against hand counts: g2rpo scores each of its G = 8 branches from each of its 4 branched steps
    at each of its 3 strides, and each prompt's anchor; pro_grpo the previews of its 16 trajectories at the first
    checkpoint, of the 8 kept at the second, and the 4 survivors' images."""
    rows = [line.split(" | ") for line in readme_tables.defaults_table().splitlines()[2:]]
    toy = {cells[1]: int(cells[7]) for cells in rows if cells[0] == "| toy"}
    assert {t: toy[f"`{t}`"] for t in ("flow_grpo", "g2rpo", "pro_grpo", "v_grpo")} == {
        "flow_grpo": 16 * 8, "g2rpo": 8 * (4 * 8 * 3 + 1), "pro_grpo": 8 * (16 + 8 + 4), "v_grpo": 16 * 8}


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("model", readme_tables.MODELS)
def test_the_tables_defaults_are_what_the_command_line_applies(trainer, model):
    module = importlib.import_module(trainer)
    parsed = dataclasses.asdict(common.cli(module.Args, ["--model", model], module.MODEL_DEFAULTS))
    parsed["prompts"] = parsed["prompts"] and parsed["prompts"].partition("@")[0]  # a set is recorded @REVISION
    assert parsed == readme_tables.effective_defaults(module, model)


def test_a_changed_default_changes_the_table(monkeypatch):
    module = importlib.import_module(readme_tables.BASELINE)
    before = readme_tables.defaults_table()
    monkeypatch.setitem(module.MODEL_DEFAULTS["flux"], "lr", 1.25e-5)
    flux = readme_tables.defaults_table()
    assert flux != before and "| 1.25e-5 |" in flux and flux not in README
    beta = next(f for f in dataclasses.fields(module.Args) if f.name == "beta")
    monkeypatch.setattr(beta, "default", 0.125)
    toy = readme_tables.defaults_table()
    assert toy != flux and "| 0.125 |" in toy.splitlines()[2]


# ---- metrics ----
def documented() -> tuple[set[str], dict[str, set[str]]]:
    """The keys of README.md's metrics tables: those of `| metric | meaning |` (every trainer) and of
    `| trainer | metric | meaning |` (the trainers named in the row), each key in backticks, <name> a placeholder."""
    common_keys, per_trainer, header = set(), {}, None
    for line in README.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if header is None:
            header = cells
        elif header == ["metric", "meaning"]:
            common_keys |= set(re.findall(r"`([^`]+)`", cells[0]))
        elif header == ["trainer", "metric", "meaning"]:
            for trainer in re.findall(r"`([^`]+)`", cells[0]):
                per_trainer.setdefault(trainer, set()).update(re.findall(r"`([^`]+)`", cells[1]))
    return common_keys, per_trainer


def explained_by(key: str, entries: set[str]) -> str | None:
    """The README entry that documents a logged key: the key itself, else the most specific pattern matching it."""
    if key in entries:
        return key
    matches = [e for e in entries if "<" in e and re.fullmatch(re.sub(r"<\w+>", "[A-Za-z0-9_]+", e), key)]
    return max(matches, key=lambda e: len(re.sub(r"<\w+>", "", e)), default=None)


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> dict[str, set[str]]:
    """The keys each trainer writes to metrics.jsonl in one toy iteration."""
    keys = {}
    for trainer in TRAINERS:
        out = tmp_path_factory.mktemp(trainer)
        run(importlib.import_module(trainer), [*ONE_ITERATION, "--output-dir", str(out)])
        lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        keys[trainer] = {k for line in lines if "iteration" in line for k in line}
    return keys


def test_the_readme_has_both_metrics_tables():
    common_keys, per_trainer = documented()
    assert {"iteration", "loss", "kl", "reward_<name>", "eval_<name>"} <= common_keys
    assert set(per_trainer) <= set(TRAINERS), f"the README documents metrics of unknown trainers {set(per_trainer)}"


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_logged_metric_is_documented_and_every_documented_one_logged(trainer, logged):
    common_keys, per_trainer = documented()
    entries = common_keys | per_trainer.get(trainer, set())
    keys = logged[trainer]
    missing = sorted(k for k in keys if explained_by(k, entries) is None)
    assert not missing, f"{trainer} logs {missing}, which README.md's metrics tables do not document"
    used = {explained_by(k, entries) for k in keys}
    unused = sorted(entries - used - SPECIAL_CASES)
    assert not unused, f"README.md documents {unused} for {trainer}, which it does not log"


# ---- the reader's part, then the reference ----
def slug(heading: str) -> str:
    """The anchor a markdown renderer gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")


def test_the_readme_is_a_part_to_read_then_a_reference_with_contents_pointing_into_both():
    heads = [line for line in README.splitlines() if line.startswith("## ")]
    reference = [h for h in heads if h.startswith("## Reference")]
    assert len(reference) == 1 and heads[-1] == reference[0], "one level-2 Reference heading, last; its sections ###"
    reading, _ = README.split(reference[0] + "\n")
    assert len(reading.splitlines()) <= 250 and len(README.splitlines()) <= 560
    contents = reading[:reading.index("\n## ")]
    sections = [h for h in README.splitlines() if h.startswith(("## ", "### "))]
    missing = [h for h in sections if f"(#{slug(h)})" not in contents and h not in reference]
    assert not missing, f"the contents at the top do not point to {missing}"
    anchors = {slug(h) for h in README.splitlines() if h.startswith("#")}
    assert set(re.findall(r"\]\(#([\w-]+)\)", README)) <= anchors, "a link points to no heading"
    wide = [line for line in reading.splitlines() if line.startswith("|") and len(line) > 120]
    assert not wide, f"a table of the reading part does not fit a terminal: {wide[0]}"


GLOSSARY = ["CPS", "Flow-GRPO-Fast", "SDE window", "OVF", "MGAI", "ELBO surrogate", "toy-soft", "shared block",
            "rollout", "advantage", "clip range", "micro-batch", "minibatch", "on-policy"]


@pytest.mark.parametrize("term", GLOSSARY)
def test_a_word_is_defined_in_words_before_it_is_used(term):
    """The first use of each of these words is the line of README.md's Words that defines it (in bold)."""
    lines = README.splitlines()
    first = next(i for i, line in enumerate(lines) if re.search(rf"\b{re.escape(term)}\b", line, flags=re.I))
    defining = next(i for i, line in enumerate(lines) if f"**{term.lower()}" in line.lower())
    assert first == defining > lines.index("## Words"), f"{term!r} is used on line {first + 1} before Words defines it"


def test_the_fork_checklist_quotes_flow_grpo():
    """Each duty of an update of one's own cites the line of flow_grpo.py that does it, verbatim."""
    flow = (ROOT / "flow_grpo.py").read_text()
    items = re.findall(r"^ *- \[ \] (.*?)(?=^ *- \[ \]|^\d+\. )", README, flags=re.M | re.S)
    cited = [code for item in items for code in re.findall(r"\(`([^`]+)`(?:, `([^`]+)`)?\)", item) for code in code
             if code]
    assert len(items) >= 8 and len(cited) >= len(items)
    assert not [c for c in cited if c not in flow], "a quoted line is not flow_grpo.py's"


def test_what_a_fork_calls_in_common_is_listed():
    """Every name of common.py a trainer (or tests/likelihood_free.py) calls outside its shared blocks, and every
    TrainingLoop method it calls, is in README.md's list of what a fork calls."""
    import fix_copies
    listed = README[README.index("**What a fork calls in `common.py`**"):README.index("**Changes for forks**")]
    listed = set(re.findall(r"`(\w+)`", listed))
    used = set()
    for path in [ROOT / f"{t}.py" for t in TRAINERS] + [ROOT / "tests" / "likelihood_free.py"]:
        text = path.read_text()
        spans = sorted(fix_copies.blocks(text).values()) if "# >>> shared:" in text else []
        outside, last = [], 0
        for a, b in spans:
            outside.append(text[last:a] if a >= last else "")
            last = max(last, b)
        outside = "".join(outside) + text[last:]
        used |= set(re.findall(r"\bcommon\.(\w+)", outside)) | set(re.findall(r"\bloop\.(\w+)\(", outside))
    assert not used - listed, f"README.md's list of what a fork calls lacks {sorted(used - listed)}"
