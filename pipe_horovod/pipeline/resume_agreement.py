"""Every rank starts its pipeline from the same step and the same gradients in flight.

Horovod's usual resume has rank 0 alone read the checkpoint and broadcast the variables,
so the other ranks' pipelines start at step 0 with nothing in flight while rank 0's holds
the checkpoint's. Reductions are named after the step count, so at one parity the ranks
would pair different steps' gradients silently, at the other wait on names the others
never send. The averaged gradients in flight are the same on every rank, so the set's
first rank's state is what every rank of the uninterrupted run held, and it is given to
all. Error-feedback residuals are each rank's own and cannot be sent instead: there every
rank must restore its own checkpoint, and the ranks are told so, each rank's step named.
"""
from .. import engine


def agree_on_the_state(machine, process_set, state, restore, wrapper):
    """Give every rank the first rank's pipeline state where the ranks' steps differ.

    Args:
        machine: the pipeline's StepMachine (its step count and gradients in flight).
        process_set: the set it reduces over (None: every rank).
        state: () -> the pipeline's checkpoint state (tensors travel as host arrays, so
            none lands on the first rank's device index elsewhere).
        restore: (state) -> None, the pipeline's own restore of what `state` returned.
        wrapper: the public name of what built the pipeline, for the error.
    """
    eng = engine.current()
    fifo = machine.fifo
    held = eng.allgather_object((fifo.steps, len(fifo)), process_set=process_set)
    if len(set(held)) == 1:
        return
    ranks = list(range(eng.size())) if process_set is None else process_set.ranks
    said = ", ".join(f"rank {r} at step {s} with {n} in flight"
                     for r, (s, n) in zip(ranks, held))
    if machine.feedback is not None:
        raise ValueError(
            f"the ranks' {wrapper} pipelines differ at their first step ({said}): with an "
            f"error-feedback codec ({machine.compression.name}) each rank's residuals are its "
            "own, so every rank must restore its own checkpoint before the first step")
    first = ranks[0]
    restore(eng.broadcast_object(_on_host(state()) if eng.rank() == first else None, first,
                                 process_set=process_set))


def _on_host(value):
    """`value` with every torch tensor in it (dicts, lists, tuples) a NumPy array."""
    if isinstance(value, dict):
        return {k: _on_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_host(v) for v in value)
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu().numpy()
    return value
