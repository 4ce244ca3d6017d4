"""Test set-up shared by every test module.

* Without a GPU, Triton kernels run in Triton's CPU interpreter. TRITON_INTERPRET must be set before any
  `@triton.jit` decorator runs, i.e. before detinfer's kernel modules are imported, so it is set here.
* `@pytest.mark.gpu` tests are skipped (and reported as skipped) when CUDA is not available.
* Hypothesis profiles: "ci" (default, small example counts for the 2-core CPU CI) and "gpu" (more
  examples; select with HYPOTHESIS_PROFILE=gpu).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=15, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "gpu", max_examples=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_CUDA = torch.cuda.is_available()

# The fold-based CPU paths are many small elementwise ops: intra-op threads only add overhead there (measured
# 25-50x slower with 2 threads on a busy 2-core machine). GPU runs are unaffected.
if not HAS_CUDA:
    torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread_per_module():
    """Every module starts with one intra-op thread (see above), also after a test that ran a CLI entry point,
    which picks its own thread count from the machine's idle cores. Results never depend on it."""
    if HAS_CUDA:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """The device kernel tests run on: cuda when present, else cpu (Triton interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
