import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def pytest_collection_modifyitems(config, items):
    # GPU tests skip cleanly where there is no CUDA device; nothing else is ever skipped.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    assert SHAKESPEARE.is_file(), f"{SHAKESPEARE} is missing: CI runs with ../shared beside the repo"
    return SHAKESPEARE


@pytest.fixture(autouse=True)
def _torch_threads():
    # Keep each test's torch on the cores it was given; restore afterwards.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
