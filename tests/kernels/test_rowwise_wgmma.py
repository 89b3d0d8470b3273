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


@pytest.mark.parametrize("m,k,n,int8_ws,fp8_ws", [
    # from 1024 rows at any K, where the cooperative kernel's 128x256 tiles fill one round of 132 SMs (125.4 at
    # WAVE_TOLERANCE): the measured wins of tune_scaled_mm_ws.json, ..._ws_store.json, ..._ws_dispatch_rot.json
    (1024, 14336, 4096, True, True), (1024, 28672, 8192, True, True), (4096, 28672, 8192, True, True),
    (4096, 14336, 4096, True, True), (1536, 20480, 8192, True, True), (4096, 8192, 10240, True, True),
    (1024, 4096, 28672, True, True), (1024, 4096, 4096, True, True), (1024, 8192, 10240, True, True),
    (2048, 4096, 2048, True, True),
    # from 257 rows too (tune_scaled_mm_ws_mid_m.json): fp8 where the cooperative tiles fill a round (1023 x 8192:
    # 8 x 32 = 256 tiles), int8 at any fill (its tl tile trails by up to 1.6x there)
    (1023, 28672, 8192, True, True), (768, 4096, 28672, True, True), (257, 4096, 28672, True, True),
    # fewer cooperative tiles than a round: int8 still, fp8 the tl tiles (1024 x 2048: 8 x 8 = 64 tiles, half a round;
    # 1024 x 1024 a quarter; 384 x 8192: 3 x 32 = 96)
    (1024, 4096, 2048, True, False), (1024, 4096, 1024, True, False), (384, 28672, 8192, True, False),
    (257, 4096, 4096, True, False), (384, 14336, 4096, True, False), (768, 14336, 4096, True, False),
    # decode and batched-decode sizes whose 128-row tiles would be less than WS_MIN_ROW_FILL full: split-K tl tiles
    (230, 4096, 4096, False, False), (192, 28672, 8192, False, False), (115, 4096, 4096, False, False),
    (64, 4096, 4096, False, False), (16, 28672, 8192, False, False),
    # 116..128 and 231..256 rows: the Gluon kernels for both (tune_scaled_mm_ws_small_m.json)
    (116, 4096, 4096, True, True), (128, 14336, 4096, True, True), (231, 8192, 10240, True, True),
    (256, 4096, 28672, True, True),
])
def test_dispatch_rule(sm90, m, k, n, int8_ws, fp8_ws):
    for flavor, takes_ws in (("int8", int8_ws), (None, fp8_ws)):
        picked = kmm._pick_config(kmm.CONFIGS, m, n, k, sm90, None, None, flavor, True, True)
        assert isinstance(picked, kmm.WsConfig) == takes_ws
        # never where the kernel does not apply (no Gluon, not sm90, operands not describable)
        assert isinstance(kmm._pick_config(kmm.CONFIGS, m, n, k, sm90, None, None, flavor, True, False),
                          kmm.MMConfig)
        no_tma = kmm._pick_config(kmm.CONFIGS, m, n, k, sm90, None, None, flavor, False, True)
        assert isinstance(no_tma, kmm.MMConfig) and not no_tma.tma


def test_fp8_below_a_round_takes_the_tl_tiles(sm90):
    # 1024 x 3072: 96 cooperative tiles fill a round as (un)evenly as the tl 128x128 tiles (0.73 each); the wave rule
    # sees the tl tiles only (the tl tile led in 7 of 9 such ties measured: 1024x2048x3072 15.9 us vs 16.3)
    assert isinstance(kmm._pick_config(kmm.CONFIGS, 1024, 3072, 2048, sm90, None, None, None, True, True),
                      kmm.MMConfig)
    # the same tie at 2048 rows (2048 x 1536: 96 cooperative tiles, 192 tl tiles)
    assert isinstance(kmm._pick_config(kmm.CONFIGS, 2048, 1536, 4096, sm90, None, None, None, True, True),
                      kmm.MMConfig)
    # 1024 x 2048: 64 cooperative tiles (0.48) against 128 tl tiles (0.97)
    assert isinstance(kmm._pick_config(kmm.CONFIGS, 1024, 2048, 2048, sm90, None, None, None, True, True),
                      kmm.MMConfig)


def test_every_bucket_has_a_tl_tile():
    # the fallback where the Gluon kernel does not apply (and the wave rule's candidates) must exist in every bucket
    for rows in kmm.CONFIGS.values():
        for entry in rows:
            assert any(isinstance(c, kmm.MMConfig) for c in entry[-1]), entry


