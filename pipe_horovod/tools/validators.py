"""argparse types shared by the commands (pipe_horovod.tools.commands) and the
workers they launch (pipe_horovod.tools.bench), so neither imports the other for them.

Each turns bad input into `argparse.ArgumentTypeError`, so argparse exits with
status 2 and the converter's own message, never a traceback.
"""
import argparse
import re


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


def bucket_cap(text):
    """--bucket-cap-mb: "auto" (None: the optimizer's bucket_cap_mb=None, its size picked
    for the ranks and $PIPE_HOROVOD_LINK_*) or a number of MiB > 0."""
    if str(text).strip().lower() in ("auto", "none"):
        return None
    return number(0, what="bucket cap", strict=True)(text)


def bucket_cap_flag(value):
    """A --bucket-cap-mb value as the command line writes it back ("auto" for None)."""
    return "auto" if value is None else f"{value:g}"


def positive_int(what=""):
    """An argparse type for an integer >= 1; `what` names it in the error."""
    return number(1, kind=int, what=what)


def positive(kind=float, what=""):
    """An argparse type for a `kind` > 0; `what` names it in the error."""
    return number(0, kind=kind, what=what, strict=True)


def seconds(what):
    """An argparse type for a number of seconds > 0; `what` names it in the error."""
    def convert(text):
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{what} must be a number of seconds, got {text!r}") from None
        if not value > 0:
            raise ValueError(f"{what} must be > 0 seconds, got {text!r}")
        return value
    convert.__name__ = what
    return checked(convert)


@checked
def link_rate(text):
    """An argparse type for an emulated link's rate: a number and a tc unit (1gbit,
    500mbit, 100mbps), > 0; returned as written, lowercased, for tc."""
    from pipe_horovod.tools.emulate.network import rate_bytes

    if str(text).strip().startswith("-"):
        raise ValueError(f"link rate must not be negative, got {text!r}")
    try:
        value = rate_bytes(text)
    except ValueError:
        raise ValueError(
            f"unrecognised link rate {text!r}: use a number and a tc unit, e.g. 1gbit, 4gbit, "
            "500mbit, 100mbps (bit = bits/s, bps = bytes/s)") from None
    if not value > 0:
        raise ValueError(f"link rate must be > 0, got {text!r}")
    return str(text).strip().lower()


def names(choices, what):
    """An argparse type for a list of names from `choices`, separated by commas or
    spaces, returned in order without repeats; `what` (singular) names them in errors."""
    def convert(text):
        given = [n for n in re.split(r"[,\s]+", str(text).strip()) if n]
        for name in given:
            if name not in choices:
                raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(choices)}")
        if not given:
            raise ValueError(f"no {what} given")
        return list(dict.fromkeys(given))
    convert.__name__ = what
    return checked(convert)


def read_json(path, what):
    """The JSON file at `path` (a run summary, a profile: `what`); ValueError saying it
    cannot be read or is not JSON, naming `what` and `path`."""
    import json

    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not JSON ({exc.msg} at line {exc.lineno})") from None
