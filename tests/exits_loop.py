"""The clean-exit loop (a script that ends with an error must end every rank): every case of tests/workers/exits_worker.py, many times
under each launcher, counting exit statuses and aborts.

The abort it looks for (SIGABRT at exit, "terminate called without an active
exception") was intermittent, so one launch per case (tests/test_misuse_engine.py)
cannot show it is gone; this runs each case --runs times, one launch at a time:

    python tests/exits_loop.py --runs 20 --launchers torch,horovod --out /tmp/exits.tsv

Each launch is one row of --out (launcher, case, run, launcher's exit code, aborted,
each rank's status, seconds), appended, so a run can be resumed (--out rows already
there count); the summary table goes to stdout. Not collected by pytest.
"""
import argparse
import collections
import re
import statistics
import time
from pathlib import Path

from tqdm import tqdm

import launcher

CASES = ("uneven", "barrier", "loader", "grouped", "complex", "raise")
ENV = {"PIPE_HOROVOD_TIMEOUT": "5", "HOROVOD_STALL_CHECK_TIME_SECONDS": "60"}
ABORT = re.compile(r"terminate called|SIGABRT|signal 6|status code 134|exitcode\s*:\s*-6")


def statuses(name, out):
    """Each rank's exit status as its launcher reports it (rank -> status)."""
    if name == "torch":
        found = re.findall(r"rank\s*:\s*(\d) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", out, re.S)
    else:
        found = re.findall(r"Process (\d) exit with status code (\d+)", out)
    return dict(sorted(found))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--launchers", default="torch,horovod")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", required=True, help="TSV of every launch (appended)")
    p.add_argument("--timeout", type=float, default=180)
    args = p.parse_args()
    out_path = Path(args.out)
    rows = [line.split("\t") for line in out_path.read_text().splitlines()] if out_path.exists() else []
    done = collections.Counter((row[0], row[1]) for row in rows)
    plan = [(name, case) for name in args.launchers.split(",") for case in args.cases.split(",")
            for _ in range(max(0, args.runs - done[name, case]))]
    for name, case in tqdm(plan, unit="launch"):
        start = time.monotonic()
        code, out = launcher.run(name, 2, "exits_worker.py", case, timeout=args.timeout,
                                 env=ENV, expect_ok=False)
        done[name, case] += 1
        aborted = bool(ABORT.search(out))
        if aborted:
            out_path.with_name(f"{out_path.stem}.{name}.{case}.{done[name, case]}.out").write_text(out)
        ranks = ",".join(f"{r}:{s}" for r, s in statuses(name, out).items())
        row = [name, case, str(done[name, case]), str(code), str(int(aborted)), ranks,
               f"{time.monotonic() - start:.1f}"]
        rows.append(row)
        with out_path.open("a") as f:
            f.write("\t".join(row) + "\n")
    print("| launcher | case | runs | aborted | exit statuses (rank:status × runs) | median s |")
    print("|---|---|---:|---:|---|---:|")
    for name in args.launchers.split(","):
        for case in args.cases.split(","):
            mine = [row for row in rows if row[:2] == [name, case]]
            if mine:
                seen = collections.Counter(row[5] for row in mine)
                print(f"| {name} | {case} | {len(mine)} | {sum(int(row[4]) for row in mine)} | "
                      + "; ".join(f"{k or '-'} × {n}" for k, n in seen.most_common())
                      + f" | {statistics.median(float(row[6]) for row in mine):.1f} |")


if __name__ == "__main__":
    main()
