"""Names both backends' data paths agree on: the tensor-name prefix of an optimizer,
variable names that match across ranks and survive save/load, and which attribute of
a Keras optimizer holds its momentum."""
import itertools

_builds = itertools.count()


def next_prefix():
    """Tensor-name prefix of the next optimizer built: builds happen in the same
    order on every rank, so the names agree."""
    return f"keras{next(_builds)}"


def variable_names(variables):
    """Names that agree across ranks and survive save/load: a variable's path
    carries per-process counters ("sequential_3/dense/kernel"), its index does not."""
    return [f"{i}.{v.name}" for i, v in enumerate(variables)]


def momentum_attribute(optimizer):
    """The Keras optimizer's attribute holding its momentum ("momentum" of SGD and
    RMSprop, "beta_1" of the Adam family), or None when it has none (or it is 0)."""
    for attribute in ("momentum", "beta_1"):
        value = getattr(optimizer, attribute, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value:
            return attribute
    return None
