"""Continual pre-training data, preparing: tokenize a corpus into memory-mapped token files.

Preparing (``prepare_cpt``, the ``infir2 prepare-cpt`` command)
----------------------------------------------------------------
Inputs are files or folders (searched recursively, in sorted order) of

* ``.txt``     -- one document per file (the whole file). For many small documents use JSONL.
* ``.jsonl``   -- one JSON object per line, the document in ``text_field`` (default ``"text"``);
  blank lines are ignored.
* ``.parquet`` -- the document in the column ``text_field``; needs ``pyarrow`` (``pip install
  'infir2[parquet]'``).

Each document is tokenized without special tokens and followed by the eos token, so the token stream is
``doc0 EOS doc1 EOS ...``. Documents that are empty or whitespace only are skipped and counted. A record
that is not what is expected (bad JSON, missing field, non-string) is an error naming file and line.

Documents are split into train / validation whole, deterministically and evenly spread: with
``val_fraction = f``, document ``i`` (in input order) is held out when ``ceil((i+1) f) > ceil(i f)``,
i.e. exactly ``ceil(n f)`` documents, the first one included (so the split is never empty when f > 0).

The output folder holds ``train.bin`` and ``val.bin`` (raw little-endian token ids, ``uint16`` when the
vocabulary has fewer than 65536 entries, else ``uint32``) and ``meta.json`` (dtype, vocabulary size,
token and document counts, skipped documents, source files, tokenizer). Everything is written into a
temporary folder beside ``out_dir`` (``.<name>.tmp-<pid>``) and moved into place only when the whole
input has been read: bad input leaves an existing dataset in ``out_dir`` untouched. ``meta.json`` is
moved last: a folder without it is an interrupted run. Input that is not UTF-8 is an error naming
the file and the line.

Reading the folder back (training windows, held-out windows, the token reader) is ``infir2.data.tokens``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from .._paths import jsonl_records, not_utf8
from .tokens import META_FILE

__all__ = [
    "CPT_SUFFIXES",
    "find_input_files",
    "is_val_document",
    "iter_documents",
    "open_parquet",
    "prepare_cpt",
    "token_dtype",
]

log = logging.getLogger(__name__)

CPT_SUFFIXES = (".txt", ".jsonl", ".parquet")
_TOKENIZE_BATCH = 256  # documents per call into the (parallel, Rust) fast tokenizer


# ----------------------------------------------------------------------------- reading documents


def find_input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """Expand files and folders into the sorted list of supported files (error if there are none)."""
    files: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            found = sorted(p for p in item.rglob("*") if p.is_file() and p.suffix in CPT_SUFFIXES)
            if not found:
                raise ValueError(f"{item}: folder has no {'/'.join(CPT_SUFFIXES)} files")
            files.extend(found)
        elif item.is_file():
            if item.suffix not in CPT_SUFFIXES:
                raise ValueError(
                    f"{item}: unsupported file type {item.suffix!r}; expected one of {CPT_SUFFIXES}"
                )
            files.append(item)
        else:
            raise FileNotFoundError(f"input not found: {item}")
    if not files:
        raise ValueError("no input files given")
    return files


def _without_foreign_parquet(files: list[Path], inputs: Sequence[str | Path], text_field: str) -> list[Path]:
    """``files`` less the Parquet files found in a folder that have no ``text_field`` column (a warning each).

    A folder of a dataset often holds other tables beside the text (metadata, labels); a file named
    on the command line is kept, and fails with the column named if it lacks it.
    """
    named = {Path(item).resolve() for item in inputs if Path(item).is_file()}
    kept = []
    for path in files:
        if path.suffix == ".parquet" and path.resolve() not in named:
            columns = _parquet_columns(path)
            if text_field not in columns:
                log.warning(
                    "skipping %s: no column %r (columns: %s; see --text-field)", path, text_field, columns
                )
                continue
        kept.append(path)
    if not kept:
        raise ValueError(f"no input file has the text column {text_field!r} (see --text-field)")
    return kept


def open_parquet(path: Path) -> Any:
    """``pyarrow.parquet.ParquetFile(path)``; without pyarrow, an ImportError naming ``path`` and the install."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"{path}: reading Parquet needs pyarrow: pip install 'infir2[parquet]' (or pip install pyarrow)"
        ) from None
    return pq.ParquetFile(path)


def _parquet_columns(path: Path) -> list[str]:
    return list(open_parquet(path).schema_arrow.names)


