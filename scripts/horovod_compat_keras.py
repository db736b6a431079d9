#!/usr/bin/env python
"""Horovod's Keras suite against pipe_horovod.keras (issue 36).

From Horovod's own sources at --ref (default v0.28.1), read out of a git clone
of horovod/horovod (--horovod-git) into a temporary folder and never into this
repository, runs:

  tests     test/parallel/test_tensorflow2_keras.py, one test per
            `horovodrun -np 2 -H localhost:2 --gloo python -m pytest -x ...`
            (scripts/horovod_compat.py's machinery);
  examples  EXAMPLES below, each whole under `horovodrun -np 2 ... --gloo`
            through scripts/run_with_synthetic_mnist.py (MNIST made up: nothing
            can be downloaded), which also reports what each rank's models
            hold at the end;

under the configurations horovod (the files as they are), ours-k2
(PIPE_HOROVOD_PIPELINE_DEPTH=2) and ours-k1 (PIPE_HOROVOD_PIPELINE_DEPTH=1).

The change for ours: the imports (`horovod.tensorflow.keras` and
`horovod.keras` -> `pipe_horovod.keras`) plus RENAMES, a short list of
mechanical edits that Keras 3 forces on any Keras 2 script, with or without
Horovod, each with the Keras 3 change behind it; nothing else. Results go
to a JSON file (resumable, as scripts/horovod_compat.py's) and, with
--markdown, to the Keras section of docs/horovod_compatibility.md.

    python scripts/horovod_compat_keras.py --horovod-git /work/.mirror/horovod+horovod/repo \\
        --out docs/horovod_compatibility_keras.json --markdown docs/horovod_compatibility.md

Horovod's test file imports `parameterized`: pyproject.toml's `horovod-tests` extra
installs it (`make install` does); without it the harness stops before collection,
naming the module and that command (horovod_compat.check_imports).

The machinery serves any of Horovod's suites described as a Suite (KERAS here;
scripts/horovod_compat_tensorflow.py's TENSORFLOW): which file, the files beside
it, the module map, the renames, the markdown section. --batch N runs N tests per
launch (horovod_compat.run_batch) where one test per launch would take too long.
"""
import argparse
import dataclasses
import datetime
import hashlib
import json
import re
import shlex
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import horovod_compat as hc  # noqa: E402

KERAS_MODULES = {"horovod.tensorflow.keras": "pipe_horovod.keras",
                 "horovod.keras": "pipe_horovod.keras"}
TESTS = "test/parallel/test_tensorflow2_keras.py"
RUNNER = Path(__file__).resolve().parent / "run_with_synthetic_mnist.py"
# name -> (path in Horovod's repository, arguments). The benchmark's defaults are a GPU's
# (ResNet-50, 224x224, batch 32): on a CPU its own flags pick a size that ends in minutes.
EXAMPLES = {
    "tensorflow2_keras_mnist": ("examples/tensorflow2/tensorflow2_keras_mnist.py", []),
    "tensorflow2_keras_synthetic_benchmark": (
        "examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py",
        ["--no-cuda", "--model", "MobileNetV2", "--batch-size", "8", "--num-iters", "3",
         "--num-batches-per-iter", "5"]),
    "keras_mnist": ("examples/keras/keras_mnist.py", []),
    "keras_mnist_advanced": ("examples/keras/keras_mnist_advanced.py", []),
}

