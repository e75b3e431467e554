"""Run the target sharded over several processes or Macs with ``mx.distributed``.

    mlx.launch -n 3 main.py --prompt-lookup             # 3 local ranks (ring backend)
    mlx.launch --hostfile hosts.json main.py --model mlx-community/...

Every rank runs the same decoding loop with the same draft sources and seed;
the target's final hidden states are broadcast from one rank and every rank
applies the output head to them, so every accept decision (and every random
draw) is the same everywhere without extra messages. Only rank 0 prints. See
README.md in this folder.
"""

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import mlx.core as mx

from decoder.pass_cost import PassCost

from .sharding import shard_model
from .watchdog import Watchdog

DEFAULT_TIMEOUT = 120.0  # seconds a rank waits on its peers (connect, each forward pass)
# Variables that fix a BLAS's thread count when it loads; a user who sets one keeps it.
THREAD_VARIABLES = (
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OMP_NUM_THREADS",
)

# Set by mlx.launch (ring, jaccl) or mpirun; without them this is a single process.
RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK")


class DistributedError(Exception):
    """A peer that died, did not connect or cannot hold its shard (shown as one line)."""


def launched_rank() -> Optional[int]:
    """This process's rank as the launcher set it, or None when not launched."""
    for name in RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return None


def local_ranks(rank: int, environ=os.environ) -> int:
    """How many ranks of this launch run on this rank's host (1 when the launcher does not say).

    mpirun says it; for the ring backend, ``mlx.launch`` writes a hostfile with one list of
    ``ip:port`` per rank, and ranks on one host share its addresses.
    """
    if "OMPI_COMM_WORLD_LOCAL_SIZE" in environ:
        return int(environ["OMPI_COMM_WORLD_LOCAL_SIZE"])
    try:
        hosts = json.loads(Path(environ["MLX_HOSTFILE"]).read_text())
        addresses = [{address.rsplit(":", 1)[0] for address in host} for host in hosts]
        return addresses.count(addresses[rank])
    except (KeyError, OSError, ValueError, TypeError, AttributeError, IndexError):
        return 1


