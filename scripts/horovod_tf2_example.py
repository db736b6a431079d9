#!/usr/bin/env python
"""Run one of Horovod's TensorFlow 2 examples with only its import changed (issue 38).

    python scripts/horovod_tf2_example.py --example /tmp/tensorflow2_mnist.py \
        [--depth 1] [--np 2] [--launcher horovod|torch] [--steps 40] [-- SCRIPT ARGS...]

Horovod's code is never part of this repository: pass its file (at tag v0.28.1,
e.g. `git -C <horovod checkout> show v0.28.1:examples/tensorflow2/tensorflow2_mnist.py`).
The copy that runs differs from it only in

  import horovod.tensorflow as hvd  ->  import pipe_horovod.tensorflow as hvd
  opt.variables()                   ->  opt.variables   (Keras 3 made it a property)

and this harness, not the script, supplies what cannot be had here: MNIST (nothing
can be downloaded) comes back from `keras.datasets.mnist.load_data` as synthetic
arrays of MNIST's shapes (each image noise with a bright band at its label's rows),
and `--steps` caps `tf.data.Dataset.take` so the example's 10000 // size steps of
a convolutional network finish on a small CPU. It prints the changed lines, runs
the copy in a scratch directory under the launcher, and exits with its status;
each rank prints `EXAMPLE_END rank=R` when the script returned.
"""
import argparse
import difflib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EDITS = [("import horovod.tensorflow as hvd", "import pipe_horovod.tensorflow as hvd"),
         ("opt.variables()", "opt.variables")]

RUNNER = '''
import os, runpy, sys
import keras, tensorflow as tf

sys.path.insert(0, SCRIPTS)
from run_with_synthetic_mnist import synthetic_mnist  # the Keras harness's MNIST

for module in (keras.datasets.mnist, tf.keras.datasets.mnist):
    module.load_data = synthetic_mnist
take = tf.data.Dataset.take
tf.data.Dataset.take = lambda self, count, name=None: take(self, min(int(count), STEPS), name)
sys.argv = [SCRIPT, *ARGS]
runpy.run_path(SCRIPT, run_name="__main__")
print(f"EXAMPLE_END rank={os.environ.get('HOROVOD_RANK', os.environ.get('RANK', '0'))}",
      flush=True)
'''


def changed_copy(source):
    """The example with EDITS applied; raises if one does not occur (the file changed)."""
    out = source
    for old, new in EDITS:
        if old not in out:
            raise SystemExit(f"{old!r} is not in the example: is it Horovod 0.28.1's?")
        out = out.replace(old, new)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--example", required=True, type=Path)
    parser.add_argument("--depth", type=int, help="PIPE_HOROVOD_PIPELINE_DEPTH (default: unset)")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--launcher", choices=["horovod", "torch"], default="horovod")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("script_args", nargs="*", help="after --: the example's own arguments")
    args = parser.parse_args()
    source = args.example.read_text()
    copy = changed_copy(source)
    sys.stdout.writelines(difflib.unified_diff(source.splitlines(True), copy.splitlines(True),
                                               "horovod", "ours", n=0))
    work = Path(tempfile.mkdtemp(prefix="tf2_example_"))
    script = work / args.example.name
    script.write_text(copy)
    runner = work / "run_example.py"
    runner.write_text(f"SCRIPT = {str(script)!r}\nSCRIPTS = {str(REPO / 'scripts')!r}\n"
                      f"STEPS = {args.steps}\n"
                      f"ARGS = {args.script_args!r}\n{RUNNER}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]), TF_CPP_MIN_LOG_LEVEL="2")
    if args.depth is not None:
        env["PIPE_HOROVOD_PIPELINE_DEPTH"] = str(args.depth)
    bin_dir = Path(sys.executable).parent
    if args.launcher == "horovod":
        cmd = [str(bin_dir / "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}",
               "--gloo", sys.executable, str(runner)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(args.np), str(runner)]
    print("$", " ".join(cmd), f"(in {work})", flush=True)
    return subprocess.run(cmd, cwd=work, env=env, timeout=args.timeout).returncode


if __name__ == "__main__":
    sys.exit(main())
