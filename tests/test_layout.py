"""The layout, read from the source with ``ast`` (nothing is imported): no import cycle among the
project's own modules, the library -- what a user copies -- never imports the application, and
every file and function is a size a reader can hold.

Imports inside functions count too: a lazy import hides a cycle from Python, not from a reader.
"""

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What a user copies into their project (README: "Use it from Python").
LIBRARY = ["decoder", "prompt_lookup", "constrained", "draft_model", "draft_head", "mtp", "t5"]
# main.py's side: entry points, loaders, the batched engine, the server, the benchmarks, the
# trainer.
APPLICATION = {
    "main",
    "cli",
    "loading",
    "convert",
    "batch",
    "server",
    "benchmarks",
    "distributed",
    "head_training",
    "demo",
}

# Sizes a reader can hold (STYLE.md 19): a file in one sitting, a function body on one screen.
# Counted in ruff-formatted lines, where a call that does not fit puts one argument a line: a
# little over STYLE.md's 400 and 60, which count the packed style the code had before the formatter.
MAX_FILE_LINES = 450
MAX_BODY_LINES = 75
# A folder's README is a front page: what it is, how to run it, what it prints, links. Design notes
# and measurements go to docs/ and benchmarks/results/.
MAX_README_BYTES = 5_000
# Comment and docstring lines per code line in the core, at about mlx-lm's density (its generate.py
# has 0.20, cache.py 0.13); design prose goes to docs/decoder.md.
MAX_PROSE_PER_CODE_LINE = 0.25
# Names still over while a restructuring that owns them is under way (none now): list one here with
# its issue, and remove it when it lands. A name here that is no longer over fails the test too, so
# the list cannot go stale.
KNOWN_OVER = set()

RUFF = Path(sys.executable).parent / "ruff"


def project_modules(root: Path) -> dict:
    """Dotted module name -> file, for the ``.py`` files under ``root`` (hidden folders skipped)."""
    modules = {}
    for top in root.iterdir():
        if top.name.startswith("."):
            continue
        for path in (
            [top] if top.suffix == ".py" else sorted(top.rglob("*.py")) if top.is_dir() else []
        ):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict) -> set:
    """The project modules that module ``name`` imports: ``from a import b`` is ``a.b`` where that
    is a module, else ``a``; ``import a.b.c`` is its longest prefix that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = (
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    if package
                    else []
                )
                base = ".".join(anchor + ([node.module] if node.module else []))
            candidates = [[f"{base}.{alias.name}", base] for alias in node.names]
        else:
            continue
        for names in candidates:
            for dotted in names:
                parts = dotted.split(".")
                prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
                module = next((prefix for prefix in prefixes if prefix in modules), None)
                if module is not None:
                    found.add(module)
                    break
    found.discard(name)
    return found


def import_graph(root: Path) -> dict:
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def oversized(root: Path) -> set:
    """The source files over ``MAX_FILE_LINES`` lines (``"a/b.py"``) and the functions whose body --
    docstring included, from its first statement to its last line -- is over ``MAX_BODY_LINES``
    (``"a/b.py:Class.method"``). Tests are left out: a test module is a list, not a chapter."""
    found = set()
    for path in sorted(project_modules(root).values()):
        name = path.relative_to(root).as_posix()
        if name.startswith("tests/"):
            continue
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            found.add(name)
        found |= {f"{name}:{qualified}" for qualified in long_functions(ast.parse(source, name))}
    return found


def long_functions(tree: ast.AST, prefix: str = ""):
    """The dotted names of the functions under ``tree`` whose body is over ``MAX_BODY_LINES``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qualified = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                if node.end_lineno - node.body[0].lineno + 1 > MAX_BODY_LINES:
                    yield qualified
            yield from long_functions(node, qualified + ".")
        else:
            yield from long_functions(node, prefix)


def in_library(name: str) -> bool:
    top = name.split(".")[0]
    return any(top == entry.removesuffix(".py") for entry in LIBRARY)


def test_no_import_cycle():
    assert cycles(import_graph(ROOT)) == []


def test_the_library_never_imports_the_application():
    graph = import_graph(ROOT)
    library = [name for name in graph if in_library(name)]
    assert {"decoder", "draft_head.head", "mtp.model", "t5.t5"} <= set(
        library
    )  # the walk found the files
    offending = {
        name: sorted(other for other in graph[name] if other.split(".")[0] in APPLICATION)
        for name in library
    }
    assert not {name: others for name, others in offending.items() if others}


def test_the_core_imports_only_itself():
    # decoder/ is copied with one technique folder: it may not need any other folder.
    graph = import_graph(ROOT)
    core = {name: graph[name] for name in graph if name.split(".")[0] == "decoder"}
    assert {"decoder", "decoder.loop", "decoder.cache"} <= set(core)
    outside = {
        name: sorted(o for o in others if o.split(".")[0] != "decoder")
        for name, others in core.items()
    }
    assert not {name: others for name, others in outside.items() if others}