# (pattern, replacement, the Keras 3 change that forces it). Applied to every file, in
# order, with re.MULTILINE; the table in the docs says where each one applied.
RENAMES = [
    (r"\blr=", "learning_rate=",
     "Keras 3 optimizers take the rate only as `learning_rate` (`lr=` raises "
     "`ValueError: Argument(s) not recognized`)"),
    (r"\.optimizer\.lr\b", ".optimizer.learning_rate",
     "Keras 3 optimizers have no `lr` attribute"),
    (r",\s*experimental_run_tf_function=False", "",
     "Keras 3's `compile()` has no `experimental_run_tf_function` (TypeError)"),
    (r"keras\.layers\.ThresholdedReLU\(", "keras.layers.ReLU(threshold=",
     "Keras 3 removed `ThresholdedReLU`; `ReLU(threshold=t)` is its replacement"),
    (r"\bkeras\.losses\.mean_squared_error\b", "keras.losses.MSE",
     "Keras 3's `tf.keras` namespace exports that loss function only as `MSE` / `mse`"),
    (r"super\(\)\.__init__\(name=name, \*\*kwargs\)",
     "super().__init__(learning_rate=0.1, name=name, **kwargs)",
     "Keras 3's `Optimizer.__init__` requires `learning_rate` (the test sets 0.1 "
     "right after, through Keras 2's `_build_learning_rate`)"),
    (r"def update_step\(self, gradient, variable\):",
     "def update_step(self, gradient, variable, learning_rate):",
     "Keras 3 calls `update_step(gradient, variable, learning_rate)`"),
    (r"\bvar\.ref\(\)", "var.value.ref()",
     "Keras 3 variables are not `tf.Variable`s and have no `ref()`; the TensorFlow variable "
     "each holds (`.value`) has"),
    (r"\.fit_generator\(", ".fit(",
     "Keras 3 removed `fit_generator`; `fit` takes the generator"),
    (r"^from keras\.preprocessing\.image import ImageDataGenerator$",
     "from keras.src.legacy.preprocessing.image import ImageDataGenerator",
     "Keras 3 dropped `ImageDataGenerator` from its public API and still ships it under "
     "`keras.src.legacy`"),
    (r"^config = tf\.ConfigProto\(\)\n(?:config\.gpu_options\..*\n)*"
     r"K\.set_session\(tf\.Session\(config=config\)\)\n", "",
     "TensorFlow 2 / Keras 3 have no sessions (`tf.ConfigProto`, `tf.Session`, "
     "`keras.backend.set_session` are gone); these lines only pinned a GPU"),
]
# Tests that exercise only a Keras 2 feature, which Keras 3 does not have: test -> why.
KERAS2_ONLY = {
    "Tf2KerasTests::test_legacy_optimizer":
        "`keras.optimizers.legacy` (Keras 2's optimizers): in Keras 3 every one of them "
        "raises `ImportError: keras.optimizers.legacy is not supported in Keras 3`, before "
        "Horovod or pipe_horovod is involved.",
}
# Collected but not Horovod's: test -> what it is (not counted either).
NOT_HOROVODS = {
    "Tf2KerasTests::test_session":
        "`tf.test.TestCase.test_session`, TensorFlow's deprecated session helper, which pytest "
        "collects by its name and TensorFlow skips (\"Not a test.\").",
}
KERAS_BEGIN, KERAS_END = hc.KERAS_BEGIN, hc.KERAS_END
CONFIGS = hc.CONFIGS
COMMON = "test/utils/common.py"


@dataclasses.dataclass(frozen=True)
class Suite:
    """One of Horovod's test files with what this harness needs to run it against ours:
    the module map for the imports, the files beside it (converted as it is; COMMON cut
    to the helpers it imports), the examples, the renames, and the markdown section."""
    name: str
    modules: dict
    tests: str
    support: tuple = ()
    examples: dict = dataclasses.field(default_factory=dict)
    renames: list = dataclasses.field(default_factory=list)
    begin: str = KERAS_BEGIN
    end: str = KERAS_END
    render: object = None          # (data, command) -> the section, begin to end
    classify: object = None        # test file's source -> {test: category}, kept in meta

    def files(self):
        return [self.tests, *self.support] + [path for path, _ in self.examples.values()]


def convert(source, suite=None):
    """The imports rewritten, then the suite's renames: (new source, [(what, count)]).
    A file with no import to rewrite (a helper module beside the tests) is left as is."""
    suite = suite or KERAS
    try:
        source, imports = hc.rewrite_imports(source, suite.modules)
    except ValueError as err:
        if not str(err).startswith("no "):
            raise
        imports = []
    changes = [(f"import: {old.strip()} -> {new.strip()}", 1) for _, old, new in imports]
    for pattern, replacement, _ in suite.renames:
        source, count = re.subn(pattern, replacement, source, flags=re.MULTILINE)
        if count:
            changes.append((pattern, count))
    return source, changes


