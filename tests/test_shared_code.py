"""Every trainer is a copy of flow_grpo.py: the blocks marked `# >>> shared: NAME` ... `# <<< shared: NAME`
must stay verbatim (like diffusers' "Copied from" check; `python tests/fix_copies.py FILE` brings them up to date),
the functions they call must be defined, trainers import only common, and stay readable. A trainer is any top-level .py
file with the shared markers, so a forked method is checked without listing it; tests/likelihood_free.py, the template
of a method without a ratio, is checked as one. Each block opens with the names it reads from the method and those it
binds, held to its code; a name means one thing in every trainer."""
import ast
import dataclasses
import importlib
import re

import pytest

import common
import fix_copies
import helpers
from helpers import ROOT

SHARED, OPTIONAL = set(fix_copies.SHARED), set(fix_copies.OPTIONAL)
TRAINERS = [f"{name}.py" for name in helpers.TRAINERS]
FORKS = [name for name in TRAINERS if name != "flow_grpo.py"] + ["tests/likelihood_free.py"]  # copies of flow_grpo.py


def shared_blocks(path) -> dict[str, str]:
    """NAME -> the text between its markers (a block may hold another: `step` lies in `update`)."""
    return fix_copies.shared_blocks(path.read_text())


def test_trainers_are_found_by_their_markers(tmp_path):
    assert helpers.TRAINERS == helpers.find_trainers() and helpers.TRAINERS[0] == "flow_grpo"
    (tmp_path / "my_method.py").write_text((ROOT / "flow_grpo.py").read_text())   # a fork joins by being there
    (tmp_path / "common.py").write_text((ROOT / "common.py").read_text())
    (tmp_path / "flow_grpo.py").write_text((ROOT / "flow_grpo.py").read_text())
    assert helpers.find_trainers(tmp_path) == ["flow_grpo", "my_method"]
    import benchmark
    import gpu_check
    import readme_tables                               # one list everywhere: nothing to register for a fork
    assert benchmark.METHODS is gpu_check.TRAINERS is readme_tables.TRAINERS is helpers.TRAINERS


def test_flow_grpo_marks_the_shared_blocks():
    assert set(shared_blocks(ROOT / "flow_grpo.py")) == SHARED | OPTIONAL


@pytest.mark.parametrize("name", FORKS)
def test_shared_blocks_are_verbatim_copies(name):
    """Every trainer has the SHARED blocks; any block it marks (an OPTIONAL one too) is flow_grpo.py's verbatim."""
    ours, base = shared_blocks(ROOT / name), shared_blocks(ROOT / "flow_grpo.py")
    assert SHARED <= set(ours) <= SHARED | OPTIONAL
    for block in ours:
        assert ours[block] == base[block], f"{name}: shared block '{block}' differs from flow_grpo.py: run `python " \
                                           f"tests/fix_copies.py {name}` (it rewrites the shared blocks from it)"
    missing = fix_copies.missing_functions((ROOT / name).read_text(), (ROOT / "flow_grpo.py").read_text())
    assert not missing, f"{name}: its shared blocks call {missing}, which it does not define: run `python " \
                        f"tests/fix_copies.py {name}` (it adds flow_grpo.py's)"
    assert fix_copies.main(["--check", str(ROOT / name)]) == 0                 # and the tool agrees


def test_the_likelihood_free_template_drops_only_the_optional_blocks():
    assert set(shared_blocks(ROOT / "tests" / "likelihood_free.py")) == SHARED


def test_each_block_opens_with_the_names_it_reads_from_the_method_and_those_it_binds():
    """`# reads A, B; defines C, D` under each opening marker in main(): A, B are the names the block reads before it
    binds them that neither the module nor a block every trainer keeps binds (the method's: renamed, they would be a
    NameError), C, D every name it binds, each in the order the code first uses it."""
    text = (ROOT / "flow_grpo.py").read_text()
    m, given = fix_copies.Method(text), fix_copies.required_binds(text)
    assert {"N", "cond", "advantages", "policy_step", "ref_mu", "loop"} <= set(m.reads("update", given))  # it sees
    assert m.reads("step", given) == ["stats", "n_step"] and m.reads("validate", given) == []
    for block, text_ in fix_copies.shared_blocks(text).items():
        if block == "args":                                   # the fields: not code of main()
            continue
        said = fix_copies.header(text_)
        assert said is not None, f"the shared block '{block}' does not open with `# reads ...; defines ...`"
        code = (m.reads(block, given), m.binds(block))
        assert said == code, f"the shared block '{block}' says it reads {said[0]} and defines {said[1]}; its code " \
                             f"reads {code[0]} and defines {code[1]}:\n" + fix_copies.header_text(*code, "")


@pytest.mark.parametrize("name", [*TRAINERS, "tests/likelihood_free.py"])
def test_a_name_means_one_thing(name):
    """W is the SDE window (Flow-GRPO-Fast), never the world size; step an optimizer step (guard.step, ema.step, the
    `step` block), never the policy's denoising step (policy_step); mu a step's mean, `mean` only an average: no
    trainer binds W in main(), or step or mean anywhere."""
    tree = ast.parse((ROOT / name).read_text())
    bound = {n for kind, n, _ in fix_copies.events(tree.body) if kind == "store"}
    inner = {n for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) for kind, n, _ in
             fix_copies.events(node.body) if kind == "store"} | {a.arg for node in ast.walk(tree) if
                                                                   isinstance(node, ast.arg) for a in [node]}
    main = fix_copies.main_def(tree)
    in_main = {n for kind, n, _ in fix_copies.events(main.body) if kind == "store"} | fix_copies._params(main.args)
    assert not {"step", "mean"} & (bound | inner), f"{name} binds step or mean"
    assert "W" not in in_main, f"{name}: W in main() is the SDE window's name, not the world size (rt.world_size)"


