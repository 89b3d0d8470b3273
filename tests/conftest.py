"""Test set-up: without a GPU, Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is first imported, which is why it happens here, at
collection, before any test module imports quantfuse.kernels.
"""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from quantfuse import ops  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def kernel_device():
    """Device on which the Triton kernels run in this session: cuda, or cpu under the interpreter."""
    return "cuda" if HAS_CUDA and not INTERPRET else "cpu"


@pytest.fixture
def triton_backend():
    """Force the Triton kernels (interpreter on CPU tensors) for the duration of a test."""
    with ops.backend("triton"):
        yield


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh but reproducible random inputs per test: the seed derives from the test id (crc32, not
    # hash(), which Python salts per process).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
