"""Brings the shared blocks of trainer files up to date with flow_grpo.py, as diffusers' `make fix-copies` does its
"Copied from" blocks: after pulling a new version, `python tests/fix_copies.py my_method.py` rewrites every block
between `# >>> shared: NAME` and `# <<< shared: NAME` in my_method.py with flow_grpo.py's, restores a required block
whose markers are gone where code of yours still matches its first lines, and adds what the new blocks need that the
file lacks: the closures they call inside main() (a renamed one as an alias of your old name, else flow_grpo.py's), the
top-level functions (flow_grpo.py's, before `def main`: yours to change, as `step_loss`) and imports. A block the file
dropped (an OPTIONAL one) stays dropped; everything else stays as it was, byte for byte, line endings and a BOM too.

It never leaves a fork worse than it found it: each line a rewrite takes out is printed; a statement of yours taken
out of a block that binds a name your code still reads is kept, after the block; the result must compile with every
name it uses defined, bound before main() reads it, or nothing is written and the line says what to copy by hand.
Every named file is checked before any is written; each is written to a temporary file renamed over it, and "updated"
is printed after that. Exit status: 0 done (or up to date), 1 `--check` found a stale file, 2 refused (nothing
written) or a write failed (that file as it was).

  python tests/fix_copies.py my_method.py            # bring the shared blocks up to date
  python tests/fix_copies.py --check my_method.py    # write nothing; exit status 1 if a file would change
"""
from __future__ import annotations

import argparse
import ast
import builtins
import codecs
import copy
import os
import re
import stat
import symtable
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "flow_grpo.py"
SHARED = ("args", "validate", "setup-run", "setup-model", "setup-train", "loop", "iteration-start", "step", "log",
          "loop-end")
# flow_grpo.py's blocks that a trainer may share or drop: its update (pro_grpo trains with it) and the metrics of a
# likelihood ratio (a likelihood-free method has none)
OPTIONAL = ("update", "ratio-log")
# A closure the shared blocks call -> its name in earlier versions (a fork that binds the old name gets an alias)
RENAMED = {"policy_step": "step", "ref_mu": "ref_mean"}
MAX_BYTES = 1 << 20  # more than any trainer: under 1000 lines of 120 columns
DUNDERS = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__", "__builtins__"}


class Refused(Exception):
    """What fix_copies will not do, as one line saying what to do instead (then nothing is written)."""


# ---- files: read whole or refused; written through a temporary file renamed over them ----
class Source:
    """A trainer file's text with "\\n" line ends, and what writing it back as it was takes: its BOM, line end, mode."""

    def __init__(self, path):
        self.path = Path(os.path.realpath(path))
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without waiting for a writer
        except OSError as e:
            raise Refused(f"cannot be read ({e.strerror})") from None
        try:
            info, data = os.fstat(fd), b""
            if not stat.S_ISREG(info.st_mode):
                raise Refused("is not a regular file (a folder, FIFO or device): name a trainer's .py file")
            while len(data) <= MAX_BYTES and (chunk := os.read(fd, MAX_BYTES + 1 - len(data))):
                data += chunk
        finally:
            os.close(fd)
        if len(data) > MAX_BYTES:
            raise Refused(f"is larger than any trainer (over {MAX_BYTES} bytes): name a trainer's .py file")
        self.mode, self.bom = stat.S_IMODE(info.st_mode), data.startswith(codecs.BOM_UTF8)
        try:
            text = data[len(codecs.BOM_UTF8) if self.bom else 0:].decode()
        except UnicodeDecodeError as e:
            raise Refused(f"is not UTF-8 text (byte {e.start}): name a trainer's .py file") from None
        crlf = text.count("\r\n")
        if text.count("\r") != crlf or crlf and text.count("\n") != crlf:
            raise Refused("mixes line endings (CRLF, LF, CR): give it one kind first (dos2unix or unix2dos)")
        self.newline, self.text = "\r\n" if crlf else "\n", text.replace("\r\n", "\n")

    def check_writable(self):
        if not self.mode & 0o222 or not os.access(self.path, os.W_OK):  # its mode, as it tells even root
            raise Refused("is read-only: make it writable (chmod u+w) to update it")
        if not os.access(self.path.parent, os.W_OK | os.X_OK):
            raise Refused(f"is in a folder this user cannot write ({self.path.parent}), where its update is written "
                          f"first and renamed over it")

    def write(self, text: str):
        """The file as `text`, all or nothing: a temporary file beside it, flushed to disk, renamed over it."""
        tmp = self.path.with_name(f".{self.path.name}.fix_copies-{os.getpid()}")
        try:
            with open(tmp, "xb") as f:
                f.write((codecs.BOM_UTF8 if self.bom else b"") + text.replace("\n", self.newline).encode())
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, self.mode)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


