"""The `quantfuse` command line."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _cmd_check(args: argparse.Namespace) -> int:
    from .check import run_check

    return run_check(device=args.device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quantfuse", description="Fused quantization kernels for inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="self-test: every op against the reference on this machine")
    check.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    check.set_defaults(func=_cmd_check)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
