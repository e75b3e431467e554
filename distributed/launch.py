"""`mlx.launch` with an exit status: non-zero when any rank fails.

    python -m distributed.launch -n 3 main.py --prompt "Name three colours."

`mlx.launch` stops the other ranks when one fails, but exits 0 itself and says so only in a
coloured `[WARN] Node with rank N exited with code C` line per rank. This wrapper passes every
argument to `mlx.launch` unchanged, passes its output through, replaces those lines with one
`error:` line naming the first rank that failed (none when a rank wrote its own `error:` line), and
exits 1 (or `mlx.launch`'s own non-zero status). It reads `mlx.launch`'s warning text:
tests/test_reliability.py checks that it still does.

`mlx.launch` dies on SIGTERM and leaves its ranks running; this wrapper ends them all (SIGTERM,
SIGINT or SIGHUP to it stops `mlx.launch`'s whole process group).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

# mlx/_distributed_utils/launch.py: log_warning(f"Node with rank {rank} exited with code {code}" or
# "was killed").
RANK_ENDED = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def find_launcher() -> str:
    """`mlx.launch` beside this interpreter (a venv), else on PATH."""
    found = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which(
        "mlx.launch"
    )
    if found is None:
        sys.stderr.write(
            "error: mlx.launch not found (it ships with mlx; activate the environment that has "
            "it)\n"
        )
        sys.exit(1)
    return found


def main(arguments=None) -> int:
    """Run `mlx.launch arguments`; returns the exit status (1 when a rank failed)."""
    arguments = sys.argv[1:] if arguments is None else arguments
    # its own process group, with the ranks it starts: one signal ends them all
    process = subprocess.Popen(
        [find_launcher(), *arguments], stderr=subprocess.PIPE, start_new_session=True
    )

    def stop_group(signum, _frame):
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        sys.exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop_group)
    failures = []  # (rank, how), in the order mlx.launch saw them end
    said = False  # a rank wrote its own one-line error
    # A traceback of mlx.launch's own thread: stopping a rank that had just ended raises there.
    # Held back, and dropped when a rank failed (the line below says what happened).
    traceback, launcher = [], []
    for raw in process.stderr:
        line = raw.decode(errors="replace")
        if traceback or line.startswith("Exception in thread"):
            traceback.append(line)
            if not line.startswith((" ", "Traceback", "Exception in thread")):  # its last line
                launcher, traceback = launcher + traceback, []
            continue
        ended = RANK_ENDED.search(ANSI_COLOUR.sub("", line))
        if ended is None:
            said = said or line.startswith("error: ")
            sys.stderr.write(line)
            sys.stderr.flush()
        else:
            code = ended.group(2)
            failures.append(
                (ended.group(1), "was stopped" if code is None else f"exited with status {code}")
            )
    status = process.wait()
    if not failures:
        sys.stderr.writelines(launcher + traceback)
    if failures and said:
        return 1
    if failures:
        rank, how = failures[0]
        others = (
            f"; mlx.launch then stopped {len(failures) - 1} other rank(s)"
            if len(failures) > 1
            else ""
        )
        sys.stderr.write(f"error: rank {rank} {how}{others}\n")
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
