"""tests/fix_copies.py never leaves a fork worse than it found it: every named file is checked before one is written,
each written to a temporary file renamed over it ("updated" printed after that); its line endings and BOM kept; a line
a rewrite takes out printed, a statement of the fork's it takes out kept when the fork still reads what it binds; what
the new blocks need added where it belongs (a closure in main(), a function before main(), an import after the
imports), never over what the fork binds or imports; a result that would not run refused, naming what to copy by hand.
What is not a trainer file is refused in one line, and an error in flow_grpo.py names flow_grpo.py."""
import codecs
import os
import re
import signal
import subprocess
import sys

import pytest

import fix_copies
from helpers import ROOT

BASE = (ROOT / "flow_grpo.py").read_text()
G2RPO = (ROOT / "g2rpo.py").read_text()
STALE = G2RPO.replace("**loop.work(),", "**loop.work(), \"stale\": 1,")  # g2rpo.py with a stale `log` block
TOOL = [sys.executable, str(ROOT / "tests" / "fix_copies.py")]


def tool(*argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*TOOL, *map(str, argv)], capture_output=True, text=True, timeout=60, **kw)


def test_a_failed_write_leaves_the_fork_whole_and_is_not_called_an_update(tmp_path):
    """A file-size limit below the fork's size: its update cannot be written. The fork is as it was (no half file, no
    temporary file left), nothing says "updated", and the exit status is 2."""
    fork = tmp_path / "g2rpo.py"
    fork.write_text(STALE)

    def limited():
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # the write then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(STALE) // 2, len(STALE) // 2))
    out = tool(fork, preexec_fn=limited)
    assert out.returncode == 2 and fork.read_text() == STALE and os.listdir(tmp_path) == ["g2rpo.py"], out
    assert "updated" not in out.stdout and "could not write it (File too large): it is as it was" in out.stderr


def test_updated_is_printed_once_the_file_is_written(tmp_path, monkeypatch, capsys):
    fork, seen = tmp_path / "g2rpo.py", []
    fork.write_text(STALE)
    write = fix_copies.Source.write

    def recorded(self, text):
        seen.append(capsys.readouterr().out)               # what was printed before the write
        write(self, text)
    monkeypatch.setattr(fix_copies.Source, "write", recorded)
    assert fix_copies.main([str(fork)]) == 0
    assert seen == [""] and capsys.readouterr().out.startswith("g2rpo.py: updated the shared block 'log'")


@pytest.mark.parametrize("bom,newline", [(False, "\r\n"), (True, "\n"), (True, "\r\n")])
def test_line_endings_and_a_bom_are_kept(bom, newline, tmp_path):
    def encoded(text):
        return (codecs.BOM_UTF8 if bom else b"") + text.replace("\n", newline).encode()
    fork = tmp_path / "g2rpo.py"
    fork.write_bytes(encoded(STALE))
    assert fix_copies.main([str(fork)]) == 0 and fork.read_bytes() == encoded(G2RPO)


def test_mixed_line_endings_are_refused(tmp_path, capsys):
    fork = tmp_path / "g2rpo.py"
    fork.write_bytes(STALE.encode().replace(b"\n", b"\r\n", 3))
    assert fix_copies.main([str(fork)]) == 2 and fork.read_bytes() == STALE.encode().replace(b"\n", b"\r\n", 3)
    assert "mixes line endings (CRLF, LF, CR): give it one kind first" in capsys.readouterr().err


