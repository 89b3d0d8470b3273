"""Dump and count the SASS of the weight-only kernels (kernels/weight_only.py) on the GPU.

Runs quantfuse.weight_only_mm once for one shape (W4A16 group 128 symmetric, bf16, K=4096, N=6144) at
M=1 (decode: split-K tile + reduction kernel) and M=64 (tiled), plus QuantizedWeight.dequantize (the
converter alone), then for every kernel compiled by those calls: gets the SASS (Triton's
compiled-kernel .asm['sass'], else cuobjdump -sass on .asm['cubin'], else the cubin files in the Triton
cache directory) and counts instructions by opcode, for the whole kernel and for its largest loop (the
K loop: the body of the longest backward branch). The converter of SPEC section 4 should show up as
SHF/LOP3 + FADD (magic-number bias) + FMUL (scale) + F2FP (pack to bf16) with no I2F.

Writes <results_dir>/weight_only_sass.json (counts) and weight_only_sass.txt (the SASS), results_dir
being $OUT on the device machine. Run: PYTHONPATH=$PWD/src:$PWD python benchmarks/sass_weight_only.py
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback

# A private Triton cache, so that this run compiles (and leaves cubins we can find as a fallback).
_CACHE_DIR = tempfile.mkdtemp(prefix="qf_sass_triton_cache_")
os.environ.setdefault("TRITON_CACHE_DIR", _CACHE_DIR)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import quantfuse as qf  # noqa: E402
from quantfuse.kernels import weight_only as kw  # noqa: E402

K, N = 4096, 6144
WATCH = ["LOP3", "PRMT", "SHF", "IADD3", "IMAD", "I2F", "I2FP", "F2F", "F2FP", "F2I", "FADD", "FMUL", "FFMA",
         "HADD2", "HSUB2", "HMUL2", "HFMA2", "HMMA", "HGMMA", "LDG", "LDGSTS", "LDS", "LDSM", "STS", "STG",
         "BAR", "BRA", "SYNCS", "UTMALDG"]
_ADDR = re.compile(r"^/\*([0-9a-fA-F]{4,})\*/\s*")
_CTRL = re.compile(r"^[-\d]{2}:[-\d]:[-\d]:[-Y]:[0-9a-fA-F]\s+")
_LABEL = re.compile(r"^(LBB\d+|\.L\w+):\s*$")
_PRED = re.compile(r"^@!?U?P[T\d]+\s+")
_OPCODE = re.compile(r"^([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")
_BRA_TARGET = re.compile(r"\b(?:BRA|BRX)(?:\.[A-Z]+)*\s+(?:`?\(?\.?)?(LBB\d+|\.L\w+|0x[0-9a-fA-F]+)")


def parse_sass(text: str):
    """[(opcode, full opcode, operand text)] plus loops [(start index, end index)] from either Triton's
    processed SASS ('ctrl<TAB>OPC ...;' with LBBn: labels) or raw cuobjdump output ('/*0040*/ OPC ...;')."""
    instrs, labels, addr_index, branches = [], {}, {}, []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("Function", ".", "//", "code for", "Fatbin", "=")):
            continue
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        a = _ADDR.match(line)
        if a:
            addr_index[int(a.group(1), 16)] = len(instrs)
            line = line[a.end():]
        elif line.startswith("/*"):  # encoding-only line of raw cuobjdump output
            continue
        line = _CTRL.sub("", line)
        line = line.split("/*")[0].strip().rstrip(";").strip()
        line = _PRED.sub("", line)
        op = _OPCODE.match(line)
        if not op:
            continue
        instrs.append((op.group(1), op.group(1) + op.group(2), line))
        b = _BRA_TARGET.search(line)
        if b and op.group(1) in ("BRA", "BRX"):
            branches.append((len(instrs) - 1, b.group(1)))
    loops = []
    for at, target in branches:
        if target.startswith("0x"):
            start = addr_index.get(int(target, 16))
        else:
            start = labels.get(target)
        if start is not None and start <= at:
            loops.append((start, at))
    return instrs, loops


def count(instrs, lo=0, hi=None):
    sel = instrs[lo : (len(instrs) if hi is None else hi + 1)]
    base = collections.Counter(i[0] for i in sel)
    full = collections.Counter(i[1] for i in sel)
    return base, full


def summarize(text: str):
    instrs, loops = parse_sass(text)
    base, full = count(instrs)
    out = {
        "instructions": len(instrs),
        "watched": {k: base.get(k, 0) for k in WATCH},
        "by_opcode": dict(base.most_common()),
        "by_full_opcode": dict(full.most_common(60)),
        "loops": len(loops),
    }
    if loops:
        lo, hi = max(loops, key=lambda r: r[1] - r[0])
        lbase, lfull = count(instrs, lo, hi)
        out["main_loop"] = {
            "instructions": hi - lo + 1,
            "watched": {k: lbase.get(k, 0) for k in WATCH},
            "by_opcode": dict(lbase.most_common()),
            "by_full_opcode": dict(lfull.most_common(40)),
        }
    return out


def sass_of(kernel) -> str:
    errors = []
    asm = getattr(kernel, "asm", None)
    if asm is not None:
        try:
            text = asm["sass"]
            if text:
                return text
        except Exception as e:  # noqa: BLE001
            errors.append(f"asm['sass']: {type(e).__name__}: {e}")
        try:
            return cuobjdump(asm["cubin"])
        except Exception as e:  # noqa: BLE001
            errors.append(f"cuobjdump(asm['cubin']): {type(e).__name__}: {e}")
    raise RuntimeError("; ".join(errors) or "no .asm on the compiled kernel")


def cuobjdump(cubin: bytes) -> str:
    exe = shutil.which("cuobjdump")
    if exe is None:
        try:
            from triton import knobs

            exe = knobs.nvidia.cuobjdump.path
        except Exception:  # noqa: BLE001
            exe = None
    if exe is None:
        raise RuntimeError("cuobjdump not found")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.check_output([exe, "-sass", path], text=True)
    finally:
        os.remove(path)


def compiled_kernels(jit_fn):
    """{key: CompiledKernel} of a JITFunction across Triton versions (device_caches in 3.x, cache before)."""
    found = {}
    dicts = []
    dc = getattr(jit_fn, "device_caches", None)
    if dc is not None:
        for entry in list(dc.values()):
            parts = entry if isinstance(entry, (tuple, list)) else (entry,)
            dicts.extend(p for p in parts if isinstance(p, dict))
    cache = getattr(jit_fn, "cache", None)
    if isinstance(cache, dict):
        for v in cache.values():
            if isinstance(v, dict):
                dicts.append(v)
    seen = set()
    for d in dicts:
        for key, v in list(d.items()):
            if hasattr(v, "asm") and id(v) not in seen:
                seen.add(id(v))
                found[str(key)[:400]] = v
    return found


def kernel_meta(kernel):
    meta = {}
    for attr in ("n_regs", "n_spills", "n_max_threads"):
        v = getattr(kernel, attr, None)
        if v is not None:
            meta[attr] = v
    md = getattr(kernel, "metadata", None)
    for attr in ("num_warps", "num_stages", "shared", "name"):
        v = getattr(md, attr, None) if md is not None else None
        if v is not None:
            meta[attr] = v if isinstance(v, (int, str)) else str(v)
    return meta


def main():
    results = {"shape": {"K": K, "N": N, "bits": 4, "group_size": 128, "symmetric": True, "dtype": "bfloat16"},
               "env": common.env_info(), "kernels": [], "errors": []}
    texts = []
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return
    torch.manual_seed(0)
    qw = qf.quantize_weight(torch.randn(N, K, device="cuda"), bits=4, group_size=128, symmetric=True)
    fns = [("_wo_mm_kernel", kw._wo_mm_kernel), ("_splitk_reduce_kernel", kw._splitk_reduce_kernel),
           ("_dequant_kernel", kw._dequant_kernel)]
    runs = [
        ("M=1 decode (split-K)", lambda: qf.weight_only_mm(torch.randn(1, K, device="cuda").bfloat16(), qw)),
        ("M=64 tiled", lambda: qf.weight_only_mm(torch.randn(64, K, device="cuda").bfloat16(), qw)),
        ("dequantize bf16", lambda: qw.dequantize(torch.bfloat16)),
    ]
    have = {name: set() for name, _ in fns}
    for label, run in runs:
        try:
            run()
            torch.cuda.synchronize()
            print(f"ran {label}")
        except Exception as e:  # noqa: BLE001
            msg = f"{label}: {type(e).__name__}: {e}"
            print("FAILED", msg)
            traceback.print_exc()
            results["errors"].append(msg)
            continue
        for name, fn in fns:
            try:
                kernels = compiled_kernels(fn)
            except Exception as e:  # noqa: BLE001
                results["errors"].append(f"cache of {name}: {type(e).__name__}: {e}")
                continue
            for key, kernel in kernels.items():
                if key in have[name]:
                    continue
                have[name].add(key)
                entry = {"kernel": name, "compiled_by": label, "key": key, "meta": {}}
                try:
                    entry["meta"] = kernel_meta(kernel)
                except Exception as e:  # noqa: BLE001
                    entry["meta_error"] = str(e)
                try:
                    text = sass_of(kernel)
                    entry.update(summarize(text))
                    texts.append(f"==== {name} ({label})\n{text}")
                except Exception as e:  # noqa: BLE001
                    entry["error"] = f"{type(e).__name__}: {e}"
                    print(f"FAILED sass of {name} ({label}): {entry['error']}")
                results["kernels"].append(entry)

    if not any("instructions" in k for k in results["kernels"]):
        # Fallback: the cubins Triton wrote to its cache directory.
        cache_dir = os.environ.get("TRITON_CACHE_DIR", _CACHE_DIR)
        cubins = sorted(glob.glob(os.path.join(cache_dir, "**", "*.cubin"), recursive=True))
        print(f"fallback: {len(cubins)} cubins under {cache_dir}")
        for path in cubins:
            name = os.path.basename(path)
            entry = {"kernel": name, "compiled_by": "triton cache", "key": path}
            try:
                with open(path, "rb") as f:
                    text = cuobjdump(f.read())
                entry.update(summarize(text))
                texts.append(f"==== {name}\n{text}")
            except Exception as e:  # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {e}"
            results["kernels"].append(entry)

    out_dir = common.results_dir()
    with open(os.path.join(out_dir, "weight_only_sass.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out_dir, "weight_only_sass.txt"), "w") as f:
        f.write("\n\n".join(texts))

    for k in results["kernels"]:
        print(f"\n== {k['kernel']} ({k['compiled_by']}) meta={k.get('meta')}")
        if "error" in k:
            print("   error:", k["error"])
            continue
        print(f"   {k['instructions']} instructions, {k['loops']} backward branches")
        print("   whole kernel:", {op: c for op, c in k["watched"].items() if c})
        if "main_loop" in k:
            ml = k["main_loop"]
            print(f"   main loop ({ml['instructions']} instr):", {op: c for op, c in ml["watched"].items() if c})
            print("   main loop full opcodes:", dict(list(ml["by_full_opcode"].items())[:25]))
    if results["errors"]:
        print("\nerrors:", *results["errors"], sep="\n  ")
    print("\nwrote", os.path.join(out_dir, "weight_only_sass.json"))
    if os.environ.get("TRITON_CACHE_DIR") == _CACHE_DIR:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


if __name__ == "__main__":
    main()
