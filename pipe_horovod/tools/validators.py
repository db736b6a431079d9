"""argparse types shared by the commands (pipe_horovod.tools.commands) and the
workers they launch (pipe_horovod.tools.bench), so neither imports the other for them.

Each turns bad input into `argparse.ArgumentTypeError`, so argparse exits with
status 2 and the converter's own message, never a traceback.
"""
import argparse


def checked(convert):
    """Turn a converter's ValueError into ArgumentTypeError so argparse exits
    with status 2 and the converter's own message, never a traceback."""
    def wrapper(text):
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    wrapper.__name__ = convert.__name__
    return wrapper


def number(low, high=None, kind=float, what="value", strict=False):
    """An argparse type for a `kind` (float or int) >= low (> low if strict), <= high
    if given; `what` names it in the error ('' for none: argparse names the option)."""
    prefix = f"{what} " if what else ""

    def convert(text):
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"{prefix}must be {'an integer' if kind is int else 'a number'}, "
                             f"got {text!r}") from None
        if (value < low or (strict and value == low) or (high is not None and value > high)
                or value != value):
            bounds = f"> {low}" if strict else f">= {low}"
            if high is not None:
                bounds += f" and <= {high}"
            raise ValueError(f"{prefix}must be {bounds}, got {text!r}")
        return value
    convert.__name__ = what or "value"
    return checked(convert)


def positive_int(what=""):
    """An argparse type for an integer >= 1; `what` names it in the error."""
    return number(1, kind=int, what=what)


def positive(kind=float, what=""):
    """An argparse type for a `kind` > 0; `what` names it in the error."""
    return number(0, kind=kind, what=what, strict=True)
