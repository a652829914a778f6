"""Every trainer is a copy of flow_grpo.py: the blocks marked `# >>> shared: NAME` ... `# <<< shared: NAME`
must stay verbatim (like diffusers' "Copied from" check), trainers import only common, and stay readable."""
import re

import pytest

from helpers import ROOT

TRAINERS = ["pro_grpo.py", "g2rpo.py", "v_grpo.py"]
SHARED = {"args", "setup-model", "setup-run", "eval", "checkpoint"}


def shared_blocks(path) -> dict[str, str]:
    text = path.read_text()
    blocks = dict(re.findall(r"# >>> shared: ([\w-]+)\n(.*?)# <<< shared: \1\n", text, flags=re.S))
    opened = re.findall(r"# >>> shared: ([\w-]+)", text)
    assert sorted(opened) == sorted(blocks), f"{path.name}: unbalanced shared markers {opened}"
    return blocks


def test_flow_grpo_marks_the_shared_blocks():
    assert set(shared_blocks(ROOT / "flow_grpo.py")) == SHARED


@pytest.mark.parametrize("name", TRAINERS)
def test_shared_blocks_are_verbatim_copies(name):
    path = ROOT / name
    if not path.exists():
        pytest.skip(f"{name} not written yet")
    ours, base = shared_blocks(path), shared_blocks(ROOT / "flow_grpo.py")
    assert set(ours) == SHARED
    for block in SHARED:
        assert ours[block] == base[block], f"{name}: shared block '{block}' differs from flow_grpo.py"


@pytest.mark.parametrize("name", ["flow_grpo.py", *TRAINERS])
def test_trainer_is_self_contained_and_short(name):
    path = ROOT / name
    if not path.exists():
        pytest.skip(f"{name} not written yet")
    text = path.read_text()
    assert len(text.splitlines()) < 1000
    assert not re.search(r"^(from|import) (flow_grpo|pro_grpo|g2rpo|v_grpo)\b", text, flags=re.M)
