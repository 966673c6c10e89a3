from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run wherever CUDA is present; the suite never depends on them."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is false here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]
