"""Tokenize a text corpus into memory-mapped token shards for continual pre-training.

Inputs are files or folders (searched recursively) of .txt (one document per file), .jsonl (one JSON
object per line, the document in --text-field) and .parquet (column --text-field; needs pyarrow).
Each document is followed by the tokenizer's eos token; empty documents are skipped and counted;
whole documents are held out for validation (--val-fraction, deterministic and evenly spread).

Writes OUT/train.bin and OUT/val.bin (raw little-endian token ids, uint16 or uint32) and
OUT/meta.json (dtype, vocabulary size, token and document counts, sources, tokenizer), which a
CPT run config points at.

The tokenizer is read as `AutoTokenizer` will read the trained model's export (for the model type
of the folder's config.json, or --model-type), so the ids written here are the ids every downstream
user of the model gets for the same text; a folder whose tokenizer.json says otherwise is reported.
`infir2 train` checks the shards against its own tokenizer before it starts.

Example:
  infir2 prepare-cpt --tokenizer models/qwen2.5-1.5b --out data/cpt --val-fraction 0.005 \\
      corpus/books/ corpus/web.jsonl corpus/code.parquet
"""

from __future__ import annotations

import argparse
import json

from .cpt import prepare_cpt
from .tokenizer import load_tokenizer

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="files or folders (.txt, .jsonl, .parquet)"
    )
    parser.add_argument("--tokenizer", required=True, metavar="DIR", help="local tokenizer (or model) folder")
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="output folder for train.bin/val.bin/meta.json"
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        metavar="F",
        help="share of documents held out (default 0.01)",
    )
    parser.add_argument(
        "--model-type",
        metavar="TYPE",
        help="tokenize as AutoTokenizer loads a model of this type (qwen2, llama, ...): the type "
        "of the model you will train; default: model_type in the folder's config.json, "
        "else the tokenizer as saved",
    )
    parser.add_argument("--text-field", default="text", help="JSONL field / Parquet column (default: text)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.val_fraction < 1.0:
        raise ValueError(f"--val-fraction: must be in [0, 1), got {args.val_fraction}")
    tokenizer = load_tokenizer(args.tokenizer, model_type=args.model_type)
    meta = prepare_cpt(
        args.inputs,
        args.out,
        tokenizer,
        val_fraction=args.val_fraction,
        text_field=args.text_field,
        progress=not args.no_progress,
    )
    summary = {k: meta[k] for k in ("dtype", "vocab_size", "train_tokens", "val_tokens", "skipped_empty")}
    print(json.dumps(summary))
    return 0
