"""Object collectives (broadcast_object, allgather_object) on the engine's own collectives.

Horovod's object collectives are a size then the pickled bytes, each a
named tensor collective; torch.distributed's block inside the library and
are matched by call order. Built here on the engine's `broadcast_async` and
`allgather_async` for every engine, they are matched by name and compared
(root, kind) like any tensor collective (Horovod's coordinator, the torch
engine's negotiation), and their waits are the engine's own: bounded,
posted to the status board and inspected when they stall (stall.py), where
a call blocked inside torch could neither time out nor say why.

Names: an object collective called without a name takes the next of one
counter per process set for both kinds (`object.noname.N`), so a rank that
calls allgather_object where another calls broadcast_object meets it under
the same name and both get one MismatchError naming the two calls, instead
of each waiting for a name the other never starts.
"""
import contextlib
import io
import re

from .mismatch import MismatchError

try:            # Horovod's own object collectives use cloudpickle (lambdas, local classes)
    import cloudpickle as _pickle
except ImportError:          # pragma: no cover - torch-only installs
    import pickle as _pickle

# The tensor collectives an object call is made of, as Horovod's messages name them.
_PARTS = {"BROADCAST": "broadcast_object", "ALLGATHER": "allgather_object"}


def _dumps(obj):
    import torch

    return torch.frombuffer(bytearray(_pickle.dumps(obj)), dtype=torch.uint8)


def _loads(data):
    return _pickle.load(io.BytesIO(data.numpy().tobytes()))


@contextlib.contextmanager
def _as_object_call(name):
    """A MismatchError of one of the call's tensors, in the words of object calls."""
    try:
        yield
    except MismatchError as exc:
        text = re.sub(r"\b(?:an? )?(BROADCAST|ALLGATHER)\b", lambda m: _PARTS[m.group(1)],
                      str(exc))
        text = re.sub(r"\((?:broadcast|allgather) '(.*?)\.(?:sz|t)'",
                      lambda m: f"(object collective '{m.group(1)}'", text)
        raise MismatchError(text) from exc


def broadcast_object(engine, obj, root, name, ps):
    """Root's `obj` on every rank of `ps` (root gets its own back)."""
    import torch

    if len(ps.ranks) == 1:
        return obj
    with engine.calling("broadcast_object", name, root=root), _as_object_call(name):
        mine = engine.rank() == root
        data = _dumps(obj) if mine else None
        size = torch.tensor([data.numel() if mine else 0], dtype=torch.int64)
        engine.wait(engine.broadcast_async(size, root, f"{name}.sz", process_set=ps))
        if not mine:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        engine.wait(engine.broadcast_async(data, root, f"{name}.t", process_set=ps))
    return obj if mine else _loads(data)


def allgather_object(engine, obj, name, ps):
    """Every rank's `obj` of `ps`, in set order."""
    import torch

    if len(ps.ranks) == 1:
        return [obj]
    with engine.calling("allgather_object", name), _as_object_call(name):
        data = _dumps(obj)
        sizes = engine.wait(engine.allgather_async(
            torch.tensor([data.numel()], dtype=torch.int64), f"{name}.sz", process_set=ps))
        blob = engine.wait(engine.allgather_async(data, f"{name}.t", process_set=ps))
    return [_loads(part) for part in blob.split(sizes.tolist())]
