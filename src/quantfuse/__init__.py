"""quantfuse: fused quantization kernels (INT8, FP8, INT4) for transformer inference, in Triton.

The ops live in `quantfuse.ops` (and are re-exported here); `quantfuse.reference` is the executable
spec every kernel is tested against.
"""

from . import ops, reference
from .ops import *  # noqa: F401,F403
from .ops import __all__ as _ops_all

__version__ = "0.1.0"
__all__ = ["ops", "reference", "__version__", *_ops_all]

# Model-level API (quantize_, configs, checkpoints): see quantfuse.quantize_api.
from .quantize_api import (  # noqa: E402
    Fp8BlockConfig,
    Fp8DynamicConfig,
    Fp8StaticConfig,
    Int4WeightOnlyConfig,
    Int8DynamicConfig,
    Int8StaticConfig,
    Int8WeightOnlyConfig,
    load_compressed_tensors,
    load_quantized,
    quantize_,
    save_quantized,
)

__all__ += ["quantize_", "save_quantized", "load_quantized", "load_compressed_tensors", "Int8DynamicConfig",
            "Int8StaticConfig", "Fp8DynamicConfig", "Fp8StaticConfig", "Fp8BlockConfig", "Int4WeightOnlyConfig",
            "Int8WeightOnlyConfig"]
