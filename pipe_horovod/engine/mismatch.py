"""What ranks must agree on for one collective, and Horovod's words when they do not.

Horovod's coordinator compares every rank's request for a tensor name
before anything moves, and answers a difference with one error on every
rank ("Mismatched ALLREDUCE tensor shapes: ..."). The torch engine's
negotiation (negotiation.py) compares the same fields with this module, so
a script gets the same sentence under torchrun as under horovodrun, plus
the tensor's name and the two ranks, which Horovod does not say.
"""
import re
import struct

from .faults import HorovodInternalError

# Operation kinds as Horovod's Request::RequestType names them in its messages.
KINDS = ("ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "JOIN", "BARRIER")
# Small codes for dtypes and ops (any code works if it is the same on every rank).
DTYPES = ("float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32",
          "int64", "bool", "complex64", "complex128")
OPS = ("Average", "Sum", "Adasum", "Min", "Max", "Product")
DIMS = 8            # dimensions carried one by one; further ones folded into the last
NAME_BYTES = 48     # the start of the name, for messages about other ranks' tensors
# key, kind, dtype, op, root, ndim, DIMS dims, prescale, postscale, device, name length, name
WIDTH = 6 + DIMS + 4 + NAME_BYTES // 8


class MismatchError(HorovodInternalError, ValueError):
    """Ranks started the same collective with different shapes, dtypes, ops or roots
    (Horovod raises HorovodInternalError; a ValueError too, as the caller's mistake)."""


def _bits(x):
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _float(bits):
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def encode(key, kind, tensor, op=None, root=-1, prescale=1.0, postscale=1.0, name=""):
    """One rank's request as WIDTH int64s (`tensor` None: a join)."""
    if tensor is None:
        dims, dtype, device = [], -1, -1
    else:
        dims = list(tensor.shape)
        dtype = str(tensor.dtype).replace("torch.", "")
        dtype = DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)
        device = -1 if tensor.device.type == "cpu" else (tensor.device.index or 0)
    if len(dims) > DIMS:
        folded = 1
        for d in dims[DIMS - 1:]:
            folded *= d
        dims = dims[:DIMS - 1] + [folded]
    raw = name.encode()[:NAME_BYTES]
    packed = raw.ljust(NAME_BYTES, b"\0")
    return ([key, KINDS.index(kind.upper()), dtype,
             -1 if op is None else OPS.index(op.name.title()), root,
             -1 if tensor is None else tensor.dim()]
            + (dims + [0] * DIMS)[:DIMS]
            + [_bits(prescale), _bits(postscale), device, len(name.encode())]
            + list(struct.unpack(f"<{NAME_BYTES // 8}q", packed)))


