"""Server pieces without a server: request validation, logprob token formatting, metrics text, ServerConfig
and its CLI flags, the system fingerprint."""

from __future__ import annotations

import argparse

import pytest

from detinfer.engine.config import EngineConfig
from detinfer.server import protocol as P
from detinfer.server.config import ServerConfig
from detinfer.server.fingerprint import (
    DeviceInfo,
    SoftwareInfo,
    model_files_digest,
    numeric_code_digest,
    system_fingerprint,
)
from detinfer.server.logprobs import LOGPROB_FLOOR, TokenFormatter, clamp_logprob
from detinfer.server.metrics import ServerMetrics, parse_metrics
from detinfer.server.serve import CLIError, build_parser


def _err(model, body) -> P.APIError:
    with pytest.raises(P.APIError) as info:
        P.parse_request(model, body)
    assert info.value.status == 400
    return info.value


def test_completion_request_defaults_and_nulls():
    req = P.parse_request(P.CompletionRequest, {"model": "m", "prompt": "hi", "temperature": None, "n": None})
    assert (req.max_tokens, req.temperature, req.n, req.stream, req.logprobs) == (16, None, None, False, None)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": [[]]}, "prompt"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt"),
    ({"model": "m", "prompt": [True]}, "prompt"),
    ({"model": "m", "prompt": 5}, "prompt"),
    ({"model": "m", "prompt": ["a"] * (P.MAX_PROMPTS_PER_REQUEST + 1)}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 5.0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": -0.1}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": "m", "prompt": "x", "top_k": -2}, "top_k"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m", "prompt": "x", "seed": -1}, "seed"),
    ({"model": "m", "prompt": "x", "seed": 1 << 63}, "seed"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "stop": ["a", ""]}, "stop"),
    ({"model": "m", "prompt": "x", "stop": 3}, "stop"),
    ({"model": "m", "prompt": "x", "logprobs": -1}, "logprobs"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"-5": 1.0}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"model": "m", "prompt": "x", "suffix": "tail"}, "suffix"),
    ({"model": "m", "prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"model": "m", "prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"model": "m", "prompt": "x", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"model": "m", "prompt": "x", "allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"model": "m", "prompt": "x", "bad_words": "word"}, "bad_words"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"model": "m", "prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
])
def test_completion_request_errors_name_the_field(body, param):
    err = _err(P.CompletionRequest, body)
    assert err.param == param
    assert err.body()["error"]["type"] == "invalid_request_error"
    assert err.body()["error"]["message"]


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format.type"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": -1}, "top_logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
])
def test_chat_request_errors_name_the_field(body, param):
    assert _err(P.ChatCompletionRequest, body).param == param


def test_chat_messages_render_roles_and_text_parts():
    req = P.parse_request(P.ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]})
    assert req.template_messages() == [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]


def test_body_must_be_an_object():
    assert "JSON object" in _err(P.CompletionRequest, [1, 2]).message


def test_normalize_prompt_shapes():
    assert P.normalize_prompt("a") == ["a"]
    assert P.normalize_prompt(["a", "b"]) == ["a", "b"]
    assert P.normalize_prompt([1, 2]) == [[1, 2]]
    assert P.normalize_prompt([[1], [2, 3]]) == [[1], [2, 3]]


