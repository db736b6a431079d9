"""How ranks tell that they hold the same variables, in the same order.

Ranks pair gradients by position, so every adapter compares, before the
first reduction, what each position holds. A bare name cannot tell layers
apart: every Keras 3 Dense layer's weights are "kernel" and "bias", so a list
in another order on one rank (same shapes) compared equal, and gradients
were averaged into the wrong layers with nothing said. A path
("sequential/dense_1/kernel") tells them apart, but not all of it agrees
across ranks that hold the same model:
- its start says where the variable was created: Horovod's resume loads the
  model on rank 0 (load_model names it "dense_1/kernel") and builds it on the
  others ("sequential/dense_1/kernel"), so the leading parts every path of the
  list shares (the model's name: they tell no two positions apart) are dropped,
  down to the layer's name and the weight's. What is left keeps the nested
  blocks apart: two attention blocks' "mha/query/kernel" and "mha_1/query/kernel",
  where the last two parts alone were alike;
- the numbers Keras appends to auto-named layers count per process: a rank
  that built another model first calls the same layer "dense_3", so they are
  renumbered within the list (the n-th distinct counter of a name becomes its
  n-th), which keeps the layers' order and drops what only says how many
  models the process made before.

A list handed to broadcast_variables mixes the model's variables with the
optimizer's, and an optimizer slot's path embeds its model variable's whole path
("sgd/sequential_1_dense_2_kernel_momentum"), counters and model name included,
which a loaded and a built model spell differently. There each position is compared
by its kind (the path's last word without counters: kernel, bias, momentum,
velocity, iteration), shape and dtype: a weaker signature than a path, but one no
correct list fails.
"""
import re

_COUNTED = re.compile(r"^(.*?)(?:_(\d+))?$")    # "dense_3" -> ("dense", "3")


def comparable_paths(paths):
    """`paths` ("model/block/layer/weight", one per variable, in order) without the
    leading parts they all share (each keeps its last two), with each name's
    per-process counters renumbered from 0 within the list: equal on ranks that hold
    the same model, however each made it; different where two layers or blocks of one
    kind come in another order."""
    parts = [str(path).split("/") for path in paths]
    shared = 0
    while all(len(p) > shared + 2 and p[shared] == parts[0][shared] for p in parts):
        shared += 1
    split = [[_COUNTED.match(part).groups() for part in p[shared:]] for p in parts]
    seen = {}
    for parts in split:
        for base, number in parts:
            seen.setdefault(base, set()).add(int(number or 0))
    order = {base: {n: i for i, n in enumerate(sorted(numbers))}
             for base, numbers in seen.items()}

    def renumbered(base, number):
        i = order[base][int(number or 0)]
        return base if i == 0 else f"{base}_{i}"
    return ["/".join(renumbered(base, number) for base, number in parts) for parts in split]


def describe_variables(entries, what="variable"):
    """The description compare_across_ranks compares for a list of variables.

    Args:
        entries: one (path, shape, dtype name, note) per variable, in the order the
            ranks pair their gradients; note ("local", ...) may be ""; shape and dtype
            None where they may differ between ranks (a local variable's).
        what: how the message names one entry ("variable", "source").

    Returns:
        {"<what> <position>": "<path>, shape <shape> <dtype>[, <note>]"}: position,
        path, shape and dtype together, so the first entry that differs is named with
        what it is on each rank.
    """
    entries = list(entries)
    paths = comparable_paths([e[0] for e in entries])
    return {f"{what} {i}": ", ".join(
                [path] + ([] if shape is None else [f"shape {tuple(shape)} {dtype}"])
                + ([note] if note else []))
            for i, (path, (_, shape, dtype, note)) in enumerate(zip(paths, entries))}


def broadcast_description(entries):
    """The description compare_across_ranks compares for a list to broadcast.

    Args:
        entries: one (path, shape, dtype name) per variable, in the order the ranks pair
            their broadcasts.

    Returns:
        {"variable <position>": "<kind>, shape <shape> <dtype>"}.
    """
    return {f"variable {i}": f"{_kind(path)}, shape {tuple(shape)} {dtype}"
            for i, (path, shape, dtype) in enumerate(entries)}


def _kind(path):
    """"sgd/sequential_1_dense_2_kernel_momentum" -> "momentum", "dense_3/kernel" -> "kernel",
    "batch_normalization/moving_mean" -> "mean" (the last word, its counter dropped)."""
    last = str(path).split("/")[-1].split(":")[0]
    return _COUNTED.match(last).group(1).split("_")[-1]
