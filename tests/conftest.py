import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402

torch.set_num_threads(1)  # many tiny ops: one thread is fastest on a small CPU


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    """Every test runs in its own temporary folder, so runs/ never lands in the checkout; a test that ran a trainer
    with the default CPU threads (the long learning runs) leaves one thread and no thread balancer behind."""
    monkeypatch.chdir(tmp_path)
    yield
    common.cpu_threads(1)


@pytest.fixture
def empty_hub(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE set and an empty hub cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes each; run with `python -m pytest -q tests -m slow`")


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run only when asked for (-m slow); the default suite skips them."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
