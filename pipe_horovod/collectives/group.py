"""The torch.distributed gloo group the collectives send on.

Under torchrun the engine's own world is there: a new gloo group over it
keeps our point-to-point traffic apart from the engine's collectives (and
gives NCCL worlds a CPU path). Under horovodrun there is no torch.distributed
world, so one is started beside Horovod from Horovod's rank and size: rank
0 picks an address and a free port, Horovod's broadcast tells the others.
The same start serves the benchmark's DDP runs (tools/bench/worker.py).
"""
import datetime
import math
import os
import socket

# gloo has no "wait forever": an infinite engine timeout becomes this.
_FOREVER_S = 7 * 24 * 3600.0


def gloo_timeout(eng):
    """How long a point-to-point operation may wait for its peer before gloo raises:
    the engine's wait timeout (PIPE_HOROVOD_TIMEOUT or init(timeout=...)), so a rank
    that never starts a collective becomes an error, not a hang."""
    seconds = eng.timeout_s if math.isfinite(eng.timeout_s) else _FOREVER_S
    return datetime.timedelta(seconds=seconds)


def free_port(host):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_beside(eng, addr=None, port=None):
    """Start torch.distributed's default gloo group with `eng`'s rank and size.

    Returns (address, port, gloo interface, where the address came from).
    """
    import torch.distributed as dist

    if addr and port:
        source = "launcher"
        port = int(port)
    else:
        source = "rank 0 via the engine's broadcast"
        choice = None
        if eng.rank() == 0:
            host = ("127.0.0.1" if eng.local_size() == eng.size()
                    else socket.gethostbyname(socket.gethostname()))
            choice = (host, free_port(host))
        addr, port = eng.broadcast_object(choice, 0, name="pipe_horovod.collectives.address")
    # Gloo connects over this interface: under the emulated cluster the worker's
    # namespace NIC (GLOO_SOCKET_IFNAME); under horovodrun the NIC Horovod chose
    # for its own gloo (HOROVOD_GLOO_IFACE).
    iface = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("HOROVOD_GLOO_IFACE")
    if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=eng.rank(),
                                world_size=eng.size(),
                                timeout=gloo_timeout(eng))
    except Exception as exc:
        raise RuntimeError(
            f"rank {eng.rank()}: could not start a torch.distributed gloo group next to the "
            f"{eng.name} engine at tcp://{addr}:{port} (interface {iface or 'default'}): "
            f"{exc}") from exc
    if dist.get_rank() != eng.rank() or dist.get_world_size() != eng.size():
        raise RuntimeError(f"the torch.distributed group (rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}) does not match the engine's ranks "
                           f"({eng.rank()} of {eng.size()})")
    return addr, port, iface, source


def open_group(eng):
    """(group, owned): a gloo group spanning the engine's ranks; `owned` when this
    call started torch.distributed itself and must tear it down. Collective."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_rank() != eng.rank() or dist.get_world_size() != eng.size():
            raise RuntimeError("torch.distributed is initialized with other ranks than the "
                               f"{eng.name} engine's; pipe_horovod.collectives needs both to agree")
        return dist.new_group(backend="gloo", timeout=gloo_timeout(eng)), False
    start_beside(eng)
    return dist.group.WORLD, True
