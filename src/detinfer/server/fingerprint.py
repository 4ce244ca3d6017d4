"""`system_fingerprint`: equal fingerprints mean two servers return the same bits for the same request.

It hashes what can change the numbers a request gets back, and nothing else, so that servers tuned
differently (batch limits, port, KV pool size) still compare equal:
* the model files: weights, config and tokenizer files (the tokenizer decides the prompt's token ids);
* dtype, mode and the KV block size (paged attention's blocking);
* the source of detinfer's numeric code (kernels, ops, models, engine, cache) and the versions of torch,
  CUDA and Triton (they compile or pick the kernels), and of llguidance (its grammars decide which tokens a
  structured request may draw);
* the device. In deterministic mode every reduction order is fixed by the kernels' code, not by the device:
  the same code gives the same bits on an H100 and an H200 (measured: random qwen3-0.6b and qwen3-8b shapes,
  bit-identical tokens and logprobs). What the hardware can still change is the instructions the compiler
  emits, which it picks per architecture (compute capability: e.g. which MMA instructions tl.dot uses), so
  deterministic mode keys on the device type and compute capability, not the device's name. Fast mode
  uses cuBLAS/cuDNN, which choose kernels per device model, so there the device's name counts too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Subpackages whose code computes the numbers; their source is part of the fingerprint.
NUMERIC_PACKAGES = ("kernels", "ops", "models", "engine", "cache")
MODEL_FILE_SUFFIXES = (".safetensors", ".json", ".jinja", ".model")


@dataclass(frozen=True)
class DeviceInfo:
    """What identifies the hardware: type ("cuda"/"cpu"), model name, compute capability (None off CUDA)."""

    type: str
    name: str
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class SoftwareInfo:
    """Versions of what compiles or picks the kernels, and the digest of detinfer's numeric source."""

    code_digest: str
    torch: str
    cuda: str | None
    triton: str
    llguidance: str = "none"  # structured output's grammar library ("none": not installed)

    @classmethod
    def current(cls) -> SoftwareInfo:
        import torch

        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = "none"
        try:
            from importlib.metadata import PackageNotFoundError, version

            grammar_version = version("llguidance")
        except PackageNotFoundError:
            grammar_version = "none"
        return cls(numeric_code_digest(), torch.__version__, torch.version.cuda, triton_version, grammar_version)


def _hash_file(h: Any, path: Path) -> None:
    h.update(path.name.encode() + b"\0")
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)


def model_files_digest(model_dir: str | Path) -> str:
    """sha256 over the weights, config and tokenizer files of a model directory (names and contents)."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and path.suffix in MODEL_FILE_SUFFIXES:
            _hash_file(h, path)
    return h.hexdigest()


def numeric_code_digest() -> str:
    """sha256 of detinfer's numeric source files: any edit there may change results, so it counts."""
    import detinfer

    root = Path(detinfer.__file__).parent
    h = hashlib.sha256(detinfer.__version__.encode())
    for pkg in NUMERIC_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def fingerprint_parts(*, weights_digest: str, dtype: str, mode: str, block_size: int, device: DeviceInfo,
                      software: SoftwareInfo) -> list[str]:
    """The named inputs of the fingerprint (see the module docstring for why each one is there)."""
    parts = [f"weights={weights_digest}", f"dtype={dtype}", f"mode={mode}", f"block_size={block_size}",
             f"code={software.code_digest}", f"torch={software.torch}", f"cuda={software.cuda}",
             f"triton={software.triton}", f"llguidance={software.llguidance}", f"device_type={device.type}"]
    if device.capability is not None:
        parts.append(f"capability=sm{device.capability[0]}{device.capability[1]}")
    if mode != "deterministic":
        parts.append(f"device_name={device.name}")
    return parts


def system_fingerprint(*, weights_digest: str, dtype: str, mode: str, block_size: int, device: DeviceInfo,
                       software: SoftwareInfo | None = None) -> str:
    """`fp_` + 16 hex digits of `fingerprint_parts`. `device`: the engine's, as its core reports it
    (`core_process.engine_info`), so the API process never touches the GPU."""
    parts = fingerprint_parts(weights_digest=weights_digest, dtype=dtype, mode=mode, block_size=block_size,
                              device=device, software=software or SoftwareInfo.current())
    return "fp_" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
