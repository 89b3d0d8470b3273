"""The Gluon warp-specialized rowwise INT8 / FP8 kernel (kernels/rowwise_wgmma.py) without a GPU: when the
dispatch takes it, that a CPU caller can never reach it, and its sm90 build. Its numerics are tested on the GPU
(tests/gpu/test_scaled_mm_gpu.py: bit for bit against the `tl` kernel for int8); under the interpreter
scaled_mm runs the `tl` twin."""

import re

import pytest
import torch

from quantfuse.kernels import rowwise_wgmma as rw
from quantfuse.kernels import _gluon
from quantfuse.kernels import scaled_mm as kmm
from tests._util import gluon_sm90_build, sm90_sass


def _operands(m=256, k=1024, n=512, dtype=torch.int8):
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8).to(dtype)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8).to(dtype)
    return a, w.t()


def test_never_applies_to_cpu_tensors():
    a, b = _operands()
    assert not rw.applies(a, b)


def test_explicit_config_refused_off_sm90():
    a, b = _operands()
    sa, sb = torch.ones(a.shape[0]), torch.ones(b.shape[1])
    with pytest.raises(ValueError, match="config: a WsConfig needs sm90"):
        kmm.scaled_mm(a, b, sa, sb, torch.bfloat16, None, None, None, config=kmm.WsConfig())


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(kmm, "arch_key", lambda *a: "sm90")
    monkeypatch.setattr(kmm, "sm_count", lambda device: 132)
    monkeypatch.setattr(kmm, "_autotune_enabled", lambda: False)
    return torch.device("cuda")


@pytest.mark.parametrize("m,k,n,takes_ws", [
    # int8 from 1024 rows at any K, where its 128x256 tiles fill one round of 132 SMs (125.4 at WAVE_TOLERANCE):
    # the measured wins of tune_scaled_mm_ws.json and tune_scaled_mm_ws_store.json
    (1024, 14336, 4096, True), (1024, 28672, 8192, True), (4096, 28672, 8192, True), (4096, 14336, 4096, True),
    (1536, 20480, 8192, True), (4096, 8192, 10240, True), (1024, 4096, 28672, True), (1024, 4096, 4096, True),
    (1024, 8192, 10240, True), (2048, 4096, 2048, True),
    # fewer tiles than that, where the last round of the tl tiles is fuller (1024 x 2048: 8 x 8 = 64 tiles, half
    # a round; 1024 x 1024: a quarter), fewer rows
    (1024, 4096, 2048, False), (1024, 4096, 1024, False), (1023, 28672, 8192, False), (16, 28672, 8192, False),
])
def test_dispatch_rule(sm90, m, k, n, takes_ws):
    int8 = kmm._pick_config(kmm.CONFIGS, m, n, k, sm90, None, None, "int8", True, True)
    assert isinstance(int8, kmm.WsConfig) == takes_ws
    # never where the kernel does not apply (no Gluon, not sm90, operands not describable), nor for fp8
    assert isinstance(kmm._pick_config(kmm.CONFIGS, m, n, k, sm90, None, None, "int8", True, False), kmm.MMConfig)
    assert isinstance(kmm._pick_config(kmm.CONFIGS, m, n, k, sm90, None, None, None, True, True), kmm.MMConfig)
    no_tma = kmm._pick_config(kmm.CONFIGS, m, n, k, sm90, None, None, "int8", False, True)
    assert isinstance(no_tma, kmm.MMConfig) and not no_tma.tma


def test_dispatch_keeps_the_old_rows_without_the_kernel(sm90):
    # without the Gluon kernel the long-K buckets fall back to exactly the tiles they had before it
    assert kmm._pick_config(kmm.CONFIGS, 4096, 8192, 28672, sm90, None, None, "int8") == kmm.MMConfig(
        128, 256, 128, 8, 3, tma=True, persistent=1)
    assert kmm._pick_config(kmm.CONFIGS, 1024, 8192, 28672, sm90, None, None, "int8") == kmm.MMConfig(
        128, 128, 128, 4, 3, tma=True, persistent=2)


def _compile_sm90(dtype: str, azp_mode: int, stages: int = 4, block_n: int = 256):
    """The kernel built for sm90 by this Triton, with the integer arguments specialized as the launcher sees them
    at aligned shapes."""
    a, b = _operands(512, 1024, 512, {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[dtype])
    out = torch.empty(512, 512, dtype=torch.bfloat16)
    sa, sb, adj = torch.ones(512), torch.ones(512), torch.zeros(512, dtype=torch.int32)
    args = dict(a_desc=_gluon.operand_descriptor(a, [128, rw.BLOCK_K]),
                b_desc=_gluon.operand_descriptor(b.t(), [block_n, rw.BLOCK_K]),
                out_ptr=out, scale_a_ptr=sa, scale_b_ptr=sb, bias_ptr=out, azp_adj_ptr=adj, azp_ptr=adj)
    consts = dict(SCALE_A_PER_ROW=True, SCALE_B_PER_COL=True, HAS_BIAS=True, AZP_MODE=azp_mode, GROUP_M=8,
                  STAGES=stages, CONSUMER_REGS=rw.WS_CONSUMER_REGS, num_warps=4)
    return gluon_sm90_build(rw._rowwise_ws_kernel, args, consts, lambda _, typ: typ == "i32" or typ.startswith("*"),
                            num_warps=4, maxnreg=rw.WS_MAXNREG)


@pytest.mark.skipif(not rw.GLUON_AVAILABLE or rw._aggregate is None, reason="this Triton has no Gluon aggregates")
@pytest.mark.parametrize("dtype,azp_mode", [("int8", 0), ("int8", 2), ("fp8", 0)])
def test_sm90_build_is_asynchronous_and_does_not_spill(tmp_path, dtype, azp_mode):
    """A guard on the kernel's point: each consumer keeps one K step's pair of wgmma groups in flight (the
    wait leaves 2 outstanding) and its 64x256 accumulator plus the widest epilogue (per-token zero points,
    scale_b, bias) fit the consumer's registers."""
    sass, _ = sm90_sass(tmp_path, "tests.kernels.test_rowwise_wgmma", f"_compile_sm90({dtype!r}, {azp_mode})")
    mma = re.findall(r"\b[IQ]GMMA\.64x128x32[^;]*", sass)
    assert len(mma) == 16, len(mma)  # 2 consumers x 2 halves x 4 K slices of 32
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
    assert "0x2" in waits, waits
    # nothing touches local memory inside the main loops (from the first wgmma to the last), and no more than a
    # few scalars anywhere (Triton 3.9's build of the per-token zero-point epilogue keeps one word on the stack,
    # 3.6's none; a spilled accumulator would be dozens of stores)
    lines = sass.splitlines()
    gmma = [i for i, line in enumerate(lines) if re.search(r"\b[IQ]GMMA\.", line)]
    assert not any(re.search(r"\b(STL|LDL)\b", line) for line in lines[gmma[0]:gmma[-1]]), "local memory in a main loop"
    assert len(re.findall(r"\bSTL\b", sass)) <= 4, "the consumers spill"
