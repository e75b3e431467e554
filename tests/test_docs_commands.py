"""Every command the README and the docs show exists: each entry point parses the flags it is shown
with (argparse stops it right after parsing, so nothing loads or runs), each make target is in the
Makefile, each script is in the tree.

Commands come from code blocks, indented blocks and inline code of the pages; a command with a
``...`` placeholder, or one that first restores a removed script with ``git checkout``, is left out,
and a removed benchmark counts as there where the page says how to bring it back (``git checkout REV
-- benchmarks/NAME.py`` or ``git show REV:benchmarks/NAME.py``); so does a script the page tells the
reader to save (``Save it as `NAME.py```).
"""

import argparse
import contextlib
import importlib.util
import io
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [
        ROOT / "README.md",
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("*/README.md"),
        ROOT / "benchmarks/results/README.md",
    ]
)
PYTHON = {"python", "python3", ".venv/bin/python"}
COMMAND = r"(?:(?:\.venv/bin/)?python3? |make |mlx\.launch |bash )"


def command_lines(text: str) -> list:
    """Shell lines shown on a page: fenced and indented blocks (continuations joined), inline
    code."""
    lines = []
    for block in re.findall(r"^```(?:|sh|bash|shell|console)\n(.*?)^```", text, flags=re.S | re.M):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(rf"^(?: {{4}}|\t)({COMMAND}.*)$", text, flags=re.M)
    lines += re.findall(rf"`({COMMAND}[^`]+)`", text)
    # A placeholder in angle brackets (<embedded gguf>) stands for one argument.
    return [re.sub(r"<[^<>|]+>", "PLACEHOLDER", line.strip().removeprefix("$ ")) for line in lines]


def commands(text: str) -> list:
    """Each command of the page as its argument list (a pipeline's parts apart)."""
    found = []
    for line in command_lines(text):
        if "..." in line or "git checkout" in line:
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # not shell (an unbalanced quote in prose or output)
            continue
        part = []
        for word in words + ["|"]:
            if word in ("|", "&&", ";", "||"):
                if (
                    "--" in part
                    and part[0] in ("mlx.launch", "python")
                    and part[:3] != ["python", "-m", "distributed.launch"]
                ):
                    part = part[part.index("--") + 1 :]  # mlx.launch ... -- python main.py ...
                if (
                    len(part) > 1
                    and (part[0] in PYTHON or part[0] in ("make", "bash"))
                    and part[1] != "-"
                ):
                    found.append(part)
                part = []
            else:
                part.append(word)
    return found


class Parsed(Exception):
    """Raised right after an entry point's arguments parsed."""


def parses(argv: list, page: str = "") -> str:
    """Run the entry point in ``argv`` until its arguments are parsed; "" if they parse, else why
    not. ``page``: the text that shows it (a removed script it says how to restore, or one to
    save)."""
    if argv[0] == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        missing = [target for target in argv[1:] if "=" not in target and target not in targets]
        return f"no make target {missing}" if missing else ""
    if argv[0] == "bash":
        return "" if (ROOT / argv[1]).is_file() else f"no script {argv[1]}"
    args = argv[1:]
    if args[0] == "-m":
        module, args = args[1], args[2:]
        spec = importlib.util.find_spec(module)
        if spec is None:
            path = module.replace(".", "/") + ".py"
            restored = re.search(
                rf"git\s+(checkout\s+\S+\s+--\s+|show\s+\S+:){re.escape(path)}", page
            )
            return "" if restored else f"no module {module}"
        origin = Path(spec.origin)
        if ROOT not in origin.parents or ROOT / ".venv" in origin.parents:
            return ""  # another project's command (mlx_lm.server, pytest): it exists
        if origin.name == "__init__.py" and (origin.parent / "__main__.py").exists():
            origin = origin.parent / "__main__.py"
        run = lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script, args = ROOT / args[0], args[1:]
        if not script.is_file():
            return "" if f"as `{script.name}`" in page else f"no script {script.name}"
        origin = script
        run = lambda: runpy.run_path(str(script), run_name="__main__")  # noqa: E731
    if "parse_args" not in origin.read_text():
        return "" if not args else f"{origin.name} takes no arguments, given {args}"
    saved_argv, stderr = sys.argv, io.StringIO()
    sys.argv = [str(origin)] + args
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            run()
    except Parsed:
        return ""
    except SystemExit as error:  # argparse's: 0 after --help, 2 for flags it refuses
        if not error.code:
            return ""
        return f"exit {error.code}: {stderr.getvalue().strip().splitlines()[-1:] or ''}"
    finally:
        sys.argv = saved_argv
    return f"{origin.name} ran to the end without parsing arguments"


@pytest.fixture
def stop_after_parsing(monkeypatch):
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise Parsed()

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_command_shown_parses(page, stop_after_parsing):
    shown = commands(page.read_text())
    failures = [
        f"{shlex.join(argv)}: {why}" for argv in shown if (why := parses(argv, page.read_text()))
    ]
    assert not failures, "\n".join(failures)


def test_the_check_finds_commands_and_can_fail(stop_after_parsing):
    page = (
        "```\npython main.py --prompt-lookup --ngram-max 2   # fine\n"
        "echo hi | python main.py --no-such-flag\nmake demo\n```\n"
        "    python -m benchmarks.batch --workloads chat\n"
        "Inline: `python -m server --port 0` and `make no-such-target`.\n"
    )
    shown = commands(page)
    assert [argv[:3] for argv in shown] == [
        ["python", "main.py", "--prompt-lookup"],
        ["python", "main.py", "--no-such-flag"],
        ["make", "demo"],
        ["python", "-m", "benchmarks.batch"],
        ["python", "-m", "server"],
        ["make", "no-such-target"],
    ]
    verdicts = [parses(argv) for argv in shown]
    assert verdicts[0] == verdicts[2] == verdicts[3] == verdicts[4] == ""
    assert (
        "unrecognized arguments: --no-such-flag" in verdicts[1] and "no make target" in verdicts[5]
    )
