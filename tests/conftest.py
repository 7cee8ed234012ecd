"""Test set-up: Triton kernels run in the interpreter on machines without a GPU.

TRITON_INTERPRET must be set before triton is first imported, hence here, at collection time.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(4, os.cpu_count() or 1))


@pytest.fixture
def one_thread():
    """Run a test on one torch thread (deterministic reductions, no oversubscription on the 2-core CI)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    """A tiny random deepseek_v3 checkpoint with the reference tokenizer beside it (read-only: the CLI tests write
    their outputs elsewhere)."""
    from transformers import AutoTokenizer  # after TRITON_INTERPRET is set

    from quantmla_hf.embedded import REFERENCE_MODEL
    from quantmla_hf.tiny_models import tiny_mla_model

    path = tmp_path_factory.mktemp("base")
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    tiny_mla_model("deepseek_v3", seed=6, vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def pytest_configure(config):
    # Markers of transformers' common model tests (tests/test_transformers_suite.py), registered by transformers' own
    # conftest.py, which the source distribution does not ship.
    for marker in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "torch_compile_test"):
        config.addinivalue_line("markers", f"{marker}: transformers common-test marker")
