"""EngineConfig validation, CLI flag generation, and the no-torch rule of the pure-Python engine modules."""

import argparse
import dataclasses
import subprocess
import sys

import pytest

from detinfer.engine.config import EngineConfig, add_dataclass_args, from_args


def test_defaults_are_valid_and_frozen():
    cfg = EngineConfig()
    assert cfg.mode == "deterministic" and cfg.enable_prefix_caching and cfg.enable_chunked_prefill
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 32


@pytest.mark.parametrize("changes, match", [
    ({"max_num_batched_tokens": 0}, r"max_num_batched_tokens must be >= 1, got 0"),
    ({"max_num_seqs": -1}, r"max_num_seqs must be >= 1"),
    ({"block_size": 12}, r"block_size must be a power of two in \[1, 1024\], got 12"),
    ({"block_size": 2048}, r"block_size must be in \[1, 1024\]"),
    ({"num_kv_blocks": 0}, r"num_kv_blocks must be >= 1"),
    ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\], got 0.0"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"gpu_memory_utilization": float("nan")}, r"gpu_memory_utilization must be finite"),
    ({"max_model_len": 0}, r"max_model_len must be >= 1"),
    ({"mode": "fastest"}, r"mode must be one of \('deterministic', 'fast'\), got 'fastest'"),
    ({"dtype": "fp8"}, r"dtype must be one of"),
    ({"seed": -3}, r"seed must be >= 0"),
    ({"cuda_graph_max_tokens": -1}, r"cuda_graph_max_tokens must be >= 0, got -1"),
    ({"max_num_seqs": 300, "max_num_batched_tokens": 256},
     r"max_num_batched_tokens \(256\) must be >= max_num_seqs \(300\)"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 1024},
     r"enable_chunked_prefill=False, max_num_batched_tokens \(512\) must be >= max_model_len \(1024\)"),
])
def test_invalid_values_are_rejected_with_field_and_range(changes, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**changes)


@pytest.mark.parametrize("changes, match", [
    ({"max_num_seqs": 2.0}, r"max_num_seqs must be an int, got 2.0 \(float\)"),
    ({"max_num_seqs": True}, r"max_num_seqs must be an int"),
    ({"num_kv_blocks": "8"}, r"num_kv_blocks must be an int or None"),
    ({"enforce_eager": 1}, r"enforce_eager must be a bool"),
    ({"cuda_graph_short_kv": "no"}, r"cuda_graph_short_kv must be a bool, got 'no'"),
    ({"cuda_graph_max_tokens": 64.0}, r"cuda_graph_max_tokens must be an int"),
    ({"gpu_memory_utilization": "0.5"}, r"gpu_memory_utilization must be a number"),
])
def test_wrong_types_are_rejected(changes, match):
    with pytest.raises(TypeError, match=match):
        EngineConfig(**changes)


def test_replace_validates_again():
    cfg = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8)
    assert cfg.replace(max_model_len=4096).max_model_len == 4096
    with pytest.raises(ValueError, match="max_num_seqs"):
        cfg.replace(max_num_seqs=128)


def _parser():
    return add_dataclass_args(argparse.ArgumentParser(), EngineConfig)


def test_flags_follow_vllm_names_and_defaults_round_trip():
    parser = _parser()
    flags = {opt for a in parser._actions for opt in a.option_strings}
    for flag in ("--max-num-batched-tokens", "--max-num-seqs", "--block-size", "--num-kv-blocks",
                 "--gpu-memory-utilization", "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--max-model-len", "--mode",
                 "--dtype", "--enforce-eager", "--seed"):
        assert flag in flags, flag
    assert from_args(EngineConfig, parser.parse_args([])) == EngineConfig()


def test_flags_parse_into_a_validated_config():
    ns = _parser().parse_args([
        "--max-num-batched-tokens", "512", "--max-num-seqs", "32", "--block-size", "32",
        "--num-kv-blocks", "100", "--no-enable-prefix-caching", "--max-model-len", "2048",
        "--mode", "fast", "--dtype", "bfloat16", "--enforce-eager", "--seed", "none",
        "--gpu-memory-utilization", "0.5", "--no-cuda-graph-short-kv",
    ])
    cfg = from_args(EngineConfig, ns)
    assert cfg == EngineConfig(max_num_batched_tokens=512, max_num_seqs=32, block_size=32, num_kv_blocks=100,
                               enable_prefix_caching=False, max_model_len=2048, mode="fast", dtype="bfloat16",
                               enforce_eager=True, seed=None, gpu_memory_utilization=0.5,
                               cuda_graph_short_kv=False)


def test_bad_flag_values_fail_at_parse_or_validation(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--mode", "turbo"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--max-num-seqs", "many"])
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        from_args(EngineConfig, _parser().parse_args(["--block-size", "24"]))


def test_every_field_has_help_text():
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata.get("help"), f"EngineConfig.{f.name} has no help text"


def test_pure_python_engine_modules_do_not_import_torch():
    # The package __init__ files may import torch (the drop-in mode, the LLM class), so they are replaced
    # by empty namespace stubs: what is checked is that these modules and their own imports stay torch-free.
    code = (
        "import importlib.util, sys, types\n"
        "for name in ('detinfer', 'detinfer.engine'):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    stub = types.ModuleType(name)\n"
        "    stub.__path__ = list(spec.submodule_search_locations)\n"
        "    sys.modules[name] = stub\n"
        "import detinfer.engine.config, detinfer.engine.sampling_params, detinfer.engine.sequence\n"
        "import detinfer.engine.block_manager, detinfer.engine.scheduler\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded[:5]\n"
        "assert 'detinfer.engine.scheduler' in sys.modules\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_resolved_returns_a_new_config_and_never_changes_the_given_one():
    """The engine runs `config.resolved(context_len)`: max_model_len defaulted and checked, the TP-invariant
    flag dropped in fast mode. The given (frozen) config is never rewritten."""
    given = EngineConfig(mode="fast", tp_invariant_reduction=True, max_num_batched_tokens=64, max_num_seqs=4)
    run = given.resolved(128)
    assert (run.max_model_len, run.tp_invariant_reduction) == (128, False)
    assert (given.max_model_len, given.tp_invariant_reduction) == (None, True)
    assert EngineConfig(max_model_len=64).resolved(128).max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len=256 exceeds the model's max_position_embeddings=128"):
        EngineConfig(max_model_len=256).resolved(128)
    with pytest.raises(ValueError, match="with max_model_len resolved to 128 .*set max_model_len explicitly"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=64, max_num_seqs=4).resolved(128)
