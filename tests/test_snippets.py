"""The READMEs' Python snippets run as written, and each folder works when copied alone.

A folder's snippet runs in a temporary directory that holds only the core (``CORE``: ``decoder/``),
that folder and the folders it needs (``NEEDS``), as in a user's project with ``mlx``, ``mlx-lm``
and numpy installed: an import of ``loading`` or ``cli`` there fails the test. The model id in the
snippets is swapped for the embedded model's converted directory (no download here).
"""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = [
    "prompt_lookup",
    "constrained",
    "draft_model",
    "draft_head",
    "mtp",
    "distributed",
    "prompt_store",
]
CORE = ["decoder/"]  # what every copied folder needs beside it
NEEDS = {}  # folders a copied folder needs beyond the core
# packages a folder's README lists beyond mlx, mlx-lm and numpy
EXTRAS = {"constrained": ["llguidance"]}
MODEL_ID = "mlx-community/SmolLM2-135M-Instruct"
# mtp/'s snippet loads a checkpoint with MTP layers: a tiny random one stands in for it here
MTP_MODEL_ID = "MiMo-7B-RL"
# Modules of the application (main.py's side) that no copied folder may need.
APPLICATION_MODULES = {"loading", "cli", "main", "convert", "head_training", "batch"}


def python_blocks(readme: Path) -> list:
    return re.findall(r"^```python\n(.*?)^```", readme.read_text(), flags=re.S | re.M)


def readmes_with_snippets() -> list:
    return [ROOT / "README.md", ROOT / "decoder" / "README.md"] + [
        ROOT / folder / "README.md" for folder in FOLDERS
    ]


