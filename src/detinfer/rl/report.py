"""The GRPO comparison report: report.json (every step's metrics per arm), summary.png (reward, response
length, step time and the sampler-vs-trainer mismatch of all arms, one curve per arm) and a
self-contained report.html (the plot embedded, a summary table per arm), in the style of `detinfer
repro`'s report."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from detinfer.report_html import BASE_CSS, escape, experiment_html, figure_png, img_tag, page_head, pyplot
from detinfer.rl.checkpoint import jsonable

REPORT_FORMAT = "detinfer-rl/1"
COLORS = {"deterministic": "#4c72b0", "fast": "#dd8452", "fast-tis": "#55a868"}
SMOOTH = 5  # moving-average window of the reward curve (rewards of one step are noisy)
SMOOTH_FROM = 20  # shorter runs are drawn raw: a trailing average would hide most of the curve
# (metric key, panel title, y scale); symlog keeps exact zeros visible at the bottom of a log-like axis
PANELS = (("reward_mean", "mean reward", "linear"), ("eval_accuracy", "eval accuracy (greedy, held out)", "linear"),
          ("response_len_mean", "mean response length (tokens)", "linear"), ("step_s", "step time (s)", "linear"),
          ("mismatch_bits_differ", "sampled tokens whose logprob bits differ\n(sampler vs trainer)", "linear"),
          ("mismatch_max_abs_diff", "max |logprob difference|", "symlog"),
          ("mismatch_kl_k3", "KL(sampler || trainer), k3 estimate", "symlog"))


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def _moving_average(ys: Sequence[float], w: int) -> list[float]:
    return [sum(ys[max(0, i - w + 1):i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(ys))]


def arm_summary(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Headline numbers of one arm. Step time leaves out step 1 (warm-up: compilation, CUDA graphs)."""
    if not history:
        return {"steps": 0}
    k = max(1, min(10, len(history) // 4 or 1))
    rewards = [h["reward_mean"] for h in history]
    zero = sum(1 for h in history if h["mismatch_bits_differ"] == 0 and h["mismatch_max_abs_diff"] == 0)
    timed = history[1:] or history
    return {"steps": len(history), f"reward, first {k} steps": _mean(rewards[:k]),
            f"reward, last {k} steps": _mean(rewards[-k:]),
            "mean response length": _mean([h["response_len_mean"] for h in history]),
            "steps with mismatch exactly 0": f"{zero} of {len(history)}",
            "max fraction of differing tokens": max(h["mismatch_bits_differ"] for h in history),
            "max |logprob difference|": max(h["mismatch_max_abs_diff"] for h in history),
            "mean KL k3": _mean([h["mismatch_kl_k3"] for h in history]),
            "mean step time (s)": _mean([h["step_s"] for h in timed]),
            "mean rollout / train time (s)": f"{_mean([h['rollout_s'] for h in timed]):.3g} / "
                                              f"{_mean([h['train_s'] for h in timed]):.3g}",
            "final weights hash": history[-1]["weights_hash"]}


def summary_png(histories: Mapping[str, Sequence[Mapping[str, Any]]]) -> bytes:
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 4, figsize=(20, 7.5))
    for ax, (key, title, scale) in zip(axes.flat, PANELS):
        for arm, hist in histories.items():
            scored = [h for h in hist if h.get(key) is not None]  # eval metrics: only on eval steps
            steps = [h["step"] for h in scored]
            ys = [h[key] for h in scored]
            color = COLORS.get(arm, None)
            if key == "reward_mean" and len(ys) >= SMOOTH_FROM:
                ax.plot(steps, ys, color=color, alpha=0.25, linewidth=0.8)
                ax.plot(steps, _moving_average(ys, SMOOTH), color=color, label=f"{arm} ({SMOOTH}-step mean)")
            else:
                ax.plot(steps, ys, color=color, label=arm, marker="." if len(ys) <= 30 else None)
        if scale == "symlog":
            # linear below the smallest nonzero value's decade, so exact zeros sit on the axis's floor
            positive = [h[key] for hist in histories.values() for h in hist if h.get(key) and h[key] > 0]
            ax.set_yscale("symlog", linthresh=10.0 ** math.floor(math.log10(min(positive))) if positive else 1e-7)
            ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes.flat[len(PANELS):]:
        ax.axis("off")
    fig.tight_layout()
    return figure_png(fig)


_CSS = BASE_CSS + "body{--col-width:360px}"


def _fmt(x: Any) -> str:
    if x is None:
        return "—"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _arm_html(arm: str, history: Sequence[Mapping[str, Any]]) -> str:
    s = arm_summary(history)
    if not history:
        return f"<div class=col><h2>{escape(arm)}</h2><p class=muted>no steps</p></div>"
    exact = all(h["mismatch_bits_differ"] == 0 and h["mismatch_max_abs_diff"] == 0 for h in history)
    verdict = ('<span class=ok>sampler and trainer agree bit for bit at every step: on-policy</span>' if exact else
               '<span class=bad>sampler and trainer logprobs differ: the samples are off-policy</span>')
    rows = "".join(f"<tr><th>{escape(k)}</th><td>{escape(_fmt(v))}</td></tr>" for k, v in s.items())
    last = history[-1].get("sample_text", "")
    return (f"<div class=col><h2>{escape(arm)}</h2><p>{verdict}</p><table>{rows}</table>"
            f"<details><summary>a completion from the last step</summary><pre>{escape(last)}</pre></details></div>")


def report_html(histories: Mapping[str, Sequence[Mapping[str, Any]]], experiment: Mapping[str, Any],
                png: bytes) -> str:
    # a partial report (Ctrl-C) holds the steps that finished
    head = page_head("detinfer rl report", "GRPO: sampler-trainer mismatch, deterministic vs fast", _CSS, experiment)
    info = experiment_html(experiment)
    times = {a: arm_summary(h).get("mean step time (s)") for a, h in histories.items()}
    if times.get("deterministic") and times.get("fast"):
        info += (f"<p>step time deterministic / fast: <b>{times['deterministic'] / times['fast']:.2f}x</b> "
                 "(mean over steps 2.., rollout + training)</p>")
    body = img_tag(png, "reward and mismatch per step") + "<div class=cols>" + \
        "".join(_arm_html(a, h) for a, h in histories.items()) + "</div>"
    return head + info + body + "<p class=muted>every step's metrics: report.json</p></body></html>\n"


def write_report(out_dir: str | Path, histories: Mapping[str, Sequence[Mapping[str, Any]]],
                 experiment: Mapping[str, Any]) -> dict[str, Path]:
    """Write report.json, summary.png and report.html into out_dir; returns {name: path}."""
    if not histories:
        raise ValueError("no arms to report")
    from detinfer import __version__

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "html": out / "report.html", "summary_png": out / "summary.png"}
    doc = {"format": REPORT_FORMAT, "detinfer_version": __version__, "partial": bool(experiment.get("partial")),
           "experiment": dict(experiment),
           "arms": {a: {"summary": arm_summary(h), "steps": list(h)} for a, h in histories.items()}}
    paths["json"].write_text(json.dumps(jsonable(doc), allow_nan=False, indent=1) + "\n", encoding="utf-8")
    png = summary_png(histories)
    paths["summary_png"].write_bytes(png)
    paths["html"].write_text(report_html(histories, experiment, png), encoding="utf-8")
    return paths
