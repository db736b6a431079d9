"""The benchmark's models: what `pipe-horovod bench --model/--compute` trains.

CPU compute (the default) trains a synthetic MLP or CNN of --model-mb MB, or
a model of `pipe-horovod convergence`, on the workers' own cores. Replayed
compute (`--compute replay`) trains `pipe_horovod.tools.workloads.replay`'s
stand-in for a real model (resnet50, vgg16, bert-base, or the mlp / cnn
above): real parameters, layer-by-layer timed waits at --device-tflops or
from a measured --profile, so the cores are left to communication as on an
accelerator.
"""
import math

from pipe_horovod.tools.bench import convergence_tasks
from pipe_horovod.tools.workloads import architectures
from pipe_horovod.tools.workloads.synthetic import (CNN_CLASSES, MLP_CLASSES, MLP_IN,  # noqa: F401
                                                  build_synthetic, mlp_width)

COMPUTE_MODES = ("cpu", "replay")
DEVICES = ("cpu", "cuda")
# Real architectures that only replay (their CPU step would take minutes on these cores).
REPLAY_ONLY = tuple(m for m in architectures.MODELS if m not in ("mlp", "cnn"))
MODEL_CHOICES = ("mlp", "cnn", *REPLAY_ONLY, *convergence_tasks.MODEL_NAMES)


def build_model(kind, model_mb, layers=5):
    """The benchmark model and one synthetic batch shape: ('mlp'|'cnn', MB of float32)."""
    if kind in convergence_tasks.MODEL_NAMES:     # a model of `pipe-horovod convergence`
        return convergence_tasks.bench_model(kind)
    if kind in ("mlp", "cnn"):
        return build_synthetic(kind, model_mb, layers)
    if kind in REPLAY_ONLY:
        raise ValueError(f"model {kind!r} runs only with replayed compute "
                         "(--compute replay --device-tflops T)")
    raise ValueError(f"unknown model {kind!r}; choose from {', '.join(MODEL_CHOICES)}")


def check_compute(args):
    """The reason args' --compute / --device-tflops / --profile / --model cannot run
    together (or a profile file is wrong), or None."""
    replay = args.compute == "replay"
    if getattr(args, "device", "cpu") == "cuda":
        if replay:
            return ("--device cuda computes on a GPU; --compute replay computes nowhere (timed "
                    "waits): choose one")
        import torch

        if not torch.cuda.is_available():
            return (f"--device cuda: torch {torch.__version__} sees no GPU here "
                    "(torch.cuda.is_available() is False)")
    if not replay:
        if args.device_tflops is not None or args.profile is not None:
            return "--device-tflops and --profile set replayed compute: add --compute replay"
        if args.model in REPLAY_ONLY:
            return (f"--model {args.model} runs only with replayed compute: add --compute "
                    "replay --device-tflops T (its CPU step would take minutes here)")
        return None
    if args.model not in architectures.MODELS:
        return (f"--compute replay needs one of the models {', '.join(architectures.MODELS)} "
                f"(got {args.model!r})")
    if (args.device_tflops is None) == (args.profile is None):
        return ("--compute replay needs exactly one of --device-tflops T (forward = FLOPs / "
                "T TFLOP/s, backward = 2 x forward) or --profile FILE (measured layer times)")
    if args.profile is not None:
        from pipe_horovod.tools.workloads import replay

        try:
            replay.load_profile(args.profile, replay_table(args), args.model, args.batch_size,
                                args.seq_len)
        except ValueError as exc:
            return str(exc)
    return None


def replay_table(args):
    return architectures.layer_table(args.model, args.batch_size, seq_len=args.seq_len,
                                     model_mb=args.model_mb, layers=args.layers)


def bench_model(args):
    """(model, input shape, classes) of this run: args.compute's kind of model."""
    if args.compute != "replay":
        return build_model(args.model, args.model_mb, args.layers)
    from pipe_horovod.tools.workloads import replay

    return (replay.replay_model(args.model, args.batch_size, device_tflops=args.device_tflops,
                                profile=args.profile, seq_len=args.seq_len,
                                model_mb=args.model_mb, layers=args.layers),
            (1,), replay.OUTPUTS)


def worker_device(name, local_rank):
    """The torch device of a worker's model: its local GPU (modulo the GPUs it sees, so
    workers share a machine's one GPU) for "cuda"."""
    import torch

    if name != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def compute_meta(args):
    """What the raw result records about the compute: mode, and for replay the device,
    the layers' total times and the per-layer table (the timing model's input)."""
    if args.compute != "replay":
        device = getattr(args, "device", "cpu")
        return {"mode": "cpu"} if device == "cpu" else {"mode": "cpu", "device": device}
    from pipe_horovod.tools.workloads import replay

    table = replay_table(args)
    times = replay.table_times(table, args.model, args.batch_size,
                               device_tflops=args.device_tflops, profile=args.profile,
                               seq_len=args.seq_len)
    return {"mode": "replay", "device_tflops": args.device_tflops, "profile": args.profile,
            "seq_len": args.seq_len if args.model == "bert-base" else None,
            "forward_s": sum(t.forward_s for t in times),
            "backward_s": sum(t.backward_s for t in times),
            "layers": [{"name": t.name, "forward_s": t.forward_s, "backward_s": t.backward_s,
                        "param_numel": [math.prod(shape) for _, shape in layer.params]}
                       for layer, t in zip(table, times)]}


def compute_label(compute):
    """How reports name the compute of a run (`compute_meta`'s dict, or None: CPU)."""
    if not compute or compute.get("mode") != "replay":
        if compute and compute.get("device") == "cuda":
            return "compute on the GPU"
        return "compute on CPU"
    if compute.get("profile"):
        return f"compute replayed from profile {compute['profile']}"
    return f"compute replayed at {compute['device_tflops']:g} TFLOP/s"


def model_numel(args):
    """Parameter count of the benchmark model, without allocating it."""
    import torch

    if args.compute == "replay":
        return sum(layer.numel for layer in replay_table(args))
    with torch.device("meta"):
        model = build_model(args.model, args.model_mb, args.layers)[0]
    return int(sum(p.numel() for p in model.parameters()))


def synthetic_batch(shape, classes, batch_size, seed):
    import torch

    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(batch_size, *shape, generator=gen)
    target = torch.randint(0, classes, (batch_size,), generator=gen)
    return data, target