def test_token_formatter_bytes_rebuild_the_text(tiny_model_dir):
    """The byte-level table must be exact: concatenating each token's bytes gives the decoded text."""
    from detinfer.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    fmt = TokenFormatter(tok)
    for text in ["Hello world", "Déterminisme: naïve café, 東京 🙂\tand\nnewlines", "def add(a, b): return"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(fmt.token(i)[1] for i in ids) == tok.decode(ids).encode("utf-8")
    for i in range(tok.vocab_size):  # every id has bytes; partial UTF-8 shows as bytes:\xNN
        text, raw = fmt.token(i)
        assert raw
        try:
            expected = raw.decode("utf-8")
        except UnicodeDecodeError:
            expected = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        assert text == expected
    assert fmt.token(2) == ("<|im_end|>", b"<|im_end|>")  # special tokens keep their text


def test_clamp_logprob():
    assert clamp_logprob(float("-inf")) == LOGPROB_FLOOR
    assert clamp_logprob(-1.25) == -1.25


def test_metrics_text_format_round_trips():
    m = ServerMetrics()
    m.http_requests.inc(path="/health", status="200")
    m.http_requests.inc(2, path="/health", status="200")
    m.update_engine_stats({"num_running": 3, "num_waiting": 1, "kv_blocks_used": 4, "kv_blocks_total": 16,
                           "prompt_tokens": 10, "generation_tokens": 7})
    m.step_time.observe(0.003)
    m.step_time.observe(20.0)
    text = m.render()
    assert "# TYPE detinfer_http_requests_total counter" in text
    values = parse_metrics(text)
    assert values['detinfer_http_requests_total{path="/health",status="200"}'] == 3
    assert values["detinfer_requests_running"] == 3 and values["detinfer_requests_waiting"] == 1
    assert values["detinfer_kv_cache_usage_ratio"] == 0.25
    assert values["detinfer_generation_tokens_total"] == 7
    assert values['detinfer_engine_step_seconds_bucket{le="0.005"}'] == 1
    assert values['detinfer_engine_step_seconds_bucket{le="+Inf"}'] == 2
    with pytest.raises(ValueError):
        m.http_requests.inc(-1, path="/health", status="200")
    with pytest.raises(ValueError):
        m.http_requests.inc(path="/health")


def test_server_config_validation():
    ServerConfig()
    for bad in [dict(port=70000), dict(port="80"), dict(max_pending_requests=0), dict(max_n=0),
                dict(host=""), dict(api_key=""), dict(uvicorn_log_level="loud"),
                dict(timeout_graceful_shutdown=-1.0), dict(max_request_bytes=10), dict(gil_switch_interval_ms=0.0),
                dict(gil_switch_interval_ms=-5.0)]:
        with pytest.raises((ValueError, TypeError)):
            ServerConfig(**bad)


def test_cli_flags_come_from_the_dataclasses():
    parser = build_parser()
    ns = parser.parse_args(["/m", "--port", "9001", "--mode", "fast", "--dtype", "bfloat16", "--max-num-seqs", "8",
                            "--max-num-batched-tokens", "64", "--api-key", "k", "--no-enable-prefix-caching"])
    assert ns.port == 9001 and ns.mode == "fast" and ns.dtype == "bfloat16" and ns.api_key == "k"
    assert ns.max_num_seqs == 8 and ns.enable_prefix_caching is False
    flags = {a for action in parser._actions for a in action.option_strings}
    assert {"--host", "--port", "--served-model-name", "--max-num-seqs", "--gpu-memory-utilization",
            "--max-model-len", "--enable-prefix-caching", "--block-size"} <= flags
    with pytest.raises(CLIError):
        build_parser().parse_args(["/m", "--mode", "sloppy"])


def test_serve_refuses_bad_flags_and_missing_model(tmp_path, capsys):
    """Each error is one line on stderr (no usage dump) and exit status 2."""
    from detinfer.server.serve import main

    assert main([str(tmp_path), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "no config.json" in err and err.count("\n") == 1 and "usage" not in err
    # EngineConfig validation reaches the user the same way
    assert main([str(tmp_path), "--max-num-seqs", "64", "--max-num-batched-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "max_num_batched_tokens" in err and err.count("\n") == 1
    assert main([str(tmp_path), "--max-num-seq", "8"]) == 2  # no prefix matching of flags
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-num-seq" in err and err.count("\n") == 1 and "usage" not in err


SOFTWARE = SoftwareInfo(code_digest="c", torch="2.13.0", cuda="13.0", triton="3.9.0")
H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", (9, 0))


def test_system_fingerprint_tracks_everything_that_changes_numbers(tiny_model_dir, tmp_path):
    base = dict(weights_digest="w", dtype="float32", mode="deterministic", block_size=16, device=H100,
                software=SOFTWARE)
    fp = system_fingerprint(**base)
    assert fp.startswith("fp_") and fp == system_fingerprint(**base)
    for key, other in [("weights_digest", "w2"), ("dtype", "bfloat16"), ("mode", "fast"), ("block_size", 32),
                       ("device", DeviceInfo("cpu", "cpu")), ("device", DeviceInfo("cuda", H100.name, (8, 0))),
                       ("software", SoftwareInfo("c2", "2.13.0", "13.0", "3.9.0")),
                       ("software", SoftwareInfo("c", "2.12.0", "13.0", "3.9.0")),
                       ("software", SoftwareInfo("c", "2.13.0", "12.8", "3.9.0")),
                       ("software", SoftwareInfo("c", "2.13.0", "13.0", "3.8.0")),
                       ("software", SoftwareInfo("c", "2.13.0", "13.0", "3.9.0", "1.9.1"))]:
        assert system_fingerprint(**{**base, key: other}) != fp, (key, other)
    assert len(numeric_code_digest()) == 64

    from detinfer.models.testing import write_tiny_checkpoint

    a = model_files_digest(tiny_model_dir)
    assert a == model_files_digest(tiny_model_dir)
    other = write_tiny_checkpoint(tmp_path / "other", "LlamaForCausalLM", seed=1)  # same files, other weights
    assert model_files_digest(other) != a


def test_deterministic_fingerprint_ignores_the_device_name_fast_mode_keeps_it():
    """Deterministic mode on an H100 and an H200 (same compute capability, same code) gives the same bits,
    so the fingerprint must be equal; fast mode lets cuBLAS pick kernels per device, so it must differ."""
    h200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0))
    base = dict(weights_digest="w", dtype="bfloat16", block_size=16, software=SOFTWARE)
    assert (system_fingerprint(**base, mode="deterministic", device=H100)
            == system_fingerprint(**base, mode="deterministic", device=h200))
    assert (system_fingerprint(**base, mode="fast", device=H100)
            != system_fingerprint(**base, mode="fast", device=h200))
    # the capability (the compiler's target) still counts in deterministic mode
    a100 = DeviceInfo("cuda", "NVIDIA A100", (8, 0))
    assert (system_fingerprint(**base, mode="deterministic", device=H100)
            != system_fingerprint(**base, mode="deterministic", device=a100))


def test_engine_config_flags_parse_into_engine_config():
    ns = build_parser().parse_args(["/m", "--num-kv-blocks", "12", "--max-model-len", "none"])
    from detinfer.engine.config import from_args

    cfg = from_args(EngineConfig, ns)
    assert cfg.num_kv_blocks == 12 and cfg.max_model_len is None
    assert isinstance(ns, argparse.Namespace)


def test_unknown_top_level_fields_are_kept_as_ignored():
    req = P.parse_request(P.CompletionRequest, {"model": "m", "prompt": "x", "frobnicate": 1, "best_of": 1,
                                                "use_beam_search": False})
    assert req.ignored_fields() == ["frobnicate", "use_beam_search"]
    assert P.parse_request(P.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                     "knob": 1}).ignored_fields() == ["knob"]
    # nested objects stay strict
    assert _err(P.CompletionRequest, {"model": "m", "prompt": "x", "stream_options": {"knob": 1}}).param == \
        "stream_options.knob"
