"""README.md against the code: its table of defaults is the one tests/readme_tables.py generates from the trainers,
and its metrics tables document exactly the keys each trainer logs. The trainers are found by their shared-block
marker, so a forked method is held to the same README, as the recipe describes it: its rows written for it alone, room
under the line cap for them, the keys of a shared block it dropped not asked of it."""
import dataclasses
import importlib
import importlib.util
import json
import re
import sys

import pytest

import common
import fix_copies
import readme_tables
from helpers import ROOT, TRAINERS, run

SHIPPED = ("flow_grpo", "pro_grpo", "g2rpo", "v_grpo")
# The README's lines: at most CAP (three full-scale models, FLUX.2-klein's one-GPU section), and FORK_ROOM more for
# each forked trainer (its defaults rows, its metrics rows).
CAP, FORK_ROOM = 620, 12

README = (ROOT / "README.md").read_text()
BASE_TEXT = (ROOT / "flow_grpo.py").read_text()
# Logged only in special cases the toy run below does not take: the weights' spread across DDP ranks (last line of
# a multi-process DDP run); the compiles and their seconds (--compile).
SPECIAL_CASES = {"rank_param_diff", "compiles", "compile_s"}
# One iteration on the toy at small sizes that every trainer's own toy settings fit, with an evaluation before and
# after it, so that every per-iteration and every evaluation key is logged.
ONE_ITERATION = ["--iterations", "1", "--eval-every", "1", "--prompts-per-step", "2", "--micro-batch", "4",
                 "--eval-images", "8", "--eval-steps", "4", "--threads", "1"]


def unscored(line: str) -> str:
    """A defaults row with its images-scored cell as "?" (the cells of a row without its count)."""
    cells = line.split(" | ")
    return " | ".join([*cells[:7], "?", *cells[8:]]) if re.match(r"\| \w+ \| `\w+` \|", line) else line


@pytest.mark.parametrize("scored", ["toy", pytest.param("every model", marks=pytest.mark.slow)])  # slow: 30 s more
@pytest.mark.parametrize("trainer", TRAINERS)
def test_the_defaults_rows_are_generated_from_the_code(trainer, scored, monkeypatch):
    """Every trainer's rows, a forked one's too, are in README.md's defaults table as the code makes them, in the
    table's order (model, then the trainers' order). The images scored are counted by runs of the trainer at each
    row's settings: the toy row's in the default suite (the full-scale rows' other cells), every row's (slow)."""
    rows = [readme_tables.row(trainer, "toy")]
    readme = README.splitlines()
    if scored == "toy":
        monkeypatch.setattr(readme_tables, "images_scored", lambda module, d: "?")
        readme = [unscored(line) if not line.startswith("| toy |") else line for line in readme]
    rows += [readme_tables.row(trainer, model) for model in readme_tables.MODELS if model != "toy"]
    stale = [r for r in rows if r not in readme]
    assert not stale, f"README.md's defaults table lacks {trainer}'s rows as the code makes them: run `python " \
                      f"tests/readme_tables.py --write {trainer}` (it writes them alone). The code's rows:\n" + \
                      "\n".join(stale)
    monkeypatch.setattr(readme_tables, "images_scored", lambda module, d: "?")      # the order: rows checked above
    assert readme_tables.defaults_table([t for t in TRAINERS if f"| toy | `{t}` |" in README]) in \
        "\n".join(map(unscored, README.splitlines()))


def test_a_forks_rows_are_written_for_it_alone(tmp_path, monkeypatch):
    """`readme_tables.py --write my_fork` runs my_fork only (each row's images counted by its own runs, here
    recorded), writes its rows into each model's part of the table after the trainers before it, and leaves every
    other line as it was."""
    import flow_grpo
    monkeypatch.setitem(sys.modules, "my_fork", flow_grpo)
    monkeypatch.setattr(readme_tables, "TRAINERS", [*readme_tables.TRAINERS, "my_fork"])
    counted = []
    monkeypatch.setattr(readme_tables, "images_scored", lambda module, d: counted.append(module) or 7)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    readme_tables.write_readme(readme, ["my_fork"])
    new = readme.read_text().splitlines()
    assert counted == [flow_grpo] * len(readme_tables.MODELS)
    added = [line for line in new if line not in README.splitlines()]
    assert added == [readme_tables.row("my_fork", m) for m in readme_tables.MODELS]
    assert [line for line in new if line not in added] == README.splitlines()
    for model, line in zip(readme_tables.MODELS, added):     # after its model's rows, before the next model's
        at = new.index(line)
        assert new[at - 1].startswith(f"| {model} | ") and not new[at + 1].startswith(f"| {model} | ")


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
def documented() -> tuple[set[str], dict[str, set[str]], dict[str, str]]:
    """The keys of README.md's metrics tables: those of `| metric | meaning |` (every trainer) and of
    `| trainer | metric | meaning |` (the trainers named in the row), each key in backticks, <name> a placeholder; and
    the keys of a row of the first that names a shared block ("the `ratio-log` block"): key -> that block."""
    common_keys, per_trainer, header, block_of = set(), {}, None, {}
    for line in README.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if header is None:
            header = cells
        elif header == ["metric", "meaning"]:
            common_keys |= set(re.findall(r"`([^`]+)`", cells[0]))
            if len(cells) > 1 and (block := re.search(r"the `([\w-]+)` block", cells[1])):
                block_of.update(dict.fromkeys(re.findall(r"`([^`]+)`", cells[0]), block.group(1)))
        elif header == ["trainer", "metric", "meaning"]:
            for trainer in re.findall(r"`([^`]+)`", cells[0]):
                per_trainer.setdefault(trainer, set()).update(re.findall(r"`([^`]+)`", cells[1]))
    return common_keys, per_trainer, block_of


