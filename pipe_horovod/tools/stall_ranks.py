"""Real ranks on this machine: does every rank name the true cause when one of many
straggles or is killed? (The load test, stall_load.py, simulates the ranks; this runs
them: torch engine, a tiny model, pipelined SGD, no launcher watching, as on separate
nodes.)

    nice python -m pipe_horovod.tools.stall_ranks --ranks 32 --scenario straggler
    nice python -m pipe_horovod.tools.stall_ranks --ranks 32 --scenario killed

`straggler`: rank N/2 sleeps STRAGGLE_S at step AT_STEP; every other rank must warn, at
HOROVOD_STALL_CHECK_TIME_SECONDS (CHECK_S here), that rank N/2 is not waiting in any
collective, and the job then completes. `killed`: rank N/2 SIGKILLs itself at step
AT_STEP; every other rank must raise RankLostError naming it (its pid). Prints each
rank's words and one line per scenario: how many ranks named the cause, and when.

Tooling only: the runtime never imports it.
"""
import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time

AT_STEP, STEPS = 3, 6
CHECK_S, STRAGGLE_S = 8, 14


def worker(scenario, odd):
    """One rank: a Linear model under DistributedOptimizer (K=2), the fault at AT_STEP."""
    import warnings

    import torch

    import pipe_horovod.torch as phvd

    def told(message, category, *args, **kwargs):
        text = " ".join(str(message).split())
        print(f"WARNED rank={phvd.rank()} at={time.time():.2f}: {text}", flush=True)
    warnings.showwarning = told
    warnings.simplefilter("always")
    phvd.init()
    rank = phvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    pipeline_depth=2)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    try:
        for step in range(STEPS):
            if step == AT_STEP and rank == odd:
                print(f"FAULT rank={rank} at={time.time():.2f}", flush=True)
                if scenario == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(STRAGGLE_S)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.flush()
    except Exception as exc:
        text = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"RAISED rank={rank} at={time.time():.2f}: {text}", flush=True)
        sys.exit(1)
    print(f"DONE rank={rank}", flush=True)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks, scenario, bound_s=600):
    """Start `ranks` torch-engine ranks directly (env://, no launcher); {rank: output}."""
    odd = ranks // 2
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1",
               PIPE_HOROVOD_ENGINE="torch", PIPE_HOROVOD_TIMEOUT="300",
               HOROVOD_STALL_CHECK_TIME_SECONDS=str(CHECK_S))
    procs = {r: subprocess.Popen(
        [sys.executable, "-m", "pipe_horovod.tools.stall_ranks", "--worker", scenario,
         str(odd)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        for r in range(ranks)}
    out, start = {}, time.monotonic()
    try:
        for r, proc in procs.items():
            out[r] = proc.communicate(timeout=max(1, bound_s - (time.monotonic() - start)))[0]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return odd, out


def judge(ranks, scenario, odd, out):
    """(ranks that named the cause, of those that should, seconds after the fault:
    (first, last), one rank's words)."""
    fault = re.search(r"FAULT rank=\d+ at=([\d.]+)", out.get(odd, ""))
    fault_at = float(fault.group(1)) if fault else None
    if scenario == "straggler":
        pattern = (r"WARNED rank=(\d+) at=([\d.]+): (.*rank " + str(odd) +
                   r" (is not waiting in any collective|runs( after \d+ step\(s\))?[;.]).*)")
    else:
        pattern = (r"RAISED rank=(\d+) at=([\d.]+): (RankLostError: .*rank " + str(odd) +
                   r" \(pid \d+ on [^)]+\) no longer runs.*)")
    named, times, words = [], [], ""
    for rank, text in out.items():
        if rank == odd:
            continue
        found = re.search(pattern, text)
        if found:
            named.append(rank)
            times.append(float(found.group(2)) - (fault_at or 0.0))
            words = words or found.group(3)
    span = (min(times), max(times)) if times else (None, None)
    if not words:               # what they said instead
        words = next((line for text in out.values() for line in text.splitlines()
                      if line.startswith(("WARNED", "RAISED"))), "")
    return len(named), ranks - 1, span, words


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m pipe_horovod.tools.stall_ranks",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--scenario", choices=["straggler", "killed"], default="straggler")
    args = parser.parse_args(argv)
    began = time.monotonic()
    odd, out = launch(args.ranks, args.scenario)
    named, of, (first, last), words = judge(args.ranks, args.scenario, odd, out)
    for rank in sorted(out):
        lines = [line for line in out[rank].splitlines()
                 if line.startswith(("WARNED", "RAISED", "FAULT", "DONE"))]
        print(f"rank {rank}: " + (" | ".join(line[:160] for line in lines) or
                                  out[rank][-300:].replace("\n", " | ")))
    when = "-" if first is None else f"{first:.1f}-{last:.1f} s after the fault"
    print(f"{args.scenario}, {args.ranks} ranks: {named}/{of} ranks named rank {odd}, {when}, "
          f"in {time.monotonic() - began:.0f} s; e.g. {words}")
    return 0 if named == of else 1


if __name__ == "__main__":
    raise SystemExit(main())