# ---- blocks ----
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


def block_lines(text: str) -> dict[str, tuple[int, int]]:
    """NAME -> the first and last line (from 1) of the block's text; first > last: an empty block."""
    return {name: (text.count("\n", 0, a) + 1, text.count("\n", 0, b)) for name, (a, b) in blocks(text).items()}


def header(text: str) -> tuple[list[str], list[str]] | None:
    """A block's opening comment, `# reads A, B; defines C, D` (continued on lines `#   ...`): the names the block
    reads that the method binds, and those it binds; None without one."""
    lines = [ln.strip() for ln in text.split("\n")]
    if not lines[0].startswith("# reads "):
        return None
    said = [lines[0][2:]]
    for ln in lines[1:]:
        if not ln.startswith("#   "):
            break
        said.append(ln[1:].strip())
    m = re.fullmatch(r"reads (.*); defines (.*)", " ".join(said))
    return m and tuple([] if part == "nothing" else part.split(", ") for part in m.groups())


# ---- names: who binds and who reads what, in evaluation order ----
def _expr(node, out: list, bound=frozenset()):
    """Appends ("load" | "store", name, line) for an expression, near enough in evaluation order; a lambda's or a
    comprehension's own names are neither."""
    if isinstance(node, ast.Name):
        if node.id not in bound:
            out.append(("load" if isinstance(node.ctx, ast.Load) else "store", node.id, node.lineno))
    elif isinstance(node, ast.NamedExpr):
        _expr(node.value, out, bound)
        _expr(node.target, out, bound)
    elif isinstance(node, ast.Lambda):
        for d in [*node.args.defaults, *filter(None, node.args.kw_defaults)]:
            _expr(d, out, bound)
        _expr(node.body, out, bound | _params(node.args))
    elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        inner = set(bound)
        for i, gen in enumerate(node.generators):
            _expr(gen.iter, out, bound if i == 0 else inner)
            inner |= {n.id for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
            for cond in gen.ifs:
                _expr(cond, out, inner)
        for e in [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]:
            _expr(e, out, inner)
    elif isinstance(node, ast.AST):
        for child in ast.iter_child_nodes(node):
            _expr(child, out, bound)


def _params(a: ast.arguments) -> set[str]:
    return {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if p}


def events(stmts: list, out: list | None = None) -> list[tuple[str, str, int]]:
    """("load" | "store" | "free", name, line) of statements in the order they run (a loop's body once, both branches
    of an `if`); a nested function or class binds its name, and what it reads from outside is "free" where it is
    defined (read when it runs)."""
    out = [] if out is None else out
    for s in stmts:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            heads = [*s.decorator_list, *getattr(s, "bases", []), *[k.value for k in getattr(s, "keywords", [])]]
            if not isinstance(s, ast.ClassDef):
                heads += [*s.args.defaults, *filter(None, s.args.kw_defaults)]
            for e in heads:
                _expr(e, out)
            inner = events(s.body)
            local = {n for kind, n, _ in inner if kind == "store"} | (set() if isinstance(s, ast.ClassDef) else
                                                                     _params(s.args))
            out += [("free", n, s.lineno) for n in dict.fromkeys(n for kind, n, _ in inner if kind != "store")
                    if n not in local]
            out.append(("store", s.name, s.lineno))
        elif isinstance(s, ast.Assign):
            _expr(s.value, out)
            for t in s.targets:
                _expr(t, out)
        elif isinstance(s, (ast.AugAssign, ast.AnnAssign)):
            _expr(s.value, out)
            if isinstance(s, ast.AugAssign) and isinstance(s.target, ast.Name):
                out.append(("load", s.target.id, s.lineno))
            if s.value is not None or isinstance(s, ast.AugAssign):
                _expr(s.target, out)
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            _expr(s.iter, out)
            _expr(s.target, out)
            events(s.body + s.orelse, out)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                _expr(item.context_expr, out)
                _expr(item.optional_vars, out)
            events(s.body, out)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            out += [("store", (a.asname or a.name).split(".")[0], s.lineno) for a in s.names if a.name != "*"]
        elif isinstance(s, ast.ExceptHandler):
            _expr(s.type, out)
            if s.name:
                out.append(("store", s.name, s.lineno))
            events(s.body, out)
        else:  # if, while, try, return, an expression, ...: its expressions, then its statements, in field order
            for _, value in ast.iter_fields(s):
                for v in value if isinstance(value, list) else [value]:
                    events([v], out) if isinstance(v, (ast.stmt, ast.ExceptHandler)) else _expr(v, out)
    return out


def main_def(tree: ast.Module) -> ast.FunctionDef | None:
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)


