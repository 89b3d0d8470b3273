"""quantfuse: fused quantization kernels (INT8, FP8, INT4) for transformer inference, in Triton.

The ops live in `quantfuse.ops` (and are re-exported here); `quantfuse.reference` is the executable
spec every kernel is tested against.
"""

from . import ops, reference
from .ops import *  # noqa: F401,F403
from .ops import __all__ as _ops_all

__version__ = "0.1.0"
__all__ = ["ops", "reference", "__version__", *_ops_all]