def share_cores(local: int, set_blas_threads, environ=os.environ) -> Optional[int]:
    """Split this host's cores between its ``local`` ranks' BLAS threads; returns the count set.

    Each BLAS starts one thread per core; ranks sharing a host then fight over cores, and
    every rank slows down many times over (benchmarks/results/figures.md). An explicit
    OPENBLAS_NUM_THREADS (or MKL_/OMP_NUM_THREADS) is kept. ``set_blas_threads(count) -> bool``
    comes from the application (main.py: ``fast_blas.set_num_threads``).
    """
    if local <= 1 or set_blas_threads is None or any(name in environ for name in THREAD_VARIABLES):
        return None
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    threads = max(1, cores // local)
    return threads if set_blas_threads(threads) else None


def quiet_native_stderr():
    """Send C++-level stderr to /dev/null; Python's ``sys.stderr`` keeps the terminal.

    When a peer dies, MLX's ring threads print a line per failed socket operation
    (about ten per rank); the rank's own one-line error says it better.
    ``MLX_RING_VERBOSE=1`` keeps them.
    """
    if os.environ.get("MLX_RING_VERBOSE"):
        return
    sys.stderr.flush()
    terminal = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    sys.stderr = os.fdopen(terminal, "w", buffering=1)


class SharedPassCost(PassCost):
    """A ``PassCost`` that every rank fits alike: each timing is averaged over the group (one
    scalar all-reduce), so all ranks choose the same draft lengths, as lockstep decoding needs.
    Each rank's own clock would differ a little, and one different choice deadlocks the group."""

    def __init__(self, group, **options):
        super().__init__(**options)
        self.group = group

    def agreed(self, seconds: float) -> float:
        return (
            mx.distributed.all_sum(mx.array(seconds), group=self.group).item() / self.group.size()
        )

    def record(self, seconds: float, width: int, rows: int = 1):
        super().record(self.agreed(seconds), width, rows)

    def record_draft(self, name: str, seconds: float, num_drafted: int):
        super().record_draft(name, self.agreed(seconds), num_drafted)


class Session:
    """This rank's view of the run: the group, the watchdog and sharding."""

    def __init__(self, group, watchdog: Watchdog, timeout: float):
        self.group, self.watchdog, self.timeout = group, watchdog, timeout
        self.rank, self.size = group.rank(), group.size()
        self.last_beat = time.monotonic()
        self.mode = None  # set by shard

    def beat(self):
        """Progress: the watchdog's clock restarts (``stalled_for`` too)."""
        self.last_beat = time.monotonic()
        self.watchdog.beat()

    def stalled_for(self) -> float:
        """Seconds since the last ``beat``."""
        return time.monotonic() - self.last_beat

    def pass_cost(self) -> PassCost:
        """The cost model the loop must use on every rank (``generate_step(pass_cost=...)``)."""
        return SharedPassCost(self.group)

    def fewest(self, count: int) -> int:
        """The smallest of every rank's ``count`` (a prompt store's blocks, which one rank may
        lack: every rank restores as many)."""
        counts = mx.distributed.all_gather(mx.array([count], mx.int32), group=self.group)
        return min(counts.tolist())

    def shard(self, model, mode: str = "auto"):
        """Shard a lazily loaded mlx-lm model in place; the watchdog restarts at its first forward
        pass."""
        try:
            model = shard_model(model, self.group, mode, heartbeat=self.beat)
        except ValueError as error:
            raise DistributedError(str(error)) from None
        self.mode = model.model.mode  # "tensor" or "pipeline"
        return model


def start(
    timeout: float = DEFAULT_TIMEOUT, set_blas_threads=None, rank0_grace: float = 0.0
) -> Optional[Session]:
    """Join the launched group (``None`` when this is the only process).

    Connecting is bounded by ``timeout``: ring's rank 0 would otherwise wait for
    a missing peer forever. Ranks other than 0 print nothing to stdout, and no
    rank reads stdin (give the prompt with --prompt or --prompt-file). Ranks that
    share a host split its cores between their BLAS threads (``share_cores``, when the
    application passes ``set_blas_threads``). Rank 0's watchdog waits ``rank0_grace`` seconds
    more: the server's rank 0 answers its clients before it exits (server/ranks.py).
    """
    rank = launched_rank()
    hostfile = os.environ.get("MLX_HOSTFILE")
    if rank is None or (hostfile and not Path(hostfile).read_text().strip()):  # mlx.launch -n 1
        return None
    quiet_native_stderr()
    watchdog = Watchdog(timeout + (rank0_grace if rank == 0 else 0.0), rank)
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as error:
        raise DistributedError(f"rank {rank}: could not join the group: {error}") from None
    if group.size() == 1:
        watchdog.stop()
        return None
    watchdog.pause()  # loading weights is local work; the clock restarts at the first forward pass
    share_cores(local_ranks(group.rank()), set_blas_threads)
    if group.rank() != 0:
        sys.stdout = open(os.devnull, "w")
    # mlx.launch forwards its stdin but never closes the ranks' end: reading it would wait forever.
    sys.stdin = open(os.devnull)
    return Session(group, watchdog, timeout)


def peer_fault(error: Exception) -> Optional[str]:
    """The one-line message when ``error`` is the backend's about a peer (``[ring] ...``), else
    None."""
    if isinstance(error, DistributedError):
        return str(error)
    message = str(error)
    if not isinstance(error, RuntimeError) or not message.startswith(
        ("[ring]", "[jaccl]", "[mpi]")
    ):
        return None
    if "lost" in message or "closed" in message:
        message = (
            f"lost the connection to a peer; another rank died or the network dropped ({message})"
        )
    return f"rank {launched_rank()}: {message}"


@contextmanager
def reporting_faults():
    """Turn the backend's errors about peers (``[ring] ...``) into one-line DistributedErrors."""
    try:
        yield
    except RuntimeError as error:
        message = peer_fault(error)
        if message is None:
            raise
        raise DistributedError(message) from None
