"""Tokenizers: train a small byte-level BPE in-process, or load one from a local folder.

``train_bpe_tokenizer`` builds the kind of tokenizer Qwen2.5 uses, scaled down for from-scratch demo runs:

* byte-level BPE (any UTF-8 text round-trips, no unknown token);
* digits are split one by one *before* the byte-level step (``Digits(individual_digits=True)``), so
  ``"1234"`` is always the four tokens ``1 2 3 4``. A model then sees numbers digit by digit, with the same
  token for the same digit everywhere, which is what makes column arithmetic learnable;
* the ChatML special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (ids 0, 1, 2);
* ``eos_token = pad_token = "<|endoftext|>"`` (Qwen2.5 base convention; also the CPT document separator);
* the default chat template (ChatML) is set, so ``apply_chat_template`` works.

``load_tokenizer`` loads any Hugging Face tokenizer folder without touching the network, as
``AutoTokenizer`` will load the exported model (so a run trains on the ids its export produces), and
fills in the documented defaults (chat template, pad token) when the folder lacks them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .._logging import log_once
from .chat_template import CHATML_SPECIAL_TOKENS, DEFAULT_CHAT_TEMPLATE

__all__ = [
    "EOS_TOKEN",
    "PROBE_TEXTS",
    "first_difference",
    "folder_model_type",
    "load_tokenizer",
    "train_bpe_tokenizer",
]

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
#: The split before byte-level BPE of Qwen2 / Qwen2.5 (transformers' ``Qwen2Tokenizer``).
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    special_tokens: list[str] | None = None,
    model_max_length: int = 32768,
    whole_numbers: int = 0,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (digits split individually, ChatML specials).

    ``vocab_size`` counts the 256 byte symbols and the special tokens; it must leave room for them.
    ``whole_numbers=N`` adds the numbers ``10 .. N-1`` as tokens of their own (on top of
    ``vocab_size``; matched before BPE, so ``"12"`` is one token and ``"123"`` is ``"12"`` + ``"3"``):
    for a synthetic arithmetic task, each number is then one token, so each copy of a number sits at
    the same distance whatever its digits.
    Returns a ``PreTrainedTokenizerFast``; ``save_pretrained(dir)`` writes a folder that
    ``load_tokenizer`` / ``AutoTokenizer`` load back.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    specials = list(CHATML_SPECIAL_TOKENS if special_tokens is None else special_tokens)
    if EOS_TOKEN not in specials:
        raise ValueError(f"special_tokens must contain the eos token {EOS_TOKEN!r}, got {specials}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(specials):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the byte alphabet ({len(alphabet)}) and the special "
            f"tokens ({len(specials)}) need {len(alphabet) + len(specials)}"
        )
    tok = Tokenizer(models.BPE())
    # Qwen2's normalizer and pre-tokenizer (digits split individually), exactly as transformers'
    # Qwen2Tokenizer rebuilds them: a qwen2 run's folder then reads the same as saved and through
    # AutoTokenizer (``load_tokenizer``), and its export tokenizes as the run trained.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=None,
        model_max_length=model_max_length,
    )
    fast.chat_template = DEFAULT_CHAT_TEMPLATE
    if whole_numbers > 10:
        fast.add_tokens([str(n) for n in range(10, whole_numbers)])
    return fast


#: texts on which two readings of one tokenizer folder are compared: digit runs, punctuation before
#: letters, contractions, composed / decomposed accents (NFC), whitespace runs, CJK
PROBE_TEXTS = (
    "In 1133 there were 2024 apples, 3.14159 pies and 1,000,000 coins.",
    "He said:\"hello\"... .net isn't it? DON'T! x=12+7*(3-4)",
    "cafe\u0301 vs caf\u00e9, na\u00efve; \u4f60\u597d\u4e16\u754c \U0001f600",
    "  two  spaces\n\n\ttab\r\nline   end   ",
)


def load_tokenizer(path: str | Path, model_type: str | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder (never the network) as ``AutoTokenizer`` will load the export.

    A run's exported folder (``<run>/hf``) holds the tokenizer next to a ``config.json`` of the model's
    type, and every downstream user (transformers, vLLM, SGLang, lm-eval) loads it with
    ``AutoTokenizer.from_pretrained``. For some model types (qwen2 among them) transformers 5 picks its
    own class for that type and rebuilds the normalizer and pre-tokenizer from the vocabulary alone,
    whatever ``tokenizer.json`` says. So that a run trains on exactly the ids its export produces, this
    function returns what ``AutoTokenizer`` returns for a folder of ``model_type`` (default: the
    ``model_type`` of ``path/config.json``; a folder without one is read as saved). Where that
    differs from the folder's own ``tokenizer.json`` on ``PROBE_TEXTS`` (an ambiguous folder), a
    warning names both readings and the first text they split differently.

    Documented defaults are filled in:

    * no chat template -> ``DEFAULT_CHAT_TEMPLATE`` (ChatML), logged once per folder;
    * no pad token -> the eos token (right padding; padded positions never carry loss).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer folder not found: {path} (expected a local Hugging Face tokenizer "
            "or model folder; `infir2 demo --data-only --out DIR` writes a small one "
            "to DIR/tokenizer)"
        )
    model_type = model_type or folder_model_type(path)
    try:
        saved = _load_as_saved(path)
    except Exception as e:  # JSON errors, the tokenizers library's own (a bare Exception), a missing file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"tokenizer folder {path}: its files cannot be read ({first})") from e
    tokenizer = saved
    if model_type is not None:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path), config=AutoConfig.for_model(model_type), local_files_only=True
        )
        difference = first_difference(saved, tokenizer)
        if difference is not None:
            log.warning(
                "tokenizer %s is ambiguous: its tokenizer.json (read as %s) and what AutoTokenizer loads for a "
                "%s model (%s) tokenize differently (%r: %d vs %d tokens). Training uses %s, the tokenizer "
                "AutoTokenizer (and so vLLM, SGLang, evaluation harnesses) will load from the exported model",
                path,
                type(saved).__name__,
                model_type,
                type(tokenizer).__name__,
                difference[0],
                len(difference[1]),
                len(difference[2]),
                type(tokenizer).__name__,
            )
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        log_once(log, f"tokenizer {path} has no chat template; using the default ChatML template")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer {path} has neither a pad token nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
        log_once(log, f"tokenizer {path} has no pad token; padding with eos {tokenizer.eos_token!r}")
    return tokenizer


def folder_model_type(path: str | Path) -> str | None:
    """The ``model_type`` in ``path/config.json``, or None (no config.json, or one without it)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return None
    try:
        model_type = json.loads(config_path.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{config_path}: not a JSON object with a model_type ({e})") from e
    return model_type if isinstance(model_type, str) and model_type else None


def first_difference(
    a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase, texts: Iterable[str] = PROBE_TEXTS
) -> tuple[str, list[int], list[int]] | None:
    """The first of ``texts`` that ``a`` and ``b`` encode to different ids, with both id lists; or None."""
    for text in texts:
        ids_a = a(text, add_special_tokens=False)["input_ids"]
        ids_b = b(text, add_special_tokens=False)["input_ids"]
        if ids_a != ids_b:
            return text, ids_a, ids_b
    return None


def _load_as_saved(path: Path) -> PreTrainedTokenizerBase:
    """The folder's tokenizer as its files say (a generic fast tokenizer keeps its tokenizer.json)."""
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    if config.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
