"""Brings the shared blocks of trainer files up to date with flow_grpo.py, as diffusers' `make fix-copies` does its
"Copied from" blocks: after pulling a new version, `python tests/fix_copies.py my_method.py` rewrites every block
between `# >>> shared: NAME` and `# <<< shared: NAME` in my_method.py with flow_grpo.py's, and adds the top-level
functions the new blocks call that the file does not define (flow_grpo.py's, before `def main`: yours to change, as
`step_loss`). Everything else in the file stays as it was, byte for byte, and a block the file dropped (an OPTIONAL
one) stays dropped. It says in one line what it changed in each block.

  python tests/fix_copies.py my_method.py            # rewrite the stale blocks
  python tests/fix_copies.py --check my_method.py    # change nothing; exit status 1 if a block is stale
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "flow_grpo.py"
SHARED = ("args", "validate", "setup-run", "setup-model", "setup-train", "loop", "iteration-start", "step", "log",
          "loop-end")
# flow_grpo.py's blocks that a trainer may share or drop: its update (pro_grpo trains with it) and the metrics of a
# likelihood ratio (a likelihood-free method has none)
OPTIONAL = ("update", "ratio-log")
OPEN, CLOSE = "# >>> shared: {}\n", "# <<< shared: {}\n"


def blocks(text: str) -> dict[str, tuple[int, int]]:
    """NAME -> (start, end) of the text between its markers (a block may hold another: `step` lies in `update`); a
    ValueError names a marker opened twice or left unclosed."""
    out = {}
    for m in re.finditer(r"# >>> shared: ([\w-]+)\n", text):
        name = m.group(1)
        end = text.find(f"# <<< shared: {name}\n", m.end())
        if name in out or end < 0:
            raise ValueError(f"the shared block '{name}' {'opens twice' if name in out else 'is never closed'}")
        out[name] = (m.end(), text.rindex("\n", 0, end) + 1)
    if text.count("# <<< shared: ") != len(out):
        raise ValueError("a `# <<< shared:` marker closes no open block")
    return out


def shared_blocks(text: str) -> dict[str, str]:
    """NAME -> the text of the block."""
    return {name: text[a:b] for name, (a, b) in blocks(text).items()}


def top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """The module's top-level functions, classes and assigned names."""
    out = {}
    for node in tree.body:
        names = [node.name] if hasattr(node, "name") else [t.id for n in getattr(node, "targets", []) for t in
                                                            ast.walk(n) if isinstance(t, ast.Name)]
        out.update(dict.fromkeys(names, node))
    return out


def missing_functions(text: str, base: str) -> list[str]:
    """The base's top-level functions that the text's shared blocks call, directly or through another, and the text
    does not define, in the base's order."""
    ours, theirs = top_level(ast.parse(text)), top_level(ast.parse(base))
    todo = [n for block in shared_blocks(text).values() for n in re.findall(r"(?<![\w.])([A-Za-z_]\w*)\(", block)]
    wanted = []
    while todo:
        name = todo.pop()
        node = theirs.get(name)
        if name in ours or name in wanted or not isinstance(node, ast.FunctionDef):
            continue
        wanted.append(name)
        todo += [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    return sorted(wanted, key=list(theirs).index)


def function_source(base: str, name: str) -> str:
    """A top-level function of the base, with its decorators, and the two blank lines after it."""
    node = top_level(ast.parse(base))[name]
    lines = base.splitlines(keepends=True)
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    return "".join(lines[start:node.end_lineno]) + "\n\n"


def fix(text: str, base: str, name: str = "FILE") -> tuple[str, list[str]]:
    """The text with its shared blocks as the base's and the functions they call added; and one line per change."""
    ours, theirs = blocks(text), shared_blocks(base)
    changes = [f"{name}: the shared block '{b}' is missing: copy it from flow_grpo.py by hand"
               for b in theirs if b not in ours and b not in OPTIONAL]
    changes += [f"{name}: '{b}' is not a shared block of flow_grpo.py: remove its markers" for b in ours
                if b not in theirs]
    stale = [b for b in theirs if b in ours and text[slice(*ours[b])] != theirs[b]]
    inner = {b for b in stale for c in stale if c != b and ours[c][0] < ours[b][0] and ours[b][1] <= ours[c][1]}
    for b in stale:
        if b not in inner:
            within = "".join(f", and '{c}' within it" for c in stale if c in inner and ours[b][0] < ours[c][0] <
                             ours[b][1])
            changes.append(f"{name}: updated the shared block '{b}'{within} ({describe(text, ours[b], theirs[b])})")
    for b in sorted((b for b in stale if b not in inner), key=lambda b: -ours[b][0]):  # from the end: positions hold
        text = text[:ours[b][0]] + theirs[b] + text[ours[b][1]:]
    for fn in missing_functions(text, base):
        at = text.find("\ndef main(")
        text = text[:at + 1] + function_source(base, fn) + text[at + 1:]
        changes.append(f"{name}: added {fn}(), flow_grpo.py's, before main(): a shared block calls it (yours to "
                       f"change)")
    return text, changes


def describe(text: str, span: tuple[int, int], new: str) -> str:
    """How many of a block's lines came and went."""
    a, b = text[slice(*span)].splitlines(), new.splitlines()
    return f"{sum(ln not in a for ln in b)} line(s) in, {sum(ln not in b for ln in a)} out"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests/fix_copies.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="trainer files to bring up to date (not flow_grpo.py itself)")
    ap.add_argument("--check", action="store_true", help="change nothing; exit status 1 if a block is stale")
    a = ap.parse_args(argv)
    base, stale = BASE.read_text(), False
    for path in map(Path, a.files):
        try:
            text = path.read_text()
            fixed, changes = fix(text, base, path.name)
        except (OSError, ValueError, SyntaxError) as e:
            print(f"tests/fix_copies.py: {path}: {e}", file=sys.stderr)
            return 2
        stale |= fixed != text or bool(changes)
        for line in changes or [f"{path.name}: up to date"]:
            print(line)
        if not a.check and fixed != text:
            path.write_text(fixed)
    return int(stale and a.check)


if __name__ == "__main__":
    sys.exit(main())
