"""A device array that the one model forward can use as it uses a NumPy array.

model/layers.py and model/transformer.py do a few array operations themselves, between the ops:
reshapes, slices, the residual adds, concatenating stacked outputs, picking the rows that get
logits. `DeviceTensor` gives a Numba device array exactly those, each done on the GPU:

    reshape      a view when the array is contiguous, else a copy kernel first (Numba can only
                 reshape contiguous memory; NumPy copies silently in that case too)
    t[a:b, c:d]  a view (strided): every kernel here indexes with strides
    t[indices]   a row gather (the embedding kernel: out[i] = t[indices[i]])
    a + b        an elementwise kernel
    np.concatenate([...], axis=...)   copy kernels into slices of one output (NumPy's
                 __array_function__ protocol hands the call to us)

Anything else NumPy might try - np.asarray(t), t.sum() - fails loudly instead of copying the
array to the host behind our back: the only way out is `to_host()`, counted in setup.TRAFFIC.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from minillm.kernels.cuda.ops import ELEMENTWISE_THREADS, embedding_gpu
from minillm.kernels.cuda.setup import blocks_for, empty_gpu, launch, to_gpu, to_host


@cuda.jit
def copy2_kernel(src, dst):
    """dst (A, B) = src (A, B), any strides; one thread per element."""
    n = cuda.grid(1)
    B = dst.shape[1]
    if n < dst.shape[0] * B:
        dst[n // B, n % B] = src[n // B, n % B]


@cuda.jit
def copy3_kernel(src, dst):
    """dst (A, B, C) = src (A, B, C), any strides; one thread per element."""
    n = cuda.grid(1)
    B, C = dst.shape[1], dst.shape[2]
    if n < dst.shape[0] * B * C:
        a, b, c = n // (B * C), n // C % B, n % C
        dst[a, b, c] = src[a, b, c]


@cuda.jit
def add2_kernel(x, y, out):
    """out (A, B) = x + y; one thread per element."""
    n = cuda.grid(1)
    B = out.shape[1]
    if n < out.shape[0] * B:
        out[n // B, n % B] = x[n // B, n % B] + y[n // B, n % B]


def copy_into(src, dst) -> None:
    """Device arrays of one shape, 2-D or 3-D, any strides: dst[...] = src."""
    n = int(np.prod(dst.shape))
    if n == 0:
        return
    kernel = {2: copy2_kernel, 3: copy3_kernel}[len(dst.shape)]
    launch(kernel[blocks_for(n, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS], src, dst)


class DeviceTensor:
    """A Numba device array (``.array``) with the NumPy operations the forward uses, done on the GPU."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    @classmethod
    def upload(cls, host: np.ndarray, dtype=np.float32) -> DeviceTensor:
        return cls(to_gpu(host, dtype))

    @classmethod
    def empty(cls, shape, dtype=np.float32) -> DeviceTensor:
        return cls(empty_gpu(shape, dtype))

    def to_host(self) -> np.ndarray:
        return to_host(self.array)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def ndim(self) -> int:
        return len(self.array.shape)

    @property
    def dtype(self):
        return self.array.dtype

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def __len__(self) -> int:
        return self.shape[0]

    def contiguous(self) -> DeviceTensor:
        if self.array.is_c_contiguous():
            return self
        out = empty_gpu(self.shape, self.dtype)
        copy_into(self.array, out)
        return DeviceTensor(out)

    def reshape(self, *shape) -> DeviceTensor:
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        return DeviceTensor(self.contiguous().array.reshape(*shape))

    def __getitem__(self, index) -> DeviceTensor:
        if isinstance(index, np.ndarray):  # rows named by a host index array: a gather
            if index.ndim != 1 or self.ndim != 2:
                raise TypeError(f"a DeviceTensor gathers rows of a 2-D array by a 1-D index, got {index.shape}")
            if len(index) == 0:
                return DeviceTensor.empty((0, self.shape[1]), self.dtype)
            return DeviceTensor(embedding_gpu(to_gpu(index, np.int64), self.array))
        return DeviceTensor(self.array[index])

    def __add__(self, other: DeviceTensor) -> DeviceTensor:
        if self.shape != other.shape or self.ndim != 2:
            raise ValueError(f"DeviceTensor + needs two 2-D arrays of one shape, got {self.shape} and {other.shape}")
        out = empty_gpu(self.shape)
        n = self.shape[0] * self.shape[1]
        if n:
            launch(add2_kernel[blocks_for(n, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS], self.array, other.array, out)
        return DeviceTensor(out)

    def __array__(self, *args, **kwargs):
        raise TypeError("this array lives on the GPU: NumPy cannot read it without a copy; call .to_host()")

    def __array_function__(self, func, types, args, kwargs):
        if func is np.concatenate:
            return concatenate(*args, **kwargs)
        raise TypeError(f"np.{func.__name__} does not run on a DeviceTensor (only np.concatenate does)")

    def __repr__(self) -> str:
        return f"DeviceTensor(shape={self.shape}, dtype={self.dtype})"


def concatenate(parts, axis: int = 0) -> DeviceTensor:
    """np.concatenate for DeviceTensors of 2 or 3 dimensions: each part copied into its slice."""
    parts = list(parts)
    shape = list(parts[0].shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    out = empty_gpu(tuple(shape), parts[0].dtype)
    first = 0
    for part in parts:
        index = [slice(None)] * len(shape)
        index[axis] = slice(first, first + part.shape[axis])
        copy_into(part.array, out[tuple(index)])
        first += part.shape[axis]
    return DeviceTensor(out)
