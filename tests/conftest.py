"""Shared test fixtures. Run the suite with `bash run.sh test` (or `.venv/bin/python -m pytest tests`)."""
import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# vLLM's worker processes import weights_sync by name: make the repo importable in every child.
os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def free_port() -> int:
    """A TCP port nothing listens on right now (tests never use fixed ports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init tiny Qwen2 + the char tokenizer, built in seconds."""
    import torch
    torch.set_num_threads(1)
    from scripts.make_tiny_model import random_model_dir
    return random_model_dir(tmp_path_factory.mktemp("tiny-model"), seed=0)
