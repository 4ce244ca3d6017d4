"""Low-overhead kernel launches: compiled Triton kernels remembered per launch key, called directly.

`kernel[grid](*args, **constexprs)` runs Triton's `JITFunction.run` on every call: it reads knobs and the
current device/stream, binds and specializes every argument, formats a cache key (a string of the
options), looks the compiled kernel up, checks the kernel's globals and only then calls the compiled
launcher. A decode step of a small model is hundreds of such launches, each in front of a kernel of a few
microseconds, so that per-call work is what the drop-in mode pays over cuBLAS.

`LaunchCache` does that work once per launch *key*: the first launch of a key goes through
`kernel[grid](...)` (which compiles or finds the binary) and the compiled kernel it returns is remembered;
later launches of the key call the compiled launcher with the same arguments, as `JITFunction.run` itself
does at its end (`CompiledKernel.run(grid..., stream, function, packed_metadata, launch_metadata, enter
hook, exit hook, *args)`, the same call in triton 3.6 and 3.9). Nothing about *what* runs changes: the
binary, the grid and the arguments are those the normal launch used, so no bit can change.

The caller's contract: `key` determines everything but the tensors themselves: the grid, every scalar
argument, every constexpr and launch option (num_warps, ...), and every tensor's dtype. The cache adds
what Triton specializes on that the key cannot know: the current device and each tensor's 16-byte
alignment. (Triton's integer specializations, == 1 and % 16, are functions of the scalar values, which
the key determines.)

Fallbacks to the normal launch, always correct: the interpreter (its launch returns no compiled kernel),
a triton whose compiled kernel lacks the attributes used here or whose launcher refuses the call (argument
parsing fails before anything launches: direct launches are then turned off with a warning), constexprs
that are not the kernel's last parameters, and `DETINFER_DIRECT_LAUNCH=0` in the environment at import (or
`set_enabled(False)`), which exists to measure the difference.
"""

from __future__ import annotations

import os
import warnings

_ENABLED = [os.environ.get("DETINFER_DIRECT_LAUNCH", "1") != "0"]
_NO_DIRECT = object()  # a key whose launches always take the normal path
MAX_ENTRIES = 4096  # per kernel; cleared when full (a sweep over many shapes), then refilled on use


def set_enabled(on: bool) -> None:
    """Turn direct launches on or off process-wide (off: every launch is `kernel[grid](...)`)."""
    _ENABLED[0] = bool(on)


def enabled() -> bool:
    return _ENABLED[0]


class _Runtime:
    """Triton's current-device / current-stream getters and launch hooks, resolved on first use (so that
    importing this module needs no GPU driver)."""

    device = stream = knobs = None

    @classmethod
    def resolve(cls) -> bool:
        if cls.device is None:
            try:
                from triton import knobs
                from triton.runtime import driver

                active = driver.active
                cls.device, cls.stream, cls.knobs = active.get_current_device, active.get_current_stream, knobs.runtime
            except (ImportError, AttributeError, RuntimeError):
                return False
        return True


def _alignment(tensors: tuple) -> int:
    """Bit i set when tensor i's data pointer is not 16-byte aligned (Triton specializes on it)."""
    mask = 0
    for i, t in enumerate(tensors):
        if t.data_ptr() & 15:
            mask |= 1 << i
    return mask


class LaunchCache:
    """Compiled launches of one Triton kernel by launch key (see the module docstring for the contract).
    The tensors come first in the kernel's parameters, then the scalars, then the constexprs."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.entries: dict = {}

    def clear(self) -> None:
        self.entries.clear()

    def try_launch(self, key, tensors: tuple) -> bool:
        """Launch directly if this key was seen (True); False: the caller launches with `launch`."""
        if not _ENABLED[0] or _Runtime.device is None:
            return False
        rt = _Runtime
        device = rt.device()
        entry = self.entries.get((key, device, _alignment(tensors)))
        if entry is None or entry is _NO_DIRECT:
            return False
        compiled, run, grid, tail = entry
        stream = rt.stream(device)
        args = tensors + tail
        knobs = rt.knobs
        try:
            run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                compiled.launch_metadata(grid, stream, *args), knobs.launch_enter_hook, knobs.launch_exit_hook,
                *args)
        except TypeError as e:  # a triton whose launcher takes other arguments: rejected before launching
            _ENABLED[0] = False
            warnings.warn(f"detinfer: direct kernel launches disabled, this triton's launcher refused the call "
                          f"({e}); every launch now goes through kernel[grid](...)", RuntimeWarning, stacklevel=2)
            return False
        return True

    def launch(self, key, tensors: tuple, grid: tuple, scalars: tuple, constexprs: dict, **options) -> None:
        """The normal launch, `kernel[grid](*tensors, *scalars, **constexprs, **options)`; its compiled kernel
        is remembered for `key` when a direct launch can reproduce it."""
        compiled = self.kernel[grid](*tensors, *scalars, **constexprs, **options)
        if not _ENABLED[0] or tensors[0].device.type != "cuda" or not _Runtime.resolve():
            return
        entries = self.entries
        if len(entries) >= MAX_ENTRIES:
            entries.clear()
        full = (key, _Runtime.device(), _alignment(tensors))
        entries[full] = self._entry(compiled, grid, tensors, scalars, constexprs)

    def _entry(self, compiled, grid, tensors, scalars, constexprs):
        names = getattr(self.kernel, "arg_names", None)
        if compiled is None or names is None or getattr(compiled, "function", None) is None:
            return _NO_DIRECT
        try:
            run = compiled.run
            _ = compiled.packed_metadata, compiled.launch_metadata
        except AttributeError:
            return _NO_DIRECT
        n_pos = len(tensors) + len(scalars)
        if set(names[n_pos:]) != set(constexprs) or len(names) != n_pos + len(constexprs):
            return _NO_DIRECT
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        return compiled, run, grid3, tuple(scalars) + tuple(constexprs[n] for n in names[n_pos:])
