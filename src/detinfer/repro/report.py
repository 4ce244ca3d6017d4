"""Report files for a reproducibility experiment: JSON (every raw completion), PNG plots, and one
self-contained HTML page (plots embedded as base64, no external assets) with the sections side by side.

A `Section` is one set of N runs: one engine mode, or one server URL. `write_report` writes
report.json, report.html, summary.png (every section's plots in one picture) and per-section PNGs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detinfer.report_html import BASE_CSS, escape, experiment_html, figure_png, img_tag, page_head, pyplot
from detinfer.repro.analysis import Completion, Summary

REPORT_FORMAT = "detinfer-repro/1"
MAX_BARS = 40  # distinct completions drawn (histogram) and listed (HTML); report.json has them all


@dataclass(frozen=True)
class Section:
    """label: "deterministic", "fast", or a URL. target: what ran it, in words. prompt: the prompt text as
    sent (after any chat template). elapsed_s: wall time of the N runs. extra: anything else to record."""

    label: str
    target: str
    prompt: str
    summary: Summary
    completions: tuple[Completion, ...]
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def reproduces(summary: Summary) -> bool:
    """The one verdict every output uses (HTML, terminal, `--check`): a run set reproduces when its N runs
    gave one completion and, when logprobs were requested, one logprob sequence bit for bit."""
    return summary.num_unique == 1 and summary.num_unique_logprobs in (None, 1)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def counts(summary: Summary) -> str:
    """Both counts a verdict rests on, e.g. "1 distinct text but 6 distinct logprob sequences"."""
    sm = summary
    texts = _count(sm.num_unique, "distinct text" if sm.unit == "token" else "distinct completion")
    if sm.num_unique_logprobs is None:
        return texts
    joint = "and" if (sm.num_unique_logprobs == 1) == (sm.num_unique == 1) else "but"
    return f"{texts} {joint} {_count(sm.num_unique_logprobs, 'distinct logprob sequence')}"


def verdict_word(summary: Summary) -> str:
    return "reproducible" if reproduces(summary) else "not reproducible"


def verdict(summary: Summary) -> str:
    """One section in words, e.g. "1 distinct text but 6 distinct logprob sequences in 20 runs: not
    reproducible"."""
    return f"{counts(summary)} in {summary.n} runs: {verdict_word(summary)}"


def panel_title(label: str, summary: Summary) -> str:
    """A plot's title: the verdict and both counts it rests on (a title that gave only the text count
    read "1 unique of 20 (not reproducible)" when the logprobs differed)."""
    return f"{label}: {verdict_word(summary)} ({summary.n} runs)\n{counts(summary)}"


def max_diff_text(summary: Summary) -> str | None:
    """The largest logprob difference from the reference run in words (None without logprobs)."""
    sm = summary
    if sm.max_logprob_diff is None:
        return None
    if sm.max_logprob_diff_at is None:
        return f"0 (every run's logprobs equal run {sm.reference_run}'s while their {sm.unit}s agree)"
    run, pos = sm.max_logprob_diff_at
    return f"{sm.max_logprob_diff:.3g} (run {run} vs run {sm.reference_run}, {at_unit(sm.unit, pos)})"


def headline(sections: Sequence[Section]) -> str:
    """The report's one-sentence summary: every section's verdict, side by side."""
    return "; ".join(f"{s.label}: {verdict(s.summary)}" for s in sections) + "."


def at_unit(unit: str, index: int | None) -> str:
    """A position in words: "at token 0" (position 0 is the first token, not "no difference")."""
    return "none" if index is None else f"at {unit} {index}"


# --- JSON ------------------------------------------------------------------------------------------


def _jsonable(x: Any) -> Any:
    """Strict JSON: non-finite floats (a -inf logprob) become the strings "inf"/"-inf"/"nan"."""
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def completion_dict(c: Completion) -> dict[str, Any]:
    return {"run": c.run, "text": c.text, "tokens": c.tokens, "logprobs": c.logprobs,
            "top_logprobs": c.top_logprobs, "finish_reason": c.finish_reason, "meta": c.meta}


