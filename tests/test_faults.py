"""Fault injection: hostile input, killed and concurrent conversions, damaged caches, closed pipes.

Every case must end in one line on stderr and a non-zero exit, or in correct output. A tiny GGUF
(one layer, a 258-token byte vocabulary) stands in for the embedded model, so a conversion takes
a fraction of a second; subprocesses are used only where a process boundary is the point.
"""

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import ScriptedSource, start_process, stop, tiny_byte_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def write_tiny_gguf(path: Path):
    """A one-layer Llama GGUF with a byte-level BPE vocabulary: 256 bytes, one merge and an EOS."""
    from constrained.token_index import gpt2_unicode_to_byte

    alphabet = {byte: char for char, byte in gpt2_unicode_to_byte().items()}
    tokens = [alphabet[byte] for byte in range(256)] + ["ab", "<eos>"]
    hidden, intermediate, vocab = 32, 64, len(tokens)
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (16, hidden),
        "blk.0.attn_v.weight": (16, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (intermediate, hidden),
        "blk.0.ffn_up.weight": (intermediate, hidden),
        "blk.0.ffn_down.weight": (hidden, intermediate),
    }
    mx.random.seed(0)
    weights = {name: mx.random.normal(shape) * 0.5 for name, shape in shapes.items()}

    def integer(value):
        return mx.array(value, dtype=mx.uint32)

    metadata = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "llama.attention.head_count": integer(4),
        "llama.attention.head_count_kv": integer(2),
        "llama.embedding_length": integer(hidden),
        "llama.feed_forward_length": integer(intermediate),
        "llama.block_count": integer(1),
        "llama.context_length": integer(4096),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
        "llama.rope.freq_base": mx.array(10000.0),
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [f"{alphabet[97]} {alphabet[98]}"],
        "tokenizer.ggml.token_type": mx.array([1] * 257 + [3], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": integer(257),
        "tokenizer.ggml.eos_token_id": integer(257),
    }
    mx.save_gguf(str(path), weights, metadata)
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_model(tiny_gguf, tmp_path_factory):
    """The tiny GGUF converted by the conversion code path (so it has checksums.json)."""
    from loading.conversion import convert

    return convert(str(tmp_path_factory.mktemp("model") / "tiny"), gguf=str(tiny_gguf))


def run(args, script="main.py", stdout=subprocess.PIPE):
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        timeout=300,
    )


def assert_one_line_error(result, fragment):
    stderr = (
        result.stderr.decode(errors="replace")
        if isinstance(result.stderr, bytes)
        else result.stderr
    )
    assert result.returncode not in (0, None), stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert fragment in stderr, stderr


# ---------------------------------------------------------------------------------------------
# The model cache: concurrent first use, kills, an unwritable cache, damage.

# Converts the embedded model into $XDG_CACHE_HOME as main.py would, with the tiny GGUF standing in.
# With $HOLD set, each process announces itself there once its conversion has started and waits for
# a "go" file, so the test decides when the race (or the kill) happens.
CACHE_RUN = """
import os, sys, time
from pathlib import Path
import loading.conversion as conversion
import loading.load as loading

loading.embedded_gguf = lambda: Path(os.environ["TINY_GGUF"])
if os.environ.get("HOLD"):
    read_gguf = conversion.read_gguf

    def held_read(path):
        Path(os.environ["HOLD"], f"started-{os.getpid()}").touch()
        while not Path(os.environ["HOLD"], "go").exists():
            time.sleep(0.02)
        return read_gguf(path)

    conversion.read_gguf = held_read
print(loading.default_model_path())
"""


