"""The CUDA kernel tests run on a GPU, or on Numba's CUDA simulator - never silently on neither.

Without a GPU, run them in a process of their own with the simulator switched on before numba is
imported (`make test-cuda` does this):

    NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest tests/cuda
"""
import pytest

from minillm.kernels.cuda.setup import cuda_available


@pytest.fixture(autouse=True, scope="session")
def cuda_or_simulator():
    """Every test here errors with the reason when neither a GPU nor the simulator is available."""
    available, reason = cuda_available()
    if not available:
        pytest.fail(f"{reason}\nrun: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest tests/cuda", pytrace=False)
