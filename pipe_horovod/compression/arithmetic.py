"""What every codec computes alike: the block size and scale bytes of the quantized
formats, the type sums and residuals are kept in, and a division that rounds the same on
every device. Below the codecs (hops.py, two_stage.py, feedback.py) and the package's
`Compression`, which all import it: none of them imports the package for these."""


DEFAULT_BLOCK_SIZE = 256      # elements per float32 scale: 4 bytes per 256 values, 1.6% more
SCALE_BYTES = 4               # one float32 scale in front of each block


def accumulator(dtype):
    """The type reductions sum in and residuals are kept in: float64 for float64
    tensors, float32 for every other floating type (a 16-bit or 8-bit sum loses too much)."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def divide_(tensor, number, out=None):
    """tensor / number into `out` (tensor itself when None), rounded as the quotient on
    every device. CUDA divides by a Python number as a product with the number's
    reciprocal, which rounds differently (the GPU kit's codec check, 2026-11-27: the
    int8 and fp8 scales, so 431 of 864 intermediates, differed from the CPU's); a
    divisor that is a tensor on the tensor's device is divided by, as on the CPU and in
    the C kernels."""
    import torch

    divisor = torch.full((), number, dtype=tensor.dtype, device=tensor.device)
    return torch.div(tensor, divisor, out=tensor if out is None else out)
