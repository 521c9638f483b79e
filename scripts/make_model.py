"""Write a small local MLX llama model: `python scripts/make_model.py DIR [--size SIZE] [--seed N] [--quantize 4|8]`.

The model has random float16 weights of about SIZE bytes (same seed, same
bytes), a BPE tokenizer trained offline, and a chat template; `mlx_lm.load(DIR)`
loads it. The logic lives in `modelfiles.modelgen` so the supervisor can build its
demo models on first run without importing MLX; this file is the command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from modelfiles.modelgen import DEFAULT_DTYPE, DTYPES, FIM_TOKENS, QUANT_BITS, ModelGenError, make_model
except ImportError:  # run as a file from a checkout: put the repo root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from modelfiles.modelgen import DEFAULT_DTYPE, DTYPES, FIM_TOKENS, QUANT_BITS, ModelGenError, make_model

from shared.sizes import SizeError, format_size, parse_size

__all__ = ["make_model", "main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="make_model.py",
        description="Write a small local MLX llama model (random weights, trained tokenizer).",
    )
    parser.add_argument("dir", help="directory to write the model into")
    parser.add_argument("--size", default="16MiB",
                        help="about how many bytes of weights, e.g. 16MiB, 200MB (default 16MiB)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the weights (default 0)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=DEFAULT_DTYPE,
                        help=f"parameter type (default {DEFAULT_DTYPE}; float32 runs fastest on CPU)")
    parser.add_argument("--quantize", type=int, choices=QUANT_BITS, default=0, metavar="BITS",
                        help="write the matrices quantized as mlx_lm.convert -q does: affine, "
                             "group size 64, BITS 4 or 8 (SIZE counts the packed bytes)")
    parser.add_argument("--fim", action="store_true",
                        help="add fill-in-the-middle tokens (<fim_prefix>, <fim_suffix>, <fim_middle>) "
                             "so the model takes a suffix on /v1/completions and /api/generate")
    parser.add_argument("--force", action="store_true",
                        help="write into DIR even if it is not empty")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _run_with_bar(args, size: int):
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("writing weights"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("weights", total=size)
        return make_model(args.dir, size, args.seed,
                          lambda done, total: bar.update(task, completed=done, total=total),
                          force=args.force, dtype=args.dtype, bits=args.quantize,
                          extra_special=FIM_TOKENS if args.fim else ())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        size = parse_size(args.size)
        if args.quiet or not sys.stderr.isatty():
            dims = make_model(args.dir, size, args.seed, force=args.force, dtype=args.dtype, bits=args.quantize,
                              extra_special=FIM_TOKENS if args.fim else ())
        else:
            dims = _run_with_bar(args, size)
    except (SizeError, ModelGenError) as exc:
        print(f"make_model.py: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"make_model.py: error: cannot write {args.dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.dir}: {format_size(dims.weight_bytes)} of weights, "
        f"{dims.param_count / 1e6:.1f}M {dims.dtype} parameters"
        f"{f' ({dims.bits}-bit affine)' if dims.bits else ''} (hidden {dims.hidden_size}, "
        f"{dims.num_hidden_layers} layers, mlp {dims.intermediate_size}, vocab {dims.vocab_size})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
