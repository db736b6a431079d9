"""matplotlib for the tools' figures, loaded only when a figure is drawn.

matplotlib is an extra of the tools (`pipe_horovod[tools]`), not a requirement of
the package: training never draws, so an environment that only trains need not
carry it. A tool asked for a figure without it says what to install, instead of
an ImportError from deep inside a report.
"""

INSTALL = "pip install 'pipe_horovod[tools]' (or: pip install matplotlib)"


def pyplot():
    """matplotlib.pyplot on the Agg backend: the tools write files, and a cluster
    node or CI machine has no display."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"drawing this figure needs matplotlib, which is not installed: {INSTALL}",
            name="matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
