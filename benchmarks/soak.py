"""The server soak (issue #59) at length: tests/soak.py's random valid requests, more rounds and
more of them than the suite sends, against each of its servers (tiny models drafting with prompt
lookup, a draft head, a draft model and MTP layers).

    flock /tmp/mlxdec-test.lock python -m benchmarks.soak [--requests 200 --rounds 3 --seed 0]

Reports per server the requests sent, the answers by status (400: the requests invalid on
purpose), the failures (problems: any other status, a broken constraint, a token outside its
filters, a greedy answer unlike the same request alone, anything left open), the time and the RSS
growth over the last round. Writes benchmarks/results/soak.md; exits 1 if any problem was found.
"""

import argparse
import logging
import tempfile
import time
from pathlib import Path

from server.__main__ import exit_now
from tests import soak

RESULTS = Path(__file__).parent / "results" / "soak.md"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="Requests per round.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--servers", default=",".join(soak.SERVERS))
    return parser.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.ERROR)  # refusals on purpose are warnings: not shown
    rows, problems, started = [], [], time.perf_counter()
    for kind in args.servers.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            report = soak.soak(kind, Path(tmp), args.requests, args.seed, args.rounds)
        failed = len(report["problems"]) + bool(report["left_open"]) + (report["health"] != 200)
        statuses = ", ".join(f"{n} x {s}" for s, n in sorted(report["statuses"].items()))
        rows.append(
            f"| {kind} | {soak.SERVERS[kind]['tree_nodes']} | {report['requests']} | {statuses} | "
            f"{report['hung_up']} | {report['greedy_checked_alone']} | {failed} | "
            f"{report['seconds']:.1f} | {report['rss_growth_mib']:.1f} |"
        )
        problems += [f"{kind}: {line}" for line in report["problems"]]
        print(rows[-1], flush=True)
    command = (
        f"python -m benchmarks.soak --requests {args.requests} --rounds {args.rounds} "
        f"--seed {args.seed}"
    )
    lines = [
        "# Server soak (#59)",
        "",
        f"`{command}`: tiny random models on this 2-core CPU, concurrent random valid requests "
        "from 10 threads (tests/soak.py), "
        f"{time.perf_counter() - started:.0f} s in all. 400s are the requests invalid on purpose; "
        "*failed* counts every other status, broken constraint, token outside its filters, greedy "
        "answer unlike the same request alone, and anything left open. RSS: growth over the last "
        "round.",
        "",
        "| server | tree nodes | requests | answers | hung up | greedy checked alone | failed | "
        "seconds | RSS growth MiB |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        *(["Problems:", "", *[f"- {line}" for line in problems]] if problems else []),
    ]
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")
    exit_now(1 if problems else 0)  # the engines' workers may still be exiting (server/__main__)


if __name__ == "__main__":
    main()
