"""Model arguments that are Hugging Face hub ids, resolved offline from a hub cache laid out here as
huggingface_hub lays it out (models--Org--Name/refs/main naming the commit, snapshots/<commit>/ holding the
files; stored directly rather than as links into blobs/, which the hub's reader does not need); and the
vLLM-style top-level names (`from detinfer import LLM, SamplingParams`)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import detinfer
from detinfer.engine import SamplingParams
from detinfer.models.hub import looks_like_hub_id, resolve_model_path
from detinfer.models.testing import write_tiny_checkpoint

pytest.importorskip("huggingface_hub", reason="hub ids need the optional huggingface_hub package")
from huggingface_hub import constants as hub_constants  # noqa: E402

REPO_ID = "TinyOrg/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hub") / "plain", "Qwen3ForCausalLM", seed=11,
                                 num_shards=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, model_dir):
    """A hub cache holding REPO_ID at COMMIT (refs/main points to it) with model_dir's files."""
    cache = tmp_path_factory.mktemp("hub_cache")
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture
def offline_hub(monkeypatch, hub_cache):
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=hub_cache, for this process (huggingface_hub reads both when it is
    imported, so its constants are set too)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def test_top_level_names_are_the_engine_classes():
    from detinfer import LLM, EngineConfig, LLMEngine, RequestOutput
    from detinfer import SamplingParams as TopLevelSamplingParams
    from detinfer.engine import LLM as EngineLLM

    assert LLM is EngineLLM and TopLevelSamplingParams is SamplingParams
    assert {"LLM", "SamplingParams", "LLMEngine", "EngineConfig", "RequestOutput"} <= set(detinfer.__all__)
    assert LLMEngine.__module__ == "detinfer.engine.llm_engine" and EngineConfig and RequestOutput
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        detinfer.NotAThing  # noqa: B018


def test_import_detinfer_stays_light():
    code = ("import sys, detinfer\n"
            "assert 'torch' not in sys.modules, 'import detinfer pulled in torch'\n"
            "assert 'huggingface_hub' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": SRC})


def test_hub_id_loads_and_generates_like_its_directory(offline_hub, model_dir):
    from detinfer import LLM

    snapshot = resolve_model_path(REPO_ID)
    assert snapshot == offline_hub / "models--TinyOrg--tiny-qwen3" / "snapshots" / COMMIT
    kwargs = dict(max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=48, block_size=4, device="cpu")
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=2)
    prompts = ["Hello world", "Once upon a time"]
    by_id = LLM(REPO_ID, **kwargs).generate(prompts, params, use_tqdm=False)
    by_dir = LLM(str(model_dir), **kwargs).generate(prompts, params, use_tqdm=False)
    for a, b in zip(by_id, by_dir, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert len(a.outputs[0].token_ids) == 6
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # floats compared exactly


def test_hub_env_vars_alone_resolve_from_the_cache(hub_cache):
    """A fresh process configured only through the environment, as a user would."""
    code = ("from detinfer.models.hub import resolve_model_path\n"
            f"print(resolve_model_path({REPO_ID!r}))\n")
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True)
    assert Path(out.stdout.strip()) == hub_cache / "models--TinyOrg--tiny-qwen3" / "snapshots" / COMMIT


def test_a_directory_wins_over_the_hub(offline_hub, model_dir, monkeypatch):
    assert resolve_model_path(model_dir) == model_dir
    monkeypatch.chdir(model_dir.parent)  # "plain" is both a relative directory and a valid hub id
    assert resolve_model_path("plain") == Path("plain")
    with pytest.raises(ValueError, match="revision='main' applies to hub ids"):
        resolve_model_path(model_dir, revision="main")


def test_unresolvable_models_are_refused_with_a_reason(offline_hub, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'TinyOrg/not-cached'.*could not be resolved.*LocalEntryNotFound"):
        resolve_model_path("TinyOrg/not-cached")
    with pytest.raises(FileNotFoundError, match="could not be resolved"):
        resolve_model_path(REPO_ID, revision="no-such-branch")
    with pytest.raises(FileNotFoundError, match="does not exist.*not a Hugging Face hub id"):
        resolve_model_path(tmp_path / "missing")  # a path object is never a hub id
    with pytest.raises(FileNotFoundError, match="does not exist.*not a Hugging Face hub id"):
        resolve_model_path(str(tmp_path / "missing"))
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match="is a file"):
        resolve_model_path(tmp_path / "weights.gguf")
    with pytest.raises(TypeError, match="directory path or a Hugging Face hub id"):
        resolve_model_path(42)


def test_without_huggingface_hub_a_hub_id_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes `import huggingface_hub` fail
    with pytest.raises(FileNotFoundError, match=r"needs the huggingface_hub package: pip install 'detinfer\[hub\]'"):
        resolve_model_path(REPO_ID)


def test_the_generate_cli_takes_a_hub_id(offline_hub, model_dir, capsys):
    from detinfer.engine.generate_cli import main as generate_main

    args = ["--prompt", "Hello", "--max-tokens", "4", "--device", "cpu", "--num-kv-blocks", "32", "--show-ids"]
    assert generate_main(["--model", REPO_ID, *args]) == 0
    by_id = capsys.readouterr().out
    assert generate_main(["--model", str(model_dir), *args]) == 0
    assert capsys.readouterr().out == by_id and "token ids: [" in by_id
    assert generate_main(["--model", "TinyOrg/not-cached", *args]) == 2
    assert "could not be resolved" in capsys.readouterr().err


def test_a_cached_snapshot_without_config_is_refused(offline_hub):
    repo = offline_hub / "models--TinyOrg--no-config"
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / "README.md").write_text("not a model")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_path("TinyOrg/no-config")


@pytest.mark.parametrize(("text", "is_id"), [
    ("Qwen/Qwen3-0.6B", True), ("gpt2", True), ("meta-llama/Llama-3.1-8B-Instruct", True),
    ("/abs/path", False), ("./rel", False), ("a/b/c", False), ("org--x/name", False), ("org/na..me", False),
    ("~/models/x", False), ("", False), ("org/", False), ("x" * 97, False),
])
def test_hub_id_syntax(text, is_id):
    assert looks_like_hub_id(text) is is_id