@pytest.mark.parametrize("m,k,n,pingpong", [
    # up to K = 4096 (tune_scaled_mm_ws_dispatch_rot.json, ..._small_rot.json: 0.99-1.31x the faster of the
    # cooperative kernel and the tl tiles where it runs)
    (1024, 4096, 4096, True), (1024, 4096, 28672, True), (2048, 4096, 6144, True), (4096, 4096, 4096, True),
    (4096, 4096, 28672, True), (4096, 2048, 16384, True), (4096, 3072, 3072, True),
    # beyond, where its busiest program has at most 0.9 of the cooperative one's 128x128 tile-times (1.10-1.22x
    # there): 1024x10240: 640 tiles -> 5 per program vs 320 -> 3 x 2; 2048x3072: 768 -> 6 vs 384 -> 3 x 2
    (1024, 8192, 10240, True), (2048, 8192, 3072, True),
    # equal or barely fewer beyond K = 4096: the cooperative kernel, ahead there by up to 13%
    (1024, 14336, 4096, False), (1024, 28672, 8192, False), (4096, 28672, 8192, False), (8192, 8192, 8192, False),
    (4096, 8192, 10240, False), (2048, 8192, 2048, False),
])
def test_pingpong_rule(sm90, m, k, n, pingpong):
    for flavor in ("int8", None):
        picked = kmm._pick_config(kmm.CONFIGS, m, n, k, sm90, None, None, flavor, True, True)
        assert (isinstance(picked, kmm.WsConfig) and picked.pingpong) == pingpong
        if pingpong:
            assert picked == kmm.WsConfig(128, 128, 5, 8, pingpong=True)


@pytest.mark.parametrize("m,k,n,pingpong", [
    # batched decode, both dtypes (tune_scaled_mm_ws_small_m.json): ping-pong where its busiest program has fewer
    # tile-times (256x4096x4096: 64 tiles, one each, vs 32 x 2: 15.3 us vs cooperative 25.0, tl 21.0) or as many up to
    # K = 4096 (256x4096x28672 63.0 vs 65.3 / 81.6), else cooperative (256x8192x10240: 160 tiles -> 2 per program vs
    # 80 -> 1 x 2; 51.3 vs 57.9 / 63.0)
    (256, 4096, 4096, True), (256, 4096, 28672, True), (128, 28672, 8192, True), (256, 8192, 10240, False),
])
def test_batched_decode_rule(sm90, m, k, n, pingpong):
    for flavor in ("int8", None):
        picked = kmm._pick_config(kmm.CONFIGS, m, n, k, sm90, None, None, flavor, True, True)
        assert isinstance(picked, kmm.WsConfig) and picked.pingpong == pingpong


@pytest.mark.parametrize("m,k,n,pingpong", [
    # int8 below a round of cooperative tiles, the same rule (tune_scaled_mm_ws_mid_m.json, 5 rotated rounds):
    # ping-pong up to K = 4096 (384x4096x4096 15.6 us vs cooperative 25.0 / tl 22.6) and where its busiest program
    # has fewer tile-times (384x14336x4096: 96 tiles, one each, vs 48 x 2: 44.5 vs 71.2 / 71.2; 768x28672x8192 252
    # vs 292 / 312; 1024x8192x2048 26.0 vs 43.1 / 41.4), else cooperative (384x28672x8192 150 vs 169 / 166)
    (384, 4096, 4096, True), (512, 14336, 4096, True), (512, 8192, 10240, True), (768, 28672, 8192, True),
    (1024, 8192, 2048, True), (257, 4096, 28672, True),
    (384, 28672, 8192, False), (512, 28672, 8192, False), (768, 14336, 4096, False), (768, 8192, 10240, False),
])
def test_int8_pingpong_rule_below_a_round(sm90, m, k, n, pingpong):
    picked = kmm._pick_config(kmm.CONFIGS, m, n, k, sm90, None, None, "int8", True, True)
    assert isinstance(picked, kmm.WsConfig) and picked.pingpong == pingpong


def test_row_split_counts_pingpong_rounds():
    # a round of the ping-pong kernel is two 128x128 tiles per program: at N = 6144 (48 column tiles) 5 x 128
    # rows, as for the cooperative kernel's 128x256 tiles one per program (24 column tiles); its part-filled extra
    # round costs one 128x128 tile per program, half the cooperative kernel's, so a 16-row tail is split off at
    # K = 4096 for the cooperative kernel only, at K = 65536 for both
    coop, pp = kmm.WsConfig(), kmm.WsConfig(128, 128, 5, 8, pingpong=True)
    for m in (640 + 16, 1280 + 16, 3 * 640 + 16):
        main = m - 16
        assert kmm.row_split(m, 6144, 65536, 1, pp, 132, "sm90") == main
        assert kmm.row_split(m, 6144, 65536, 1, coop, 132, "sm90") == main
        assert kmm.row_split(m, 6144, 4096, 1, coop, 132, "sm90") == main
        assert kmm.row_split(m, 6144, 4096, 1, pp, 132, "sm90") == 0


