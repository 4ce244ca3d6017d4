"""Test set-up shared by every test module.

* Without a GPU, Triton kernels run in Triton's CPU interpreter. TRITON_INTERPRET must be set before any
  `@triton.jit` decorator runs, i.e. before detinfer's kernel modules are imported, so it is set here.
* `@pytest.mark.gpu` tests are skipped (and reported as skipped) when CUDA is not available.
* Hypothesis profiles: "ci" (default, small example counts for the 2-core CPU CI) and "gpu" (more
  examples; select with HYPOTHESIS_PROFILE=gpu).
* `stories_dir`: the tiny real model the CPU tests run on (Karpathy's stories260k, 1.1 MB), shipped in
  tests/data/stories260k (its SOURCE.md says where it came from and how it was converted). Should it be
  missing, its tests skip, unless DETINFER_REQUIRE_TEST_MODELS=1 (CI sets it) makes that a failure.
"""

import ast
import os
import re
from pathlib import Path

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


TEST_DATA = Path(__file__).resolve().parent / "data"
REQUIRE_TEST_MODELS_ENV = "DETINFER_REQUIRE_TEST_MODELS"


def repository_test_model(name: str) -> Path:
    """tests/data/<name>, a model directory shipped with the repository. Missing (a partial checkout): skip
    the test, or fail it when DETINFER_REQUIRE_TEST_MODELS=1, so that CI cannot pass by skipping."""
    path = TEST_DATA / name
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    message = f"test model {name!r} not found at {path} (it ships with the repository in tests/data/{name})"
    if os.environ.get(REQUIRE_TEST_MODELS_ENV, "") not in ("", "0"):
        pytest.fail(f"{message}; {REQUIRE_TEST_MODELS_ENV} is set, so a missing test model is a failure",
                    pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The real trained stories260k checkpoint (fp32, 5 layers, hidden 64, vocab 512)."""
    return repository_test_model("stories260k")


@pytest.fixture(scope="session")
def stories_expected(stories_dir) -> dict:
    """What SOURCE.md records for greedy decoding from "Once upon a time": prompt ids, the 40 new ids,
    and the text."""
    source = (stories_dir / "SOURCE.md").read_text(encoding="utf-8")
    prompt = re.search(r"The prompt ids are (\[[\d, ]+\])", source)
    new = re.search(r"New token ids: (\[[\d, ]+\])", source)
    text = re.search(r"\n    (Once upon a time.*)\n", source)
    if not (prompt and new and text):
        pytest.fail(f"could not find the prompt ids, new token ids and text in {stories_dir / 'SOURCE.md'}")
    return {"prompt_ids": ast.literal_eval(prompt.group(1)), "new_ids": ast.literal_eval(new.group(1)),
            "text": text.group(1)}


@pytest.fixture
def device():
    """The device kernel tests run on: cuda when present, else cpu (Triton interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


GPUS = torch.cuda.device_count() if HAS_CUDA else 0


@pytest.fixture
def two_gpus():
    """Skip (shown as skipped) unless two CUDA GPUs are visible (tensor / expert parallelism, trainer ranks)."""
    if GPUS < 2:
        pytest.skip(f"needs >= 2 GPUs, {GPUS} visible")


@pytest.fixture
def peer_gpus(two_gpus):
    """Two GPUs that can read each other's memory (the two-GPU peer sum); else skipped, saying why."""
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("GPUs 0 and 1 cannot access each other's memory (the peer sum is off; NCCL sums)")
