"""ElasticSampler: a DistributedSampler that survives a change of ranks mid-epoch.

Horovod 0.28.1's contract, on every engine: the epoch's order is a fixed
permutation (Python's `random.Random(seed + epoch)` shuffle of
range(len(dataset)), so a script sees the same order as under Horovod),
rank r of n takes every n-th of the samples not processed yet, and the
progress is one number, `processed_num`: how many samples of that order
every rank together has processed. Since all ranks take their batches in
lockstep, the processed samples are exactly a prefix of the order, so after
a reset (new rank and size) the remaining suffix is split among the new
ranks with no sample repeated or skipped.

Tracked by a TorchState, the count is committed and restored with the
model and optimizer, and synchronized from rank 0 after a reset.
"""
import math
import random

import torch.utils.data

from .. import mpi_ops


class ElasticSampler(torch.utils.data.Sampler):
    """Partition `dataset` across ranks; re-partition what is left after a reset.

    Use it as Horovod documents: put it in the TorchState, call
    `record_batch` after each processed batch and `set_epoch(epoch + 1)` at
    the *end* of an epoch (so a partially done epoch is never re-read from
    the start).

    Args:
        dataset: the data set (its length must not change).
        shuffle: shuffle the indices, differently each epoch (default True).
        seed: shuffle seed; identical on every rank (default 0).
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices = []
        self.indices = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    # --- progress -----------------------------------------------------------
    def set_epoch(self, epoch):
        """Start epoch `epoch` (its own shuffle) with nothing processed.

        Call it when an epoch ends, not when it begins: called at the start of
        a resumed epoch it would forget the samples already processed.
        """
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Record that every rank processed one more batch of `batch_size` samples.

        `batch_idx` is accepted for Horovod's signature and not used (as in
        Horovod 0.28.1): progress is a count, so a restarted epoch may number
        its batches from wherever it likes.
        """
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices):
        """Record that this rank processed `indices` and every other rank as many of its own.

        The count form of `record_batch`, for a last batch shorter than the rest.
        """
        self.processed_num += len(indices) * self.num_replicas

    def get_indices(self, batch_idx, batch_size):
        """This rank's indices of batch `batch_idx` of the current pass over the sampler.

        The current pass starts where the last reset (or set_epoch) left the
        epoch, so after a restart batch 0 is the first batch not processed yet.
        """
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    @property
    def processed_indices(self):
        """The samples of this epoch processed by all ranks together (a set)."""
        return set(self._order()[:self.processed_num])

    # --- state --------------------------------------------------------------
    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self):
        """Take this process's rank and the current size, and split what is left."""
        self.num_replicas = mpi_ops.size()
        self.rank = mpi_ops.rank()
        self.remaining_indices = self._order()[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.indices = self._partition()

    def _order(self):
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def _partition(self):
        # Repeat the first remaining samples so every rank gets num_samples
        # (as DistributedSampler and Horovod pad), then deal them out.
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:
            padded += self.remaining_indices[:self.total_size - len(padded)]
        return padded[self.rank:self.total_size:self.num_replicas]

    def __iter__(self):
        self.indices = self._partition()
        return iter(list(self.indices))

    def __len__(self):
        return self.num_samples