class Record:
    """A decoded request: what the comparison and the joined ranks' stand-ins read."""

    __slots__ = ("key", "kind", "dtype", "op", "root", "ndim", "shape", "prescale",
                 "postscale", "device", "name", "data")

    def __init__(self, row):
        self.data = None        # a small collective's bytes, sent in the cycle (negotiation.py)
        self.key, kind, self.dtype, op, self.root, self.ndim = row[:6]
        self.kind = KINDS[kind]
        self.op = None if op < 0 else OPS[op]
        self.shape = list(row[6:6 + min(max(self.ndim, 0), DIMS)])
        at = 6 + DIMS
        self.prescale, self.postscale = _float(row[at]), _float(row[at + 1])
        self.device, length = row[at + 2], row[at + 3]
        raw = struct.pack(f"<{NAME_BYTES // 8}q", *row[at + 4:at + 4 + NAME_BYTES // 8])
        self.name = raw[:min(length, NAME_BYTES)].decode(errors="replace") + (
            "..." if length > NAME_BYTES else "")

    def dtype_name(self):
        return DTYPES[self.dtype] if 0 <= self.dtype < len(DTYPES) else "other"


def _first_difference(records, field):
    first = records[0]
    for rank, record in records[1:]:
        if field(record) != field(first[1]):
            return first, (rank, record)
    return None


def compare(records):
    """The MismatchError for `records` [(global rank, Record)] of one name, or None.

    Checks in Horovod's order: operation kind, dtype, reduction op, scale
    factors, device, root, shape (all of it for reductions and broadcast,
    beyond dimension 0 for allgather and alltoall)."""
    kind = records[0][1].kind
    checks = [
        (lambda r: r.kind, lambda a, b: (
            f"Mismatched collective operations: One rank did an {a.kind}, but another rank "
            f"did an {b.kind}.")),
        (lambda r: r.dtype, lambda a, b: (
            f"Mismatched data types: One rank had type {a.dtype_name()}, but another rank had "
            f"type {b.dtype_name()}.")),
        (lambda r: r.op, lambda a, b: (
            f"Mismatched reduction operation: One rank sent reduction op {a.op}, but another "
            f"rank sent reduction op {b.op}.")),
        (lambda r: (r.prescale, r.postscale), lambda a, b: (
            f"Mismatched prescale and/or postscale factors: One rank sent factors "
            f"{a.prescale:g}, {a.postscale:g}, but another rank sent factors {b.prescale:g}, "
            f"{b.postscale:g}.")),
        (lambda r: r.device, lambda a, b: (
            f"Mismatched CPU/GPU device selection: One rank specified device "
            f"{_device(a)}, but another rank specified device {_device(b)}.")),
        (lambda r: r.root, lambda a, b: (
            f"Mismatched {kind} root ranks: One rank specified root rank {a.root}, but "
            f"another rank specified root rank {b.root}.")),
    ]
    if kind in ("ALLGATHER", "ALLTOALL"):
        checks.append((lambda r: r.ndim, lambda a, b: (
            f"Mismatched {kind} tensor shapes: One rank sent a tensor of rank {a.ndim}, but "
            f"another rank sent a tensor of rank {b.ndim}.")))
        checks.append((lambda r: r.shape[1:], lambda a, b: _dimension(kind, a, b)))
    else:
        checks.append((lambda r: (r.ndim, r.shape), lambda a, b: (
            f"Mismatched {kind} tensor shapes: One rank sent a tensor of shape {a.shape}, but "
            f"another rank sent a tensor of shape {b.shape}.")))
    for field, say in checks:
        found = _first_difference(records, field)
        if found:
            (ra, a), (rb, b) = found
            return MismatchError(f"{say(a, b)} ({_what(a)}: rank {ra} and rank {rb})")
    return None


def _what(record):
    """How the messages name an operation, as the engine's other errors do: allreduce 'x'."""
    return f"{record.kind.lower()} {record.name!r}"


def _device(record):
    return "CPU" if record.device < 0 else f"GPU {record.device}"


def _dimension(kind, a, b):
    dim = next(i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if i and x != y)
    return (f"Mismatched {kind} tensor shapes: One rank sent a tensor with dimension {dim} "
            f"equal to {a.shape[dim]}, but another rank sent a tensor with dimension {dim} "
            f"equal to {b.shape[dim]}.")


def unsupported_with_join(record):
    """Horovod's answer when a rank that joined would have to stand in for `record`'s kind."""
    kind = record.kind
    extra = (" Specify sparse_to_dense=True if using DistributedOptimizer"
             if kind == "ALLGATHER" else "")
    return MismatchError(f"{kind.title()} is not supported with Join at this time.{extra} "
                         f"({_what(record)})")


def join_refused(exc):
    """Whether `exc` is the refusal of a collective a joined rank cannot stand in for
    (Horovod's words, which the torch engine's negotiation also uses)."""
    return "is not supported with Join" in str(exc)


def from_library(exc, what):
    """Horovod's own refusal in `exc` (its coordinator's comparison, or Join's limits) as a
    MismatchError naming `what`; None for any other failure."""
    text = str(exc).strip()
    if not (text.startswith("Mismatched ") or join_refused(exc)):
        return None
    # Horovod prints its ReduceOp enum's numbers; the torch engine says their names.
    text = re.sub(r"reduction op (\d)", lambda m: f"reduction op {OPS[int(m.group(1))]}", text)
    error = MismatchError(f"{text} ({what})")
    error.__cause__ = exc
    return error