def read_sources(git_dir, ref, dest, paths):
    """Horovod's files `paths` at `ref`, written under `dest` by their paths."""
    for path in paths:
        text = subprocess.run(["git", "-C", str(git_dir), "show", f"{ref}:{path}"],
                              capture_output=True, text=True, check=True).stdout
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_text(text)
    commit = subprocess.run(["git", "-C", str(git_dir), "rev-parse", f"{ref}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    return commit


# --------------------------------------------------------------------------
# Examples

_END = re.compile(r"EXAMPLE_END rank=(\d+) models=(\d+) in_flight=(\d+) weights=(\w+)")
UNAPPLIED = "computed gradient(s) were not applied"


def parse_example(output, returncode, np=2, timed_out=False, timeout=None):
    """One example's run: status, error, and how it ended (runner's EXAMPLE_END lines)."""
    per_rank = hc.split_ranks(output)
    ends = {}
    for rank in range(np):
        for text in per_rank.get(rank, []):
            m = _END.search(text)
            if m:
                ends[rank] = (int(m.group(2)), int(m.group(3)), m.group(4))
    result = {"unapplied_warning": UNAPPLIED in output}
    if ends:
        result.update(models=max(e[0] for e in ends.values()),
                      in_flight=sum(e[1] for e in ends.values()),
                      weights_agree=len({e[2] for e in ends.values()}) == 1)
    if timed_out:
        return {**result, "status": "TIMEOUT", "error": f"no result after {timeout:g} s"}
    if returncode == 0 and len(ends) == np:
        return {**result, "status": "PASS", "error": None}
    error = hc.first_error(per_rank) or f"exit {returncode}"
    return {**result, "status": "FAIL", "error": error}


def run_example(name, work, config, args, data_env, examples=EXAMPLES):
    path, example_args = examples[name]
    script = work / ("horovod" if config == "horovod" else "ours") / path
    cmd = [args.horovodrun, "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo",
           args.python, str(RUNNER), str(script), *example_args]
    folder = work / "run" / config / name          # examples write checkpoints to ./
    folder.mkdir(parents=True, exist_ok=True)
    env = {**hc.config_env(config), **data_env}
    output, rc, timed_out, seconds = hc.launch(cmd, folder, env, args.example_timeout)
    hc.write_log(args.logs, config, name, cmd, folder, rc, output)
    return {**parse_example(output, rc, args.np, timed_out, args.example_timeout),
            "rc": rc, "seconds": seconds, "args": example_args}


# --------------------------------------------------------------------------
# Markdown (the Keras section of docs/horovod_compatibility.md)

def _counts(results, config):
    return Counter(r.get(config, {}).get("status", "—") for r in results.values())


def render_keras(data, command):
    tests, examples, meta = data.get("tests", {}), data.get("examples", {}), data.get("meta", {})
    out = [KERAS_BEGIN, "## Horovod's Keras suite against `pipe_horovod.keras`", "",
           "Generated by `scripts/horovod_compat_keras.py` (issue 36). Horovod 0.28.1's "
           "`test/parallel/test_tensorflow2_keras.py`, one test per `horovodrun -np 2 -H "
           "localhost:2 --gloo python -m pytest -x`, and its Keras examples, each whole under "
           "`horovodrun -np 2 --gloo` with MNIST made up (`scripts/run_with_synthetic_mnist.py`); "
           "Horovod's files are read from its repository at the tag and never copied here. "
           "**Horovod**: the files as they are; **ours K=2**: the imports changed to "
           "`pipe_horovod.keras` and the Keras 3 renames below, `PIPE_HOROVOD_PIPELINE_DEPTH=2`; **ours K=1**: the "
           "same with `PIPE_HOROVOD_PIPELINE_DEPTH=1`.", "", *SECTION_NOTES, "", "Command:", "",
           "```", command,
           "```", "", "| | |", "|---|---|"]
    for key in ("horovod_ref", "horovod_commit", "tests_sha256", "tests_collected", "horovod",
                "pipe_horovod", "tensorflow", "keras", "python", "updated", "example_env"):
        if key in meta:
            out.append(f"| {key} | {meta[key]} |")
    commits = Counter(r["pipe_horovod"] for group in (tests, examples) for runs in group.values()
                      for r in runs.values() if "pipe_horovod" in r)
    if len(commits) > 1:
        out += ["", "The runs of ours were made at these pipe_horovod commits (runs): "
                + ", ".join(f"{c} ({n})" for c, n in sorted(commits.items())) + "."]
    out += ["", "### The changes for ours", "",
            "Besides the imports, each applied where it matches, in every file:", "",
            "| pattern | replacement | forced by | applied |", "|---|---|---|---|"]
    applied = meta.get("applied", {})
    for pattern, replacement, why in RENAMES:
        where = ", ".join(f"{f} ({n})" for f, n in sorted(applied.get(pattern, {}).items()))
        shown = replacement.replace("\n", " ") or "(removed)"
        out.append(f"| `{pattern.replace('|', chr(92) + '|')}` | `{shown}` | {why} | "
                   f"{where or '—'} |")
    out += ["", "### Tests: summary", "", "| config | " + " | ".join(hc.STATUSES) + " | not run |",
            "|---|" + "---|" * (len(hc.STATUSES) + 1)]
    for c in CONFIGS:
        counts = _counts(tests, c)
        out.append(f"| {hc.CONFIG_TITLES[c]} | " + " | ".join(str(counts.get(s, 0))
                                                           for s in hc.STATUSES)
                   + f" | {counts.get('—', 0)} |")
    horovod_errors = {r.get("error") or "" for group in (tests, examples)
                      for runs in group.values() for c, r in runs.items() if c == "horovod"}
    if len(horovod_errors) == 1 and "has not been built" in next(iter(horovod_errors)):
        out.append(f"\nHorovod: every run made fails at `import horovod.tensorflow.keras` "
                   f"({hc._md_code(next(iter(horovod_errors)))}): Horovod 0.28.1's TensorFlow "
                   "extension does not build against TensorFlow >= 2.16. Its column was not "
                   "run for every test and example (\"not run\"): each would fail there.")
    counted = [t for t in tests if t not in KERAS2_ONLY and t not in NOT_HOROVODS]
    for c in ("ours-k2", "ours-k1"):
        passed = [t for t in counted if tests[t].get(c, {}).get("status") == "PASS"]
        if any(c in tests[t] for t in tests):
            out.append(f"\n{hc.CONFIG_TITLES[c]}: {len(passed)}/{len(counted)} of the tests that "
                       f"do not exercise only a Keras 2 feature pass"
                       + (" — target met." if len(passed) == len(counted) else " — not met."))
    out += ["", "Keras 2 only (not counted):", ""]
    out += [f"- `{t}`: {why}" for t, why in sorted(KERAS2_ONLY.items())]
    out += ["", "Collected, not Horovod's (not counted):", ""]
    out += [f"- `{t}`: {why}" for t, why in sorted(NOT_HOROVODS.items())]
    out += ["", "### Tests", "", "| test | " + " | ".join(hc.CONFIG_TITLES[c] for c in CONFIGS)
            + " |", "|---|" + "---|" * len(CONFIGS)]
    for t in sorted(tests):
        out.append(f"| `{t.split('::')[-1]}` | " + " | ".join(
            tests[t].get(c, {}).get("status", "—") for c in CONFIGS) + " |")
    out += ["", "### Examples", "",
            "Each to its end; `in flight` is what the ranks' optimizers hold unapplied at the "
            "end, `agree` whether every rank ends with the same weights, `warning` whether the "
            "run printed that computed gradients were not applied.", "",
            "| example | arguments | config | result | seconds | in flight | agree | warning |",
            "|---|---|---|---|---|---|---|---|"]
    for name in sorted(examples):
        for c in CONFIGS:
            r = examples[name].get(c)
            if r:
                out.append(f"| `{name}` | `{' '.join(r.get('args', [])) or '—'}` | "
                           f"{hc.CONFIG_TITLES[c]} | {r['status']} | {r['seconds']} | "
                           f"{r.get('in_flight', '—')} | {_yes(r.get('weights_agree'))} | "
                           f"{_yes(r.get('unapplied_warning'))} |")
    failures = [(kind, t, c, r) for kind, group in (("test", tests), ("example", examples))
                for t in sorted(group) for c, r in group[t].items()
                if r.get("status") not in ("PASS", "SKIP")]
    if failures:
        out += ["", "### Failures", ""]
        out += [f"- {kind} `{t.split('::')[-1]}`, {hc.CONFIG_TITLES[c]}: "
                f"{hc._md_code(r.get('error'))}" for kind, t, c, r in failures]
    out += ["", KERAS_END]
    return "\n".join(out)


def _yes(value):
    return "—" if value is None else ("yes" if value else "no")


# A section's hand-written notes: a render emits the markers empty, a re-render keeps them.
SECTION_NOTES = ("<!-- section notes -->", "<!-- /section notes -->")


def write_section(markdown, block, begin=KERAS_BEGIN, end=KERAS_END):
    """Put `block` in place of the section `begin`..`end` of `markdown` (appended if none),
    with the old section's notes (SECTION_NOTES) where `block` has the markers."""
    path = Path(markdown)
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        old, tail = rest.split(end, 1)
        open_, close = SECTION_NOTES
        if open_ in old and open_ + "\n" + close in block:
            notes = old.split(open_, 1)[1].split(close, 1)[0].strip("\n")
            block = block.replace(open_ + "\n" + close, f"{open_}\n{notes}\n{close}")
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


# --------------------------------------------------------------------------

KERAS = Suite("Keras", KERAS_MODULES, TESTS, examples=EXAMPLES, renames=RENAMES,
              render=render_keras)


def main(argv=None, suite=None, script="scripts/horovod_compat_keras.py", doc=__doc__):
    suite = suite or KERAS
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--horovod-git", help="git directory of a horovod/horovod clone")
    p.add_argument("--ref", default="v0.28.1", help="Horovod tag or commit (default v0.28.1)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--only", choices=("tests", "examples"), help="run one half only")
    p.add_argument("-k", dest="keyword", help="pytest -k expression, or an example's name part")
    p.add_argument("--timeout", type=float, default=240,
                   help="seconds per launch (default 240)")
    p.add_argument("--batch", type=int, default=1,
                   help="tests per launch (default 1: each alone, stopping at its failure)")
    p.add_argument("--example-timeout", type=float, default=3600,
                   help="seconds per example run (default 3600)")
    p.add_argument("--max-epochs", type=int,
                   help="cap every fit's epochs (Keras's KERAS_MAX_EPOCHS; default: none)")
    p.add_argument("--max-steps", type=int, help="cap every epoch's steps "
                   "(Keras's KERAS_MAX_STEPS_PER_EPOCH; default: none)")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--out", help="results JSON (runs already there are skipped)")
    p.add_argument("--rerun", action="store_true")
    p.add_argument("--markdown", help="write the Keras section of this file")
    p.add_argument("--logs", help="folder for each run's full output")
    p.add_argument("--horovodrun", default=str(Path(sys.executable).parent / "horovodrun"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--render-only", action="store_true")
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if set(configs) - set(CONFIGS):
        p.error(f"configs are among {CONFIGS}")
    data = hc.load_results(args.out)
    data.setdefault("tests", {})
    data.setdefault("examples", {})
    data.pop("results", None)
    command = f"python {script} " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if not args.render_only:
        if not args.horovod_git:
            p.error("--horovod-git is required unless --render-only")
        data["meta"]["commands"] = (data["meta"].get("commands", []) + [command])[-10:]
        run_all(args, configs, data, suite)
    if args.markdown:
        write_section(args.markdown, suite.render(
            data, "\n".join(data["meta"].get("commands") or [command])), suite.begin, suite.end)
        print(f"wrote the {suite.name} section of {args.markdown}")
    for kind in ("tests", "examples"):
        for c in configs:
            counts = _counts(data[kind], c)
            print(f"{kind} {c}: " + ", ".join(f"{s} {counts.get(s, 0)}" for s in hc.STATUSES))
    return 0


def run_all(args, configs, data, suite):
    import keras
    import tensorflow as tf
    from tqdm import tqdm

    meta = data["meta"]
    data_env = {}
    if args.max_epochs:
        data_env["KERAS_MAX_EPOCHS"] = str(args.max_epochs)
    if args.max_steps:
        data_env["KERAS_MAX_STEPS_PER_EPOCH"] = str(args.max_steps)
    with tempfile.TemporaryDirectory(prefix="horovod_compat_keras_") as root:
        work = Path(root)
        src = work / "src"
        commit = read_sources(args.horovod_git, args.ref, src, suite.files())
        if suite.classify:
            meta["categories"] = suite.classify((src / suite.tests).read_text())
        applied = {}
        for kind in ("horovod", "ours"):
            for path in suite.files():
                text = (src / path).read_text()
                if path == COMMON:
                    text = hc.common_helpers(text, (src / suite.tests).read_text())
                elif kind == "ours":
                    text, changes = convert(text, suite)
                    for what, count in changes:
                        applied.setdefault(what, {})[Path(path).name] = count
                (work / kind / path).parent.mkdir(parents=True, exist_ok=True)
                (work / kind / path).write_text(text)
        try:
            import horovod
            meta["horovod"] = horovod.__version__
        except ImportError:
            meta["horovod"] = "not installed"
        meta.update(horovod_ref=args.ref, horovod_commit=commit, applied=applied,
                    tests_sha256=hashlib.sha256((src / suite.tests).read_bytes()).hexdigest(),
                    pipe_horovod=hc.repo_state(), tensorflow=tf.__version__,
                    keras=keras.__version__, python=sys.version.split()[0],
                    updated=datetime.datetime.now().isoformat(timespec="seconds"))
        if data_env:
            meta["example_env"] = " ".join(f"{k}={v}" for k, v in sorted(data_env.items()))
        todo = []
        if args.only != "examples":
            for kind in ("horovod", "ours"):
                (work / kind / suite.tests).parent.joinpath("pytest.ini").write_text(
                    hc.pytest_ini(args.timeout))
            hc.check_imports({work / ("horovod" if c == "horovod" else "ours") / suite.tests
                              for c in configs}, args.python, hc.config_env("horovod"))
            # Collected from ours: Horovod's own file cannot import horovod.tensorflow.keras
            # on TensorFlow >= 2.16 (its extension does not build), so it collects nothing.
            ids = hc.collect(work / "ours" / suite.tests, args.python, args.keyword)
            if not args.keyword:
                meta["tests_collected"] = len(ids)
            todo += [("tests", hc.test_key(t), c) for t in ids for c in configs]
        if args.only != "tests":
            todo += [("examples", name, c) for name in suite.examples for c in configs
                     if not args.keyword or args.keyword in name]
        todo = [(kind, key, c) for kind, key, c in todo
                if args.rerun or c not in data[kind].get(key, {})]
        print(f"{len(todo)} runs to do")
        # Tests of one configuration go --batch at a time into one launch.
        units, batch = [], max(1, args.batch)
        for c in configs:
            keys = [key for kind, key, cc in todo if kind == "tests" and cc == c]
            units += [("tests", keys[i:i + batch], c) for i in range(0, len(keys), batch)]
        units += [(kind, [key], c) for kind, key, c in todo if kind == "examples"]
        with tqdm(total=len(todo), unit="run", dynamic_ncols=True) as bar:
            for kind, keys, c in units:
                if kind == "tests":
                    test_file = work / ("horovod" if c == "horovod" else "ours") / suite.tests
                    ids = [f"{test_file.name}::{key}" for key in keys]
                    if len(ids) == 1:
                        results = {keys[0]: hc.run_one(test_file.parent, ids[0], c, args.horovodrun,
                                                       args.python, args.timeout, np=args.np,
                                                       log_dir=args.logs)}
                    else:
                        results = hc.run_batch(test_file.parent, ids, c, args.horovodrun,
                                               args.python, args.timeout, np=args.np,
                                               log_dir=args.logs)
                else:
                    results = {keys[0]: run_example(keys[0], work, c, args, data_env, suite.examples)}
                for key in keys:
                    res = results.get(key)
                    if res is None:
                        tqdm.write(f"{'—':7} {c:8} {key}: not finished in its batch (run again)")
                        continue
                    if c != "horovod":
                        res["pipe_horovod"] = meta["pipe_horovod"]
                    data[kind].setdefault(key, {})[c] = res
                    bar.update(1)
                    line = f"{res['status']:7} {c:8} {key} ({res['seconds']} s)"
                    if res["status"] not in ("PASS", "SKIP") and res.get("error"):
                        line += f": {res['error'][:200]}"
                    tqdm.write(line)
                hc.save_results(data, args.out)
    meta["updated"] = datetime.datetime.now().isoformat(timespec="seconds")
    hc.save_results(data, args.out)


if __name__ == "__main__":
    sys.exit(main())
