"""Report files from synthetic sections: they exist, parse, hold every completion, and embed the plots."""

import base64
import json
import re

import pytest

pytest.importorskip("matplotlib")

from detinfer.repro.analysis import Completion, summarize  # noqa: E402
from detinfer.repro.report import REPORT_FORMAT, Section, panel_title, write_report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _section(label, texts, logprob=-0.5):
    comps = [Completion(r, t, tokens=tuple(t), logprobs=tuple([logprob] * len(t)),
                        top_logprobs=tuple(((ch, logprob),) for ch in t), finish_reason="length",
                        meta={"arrival_step": r}) for r, t in enumerate(texts)]
    return Section(label=label, target=f"synthetic {label}", prompt="Tell me <b>about</b>",
                   summary=summarize(comps), completions=tuple(comps), elapsed_s=1.5, extra={"engine steps": 7})


def _strict_json(path):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)


def test_report_files_exist_and_parse(tmp_path):
    fast = _section("fast", ["abc<script>x", "abd", "abc<script>x", "abc<script>x"])
    det = _section("deterministic", ["abc"] * 4, logprob=float("-inf"))
    paths = write_report(tmp_path / "out", [fast, det], {"prompt": "p", "n": 4, "command": "detinfer repro x"})
    for key in ("json", "html", "summary_png", "fast_histogram", "fast_divergence",
                "deterministic_histogram", "deterministic_divergence"):
        assert paths[key].is_file(), key
    for key in ("summary_png", "fast_histogram", "deterministic_divergence"):
        assert paths[key].read_bytes().startswith(PNG_MAGIC)

    data = _strict_json(paths["json"])
    assert data["format"] == REPORT_FORMAT
    assert [s["label"] for s in data["sections"]] == ["fast", "deterministic"]
    f, d = data["sections"]
    assert len(f["completions"]) == 4 and len(d["completions"]) == 4
    assert [c["text"] for c in f["completions"]] == ["abc<script>x", "abd", "abc<script>x", "abc<script>x"]
    assert f["completions"][1]["tokens"] == ["a", "b", "d"]
    assert f["summary"]["num_unique"] == 2 and d["summary"]["num_unique"] == 1
    assert f["summary"]["pairs"][0]["index"] == 2
    assert f["summary"]["groups"][0]["runs"] == [0, 2, 3]
    assert f["summary"]["groups"][0]["logprob_variant_counts"] == [3]
    assert d["completions"][0]["logprobs"] == ["-inf"] * 3  # strict JSON has no -Infinity
    assert f["completions"][0]["meta"] == {"arrival_step": 0}

    html = paths["html"].read_text(encoding="utf-8")
    assert html.startswith("<!doctype html>") and html.rstrip().endswith("</html>")
    assert "<script>" not in html and "abc&lt;script&gt;x" in html  # completion text is escaped
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 4  # histogram + divergence plot per section
    assert all(base64.b64decode(i).startswith(PNG_MAGIC) for i in images)
    assert "http://" not in html and "https://" not in html  # self-contained: no external assets
    assert "deterministic: 1 distinct text and 1 distinct logprob sequence in 4 runs: reproducible" in html
    assert "2 distinct texts and 2 distinct logprob sequences in 4 runs: not reproducible" in html


def test_char_sections_and_duplicate_labels(tmp_path):
    comps = [Completion(0, "same"), Completion(1, "same")]
    s = Section("http://127.0.0.1:1/v1", "server", "p", summarize(comps), tuple(comps), 0.1)
    paths = write_report(tmp_path, [s, s], {"prompt": "p"})
    assert paths["http_127_0_0_1_1_v1_0_histogram"].is_file()
    assert paths["http_127_0_0_1_1_v1_1_histogram"].is_file()
    data = _strict_json(paths["json"])
    assert data["sections"][0]["summary"]["unit"] == "char"
    assert data["sections"][0]["completions"][0]["tokens"] is None


def test_write_report_refuses_nothing(tmp_path):
    with pytest.raises(ValueError, match="no sections"):
        write_report(tmp_path, [], {})


