"""A watchdog process: ends a rank with one line when its peers stop answering.

A rank blocked in a collective sits inside MLX's C++ code holding the GIL, so a
Python thread or signal handler in that process never runs. A separate process
can: the rank writes a byte to it at every step; when none comes for
``timeout`` seconds, the watchdog prints one line and kills the rank. ``pause()``
stops the clock during local work (loading weights) until the next ``beat()``.
When the rank exits, the pipe closes and the watchdog exits too.

This file runs as a script and imports nothing but the standard library.
"""

import os
import select
import signal
import subprocess
import sys


class Watchdog:
    """Args:
    timeout: seconds without a ``beat()`` before this rank is ended.
    rank: named in the message.
    """

    def __init__(self, timeout: float, rank: int):
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(os.getpid()), str(timeout), str(rank)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=sys.stderr,
        )

    def beat(self):
        self._send(b".")

    def pause(self):
        self._send(b"p")

    def _send(self, byte: bytes):
        self.process.stdin.write(byte)
        self.process.stdin.flush()

    def stop(self):
        self.process.stdin.close()
        self.process.wait()


def watch(parent: int, timeout: float, rank: int):
    paused = False
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], None if paused else timeout)
        if not ready:
            sys.stderr.write(
                f"error: rank {rank}: no progress for {timeout:g} s: a peer did not connect or "
                "stopped answering (check the hostfile and that every rank started; "
                "--dist-timeout)\n"
            )
            sys.stderr.flush()
            os.kill(parent, signal.SIGKILL)
            sys.exit(1)
        received = os.read(sys.stdin.fileno(), 4096)
        if not received:  # the rank exited
            return
        paused = received.endswith(b"p")


if __name__ == "__main__":
    watch(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
