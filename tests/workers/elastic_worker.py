"""Elastic training with a pipelined optimizer, with or without a failure.

`python elastic_worker.py MODE DEPTH[:CODEC] OUT [...]`, launched by
horovodrun's elastic mode (one run), torchrun or plain python (the runs in turn, in
the same processes: one launch for a clean run and its failing twin):

* clean: train EPOCHS epochs under hvd.elastic.run; commit every COMMIT
  batches and at each epoch's end.
* fail-one: the same, but rank 1 raises HorovodInternalError once, between
  backward and step of batch FAIL_BATCH of epoch FAIL_EPOCH (after a
  commit, with gradients in flight). Its engine then resets, which fails
  the other ranks' pending collectives: every rank restores the last
  commit, Horovod re-forms the job in the same processes, and training
  continues. Only horovodrun can recover from a failure on some ranks.
* fail-all: every rank raises it at that point (the torch and local
  engines recover in-process from a failure every rank sees).
* crash: horovod only, started on two hosts (localhost:1, 127.0.0.1:1); rank 1's
  process dies (os._exit) at that point. Horovod blacklists its host, rank 0's
  pending collectives fail, it restores the last commit and goes on alone.
* scale: horovod only, started with one host listed by the discovery file
  (argv[4]); after a commit rank 0 adds a second host to that file, so
  Horovod starts a worker, the next commit raises HostsUpdatedInterrupt
  and the new worker receives the state from rank 0.

DEPTH:CODEC (say 2:int8_ef) reduces with that compression, whose two stages run point
to point on pipe_horovod's own gloo group (CPU tensors): a failure leaves messages there
that a peer never sends, which the reset must not wait for.

Rank 0 writes the final weights and the samples each step processed to
OUT; every rank checks that each epoch processed every sample exactly once.
"""
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import pipe_horovod.torch as hvd
from pipe_horovod import engine

torch.set_num_threads(1)
N, BATCH, EPOCHS, COMMIT = 48, 4, 3, 3
FAIL_EPOCH, FAIL_BATCH = 1, 5
_fired = False
_resets = 0          # a process-wide count: the state itself is rolled back and synced


def session(eng):
    """The status board's session of engine `eng` (None: no board)."""
    return None if eng._board is None else eng._board.session


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(N, 8, generator=g)
        self.y = torch.randint(0, 4, (N,), generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def model_and_optimizer(spec):
    depth, _, codec = spec.partition(":")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(), pipeline_depth=int(depth), warmup_steps=1,
        compression=hvd.Compression.by_name(codec) if codec else hvd.Compression.none)
    return model, opt


def run(mode, depth, out):
    global _fired, _resets
    _fired, _resets = False, 0
    hvd.init()
    engines = [engine.current()]        # a reset under Horovod starts another
    model, opt = model_and_optimizer(depth)
    sampler = hvd.elastic.ElasticSampler(Data(), shuffle=True, seed=7)
    loader = torch.utils.data.DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler,
                                   epoch=0, batch=0, seen=[])

    def on_reset():
        global _resets
        _resets += 1
        if engine.current() is not engines[-1]:
            engines.append(engine.current())
        print(f"ELASTIC_RESET rank={hvd.rank()} size={hvd.size()} "
              f"session={session(engines[-1])}", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        global _fired
        while state.epoch < EPOCHS:
            for x, y, idx in loader:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                state.batch += 1
                failing = (mode == "fail-all" or (mode == "fail-one" and hvd.rank() == 1))
                if failing and not _fired and (state.epoch, state.batch) == (FAIL_EPOCH,
                                                                               FAIL_BATCH):
                    _fired = True
                    print(f"INJECTED_FAILURE rank={hvd.rank()}", flush=True)
                    raise hvd.HorovodInternalError("injected failure between backward and step")
                if mode == "crash" and hvd.rank() == 1 and (state.epoch, state.batch) == (
                        FAIL_EPOCH, FAIL_BATCH):
                    print(f"INJECTED_CRASH rank={hvd.rank()}", flush=True)
                    os._exit(1)
                opt.step()
                sampler.record_batch(state.batch, BATCH)
                everyone = hvd.allgather_object(idx.tolist())
                state.seen = state.seen + [(state.epoch, sorted(i for part in everyone
                                                                for i in part))]
                if state.batch % COMMIT == 0:
                    state.commit()
                    if mode == "scale" and hvd.rank() == 0 and hvd.size() == 1 and \
                            state.epoch == 0 and state.batch == COMMIT:
                        Path(sys.argv[4]).write_text("localhost:1\n127.0.0.1:1\n")
                        # Wait until the driver saw it and told rank 0, so the job
                        # grows at the next commit, not at an arbitrary later one.
                        deadline = time.time() + 60
                        while state._host_messages.empty() and time.time() < deadline:
                            time.sleep(0.2)
            state.epoch += 1
            state.batch = 0
            sampler.set_epoch(state.epoch)
            state.commit()
        opt.flush()

    train(state)

    for epoch in range(EPOCHS):
        done = [i for e, batch in state.seen if e == epoch for i in batch]
        assert sorted(done) == list(range(N)), (
            f"epoch {epoch}: samples processed {sorted(done)} (repeated or skipped)")
    if mode != "scale":                  # a scale-up resets the workers Horovod already had
        resets = 0 if mode == "clean" else 1
        assert _resets == resets, f"{mode}: expected {resets} reset(s), saw {_resets}"
    # Each engine a reset starts posts under a session of its own: the last one's posts
    # (an error, "ended") are no news to it.
    boards = [session(e) for e in engines if session(e) is not None]
    assert len(set(boards)) == len(boards), f"{mode}: board sessions {boards}"
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "seen": state.seen}, out)


def main():
    runs = sys.argv[1:4] if sys.argv[1] == "scale" else sys.argv[1:]   # scale: argv[4] below
    for at in range(0, len(runs), 3):
        run(runs[at], runs[at + 1], Path(runs[at + 2]))
    print(f"WORKER_OK rank={hvd.rank()} size={hvd.size()} resets={_resets}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
