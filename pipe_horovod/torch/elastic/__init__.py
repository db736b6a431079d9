"""Elastic training with Horovod's API: `run`, `TorchState`, `ElasticSampler`.

    import pipe_horovod.torch as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for x, y in loader:              # loader draws from `sampler`
                ...one step...
                sampler.record_batch(i, batch_size)
                if i % 10 == 0:
                    state.commit()
            sampler.set_epoch(state.epoch + 1)

    train(state)

The optimizer's gradients still in flight (pipeline_depth >= 2) belong to
the state: a commit captures them, a restore puts them back, and the sync
after a reset sends rank 0's to every rank, so training that failed and
was restored continues bit for bit as if the lost steps never ran
(state.py says how).

What `run` does on each engine:

* horovod (launched by `horovodrun --host-discovery-script ... ` or
  `--min-np/--max-np`): Horovod's own elastic loop
  (`horovod.common.elastic.run_fn`): its worker notification service
  tells rank 0 about added or removed hosts, `HorovodInternalError`
  (a collective failed: a peer died or reset) restores the last commit,
  `HostsUpdatedInterrupt` (raised by `commit()`/`check_host_updates()`
  on every rank) keeps the current state; both then reset, and the state
  is synchronized from rank 0 (new workers receive it there; a rank that
  restored the same commit keeps what its optimizer holds of its own: the
  gradients lookahead predicts from, error-feedback residuals). The reset is
  pipe_horovod's, not `horovod.torch.elastic`'s: after a failure
  pipe_horovod's own point-to-point group (two-stage codecs, `collective=`,
  `prediction_exchange`) is aborted, since its peers may wait there for a
  message the failed rank never sends; operations still in
  flight are completed or, if they failed, forgotten, then the engine
  shuts down and starts again in this process (Horovod's shutdown + init,
  meeting the driver's new rendezvous: rank and size may change), and the
  optimizers re-attach to the new engine. Horovod's reset alone would keep
  the engine's per-process operation counters, which name object
  collectives, out of step with workers that just joined.
* torch (torchrun) and local (plain python): the same loop and the same
  commit / restore / sync, without a notification service and without an
  in-process engine restart. torchrun's own elastic mode handles
  membership changes by stopping and restarting every worker process
  (with the group's new size), so a worker never has to re-form the
  process group in place; in-memory state does not survive that restart
  (save `model.state_dict()` and the optimizer's `state_dict()`, which
  holds the gradients in flight, to disk for it). Within a run, a
  `HorovodInternalError` raised on every rank at the same point (by the
  application, say after a recoverable error it detected on all ranks)
  restores the last commit and continues; one raised on some ranks only
  cannot be recovered there (the others never learn of it) and is only
  recoverable under horovodrun, where the failing rank's engine shutdown
  fails its peers' pending operations.

As with Horovod, the function passed to `run` must not start with a
collective (a joining worker would run it while the others synchronize),
and a DistributedOptimizer over a process set cannot follow a reset.
"""
from ...common import elastic as _common
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState


def run(func):
    """Decorator: Horovod's `horovod.torch.elastic.run`, the one loop every adapter
    runs (pipe_horovod.common.elastic.run says what it does on a failure, a host
    update and a failure that repeats).

    Args:
        func: the training function, called with the State (a TorchState, say)
            first; it must not start with a collective (see above).

    Returns:
        A function of the same arguments that returns what `func` returns.
    """
    return _common.run(func)


__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]
