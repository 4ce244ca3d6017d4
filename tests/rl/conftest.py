"""Fixtures for the RL tests: the real stories260k checkpoint (next to the repository), one CPU thread."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO.parent / "shared" / "models" / "stories260k"



@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"stories260k checkpoint not found at {STORIES} (expected <repo>/../shared/models/stories260k)")
    return STORIES