def explained_by(key: str, entries: set[str]) -> str | None:
    """The README entry that documents a logged key: the key itself, else the most specific pattern matching it."""
    if key in entries:
        return key
    matches = [e for e in entries if "<" in e and re.fullmatch(re.sub(r"<\w+>", "[A-Za-z0-9_]+", e), key)]
    return max(matches, key=lambda e: len(re.sub(r"<\w+>", "", e)), default=None)


def logged_keys(module, out) -> set[str]:
    """The keys a trainer writes to metrics.jsonl in one toy iteration."""
    run(module, [*ONE_ITERATION, "--output-dir", str(out)])
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {k for line in lines if "iteration" in line for k in line}


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> dict[str, set[str]]:
    return {trainer: logged_keys(importlib.import_module(trainer), tmp_path_factory.mktemp(trainer))
            for trainer in TRAINERS}


def undocumented_and_unlogged(trainer: str, keys: set[str], blocks: set[str]) -> tuple[list[str], list[str]]:
    """The keys a trainer (its shared blocks `blocks`) logs that no metrics table documents, and the documented ones
    it does not log: those of the every-trainer table, but a row's that names a block the trainer dropped, and its
    own."""
    common_keys, per_trainer, block_of = documented()
    entries = common_keys | per_trainer.get(trainer, set())
    missing = sorted(k for k in keys if explained_by(k, entries) is None)
    used = {explained_by(k, entries) for k in keys}
    optional = {k for k, block in block_of.items() if block not in blocks}
    return missing, sorted(entries - used - SPECIAL_CASES - optional)


def test_the_readme_has_both_metrics_tables():
    common_keys, per_trainer, block_of = documented()
    assert {"iteration", "loss", "kl", "reward_<name>", "eval_<name>"} <= common_keys
    assert set(per_trainer) <= set(TRAINERS), f"the README documents metrics of unknown trainers {set(per_trainer)}"
    assert {"ratio_dev", "clip_frac_first_update", "approx_kl_second_update"} <= {k for k, b in block_of.items()
                                                                                  if b == "ratio-log"}


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_logged_metric_is_documented_and_every_documented_one_logged(trainer, logged):
    blocks = set(fix_copies.blocks((ROOT / f"{trainer}.py").read_text()))
    missing, unused = undocumented_and_unlogged(trainer, logged[trainer], blocks)
    assert not missing, f"{trainer} logs {missing}, which README.md's metrics tables do not document"
    assert not unused, f"README.md documents {unused} for {trainer}, which it does not log"


@pytest.mark.parametrize("dropped", ["ratio-log", "update and ratio-log"])
def test_a_fork_that_drops_an_optional_block_is_not_asked_for_its_keys(dropped, tmp_path, monkeypatch):
    """A fork of flow_grpo.py that keeps `update` but drops `ratio-log` logs no ratio key and passes the metrics
    check; so does tests/likelihood_free.py, which drops both. With every block asked of it, each would fail."""
    if dropped == "ratio-log":
        text = re.sub(r" *# >>> shared: ratio-log\n.*?# <<< shared: ratio-log\n", "", BASE_TEXT, flags=re.S)
        path = tmp_path / "no_ratio_log.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, path.stem, module)
        spec.loader.exec_module(module)
    else:
        import likelihood_free as module
        text = (ROOT / "tests" / "likelihood_free.py").read_text()
    keys = logged_keys(module, tmp_path / "r")
    assert not any(k.endswith(("_first_update", "_second_update")) for k in keys) and "ratio_dev_max" not in keys
    blocks = set(fix_copies.blocks(text))
    assert undocumented_and_unlogged("flow_grpo", keys, blocks) == ([], [])
    assert undocumented_and_unlogged("flow_grpo", keys, set(fix_copies.SHARED) | set(fix_copies.OPTIONAL))[1]


# ---- the reader's part, then the reference ----
def slug(heading: str) -> str:
    """The anchor a markdown renderer gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")


def test_the_readme_is_a_part_to_read_then_a_reference_with_contents_pointing_into_both():
    heads = [line for line in README.splitlines() if line.startswith("## ")]
    reference = [h for h in heads if h.startswith("## Reference")]
    assert len(reference) == 1 and heads[-1] == reference[0], "one level-2 Reference heading, last; its sections ###"
    reading, _ = README.split(reference[0] + "\n")
    forks = len(set(TRAINERS) - set(SHIPPED))
    assert len(reading.splitlines()) <= 180, "the part to read, before the Reference, is at most 180 lines"
    assert len(README.splitlines()) <= CAP + FORK_ROOM * forks, f"README.md is capped at {CAP} lines, and " \
                                                                f"{FORK_ROOM} more for each forked trainer's rows"
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
    """Each duty of an update of one's own cites the line of flow_grpo.py (or of its tests) that does it, verbatim."""
    flow = (ROOT / "flow_grpo.py").read_text() + (ROOT / "tests" / "test_flow_grpo.py").read_text()
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


def test_the_readme_gives_the_lint_line_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    line = re.search(r"^ruff check .*$", ci, flags=re.M).group(0)
    assert f"`{line}`" in README, f"README.md's fork recipe does not give CI's lint line `{line}`"


def test_the_formulas_call_a_steps_mean_mu():
    """In Math conventions mu is a step's mean and `mean` only an average over elements (the official CPS log-prob,
    -mean((x' - mu)^2)), never both in one formula."""
    section = README[README.index("## Math conventions"):README.index("## Set-up")]
    assert "mu = x + [v + g^2 / (2t) (x + (1 - t) v)] (s - t)" in section and "-mean((x' - mu)^2)" in section
    assert not re.search(r"\bmean =|- mean\b", section), "a formula uses `mean` for a step's mean: write mu"
