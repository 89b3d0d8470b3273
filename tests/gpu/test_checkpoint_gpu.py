"""A compressed-tensors checkpoint written by another tool (llm-compressor style: fp8 static q_proj with a
per-tensor weight scale, W4A16 g64 pack-quantized MLP with bfloat16 scales, sharded) loaded onto the GPU with
`load_compressed_tensors(..., device="cuda")`: the layers run the Triton / Gluon kernels and agree with the same
checkpoint loaded on the CPU (the reference ops)."""

import pytest
import torch

from quantfuse import modules as qm
from quantfuse.checkpoint import load_compressed_tensors
from tests.test_compressed_tensors_load import _foreign_checkpoint
from tests.test_model_api import TinyLlama

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_foreign_checkpoint_on_cuda_matches_cpu(tokens, tmp_path):
    _foreign_checkpoint(tmp_path, shards=2)
    cpu = load_compressed_tensors(tmp_path, TinyLlama())
    gpu = load_compressed_tensors(tmp_path, TinyLlama(), device="cuda")
    assert isinstance(gpu.layers[0].q_proj, qm.Fp8StaticLinear) and gpu.layers[0].q_proj.weight.is_cuda
    assert isinstance(gpu.layers[1].mlp.down_proj, qm.WeightOnlyLinear)
    ids = torch.randint(0, 64, (1, tokens))
    with torch.no_grad():
        want = cpu(ids)
        got = gpu(ids.cuda()).cpu()
    assert torch.isfinite(got).all()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert float(cos) > 0.9999, float(cos)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
