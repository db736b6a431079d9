"""Stopping cleanly when a scheduler asks: SIGTERM/SIGINT, then a checkpoint, then exit 0.

Schedulers (Slurm, Kubernetes) send SIGTERM some seconds before they kill
a job; Ctrl-C sends SIGINT. Python's default is to die at once, with
gradients in flight and every other rank left waiting on them. Stopping at
a step boundary instead keeps the checkpoint consistent, but the ranks
must stop at the same step, and the signal reaches them at different
moments (or only one of them). So the handler only sets a flag, and
`should_stop()`, called once per step on every rank, reduces the flags:

    with pipe_horovod.Preemption() as preempt:
        for step in range(start, steps):
            if preempt.should_stop():
                torch.save({"step": step, "model": model.state_dict(),
                            "optimizer": opt.state_dict()}, f"ckpt.{hvd.rank()}.pt")
                sys.exit(0)
            ...one training step...

The flag of step t travels while step t+1 computes (an async allreduce
started by one call and read by the next), so the check never blocks: every
rank stops at the same boundary, one step after the first rank saw the
signal. Each rank saves its own state_dict, which carries the gradients in
flight and the real weights, so a restart resumes bit-identically with
every staleness compensation (README, "Checkpoints").
"""
import signal
import sys
import threading

from . import engine

_NAME = "pipe_horovod.preemption"


class Preemption:
    """Context manager: handle `signals` by asking every rank to stop at an agreed step."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise ValueError("Preemption needs at least one signal to handle")
        self.received = None             # the first signal this rank got, if any
        self._previous = {}
        self._pending = None             # the flag reduction started by the last check
        self._checks = 0

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Preemption must be entered on the main thread "
                               "(Python runs signal handlers there only)")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if exc[0] is None:               # after a failure, nothing more can complete
            self._settle()
        return False

    def _on_signal(self, signum, frame):
        if self.received is not None:   # a second signal: the user insists
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
        self.received = signal.Signals(signum)
        print(f"pipe_horovod: {self.received.name} received; stopping at the next step "
              "boundary every rank agrees on", file=sys.stderr, flush=True)

    def should_stop(self):
        """True on every rank at the same call once any rank received a signal.

        Collective: every rank calls it once per step, at the same point of
        its loop. Returns one call after the first rank's signal (the flags
        travel during a step); then nothing is left in flight.
        """
        import torch

        stop = False
        if self._pending is not None:
            stop = bool(engine.wait(self._pending).item() > 0)
        flag = torch.tensor([0 if self.received is None and not stop else 1], dtype=torch.int32)
        self._pending = engine.allreduce_async(flag, f"{_NAME}.{self._checks % 2}", engine.Sum)
        self._checks += 1
        if stop:
            self._settle()
        return stop

    def _settle(self):
        pending, self._pending = self._pending, None
        if pending is not None and engine.is_initialized():
            engine.wait(pending)