def _logprob_only_section(n=20, differing=(3, 7, 11)):
    """Every run the same text; a few runs differ in the first token's logprob bits."""
    comps = [Completion(r, "abc", tokens=tuple("abc"),
                        logprobs=(-0.5 - (1e-9 if r in differing else 0.0), -0.25, -0.125),
                        top_logprobs=None, finish_reason="length") for r in range(n)]
    return Section("fast", "synthetic", "p", summarize(comps), tuple(comps), 1.0)


def test_logprob_only_differences_are_not_reproducible(tmp_path):
    """Same text in every run but different logprob bits: the HTML, the terminal and --check all say "not
    reproducible", with the same counts, and position 0 reads "at token 0" (not "0", which reads as none)."""
    from detinfer.repro import cli
    from detinfer.repro.report import headline, reproduces, verdict

    fast = _logprob_only_section()
    det = _logprob_only_section(differing=())
    assert not reproduces(fast.summary) and reproduces(det.summary)
    assert not cli.reproduces(fast) and cli.reproduces(det)  # what --check uses
    assert verdict(fast.summary) == "1 distinct text but 2 distinct logprob sequences in 20 runs: not reproducible"
    assert headline([fast, det]) == ("fast: 1 distinct text but 2 distinct logprob sequences in 20 runs: not "
                                     "reproducible; fast: 1 distinct text and 1 distinct logprob sequence in 20 "
                                     "runs: reproducible.")
    html = write_report(tmp_path, [fast], {"prompt": "p"})["html"].read_text(encoding="utf-8")
    assert 'class="bad">1 distinct text but 2 distinct logprob sequences in 20 runs: not reproducible' in html
    assert "reproducible: 1 unique" not in html and 'class="ok"' not in html
    assert "at token 0" in html
    lines = cli.describe(fast)
    assert "not reproducible" in lines and "the earliest at token 0" in lines


def _drifting_section(label="fast"):
    """One text in 4 runs, but run 2's logprob at token 1 is 0.25 off: 2 distinct logprob sequences."""
    comps = [Completion(r, "abc", tokens=tuple("abc"), logprobs=(-0.5, -0.75 if r == 2 else -0.5, -0.5))
             for r in range(4)]
    return Section(label=label, target="synthetic", prompt="p", summary=summarize(comps), completions=tuple(comps),
                   elapsed_s=1.0)


def test_panel_titles_state_both_counts_and_the_verdict(tmp_path):
    """The histogram's title once read "fast: 1 unique of 4 (not reproducible)": one text, yet not
    reproducible. Titles now give the text count, the logprob-sequence count and the verdict from both."""
    from detinfer.report_html import pyplot
    from detinfer.repro.report import _draw_divergence, _draw_histogram

    s = _drifting_section()
    title = panel_title(s.label, s.summary)
    assert title == "fast: not reproducible (4 runs)\n1 distinct text but 2 distinct logprob sequences"
    plt = pyplot()
    fig, (hist, div) = plt.subplots(1, 2)
    _draw_histogram(hist, s)
    _draw_divergence(div, s)
    assert hist.get_title() == title and "unique" not in hist.get_title()
    assert div.get_title().endswith("largest |logprob difference| from run 0: 0.25")
    plt.close(fig)


def test_max_logprob_difference_in_json_and_html(tmp_path):
    paths = write_report(tmp_path, [_drifting_section(), _section("deterministic", ["abc"] * 3)], {"prompt": "p"})
    fast, det = (s["summary"] for s in _strict_json(paths["json"])["sections"])
    assert fast["max_abs_logprob_diff"] == 0.25 and fast["max_abs_logprob_diff_at"] == {"run": 2, "position": 1}
    assert det["max_abs_logprob_diff"] == 0.0 and det["max_abs_logprob_diff_at"] is None
    html = paths["html"].read_text(encoding="utf-8")
    assert "largest |logprob difference| from the reference run, where the tokens so far agree" in html
    assert "0.25 (run 2 vs run 0, at token 1)" in html
    assert "0 (every run&#x27;s logprobs equal run 0&#x27;s while their tokens agree)" in html