def module_names(text: str) -> set[str]:
    """The names a module binds at its top (assigned, imported, defined, or declared global and assigned)."""
    names, todo = set(), [symtable.symtable(text, "file", "exec")]
    while todo:
        table = todo.pop()
        names |= {s.get_name() for s in table.get_symbols() if (s.is_assigned() or s.is_imported()) and
                  (table.get_type() == "module" or s.is_declared_global())}
        todo += table.get_children()
    return names


def known(text: str) -> set[str]:
    """What a name may refer to at the top of `text`: its module's names, the builtins, a module's own dunders."""
    return module_names(text) | set(dir(builtins)) | DUNDERS


class Method:
    """A trainer's main() seen through its shared blocks: what each block reads and binds, what the method binds."""

    def __init__(self, text: str):
        self.text, self.tree = text, ast.parse(text)
        self.main, self.lines, self.known = main_def(self.tree), block_lines(text), known(text)
        self.events = events(self.main.body) if self.main else []
        self.params = _params(self.main.args) if self.main else set()

    def inside(self, name: str):
        first, last = self.lines[name]
        return [e for e in self.events if first <= e[2] <= last]

    def binds(self, name: str) -> list[str]:
        """The names the block binds, in order (not `_`)."""
        return list(dict.fromkeys(n for kind, n, _ in self.inside(name) if kind == "store" and n != "_"))

    def reads(self, name: str, given: set[str] = frozenset()) -> list[str]:
        """The names the block reads before it binds them, less the module's, main's parameters and `given` (what
        other shared blocks bind), in order."""
        stored, out = set(), []
        for kind, n, _ in self.inside(name):
            if kind == "store":
                stored.add(n)
            elif n not in stored | self.known | self.params | set(given) | set(out):
                out.append(n)
        return out



def required_binds(base: str) -> set[str]:
    """The names flow_grpo.py's required blocks bind: a block may read them without the method binding them."""
    m = Method(base)
    return {n for b in SHARED if b in m.lines and b != "args" for n in m.binds(b)}


def header_text(reads: list[str], binds: list[str], indent: str) -> str:
    """The opening comment of a block, `# reads ...; defines ...`, wrapped at 120 columns."""
    words = (f"reads {', '.join(reads) or 'nothing'}; defines {', '.join(binds) or 'nothing'}").split(" ")
    lines, line = [], indent + "#"
    for w in words:
        if len(line) + 1 + len(w) > 120:
            lines.append(line)
            line = indent + "#  "
        line += " " + w
    return "\n".join([*lines, line]) + "\n"


