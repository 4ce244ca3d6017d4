"""Tokenizer vs HF AutoTokenizer on the same files (encode, decode, chat template), and the incremental
detokenizer (streamed deltas add up to the full decode; stop strings never leak)."""

import json

import pytest
import tokenizers
from transformers import AutoTokenizer

from detinfer.models import ChatTemplateError, Tokenizer, load_tokenizer
from detinfer.models.testing import build_tiny_tokenizer, write_tiny_checkpoint

TEXTS = ["Hello world", "  two  leading spaces", "Once upon a time, 12345!", "naïve café 東京 🙂",
         "tabs\tand\nnew\n\nlines ", "<|im_start|>user\nhi<|im_end|>", "", " "]
CONVERSATIONS = [
    [{"role": "user", "content": "Tell me about Richard Feynman"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
]


@pytest.fixture(scope="module", params=[False, True], ids=["no-bos", "bos"])
def tiny_dir(request, tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tok"), add_bos=request.param)


@pytest.fixture(scope="module")
def stories_tokenizer(stories_dir):
    return load_tokenizer(stories_dir), AutoTokenizer.from_pretrained(stories_dir)


def test_encode_decode_match_hf(tiny_dir):
    ours, hf = load_tokenizer(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ours.encode(TEXTS[3])) == TEXTS[3]  # byte-level BPE round-trips any text
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (0, 2, 0)
    assert ours.all_special_ids == [0, 1, 2]


def test_stories_encode_matches_hf_and_source(stories_tokenizer):
    ours, hf = stories_tokenizer
    assert ours.add_bos and ours.encode("Once upon a time") == [1, 403, 407, 261, 378]  # SOURCE.md
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(tiny_dir, conversation, add_generation_prompt):
    ours, hf = load_tokenizer(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    want = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == want
    ids = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == ours.encode(want, add_special_tokens=False)


# Exercises HF's Jinja conventions: lstrip/trim blocks, tojson keeping non-ASCII, loop controls,
# {% generation %}, special-token variables and extra kwargs.
FEATURE_TEMPLATE = """
{%- for m in messages %}
    {%- if m.role == 'skip' %}{% continue %}{% endif %}
    {{ bos_token }}[{{ m.role }}] {{ m.content | tojson }}
    {%- if m.role == 'assistant' %}{% generation %} <a>{{ m.content }}</a>{% endgeneration %}{% endif %}
{% endfor %}
{%- if tools %}tools: {{ tools | tojson(indent=2) }}{% endif %}
{%- if add_generation_prompt %}{{ eos_token }}GO{% endif %}
"""


def test_template_conventions_match_hf(tiny_dir):
    hf = AutoTokenizer.from_pretrained(tiny_dir)
    ours = Tokenizer(tokenizers.Tokenizer.from_file(str(tiny_dir / "tokenizer.json")), chat_template=FEATURE_TEMPLATE,
                     special_tokens={"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    msgs = [{"role": "user", "content": "café \"quoted\""}, {"role": "skip", "content": "x"},
            {"role": "assistant", "content": "東京"}]
    tools = [{"name": "f", "description": "naïve"}]
    want = hf.apply_chat_template(msgs, chat_template=FEATURE_TEMPLATE, tools=tools, tokenize=False,
                                  add_generation_prompt=True)
    assert ours.apply_chat_template(msgs, tools=tools) == want
    assert "naïve" in want and "東京" in want  # tojson kept non-ASCII as is
    probe = "{{ tools is none }}/{{ documents is none }}/{{ date_string | default('none') }}"
    ours_probe = Tokenizer(ours.backend, chat_template=probe)
    assert ours_probe.apply_chat_template(msgs) == hf.apply_chat_template(msgs, chat_template=probe,
                                                                          tokenize=False) == "True/True/none"


def test_add_bos_without_a_bos_token_is_refused():
    with pytest.raises(ValueError, match="add_bos_token is set but the tokenizer config names no bos_token"):
        Tokenizer(build_tiny_tokenizer(), add_bos_token=True)


def test_raise_exception_and_missing_template(tiny_dir, stories_tokenizer):
    ours = load_tokenizer(tiny_dir)
    with pytest.raises(ChatTemplateError, match="unknown role: tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="messages\\[0\\] must be a dict"):
        ours.apply_chat_template(["hi"])
    with pytest.raises(TypeError, match="messages must be a list"):
        ours.apply_chat_template("hi")
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        stories_tokenizer[0].apply_chat_template([{"role": "user", "content": "x"}])


def test_template_sources(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", chat_template=None)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    cfg_path.write_text(json.dumps(cfg))
    assert load_tokenizer(path).apply_chat_template([]) == "D"
    (path / "chat_template.jinja").write_text("J{{ messages | length }}")  # transformers 5 layout wins
    assert load_tokenizer(path).apply_chat_template([{"role": "user", "content": ""}]) == "J1"
    with pytest.raises(ChatTemplateError, match="does not parse"):
        Tokenizer(build_tiny_tokenizer(), chat_template="{% if %}")


def _stream(tok, ids, **kw):
    detok = tok.incremental_detokenizer(**kw)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text
    return detok, deltas


def test_incremental_detokenizer_adds_up_to_full_decode(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    for text in ["naïve café 東京 🙂 done", "Once upon a time, 12345!\n\tend"]:
        ids = tok.encode(text, add_special_tokens=False)
        detok, deltas = _stream(tok, ids)
        assert detok.text == text
        assert not any("\ufffd" in d for d in deltas)  # no half characters were streamed
    # a lone byte of a multi-byte character, at the very end, shows as U+FFFD like a full decode does
    partial = tok.encode("東", add_special_tokens=False)[:1]
    assert _stream(tok, partial)[0].text == tok.decode(partial)


def test_incremental_detokenizer_with_prompt_context(stories_tokenizer, stories_expected):
    tok, prompt, gen = stories_tokenizer[0], stories_expected["prompt_ids"], stories_expected["new_ids"]
    detok, _ = _stream(tok, gen, prompt_ids=prompt)
    assert tok.decode(prompt) + detok.text == tok.decode(prompt + gen) == stories_expected["text"]
    assert detok.text.startswith(", there was")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_never_leak(stories_tokenizer, stories_expected, include):
    tok, prompt, gen = stories_tokenizer[0], stories_expected["prompt_ids"], stories_expected["new_ids"]
    full = tok.decode(prompt + gen)[len(tok.decode(prompt)):]
    detok, deltas = _stream(tok, gen, prompt_ids=prompt, stop=["zebra", "girl named"], include_stop_str=include)
    cut = full.index("girl named") + (len("girl named") if include else 0)
    assert detok.stopped == "girl named" and detok.text == full[:cut]
    if not include:
        assert not any("girl" in d for d in deltas)
    # the earliest stop string wins
    detok, _ = _stream(tok, gen, prompt_ids=prompt, stop=["ball", "Lily"])
    assert detok.stopped == "Lily" and detok.text == full[:full.index("Lily")]


def test_unfinished_stop_prefix_is_held_back_until_finish(stories_tokenizer, stories_expected):
    tok, prompt, gen = stories_tokenizer[0], stories_expected["prompt_ids"], stories_expected["new_ids"]
    full = tok.decode(prompt + gen)[len(tok.decode(prompt)):]
    assert full.endswith(" red ball.")
    detok = tok.incremental_detokenizer(prompt_ids=prompt, stop=[" ball. The end"])
    streamed = "".join(detok.add(i) for i in gen)
    assert streamed == full[:-len(" ball.")]  # could still become the stop string
    assert detok.finish() == " ball." and detok.stopped is None and detok.text == full
    with pytest.raises(ValueError, match="non-empty strings"):
        tok.incremental_detokenizer(stop=[""])
