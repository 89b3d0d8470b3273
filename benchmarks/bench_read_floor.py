"""How fast can the weight be *read* at all? The streaming floor of the decode-sized (M <= 16) lines of issues 3 and 5.

At M <= 16 a weight-only or fp8 GEMM must read its whole weight (plus scales) from HBM once; nothing it does can
finish sooner than the fastest kernel that only reads those bytes. This script times, in one run on the device:

* the peer each line names and the target time it implies: W4A16 g128 (float32 scales) >= 3.0x bf16 `F.linear`
  and >= 1.5x tinygemm (`_weight_int4pack_mm`, in its own format) at M = 1 and 16, W8A16 per channel >= 1.8x bf16
  at M = 1 and 16 (issue 5), FP8 rowwise + bias >= 1.25x `torch._scaled_mm` at M = 1 and 16 (issue 3);
* our shipped op on the same shape (`weight_only_mm`, `scaled_mm`);
* the read floor: the best of a sweep of read-only kernels over one contiguous buffer of exactly the bytes the GEMM
  must read (packed codes + scales; the activations are a rounding error), each program summing a contiguous
  slice with 16-byte loads and writing one word (programs per SM x block x warps x cache hint), and torch's own
  `sum`. A real GEMM also reads x, multiplies, reduces split-K partials and writes the output, so the floor is a
  lower bound on its time as measured here.

Same timing as every bench: CUDA graphs replaying a rotation of buffers that exceeds L2 several times
(`common.time_ms`), `do_bench` medians. feasible = floor_us <= target_us: where it is False the line asks for a
kernel that reads the weight faster than any read-only kernel measured here.

`python benchmarks/bench_read_floor.py --dry-run` runs the read kernel under the Triton interpreter on a small
buffer and checks its sum (no GPU, no timing).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

BF16 = torch.bfloat16
LLAMA_KN = [(4096, 6144), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192)]
FP8_KN = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192)]
TARGETS = {"W4A16 g128": 3.0, "W4A16 g128 vs tinygemm": 1.5, "W8A16 per-channel": 1.8, "FP8 rowwise": 1.25}
COLUMNS = ["line", "K", "N", "M", "bytes", "peer", "peer_us", "target_x", "target_us", "ours_us", "ours_x",
           "floor_us", "floor_cfg", "floor_GBs", "floor_frac_copy", "ours_vs_floor", "floor_vs_target", "feasible",
           "min_bytes", "min_floor_us", "min_feasible"]


@triton.jit
def _read_kernel(src, out, n_words, words_per_prog, BLOCK: tl.constexpr, CG: tl.constexpr,
                 EVICT_FIRST: tl.constexpr = False):
    """Sum (wrapping int32) of this program's contiguous slice of src, one word out: reads only. EVICT_FIRST marks
    the lines first out of L2 (the stream is read once)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * words_per_prog
    stop = tl.minimum(start + words_per_prog, n_words)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for base in range(start, stop, BLOCK):
        idx = base + offs
        if CG:
            v = tl.load(src + idx, mask=idx < stop, other=0, cache_modifier=".cg")
        elif EVICT_FIRST:
            v = tl.load(src + idx, mask=idx < stop, other=0, eviction_policy="evict_first")
        else:
            v = tl.load(src + idx, mask=idx < stop, other=0)
        acc += v
    tl.store(out + pid, tl.sum(acc, 0))


@triton.jit
def _read_tma_kernel(desc, out, n_rows, rows_per_prog, BR: tl.constexpr, W: tl.constexpr, STAGES: tl.constexpr):
    """The same sum with the slice brought in [BR, W] boxes by the copy engine (rows past the end read as 0)."""
    pid = tl.program_id(0)
    start = pid * rows_per_prog
    stop = tl.minimum(start + rows_per_prog, n_rows)
    acc = tl.zeros([BR, W], dtype=tl.int32)
    for r in tl.range(start, stop, BR, num_stages=STAGES):
        acc += desc.load([r, 0])
    tl.store(out + pid, tl.sum(tl.sum(acc, 1), 0))


TMA_ROW = 256  # int32 words per descriptor row (the copy engine's box is at most 256 elements a side)