def test_pro_grpo_trains_with_flow_grpo_update():
    assert "update" in shared_blocks(ROOT / "pro_grpo.py")


def args_read_by_common() -> set[str]:
    """The trainer's Args fields that common.py reads: attributes of `args`, `self.args`, and of `a` where it stands
    for a trainer's args (`a = self.args` in TrainingLoop; the preflight's `_judge(loop, a, ...)`, `_reward_rows(loop,
    a)`)."""
    read = set()
    for fn in ast.walk(ast.parse((ROOT / "common.py").read_text())):
        if not isinstance(fn, ast.FunctionDef):
            continue
        aliases = {"args"} | ({"a"} if [p.arg for p in fn.args.args][:2] == ["loop", "a"] else set())
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple | ast.Name):
                pairs = zip(node.targets[0].elts, node.value.elts) if isinstance(node.targets[0], ast.Tuple) and \
                    isinstance(node.value, ast.Tuple) else [(node.targets[0], node.value)]
                aliases |= {t.id for t, v in pairs if isinstance(t, ast.Name) and ast.unparse(v) == "self.args"}
        read |= {node.attr for node in ast.walk(fn) if isinstance(node, ast.Attribute) and
                 ast.unparse(node.value) in aliases | {"self.args"}}
    return read


def test_the_fields_common_reads_are_shared_or_named_in_the_shared_block():
    """A field that common.py reads is in the shared `args` block, or named there (in backticks) as one each method
    defines with its own default; renamed in a fork, it would fail with a bare AttributeError. The names are exactly
    those read, and every trainer has them."""
    block = shared_blocks(ROOT / "flow_grpo.py")["args"]
    shared = set(re.findall(r"^ +(\w+): ", block, flags=re.M))
    named = set(re.findall(r"`(\w+)`", "".join(re.findall(r"^ +#(.*)$", block, flags=re.M))))
    read = args_read_by_common()
    assert {"iterations", "prompts_per_step", "seed", "lora_rank"} <= read   # the parse finds the reads
    assert read - shared == named, f"common.py reads {sorted(read - shared)} outside the shared args block; the " \
                                   f"block's comment names {sorted(named)}: name there what common.py reads"
    for name in TRAINERS:
        fields = {f.name for f in dataclasses.fields(importlib.import_module(name.removesuffix(".py")).Args)}
        assert named <= fields, f"{name}: common.py reads {sorted(named - fields)}, which its Args lacks"


@pytest.mark.parametrize("name", [*TRAINERS, "tests/likelihood_free.py"])
def test_trainer_is_self_contained_and_short(name):
    text = (ROOT / name).read_text()
    assert len(text.splitlines()) < 1000
    others = "|".join(t.removesuffix(".py") for t in TRAINERS)
    assert not re.search(rf"^(from|import) ({others})\b", text, flags=re.M)


@pytest.mark.parametrize("name", TRAINERS)
def test_model_tables_hold_only_what_differs(name):
    """MODEL_DEFAULTS overrides Args fields for the full-scale models, one key per line, and holds a key only when
    its value differs from the toy default on the field: the table reads as the list of full-scale changes."""
    module = importlib.import_module(name.removesuffix(".py"))
    fields = {f.name: f.default for f in dataclasses.fields(module.Args)}
    assert set(module.MODEL_DEFAULTS) <= set(common.MODELS) - {"toy"}
    for model, table in module.MODEL_DEFAULTS.items():
        for key, value in table.items():
            assert key in fields, f"{name}: MODEL_DEFAULTS[{model!r}] sets {key!r}, which is not an Args field"
            assert value != fields[key], f"{name}: MODEL_DEFAULTS[{model!r}][{key!r}] repeats the toy default"
    text = (ROOT / name).read_text()
    table = text[text.index("MODEL_DEFAULTS = {"):text.index("\n}\n", text.index("MODEL_DEFAULTS = {"))]
    for line in table.splitlines()[1:]:
        assert line.count('": ') <= 1, f"{name}: one key per line in MODEL_DEFAULTS: {line.strip()}"


@pytest.mark.parametrize("trainer", helpers.TRAINERS)
def test_the_trainers_test_file_takes_its_trainer_from_its_own_name(trainer):
    """Each trainer's tests/test_<trainer>.py, which a fork copies as tests/test_<module>.py (README, Fork a method),
    names its trainer nowhere in its code but its docstring: TRAINER is its file's name less test_, so a copy under any
    name needs no edit and tests the copy (tests/test_fork.py copies all four)."""
    import io
    import tokenize
    path = ROOT / "tests" / f"test_{trainer}.py"
    if not path.exists():
        pytest.skip(f"{trainer} has no test file of its own")
    text = path.read_text()
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type in (tokenize.NAME,
                                                                                             tokenize.STRING)]
    assert tokens[0].type == tokenize.STRING and trainer in tokens[0].string             # the docstring says so
    named = [f"line {t.start[0]}: {t.string}" for t in tokens[1:] if trainer in t.string]
    assert not named, f"tests/test_{trainer}.py names its trainer: a copy of it would test {trainer}, not the copy"
    assert 'TRAINER = Path(__file__).stem.removeprefix("test_")' in text
