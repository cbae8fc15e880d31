"""Shared test fixtures and the GPU marker policy."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS_DIR = ROOT / "specs"


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly on machines without a CUDA device (CI, the build machine)."""
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 via the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory):
    """SQLAlchemy URL of a throwaway PostgreSQL server on 127.0.0.1, shared by the session
    (about 1 s to start); tests keep apart by using their own study/table names."""
    from .pgserver import postgres_server

    with postgres_server(tmp_path_factory.mktemp("postgres")) as url:
        yield url
