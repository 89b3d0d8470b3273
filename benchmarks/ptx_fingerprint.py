"""Fingerprint the weight-only kernels (a dev tool): compile 680 specializations of `_wo_mm_kernel` and
`_wo_gemv_kernel` for sm90 with Triton's bundled compiler (no GPU needed) and write a hash of each one's
PTX with the debug information removed (line records, debug sections, line labels, comments). Run it
before and after a refactor: equal hashes mean the GPU runs the same code, so earlier GPU test and
benchmark results carry over.

    PYTHONPATH=src python benchmarks/ptx_fingerprint.py before.json   # about 6 minutes on two cores
"""
import hashlib
import itertools
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import WEIGHT_ONLY_DIVISIBLE, compile_sm90  # noqa: E402

from quantfuse.kernels import weight_only as kw  # noqa: E402


def compile_one(fn, consts, dtypes, num_warps=4, num_stages=3):
    types = {"x_ptr": "*" + dtypes["x"], "w_ptr": "*i32", "s_ptr": "*" + dtypes["s"],
             "z_ptr": "*i32" if consts.get("HAS_ZERO") else "*" + dtypes["s"], "bias_ptr": "*" + dtypes["x"],
             "out_ptr": "*" + dtypes["x"], "part_ptr": "*fp32", "count_ptr": "*i32"}
    ck = compile_sm90(fn, consts, types, num_warps, num_stages, divisible=WEIGHT_ONLY_DIVISIBLE)
    ptx = ck.asm["ptx"].split(".section\t.debug")[0]
    ptx = "\n".join(re.sub(r"//.*", "", line) for line in ptx.splitlines()
                    if not re.match(r"\s*(\.loc|\.file|\$L__tmp\d+:)", line))
    return hashlib.sha1(ptx.encode()).hexdigest()[:16]


out = {}
for bits, gf, zero, scale, conv, bn, x, s in itertools.product((4, 8), (2, 8), (False, True), (0, 1, 2), (0, 1, 2),
                                                              (16, 128), ("bf16", "fp16"), ("fp32", "bf16")):
    if bits == 8 and gf == 8: gf = 4
    c = dict(BITS=bits, GROUP_FIELDS=gf, HAS_ZERO=zero, HAS_BIAS=True, SPLIT=True, FUSED_REDUCE=True, BLOCK_M=16,
             BLOCK_N=bn, CHUNKS=1, CONVERT=conv, SCALE=scale, INTERPRET=False)
    if conv == 2 and not (bits == 4 or x == "fp16"): continue
    if conv == 2 and scale == 0 and s != x: continue
    key = f"mma b{bits} gf{gf} z{int(zero)} S{scale} C{conv} n{bn} {x} {s}"
    out[key] = compile_one(kw._wo_mm_kernel, c, dict(x=x, s=s))
for bits, gf, zero, scale, conv, bm, ch in itertools.product((4, 8), (2, 8), (False, True), (0, 1, 2), (0, 1),
                                                              (1, 3), (1, 2)):
    if bits == 8 and gf == 8: gf = 4
    c = dict(BITS=bits, GROUP_FIELDS=gf, HAS_ZERO=zero, HAS_BIAS=True, SPLIT=True, FUSED_REDUCE=True, BLOCK_M=bm,
             BLOCK_M_P2=4 if bm == 3 else 1, BLOCK_N=64, CHUNKS=ch, CONVERT=conv, SCALE=scale, INTERPRET=False)
    key = f"gemv b{bits} gf{gf} z{int(zero)} S{scale} C{conv} m{bm} c{ch}"
    out[key] = compile_one(kw._wo_gemv_kernel, c, dict(x="bf16", s="fp32"), num_stages=2)
json.dump(out, open(sys.argv[1], "w"), indent=0, sort_keys=True)
print(len(out), "kernels")
