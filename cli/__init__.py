"""Command-line plumbing shared by main.py and convert.py: one-line errors, text in, text out.

- Usage errors are one line (exit status 2); bad input is one line (exit status 1).
- Text (``--prompt``, ``--system``, ``--regex``, a prompt file, stdin) must be UTF-8. Other bytes
  are refused, naming the first bad byte and its offset, before the model loads: guessing an
  encoding would silently change the prompt.
- A closed output pipe (``| head``) ends the run quietly with exit status 141 (128 + SIGPIPE),
  what a shell reports for Unix tools; a failed write (a full disk) is one line, exit status 1.
"""

import argparse
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path

MAX_TEXT_BYTES = 16 << 20  # far above any context window; stops `--prompt-file /dev/zero` early
CLOSED_PIPE_STATUS = 128 + 13  # SIGPIPE


class CliError(Exception):
    """Bad input: printed as one line on stderr, exit status 1."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line instead of argparse's usage block.
        sys.stderr.write(f"error: {message} (see --help)\n")
        sys.exit(2)


def decode_utf8(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CliError(
            f"{source} is not UTF-8 text: byte 0x{data[error.start]:02x} at offset {error.start} "
            "(convert it first, e.g. with iconv -f latin1 -t utf-8)"
        ) from None


def check_text_argument(value, flag: str):
    """Refuse a command-line value that is not UTF-8 (Python passes such argv bytes on as
    surrogates)."""
    if value is not None:
        decode_utf8(value.encode("utf-8", "surrogateescape"), flag)


def check_finite(args):
    """Every float flag must be a finite number (argparse's float() accepts nan and inf)."""
    for name, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise CliError(f"--{name.replace('_', '-')} must be a finite number, not {value}")


def read_text_file(path: str, description: str) -> str:
    """The UTF-8 text of a file, or a CliError saying what is wrong with it."""
    path = Path(path)
    if path.is_dir():
        raise CliError(f"{description} {path} is a directory; give a file path")
    if not path.exists():
        raise CliError(f"{description} not found: {path}")
    try:
        with open(path, "rb") as file:
            return read_text_stream(file, f"{description} {path}")
    except OSError as error:
        raise CliError(f"cannot read {description} {path}: {error.strerror or error}") from None


def read_text_stream(stream, description: str) -> str:
    data = stream.read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES:
        raise CliError(f"{description} is larger than {MAX_TEXT_BYTES >> 20} MiB")
    return decode_utf8(data, description)


def reopen_closed_std_streams():
    """Put /dev/null behind a closed stdin, stdout or stderr (``<&-``, ``>&-``): otherwise the next
    file opened takes its descriptor, and MLX refuses to read a model from descriptor 0."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))


def discard_stdout():
    """Point stdout at /dev/null, so the interpreter's last flush cannot fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


@contextmanager
def writing_output():
    """Turn a failed write to stdout (a full disk) into a CliError; a closed pipe passes through."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as error:
        discard_stdout()
        raise CliError(f"cannot write the output: {error.strerror or error}") from None
