"""Horovod's pytorch_synthetic_benchmark.py, switched to pipe_horovod by one import.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_synthetic_benchmark.py
    torchrun --nproc_per_node 2 examples/pytorch_synthetic_benchmark.py --pipeline-depth 1
    python examples/pytorch_synthetic_benchmark.py                # one process

Same flags and output as Horovod's script (img/sec per worker and in total),
plus --pipeline-depth, --bf16-allreduce and --horovod (Horovod's own
DistributedOptimizer, for comparison under horovodrun). The model and the
synthetic batch come from the benchmark worker (pipe_horovod.tools.bench.worker),
so the figures match `pipe-horovod bench`. `--configs ...` runs that
worker's full interleaved comparison instead (see `pipe-horovod bench`).
"""
import argparse
import sys
import timeit

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim

import pipe_horovod.torch as hvd
from pipe_horovod.tools.bench import worker


def main():
    if "--configs" in sys.argv[1:]:          # the full comparison: same worker as the CLI
        return worker.main(sys.argv[1:])
    parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark (pipe_horovod)",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--bf16-allreduce", action="store_true", default=False,
                        help="use bf16 compression during allreduce")
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp", help="model to benchmark")
    parser.add_argument("--model-mb", type=float, default=50.0, help="model size, MB of float32")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument("--num-warmup-batches", type=int, default=10,
                        help="number of warm-up batches that don't count towards benchmark")
    parser.add_argument("--num-batches-per-iter", type=int, default=10,
                        help="number of batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    parser.add_argument("--pipeline-depth", type=int, default=2,
                        help="1: synchronous like Horovod; K >= 2: Pipe-SGD")
    parser.add_argument("--horovod", action="store_true",
                        help="use Horovod's own DistributedOptimizer (under horovodrun)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, shape, classes = worker.build_model(args.model, args.model_mb)
    optimizer = optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    if args.horovod:
        import horovod.torch as horovod

        compression = horovod.Compression.fp16 if args.fp16_allreduce else horovod.Compression.none
        optimizer = horovod.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                 compression=compression)
        label = "Horovod DistributedOptimizer"
    else:
        compression = (hvd.Compression.fp16 if args.fp16_allreduce else
                       hvd.Compression.bf16 if args.bf16_allreduce else hvd.Compression.none)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression,
                                             pipeline_depth=args.pipeline_depth)
        label = f"pipe_horovod DistributedOptimizer, pipeline_depth={args.pipeline_depth}"
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    data, target = worker.synthetic_batch(shape, classes, args.batch_size, 1 + hvd.rank())

    def benchmark_step():
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()

    def log(s):
        if hvd.rank() == 0:
            print(s, flush=True)

    n_params = sum(p.numel() for p in model.parameters())
    log(f"Model: {args.model} ({n_params * 4 / 1e6:.1f} MB), {label}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of CPUs: {hvd.size()}")

    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU")
        img_secs.append(img_sec)
    if hasattr(optimizer, "flush"):
        optimizer.flush()                     # apply the gradients still in flight

    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per CPU: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * img_sec_mean:.1f} "
        f"+-{hvd.size() * img_sec_conf:.1f}")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
