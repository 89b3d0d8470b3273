"""Where the host time of one eager op call goes (a dev tool): microseconds per call, GPU idle (M = 1), for
the public op, a bare Triton launch of its kernel through `JITFunction.__getitem__` (argument binding,
specialization key, cache lookup), the same compiled kernel launched directly (`CompiledKernel[grid]`,
what a cached-launch fast path would pay), and torch's F.linear / torch.empty for scale.

    PYTHONPATH=src python benchmarks/profile_launch.py     (on the device; prints a table, writes
                                                            $OUT/profile_launch.json)
"""

import json
import os
import time

import torch
import triton

import quantfuse as qf
from profile_overhead import per_call_us  # noqa: E402  (benchmarks/ is the script's directory)
from quantfuse.kernels import scaled_mm as ksm


def main():
    dev = "cuda"
    m, k, n = 1, 4096, 4096
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randint(-127, 127, (n, k), dtype=torch.int8, device=dev)
    sw = torch.rand(n, device=dev)
    q, s, _ = qf.quantize_per_token(x, torch.int8)
    lin = torch.nn.Linear(k, n, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    b = w.t()
    sa = s.reshape(-1)
    # the kernel's arguments as scaled_mm passes them (no split-K: one launch)
    args = dict(a_src=q, b_src=b, out_ptr=out, ws_ptr=sa, scale_a_ptr=sa, scale_b_ptr=sw, bias_ptr=sa, azp_adj_ptr=sa,
                azp_ptr=sa, M=m, N=n, K=k, K_PER_SPLIT=k, stride_am=q.stride(0), stride_ak=q.stride(1),
                stride_bk=b.stride(0), stride_bn=b.stride(1), stride_om=out.stride(0))
    names = ksm._scaled_mm_kernel.arg_names
    consts = dict(IS_FP8=False, SPLIT_K=1, EVEN_K=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8,
                  SCALE_A_PER_ROW=True, SCALE_B_PER_COL=True, HAS_BIAS=False, AZP_MODE=0, TMA=False, PERSISTENT=False,
                  PDL=False, INTERPRET=False)
    missing = [a for a in names if a not in args and a not in consts]
    rows = {}
    if missing:
        print("kernel arguments changed, not profiled directly:", missing)
    else:
        pos = [args[a] for a in names if a in args]
        grid = (triton.cdiv(n, 64), 1)
        ck = ksm._scaled_mm_kernel[grid](*pos, **consts, num_warps=4, num_stages=4)
        bound = [args.get(a, consts.get(a)) for a in names]
        runner = ck[(grid[0], grid[1], 1)]
        rows["triton JIT launch (JITFunction[grid])"] = per_call_us(
            lambda: ksm._scaled_mm_kernel[grid](*pos, **consts, num_warps=4, num_stages=4))
        rows["compiled launch (CompiledKernel[grid])"] = per_call_us(lambda: runner(*bound))
    rows["qf.scaled_mm (public op)"] = per_call_us(lambda: qf.scaled_mm(q, w.t(), s, sw, torch.bfloat16))
    # the layers below the public op: the custom-op body (no argument checks), the launcher alone (plan cached)
    from quantfuse import ops

    rows["ops._scaled_mm (no validation)"] = per_call_us(
        lambda: ops._scaled_mm(q, w.t(), s, sw, torch.bfloat16, None, None, None))
    rows["kernels.scaled_mm (launcher)"] = per_call_us(
        lambda: ksm.scaled_mm(q, w.t(), s, sw, torch.bfloat16, None, None, None))
    rows["2 tensor descriptors"] = per_call_us(lambda: (ksm.descriptor(q, (16, 128)), ksm.descriptor(b.t(), (64, 128))))
    rows["qf.quantize_per_token (public op)"] = per_call_us(lambda: qf.quantize_per_token(x, torch.int8))
    rows["F.linear bf16"] = per_call_us(lambda: lin(x))
    rows["torch.empty"] = per_call_us(lambda: torch.empty(m, n, device=dev, dtype=torch.bfloat16))
    for name, us in rows.items():
        print(f"{name:44s} {us:8.1f} us/call (host)")
    env = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(0),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path = os.path.join(os.environ.get("OUT", "benchmarks/results"), "profile_launch.json")
    with open(path, "w") as f:
        json.dump({"name": "profile_launch", "env": env, "shape": [m, k, n], "host_us_per_call": rows}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