# ---- what a fork lacks ----
def stmt_binds(s: ast.stmt) -> set[str]:
    return {n for kind, n, _ in events([s]) if kind == "store"}


def method_statements(m: Method) -> list[ast.stmt]:
    """main()'s statements outside every shared block, the largest ones (a loop that holds a block is not one; its
    statements outside the blocks are)."""
    spans, out = list(m.lines.values()), []

    def visit(stmts):
        for s in stmts:
            if not any(a <= s.end_lineno and s.lineno <= b for a, b in spans):
                out.append(s)
            else:
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(s, field, []))
    visit(m.main.body if m.main else [])
    return out


def block_statements(m: Method, span: tuple[int, int]) -> tuple[list[ast.stmt], bool]:
    """main()'s statements that lie wholly in the line span, the largest ones; and whether the block holds only whole
    statements (the `loop` block opens a loop that goes on after it)."""
    out, whole = [], True

    def visit(stmts):
        nonlocal whole
        for s in stmts:
            if span[0] <= s.lineno and s.end_lineno <= span[1]:
                out.append(s)
            elif s.lineno <= span[1] and span[0] <= s.end_lineno:
                whole &= s.lineno < span[0] and span[1] <= s.end_lineno  # it holds the block, or only a part of it
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(s, field, []))
    visit(m.main.body if m.main else [])
    return out, whole


def head(s: ast.stmt) -> str:
    """A statement as flow_grpo.py and a fork both write it when it is the same: a simple one whole, a compound one
    its first line (decorators, comments and the body left out)."""
    if not hasattr(s, "body"):
        return ast.unparse(s)
    s = copy.copy(s)
    for f in ("body", "orelse", "handlers", "finalbody", "decorator_list"):
        if hasattr(s, f):
            setattr(s, f, [ast.Pass()] if f == "body" else [])
    return ast.unparse(s).split("\n")[0]


def bodies(fn: ast.FunctionDef | None):
    """Every statement list of a function but its nested functions', its own body first."""
    todo = [fn.body] if fn else []
    while todo:
        body = todo.pop(0)
        yield body
        for s in body:
            if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                todo += [getattr(s, f) for f in ("body", "orelse", "finalbody") if getattr(s, f, None)]


def source(text: str, s: ast.stmt) -> str:
    """A statement's whole lines (its decorators, comments on its lines), "\\n" ended."""
    first = min([s.lineno, *[d.lineno for d in getattr(s, "decorator_list", [])]])
    return "\n".join(text.split("\n")[first - 1:s.end_lineno]) + "\n"


def reindent(code: str, old: str, new: str) -> str:
    return "".join(new + ln[len(old):] if ln.startswith(old) else ln for ln in code.splitlines(keepends=True))


def indent_of(text: str, line: int) -> str:
    ln = text.split("\n")[line - 1]
    return ln[:len(ln) - len(ln.lstrip(" "))]


def offset(text: str, line: int) -> int:
    """The index in `text` where line `line` (from 1) starts."""
    return sum(len(ln) + 1 for ln in text.split("\n")[:line - 1])


def top_level(tree: ast.Module) -> dict[str, ast.stmt]:
    """The module's top-level statements by the names they bind."""
    return {n: s for s in tree.body for n in stmt_binds(s)}


def undefined(text: str) -> list[tuple[str, int]]:
    """(name, first line) of each name the module reads that nothing binds: not its scope's own, an enclosing one's,
    the module's or a builtin."""
    have, names, todo = known(text), set(), [symtable.symtable(text, "file", "exec")]
    while todo:
        table = todo.pop()
        names |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and (s.is_global() or (
            table.get_type() == "module" and not (s.is_assigned() or s.is_imported())))}
        todo += table.get_children()
    lines = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Name) and node.id in names - have:
            lines[node.id] = min(lines.get(node.id, node.lineno), node.lineno)
    return sorted(((n, lines.get(n, 0)) for n in names - have), key=lambda x: x[1])


