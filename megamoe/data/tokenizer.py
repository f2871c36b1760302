"""Train a sentencepiece tokenizer, and load one (or an HF ``tokenizer.json``) behind one interface.

Training choices, made for source code and for exact round trips (``decode(encode(t)) == t``):

- ``byte_fallback``: a character outside the vocabulary becomes its UTF-8 bytes (256 byte pieces), so
  there is no ``<unk>`` in practice; newlines, which never occur inside a training line, are bytes too.
- identity normalisation, no extra-whitespace removal, no dummy ``▁`` prefix, whitespace-only pieces
  allowed: indentation survives and is learnt as pieces.
- Fixed special ids: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``<pad>`` 3.

Determinism. sentencepiece's own line sampling (``input_sentence_size``) does not follow its random
seed (measured with sentencepiece 0.2: two runs with the same seed gave different models), so the lines
are read and sampled here with a seeded reservoir and fed to the trainer as an iterator; the model
then also does not record the input paths. The thread count is stored in the model and changes
unigram results, so it is a fixed argument rather than the machine's core count. Same files and
arguments give byte-identical ``.model`` files.

Measured on 2 cores (AMD EPYC), Python 3.11 stdlib sources: BPE, 3 MB: about 1 s for vocab 2000 or
8000; 12 MB, vocab 8000: about 3-4 s. Unigram, 3 MB, vocab 8000: about 6-10 s. Two to three times
longer while other jobs load the cores.

CLI: ``python -m megamoe.data.tokenizer train --input FILES... --model-prefix P --vocab-size N``.
"""

from __future__ import annotations

import abc
import argparse
import functools
import hashlib
import io
import json
import logging
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

import sentencepiece

from megamoe.atomic_file import atomic_write, check_output_target

__all__ = [
    "UNK_ID", "BOS_ID", "EOS_ID", "PAD_ID", "train_sentencepiece",
    "Tokenizer", "SentencePieceTokenizer", "HFTokenizer", "read_json_object", "check_tokenizer_fits", "main",
]

logger = logging.getLogger(__name__)

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
_NUM_SPECIAL_PIECES = 4
_NUM_BYTE_PIECES = 256
_MODEL_TYPES = ("bpe", "unigram")


def _training_lines(
    input_files: Sequence[Path], max_sentence_length: int, input_sentence_size: int, seed: int
) -> tuple[list[str], int]:
    """Non-empty lines of ``input_files`` (newline stripped) of at most ``max_sentence_length`` UTF-8
    bytes; when there are more than ``input_sentence_size``, a uniform sample of that many (reservoir
    sampling with ``random.Random(seed)``), kept in corpus order. Returns (lines, lines seen)."""
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    seen = 0
    for path in input_files:
        try:
            with open(path, encoding="utf-8") as file:
                for raw_line in file:
                    line = raw_line.rstrip("\r\n")
                    if not line or len(line.encode("utf-8")) > max_sentence_length:
                        continue
                    if len(reservoir) < input_sentence_size:
                        reservoir.append((seen, line))
                    else:
                        slot = rng.randrange(seen + 1)
                        if slot < input_sentence_size:
                            reservoir[slot] = (seen, line)
                    seen += 1
        except UnicodeDecodeError as error:
            raise ValueError(f"input file {path} is not UTF-8 text ({error})") from None
    reservoir.sort()
    return [line for _, line in reservoir], seen


