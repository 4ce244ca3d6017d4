"""constants.py: the names and numbers several layers share are stated there once and imported, never
restated, and the module loads without torch."""

import re
import subprocess
import sys
from pathlib import Path

from detinfer import constants
from detinfer.engine import cuda_graphs
from detinfer.kernels import attention

SRC = Path(__file__).resolve().parents[1] / "src" / "detinfer"
# A restatement: the literal value assigned again, or the dot precision chosen again from a dtype.
RESTATED = {
    "the modes": re.compile(r"""^\s*\w+\s*=\s*\(\s*["']deterministic["'],\s*["']fast["']""", re.M),
    "the dtype names": re.compile(r"""=\s*\(\s*["']auto["'],\s*["']bfloat16["']|["']float32["']: torch\.float32"""),
    "the fp32 dot precision": re.compile(r"""["']ieee["']|["']tf32["']"""),
    "the attention split size or short-KV bound": re.compile(r"""(SPLIT_SIZE|SHORT_KV_TOKENS)\s*=\s*\d"""),
}


def test_no_module_restates_a_shared_constant():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "constants.py":
            continue
        text = path.read_text()
        found += [f"{path.relative_to(SRC)}: {what}" for what, pattern in RESTATED.items() if pattern.search(text)]
    assert not found, "restated instead of imported from detinfer.constants:\n" + "\n".join(found)


def test_the_short_kv_bound_is_one_attention_split():
    """A short-KV decode graph must take the kernel's sequential schedule (one split): the bound is derived
    from the split size, and both users see the one value."""
    assert constants.SHORT_KV_TOKENS == constants.ATTENTION_SPLIT_SIZE
    assert cuda_graphs.SHORT_KV_TOKENS is constants.SHORT_KV_TOKENS
    assert attention.DEFAULT_SPLIT_SIZE is constants.ATTENTION_SPLIT_SIZE


def test_constants_import_nothing_heavy():
    code = "import sys, detinfer.constants; print(sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