def needed_globals(text: str, base: str) -> list[tuple[str, str]]:
    """(name, "function" | "import") for each name the text reads and does not bind that the base binds at its top
    with a function or an import, and those such a function reads in turn, in the base's order."""
    have, theirs = known(text), top_level(ast.parse(base))
    todo, wanted = [n for n, _ in undefined(text)], {}
    while todo:
        name = todo.pop(0)
        node = theirs.get(name)
        if name in wanted or name in have or node is None:
            continue
        if isinstance(node, ast.FunctionDef):
            wanted[name] = "function"
            todo += [n for kind, n, _ in events([node]) if kind != "store"]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            wanted[name] = "import"
    order = list(theirs)
    return sorted(wanted.items(), key=lambda kv: order.index(kv[0]))


def missing_functions(text: str, base: str) -> list[str]:
    """The base's top-level functions that the text reads (its shared blocks, say) and does not bind or import."""
    return [n for n, kind in needed_globals(text, base) if kind == "function"]


def import_source(base: str, name: str) -> str:
    """The base's import of `name` alone (`import x`, `from m import name`, aliased as there)."""
    node = top_level(ast.parse(base))[name]
    alias = next(a for a in node.names if (a.asname or a.name).split(".")[0] == name)
    what = alias.name + (f" as {alias.asname}" if alias.asname else "")
    return (f"from {'.' * node.level}{node.module or ''} import {what}" if isinstance(node, ast.ImportFrom)
            else f"import {what}") + "\n"


def function_source(base: str, name: str) -> str:
    """A top-level function of the base, with its decorators, and the two blank lines after it."""
    return source(base, top_level(ast.parse(base))[name]) + "\n\n"


def args_fields(tree: ast.Module) -> set[str] | None:
    """The fields of the module's `Args` dataclass; None when it has none of its own or inherits some."""
    cls = next((s for s in tree.body if isinstance(s, ast.ClassDef) and s.name == "Args"), None)
    if cls is None or cls.bases:
        return None
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


# ---- the update of one file ----
VERBS = {"restored": "restore", "updated": "update", "kept": "keep", "added": "add"}


