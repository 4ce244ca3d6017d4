"""The CPU tests' model ships with the repository (tests/data), and a missing test model is a skip on a
partial checkout but a failure where DETINFER_REQUIRE_TEST_MODELS is set (CI), so a run cannot pass by
skipping the tests that need it."""

import importlib.util
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _root_conftest():
    """tests/conftest.py under its own module name (the name `conftest` belongs to whichever directory's
    conftest was imported last)."""
    spec = importlib.util.spec_from_file_location("root_conftest_for_test", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stories260k_ships_in_tests_data_with_its_source_notes(stories_dir):
    assert stories_dir == TESTS / "data" / "stories260k"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "SOURCE.md"):
        assert (stories_dir / name).is_file(), name
    source = (stories_dir / "SOURCE.md").read_text(encoding="utf-8")
    assert "MIT" in source and "karpathy" in source.lower()  # the licence and the origin stay with the weights


@pytest.mark.parametrize("value", [None, "", "0"])
def test_a_missing_test_model_skips_without_the_switch(monkeypatch, value):
    conftest = _root_conftest()
    if value is None:
        monkeypatch.delenv(conftest.REQUIRE_TEST_MODELS_ENV, raising=False)
    else:
        monkeypatch.setenv(conftest.REQUIRE_TEST_MODELS_ENV, value)
    with pytest.raises(pytest.skip.Exception, match="no-such-model"):
        conftest.repository_test_model("no-such-model")


def test_a_missing_test_model_fails_with_the_switch(monkeypatch):
    conftest = _root_conftest()
    monkeypatch.setenv(conftest.REQUIRE_TEST_MODELS_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="no-such-model.*DETINFER_REQUIRE_TEST_MODELS"):
        conftest.repository_test_model("no-such-model")
    assert conftest.repository_test_model("stories260k") == TESTS / "data" / "stories260k"


def test_ci_requires_the_test_models():
    ci = (TESTS.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert "export DETINFER_REQUIRE_TEST_MODELS=1" in ci
