"""Suite-wide set-up that must happen before any test module is imported.

TensorFlow >= 2.20 loads its library with RTLD_GLOBAL, and a triton imported
after it binds to TensorFlow's LLVM and segfaults (tensorflow#124205).
Collecting tests/test_keras*.py imports TensorFlow, and a CUDA build of torch
imports triton the first time a test in this process makes a torch.optim
optimizer; the CPU build has no triton. So triton, where installed, is
imported here, before TensorFlow can be.
"""
import importlib.util

if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: F401