class Fix:
    """One file brought up to date, step by step on its text. `said`: (line, details) per change, the line's verb in
    braces: "updated" once written, "would update" under --check."""

    def __init__(self, text: str, base: str, name: str):
        self.text, self.base, self.name, self.said = text, base, name, []
        self.theirs, self.basem = shared_blocks(base), Method(base)
        self.given = required_binds(base) | module_names(base)  # what main() need not bind (add_globals adds those)
        self.taken = []  # (block, a statement the rewrite took out of it, the names that statement binds)

    def run(self) -> str:
        ours = blocks(self.text)
        Method(self.text)  # it parses
        if unknown := [b for b in ours if b not in self.theirs]:
            raise Refused(f"'{unknown[0]}' is not a shared block of flow_grpo.py: remove its two markers (the code "
                          f"between them is then yours)")
        for b in SHARED:
            if b not in blocks(self.text):
                self.restore(b)
        self.rewrite()
        self.keep_what_is_read()
        self.add_closures()
        self.add_globals()
        self.lint()
        return self.text

    def by_hand(self, b: str) -> str:
        first, last = self.basem.lines[b]
        return f"copy it from flow_grpo.py (lines {first - 1}-{last + 1}, its markers included) by hand"

    def restore(self, b: str):
        """A required block whose markers are gone: where one statement of main() outside the blocks starts as the
        block's first does, that statement and those after it that start as the block's next ones do are replaced by
        the block, each that differs printed; the first that does not stays, after the block."""
        m = Method(self.text)
        theirs, whole = block_statements(self.basem, self.basem.lines[b])
        if not whole or not theirs or not m.main:
            raise Refused(f"the shared block '{b}' is missing: {self.by_hand(b)}")
        keys = [head(s) for s in theirs]
        starts = [(body, i) for body in bodies(m.main) for i, s in enumerate(body) if head(s) == keys[0] and
                  not any(a <= s.lineno <= z for a, z in m.lines.values())]
        if len(starts) != 1:
            raise Refused(f"the shared block '{b}' is missing and {'no' if not starts else 'more than one'} statement "
                          f"of main() is its first, `{keys[0]}`: {self.by_hand(b)}")
        body, i = starts[0]
        n = next((k for k in range(len(theirs)) if i + k >= len(body) or head(body[i + k]) != keys[k]), len(theirs))
        region = body[i:i + n]
        first, last = region[0].lineno, region[-1].end_lineno
        pad, base_pad = indent_of(self.text, first), indent_of(self.base, theirs[0].lineno)
        replaced = [f"- {ln.strip()}" for s, t in zip(region, theirs) if ast.dump(s) != ast.dump(t)
                    for ln in source(self.text, s).splitlines()]
        lines = self.text.split("\n")
        block = f"{pad}# >>> shared: {b}\n" + reindent(self.theirs[b], base_pad, pad) + f"{pad}# <<< shared: {b}"
        self.text = "\n".join(lines[:first - 1] + [block] + lines[last:])
        self.said.append((f"{self.name}: {{restored}} the shared block '{b}' over lines {first}-{last}, which start "
                          f"as it does" + (", these of yours, which differ from it, out:" if replaced else ""),
                          replaced))

    def rewrite(self):
        """The stale blocks become the base's (the outermost; a block within goes with it); each line a block loses is
        printed, and each statement it loses kept aside for keep_what_is_read."""
        ours, m = blocks(self.text), Method(self.text)
        stale = [b for b in self.theirs if b in ours and self.text[slice(*ours[b])] != self.theirs[b]]
        inner = {b for b in stale for c in stale if c != b and ours[c][0] < ours[b][0] and ours[b][1] <= ours[c][1]}
        outer = [b for b in stale if b not in inner]
        for b in outer:
            self.taken += [(b, source(self.text, s), stmt_binds(s)) for s in block_statements(m, m.lines[b])[0]]
            old, new = self.text[slice(*ours[b])].splitlines(), self.theirs[b].splitlines()
            out = [ln.strip() for ln in old if ln not in new and ln.strip()]
            within = "".join(f", and '{c}' within it" for c in inner if ours[b][0] < ours[c][0] < ours[b][1])
            came, went = sum(ln not in old for ln in new), sum(ln not in new for ln in old)
            self.said.append((f"{self.name}: {{updated}} the shared block '{b}'{within} ({came} line(s) in, {went} "
                              f"out)" + (", these out:" if out else ""), [f"- {ln}" for ln in out]))
        for b in sorted(outer, key=lambda b: -ours[b][0]):  # from the end: the positions before it hold
            self.text = self.text[:ours[b][0]] + self.theirs[b] + self.text[ours[b][1]:]

    def keep_what_is_read(self):
        """Each statement a rewrite took out that binds a name main() still reads and no longer binds goes back, as it
        was, after its block."""
        m = Method(self.text)
        bound = {n for kind, n, _ in m.events if kind == "store"} | m.params
        read = {n for kind, n, _ in m.events if kind != "store"}
        kept = {}
        for b, code, names in self.taken:
            if needed := sorted(n for n in names if n in read and n not in bound):
                kept.setdefault(b, []).append(code)
                bound |= names
                self.said.append((f"{self.name}: {{kept}} `{code.strip().splitlines()[0]}` after the shared block "
                                  f"'{b}': the block no longer binds {', '.join(needed)}, which main() reads", []))
        for b, codes in kept.items():
            close = self.text.index(f"# <<< shared: {b}\n")
            at, pad = self.text.index("\n", close) + 1, indent_of(self.text, self.text.count("\n", 0, close) + 1)
            self.text = self.text[:at] + "".join(reindent(c, indent_of(c, 1), pad) for c in codes) + self.text[at:]

    def add_closures(self):
        """Each name a shared block reads from main() that main() does not bind: an alias of its earlier name where
        main() binds that (RENAMED); else, for a closure, flow_grpo.py's statement that binds it, before the block
        that follows it in flow_grpo.py; else a refusal."""
        while (m := Method(self.text)).main:
            have = {n for kind, n, _ in m.events if kind == "store"} | m.params
            missing = [(b, n) for b in m.lines if b != "args" for n in m.reads(b, self.given) if n not in have]
            if not missing:
                return
            b, n = missing[0]
            old = RENAMED.get(n)
            s = next((s for s in m.main.body if old and old in stmt_binds(s)), None)
            if s is None:
                self.copy_closure(b, n, m, have)
                continue
            at = offset(self.text, s.end_lineno + 1)
            self.text = self.text[:at] + f"{indent_of(self.text, s.lineno)}{n} = {old}\n" + self.text[at:]
            self.said.append((f"{self.name}: {{added}} `{n} = {old}` after line {s.end_lineno}: the shared blocks call "
                              f"your {old} {n} now", []))

    def copy_closure(self, b: str, n: str, m: Method, have: set[str]):
        called = {c.func.id for c in ast.walk(self.basem.main) if isinstance(c, ast.Call) and
                  isinstance(c.func, ast.Name)}
        theirs = [s for s in method_statements(self.basem) if n in stmt_binds(s)]
        s = theirs[0] if len(theirs) == 1 else None
        closure = s is not None and n in called and (isinstance(s, ast.FunctionDef) or all(
            isinstance(a.value, ast.Call) for a in ast.walk(s) if isinstance(a, ast.Assign)))
        if not closure:
            like = f" (flow_grpo.py's line {theirs[0].lineno}: " \
                   f"`{source(self.base, theirs[0]).strip().splitlines()[0]}`)" if theirs else ""
            raise Refused(f"the shared block '{b}' reads `{n}`, which main() does not bind: bind it before the "
                          f"block{like}")
        if clash := sorted((stmt_binds(s) - {n}) & have):
            raise Refused(f"the shared block '{b}' calls `{n}`, which main() does not bind, and flow_grpo.py's "
                          f"statement that binds it (line {s.lineno}) binds your {', '.join(clash)} too: bind `{n}` "
                          f"by hand")
        fields = args_fields(ast.parse(self.text))
        reads = {a.attr for a in ast.walk(s) if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and
                 a.value.id == "args"}
        if fields is not None and (lacking := sorted(reads - fields)):
            raise Refused(f"the shared block '{b}' calls `{n}`, which main() does not bind, and flow_grpo.py's (line "
                          f"{s.lineno}) reads args.{lacking[0]}, which your Args lacks: bind `{n}` by hand")
        later = sorted((c for c in self.basem.lines if c != "args" and self.basem.lines[c][0] > s.end_lineno),
                       key=lambda c: self.basem.lines[c][0])
        here = next((c for c in later if c in m.lines), None)
        if here is None:
            raise Refused(f"the shared block '{b}' calls `{n}`, which main() does not bind: copy flow_grpo.py's (line "
                          f"{s.lineno}) by hand")
        marker = self.text.index(f"# >>> shared: {here}\n")
        at = self.text.rindex("\n", 0, marker) + 1
        self.text = self.text[:at] + reindent(source(self.base, s), indent_of(self.base, s.lineno),
                                              self.text[at:marker]) + self.text[at:]
        self.said.append((f"{self.name}: {{added}} `{n}` to main(), flow_grpo.py's (its line {s.lineno}), before the "
                          f"shared block '{here}': the block '{b}' calls it (yours to change)", []))

    def add_globals(self):
        """The base's top-level functions and imports that the file reads and lacks: an import after the file's
        last top-level import, a function before `def main` (or after the imports)."""
        for name, kind in needed_globals(self.text, self.base):
            tree = ast.parse(self.text)
            heads = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))] + tree.body[:1] * (
                bool(tree.body) and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant))
            after, main = max([s.end_lineno for s in heads], default=0), main_def(tree)
            if kind == "import":
                at, code, where = offset(self.text, after + 1), import_source(self.base, name), "after the imports"
            elif main:
                first = min([main.lineno, *[d.lineno for d in main.decorator_list]])
                at, code, where = offset(self.text, first), function_source(self.base, name), "before main()"
            else:
                at, code = offset(self.text, after + 1), "\n\n" + function_source(self.base, name).rstrip("\n") + "\n"
                where = "after the imports"
            self.text = self.text[:at] + code + self.text[at:]
            self.said.append((f"{self.name}: {{added}} {name}{'()' if kind == 'function' else ''}, flow_grpo.py's, "
                              f"{where}" + (": yours to change" if kind == "function" else ""), []))

    def lint(self):
        """The result compiles, every name it reads is bound somewhere, and main() binds its names before it reads
        them; else a refusal naming the first that is not."""
        try:
            compile(self.text, self.name, "exec")
        except SyntaxError as e:
            raise Refused(f"the update would not compile (line {e.lineno}: {e.msg}): copy the blocks by hand") \
                from None
        for name, line in undefined(self.text):
            raise Refused(f"after the update, line {line} reads `{name}`, which nothing binds: bind it, or copy the "
                          f"blocks by hand")
        m = Method(self.text)
        local, bound = {n for kind, n, _ in m.events if kind == "store"} | m.params, set(m.params)
        for kind, n, line in m.events:
            if kind == "store":
                bound.add(n)
            elif kind == "load" and n in local and n not in bound:
                raise Refused(f"after the update, main() reads `{n}` on line {line} before it binds it: bind it "
                              f"earlier, or copy the blocks by hand")


