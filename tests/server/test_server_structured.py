"""Structured output through the real server: OpenAI's response_format (json_object, json_schema), vLLM's
guided_json / guided_regex / guided_choice / guided_grammar and structured_outputs, on both endpoints;
400s naming the field for invalid schemas, regexes, grammars, several constraints at once, and a server
without llguidance; the constrained request is bit-identical alone and next to others."""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from detinfer.server import protocol as P
from detinfer.server.sampling import structured_outputs

pytest.importorskip("llguidance")
MODEL_NAME = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Describe a pet."}]
PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
       "required": ["kind", "ok"], "additionalProperties": False}


def _post(server, path, body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL_NAME, **body}, timeout=120.0)


def test_chat_json_schema_with_the_openai_client(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0.8, seed=3, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}})
    (c,) = r.choices
    pet = json.loads(c.message.content)
    assert c.finish_reason == "stop" and set(pet) == {"kind", "ok"} and pet["kind"] in ("cat", "dog")


@pytest.mark.parametrize("body,check", [
    ({"guided_choice": ["alpha", "beta gamma"]}, lambda t: t in ("alpha", "beta gamma")),
    ({"guided_regex": r"[a-c]{2,4}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", t)),
    ({"guided_grammar": 'root ::= "x" ("y" | "z")+ "."'}, lambda t: re.fullmatch(r"x[yz]+\.", t)),
    ({"guided_json": PET}, lambda t: json.loads(t)["kind"] in ("cat", "dog")),
    ({"structured_outputs": {"regex": "(on|off)!"}}, lambda t: t in ("on!", "off!")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_choice": ["up", "down"], "min_tokens": 1, "logit_bias": {"2": 50.0}, "bad_words": ["zzz"]},
     lambda t: t in ("up", "down")),  # with vLLM's sampling extras: both apply
    ({"structured_outputs": {"json": json.dumps(PET)}}, lambda t: set(json.loads(t)) == {"kind", "ok"}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PET}}},
     lambda t: set(json.loads(t)) == {"kind", "ok"}),
])
def test_completions_follow_every_spelling(server, body, check):
    r = _post(server, "completions", {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 1.0,
                                      "seed": 5, "n": 2, "vendor_knob": 1, **body})
    assert r.status_code == 200, r.text
    # the structured fields are real fields: only the unknown one is reported as ignored
    assert r.headers["X-Detinfer-Ignored-Fields"] == "vendor_knob"
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


def test_json_object_mode_starts_an_object_and_logprobs_stay_json(server):
    r = _post(server, "chat/completions", {"messages": MESSAGES, "max_tokens": 6, "temperature": 0,
                                           "logprobs": True, "top_logprobs": 5,
                                           "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    (c,) = r.json()["choices"]
    assert c["message"]["content"].startswith("{")
    first = c["logprobs"]["content"][0]
    assert first["token"] == "{" and first["logprob"] == 0.0  # the only token the grammar allows


def test_text_response_format_is_free_text(server):
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = _post(server, "chat/completions", body).json()["choices"][0]["message"]["content"]
    text = _post(server, "chat/completions", {**body, "response_format": {"type": "text"}})
    assert text.json()["choices"][0]["message"]["content"] == plain


@pytest.mark.parametrize("path,body,param,what", [
    ("completions", {"guided_regex": "(abc"}, "guided_regex", "unclosed group"),
    ("completions", {"guided_json": {"type": "nonsense"}}, "guided_json", "nonsense"),
    ("completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("completions", {"guided_grammar": 'start: "a" | missing'}, "guided_grammar", "missing"),
    ("completions", {"guided_choice": []}, "guided_choice", "at least one"),
    ("completions", {"structured_outputs": {"regex": "(x"}}, "structured_outputs.regex", "unclosed"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("completions", {"structured_outputs": {"xml": "a"}}, "structured_outputs.xml", "unrecognized"),
    ("completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                     "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "nope"),
    ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ("chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "at most one"),
])
def test_invalid_constraints_are_400s_naming_the_field(server, path, body, param, what):
    base = {"prompt": "Once"} if path == "completions" else {"messages": MESSAGES}
    r = _post(server, path, {**base, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and what in err["message"], err


def test_a_server_without_llguidance_answers_400_saying_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    req = P.parse_request(P.CompletionRequest, {"model": "m", "prompt": "x", "guided_regex": "never-seen-[a-z]+z"})
    with pytest.raises(P.APIError) as e:
        structured_outputs(req)
    assert e.value.status == 400 and e.value.param == "guided_regex"
    assert "pip install 'detinfer[structured]'" in e.value.message


def test_structured_request_is_bitwise_the_same_alone_and_among_others(server):
    body = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0.9, "seed": 11, "logprobs": 3,
            "guided_json": PET}
    alone = _post(server, "completions", body).json()["choices"]
    others = [{"prompt": "The dog", "max_tokens": 20, "temperature": 0.7, "seed": s, "guided_regex": "[a-z ]{3,20}"}
              for s in range(3)]
    others += [{"prompt": "Lily", "max_tokens": 20, "temperature": 0.0, "ignore_eos": True}] * 3
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_post, server, "completions", b) for b in others[:3]]
        target = pool.submit(_post, server, "completions", body)
        futures += [pool.submit(_post, server, "completions", b) for b in others[3:]]
        assert all(f.result().status_code == 200 for f in futures)
        assert target.result().json()["choices"] == alone
