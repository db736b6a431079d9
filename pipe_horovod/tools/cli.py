"""The `pipe-horovod` command: one subcommand per module in `commands/`."""
import argparse
import importlib
import sys

# Subcommand name -> module under pipe_horovod.tools.commands (its name with _ for -) exposing
# add_arguments(parser) and run(args) -> exit code. Imported lazily so
# `pipe-horovod check` works even when torch is missing.
COMMANDS = {
    "check": "Print which engines, controllers and frameworks are available.",
    "model": "Predict sync vs pipelined step time from the timing model.",
    "plan": "Predict a real model's step time per system (Horovod, DDP, ours, codecs) on a cluster.",
    "simulate": "Run a real model's step (Horovod, ours K=1/K=2, codecs) on SimGrid over a topology.",
    "bench": "Measure pipelined vs sync vs Horovod vs DDP step time.",
    "bench-collectives": "Bus bandwidth of each collective algorithm and per-hop codec.",
    "convergence": "Time to accuracy: sync vs pipelined (K=2) with each staleness option.",
    "convergence-lm": "Validation loss of a char transformer with AdamW: sync vs default vs plain K=2.",
    "memory": "Live tensor memory per configuration (Horovod, DDP, ours K=1, K=2, default).",
}


def build_parser():
    """(the `pipe-horovod` parser, {subcommand: its module}) for the commands importable here."""
    parser = argparse.ArgumentParser(prog="pipe-horovod")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, help_text in COMMANDS.items():
        try:
            module = importlib.import_module(f"pipe_horovod.tools.commands.{name.replace('-', '_')}")
        except ModuleNotFoundError as exc:
            if not exc.name.startswith("pipe_horovod.tools.commands"):
                raise
            continue
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser, modules


def main(argv=None):
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