def fix(text: str, base: str, name: str = "FILE") -> tuple[str, list[str]]:
    """The text brought up to date and its change lines as written (Refused: what it will not do)."""
    f = Fix(text, base, name)
    return f.run(), [line for said in f.said for line in render(said, written=True)]


def render(said: tuple[str, list[str]], written: bool) -> list[str]:
    """A change's lines, its verb as done, or as it would be (--check)."""
    line, details = said
    verb = re.search(r"\{(\w+)\}", line).group(1)
    return [line.replace(f"{{{verb}}}", verb if written else "would " + VERBS[verb]), *(f"    {d}" for d in details)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests/fix_copies.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="trainer files to bring up to date (not flow_grpo.py itself)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit status 1 if a file would change")
    a = ap.parse_args(argv)
    try:
        base = Source(BASE).text
        blocks(base)
        if not Method(base).main:
            raise Refused("has no main()")
    except (Refused, ValueError, SyntaxError) as e:
        what = f"line {e.lineno}: {e.msg}" if isinstance(e, SyntaxError) else str(e)
        print(f"tests/fix_copies.py: {BASE}: {what}: the blocks' source must be whole (git checkout flow_grpo.py); "
              f"nothing was written", file=sys.stderr)
        return 2
    done, errors = [], []
    for path in a.files:  # every file is checked before any is written
        try:
            src = Source(path)
            if src.path == BASE.resolve():
                raise Refused("is flow_grpo.py, the blocks' source: name a fork of it")
            f = Fix(src.text, base, Path(path).name)
            new = f.run()
            if new != src.text and not a.check:
                src.check_writable()
            done.append((src, new, f.said, Path(path).name))
        except (Refused, ValueError, SyntaxError) as e:
            errors.append(f"tests/fix_copies.py: {path}: " + (f"line {e.lineno}: {e.msg}: it must compile first"
                                                               if isinstance(e, SyntaxError) else str(e)))
    if errors:
        print("\n".join(errors) + "\ntests/fix_copies.py: nothing was written", file=sys.stderr)
        return 2
    for src, new, said, name in done:
        if new != src.text and not a.check:
            try:
                src.write(new)
            except OSError as e:
                print(f"tests/fix_copies.py: {src.path}: could not write it ({e.strerror or e}): it is as it was",
                      file=sys.stderr)
                return 2
        print("\n".join(line for s in said for line in render(s, written=not a.check)) or f"{name}: up to date")
    if a.check:
        print("tests/fix_copies.py --check: nothing was written")
    return int(a.check and any(new != src.text for src, new, *_ in done))


if __name__ == "__main__":
    sys.exit(main())
