from setuptools import find_packages, setup

TORCH = ["torch==2.13.0"]

setup(
    name="pipe_horovod",
    version="0.1.0",
    description="Pipelined (Pipe-SGD) gradient communication for PyTorch and Keras, Horovod-style.",
    python_requires=">=3.11",
    packages=find_packages(include=["pipe_horovod", "pipe_horovod.*"]),
    install_requires=["numpy", "tqdm", "matplotlib"],
    extras_require={
        "torch": TORCH,
        # The Keras adapter talks to the torch-based engines (DESIGN.md).
        "keras": TORCH + ["tensorflow-cpu==2.21.0"],
        "tensorflow": TORCH + ["tensorflow-cpu==2.21.0"],
        # dockerfile: the official Dockerfile parser (Go, as a wheel) for tests/test_deploy.py.
        "test": TORCH + ["pytest", "pytest-timeout", "scikit-learn", "dockerfile", "pyyaml"],
    },
    entry_points={"console_scripts": ["pipe-horovod=pipe_horovod.cli:main"]},
)
