"""A/B: the .grad edit detection of issue 31 (torch/edits.py) on vs off, K=2, a many-parameter
model. Run: torchrun --nproc_per_node 2 examples/bench_edit_detection.py (docs/bench/log.md)."""
import time, statistics, torch, torch.nn as nn, torch.nn.functional as F
import pipe_horovod.torch as hvd
from pipe_horovod.torch import edits
hvd.init(); torch.set_num_threads(1)
torch.manual_seed(0)
layers = [nn.Linear(128, 128) for _ in range(40)]
model = nn.Sequential(*[m for l in layers for m in (l, nn.Tanh())], nn.Linear(128, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(), pipeline_depth=2)
x = torch.randn(64, 128); y = torch.randint(0, 10, (64,))
real_record, real_edited = edits.GradientWatch.record, edits.GradientWatch.edited
def run(n):
    t = time.perf_counter()
    for _ in range(n):
        opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
    return (time.perf_counter() - t) / n
on, off = [], []
run(10)
for r in range(8):
    edits.GradientWatch.record, edits.GradientWatch.edited = real_record, real_edited
    on.append(run(25))
    edits.GradientWatch.record = lambda self, p: None
    edits.GradientWatch.edited = lambda self: None
    off.append(run(25))
w = edits.GradientWatch(); ps = list(model.parameters())
t = time.perf_counter()
for _ in range(1000):
    for p in ps: w.record(p)
    w.edited(); w.clear()
per = (time.perf_counter() - t) / 1000
if hvd.rank() == 0:
    a, b = statistics.median(on), statistics.median(off)
    print(f"params {len(ps)}: step on {a*1e3:.3f} ms, off {b*1e3:.3f} ms, diff {(a-b)/b*100:+.2f}%; "
          f"record+check alone {per*1e6:.1f} us/step = {per/b*100:.2f}% of the step")
opt.flush()
