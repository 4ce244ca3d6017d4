"""Direct launches of remembered compiled kernels (kernels/_direct.py): the call they make is the one Triton's
own launch makes, they are keyed on what Triton specializes on, and every fallback takes the normal path.
CPU tests drive `LaunchCache` with a stand-in kernel; GPU tests check the real launchers bit for bit."""

from types import SimpleNamespace

import pytest
import torch

from detinfer.kernels import _direct
from detinfer.kernels._direct import LaunchCache


class FakeTensor:
    def __init__(self, ptr: int, device: str = "cuda"):
        self.ptr, self.device = ptr, SimpleNamespace(type=device)

    def data_ptr(self):
        return self.ptr


class FakeCompiled:
    function, packed_metadata = "function-handle", "packed-metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream)


class FakeKernel:
    """A kernel (a, b, n, STRIDE, BLOCK: constexpr, FLAG: constexpr) whose normal launch is recorded."""

    arg_names = ["a", "b", "n", "stride", "BLOCK", "FLAG"]

    def __init__(self, compiled=None):
        self.compiled = FakeCompiled() if compiled is None else compiled
        self.normal = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.normal.append((grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture
def runtime(monkeypatch):
    """Triton's device/stream getters and hooks as the cache resolves them on a GPU."""
    knobs = SimpleNamespace(launch_enter_hook="enter-hook", launch_exit_hook="exit-hook")
    monkeypatch.setattr(_direct._Runtime, "device", lambda: 0)
    monkeypatch.setattr(_direct._Runtime, "stream", lambda device: 1234)
    monkeypatch.setattr(_direct._Runtime, "knobs", knobs)
    monkeypatch.setattr(_direct, "_ENABLED", [True])


def launch(cache, key, a, b, n=48):
    if not cache.try_launch(key, (a, b)):
        # constexprs given out of parameter order on purpose: the direct call must use the kernel's order
        cache.launch(key, (a, b), (5, 2), (n, 16), {"FLAG": True, "BLOCK": 64}, num_warps=4)


def test_second_launch_is_direct_with_the_same_arguments(runtime):
    kernel = FakeKernel()
    cache = LaunchCache(kernel)
    a, b = FakeTensor(4096), FakeTensor(8192)
    launch(cache, "k", a, b)
    assert kernel.normal == [((5, 2), (a, b, 48, 16), {"FLAG": True, "BLOCK": 64, "num_warps": 4})]
    assert kernel.compiled.launches == []
    launch(cache, "k", a, b)
    assert len(kernel.normal) == 1
    (call,) = kernel.compiled.launches
    # JITFunction.run's own final call: grid (padded to 3 dims), stream, function, packed metadata, launch
    # metadata, hooks, then every parameter in declaration order (constexprs included)
    assert call == (5, 2, 1, 1234, "function-handle", "packed-metadata", ("metadata", (5, 2, 1), 1234),
                    "enter-hook", "exit-hook", a, b, 48, 16, 64, True)


def test_alignment_and_key_select_entries(runtime):
    kernel = FakeKernel()
    cache = LaunchCache(kernel)
    a, b, b_odd = FakeTensor(4096), FakeTensor(8192), FakeTensor(8194)
    launch(cache, "k", a, b)
    launch(cache, "k", a, b_odd)  # Triton specializes on 16-byte alignment: another entry, normal launch
    launch(cache, "other", a, b)  # another key: normal launch
    assert len(kernel.normal) == 3 and not kernel.compiled.launches
    launch(cache, "k", a, FakeTensor(8194 + 32))  # misaligned the same way: the remembered entry
    assert len(kernel.normal) == 3 and len(kernel.compiled.launches) == 1


def test_fallbacks_take_the_normal_launch(runtime, monkeypatch):
    a, b = FakeTensor(0), FakeTensor(16)
    interpreted = FakeKernel()
    interpreted.compiled = None  # the interpreter's launch returns no compiled kernel
    not_last = FakeKernel()
    not_last.arg_names = ["a", "BLOCK", "b", "n", "stride", "FLAG"]  # a constexpr before runtime arguments
    unloaded = FakeKernel()
    unloaded.compiled.function = None
    on_cpu = FakeKernel()
    for kernel, tensors in ((interpreted, (a, b)), (not_last, (a, b)), (unloaded, (a, b)),
                            (on_cpu, (FakeTensor(0, "cpu"), FakeTensor(16, "cpu")))):
        cache = LaunchCache(kernel)
        for _ in range(2):
            launch(cache, "k", *tensors)
        assert len(kernel.normal) == 2
        if kernel.compiled is not None:
            assert not kernel.compiled.launches
    kernel = FakeKernel()
    cache = LaunchCache(kernel)
    _direct.set_enabled(False)
    for _ in range(2):
        launch(cache, "k", a, b)
    assert len(kernel.normal) == 2 and not cache.entries and _direct.enabled() is False


def test_a_launcher_that_refuses_the_call_turns_direct_launches_off(runtime):
    class OtherLauncher(FakeCompiled):
        def run(self, *args):
            raise TypeError("function takes exactly 14 arguments")

    kernel = FakeKernel(OtherLauncher())
    cache = LaunchCache(kernel)
    a, b = FakeTensor(0), FakeTensor(16)
    launch(cache, "k", a, b)
    with pytest.warns(RuntimeWarning, match="direct kernel launches disabled"):
        launch(cache, "k", a, b)  # refused before launching: the normal launch runs instead
    assert len(kernel.normal) == 2 and _direct.enabled() is False
    launch(cache, "k", a, b)
    assert len(kernel.normal) == 3


def test_cache_is_bounded_and_clearable(runtime, monkeypatch):
    monkeypatch.setattr(_direct, "MAX_ENTRIES", 3)
    kernel = FakeKernel()
    cache = LaunchCache(kernel)
    a, b = FakeTensor(0), FakeTensor(16)
    for key in range(5):
        launch(cache, key, a, b)
    assert 1 <= len(cache.entries) <= 3
    cache.clear()
    assert not cache.entries


def test_no_runtime_no_direct_launch(monkeypatch):
    """Before any CUDA launch resolved Triton's runtime (always, on a CPU-only machine) nothing is direct."""
    monkeypatch.setattr(_direct._Runtime, "device", None)
    assert LaunchCache(FakeKernel()).try_launch("k", (FakeTensor(0),)) is False


# ------------------------------------------------------------------------------------------------- GPU
def _launches(name):
    """(module, its LaunchCache, a call of the launcher) for every launcher that uses one."""
    from detinfer.kernels import linear_silu_mul, matmul, reduce, rmsnorm, silu_mul, softmax

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 576, device="cuda", generator=g).bfloat16()
    w = torch.randn(960, 576, device="cuda", generator=g).bfloat16()
    bias = torch.randn(960, device="cuda", generator=g).bfloat16()
    r = torch.randn(37, 576, device="cuda", generator=g).bfloat16()
    table = {
        "matmul": (matmul._POINTER_LAUNCHES, lambda: matmul.linear(x, w, bias)),
        "matmul-strided": (matmul._POINTER_LAUNCHES, lambda: matmul.matmul(x[:, 1:], w.t()[1:])),
        "rmsnorm": (rmsnorm._LAUNCHES, lambda: rmsnorm.rms_norm(x, w[0, :576], 1e-6, residual=r)),
        "softmax": (softmax._LAUNCHES, lambda: softmax.log_softmax(x, dim=-1, dtype=torch.float32)),
        "reduce": (reduce._LAUNCHES, lambda: reduce.mean_dim(x, -1, keepdim=True)),
        "silu_mul": (silu_mul._LAUNCHES, lambda: silu_mul.silu_mul(x[:, :288], x[:, 288:])),
        "linear_silu_mul": (linear_silu_mul._LAUNCHES, lambda: linear_silu_mul.linear_silu_mul(x, w, bias)),
    }
    return table[name]


def _flat(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["matmul", "matmul-strided", "rmsnorm", "softmax", "reduce", "silu_mul",
                                  "linear_silu_mul"])
def test_gpu_direct_launch_is_bit_identical_and_skips_triton_run(name, monkeypatch):
    cache, call = _launches(name)
    _direct.set_enabled(False)
    try:
        want = _flat(call())
    finally:
        _direct.set_enabled(True)
    cache.clear()
    first = _flat(call())  # normal launch, remembered
    runs = []
    kernel = cache.kernel
    original = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a, **k: runs.append(1) or original(*a, **k))
    second = _flat(call())
    torch.cuda.synchronize()
    assert runs == [], "the second launch of a remembered key went through JITFunction.run"
    for a, b, c in zip(want, first, second, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.gpu
def test_gpu_direct_launches_capture_in_cuda_graphs():
    """Graph capture uses its own stream: direct launches read the current stream per call."""
    from detinfer.kernels import matmul

    x = torch.randn(8, 256, device="cuda").bfloat16()
    w = torch.randn(512, 256, device="cuda").bfloat16()
    out = torch.empty(8, 512, device="cuda", dtype=torch.bfloat16)
    want = matmul.linear(x, w)
    matmul.linear(x, w, out=out)  # remembered before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        matmul.linear(x, w, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul.linear(x, w, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