def test_dispatch_keeps_the_old_rows_without_the_kernel(sm90):
    # without the Gluon kernel the long-K buckets fall back to exactly the tiles they had before it
    assert kmm._pick_config(kmm.CONFIGS, 4096, 8192, 28672, sm90, None, None, "int8") == kmm.MMConfig(
        128, 256, 128, 8, 3, tma=True, persistent=1)
    assert kmm._pick_config(kmm.CONFIGS, 1024, 8192, 28672, sm90, None, None, "int8") == kmm.MMConfig(
        128, 128, 128, 4, 3, tma=True, persistent=2)


def _compile_sm90(dtype: str, azp_mode: int, stages: int = 4, block_n: int = 256, pingpong: bool = False):
    """The kernel built for sm90 by this Triton, with the integer arguments specialized as the launcher sees them
    at aligned shapes."""
    a, b = _operands(512, 1024, 512, {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[dtype])
    out = torch.empty(512, 512, dtype=torch.bfloat16)
    sa, sb, adj = torch.ones(512), torch.ones(512), torch.zeros(512, dtype=torch.int32)
    args = dict(a_desc=_gluon.operand_descriptor(a, [128, rw.BLOCK_K]),
                b_desc=_gluon.operand_descriptor(b.t(), [block_n, rw.BLOCK_K]),
                out_ptr=out, scale_a_ptr=sa, scale_b_ptr=sb, bias_ptr=out, azp_adj_ptr=adj, azp_ptr=adj)
    consts = dict(SCALE_A_PER_ROW=True, SCALE_B_PER_COL=True, HAS_BIAS=True, AZP_MODE=azp_mode, GROUP_M=8,
                  STAGES=stages, CONSUMER_REGS=rw.WS_CONSUMER_REGS, num_warps=4, PINGPONG=pingpong)
    return gluon_sm90_build(rw._rowwise_ws_kernel, args, consts, lambda _, typ: typ == "i32" or typ.startswith("*"),
                            num_warps=4, maxnreg=rw.WS_MAXNREG)


@pytest.mark.skipif(not rw.GLUON_AVAILABLE or rw._aggregate is None, reason="this Triton has no Gluon aggregates")
@pytest.mark.parametrize("dtype,azp_mode,pingpong", [("int8", 0, False), ("int8", 2, False), ("fp8", 0, False),
                                                     ("int8", 2, True), ("fp8", 0, True)])
def test_sm90_build_is_asynchronous_and_does_not_spill(tmp_path, dtype, azp_mode, pingpong):
    """A guard on the kernel's point: each consumer keeps one K step's pair of wgmma groups in flight (the
    wait leaves 2 outstanding) and its 64x256 accumulator (ping-pong: 128x128) plus the widest epilogue
    (per-token zero points, scale_b, bias) fit the consumer's registers."""
    block_n = 128 if pingpong else 256
    sass, _ = sm90_sass(tmp_path, "tests.kernels.test_rowwise_wgmma",
                        f"_compile_sm90({dtype!r}, {azp_mode}, block_n={block_n}, pingpong={pingpong})")
    mma = re.findall(r"\b[IQ]GMMA\.64x128x32[^;]*", sass)
    assert len(mma) == 16, len(mma)  # 2 consumers x 2 halves (ping-pong: 64-row halves) x 4 K slices of 32
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
    assert "0x2" in waits, waits
    # nothing touches local memory inside the main loops (each loop whose body issues wgmma: one per consumer), and
    # no more than a few scalars anywhere (Triton 3.9's builds of the per-token zero-point epilogue store one word
    # on the stack, six in the ping-pong kernel, all outside the loops; 3.6's none; a spilled accumulator would be
    # dozens of stores)
    lines = sass.splitlines()
    loops = _wgmma_loops(lines)
    assert len(loops) == 2, loops
    for start, end in loops:
        body = lines[start:end + 1]
        assert not any(re.search(r"\b(STL|LDL)\b", line) for line in body), "local memory in a main loop"
    assert len(re.findall(r"\bSTL\b", sass)) <= 8, "the consumers spill"


def _wgmma_loops(lines):
    """(first, last) SASS line of each innermost loop whose body issues a wgmma (a backward branch and its target,
    holding no other such loop): the consumers' K loops. A branch back from an out-of-line block (an mbarrier
    wait's retry, placed after the function's body) into the middle of a loop is not a loop of its own."""
    at = {}
    for i, line in enumerate(lines):
        found = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if found:
            at[int(found.group(1), 16)] = i
    loops = []
    for i, line in enumerate(lines):
        branch = re.search(r"\bBRA (0x[0-9a-f]+)", line)
        target = at.get(int(branch.group(1), 16)) if branch else None
        if target is not None and target < i and any(re.search(r"\b[IQ]GMMA\.", t) for t in lines[target:i]):
            loops.append((target, i))
    loops = [loop for loop in loops if not any(o[0] < loop[0] <= o[1] < loop[1] for o in loops)]
    return [inner for inner in loops
            if not any(other != inner and inner[0] <= other[0] and other[1] <= inner[1] for other in loops)]