def train_sentencepiece(
    input_files: Iterable[str | os.PathLike],
    model_prefix: str | os.PathLike,
    vocab_size: int,
    *,
    model_type: str = "bpe",
    max_sentence_length: int = 16384,
    input_sentence_size: int = 2_000_000,
    seed: int = 0,
    num_threads: int = 2,
) -> Path:
    """Train a sentencepiece model on the lines of ``input_files`` and write ``<model_prefix>.model``.

    ``max_sentence_length`` (UTF-8 bytes): longer lines are skipped. ``input_sentence_size``: at most
    this many lines are used, a seeded uniform sample when the corpus has more. ``num_threads`` is
    part of the result (see the module docstring). The model is written under a temporary name and
    renamed, so a crash never leaves a partial ``.model``. Returns the ``.model`` path.
    """
    input_paths = [Path(p) for p in input_files]
    if not input_paths:
        raise ValueError("train_sentencepiece needs at least one input file, got none")
    missing = [str(p) for p in input_paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"input file(s) not found: {', '.join(missing)}")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"model_type must be one of {_MODEL_TYPES}, got {model_type!r}")
    min_vocab = _NUM_SPECIAL_PIECES + _NUM_BYTE_PIECES + 1
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size must be >= {min_vocab} (4 special + 256 byte pieces + learnt ones), got {vocab_size}"
        )
    for name, value in (("max_sentence_length", max_sentence_length),
                        ("input_sentence_size", input_sentence_size), ("num_threads", num_threads)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    model_path = Path(f"{os.fspath(model_prefix)}.model")
    check_output_target(model_path)           # before the training, not after it

    started = time.perf_counter()
    lines, lines_seen = _training_lines(input_paths, max_sentence_length, input_sentence_size, seed)
    if not lines:
        raise ValueError(
            f"no training text: the {len(input_paths)} input file(s) hold no non-empty line of at most "
            f"{max_sentence_length} bytes"
        )
    model_bytes = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model_bytes,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
            max_sentence_length=max_sentence_length,
            input_sentence_size=0,  # sampling already done above, deterministically
            num_threads=num_threads,
            minloglevel=1,  # sentencepiece's per-step INFO lines would flood the training log
        )
    except RuntimeError as error:  # how sentencepiece refuses a request, e.g. a vocabulary too small
        raise _training_error(error, vocab_size) from None
    model_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(model_path) as file:
        file.write(model_bytes.getvalue())
    logger.info(
        "trained %s tokenizer (vocab %d) on %d of %d lines in %.1f s -> %s",
        model_type, vocab_size, len(lines), lines_seen, time.perf_counter() - started, model_path,
    )
    return model_path


# sentencepiece's words when the vocabulary cannot hold every character the corpus needs (trainer_interface.cc).
_TOO_FEW_PIECES = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)\.")


