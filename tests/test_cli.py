"""main.py and convert.py from the command line: JSON fields and one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent
JSON_FIELDS = {
    "text",
    "tokens",
    "prompt_tokens",
    "generation_tokens",
    "target_forward_passes",
    "draft_proposed",
    "draft_accepted",
    "generation_tps",
    "prompt_tps",
    "peak_memory_gb",
    "finish_reason",
    "prompt_cache_tokens",
}


def cli(*args, script="main.py", stdin=""):
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=os.environ.copy(),
        timeout=600,
    )


def assert_one_line_error(result, fragment):
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert fragment in result.stderr, result.stderr


def test_json_answer_has_every_field(embedded):
    result = cli("--prompt", "What is the capital of France? Answer in one sentence.", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert JSON_FIELDS <= data.keys()
    assert "Paris" in data["text"] and data["finish_reason"] == "stop"
    assert data["generation_tokens"] == len(data["tokens"])


def test_prompt_from_stdin_and_length_finish(embedded):
    result = cli("--json", "--max-tokens", "3", stdin="Count from one to ten.")
    data = json.loads(result.stdout)
    assert data["generation_tokens"] == 3 and data["finish_reason"] == "length"


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--model", "/no/such/model"], "model not found"),
        (["--model", "no-such-org/no-such-model-xyz"], "cannot download"),
        (["--prompt-file", "/no/such/prompt.txt"], "prompt file not found"),
        (["--max-tokens", "-1"], "--max-tokens"),
        (["--temp", "-0.5"], "--temp"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--num-draft", "0"], "--num-draft"),
        (["--top-k", "-2"], "--top-k"),
        (["--logit-bias", "{1: 2}"], "--logit-bias"),
        (["--logit-bias", '{"999999999": 2}'], "outside the vocabulary"),
        (["--ngram-min", "4", "--ngram-max", "2"], "--ngram-min"),
        (["--bogus-flag"], "unrecognized arguments"),
        (["--max-tokens", "ten"], "invalid int value"),
        (["--regex", "(abc"], "position"),
        (["--regex", "a{3,1}"], "position"),
        (["--regex", "(?=a)b"], "position"),
        (["--regex", "[^\\s\\S]"], "matches no string"),
        (["--prompt-cache-dir", "x", "--prompt-cache-disk-bytes", "-1"], "--prompt-cache-disk"),
        (["--prompt-cache-dir", "README.md/store"], "cannot be created"),
    ],
)
def test_bad_input_is_one_line(args, fragment, monkeypatch, capsys):
    assert_one_line_error(main_in_process(args, monkeypatch, capsys), fragment)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--kv-bits", "3"], "--kv-bits must be 4 or 8, not 3"),
        (["--kv-group-size", "7"], "--kv-group-size must be 32, 64 or 128, not 7"),
        (["--kv-bits", "8", "--quantized-kv-start", "-1"], "--quantized-kv-start must be >= 0"),
    ],
)
def test_a_kv_width_the_kernels_do_not_take_exits_with_1(args, fragment, monkeypatch, capsys):
    result = main_in_process(args, monkeypatch, capsys)
    assert result.returncode == 1
    assert_one_line_error(result, fragment)


@pytest.mark.parametrize(
    "args,fragment",
    [(["--max-tokens", "-1"], "--max-tokens"), (["--model", "/no/such/model"], "model not found")],
)
def test_bad_input_is_one_line_from_a_new_process(args, fragment):
    """The cases above run in this process, to save starting one each; two run as a user runs
    main.py, where the interpreter's own handling of an uncaught error would show."""
    assert_one_line_error(cli(*args), fragment)


def main_in_process(args, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """main.py's ``main()`` in this process (its stdin: a prompt flag where none is given), as
    ``cli`` reports it."""
    import signal

    import main

    if "--prompt" not in args and "--prompt-file" not in args:
        args = [*args, "--prompt", "Hi."]
    monkeypatch.setattr(sys, "argv", ["main.py", *args])
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # pytest's SIGTERM stays
    with pytest.raises(SystemExit) as exited:
        main.main()
    output = capsys.readouterr()
    return subprocess.CompletedProcess(args, exited.value.code, output.out, output.err)


def test_a_second_run_restores_the_prompt_from_disk(embedded, tmp_path):
    """#57: the prompt's whole blocks are stored by the first run (a cold prefill: the folder is
    new) and restored by the next, which prefills only the rest and writes the same tokens;
    ``prompt_cache_tokens`` says how many."""
    document = " ".join(f"item {index} costs {index * 7 % 100} dollars." for index in range(30))
    args = ["--prompt", f"{document}\nWhat does item 42 cost?", "--max-tokens", "8", "--json"]
    store = ["--prompt-cache-dir", str(tmp_path / "store")]
    first, second = (json.loads(cli(*args, *store).stdout) for _ in range(2))
    assert first["prompt_cache_tokens"] == 0
    assert second["prompt_cache_tokens"] == (second["prompt_tokens"] - 1) // 128 * 128 > 0
    assert first["tokens"] == second["tokens"]


def test_json_schema_true_falls_back_to_the_built_in_compiler_and_gives_json(embedded):
    result = cli(
        "--prompt",
        "Three prime numbers as a JSON array.",
        "--json-schema",
        "true",
        "--json",
        "--max-tokens",
        "40",
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == (
        "note: llguidance refused the schema (Expecting object schema to apply options); "
        "using the built-in compiler\n"
    )
    data = json.loads(result.stdout)
    assert data["finish_reason"] == "stop"
    json.loads(data["text"])  # any JSON value


@pytest.mark.parametrize(
    "args,fragment",
    [
        (
            ["--json-schema", '{"type": "string", "not": {"const": "a"}}'],
            'llguidance refused the schema: Unimplemented keys: ["not"]; the built-in compiler '
            "refused it too: not is",
        ),
        # asked for by name: no fallback
        (
            ["--json-schema", "true", "--json-schema-engine", "llguidance"],
            "error: llguidance refused the schema: Expecting object schema",
        ),
    ],
)
def test_refused_json_schemas_are_one_line(args, fragment, monkeypatch, capsys):
    assert_one_line_error(main_in_process(args, monkeypatch, capsys), fragment)


def test_prompt_longer_than_the_context(embedded, tmp_path, monkeypatch, capsys):
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("word " * 9000)
    result = main_in_process(["--prompt-file", str(long_prompt)], monkeypatch, capsys)
    assert_one_line_error(result, "context is 8192 tokens")


def test_convert_refuses_non_llama_gguf_and_existing_output(tmp_path):
    import mlx.core as mx

    fake = tmp_path / "gpt2.gguf"
    mx.save_gguf(str(fake), {"w": mx.zeros((2, 2))}, {"general.architecture": "gpt2"})
    assert_one_line_error(
        cli("--gguf", str(fake), "--mlx-path", str(tmp_path / "out"), script="convert.py"),
        "only Llama-family GGUF",
    )
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_text("not a gguf")
    assert_one_line_error(
        cli("--gguf", str(not_gguf), "--mlx-path", str(tmp_path / "out"), script="convert.py"),
        "cannot read GGUF",
    )
    assert_one_line_error(
        cli("--gguf", str(fake), "--mlx-path", str(tmp_path), script="convert.py"), "already exists"
    )
