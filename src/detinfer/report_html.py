"""What the HTML reports of `detinfer repro` and `detinfer rl` share: matplotlib on a file-only backend,
figures as PNG bytes, images embedded as base64 (self-contained pages, no external assets), one style sheet,
the escaping of values, and the page's head and experiment paragraph."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping
from typing import Any

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


def escape(x: Any) -> str:
    """Any value as HTML text (str() of it, escaped)."""
    return html.escape(str(x))


def page_head(title: str, heading: str, css: str, experiment: Mapping[str, Any]) -> str:
    """The page up to its heading; a partial report (Ctrl-C) says so right after it, before anything else."""
    head = (f"<!doctype html><html><head><meta charset=utf-8><title>{title}</title>"
            f"<style>{css}</style></head><body><h1>{heading}</h1>")
    if experiment.get("partial"):
        head += f"<p><b>Partial report:</b> {escape(experiment['partial'])}</p>"
    return head


def experiment_html(experiment: Mapping[str, Any]) -> str:
    """The experiment's scalar settings in one paragraph, then the command that ran it (if recorded)."""
    info = "<p>" + ", ".join(f"{escape(k)}: <code>{escape(v)}</code>" for k, v in experiment.items()
                             if k not in ("command", "partial") and not isinstance(v, (dict, list))) + "</p>"
    if experiment.get("command"):
        info += f"<p>command: <code>{escape(experiment['command'])}</code></p>"
    return info
