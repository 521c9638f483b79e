"""`python -m supervisor import-gguf FILE.gguf DIR [--force] [--json]`: an MLX folder from a GGUF.

The import itself runs in a child process (`modelfiles.gguf_import`: it needs
MLX, which the supervisor never imports); this command starts it, shows its
progress (a bar on a terminal; JSON lines with --json, one per step, for
scripts) and says what was kept quantized, what was dequantized and the size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from shared.gguf import REQUANTIZE_BITS, GGUFError, ImportLine, ImportNote, read_header
from shared.sizes import format_size
from supervisor.models.gguf_import_cache import GGUFImportError, ProgressLog, TerminalBar, run_import


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", type=Path, help="the .gguf file (from Ollama, llama.cpp, a download ...)")
    parser.add_argument("dir", type=Path, help="the MLX model folder to write")
    parser.add_argument("--force", action="store_true", help="write into DIR even if it is not empty")
    parser.add_argument("--json", action="store_true", help="progress and result as JSON lines")
    parser.add_argument("--requantize", type=int, choices=REQUANTIZE_BITS, default=0, metavar="BITS",
                        help="quantize the matrices that would be dequantized or are float (4 or 8 bits, "
                             "affine, group 64) instead of keeping them float16/32")


def _summary(path: Path, requantize: int) -> str:
    header = read_header(path)
    kept = sum(t.stays_quantized for t in header.tensors)
    lost = sum(t.dequantized for t in header.tensors)
    again = sum(t.requantized(requantize) for t in header.tensors)
    return (f"{path.name}: {header.metadata.get('general.architecture', '?')}, {len(header.tensors)} tensors "
            f"({kept} stay quantized, {lost} need dequantizing, {again} to requantize), "
            f"{format_size(header.imported_bytes(requantize))} once imported")


def _json_printer(line: ImportLine) -> None:
    sys.stdout.buffer.write(msgspec.json.encode(line) + b"\n")
    sys.stdout.flush()


def _reporter(args: argparse.Namespace):
    if args.json:
        return _json_printer
    if sys.stderr.isatty():
        return TerminalBar(f"importing {args.gguf.name}")
    log = ProgressLog(args.gguf.name)

    def plain(line: ImportLine) -> None:
        if isinstance(line, ImportNote):
            print(f"note: {line.text}", file=sys.stderr)
        else:
            log(line)

    return plain


def run(args: argparse.Namespace) -> int:
    try:
        summary = _summary(args.gguf, args.requantize)
    except GGUFError as exc:
        print(f"import-gguf: error: {exc}", file=sys.stderr)
        return 2
    if not args.json:
        print(summary, file=sys.stderr)
    reporter = _reporter(args)
    try:
        done = run_import(args.gguf, args.dir, reporter, force=args.force, requantize=args.requantize)
    except GGUFImportError as exc:
        print(f"import-gguf: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if isinstance(reporter, TerminalBar):
            reporter.close()
    if not args.json:
        print(f"wrote {done.out_dir}: {format_size(done.bytes_written)} of weights "
              f"({done.quantized_tensors} tensors kept quantized, {done.dequantized_tensors} dequantized, "
              f"{done.requantized_tensors} requantized) "
              f"in {done.seconds:.1f} s")
    return 0