def _training_error(error: RuntimeError, vocab_size: int) -> ValueError:
    """sentencepiece's refusal as one line saying what to change: for a vocabulary too small for the
    corpus's characters, the smallest that fits (sentencepiece's count: the characters it must keep,
    the 4 special and the 256 byte pieces)."""
    message = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    too_few = _TOO_FEW_PIECES.search(message)
    if too_few is not None:
        needed = int(too_few.group(2))
        return ValueError(f"a sentencepiece vocabulary of {vocab_size} pieces is too small for this corpus: it "
                          f"needs at least {needed} (its characters, 4 special and 256 byte pieces); pass a "
                          f"vocab_size (--vocab-size) of {needed} or more")
    # Drop sentencepiece's "INTERNAL: src/file.cc(line) [condition] " prefix: the reason follows it.
    reason = re.sub(r"^\w+: \S+\(\d+\) \[.*?\] ", "", message)
    return ValueError(f"sentencepiece cannot train a {vocab_size}-piece model on this corpus: {reason}")


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class Tokenizer(abc.ABC):
    """Text <-> token ids, whatever the file format. ``encode`` never adds special tokens: callers add
    ``bos_id`` / ``eos_id`` themselves, so both formats behave alike. Special ids are None when the
    tokenizer has no such token. ``path`` is the loaded file and ``sha256`` its digest (recorded by
    token files so that a dataset can be matched to its tokenizer).

    Use :meth:`from_path`, or :class:`SentencePieceTokenizer` / :class:`HFTokenizer` directly.
    """

    path: Path
    vocab_size: int  # ids produced are in [0, vocab_size)
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    @functools.cached_property
    def sha256(self) -> str:
        return _file_sha256(self.path)

    def files(self) -> list[Path]:
        """The files this tokenizer was read from (``path`` and, for some formats, files beside it): what
        a writer must not overwrite."""
        return [self.path]

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        ...

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text)`` and each token's ``[start, end)`` character span in ``text`` (what maps a chat's
        assistant text to its tokens); ValueError for a format that does not give them."""
        raise ValueError(f"tokenizer {self.path} gives no character offsets of its tokens (needed for chat data): "
                         "use an HF tokenizer.json")

    @staticmethod
    def from_path(path: str | os.PathLike) -> Tokenizer:
        """Load ``*.model`` (sentencepiece) or ``*.json`` (HF tokenizers) files; for a directory,
        ``tokenizer.json`` (when the ``tokenizers`` package is installed), else ``tokenizer.model``,
        else its only ``*.model`` file."""
        path = Path(path)
        if path.is_file():
            if path.suffix == ".model":
                return SentencePieceTokenizer(path)
            if path.suffix == ".json":
                return HFTokenizer(path)
            raise ValueError(
                f"cannot tell the tokenizer format of {path}: expected a sentencepiece '.model' or an "
                "HF 'tokenizer.json' file, or a directory holding one"
            )
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer path {path} does not exist")
        hf_file = path / "tokenizer.json"
        if hf_file.is_file() and HFTokenizer.available():
            return HFTokenizer(hf_file)
        if (path / "tokenizer.model").is_file():
            return SentencePieceTokenizer(path / "tokenizer.model")
        model_files = sorted(path.glob("*.model"))
        if len(model_files) == 1:
            return SentencePieceTokenizer(model_files[0])
        if hf_file.is_file():
            return HFTokenizer(hf_file)  # raises the "install tokenizers" error
        found = ", ".join(p.name for p in model_files) or "none"
        raise ValueError(
            f"no tokenizer found in directory {path}: looked for tokenizer.json, tokenizer.model or "
            f"exactly one *.model file (*.model files found: {found})"
        )


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``.model`` file, e.g. one written by :func:`train_sentencepiece`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=os.fspath(self.path))
        except (OSError, RuntimeError) as error:
            raise ValueError(f"cannot load sentencepiece model {self.path}: {error}") from None
        self.vocab_size = self._processor.get_piece_size()
        self.bos_id, self.eos_id, self.pad_id = (
            None if i < 0 else i
            for i in (self._processor.bos_id(), self._processor.eos_id(), self._processor.pad_id())
        )

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text, out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        return self._processor.decode(list(ids))


class HFTokenizer(Tokenizer):
    """An HF ``tokenizer.json`` (needs the ``tokenizers`` package), e.g. one of a directory written by
    ``transformers``' ``save_pretrained``. ``tokenizer.json`` does not name the bos/eos/pad tokens:
    they come from ``tokenizer_config.json`` beside it, and for a token it does not name, from the
    older ``special_tokens_map.json`` (as ``transformers`` reads them). A named token missing from the
    vocabulary is an error. ``vocab_size`` is the largest id + 1, added tokens included."""

    # The files beside tokenizer.json that name its special tokens (read by __init__, as transformers does).
    COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json")

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.available():
            raise ImportError(f"loading {self.path} needs the 'tokenizers' package: pip install tokenizers")
        import tokenizers

        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(os.fspath(self.path))
        except Exception as error:  # tokenizers raises its own exception type for bad files
            raise ValueError(f"cannot load HF tokenizer {self.path}: {error}") from None
        self.vocab_size = max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        special = self._special_tokens(self.path.parent / "special_tokens_map.json")
        special.update({
            name: token for name, token in self._special_tokens(self.path.parent / "tokenizer_config.json").items()
            if token is not None
        })
        self.bos_id, self.eos_id, self.pad_id = (self._special_id(special, name)
                                                 for name in ("bos_token", "eos_token", "pad_token"))

    def files(self) -> list[Path]:
        return [self.path] + [self.path.parent / name for name in self.COMPANION_FILES
                              if (self.path.parent / name).is_file()]

    def _special_id(self, special: dict[str, str | None], name: str) -> int | None:
        token = special.get(name)
        if token is None:
            return None
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"HF tokenizer {self.path}: {name} {token!r} (named in tokenizer_config.json or "
                "special_tokens_map.json) is not in its vocabulary"
            )
        return token_id

    @staticmethod
    def available() -> bool:
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            return False
        return True

    @staticmethod
    def _special_tokens(config_path: Path) -> dict[str, str | None]:
        """The bos/eos/pad token strings of ``tokenizer_config.json`` or ``special_tokens_map.json``
        (a value may be a string or an AddedToken dict with "content"); empty when the file is absent."""
        if not config_path.is_file():
            return {}
        config = read_json_object(config_path)
        tokens = {}
        for name in ("bos_token", "eos_token", "pad_token"):
            value = config.get(name)
            tokens[name] = value.get("content") if isinstance(value, dict) else value
        return tokens

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets


def read_json_object(path: Path) -> dict:
    """The JSON object in the file ``path`` (e.g. a ``tokenizer_config.json``); ValueError naming it otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"cannot read {path}: expected a JSON object, got {type(value).__name__}")
    return value


