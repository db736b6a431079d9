"""A Horovod training script as users write them (pytorch_imagenet_resnet50.py's shape).

Nothing here knows pipe_horovod: the drop-in test runs a copy whose only
change is the import line. It uses what real scripts use: resume from the
last checkpoint on rank 0 then broadcast, gradient_predivide_factor,
backward_passes_per_step, fp16 compression, a sparse embedding,
SyncBatchNorm, a per-batch metric allreduce, an allgather of validation
predictions, hvd.join() after each epoch (with --uneven, rank 0 has one
batch more), and no flush() anywhere.
"""
import argparse
import os

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--checkpoint-format", default="./checkpoint-{epoch}.pth.tar")
parser.add_argument("--batch-size", type=int, default=25)
parser.add_argument("--base-lr", type=float, default=0.05)
parser.add_argument("--batches-per-allreduce", type=int, default=1)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--compression", help="a hvd.Compression by name (pipe_horovod's int8_ef: "
                    "an import-switched run)")
parser.add_argument("--uneven", action="store_true", help="rank 0 gets one batch more")
parser.add_argument("--sparse-as-dense", action="store_true",
                    help="Horovod's join() does not support the allgather of sparse gradients")
parser.add_argument("--sync-bn", action=argparse.BooleanOptionalAction, default=True,
                    help="Horovod's own SyncBatchNorm needs a GPU")
parser.add_argument("--min-accuracy", type=float, default=0.8)
args = parser.parse_args()

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)

# Horovod: on resume, rank 0 finds the last checkpoint and tells the others.
resume_from_epoch = 0
for try_epoch in range(args.epochs, 0, -1):
    if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
        resume_from_epoch = try_epoch
        break
resume_from_epoch = hvd.broadcast(torch.tensor(resume_from_epoch), root_rank=0,
                                  name="resume_from_epoch").item()
verbose = hvd.rank() == 0

digits = load_digits()
pixels = torch.tensor(digits.data, dtype=torch.float32) / 16.0
tokens = torch.arange(64) * 17 + torch.tensor(digits.data, dtype=torch.long)   # (pixel, value)
labels = torch.tensor(digits.target)
train_idx, val_idx = torch.arange(0, 1500), torch.arange(1500, len(labels))
shard = train_idx[hvd.rank()::hvd.size()]
if args.uneven and hvd.rank() == 0:
    shard = torch.cat([shard, shard[:args.batch_size]])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64 * 17, 16, sparse=True)
        self.fc1 = nn.Linear(64, 64)
        self.bn = hvd.SyncBatchNorm(64) if args.sync_bn else nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64 + 16, 10)

    def forward(self, x, t):
        h = F.relu(self.bn(self.fc1(x)))
        return F.log_softmax(self.fc2(torch.cat([h, self.embed(t).mean(1)], 1)), dim=1)


model = Net()
# Horovod: scale the learning rate by the number of workers (and allreduce batches).
optimizer = torch.optim.SGD(model.parameters(),
                            lr=args.base_lr * args.batches_per_allreduce * hvd.size())
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
if args.compression:
    compression = getattr(hvd.Compression, args.compression)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     backward_passes_per_step=args.batches_per_allreduce,
                                     op=hvd.Average,
                                     gradient_predivide_factor=args.gradient_predivide_factor,
                                     sparse_as_dense=args.sparse_as_dense)

# Horovod: restore on the first worker, which broadcasts weights to the others.
if resume_from_epoch > 0 and hvd.rank() == 0:
    checkpoint = torch.load(args.checkpoint_format.format(epoch=resume_from_epoch),
                            weights_only=False)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    print(f"resumed from epoch {resume_from_epoch}", flush=True)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)


class Metric:
    def __init__(self, name):
        self.name, self.sum, self.n = name, torch.tensor(0.0), torch.tensor(0.0)

    def update(self, val):
        self.sum += hvd.allreduce(val.detach().cpu(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return self.sum / self.n


def train(epoch):
    model.train()
    order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))]
    train_loss = Metric("train_loss")
    step = args.batch_size * args.batches_per_allreduce
    for start in range(0, len(order) - step + 1, step):
        optimizer.zero_grad()
        for sub in range(start, start + step, args.batch_size):
            idx = order[sub:sub + args.batch_size]
            loss = F.nll_loss(model(pixels[idx], tokens[idx]), labels[idx])
            loss.div_(args.batches_per_allreduce).backward()
        optimizer.step()
        train_loss.update(loss)
    last = hvd.join()
    if verbose:
        print(f"epoch {epoch} train loss {train_loss.avg.item():.4f} (last to join: {last})",
              flush=True)


def validate(epoch):
    model.eval()
    with torch.no_grad():
        mine = val_idx[hvd.rank()::hvd.size()]
        pred = model(pixels[mine], tokens[mine]).argmax(1)
    correct = hvd.allgather((pred == labels[mine]).float(), name="val_correct")
    accuracy = correct.mean().item()
    if verbose:
        print(f"epoch {epoch} val accuracy {accuracy:.4f}", flush=True)
    return accuracy


def save_checkpoint(epoch):
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   args.checkpoint_format.format(epoch=epoch + 1))


accuracy = None
for epoch in range(resume_from_epoch, args.epochs):
    train(epoch)
    accuracy = validate(epoch)
    save_checkpoint(epoch)
assert accuracy is None or accuracy > args.min_accuracy, accuracy
print(f"WORKER_OK rank={hvd.rank()}", flush=True)
