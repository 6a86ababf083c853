"""Triton kernels behind the TensorRT plugins, one module per custom op, plus ``aot``.

Every kernel takes its arguments in the order TensorRT's AOT plugin launch passes them:
input pointers, then int32 scalars, then output pointers (float attributes are
``tl.constexpr``: TensorRT passes only ``SymInt32`` extras). Each module lists its kernels
as ``aot.KernelSpec`` values (``KERNELS``) so they compile ahead of time and are checked
for that parameter list. Under ``TRITON_INTERPRET=1`` they run on CPU torch tensors
(the test suite's check against each op's torch reference).
"""