def test_a_line_added_inside_a_block_is_printed_and_what_it_binds_kept_when_read(tmp_path, capsys):
    """Two lines a user put in flow_grpo.py's blocks: a print in `log` (printed as it goes out) and a binding in
    `iteration-start` that the method reads later (printed, and kept after the block)."""
    text = BASE.replace("        **loop.work(),                                   # the iteration's work",
                        "        **loop.work(), \"mine\": 1,  # the iteration's work", 1)
    text = text.replace("        texts = [r[\"prompt\"] for r in records]\n",
                        "        texts = [r[\"prompt\"] for r in records]\n        scale = 2.0  # mine\n", 1)
    text = text.replace("        advantages = advantages.clamp(-args.adv_clip, args.adv_clip)\n",
                        "        advantages = scale * advantages.clamp(-args.adv_clip, args.adv_clip)\n", 1)
    fork = tmp_path / "mine.py"
    fork.write_text(text)
    assert fix_copies.main([str(fork)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert "    - **loop.work(), \"mine\": 1,  # the iteration's work: nfe_fwd, reward_calls, ..." in said
    assert "    - scale = 2.0  # mine" in said
    assert "mine.py: kept `scale = 2.0  # mine` after the shared block 'iteration-start': the block no longer binds " \
           "scale, which main() reads" in said
    new = fork.read_text()
    assert "# <<< shared: iteration-start\n        scale = 2.0  # mine\n" in new and '"mine": 1' not in new
    assert fix_copies.shared_blocks(new) == fix_copies.shared_blocks(BASE)


def without(text: str, name: str) -> str:
    """The text without its top-level function `name` (and the two blank lines after it)."""
    return text.replace(fix_copies.function_source(text, name), "", 1)


def test_a_function_goes_before_main_never_into_a_string(tmp_path):
    """The fork's docstring quotes `def main(`: step_loss, which the update calls and the fork lacks, goes before the
    real main(), the docstring unchanged."""
    doc = '"""A fork.\n\ndef main(args) is below.\n"""\n'
    fork = tmp_path / "quoted.py"
    fork.write_text(doc + without(BASE, "step_loss").split('"""', 2)[2].lstrip("\n"))
    assert fix_copies.main([str(fork)]) == 0
    new = fork.read_text()
    assert new.startswith(doc) and new.index("def step_loss(") < new.index("\ndef main(args: Args)")
    compile(new, "quoted.py", "exec")


def test_without_a_main_a_function_goes_after_the_imports(tmp_path):
    """A fork whose entry point is not named main (`train`, with main an alias after it): step_loss goes after the
    imports, never before `from __future__`."""
    text = without(BASE, "step_loss").replace("def main(args: Args) -> dict:", "def train(args: Args) -> dict:")
    text = text.replace("common.preflight(main, args)", "common.preflight(train, args)")
    text = text.replace("# ---- 4. Entry point ----", "main = train\n\n\n# ---- 4. Entry point ----")
    fork = tmp_path / "trained.py"
    fork.write_text(text)
    assert fix_copies.main([str(fork)]) == 0
    new = fork.read_text()
    assert new.index("from common import field\n") < new.index("def step_loss(") < new.index("@dataclass")
    assert new.split('"""', 2)[2].lstrip("\n").startswith("from __future__ import annotations")
    compile(new, "trained.py", "exec")


@pytest.mark.parametrize("how", ["from my_losses import step_loss", "step_loss = functools.partial(print)"])
def test_a_function_the_fork_imports_or_binds_is_not_added(how, tmp_path, capsys):
    text = without(BASE, "step_loss").replace("from common import field\n", f"from common import field\n{how}\n")
    fork = tmp_path / "own_loss.py"
    fork.write_text(text)
    assert fix_copies.main([str(fork)]) == 0 and fork.read_text() == text
    assert capsys.readouterr().out == "own_loss.py: up to date\n"


def test_a_fifo_a_device_and_a_file_larger_than_any_trainer_are_refused_in_one_line(tmp_path):
    fifo, big = tmp_path / "fifo.py", tmp_path / "big.py"
    os.mkfifo(fifo)
    with open(big, "wb") as f:
        f.truncate(fix_copies.MAX_BYTES + 1)
    for path, why in [(fifo, "is not a regular file (a folder, FIFO or device)"), ("/dev/zero", "is not a regular "
                      "file"), (tmp_path, "is not a regular file"), (big, "is larger than any trainer")]:
        out = tool(path)                                     # a FIFO does not wait for a writer, /dev/zero is not read
        assert out.returncode == 2 and out.stdout == "", out
        lines = out.stderr.splitlines()
        assert len(lines) == 2 and lines[0].startswith(f"tests/fix_copies.py: {path}: {why}"), out
        assert lines[1] == "tests/fix_copies.py: nothing was written"


def test_a_read_only_fork_is_refused_before_any_file_is_written(tmp_path, capsys):
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text(STALE)
    second.write_text(STALE)
    second.chmod(0o444)
    assert fix_copies.main([str(first), str(second)]) == 2
    assert first.read_text() == second.read_text() == STALE
    assert "b.py: is read-only: make it writable (chmod u+w) to update it" in capsys.readouterr().err


def test_every_file_is_checked_before_one_is_written(tmp_path, capsys):
    """A first file it can update, a second it refuses (a block flow_grpo.py does not have): neither is written."""
    good, odd = tmp_path / "good.py", tmp_path / "odd.py"
    good.write_text(STALE)
    odd.write_text(re.sub(r"^( *)(# >>> shared: log\n)", r"\1# >>> shared: mine\n\1\2", STALE, flags=re.M)
                   .replace("        # <<< shared: log\n", "        # <<< shared: log\n        # <<< shared: mine\n"))
    before = odd.read_text()
    assert fix_copies.main([str(good), str(odd)]) == 2
    assert good.read_text() == STALE and odd.read_text() == before
    err = capsys.readouterr().err.splitlines()
    assert err == [f"tests/fix_copies.py: {odd}: 'mine' is not a shared block of flow_grpo.py: remove its two markers "
                   f"(the code between them is then yours)", "tests/fix_copies.py: nothing was written"]


def test_check_writes_nothing_and_says_so(tmp_path, capsys):
    fork = tmp_path / "g2rpo.py"
    fork.write_text(STALE)
    assert fix_copies.main(["--check", str(fork)]) == 1 and fork.read_text() == STALE
    assert capsys.readouterr().out.splitlines() == [
        "g2rpo.py: would update the shared block 'log' (1 line(s) in, 1 out), these out:",
        "    - **loop.work(), \"stale\": 1,                                   # the iteration's work: nfe_fwd, "
        "reward_calls, ...", "tests/fix_copies.py --check: nothing was written"]


def test_an_error_in_flow_grpo_names_flow_grpo(tmp_path, monkeypatch, capsys):
    broken = tmp_path / "flow_grpo.py"
    broken.write_text(BASE.replace("def main(args: Args) -> dict:", "def main(args: Args) -> dict", 1))
    monkeypatch.setattr(fix_copies, "BASE", broken)
    fork = tmp_path / "g2rpo.py"
    fork.write_text(STALE)
    assert fix_copies.main([str(fork)]) == 2 and fork.read_text() == STALE
    err = capsys.readouterr().err
    assert err.startswith(f"tests/fix_copies.py: {broken}: line ") and "g2rpo.py" not in err, err


def test_a_required_block_it_cannot_place_is_refused_with_what_to_copy(tmp_path, capsys):
    """`validate` gone with its code: no statement of main() starts as it does; nothing is written, exit status 2."""
    text = re.sub(r" *# >>> shared: validate\n.*?# <<< shared: validate\n", "    rt = common.setup_training(args)  "
                  "# mine\n", BASE, flags=re.S).replace("rt = common.setup_training(args)  # mine",
                                                        "rt = common.setup_training(args, )")
    fork = tmp_path / "novalidate.py"
    fork.write_text(text)
    assert fix_copies.main([str(fork)]) == 0                 # its first statement, formatted apart, is found
    assert "# >>> shared: validate" in fork.read_text()
    fork.write_text(text.replace("rt = common.setup_training(args, )", "rt = common.setup_training(args=args)"))
    assert fix_copies.main([str(fork)]) == 2
    first, last = fix_copies.block_lines(BASE)["validate"]
    assert f"the shared block 'validate' is missing and no statement of main() is its first, `rt = " \
           f"common.setup_training(args)`: copy it from flow_grpo.py (lines {first - 1}-{last + 1}, its markers " \
           f"included) by hand" in capsys.readouterr().err


def test_a_closure_the_update_calls_is_added_to_main(tmp_path, capsys, monkeypatch):
    """A fork whose update block calls ref_mu, which its main() lacks: flow_grpo.py's is added before the `loop`
    block, as there; a missing value (not a closure) is refused, naming flow_grpo.py's line."""
    ref_mu = BASE[BASE.index("    def ref_mu("):BASE.index("    # >>> shared: loop\n")]
    fork = tmp_path / "noref.py"
    fork.write_text(BASE.replace(ref_mu, ""))
    assert fix_copies.main([str(fork)]) == 0
    assert capsys.readouterr().out.startswith("noref.py: added `ref_mu` to main(), flow_grpo.py's (its line ")
    assert fork.read_text() == BASE.replace(ref_mu, ref_mu.rstrip("\n") + "\n")
    zero_std = "        zero_std = (rearrange(rewards, \"(b g) -> b g\", g=G).std(1) < 1e-6).float().mean()\n"
    fork.write_text(BASE.replace(zero_std, ""))
    assert fix_copies.main([str(fork)]) == 2
    assert "the shared block 'log' reads `zero_std`, which main() does not bind: bind it before the block " \
           "(flow_grpo.py's line " in capsys.readouterr().err


def test_a_result_that_would_not_run_is_refused(tmp_path, capsys):
    """Code of the fork that reads a name nothing binds (here a typo): nothing to copy can fix it; refused."""
    fork = tmp_path / "typo.py"
    fork.write_text(STALE.replace("t_rollout = time.time() - tic", "t_rollout = time.time() - ticc", 1))
    assert fix_copies.main([str(fork)]) == 2
    assert "reads `ticc`, which nothing binds: bind it, or copy the blocks by hand" in capsys.readouterr().err
