"""The words the stall inspector (stall.py) and the causes it finds (causes.py) share,
below both so that stall.py imports causes.py and nothing imports back: how messages name
a collective (`describe`, and the labels adapters give their own checks), Horovod's
variable that sets the stall check, and the error of a wait no rank will complete."""
import contextlib

from .faults import WaitError

CHECK_VARIABLE = "HOROVOD_STALL_CHECK_TIME_SECONDS"


class StepMismatchError(WaitError):
    """Ranks wait for collectives that other ranks will never start."""


_LABELS = {}    # collective name -> (words, hint), while its caller's labelled() lasts


@contextlib.contextmanager
def labelled(name, words, hint):
    """Inside: the collective `name` (and the parts of an object collective, `name.*`) is
    described in messages as `words`, and a stall in it ends with `hint`, on every rank.

    Why: a check an adapter runs on one rank alone (add_param_group called on rank 0
    only) stalls against the others' next step, and its internal name said nothing
    ("allreduce 'pipe0.agree.sizes'") while the step counts blamed uneven data. The hint
    travels in this rank's post, so the ranks that never started the call say it too."""
    before = _LABELS.get(name)
    _LABELS[name] = (words, hint)
    try:
        yield
    finally:
        if before is None:
            _LABELS.pop(name, None)
        else:
            _LABELS[name] = before


def _label(name):
    """(words, hint) of a labelled collective `name`, else None."""
    if name is None:
        return None
    return _LABELS.get(name) or _LABELS.get(name.rsplit(".", 1)[0])


def label_or_name(name):
    """A collective's name as messages list it: its label while labelled."""
    label = _label(name)
    return name if label is None else label[0]


def describe(kind, name):
    """How messages name a call: allreduce 'x', broadcast_object 'o', barrier(); a
    labelled call by its label."""
    if kind in ("barrier", "join"):
        return f"{kind}()"
    label = _label(name)
    if label is not None:
        return label[0]
    return kind if name is None else f"{kind} {name!r}"
