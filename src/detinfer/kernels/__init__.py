"""Batch-invariant Triton kernels. One op per file: `_x_kernel` (Triton), launcher `x()`, reference `x_ref()`.

Each `x_ref()` is pure torch built only from elementwise ops and fixed-order folds (see `_fold.py`), so it
is itself batch-invariant by construction: it doubles as the CPU path and the path for dtypes the Triton
kernels do not take (fp64).
"""