def summary_dict(s: Summary) -> dict[str, Any]:
    return {"n": s.n, "unit": s.unit, "num_unique": s.num_unique, "most_common_count": s.most_common_count,
            "num_unique_with_logprobs": s.num_unique_logprobs, "agreed_prefix": s.agreed_prefix,
            "reference_run": s.reference_run, "logprob_divergence": s.logprob_divergence,
            "max_abs_logprob_diff": s.max_logprob_diff,
            "max_abs_logprob_diff_at": (None if s.max_logprob_diff_at is None else
                                        dict(zip(("run", "position"), s.max_logprob_diff_at))),
            "groups": [{"rank": g.rank, "count": g.count, "runs": g.runs, "text": g.completion.text,
                        "divergence_from_most_common": d, "logprob_variant_counts": g.variant_counts}
                       for g, d in zip(s.groups, s.divergence_from_mode)],
            "pairs": [dataclasses.asdict(p) for p in s.pairs], "pairs_left_out": s.pairs_left_out}


def report_dict(sections: Sequence[Section], experiment: dict[str, Any]) -> dict[str, Any]:
    from detinfer import __version__

    return _jsonable({
        "format": REPORT_FORMAT, "detinfer_version": __version__, "partial": bool(experiment.get("partial")),
        "experiment": experiment,
        "sections": [{"label": s.label, "target": s.target, "prompt": s.prompt, "elapsed_s": s.elapsed_s,
                      "extra": s.extra, "summary": summary_dict(s.summary),
                      "completions": [completion_dict(c) for c in s.completions]} for s in sections]})


# --- plots -----------------------------------------------------------------------------------------



def _draw_histogram(ax, s: Section) -> None:
    """Runs per distinct completion, most common first. Past MAX_BARS the rest (each no more frequent
    than the last bar shown) are left out and the axis label says how many. Runs with the same tokens
    but different logprob bits cut their bar into one segment per variant (alternating shades)."""
    from matplotlib.ticker import MaxNLocator

    groups = s.summary.groups[:MAX_BARS]
    color, light = ("#4c72b0", "#9db4d8") if reproduces(s.summary) else ("#dd8452", "#f0bfa0")
    for x, g in enumerate(groups):
        segments = g.variant_counts if len(g.variant_counts) > 1 else (g.count,)
        bottom = 0
        for k, c in enumerate(segments):
            ax.bar(x, c, bottom=bottom, color=light if k % 2 else color, edgecolor="white",
                   linewidth=0.6 if len(segments) > 1 else 0)
            bottom += c
    if len(groups) <= 12:
        for x, g in enumerate(groups):
            ax.annotate(str(g.count), (x, g.count), ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, max(g.count for g in groups) * 1.12)  # room for the counts under the title
        ax.set_xticks(range(len(groups)), [f"#{i}" for i in range(len(groups))], fontsize=8)
    else:
        ax.set_xticks([])
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    sizes = [g.count for g in s.summary.groups]
    rest = len(sizes) - len(groups)
    segmented = any(len(g.variant_counts) > 1 for g in groups)
    ax.set_xlabel("distinct text (most common first)" + ("; segments: logprob sequences" if segmented else "")
                  + (f"\n({rest} more, {max(sizes[MAX_BARS:])} run(s) or fewer each, not shown)" if rest else ""),
                  fontsize=8)
    ax.set_ylabel("runs")
    ax.set_title(panel_title(s.label, s.summary), fontsize=9)


