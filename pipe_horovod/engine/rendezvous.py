"""The torch engine's rendezvous: say what is at MASTER_ADDR:MASTER_PORT when it fails.

Under env:// (mpirun, a scheduler, ranks started by hand) every rank but 0
connects to the TCPStore rank 0 serves at MASTER_ADDR:MASTER_PORT. When
another program holds that port, rank 0 fails with EADDRINUSE, and the
others connect to that program and wait inside torch's handshake forever:
torch's timeout does not bound it. So before torch connects, `check` makes
the handshake itself, bounded (connect, torch's validation message, one
PING that a TCPStore answers with its nonce), and refuses with the address,
the port and what answered. A failure of torch's own rendezvous is
answered the same way (`explain`). torchrun's agent serves its own store,
which it has made already: nothing to check there.
"""
import os
import socket
import struct
import time

from .base import EngineError
from .faults import TIMEOUT_VARIABLE, WaitTimeoutError

# torch/csrc/distributed/c10d/TCPStoreBackend.hpp: QueryType VALIDATE and PING, and the
# magic number a client validates with.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE
_ANSWER_S = 2.0         # how long a connected server may take to answer the PING
# How long a server that accepts and stays silent is asked again before it counts as
# another program: rank 0's store, loaded (32 ranks connecting at once on 2 busy cores),
# took more than _ANSWER_S to answer, and ranks refused to start.
_SILENT_S = 30.0


def served_by_launcher(environ=None):
    """torchrun serves the store itself (its agent), before starting any worker."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env


def _answer(addr, port, timeout_s):
    """What answers torch's handshake at addr:port: "store", "refused", or a clause
    saying what did instead."""
    try:
        with socket.create_connection((addr, port), timeout=min(timeout_s, _ANSWER_S)) as sock:
            nonce = os.getpid() & 0xFFFFFFFF
            sock.sendall(struct.pack("<BI", _VALIDATE, _MAGIC) + struct.pack("<BI", _PING, nonce))
            sock.settimeout(_ANSWER_S)
            reply = b""
            try:
                while len(reply) < 4:
                    chunk = sock.recv(256)
                    if not chunk:
                        break
                    reply += chunk
            except socket.timeout:
                pass
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return f"connecting failed ({exc})"
    if reply == struct.pack("<I", nonce):
        return "store"
    if not reply:
        return (f"a program there accepted the connection but did not answer torch's "
                f"rendezvous handshake within {_ANSWER_S:g} s: it is not torch's store")
    return f"a program there answered {reply[:60]!r}: it is not torch's store"


def check(addr, port, rank, timeout_s):
    """Rank `rank` (not 0): wait until rank 0's TCPStore answers at addr:port, at most
    `timeout_s`. Raises EngineError when another program answers there (or keeps silent
    for _SILENT_S, as a loaded store does not), WaitTimeoutError when nothing does in
    time."""
    deadline = time.monotonic() + timeout_s
    silent_until = min(deadline, time.monotonic() + _SILENT_S)
    pause = 0.05
    while True:
        answer = _answer(addr, port, max(0.1, deadline - time.monotonic()))
        if answer == "store":
            return
        silent = answer.startswith("a program there accepted the connection but did not")
        if answer != "refused":
            if not silent or time.monotonic() + pause > silent_until:
                # another program has the port (it answered otherwise, or kept silent)
                raise EngineError(_sentence(addr, port, rank, answer))
        elif time.monotonic() + pause > deadline:
            raise WaitTimeoutError(_sentence(
                addr, port, rank, f"nothing answered there (connection refused) for "
                f"{timeout_s:g} s ({TIMEOUT_VARIABLE}, or init(timeout=...))"))
        time.sleep(pause)
        pause = min(2 * pause, 1.0)


def explain(exc, addr, port, rank):
    """torch's rendezvous failure `exc` as an EngineError naming addr:port and what
    answers there now."""
    answer = _answer(addr, port, _ANSWER_S)
    if answer == "store":
        answer = ("torch's store answers there (another job's, if this rank 0 could not "
                  "serve it)")
    elif answer == "refused":
        answer = "nothing answers there now (connection refused)"
    error = EngineError(f"{_sentence(addr, port, rank, answer)} (torch: {exc})")
    error.__cause__ = exc
    return error


def _sentence(addr, port, rank, answer):
    role = "which rank 0 serves" if rank == 0 else "served by rank 0"
    return (f"rank {rank} cannot rendezvous at {addr}:{port} (MASTER_ADDR:MASTER_PORT, "
            f"{role}): {answer}. Give every rank the same MASTER_ADDR and a MASTER_PORT no "
            "other program uses (with mpirun: -x MASTER_PORT=<free port>), and start rank 0")