def iter_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one file (empty ones included; the caller skips them)."""
    if path.suffix == ".txt":
        raw = path.read_bytes()
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:
            lineno = raw.count(b"\n", 0, e.start) + 1
            raise ValueError(f"{path}:{lineno}: {not_utf8(e)}") from None
    elif path.suffix == ".jsonl":
        yield from _iter_jsonl(path, text_field)
    elif path.suffix == ".parquet":
        yield from _iter_parquet(path, text_field)
    else:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected one of {CPT_SUFFIXES}")


def _iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    for lineno, record in jsonl_records(path):
        where = f"{path}:{lineno}"
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object with a {text_field!r} field")
        if text_field not in record:
            raise ValueError(f"{where}: missing field {text_field!r} (expected a string)")
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(f"{where}: field {text_field!r} must be a string, got {type(text).__name__}")
        yield text


def _iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    parquet = open_parquet(path)
    if text_field not in parquet.schema_arrow.names:
        raise ValueError(
            f"{path}: no column {text_field!r}; columns are {parquet.schema_arrow.names} (see --text-field)"
        )
    row = 0
    for batch in _parquet_batches(parquet, path, text_field):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}: row {row}: column {text_field!r} must be a string, got {type(text).__name__}"
                )
            yield text


def _parquet_batches(parquet: Any, path: Path, text_field: str) -> Iterator[Any]:
    """``parquet``'s record batches; a decoding error (e.g. invalid UTF-8) names the file and the row."""
    import pyarrow as pa

    batches, row = parquet.iter_batches(columns=[text_field]), 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, UnicodeDecodeError) as e:
            raise ValueError(
                f"{path}: after row {row}: column {text_field!r} does not decode ({e})"
            ) from None
        row += batch.num_rows
        yield batch


# ----------------------------------------------------------------------------- preparing shards


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id (little-endian on disk)."""
    return np.dtype("<u2") if vocab_size < 2**16 else np.dtype("<u4")


def is_val_document(index: int, val_fraction: float) -> bool:
    """Whole-document split: exactly ceil(n * f) of n documents, evenly spread, the first included."""
    f = Fraction(repr(val_fraction))  # exact: 0.7 is 7/10, not 0.69999...
    return math.ceil((index + 1) * f) > math.ceil(index * f)


def prepare_cpt(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    val_fraction: float = 0.01,
    text_field: str = "text",
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into ``out_dir/{train,val}.bin`` + ``meta.json``; returns the meta dict."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token (needed as the document separator)")
    files = _without_foreign_parquet(find_input_files(inputs), inputs, text_field)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    new_parents = [p for p in out.parents if not p.exists()]  # nearest first; removed again on failure
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    dtype = token_dtype(len(tokenizer))
    try:
        counts = _write_shards(files, tmp, tokenizer, dtype, val_fraction, text_field, progress)
        meta = _meta(files, tokenizer, dtype, counts, val_fraction, text_field)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in new_parents:  # a bad input leaves no folder behind
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "wrote %s: %d train / %d val tokens, %d / %d documents, %d empty skipped",
        out,
        counts["train_tokens"],
        counts["val_tokens"],
        counts["train_documents"],
        counts["val_documents"],
        counts["skipped_empty"],
    )
    return meta


def _move_into_place(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out`` (a rename), or its files replace those in an existing ``out``, meta.json last."""
    if not out.exists():
        tmp.rename(out)
        return
    (out / META_FILE).unlink(missing_ok=True)  # from here until the last rename: an incomplete folder
    for name in ("train.bin", "val.bin", META_FILE):
        (tmp / name).replace(out / name)


def _meta(
    files: list[Path],
    tokenizer: PreTrainedTokenizerBase,
    dtype: np.dtype,
    counts: dict[str, int],
    val_fraction: float,
    text_field: str,
) -> dict[str, Any]:
    return {
        "format": "infir2-cpt-1",
        "dtype": dtype.name,
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        **counts,
        "val_fraction": val_fraction,
        "text_field": text_field,
        "sources": [str(f) for f in files],
        "tokenizer": {"name_or_path": str(tokenizer.name_or_path), "class": type(tokenizer).__name__},
    }


def _write_shards(
    files: list[Path],
    out: Path,
    tokenizer: PreTrainedTokenizerBase,
    dtype: np.dtype,
    val_fraction: float,
    text_field: str,
    progress: bool,
) -> dict[str, int]:
    """Stream documents -> token ids -> ``{train,val}.bin``; returns the counts for meta.json."""
    counts = {
        "train_tokens": 0,
        "val_tokens": 0,
        "train_documents": 0,
        "val_documents": 0,
        "skipped_empty": 0,
    }
    with (
        (out / "train.bin.tmp").open("wb") as train_f,
        (out / "val.bin.tmp").open("wb") as val_f,
        tqdm(desc="tokenizing", unit=" docs", disable=not progress) as bar,
    ):
        index = 0
        for texts in _batched(_nonempty_documents(files, text_field, counts), _TOKENIZE_BATCH):
            for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
                split = "val" if is_val_document(index, val_fraction) else "train"
                tokens = np.asarray([*ids, tokenizer.eos_token_id], dtype=dtype)
                (val_f if split == "val" else train_f).write(tokens.tobytes())
                counts[f"{split}_tokens"] += len(tokens)
                counts[f"{split}_documents"] += 1
                index += 1
            bar.set_postfix(tokens=counts["train_tokens"] + counts["val_tokens"], refresh=False)
            bar.update(len(texts))
    if counts["train_documents"] == 0:
        raise ValueError(
            f"no training documents: {index} non-empty document(s) in {[str(f) for f in files]} "
            f"(all went to validation or were empty)"
        )
    for name in ("train", "val"):
        (out / f"{name}.bin.tmp").replace(out / f"{name}.bin")
    return counts


def _nonempty_documents(files: list[Path], text_field: str, counts: dict[str, int]) -> Iterator[str]:
    for path in files:
        for text in iter_documents(path, text_field):
            if text.strip():
                yield text
            else:
                counts["skipped_empty"] += 1


def _batched(items: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch
