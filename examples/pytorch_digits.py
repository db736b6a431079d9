"""Train a small CNN on scikit-learn's digits with the pipelined DistributedOptimizer.

The same script runs in one process or many, picking the engine from the
launcher:

    python examples/pytorch_digits.py --epochs 1
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_digits.py
    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/pytorch_digits.py

Data: `sklearn.datasets.load_digits` (1,797 8x8 images, 10 classes, shipped
with scikit-learn, so nothing is downloaded), split 80/20 stratified with a
fixed seed, so every run and every rank sees the same held-out test set.
Each epoch, every rank draws the same permutation of the training set and
takes its own shard of it (rank::size), so the ranks together cover the
set once per epoch. `--batch-size` is per rank; the gradient averaged
across ranks is that of a global batch of batch-size * size images.

Before each evaluation `opt.flush()` applies the gradients still in flight
(pipeline_depth >= 2), so the accuracy printed is that of weights with every
computed gradient applied. Runs are deterministic given `--seed`.

With `--checkpoint-dir`, every rank saves its state there at the end of
each epoch and when the job is preempted (SIGTERM, SIGINT, or SIGUSR1: what
Slurm's `--signal=USR1@N` sends before the time limit), at a step every rank
agrees on (`pipe_horovod.Preemption`); run again with the same flags, it
resumes there and ends bit-identical to a run never stopped, gradients in
flight included (integrations/slurm/pipe_horovod.sbatch requeues it). A save
that was killed (a grace time shorter than the save) leaves the last complete
checkpoint whole, and the next run says so before it resumes from that one;
every rank keeps the one before its newest too, so where one rank's save was
cut and the others' were not, they all resume from the newest step every rank
saved.
"""
import argparse
import json
import math
import os
import signal
import socket
import sys
import time

# One thread per worker: the examples share small machines, and a fixed thread
# count keeps float results reproducible. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import pipe_horovod  # noqa: E402
import pipe_horovod.torch as phvd  # noqa: E402
from pipe_horovod import engine as phvd_engine  # noqa: E402

SPLIT_SEED = 0      # the train/test split never depends on --seed: one test set for all runs
TEST_FRACTION = 0.2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--lr", type=float, default=0.15,
                   help="peak learning rate: linear ramp for --lr-warmup-epochs, then cosine to 0")
    p.add_argument("--lr-warmup-epochs", type=float, default=1.0)
    p.add_argument("--momentum", type=float, default=0.5,
                   help="SGD momentum; a delayed gradient tolerates less of it than a fresh one")
    p.add_argument("--pipeline-depth", type=int,
                   help="1: synchronous (Horovod's math); K>=2: apply the gradient of K-1 steps "
                        "ago; omitted: the default (tune='auto' chooses 1 or 2)")
    p.add_argument("--tune", choices=["auto", "off"],
                   help="auto: the run chooses depth, codec and buckets from its first steps; "
                        "off: the configuration as given (K=2 where no depth is given); "
                        "omitted: the default (auto unless --pipeline-depth is given)")
    p.add_argument("--warmup-steps", type=int, default=0, help="synchronous steps before pipelining")
    p.add_argument("--compression", choices=["none", "fp16", "bf16", "int8", "int8_ef"],
                   default="none", help="int8 and int8_ef (error feedback) need --collective "
                                        "ring or lp")
    p.add_argument("--collective", choices=["none", "lp", "ring", "mst", "be"], default="none",
                   help="none: the engine's own allreduce; else pipe_horovod's per-hop collective")
    p.add_argument("--seed", type=int, default=42, help="model init and data order")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results here, and the "
                   "run summary beside it (PATH.run_summary)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="each rank saves its state here (digits.RANK.pt) after every epoch and "
                        "when preempted (SIGTERM, SIGINT, SIGUSR1), and resumes from it")
    p.add_argument("--no-progress", action="store_true",
                   help="no tqdm bar, even on rank 0 at a terminal (never one elsewhere: "
                        "carriage returns garble logs and horovodrun's prefixed lines)")
    return p.parse_args(argv)


class Net(nn.Module):
    """Two 3x3 convolutions, one 2x2 max-pool, two dense layers: ~40k parameters."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def load_data():
    """(x_train, y_train, x_test, y_test) as tensors, standardized by the training set's stats."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.images.astype(np.float32)[:, None, :, :]      # N x 1 x 8 x 8, values 0..16
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=TEST_FRACTION,
                                              random_state=SPLIT_SEED, stratify=y)
    mean, std = x_tr.mean(), x_tr.std()
    x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
    return (torch.from_numpy(x_tr), torch.from_numpy(y_tr),
            torch.from_numpy(x_te), torch.from_numpy(y_te))