def _draw_divergence(ax, s: Section) -> None:
    """Per run that differs from the most common completion: where its tokens part (red), and where its
    logprobs first differ in any bit (grey; drift that precedes, or never becomes, a different token)."""
    sm = s.summary
    tokens, logprobs = sm.divergence_positions, list(sm.logprob_divergence)
    if not tokens and not logprobs:
        what = "tokens and logprobs,\nbit for bit" if sm.num_unique_logprobs == 1 else "(tokens)"
        ax.text(0.5, 0.5, f"all {sm.n} runs identical:\n{what}", ha="center", va="center",
                transform=ax.transAxes, fontsize=11, color="#4c72b0")
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        longest = max(1, max(len(g.completion.units) for g in sm.groups))
        bins = min(50, longest)
        if logprobs:
            ax.hist(logprobs, bins=bins, range=(0, longest), color="#999999", alpha=0.7,
                    label=f"first different logprob ({len(logprobs)} runs)")
        if tokens:
            ax.hist(tokens, bins=bins, range=(0, longest), color="#c44e52", alpha=0.85,
                    label=f"first different {sm.unit} ({len(tokens)} runs)")
            ax.axvline(min(tokens), color="black", linestyle="--", linewidth=0.8)
        ax.legend(fontsize=7)
        ax.set_ylabel("runs")
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"{sm.unit} position vs the most common completion")
    title = f"{s.label}: where runs diverge"
    if sm.max_logprob_diff is not None:
        title += f"\nlargest |logprob difference| from run {sm.reference_run}: {sm.max_logprob_diff:.3g}"
    ax.set_title(title, fontsize=9)



def section_pngs(s: Section) -> tuple[bytes, bytes]:
    """(histogram, divergence plot) of one section, as PNG bytes."""
    plt = pyplot()
    out = []
    for draw in (_draw_histogram, _draw_divergence):
        fig, ax = plt.subplots(figsize=(5, 3))
        draw(ax, s)
        out.append(figure_png(fig))
    return out[0], out[1]


def summary_png(sections: Sequence[Section]) -> bytes:
    """Every section's histogram (top row) and divergence plot (bottom row), side by side."""
    plt = pyplot()
    fig, axes = plt.subplots(2, len(sections), figsize=(4.6 * len(sections), 6), squeeze=False)
    for col, s in enumerate(sections):
        _draw_histogram(axes[0][col], s)
        _draw_divergence(axes[1][col], s)
    fig.tight_layout()
    return figure_png(fig)


# --- HTML ------------------------------------------------------------------------------------------

_CSS = BASE_CSS + ".a{background:#e6f4ea}.b{background:#fde7e9}pre{max-height:12em;overflow:auto}"


def _fmt(x: Any) -> str:
    return "—" if x is None else (repr(x) if isinstance(x, float) else str(x))


def _variants(g) -> str:
    if not g.variant_counts:
        return "—"
    n = len(g.variant_counts)
    return "1" if n == 1 else f"{n} ({' + '.join(map(str, g.variant_counts))} runs)"


