"""Serving one model from several ranks (``mlx.launch``): rank 0 hears the clients, and every rank
runs the same batch in lockstep.

Only rank 0 listens for HTTP. Before each step it sends the other ranks what only it heard since the
last one: the requests that join (their tokens and settings; each rank compiles their constraints
itself) and the rows whose clients left. Everything else follows on every rank from the same
inputs, as in main.py's lockstep decoding: the draws (one shared seed at start, then each request's
own), the drafts and accept decisions (``SharedPassCost``), the prompt cache's hits (its entries are
weighed by the largest rank's bytes, ``weigh``). A step with nothing to say costs one scalar
all-reduce; one with news, a second all-reduce of its pickled bytes (docs/distributed.md).

When a peer dies, its socket closes and the step raises on every live rank; when a peer stalls, its
watchdog ends it. Either way rank 0 answers every open request with an error and the launch exits
non-zero, with one line.
"""

import os
import pickle
import random
import sys
import threading
import time
from typing import Optional

import mlx.core as mx

IDLE_WAIT_S = 0.05
STALL_CHECK_S = 0.5  # how often rank 0's monitor looks at the time since the last step
# Rank 0 answers its clients, then exits; its watchdog allows this much more than --dist-timeout.
ANSWER_GRACE_S = 3.0


class OneProcess:
    """The engine's view of its ranks when there is one: nothing to share, nobody to wait for."""

    rank = 0
    idle_wait = None  # an idle engine blocks until a request comes

    def share(self, message, failed: bool = False):
        return message

    def weigh(self, nbytes: int) -> int:
        return nbytes

    def lost_peer(self, error: Exception) -> Optional[str]:
        return None

    def watch(self, on_stall):
        pass


class Lockstep:
    """Rank 0's news for every rank, once per step, over ``session``'s group
    (``distributed.start``).

    Args:
        session: this rank's ``distributed.Session``; each exchange is progress for its watchdog.
    """

    def __init__(self, session):
        self.session, self.group, self.rank = session, session.group, session.rank
        # An idle group exchanges this often: each rank waits outside the collective (whose wait
        # spins a core) and sees progress for its watchdog; a request waits at most this long.
        self.idle_wait = IDLE_WAIT_S
        # Unseeded requests draw from the global key; every rank must start it alike.
        seed = random.getrandbits(31) if self.rank == 0 else 0
        mx.random.seed(self._sum(seed))

    def _sum(self, value: int) -> int:
        return mx.distributed.all_sum(mx.array(value), group=self.group).item()

    def share(self, message, failed: bool = False):
        """Rank 0's ``message`` (any picklable object, or None for no news) on every rank.

        ``failed``: this rank's last step raised. A step that fails on every rank fails alike (the
        engine answers its rows with errors and goes on); one that fails on some ranks only has
        put the ranks out of step, and that is a ``DistributedError``.
        """
        from distributed import DistributedError, reporting_faults

        with reporting_faults():
            data = pickle.dumps(message) if self.rank == 0 and message is not None else b""
            header = mx.array([len(data), int(failed)])
            size, failures = mx.distributed.all_sum(header, group=self.group).tolist()
            if failures not in (0, self.session.size):
                raise DistributedError(
                    f"rank {self.rank}: a step failed on {failures} of {self.session.size} ranks, "
                    "so they are out of step (see the traceback above)"
                )
            if size:
                # the others add zeros: rank 0's bytes arrive unchanged
                array = mx.array(memoryview(data)) if self.rank == 0 else mx.zeros(size, mx.uint8)
                received = mx.distributed.all_sum(array, group=self.group)
                # memoryview reads the buffer as it is (bytes() would read it item by item)
                message = pickle.loads(memoryview(received))
        self.session.beat()
        return message if size else None

    def weigh(self, nbytes: int) -> int:
        """The most bytes any rank holds for a prompt-cache entry: shards differ in size (pipeline
        stages hold different layers), and every rank must evict the same entries."""
        return mx.distributed.all_max(mx.array(nbytes), group=self.group).item()

    def lost_peer(self, error: Exception) -> Optional[str]:
        """The one-line reason when ``error`` means a peer is gone, else None."""
        from distributed import peer_fault

        return peer_fault(error)

    def watch(self, on_stall):
        """On rank 0, call ``on_stall(message)`` once no step has made progress for
        ``--dist-timeout`` (a peer stopped answering; its collective waits, the HTTP side runs)."""
        if self.rank != 0:
            return
        timeout = self.session.timeout

        def monitor():
            while self.session.stalled_for() < timeout:
                time.sleep(STALL_CHECK_S)
            on_stall(
                f"rank 0: no progress for {timeout:g} s: a peer stopped answering (--dist-timeout)"
            )

        threading.Thread(target=monitor, name="stall monitor", daemon=True).start()


def exit_after_answering(message: str):
    """Leave the event loop a moment to send the errors already queued, then end this rank with
    ``message`` as its one line: mlx.launch then stops the other ranks."""
    time.sleep(0.5)
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    os._exit(1)