@torch.no_grad()
def evaluate(model, x, y):
    model.eval()
    logits = model(x)
    model.train()
    return (logits.argmax(1) == y).float().mean().item(), F.cross_entropy(logits, y).item()


def learning_rate(args, step, total_steps, steps_per_epoch):
    """Linear warm-up to args.lr, then cosine decay to 0 at the last step."""
    warmup = min(int(args.lr_warmup_epochs * steps_per_epoch), total_steps // 5)  # short runs too
    if step < warmup:
        return args.lr * (step + 1) / warmup
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))


def weights_checksum(model):
    with torch.no_grad():
        return float(sum(p.double().sum().item() for p in model.parameters()))


PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
STOPPED = "stopped"     # in --checkpoint-dir: the run stopped at a checkpoint before its end


def checkpoint_path(args, rank):
    return os.path.join(args.checkpoint_dir, f"digits.{rank}.pt")


def previous(path):
    return f"{path}.previous"


def save_checkpoint(path, state):
    """Written beside, then renamed, the one it replaces kept as previous(path): a save cut
    short (SIGKILL at the end of a grace time) leaves the last checkpoint whole, and the
    ranks whose save was not cut can go back to it too (resume_position)."""
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    if os.path.exists(path):
        os.replace(path, previous(path))
    os.replace(tmp, path)


