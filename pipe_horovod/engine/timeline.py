"""A Chrome-trace timeline of collectives, for engines whose library has none.

Horovod's `start_timeline` writes what its coordinator did, one event per
operation, in the Chrome tracing format (chrome://tracing, Perfetto). The
torch and local engines record the same kind of file from the engine's own
bookkeeping: an operation starts when it is handed to the engine and ends
when `wait` returns it. As in Horovod, only rank 0 writes. Each event is
written when it ends, so the file is readable while training runs (the
format allows the closing bracket to be missing).
"""
import json
import os
import threading
import time


class Timeline:
    def __init__(self, file_path, mark_cycles=False):
        if not isinstance(file_path, (str, os.PathLike)) or not str(file_path):
            raise ValueError(f"start_timeline needs a file path, got {file_path!r}")
        self._file = open(file_path, "w")          # noqa: SIM115 -- closed by close()
        self._file.write("[\n")
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        self.mark_cycles = mark_cycles             # accepted for Horovod's signature

    def now(self):
        return time.perf_counter()

    def record(self, kind, name, start, end):
        event = {"name": kind, "cat": kind, "ph": "X", "pid": 0, "tid": 0,
                 "ts": round((start - self._origin) * 1e6, 3),
                 "dur": round((end - start) * 1e6, 3), "args": {"tensor": name}}
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps(event) + ",\n")
                self._file.flush()

    def close(self):
        with self._lock:
            if not self._file.closed:
                self._file.write("{}]\n")
                self._file.close()