def read_sum_tma(buf2d: torch.Tensor, out: torch.Tensor, programs: int, box_rows: int, warps: int,
                 stages: int) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = buf2d.shape[0]
    per = -(-rows // programs)
    per = -(-per // box_rows) * box_rows
    desc = TensorDescriptor.from_tensor(buf2d, [box_rows, TMA_ROW])
    _read_tma_kernel[(-(-rows // per),)](desc, out, rows, per, BR=box_rows, W=TMA_ROW, STAGES=stages,
                                         num_warps=warps)


def read_sum(buf: torch.Tensor, out: torch.Tensor, programs: int, block: int, warps: int, cg: bool,
             evict_first: bool = False) -> None:
    n = buf.numel()
    per = -(-n // programs)
    per = -(-per // block) * block  # whole blocks per program: aligned 16-byte vectors
    grid = -(-n // per)
    _read_kernel[(grid,)](buf, out, n, per, BLOCK=block, CG=cg, EVICT_FIRST=evict_first, num_warps=warps)


def floor_configs(sms: int):
    for pps in (4, 8, 16, 32, 64):
        for block in (2048, 8192, 16384):
            for warps in (4, 8):
                for cg in (False, True):
                    yield f"read p{pps} b{block} w{warps}{' cg' if cg else ''}", dict(
                        kind="ptr", programs=pps * sms, block=block, warps=warps, cg=cg)
    # stop 58: the evict-first hint (the floor on most sizes since)
    for pps in (16, 64):
        for block in (2048, 16384):
            yield f"read p{pps} b{block} w8 ef", dict(kind="ptr", programs=pps * sms, block=block, warps=8,
                                                      cg=False, evict_first=True)
    for pps in (4, 8, 16, 32):
        for box_rows in (16, 32):
            for stages in (3, 4):
                yield f"tma p{pps} r{box_rows} s{stages}", dict(kind="tma", programs=pps * sms, box_rows=box_rows,
                                                               warps=4, stages=stages)


def _launch(cfg, buf, buf2d, out):
    if cfg["kind"] == "tma":
        read_sum_tma(buf2d, out, cfg["programs"], cfg["box_rows"], cfg["warps"], cfg["stages"])
    else:
        read_sum(buf, out, cfg["programs"], cfg["block"], cfg["warps"], cfg["cg"], cfg.get("evict_first", False))


def time_floor(nbytes: int, sms: int):
    """(best us, its label) over the read kernels and torch.sum, one buffer set for all."""
    words = -(-nbytes // 4)
    # whole descriptor rows: the last one padded (under 1 KB more than the GEMM reads)
    padded = -(-words // TMA_ROW) * TMA_ROW
    bufs = [torch.randint(-2**31, 2**31 - 1, (padded,), dtype=torch.int32, device="cuda")
            for _ in range(common.rotation_count(nbytes))]
    sets = [(b[:words], b.view(-1, TMA_ROW)) for b in bufs]
    out = torch.empty(64 * sms + 64, dtype=torch.int32, device="cuda")
    best = (float("inf"), "")
    for label, cfg in floor_configs(sms):
        us = common.graph_us(lambda b, b2d, c=cfg: _launch(c, b, b2d, out), sets)
        best = min(best, (us, label))
    fbufs = [b[:words].view(torch.float32) for b in bufs]
    us = common.graph_us(lambda b: b.sum(), [(b,) for b in fbufs])
    best = min(best, (us, "torch.sum"))
    del bufs, fbufs, sets
    torch.cuda.empty_cache()
    return best


def _row(line, k, n, m, nbytes, peer, peer_us, ours_us, floor, copy_gbs, min_floor=None):
    """min_floor: (bytes, floor) of the smallest format the line's GEMM could read (W4A16: the 4-bit codes and
    bfloat16 group scales, where ours keeps float32 scales)."""
    target_x = TARGETS[line]
    target_us = peer_us / target_x
    floor_us, floor_cfg = floor
    row = {"line": line, "K": k, "N": n, "M": m, "bytes": nbytes, "peer": peer, "peer_us": round(peer_us, 2),
           "target_x": target_x, "target_us": round(target_us, 2), "ours_us": round(ours_us, 2),
           "ours_x": round(peer_us / ours_us, 3), "floor_us": round(floor_us, 2), "floor_cfg": floor_cfg,
           "floor_GBs": round(nbytes / floor_us / 1e3, 1),
           "floor_frac_copy": round(nbytes / floor_us / 1e3 / copy_gbs, 3),
           "ours_vs_floor": round(ours_us / floor_us, 3), "floor_vs_target": round(floor_us / target_us, 3),
           "feasible": floor_us <= target_us}
    if min_floor is not None:
        row.update(min_bytes=min_floor[0], min_floor_us=round(min_floor[1][0], 2),
                   min_feasible=min_floor[1][0] <= target_us)
    return row


def weight_only_rows(bits, rows, sms, copy_gbs):
    import torch.nn.functional as F

    import quantfuse as qf
    from bench_weight_only import clone_qw, qw_bytes, tinygemm, tinygemm_pack

    group = 128 if bits == 4 else -1
    line = "W4A16 g128" if bits == 4 else "W8A16 per-channel"
    for k, n in LLAMA_KN:
        qw = qf.quantize_weight(torch.randn(n, k, device="cuda"), bits=bits, group_size=group, symmetric=True,
                                scale_dtype=torch.float32)
        w_hat = qw.dequantize(BF16)
        nbytes = qw_bytes(qw)
        qw_sets = [qw] + [clone_qw(qw) for _ in range(common.rotation_count(nbytes) - 1)]
        lin_sets = [w_hat] + [w_hat.clone() for _ in range(common.rotation_count(w_hat.numel() * 2) - 1)]
        floor = time_floor(nbytes, sms)
        tg_sets, min_floor = [], None
        if bits == 4:
            # tinygemm's own format (int4 codes, bf16 scales and zeros), rotated like ours; and the floor of the
            # leanest format a g128 int4 GEMM could read: the codes plus bfloat16 scales
            wp, sz = tinygemm_pack(qw)
            tg_sets = [(wp, sz)] + [(wp.clone(), sz.clone()) for _ in range(common.rotation_count(nbytes) - 1)]
            min_bytes = n * k // 2 + -(-k // 128) * n * 2
            min_floor = (min_bytes, time_floor(min_bytes, sms))
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda").to(BF16)
            peer_us = common.graph_us(lambda w: F.linear(x, w), [(w,) for w in lin_sets])
            ours_us = common.graph_us(lambda q: qf.weight_only_mm(x, q), [(q,) for q in qw_sets])
            rows.append(_row(line, k, n, m, nbytes, "bf16 F.linear", peer_us, ours_us, floor, copy_gbs, min_floor))
            common.print_row(rows[-1])
            if tg_sets:
                tg_us = common.graph_us(lambda w, s: tinygemm(x, w, s), tg_sets)
                rows.append(_row("W4A16 g128 vs tinygemm", k, n, m, nbytes, "tinygemm _weight_int4pack_mm", tg_us,
                                 ours_us, floor, copy_gbs, min_floor))
                common.print_row(rows[-1])
        del qw, w_hat, qw_sets, lin_sets, tg_sets
        torch.cuda.empty_cache()


def fp8_rows(rows, sms, copy_gbs):
    import quantfuse as qf

    fp8 = torch.float8_e4m3fn
    for k, n in FP8_KN:
        nbytes = n * k
        sets = []
        for _ in range(common.rotation_count(nbytes)):
            w = (torch.randn(n, k, device="cuda") * 60).to(fp8)
            sets.append((w.t(), torch.rand(n, device="cuda") * 1e-3 + 1e-4, torch.randn(n, device="cuda").to(BF16)))
        floor = time_floor(nbytes, sms)
        for m in (1, 16):
            a = (torch.randn(m, k, device="cuda") * 60).to(fp8)
            sa = torch.rand(m, 1, device="cuda") * 1e-3 + 1e-4
            peer_us = common.graph_us(
                lambda b, sb, bias: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb.view(1, -1), bias=bias,
                                                     out_dtype=BF16), sets)
            ours_us = common.graph_us(lambda b, sb, bias: qf.scaled_mm(a, b, sa, sb, BF16, bias), sets)
            rows.append(_row("FP8 rowwise", k, n, m, nbytes, "torch._scaled_mm rowwise + bias", peer_us, ours_us,
                             floor, copy_gbs))
            common.print_row(rows[-1])
        del sets
        torch.cuda.empty_cache()


def dry_run() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    buf = torch.randint(-1000, 1000, (5000,), dtype=torch.int32)
    out = torch.zeros(8, dtype=torch.int32)
    for programs, block, evict_first in ((3, 256, False), (7, 512, False), (5, 128, True)):
        out.zero_()
        read_sum(buf, out, programs, block, 4, False, evict_first)
        assert int(out.sum()) == int(buf.sum()), (programs, block, evict_first, int(out.sum()), int(buf.sum()))
    buf2d = torch.zeros(-(-buf.numel() // TMA_ROW) * TMA_ROW, dtype=torch.int32)
    buf2d[: buf.numel()] = buf
    for programs, box_rows in ((3, 16), (2, 32)):
        out.zero_()
        read_sum_tma(buf2d.view(-1, TMA_ROW), out, programs, box_rows, 4, 3)
        assert int(out.sum()) == int(buf.sum()), (int(out.sum()), int(buf.sum()))
    print("dry run ok: both read kernels sum every word once")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        dry_run()
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbs = common.copy_bandwidth_gbs()
    rows = []
    weight_only_rows(4, rows, sms, copy_gbs)
    weight_only_rows(8, rows, sms, copy_gbs)
    fp8_rows(rows, sms, copy_gbs)
    infeasible = [f"{r['line']} {r['K']}x{r['N']} M={r['M']}" for r in rows if not r["feasible"]]
    min_infeasible = [f"{r['line']} {r['K']}x{r['N']} M={r['M']}" for r in rows if r.get("min_feasible") is False]
    notes = (f"copy bandwidth {copy_gbs:.0f} GB/s (read + write) in this run. feasible = floor_us <= target_us "
             f"(target_us = peer_us / target_x). Lines whose target is under the read floor of our bytes: "
             f"{', '.join(infeasible) if infeasible else 'none'}. min_floor_us: the floor of the leanest W4A16 g128 "
             f"format (4-bit codes + bfloat16 scales, min_bytes); lines under even that floor (min_feasible False): "
             f"{', '.join(min_infeasible) if min_infeasible else 'none'}.")
    common.finish("read_floor", "Decode lines vs the weight-read floor (H100)", rows, COLUMNS, notes)


if __name__ == "__main__":
    main()
