"""Which collective to run, checked before anything is sent.

`collective=` takes an algorithm name or a Collective (the name plus its
tuning). Everything that can be refused is refused here, on the calling
rank, with the valid choices named; what must agree across ranks (the
algorithm, the codec) is compared by the optimizer when it wraps.
"""
from . import bidirectional_exchange, binomial_tree, linear_pipeline, ring

# The names users pass (collective="lp", ...) -> the module that runs each.
ALGORITHMS = {"lp": linear_pipeline, "ring": ring, "mst": binomial_tree,
              "be": bidirectional_exchange}
DTYPES = ("float16", "bfloat16", "float32", "float64")


class Collective:
    """An algorithm and its tuning.

    chunks: blocks per message (lp: chunks of the chain; ring: pieces per
        segment; mst: int8 scale blocks); None picks them from the cost
        model (lp) or from a 1 MB piece size.
    network: a pipe_horovod.collectives.Network (alpha, beta) the lp chunk count
        is optimised for; None: 100 us per message, 1 Gbit/s.
    """

    def __init__(self, algorithm, *, chunks=None, network=None):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown collective {algorithm!r}; choose one of "
                             f"{', '.join(ALGORITHMS)} (or None for the engine's own allreduce)")
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)
                                   or chunks < 1):
            raise ValueError(f"chunks must be a positive int or None, got {chunks!r}")
        if network is not None and not (hasattr(network, "alpha") and hasattr(network, "beta")):
            raise TypeError(f"network must be a pipe_horovod.collectives.Network, got {network!r}")
        self.algorithm = algorithm
        self.chunks = chunks
        self.network = network

    @property
    def module(self):
        return ALGORITHMS[self.algorithm]

    def describe(self):
        """What ranks must agree on (compared across ranks at wrap time)."""
        return f"{self.algorithm}(chunks={self.chunks}, network={self.network})"

    def __repr__(self):
        return f"Collective({self.describe()})"

    def config(self):
        """Plain values that `from_config` turns back into this Collective (what a saved
        Keras model keeps)."""
        net = self.network
        return {"algorithm": self.algorithm, "chunks": self.chunks,
                "network": None if net is None else {"alpha": net.alpha, "beta": net.beta,
                                                     "gamma": getattr(net, "gamma", 0.0)}}

    @classmethod
    def from_config(cls, config):
        from .cost_model import Network

        net = config.get("network")
        return cls(config["algorithm"], chunks=config.get("chunks"),
                   network=None if net is None else Network(**net))


def check_collective(collective, compression=None):
    """The Collective that `collective=` asks for (None: the engine's own allreduce).

    Refuses a codec that cannot travel per hop: only pipe_horovod's codecs
    know how to encode a partial sum and decode it at the next rank.
    """
    from ..compression import Compression, check_compression

    compression = Compression.none if compression is None else compression
    if collective is not None and not isinstance(collective, (str, Collective)):
        raise TypeError(f"collective must be None or one of {', '.join(ALGORITHMS)} (a str) "
                        f"or a pipe_horovod.collectives.Collective, got {collective!r}")
    spec = Collective(collective) if isinstance(collective, str) else collective
    check_compression(compression, spec)
    if spec is not None and not callable(getattr(compression, "hop", None)):
        raise ValueError(
            f"collective={spec.algorithm!r} encodes at every hop and carries only "
            f"pipe_horovod's codecs (Compression.none, fp16, bf16, int8, int8_ef, int4, "
            f"int4_ef), not "
            f"{compression!r}; use one of those, or collective=None for a Horovod-style codec")
    return spec


def check_dtype(tensor, what):
    dtype = str(tensor.dtype).replace("torch.", "")
    if dtype not in DTYPES:
        raise ValueError(f"{what} reduces floating-point tensors ({', '.join(DTYPES)}), got "
                         f"{tensor.dtype}; use the engine's own collectives for other types")