@pytest.fixture
def cache_env(tmp_path, tiny_gguf):
    """A private cache and temporary directory; returns (env, models_dir, tmp_dir, hold_dir)."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "hold").mkdir()
    env = {
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "TMPDIR": str(tmp_path / "tmp"),
        "TINY_GGUF": str(tiny_gguf),
        "PYTHONPATH": str(ROOT),
    }
    return env, tmp_path / "cache" / "mlx-decoding" / "models", tmp_path / "tmp", tmp_path / "hold"


@pytest.fixture
def start_cache_run():
    """Starts a CACHE_RUN child (``start(env, hold=None)``); each is stopped when the test ends, on
    every path (a conversion waiting on ``hold`` would otherwise wait for ever)."""
    started = []

    def start(env, hold=None):
        env = {**os.environ, **env, **({"HOLD": str(hold)} if hold else {})}
        command = [sys.executable, "-c", CACHE_RUN]
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        started.append(start_process(command, cwd=ROOT, env=env, **pipes))
        return started[-1]

    yield start
    for process in started:
        stop(process)


def wait_for(condition, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def leftovers(*directories):
    return [
        entry.name
        for directory in directories
        if directory.exists()
        for entry in directory.iterdir()
        if ".converting-" in entry.name or ".removing-" in entry.name
    ]


def test_concurrent_first_use_shares_one_copy(cache_env, start_cache_run):
    from loading.store import verify_checksums

    env, models, tmp, hold = cache_env
    processes = [start_cache_run(env, hold) for _ in range(2)]
    # Both are converting into their own staging directories before either finishes.
    wait_for(lambda: len(list(hold.glob("started-*"))) == 2)
    assert len(leftovers(models)) == 2
    (hold / "go").touch()
    outputs = [process.communicate(timeout=300) for process in processes]
    for process, (stdout, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr.decode()
        assert stderr == b""
    paths = {stdout.decode().strip() for stdout, _ in outputs}
    assert len(paths) == 1
    path = Path(paths.pop())
    assert (path / "config.json").is_file() and verify_checksums(path) is None
    assert leftovers(models, tmp) == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_killed_conversion_leaves_nothing(cache_env, start_cache_run, sig):
    env, models, tmp, hold = cache_env
    process = start_cache_run(env, hold)
    wait_for(lambda: list(hold.glob("started-*")))
    assert len(leftovers(models)) == 1
    process.send_signal(sig)
    process.communicate(timeout=60)
    if sig != signal.SIGKILL:  # a signal Python sees: the process cleans up after itself
        assert leftovers(models) == []
        return
    rerun = start_cache_run(env)
    stdout, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr.decode()
    assert (Path(stdout.decode().strip()) / "config.json").is_file()
    assert leftovers(models, tmp) == []


def test_unwritable_cache_converts_into_a_temporary_directory(cache_env, start_cache_run, tmp_path):
    env, models, tmp, _ = cache_env
    (tmp_path / "a-file").write_text("")
    env = {**env, "XDG_CACHE_HOME": str(tmp_path / "a-file" / "cache")}  # unwritable, even for root
    process = start_cache_run(env)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr.decode()
    lines = stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: cannot write the model cache"), lines
    assert Path(stdout.decode().strip()).parent == tmp
    assert list(tmp.iterdir()) == []  # removed at exit


def dead_pid() -> int:
    process = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(process.stdout)


def test_damaged_cache_is_converted_again(tmp_path, tiny_gguf, monkeypatch, capsys):
    import loading.load as loading

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(loading, "embedded_gguf", lambda: tiny_gguf)
    path = loading.default_model_path()
    weights = path / "model.safetensors"
    original = weights.read_bytes()
    flip_bytes(weights, len(original) // 2)
    assert capsys.readouterr().err == ""
    assert loading.default_model_path() == path
    assert "is damaged (model.safetensors changed" in capsys.readouterr().err
    assert weights.read_bytes() == original
    (path / "config.json").unlink()  # a half-deleted copy
    assert loading.default_model_path() == path and (path / "config.json").is_file()
    (path / "checksums.json").unlink()  # every copy we convert has one: without it, convert again
    assert loading.default_model_path() == path and (path / "checksums.json").is_file()
    assert leftovers(path.parent) == []


def test_full_disk_during_conversion_is_one_error_and_no_leftover(tmp_path, tiny_gguf, monkeypatch):
    import errno

    import loading.load as loading

    def disk_full(directory):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(loading, "embedded_gguf", lambda: tiny_gguf)
    monkeypatch.setattr(loading, "write_checksums", disk_full)
    with pytest.raises(loading.ModelError, match="No space left on device"):
        loading.default_model_path()
    assert list((tmp_path / "mlx-decoding" / "models").iterdir()) == []


def test_unknown_home_is_model_not_found():
    from loading.load import ModelError, resolve_model_path

    with pytest.raises(ModelError, match="model not found"):
        resolve_model_path("~no-such-user-xyz/model")


def flip_bytes(file: Path, offset: int):
    """Same-size damage, as a bad disk or a stray write would do."""
    with open(file, "r+b") as handle:
        handle.seek(offset)
        data = handle.read(16)
        handle.seek(offset)
        handle.write(bytes(255 - b for b in data))


def test_damaged_user_model_is_refused(tiny_model, tmp_path):
    import shutil

    from loading.load import ModelError, load_model

    copy = Path(shutil.copytree(tiny_model, tmp_path / "copy"))
    load_model(str(copy))  # copied with new times: rehashed, and fine
    flip_bytes(copy / "model.safetensors", 1000)
    with pytest.raises(ModelError, match="damaged"):
        load_model(str(copy))
    (copy / "checksums.json").write_text("{not json")
    with pytest.raises(ModelError, match="checksums.json is unreadable"):
        load_model(str(copy))


def test_stale_staging_of_a_dead_process_is_swept(tmp_path):
    from loading.store import sweep

    dead = dead_pid()
    (tmp_path / f"model.converting-{dead}").mkdir()
    (tmp_path / f"model.converting-{os.getpid()}").mkdir()  # alive: ours
    (tmp_path / f"notes.converting-{dead}.txt").write_text("not ours")
    sweep(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"model.converting-{os.getpid()}",
        f"notes.converting-{dead}.txt",
    ]


# ---------------------------------------------------------------------------------------------
# convert.py: everything it cannot do is refused before any work, in one line.


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--mlx-path", "/proc/no-such-dir/out"], "cannot write /proc/no-such-dir/out"),
        (["--mlx-path", "{file}/out"], "Not a directory"),
        (["--mlx-path", "{tmp}/q7", "-q", "--q-bits", "7"], "--q-bits 7"),
        (["--mlx-path", "{tmp}/g0", "-q", "--q-group-size", "0"], "--q-group-size 0"),
        (["--mlx-path", "{tmp}/l0", "--num-layers", "0"], "--num-layers"),
        (["--mlx-path", "{tmp}/o", "--bogus"], "unrecognized arguments"),
        (["--mlx-path", "{tmp}/o", "--q-bits", "four"], "invalid int value"),
    ],
)
def test_convert_refuses_in_one_line(args, fragment, tiny_gguf, tmp_path):
    (tmp_path / "file").write_text("")
    args = [arg.format(file=tmp_path / "file", tmp=tmp_path) for arg in args]
    assert_one_line_error(run(["--gguf", str(tiny_gguf), *args], script="convert.py"), fragment)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


# ---------------------------------------------------------------------------------------------
# main.py input: bytes that are not UTF-8, non-finite and out-of-range numbers (in process: main()
# is what a subprocess would run, minus the seconds of imports).


def run_main(monkeypatch, capsys, args, stdin_bytes=None):
    import main

    monkeypatch.setattr(sys, "argv", ["main.py", *args])
    if stdin_bytes is not None:
        stdin = io.TextIOWrapper(io.BytesIO(stdin_bytes))
        stdin.isatty = lambda: False
        monkeypatch.setattr(sys, "stdin", stdin)
    with pytest.raises(SystemExit) as exit_info:
        main.main()
    return exit_info.value.code, capsys.readouterr().err


def refuse_loading(monkeypatch):
    """Fail the test if main.py loads a model."""
    import cli.sources
    import loading.load as loading

    for module in (loading, cli.sources):  # cli.sources binds the name when it is first imported
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("loaded the model"))


@pytest.mark.parametrize(
    "args,stdin,fragment",
    [
        (["--prompt-file", "{latin1}"], None, "is not UTF-8 text: byte 0xe9 at offset 3"),
        (["--prompt-file", "/bin/ls"], None, "is not UTF-8 text: byte 0x"),
        (["--prompt-file", "{tmp}"], None, "is a directory"),
        (["--prompt-file", "{tmp}/missing.txt"], None, "prompt file not found"),
        (["--prompt", "caf\udce9"], None, "--prompt is not UTF-8 text: byte 0xe9 at offset 3"),
        (["--system", "\udcff"], None, "--system is not UTF-8 text: byte 0xff at offset 0"),
        (["--regex", "a\udcc3"], None, "--regex is not UTF-8 text"),
        (
            ["--json-schema", '{"const": "caf\udce9"}'],
            None,
            "--json-schema is not UTF-8 text: byte 0xe9",
        ),
        ([], b"caf\xe9 au lait", "stdin is not UTF-8 text: byte 0xe9 at offset 3"),
        (["--temp", "nan"], None, "--temp must be a finite number"),
        (["--temp", "inf"], None, "--temp must be a finite number"),
        (["--temp", "1e-40"], None, "--temp must be 0"),
        (["--top-p", "nan"], None, "--top-p must be a finite number"),
        (["--seed", "-1"], None, "--seed must be in [0, 2**64)"),
        (["--seed", "99999999999999999999"], None, "--seed must be in [0, 2**64)"),
        (["--num-draft", "99999999999"], None, "--num-draft must be between"),
        (["--ngram-max", "99999999999"], None, "ngram-max <= 256"),
        (["--grammar", "{tmp}"], None, "is a directory; give a file path"),
        (["--lookup-history", "{latin1}/store.npz"], None, "latin1.txt is not a directory"),
    ],
)
def test_bad_input_is_one_line_before_loading(args, stdin, fragment, tmp_path, monkeypatch, capsys):
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    args = [
        arg.replace("{latin1}", str(tmp_path / "latin1.txt")).replace("{tmp}", str(tmp_path))
        for arg in args
    ]
    refuse_loading(monkeypatch)
    code, stderr = run_main(monkeypatch, capsys, args, stdin)
    assert code == 1 and stderr.count("\n") == 1 and fragment in stderr, stderr


# Paths the user gave are theirs: refused in one line that never says to delete them, and left as
# they were. Only a file the tool made in its own cache may be called deletable.


def test_a_folder_for_lookup_history_is_one_line_and_left_alone(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "some" / "folder"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    refuse_loading(monkeypatch)
    code, stderr = run_main(monkeypatch, capsys, ["--lookup-history", str(folder)])
    assert code == 1 and stderr.count("\n") == 1, stderr
    assert (
        f"--lookup-history {folder} is a directory; give a file path" in stderr
        and "delete" not in stderr
    )
    assert [p.name for p in folder.iterdir()] == ["notes.txt"] and (
        folder / "notes.txt"
    ).read_text() == "mine"


def test_a_users_file_that_is_not_a_store_is_not_called_deletable(
    tiny_model, tmp_path, monkeypatch, capsys
):
    notes = tmp_path / "notes.npz"
    notes.write_bytes(b"my own notes")
    args = ["--model", str(tiny_model), "--prompt", "hi", "--lookup-history", str(notes)]
    code, stderr = run_main(monkeypatch, capsys, args)
    assert code == 1 and stderr.count("\n") == 1, stderr
    assert (
        "is not a history store" in stderr
        and "give another path" in stderr
        and "delete" not in stderr
    )
    assert notes.read_bytes() == b"my own notes"


def test_a_damaged_store_in_the_tools_own_cache_may_be_deleted(
    tiny_model, tmp_path, monkeypatch, capsys
):
    store = tmp_path / "mlx-decoding" / "history" / "store.npz"
    store.parent.mkdir(parents=True)
    store.write_bytes(b"damaged")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, stderr = run_main(
        monkeypatch, capsys, ["--model", str(tiny_model), "--prompt", "hi", "--lookup-history"]
    )
    assert code == 1 and stderr.count("\n") == 1, stderr
    assert f"{store} is not a history store" in stderr and "delete it to start a new one" in stderr


def test_undecodable_argv_from_a_real_command_line(tiny_model):
    # The in-process cases above stand for what Python makes of argv bytes; check that here once.
    result = run(["--model", str(tiny_model), "--prompt", os.fsdecode(b"caf\xe9")])
    assert_one_line_error(result, "--prompt is not UTF-8 text: byte 0xe9 at offset 3")


def test_constraint_error_is_one_line(monkeypatch, capsys):
    import main
    from decoder import ConstraintError

    def fail(args):
        raise ConstraintError("no allowed token")

    monkeypatch.setattr(main, "run", fail)
    code, stderr = run_main(monkeypatch, capsys, [])
    assert code == 1 and stderr == "error: no allowed token\n"


# ---------------------------------------------------------------------------------------------
# main.py output: a reader that went away, a full disk.


def test_closed_pipe_exits_quietly(tiny_model):
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head -c 10` once head has exited
    try:
        result = run(["--model", str(tiny_model), "--max-tokens", "20"], stdout=write_end)
    finally:
        os.close(write_end)
    assert result.returncode == 141 and result.stderr == b"", result.stderr.decode()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_full_disk_is_one_line(tiny_model):
    with open("/dev/full", "wb") as full:
        result = run(["--model", str(tiny_model), "--max-tokens", "5", "--json"], stdout=full)
    assert_one_line_error(result, "cannot write the output: No space left on device")


# ---------------------------------------------------------------------------------------------
# The constrained loop under any logits: only allowed tokens, or a clean ConstraintError.


class ScoresModel:
    """A stand-in target that returns whatever rows of scores it is given, in turn."""

    def __init__(self, rows: np.ndarray):
        self.layers = [None]  # one KV cache, which the loop trims like a real one
        self.rows = rows
        self.used = 0

    def __call__(self, inputs, cache=None):
        count = inputs.shape[1]
        picks = (self.used + np.arange(count)) % len(self.rows)
        self.used += count
        for layer_cache in cache:  # write the cache so that trimming has something to trim
            layer_cache.update_and_fetch(mx.zeros((1, 1, count, 1)), mx.zeros((1, 1, count, 1)))
        return mx.array(self.rows[picks])[None]


PATTERNS = [r"[ab]{2,6}", r"name: (ab|12)+-0", r"\d{3}-\d{2}"]
_tokenizer = None


def constraint_for(pattern, cache_dir):
    global _tokenizer
    from constrained import RegexConstraint

    _tokenizer = _tokenizer or tiny_byte_tokenizer()
    return RegexConstraint.from_regex(
        pattern, _tokenizer, vocab_size=len(_tokenizer), cache_dir=cache_dir
    )


@st.composite
def score_rows(draw, vocab_size):
    """Rows of logits: finite noise, with some rows or entries NaN, -inf or +inf."""
    count = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = rng.normal(
        scale=draw(st.sampled_from([0.1, 3.0, 30.0])), size=(count, vocab_size)
    ).astype(np.float32)
    for row in rows:
        kind = draw(st.sampled_from(["finite", "nan", "-inf", "spotted"]))
        if kind in ("nan", "-inf"):
            row[:] = float(kind)
        elif kind == "spotted":
            spots = rng.random(vocab_size) < draw(st.sampled_from([0.1, 0.5, 0.95]))
            row[spots] = rng.choice(
                np.array([np.nan, -np.inf, np.inf], dtype=np.float32), spots.sum()
            )
    return rows


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_constrained_loop_emits_only_allowed_tokens_or_fails_cleanly(data, tmp_path):
    from constrained import ForcedTextSource
    from decoder import ConstraintError, Sampling, generate_step

    pattern = data.draw(st.sampled_from(PATTERNS))
    constraint = constraint_for(pattern, tmp_path)
    vocab_size = len(_tokenizer)
    rows = data.draw(score_rows(vocab_size))
    drafts = data.draw(
        st.lists(st.lists(st.integers(0, vocab_size - 1), max_size=4), min_size=1, max_size=4)
    )
    scripted = ScriptedSource(
        lambda tokens, max_draft: drafts[len(tokens) % len(drafts)][:max_draft]
    )
    sources = data.draw(st.sampled_from([[], [scripted], [ForcedTextSource(constraint), scripted]]))
    temp, top_p = data.draw(st.sampled_from([(0.0, 1.0), (1.0, 1.0), (0.7, 0.9)]))
    mx.random.seed(data.draw(st.integers(0, 2**32 - 1)))

    emitted = []
    try:
        for token, _ in generate_step(
            [0],
            ScoresModel(rows),
            draft_sources=sources,
            constraint=constraint,
            sampling=Sampling(temp, top_p),
            max_tokens=12,
            eos_token_ids=[_tokenizer.eos_token_id],
        ):
            emitted.append(token)
    except ConstraintError:
        assert not np.isfinite(rows).all(), "failed although every score was finite"
    replay = constraint_for(pattern, tmp_path)
    state = replay.index.start
    for token in emitted:
        state = replay.index.next_state(state, token)
        assert state >= 0, f"{emitted} breaks {pattern}"


def test_nan_scores_do_not_hide_a_finite_allowed_token(tmp_path):
    from decoder import Sampling, generate_step

    constraint = constraint_for(r"[ab]", tmp_path)
    vocab_size = len(_tokenizer)
    row = np.zeros(vocab_size, dtype=np.float32)
    row[ord("a")] = np.nan  # allowed, but no score
    row[ord("z")] = 50.0  # the best score, but forbidden
    mx.random.seed(0)
    for temp in (0.0, 1.0):
        tokens = [
            token
            for token, _ in generate_step(
                [0],
                ScoresModel(row[None]),
                constraint=constraint,
                sampling=Sampling(temp),
                max_tokens=1,
                eos_token_ids=(),
            )
        ]
        assert tokens == [ord("b")]