def test_files_and_functions_are_a_size_a_reader_can_hold():
    over = oversized(ROOT)
    assert sorted(over - KNOWN_OVER) == [], "over the size limits"
    assert sorted(KNOWN_OVER - over) == [], "now within the limits: remove from KNOWN_OVER"


def ruff(*args) -> list:
    """The lines ruff prints for ``args``, run on the repository with its ``ruff.toml``."""
    done = subprocess.run([RUFF, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr  # 1: it found something; 2: it could not run
    return done.stdout.splitlines()


@pytest.mark.skipif(not RUFF.exists(), reason="ruff is not installed (requirements-dev.txt)")
def test_ruff_finds_nothing_and_the_tree_is_formatted():
    findings = [line for line in ruff("check", ".", "--output-format", "concise") if ": " in line]
    assert findings == [], "ruff check . found:\n" + "\n".join(findings)
    unformatted = [line for line in ruff("format", "--check", ".") if line.startswith("Would")]
    assert unformatted == [], "ruff format . would change:\n" + "\n".join(unformatted)


def prose_and_code_lines(source: str) -> tuple:
    """``(prose, code)`` line counts: docstring and comment-only lines, and lines with code."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                docstrings |= set(range(body[0].lineno, body[0].end_lineno + 1))
    comments, code = set(), set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments.add(token.start[0])
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code |= set(range(token.start[0], token.end[0] + 1)) - docstrings
    code.discard(len(source.splitlines()) + 1)  # the end marker
    return len(docstrings | (comments - code)), len(code)


def test_the_core_has_comments_at_mlx_lms_density():
    counts = [prose_and_code_lines(path.read_text()) for path in (ROOT / "decoder").glob("*.py")]
    prose, code = sum(p for p, _ in counts), sum(c for _, c in counts)
    assert prose <= MAX_PROSE_PER_CODE_LINE * code, f"{prose} prose lines for {code} code lines"
    # A docstring, a comment line and two code lines, with a trailing comment counted as code.
    sample = '"""Doc."""\n# why\nx = 1  # what\ny = [\n    2,\n]\n'
    assert prose_and_code_lines(sample) == (2, 4)


def arrays_without_dtype(source: str) -> list:
    """Lines of ``mx.array(...)`` calls that name no dtype. Built from a Python list, an array
    takes its dtype from the values: ``mx.array([])`` is float32, and a gather with it raises
    (an empty draft's indices did, #59). Weights converted from ``.numpy()`` keep theirs."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "mx.array"):
            continue
        named = len(node.args) > 1 or any(keyword.arg == "dtype" for keyword in node.keywords)
        converted = node.args and ".numpy()" in ast.unparse(node.args[0])
        if not named and not converted:
            lines.append(node.lineno)
    return lines


def test_arrays_from_host_values_name_their_dtype():
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for folder in ("decoder", "batch", "prompt_lookup", "draft_model", "draft_head", "mtp")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line in arrays_without_dtype(path.read_text())
    }
    assert not found, f"mx.array without a dtype: {sorted(found)}"


def test_folder_readmes_are_front_pages():
    readmes = sorted(ROOT.glob("*/README.md"))
    assert {"constrained", "prompt_lookup", "draft_model", "draft_head", "mtp"} <= {
        path.parent.name for path in readmes
    }
    over = {
        path.parent.name: path.stat().st_size
        for path in readmes
        if path.stat().st_size > MAX_README_BYTES
    }
    assert not over, f"over {MAX_README_BYTES} bytes, move design notes to docs/: {over}"


def test_the_checks_can_fail(tmp_path):
    # A planted cycle through a relative import and a package's submodule, and a library module
    # that imports the application: both are found.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "x.py").write_text("def f():\n    from .y import g\n")
    (tmp_path / "pkg" / "y.py").write_text("from pkg import x\n")
    (tmp_path / "decoder.py").write_text("import loading.sub\n")
    (tmp_path / "loading.py").write_text("import os\n")
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["pkg.x", "pkg.y"]]
    assert graph["decoder"] == {"loading"}
    # A file one line too long, a method whose body is one line too long and one just within the
    # limit; tests/ is left out.
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_BODY_LINES))
    (tmp_path / "pkg" / "z.py").write_text(
        f"class C:\n    def long(self):\n{body}\n        return x0\n"
        f"    def short(self):\n{body}\n" + "\n" * MAX_FILE_LINES
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_big.py").write_text("\n" * (MAX_FILE_LINES + 1))
    assert oversized(tmp_path) == {"pkg/z.py", "pkg/z.py:C.long"}
    # An index array from a list without a dtype; one with it, and a converted weight, pass.
    source = "a = mx.array([1])\nb = mx.array([1], mx.int32)\nc = mx.array(w.float().numpy())\n"
    assert arrays_without_dtype(source) == [1]
