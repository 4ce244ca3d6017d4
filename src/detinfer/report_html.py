"""What the HTML reports of `detinfer repro` and `detinfer rl` share: matplotlib on a file-only backend,
figures as PNG bytes, images embedded as base64 (self-contained pages, no external assets), one style sheet."""

from __future__ import annotations

import base64
import html
import io

BASE_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
.cols{display:flex;gap:1.5em;flex-wrap:wrap;align-items:flex-start}
.col{flex:1 1 var(--col-width,480px);min-width:calc(var(--col-width,480px) - 60px);border:1px solid #ddd;
border-radius:6px;padding:0 1em 1em}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px 6px;
vertical-align:top;text-align:left}pre{white-space:pre-wrap;margin:0;font-size:12px}
.ok{color:#1a7f37;font-weight:bold}.bad{color:#cf222e;font-weight:bold}img{max-width:100%}.muted{color:#777}
"""


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only; never needs a display)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the reports draw their plots with matplotlib: pip install 'detinfer[repro]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_png(fig) -> bytes:
    """The figure as PNG bytes (no timestamp or software metadata, so equal plots give equal files); closes it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    pyplot().close(fig)
    return buf.getvalue()


def img_tag(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