@pytest.mark.parametrize("readme", readmes_with_snippets(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_readme_opens_with_a_complete_snippet_from_mlx_lm_load(readme):
    blocks = python_blocks(readme)
    assert blocks, f"{readme} has no python snippet"
    model_id = MTP_MODEL_ID if readme.parent.name == "mtp" else MODEL_ID
    assert "from mlx_lm import load" in blocks[0] and f'"{model_id}"' in blocks[0]
    for block in blocks:
        ast.parse(block)


def imported_modules(paths) -> set:
    """Top-level modules that ``paths`` import (absolute imports only)."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("folder", FOLDERS + ["t5"] + CORE)
def test_library_code_never_imports_the_application(folder):
    path = ROOT / folder
    files = list(path.glob("*.py")) if path.is_dir() else [path]
    imported = imported_modules(files) & APPLICATION_MODULES
    assert not imported, f"{folder} imports {imported}"


def installed_closure(names, extras=("cpu",)) -> list:
    """The installed distributions ``names`` need, with what they require in turn (markers evaluated
    here, extras followed): what ``pip install mlx[cpu] mlx-lm numpy`` would bring."""
    import importlib.metadata

    from packaging.requirements import Requirement

    found, todo = {}, [(name, set(extras)) for name in names]
    while todo:
        name, wanted = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in found:
            continue
        try:
            found[key] = dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:  # a platform's own (mlx-metal on Linux)
            continue
        for spec in dist.requires or []:
            requirement = Requirement(spec)
            if requirement.marker is None or any(
                requirement.marker.evaluate({"extra": extra}) for extra in wanted | {""}
            ):
                todo.append((requirement.name, set(requirement.extras)))
    return list(found.values())


def restricted_site(folder: Path, extras=()) -> Path:
    """A folder of links to the installed files of ``mlx``, ``mlx-lm`` and numpy (and ``extras``)
    and what they require, and nothing else (no torch, scipy, ...): a user's environment for copied
    code."""
    folder.mkdir()
    for dist in installed_closure(["mlx", "mlx-lm", "numpy", *extras]):
        for top in {
            Path(str(file)).parts[0] for file in dist.files or [] if not str(file).startswith("..")
        }:
            target = Path(dist.locate_file(top))
            if target.exists() and not (folder / top).exists():
                (folder / top).symlink_to(target)
    return folder


def run_snippet(
    code: str, cwd: Path, model_path: Path, extras=(), model_id=MODEL_ID
) -> subprocess.CompletedProcess:
    """Run ``code`` in ``cwd`` with only mlx, mlx-lm, numpy and what they require importable. The
    runner loads a fast BLAS first, as a user's entry point would, from the repository's
    loading/fast_blas.py under another module name, so an import of ``loading`` in the copied code
    still fails; then it leaves on the path only the copy, those packages (and ``extras``, what a
    folder's README lists) and the standard library. The snippet is unchanged apart from the model
    id."""
    script = cwd / "snippet.py"
    script.write_text(code.replace(model_id, str(model_path)))
    site = cwd.parent / f"{cwd.name}-site"
    if not site.exists():
        restricted_site(site, extras)
    runner = (
        "import importlib, importlib.util, runpy, sys\n"
        "spec = importlib.util.spec_from_file_location('blas_for_the_test', sys.argv[1])\n"
        "blas = importlib.util.module_from_spec(spec); spec.loader.exec_module(blas); blas.load()\n"
        "sys.path[:] = [sys.argv[2], sys.argv[3]] + "
        "[p for p in sys.path if p and 'site-packages' not in p]\n"
        "sys.path_importer_cache.clear(); importlib.invalidate_caches()\n"
        "runpy.run_path('snippet.py', run_name='__main__')\n"
    )
    # -E: no PYTHONPATH.
    return subprocess.run(
        [
            sys.executable,
            "-E",
            "-c",
            runner,
            str(ROOT / "loading" / "fast_blas.py"),
            str(cwd),
            str(site),
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_only_mlx_mlx_lm_and_numpy_are_importable_where_copied_code_runs(tmp_path):
    (tmp_path / "copy").mkdir()
    code = (
        "import importlib.util\n"
        "print([name for name in ('mlx', 'mlx_lm', 'numpy', 'transformers', 'torch', 'llguidance', "
        "'scipy', 'hypothesis', 'starlette') if importlib.util.find_spec(name)])"
    )
    result = run_snippet(code, tmp_path / "copy", Path("unused"))
    assert result.stdout.strip() == "['mlx', 'mlx_lm', 'numpy', 'transformers']", result.stderr[
        -2000:
    ]


def test_the_readme_says_to_copy_what_the_copy_tests_copy():
    readme = (ROOT / "README.md").read_text()
    assert (
        "Copy " + " and ".join(f"`{name}`" for name in CORE) + " and the folders you use" in readme
    )


@pytest.mark.parametrize("folder", FOLDERS + ["t5"])
def test_each_folder_readme_names_what_the_copy_test_copies(folder):
    # Every folder states its copy set in the same words, and it is the one the test below copies.
    text = (ROOT / folder / "README.md").read_text()
    found = re.search(r"\*\*What to copy:\*\* (.*?)this folder(.*?);", text, flags=re.S)
    assert found, f"{folder}/README.md does not say what to copy"
    named = set(re.findall(r"`([\w./]+)`", found.group(1) + found.group(2)))
    assert named == set(CORE) | {f"{need}/" for need in NEEDS.get(folder, [])}


def copy_core(target: Path):
    for core in CORE:
        if core.endswith("/"):
            shutil.copytree(
                ROOT / core, target / core, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(ROOT / core, target)


def mtp_checkpoint(path: Path) -> Path:
    """A tiny MiMo checkpoint whose MTP layer predicts its target exactly, with a tokenizer (its
    vocabulary of 267 tokens fits in the exact wiring's 272 one-hot rows)."""
    from tests.helpers import tiny_byte_tokenizer
    from tests.mtp_fixtures import write_checkpoint

    tokenizer = tiny_byte_tokenizer()
    write_checkpoint(
        path, "mimo", seed=0, exact=True, tokenizer=tokenizer, vocab_size=272, hidden_size=544
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize("folder", FOLDERS)
def test_a_copied_folder_runs_its_readme_snippets(folder, embedded, tmp_path):
    _, _, model_path = embedded
    model_id = MODEL_ID
    if folder == "mtp":
        model_path, model_id = mtp_checkpoint(tmp_path / "checkpoint"), MTP_MODEL_ID
    copy = tmp_path / "project"
    copy_core(copy)
    for name in [folder] + NEEDS.get(folder, []):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    for code in python_blocks(ROOT / folder / "README.md"):
        result = run_snippet(code, copy, model_path, EXTRAS.get(folder, ()), model_id)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.strip(), "the snippet printed nothing"
        if folder == "mtp":  # greedy output unchanged, in fewer passes than tokens
            same, _, passes, _ = result.stdout.split()
            assert same == "True" and int(passes) < 32, result.stdout
        quoted = re.search(
            r"This should give the output:\n\n```\n(.*?)```",
            ROOT.joinpath(folder, "README.md").read_text(),
            flags=re.S,
        )
        if quoted:  # what the README quotes, up to the counts that follow the measured costs
            said = quoted.group(1).split(" - ")[0]
            assert result.stdout.split(" - ")[0] == said, result.stdout


@pytest.mark.slow
def test_the_top_readme_snippets_run(embedded, tmp_path):
    _, _, model_path = embedded
    for folder in FOLDERS + ["t5", "batch"]:  # batch/: the batching page's example
        shutil.copytree(
            ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    copy_core(tmp_path)
    # each block once: docs/library.md opens with the README's
    blocks = [
        block
        for page in ("README.md", "docs/library.md", "docs/batching.md")
        for block in python_blocks(ROOT / page)
    ]
    for code in dict.fromkeys(blocks):
        result = run_snippet(code, tmp_path, model_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.strip()


BATCH_LOOKUP_IS_LOSSLESS = """
import sys
from mlx_lm import load

from batch import batch_generate
from decoder import generate
from prompt_lookup import PromptLookupSource

model, tokenizer = load("mlx-community/SmolLM2-135M-Instruct")
prompts = [
    "Copy these lines: " + ", ".join(f"row {i} holds {i * 7 % 13} parcels" for i in range(10)),
    "Repeat exactly: red, green, blue, cyan, magenta, yellow, black.",
    "What is the capital of France? Answer in one sentence.",
]
sources = [[PromptLookupSource()] for _ in prompts]
result = batch_generate(model, tokenizer, prompts, draft_sources=sources, max_tokens=40)
for prompt, tokens in zip(prompts, result.tokens):
    assert tokens == generate(model, tokenizer, prompt, max_tokens=40).tokens, prompt
assert sum(stats.draft_accepted for stats in result.row_stats) > 0, "lookup drafted nothing"
assert not [name for name in sys.modules if name.split(".")[0] in ("draft_model", "t5")]
assert "prompt_lookup.history" not in sys.modules, "history lookup imported, though unused"
print(result.stats.passes, sum(len(tokens) for tokens in result.tokens))
"""


@pytest.mark.slow
def test_decoder_batch_and_prompt_lookup_alone_batch_losslessly(embedded, tmp_path):
    # The smallest batched copy (#60): three folders in an empty project, no technique folder.
    # (The smallest copy of all, decoder/ and prompt_lookup/, runs prompt_lookup/README.md in
    # test_a_copied_folder_runs_its_readme_snippets.)
    _, _, model_path = embedded
    for folder in ["decoder", "batch", "prompt_lookup"]:
        shutil.copytree(
            ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    result = run_snippet(BATCH_LOOKUP_IS_LOSSLESS, tmp_path, model_path)
    assert result.returncode == 0, result.stderr[-3000:]
    passes, tokens = map(int, result.stdout.split())
    assert passes < tokens


@pytest.mark.slow
def test_the_decoder_readme_runs_with_decoder_alone_and_prints_what_it_says(embedded, tmp_path):
    _, _, model_path = embedded
    copy_core(tmp_path)
    readme = (ROOT / "decoder" / "README.md").read_text()
    (code,) = python_blocks(ROOT / "decoder" / "README.md")
    result = run_snippet(code, tmp_path, model_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"```\n{result.stdout}```" in readme, result.stdout
