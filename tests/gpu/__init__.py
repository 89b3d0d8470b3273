import pytest
import torch

from quantfuse.kernels._gluon import GLUON_AVAILABLE


def sm90_gluon_marks(kernel: str) -> list:
    """pytestmark of a Gluon kernel's GPU tests: marked gpu, and skipped off sm90 or without Gluon (the kernels
    are sm90a builds)."""
    return [pytest.mark.gpu,
            pytest.mark.skipif(not (torch.cuda.is_available() and GLUON_AVAILABLE
                                    and torch.cuda.get_device_capability() == (9, 0)),
                               reason=f"the Gluon {kernel} needs sm90 and Gluon")]
