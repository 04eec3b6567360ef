"""Layer 2: operators - NumPy reference, Numba CPU kernels, Numba CUDA kernels, quantized formats."""