def _section_html(s: Section, pngs: tuple[bytes, bytes]) -> str:
    sm = s.summary
    verdict_html = f'<span class="{"ok" if reproduces(sm) else "bad"}">{escape(verdict(sm))}</span>'
    rows = [("runs", sm.n), ("distinct texts (token sequences)", sm.num_unique),
            ("most common text", f"{sm.most_common_count} runs"),
            ("distinct logprob sequences (tokens and logprob bits)", sm.num_unique_logprobs),
            (f"{sm.unit}s shared by all runs", "all" if sm.agreed_prefix is None else sm.agreed_prefix),
            ("reference run (most common text and logprobs)", sm.reference_run),
            ("first logprob difference from the reference run",
             at_unit(sm.unit, min(sm.logprob_divergence, default=None)) if sm.num_unique_logprobs else None),
            ("largest |logprob difference| from the reference run, where the tokens so far agree",
             max_diff_text(sm)),
            ("wall time", f"{s.elapsed_s:.1f} s")] + [(k, v) for k, v in s.extra.items()]
    parts = [f"<div class=col><h2>{escape(s.label)}</h2><p class=muted>{escape(s.target)}</p><p>{verdict_html}</p>",
             "<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{escape(_fmt(v))}</td></tr>" for k, v in rows)
             + "</table>",
             img_tag(pngs[0], f"{s.label} histogram"), img_tag(pngs[1], f"{s.label} divergence positions"),
             "<h3>Distinct completions</h3><table><tr><th>#</th><th>runs</th><th>diverges from #0</th>"
             "<th>logprob variants</th><th>text</th></tr>"]
    for g, d in list(zip(sm.groups, sm.divergence_from_mode))[:MAX_BARS]:
        at = "—" if d is None else escape(at_unit(sm.unit, d))
        parts.append(f"<tr><td>{g.rank}</td><td>{g.count}</td><td>{at}</td><td>{_variants(g)}"
                     f"</td><td><pre>{escape(g.completion.text)}</pre></td></tr>")
    parts.append("</table>")
    if len(sm.groups) > MAX_BARS:
        parts.append(f"<p class=muted>{len(sm.groups) - MAX_BARS} rarer completions: see report.json</p>")
    if sm.pairs:
        parts.append("<h3>Where pairs diverge</h3><table><tr><th>pair</th><th>at</th><th>shared text ends</th>"
                     "<th>continuations</th><th>logprobs there (own / other's token)</th>"
                     "<th>first logprob difference</th></tr>")
        for p in sm.pairs:
            lp = (f"#{p.a}: {_fmt(p.a_logprob)} / {_fmt(p.a_logprob_of_b_token)}<br>"
                  f"#{p.b}: {_fmt(p.b_logprob)} / {_fmt(p.b_logprob_of_a_token)}") if p.logprob_window else "—"
            first = ("none before the divergence" if p.first_logprob_diff is None else
                     f"{at_unit(sm.unit, p.first_logprob_diff)} (max |Δ| {p.max_prefix_logprob_diff:.3g})") \
                if p.logprob_window else "—"
            parts.append(
                f"<tr><td>#{p.a} ({p.a_count}) vs #{p.b} ({p.b_count})</td><td>{escape(at_unit(sm.unit, p.index))}</td>"
                f"<td><pre>…{escape(p.prefix)}</pre></td><td><pre class=a>{escape(p.a_text or '⟨end⟩')}</pre>"
                f"<pre class=b>{escape(p.b_text or '⟨end⟩')}</pre></td><td>{lp}</td><td>{escape(first)}</td></tr>")
        parts.append("</table>")
        if sm.pairs_left_out:
            parts.append(f"<p class=muted>{sm.pairs_left_out} more pairs not listed</p>")
    parts.append(f"<details><summary>prompt as sent</summary><pre>{escape(s.prompt)}</pre></details></div>")
    return "\n".join(parts)


def report_html(sections: Sequence[Section], experiment: dict[str, Any],
                pngs: Sequence[tuple[bytes, bytes]]) -> str:
    # a partial report (Ctrl-C) holds the sections that finished
    head = page_head("detinfer repro report", "Reproducibility: N runs under load", _CSS, experiment)
    info = experiment_html(experiment)
    summary = f"<p><b>{escape(headline(sections))}</b></p>"
    body = "<div class=cols>" + "".join(_section_html(s, p) for s, p in zip(sections, pngs)) + "</div>"
    return head + summary + info + body + "<p class=muted>every raw completion: report.json</p></body></html>\n"


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")[:60] or "section"


def write_report(out_dir: str | Path, sections: Sequence[Section], experiment: dict[str, Any]) -> dict[str, Path]:
    """Write report.json, report.html, summary.png and <label>_histogram/_divergence.png into out_dir;
    returns {name: path}."""
    if not sections:
        raise ValueError("no sections to report")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "html": out / "report.html", "summary_png": out / "summary.png"}
    with open(paths["json"], "w", encoding="utf-8") as f:
        # compact separators: N=1000 runs with logprobs make a large file, and spaces add ~10% to it
        json.dump(report_dict(sections, experiment), f, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        f.write("\n")
    pngs = [section_pngs(s) for s in sections]
    slugs = [_slug(s.label) for s in sections]
    for i, (slug, (hist, div)) in enumerate(zip(slugs, pngs)):
        slug = slug if slugs.count(slug) == 1 else f"{slug}_{i}"
        for kind, data in (("histogram", hist), ("divergence", div)):
            paths[f"{slug}_{kind}"] = out / f"{slug}_{kind}.png"
            paths[f"{slug}_{kind}"].write_bytes(data)
    paths["summary_png"].write_bytes(summary_png(sections))
    paths["html"].write_text(report_html(sections, experiment, pngs), encoding="utf-8")
    return paths
