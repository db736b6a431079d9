"""Faults mid-training: a rank killed, a rank preempted (SIGTERM), and the resume after it.

`kill VICTIM`: rank VICTIM SIGKILLs itself at step KILL_AT; the others train on
and must fail (RankLostError naming VICTIM, or their launcher's SIGTERM).
`stall VICTIM`: rank VICTIM sleeps at step KILL_AT instead; the others' waits
must end at PIPE_HOROVOD_TIMEOUT (WaitTimeoutError naming the bucket and step).
`preempt CKPT`: rank 0 SIGTERMs itself at step SIGNAL_AT, inside
pipe_horovod.Preemption; every rank stops at the same step, saves its own
checkpoint to CKPT.<rank> and exits 0.
`resume CKPT`: new processes load their checkpoint and train to STEPS; a
second model trained uninterrupted from scratch in the same processes must
end bit-identical (default staleness compensation, K=2).
"""
import os
import signal
import sys
import time

import torch

from optimizer_worker import MLP, data_for, fresh, train
import pipe_horovod
import pipe_horovod.torch as phvd

STEPS, KILL_AT, SIGNAL_AT = 14, 6, 5


def build():
    model = fresh(MLP)
    opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters())
    return model, opt


def main():
    phvd.init()
    mode, rank, data = sys.argv[1], phvd.rank(), data_for()
    model, opt = build()
    if mode in ("kill", "stall"):
        victim = int(sys.argv[2])
        if os.environ.get("FAULT_PIDS"):            # the test checks that none outlives the job
            with open(os.path.join(os.environ["FAULT_PIDS"], str(rank)), "w") as f:
                f.write(str(os.getpid()))
        for t in range(10**6):                      # the others run until they fail
            if t == KILL_AT and rank == victim:
                print(f"rank {rank}: {mode} at step {t}", flush=True)
                if mode == "stall":                 # alive, but never starts step 6's reductions
                    time.sleep(120)
                os.kill(os.getpid(), signal.SIGKILL)
            train(model, opt, data, steps=t + 1, start=t)
        raise AssertionError("unreachable: the loop ends by an error")
    path = sys.argv[2]
    if mode == "preempt":
        with pipe_horovod.Preemption() as preempt:
            for t in range(STEPS):
                if preempt.should_stop():
                    torch.save({"step": t, "model": model.state_dict(),
                                "optimizer": opt.state_dict()}, f"{path}.{rank}")
                    print(f"STOPPED rank={rank} step={t}", flush=True)
                    print(f"WORKER_OK rank={rank}", flush=True)
                    sys.exit(0)
                if t == SIGNAL_AT and rank == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                train(model, opt, data, steps=t + 1, start=t)
        raise AssertionError("no rank stopped although rank 0 was sent SIGTERM")
    if mode == "resume":
        ckpt = torch.load(f"{path}.{rank}", weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        train(model, opt, data, steps=STEPS, start=ckpt["step"])
        opt.flush()
        reference, ref_opt = build()
        train(reference, ref_opt, data, steps=STEPS)
        ref_opt.flush()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), f"{name} differs from the uninterrupted run after resume"
        print(f"resumed at step {ckpt['step']}, bit-identical", flush=True)
        print(f"WORKER_OK rank={rank}", flush=True)
        phvd.shutdown()


if __name__ == "__main__":
    main()