def check_tokenizer_fits(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Raise ValueError when ``tokenizer`` produces ids the model has no embedding for (its
    vocabulary is larger than ``model_vocab_size``); a smaller vocabulary is fine (the extra rows
    are never looked up)."""
    if type(model_vocab_size) is not int or model_vocab_size < 1:
        raise ValueError(f"model_vocab_size must be an int >= 1, got {model_vocab_size!r}")
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} token ids, more than the model's "
            f"vocab_size {model_vocab_size}: ids >= {model_vocab_size} would index past the embedding; use "
            f"a model with vocab_size >= {tokenizer.vocab_size} or the tokenizer the model was trained with"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megamoe.data.tokenizer",
        description="Tokenizer tools. 'train' fits a sentencepiece model (byte fallback, exact round "
                    "trip for code) and writes <model-prefix>.model.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train", help="train a sentencepiece model on text files",
        description="Train a sentencepiece model on the lines of the input files. Deterministic: the "
                    "same files and flags give a byte-identical .model.",
    )
    train.add_argument("--input", nargs="+", required=True, metavar="FILE",
                       help="UTF-8 text files; each line is one training sentence")
    train.add_argument("--model-prefix", required=True, metavar="P", help="writes P.model")
    train.add_argument("--vocab-size", type=int, required=True, metavar="N",
                       help="number of pieces, including 4 special and 256 byte pieces (so N >= 261)")
    train.add_argument("--model-type", choices=_MODEL_TYPES, default="bpe",
                       help="bpe (default; fast) or unigram")
    train.add_argument("--max-sentence-length", type=int, default=16384, metavar="BYTES",
                       help="skip lines longer than this many UTF-8 bytes (default: %(default)s)")
    train.add_argument("--input-sentence-size", type=int, default=2_000_000, metavar="LINES",
                       help="train on at most this many lines, a seeded uniform sample when there are "
                            "more (default: %(default)s)")
    train.add_argument("--seed", type=int, default=0, help="seed of the line sample (default: %(default)s)")
    train.add_argument("--num-threads", type=int, default=2,
                       help="trainer threads; part of the result for unigram (default: %(default)s)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        model_path = train_sentencepiece(
            args.input, args.model_prefix, args.vocab_size,
            model_type=args.model_type, max_sentence_length=args.max_sentence_length,
            input_sentence_size=args.input_sentence_size, seed=args.seed, num_threads=args.num_threads,
        )
    except (ValueError, OSError, RuntimeError) as error:
        parser.exit(1, f"{parser.prog} train: error: {error}\n")
    print(model_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
