"""The project's layout has always named a top-level setup.py: this one defers to
pyproject.toml (PEP 621), where the metadata, extras and entry point live."""
from setuptools import setup

setup()