def resume_position(path, rank):
    """This rank's saved state at the newest (epoch, step) every rank saved, else None (none
    saved). A save killed before its rename (its temporary file is left) is said and
    dropped; a rank whose newest save is past that step goes back to its previous one."""
    cut = f"{path}.tmp"
    if os.path.exists(cut):              # a save killed before its rename: say so, once
        os.remove(cut)
        last = ("the last complete one" if os.path.exists(path)
                else "the start: there is no complete one")
        print(f"rank {rank}: the previous run was killed while it saved its checkpoint "
              f"(a grace time shorter than the save?): resuming from {last}", flush=True)
    saved = {}
    for candidate in (path, previous(path)):
        if os.path.exists(candidate):
            state = torch.load(candidate, weights_only=False)
            saved[(state["epoch"], state["step"])] = state
    everyone = phvd.allgather_object(sorted(saved))
    common = set(everyone[0]).intersection(*everyone[1:])
    if not common:
        if any(everyone):
            raise SystemExit(f"rank {rank}: the ranks' checkpoints in {os.path.dirname(path)} "
                             "have no step in common (epoch, step per rank: "
                             f"{everyone}); is the directory shared by every node?")
        return None
    where = max(common)
    if where != max(saved):
        print(f"rank {rank}: another rank's last save was cut short: resuming from epoch "
              f"{where[0]} step {where[1]}, the newest every rank saved, not from its own "
              f"newest (epoch {max(saved)[0]} step {max(saved)[1]})", flush=True)
    return saved[where]


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)

    phvd.init()
    rank, size = phvd.rank(), phvd.size()
    engine = phvd_engine.current().name

    x_train, y_train, x_test, y_test = load_data()
    per_rank = len(x_train) // size          # equal shards: every rank takes the same steps
    steps_per_epoch = -(-per_rank // args.batch_size)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    optimizer = phvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        pipeline_depth=args.pipeline_depth, warmup_steps=args.warmup_steps, tune=args.tune,
        compression=phvd.Compression.by_name(args.compression),
        collective=None if args.collective == "none" else args.collective)
    phvd.broadcast_parameters(model.state_dict(), root_rank=0)
    phvd.broadcast_optimizer_state(optimizer, root_rank=0)

    nodes = phvd.allgather_object(socket.gethostname())

    # Where the loop starts: the beginning, or the position a checkpoint saved (the epoch's
    # data order is redrawn from the generator state saved with it).
    order = torch.Generator().manual_seed(args.seed)
    position = {"epoch": 1, "step": 0, "global_step": 0, "order": order.get_state(),
                "running": 0.0, "history": []}
    resumed = None
    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        saved = resume_position(checkpoint_path(args, rank), rank)
        if saved is not None:
            model.load_state_dict(saved.pop("model"))
            optimizer.load_state_dict(saved.pop("optimizer"))
            position, resumed = saved, saved

    if rank == 0:
        print("ranks: " + ", ".join(f"{r} on {n}" for r, n in enumerate(nodes)), flush=True)
        if resumed is not None:
            print(f"resumed from {args.checkpoint_dir}: epoch {resumed['epoch']} step "
                  f"{resumed['step']}", flush=True)
        print(f"digits: {len(x_train)} train / {len(x_test)} test images; engine={engine} "
              f"size={size} pipeline_depth={args.pipeline_depth} tune={args.tune} "
              f"warmup_steps={args.warmup_steps} "
              f"compression={args.compression} collective={args.collective} batch={args.batch_size}/rank lr={args.lr} "
              f"momentum={args.momentum} "
              f"seed={args.seed}; {steps_per_epoch} steps/epoch", flush=True)

    history = position["history"]
    total_steps = steps_per_epoch * args.epochs
    global_step = position["global_step"]
    order.set_state(position["order"])
    preempt = pipe_horovod.Preemption(PREEMPT_SIGNALS) if args.checkpoint_dir else None
    if preempt is not None:
        preempt.__enter__()
    start = time.perf_counter()
    for epoch in range(position["epoch"], args.epochs + 1):
        epoch_order = order.get_state()
        perm = torch.randperm(len(x_train), generator=order)   # the same on every rank
        shard = perm[rank::size][:per_rank]
        first = position["step"] if epoch == position["epoch"] else 0
        bar = tqdm(range(first, steps_per_epoch), desc=f"epoch {epoch}/{args.epochs}",
                   unit="step", disable=rank != 0 or args.no_progress or not sys.stdout.isatty(),
                   leave=False, file=sys.stdout)
        running = position["running"] if epoch == position["epoch"] else 0.0
        for step in bar:
            if preempt is not None and preempt.should_stop():
                save_checkpoint(checkpoint_path(args, rank), {
                    "epoch": epoch, "step": step, "global_step": global_step,
                    "order": epoch_order, "running": running, "history": history,
                    "model": model.state_dict(), "optimizer": optimizer.state_dict()})
                why = preempt.received.name if preempt.received else "another rank's signal"
                print(f"rank {rank}: {why}: checkpoint at epoch {epoch} step {step} saved, "
                      "gradients in flight included", flush=True)
                if rank == 0:      # for the job script: requeue, the run is not finished
                    with open(os.path.join(args.checkpoint_dir, STOPPED), "w") as f:
                        f.write(f"epoch {epoch} step {step}\n")
                # Saved: the same signal may still be on its way to this rank (the
                # scheduler signals each task in turn) and must not kill it now.
                for sig in PREEMPT_SIGNALS:
                    signal.signal(sig, signal.SIG_IGN)
                return 0
            idx = shard[step * args.batch_size:(step + 1) * args.batch_size]
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, global_step, total_steps, steps_per_epoch)
            global_step += 1
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            running += loss.item()
            bar.set_postfix(loss=f"{running / (step + 1):.4f}", refresh=False)
        bar.close()
        optimizer.flush()                     # every computed gradient applied before evaluating
        accuracy, test_loss = evaluate(model, x_test, y_test)
        history.append({"epoch": epoch, "train_loss": running / steps_per_epoch,
                        "test_loss": test_loss, "accuracy": accuracy,
                        "elapsed_s": time.perf_counter() - start})
        if args.checkpoint_dir:
            save_checkpoint(checkpoint_path(args, rank), {
                "epoch": epoch + 1, "step": 0, "global_step": global_step,
                "order": order.get_state(), "running": 0.0, "history": history,
                "model": model.state_dict(), "optimizer": optimizer.state_dict()})
        if rank == 0:
            print(f"epoch {epoch:3d}/{args.epochs}  train loss {running / steps_per_epoch:.4f}  "
                  f"test loss {test_loss:.4f}  held-out accuracy {100 * accuracy:.2f}%", flush=True)
    train_time = time.perf_counter() - start
    if preempt is not None:
        preempt.__exit__(None, None, None)

    # Every rank must hold the same weights; a mismatch means the ranks diverged.
    checksums = phvd.allgather_object(weights_checksum(model))
    if args.json:               # the measured run and what auto chose (plan --from-run reads it)
        optimizer.write_run_summary(args.json + ".run_summary")
    ranks_agree = all(c == checksums[0] for c in checksums)
    if rank == 0:
        final = history[-1]["accuracy"] if history else float("nan")
        print(f"final held-out accuracy {100 * final:.2f}% after {args.epochs} epochs "
              f"in {train_time:.1f}s (ranks agree on the weights: {ranks_agree})", flush=True)
        if args.json:
            result = {
                "pipeline_depth": args.pipeline_depth, "tune": args.tune,
                "accuracy": final, "epochs": args.epochs,
                "warmup_steps": args.warmup_steps, "compression": args.compression,
                "collective": args.collective,
                "batch_size": args.batch_size, "lr": args.lr, "momentum": args.momentum,
                "lr_warmup_epochs": args.lr_warmup_epochs,
                "seed": args.seed, "size": size, "engine": engine,
                "steps_per_epoch": steps_per_epoch, "n_train": len(x_train),
                "n_test": len(x_test), "train_time_s": train_time, "ranks_agree": ranks_agree,
                "history": history, "timings": dict(optimizer.timings),
            }
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    phvd.shutdown()
    return 0 if ranks_agree else 1


if __name__ == "__main__":
    sys.exit(main())
