"""Tokenizers: bytes (no files), a Hugging Face ``tokenizer.json``, Meta's tiktoken ``tokenizer.model``.

Every tokenizer puts BOS/EOS around each document it encodes, so packed documents stay apart.
Every one has the same methods from text to ids (:class:`Tokenizer`): ``encode(text, bos=, eos=)``
(a document, BOS and EOS as asked), ``encode_text(text)`` (a plain-text prompt, as the prompts
source encodes it) and ``encode_batch(texts)`` (documents, as the data pipeline packs them).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from torchtitan_lite.data.files import unreadable_error
from torchtitan_lite.errors import DataError

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "PLAIN_TOKENIZER_CLASSES",
    "SPECIAL_TOKENS",
    "TOKENIZER_FILES",
    "TiktokenTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "hf_tokenizer_json",
    "read_tiktoken_ranks",
    "special_tokens",
    "tiktoken_to_tokenizer_json",
    "tokenizer_file",
]


class Tokenizer(Protocol):
    """What the data pipeline (and a script on the engine's tokenizer) needs from a tokenizer: the
    same methods on every class."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        """Ids of ``text`` with BOS in front and EOS after, each when asked (and when the tokenizer
        has one): by default what :meth:`encode_batch` gives a document; ``bos=False, eos=False``
        the text alone (a chat template's rendering, whose special tokens are written in it)."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Ids of a plain-text prompt with the tokenizer's own special tokens, as transformers'
        ``tokenizer(text)`` gives them and the prompts source encodes a string prompt: a
        ``tokenizer.json``'s post-processor's (a Llama folder's BOS, none for Qwen's); BOS for the
        byte tokenizer and Meta's ``tokenizer.model``."""
        ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text with BOS/EOS added, as ``uint32`` arrays."""
        ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0–255, plus BOS (256) and EOS (257). Needs no files."""

    bos_id: int | None = 256
    eos_id: int | None = 257
    vocab_size = 258

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        """The text's UTF-8 bytes, with BOS and EOS when asked (:meth:`Tokenizer.encode`)."""
        ids = list(text.encode("utf-8"))
        return ([256] if bos else []) + ids + ([257] if eos else [])

    def encode_text(self, text: str) -> list[int]:
        """A plain-text prompt's ids: BOS and the bytes (:meth:`Tokenizer.encode_text`)."""
        return self.encode(text, eos=False)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        out = []
        for text in texts:
            body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            ids = np.empty(len(body) + 2, dtype=np.uint32)
            ids[0], ids[1:-1], ids[-1] = 256, body, 257
            out.append(ids)
        return out

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# Special-token spellings tried, in order, when a tokenizer.json comes without a
# tokenizer_config.json that names its BOS/EOS tokens.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` library, or, where its
    tokenizer_config.json names a transformers class (:data:`PLAIN_TOKENIZER_CLASSES`), the
    tokenizer ``AutoTokenizer`` builds for its folder: the ids transformers gives either way.

    BOS/EOS come from a ``tokenizer_config.json`` next to the file (``bos_token``/``eos_token``)
    when there is one, otherwise from the usual special-token spellings. A tokenizer with neither
    is rejected: documents could not be told apart once packed.
    """

    def __init__(self, path: str | Path, *, key: str = "model.tokenizer_path") -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:  # pragma: no cover - tokenizers is a dependency
            raise DataError(f"{key}: reading tokenizer.json files needs the 'tokenizers' package") from exc
        file = tokenizer_file(path, key=key)
        if not _is_hf_json(file):
            raise DataError(f"{key}: {str(file)!r} is not a tokenizer.json file")
        self.path = file
        config = file.parent / "tokenizer_config.json"
        self.config = _read_config(config)  # tokenizer_config.json's values ({} without one)
        self.tokenizer_class = _named_class(self.config)
        if self.tokenizer_class is not None:  # transformers builds this class its own way
            self._tok, named_tokens = _transformers_backend(file, self.tokenizer_class, key=key)
            # The class's own defaults where the file names none (GPT-2's <|endoftext|> as BOS, …);
            # a token transformers leaves unset is unset here too (no guess from the usual spellings).
            self.config = {**self.config, **named_tokens}
        else:
            try:
                self._tok = _HFTokenizer.from_file(str(file))
            except Exception as exc:  # the library raises its own exception types
                raise DataError(f"{key}: {str(file)!r} is not a valid tokenizer.json ({exc})") from None
        # Ids of a whole text: what transformers' encode gives without truncation= / padding=.
        self._tok.no_truncation()
        self._tok.no_padding()
        try:  # (a vocabulary without the unknown token its model needs fails on the first text)
            self._tok.encode("The quick brown fox: 1, 2, 3. Ünïcödé ✓ 中文 🙂\n\t</s>", add_special_tokens=False)
        except Exception as exc:  # the library raises its own exception types
            reason = str(exc).strip() or type(exc).__name__
            raise DataError(f"{key}: {str(file)!r} cannot encode text ({reason})") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        named = special_tokens(self.config, ("bos_token", "eos_token"))
        self.bos_id = self._find("bos_token", named, _BOS_NAMES, vocab, config, key)
        self.eos_id = self._find("eos_token", named, _EOS_NAMES, vocab, config, key)
        if self.bos_id is not None and self.bos_id == self.eos_id:
            self.bos_id = None  # one token (GPT-2's <|endoftext|>) separates documents once
        if self.bos_id is None and self.eos_id is None:
            raise DataError(
                f"{key}: {str(file)!r} has no BOS or EOS token (looked for "
                f"{', '.join(dict.fromkeys(_BOS_NAMES + _EOS_NAMES))} and tokenizer_config.json); "
                "one is needed to separate packed documents"
            )

    @staticmethod
    def _find(which: str, named: dict[str, str | None], candidates: tuple[str, ...],
              vocab: dict[str, int], config: Path, key: str) -> int | None:
        if which in named:  # tokenizer_config.json decides, null included
            token = named[which]
            if token is None:
                return None
            if token not in vocab:
                raise DataError(
                    f"{key}: {str(config)!r} names {which} {token!r}, which the tokenizer's "
                    "vocabulary does not have"
                )
            return vocab[token]
        return next((vocab[name] for name in candidates if name in vocab), None)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        head = [] if self.bos_id is None else [self.bos_id]
        tail = [] if self.eos_id is None else [self.eos_id]
        return [np.array(head + enc.ids + tail, dtype=np.uint32) for enc in encodings]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        """Ids of ``text`` as written (special-token spellings are special tokens), with the BOS
        and EOS ids of this tokenizer when asked (:meth:`Tokenizer.encode`)."""
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        return head + list(self._tok.encode(text, add_special_tokens=False).ids) + tail

    def encode_text(self, text: str) -> list[int]:
        """Ids of ``text`` with the tokenizer's own special tokens added (its post-processor: a
        Llama folder's BOS), as ``tokenizer(text)`` gives them in transformers."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` as written (special-token spellings are special tokens, no BOS/EOS
        added: how ``apply_chat_template`` tokenizes a rendered conversation), and each token's
        character span."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The tokenizer's special tokens by name (transformers' ``special_tokens_map``): what a chat
template sees, and where BOS/EOS are named."""

PLAIN_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
"""``tokenizer_class`` values of a ``tokenizer_config.json`` under which transformers reads
``tokenizer.json`` as it is (so does this project, without transformers). Any other class (a
Llama 2 / Mistral / Gemma folder's ``LlamaTokenizerFast`` or ``GemmaTokenizer``, Qwen's
``Qwen2Tokenizer``, ``GPT2Tokenizer`` …) is a transformers class that may build its tokenizer
its own way: transformers 5 rebuilds it from the file's vocabulary and merges with the class's
own normalizer, pre-tokenizer and decoder, and the ids can differ from the file's pipeline
(Llama's ``legacy = false``, for one, prefixes "▁" only at the start of a text, not after each
special token). Such folders are tokenized by the tokenizer ``AutoTokenizer`` builds."""


def _named_class(config: dict[str, Any]) -> str | None:
    """The ``tokenizer_class`` a tokenizer_config.json names, unless it is one of
    :data:`PLAIN_TOKENIZER_CLASSES` (or none)."""
    name = config.get("tokenizer_class")
    return name if isinstance(name, str) and name and name not in PLAIN_TOKENIZER_CLASSES else None


def _transformers_backend(file: Path, tokenizer_class: str, *, key: str) -> tuple[Any, dict[str, str | None]]:
    """The ``tokenizers.Tokenizer`` that ``AutoTokenizer.from_pretrained`` builds for the folder of
    ``file`` (a tokenizer.json whose tokenizer_config.json names ``tokenizer_class``): its ids
    are the ones a model trained here sees at inference through transformers; and its special
    tokens by name (:data:`SPECIAL_TOKENS`, None where unset), the class's defaults included."""
    where = f"{str(file.parent / 'tokenizer_config.json')!r} names tokenizer_class {tokenizer_class!r}"
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(
            f"{key}: {where}, which transformers builds its own way (its ids can differ from "
            "tokenizer.json's); install transformers (pip install transformers) to tokenize as "
            "AutoTokenizer does, or set tokenizer_class to PreTrainedTokenizerFast to use tokenizer.json as it is"
        ) from None
    if file.name != "tokenizer.json":
        raise DataError(f"{key}: {where}, which transformers builds from the folder's tokenizer.json, "
                        f"not from {file.name!r}: name the folder or its tokenizer.json")
    try:
        built = AutoTokenizer.from_pretrained(str(file.parent))
    except Exception as exc:  # transformers raises many types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{key}: {where}, which transformers cannot build from the folder ({first})") from None
    backend = getattr(built, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"{key}: {where}, a tokenizer transformers runs in Python ({type(built).__name__}), "
                        "not from tokenizer.json; only tokenizer.json tokenizers are supported")
    return backend, {name: _token_text(getattr(built, name, None)) for name in SPECIAL_TOKENS}


def _token_text(token: Any) -> str | None:
    """A special token's text (transformers gives a string or an ``AddedToken``)."""
    if token is None or isinstance(token, str):
        return token
    return str(getattr(token, "content", token))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "original/tokenizer.model")
"""What a tokenizer folder is searched for, in this order: a Hugging Face ``tokenizer.json``
(an ``hf_assets_path`` folder, a Hugging Face model folder), Meta's tiktoken ``tokenizer.model``
(Llama 3's original download), or the same under ``original/`` (a Hugging Face Llama 3 folder
without tokenizer.json)."""


def tokenizer_file(path: str | Path, *, key: str = "model.tokenizer_path") -> Path:
    """The tokenizer file ``path`` names: the file itself (a ``tokenizer.json`` or a tiktoken
    ``tokenizer.model``), or the first of :data:`TOKENIZER_FILES` in a folder. The one place that
    decides which file a tokenizer path means; raises :class:`DataError` when there is none."""
    path = Path(path).expanduser()
    if path.is_dir():
        file = next((path / name for name in TOKENIZER_FILES if (path / name).is_file()), None)
        if file is None:
            raise DataError(
                f"{key}: invalid value {str(path)!r}; the folder holds none of "
                f"{', '.join(TOKENIZER_FILES)}"
            )
        return file
    if not path.exists():
        raise DataError(f"{key}: path not found: {str(path)!r}; expected a tokenizer.json or tiktoken "
                        "tokenizer.model file, or a folder holding one (nothing here downloads: "
                        "download it first, as docs/configuration.md says)")
    if not path.is_file():
        raise DataError(
            f"{key}: invalid value {str(path)!r}; expected a tokenizer.json or tiktoken tokenizer.model "
            "file, or a folder holding one"
        )
    return path


def _is_hf_json(file: Path) -> bool:
    return file.suffix == ".json"


def _read_config(path: Path) -> dict[str, Any]:
    """A ``tokenizer_config.json``, or {} where there is none (or it is not a JSON object)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def special_tokens(config: dict[str, Any], names: tuple[str, ...]) -> dict[str, str | None]:
    """The special tokens ``names`` (``bos_token`` …) of a tokenizer_config.json's values: a
    string (an ``AddedToken`` table's ``content``), or None where the file sets it to null; a
    key the file does not have is left out."""
    out: dict[str, str | None] = {}
    for name in names:
        if name not in config:
            continue
        value = config[name]
        if isinstance(value, dict):
            value = value.get("content")
        out[name] = value if isinstance(value, str) else None
    return out


# Meta's Llama 3 tokenizer (llama/tokenizer.py of meta-llama/llama3): the pre-tokenizer pattern
# and the 256 special tokens that follow the base ranks.
TIKTOKEN_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
TIKTOKEN_NUM_RESERVED_SPECIAL_TOKENS = 256
TIKTOKEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",  # end of turn
    *(f"<|reserved_special_token_{i}|>" for i in range(5, TIKTOKEN_NUM_RESERVED_SPECIAL_TOKENS - 5)),
)
# Meta's encode() cuts a text into pieces of at most this many characters, and those into pieces
# with at most _TIKTOKEN_MAX_RUN consecutive whitespace or non-whitespace characters (tiktoken
# issue 195), and encodes each piece on its own; so do we, for the same ids.
_TIKTOKEN_MAX_ENCODE_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000
_LONG_RUN = re.compile(rf"\s{{{_TIKTOKEN_MAX_RUN + 1}}}|\S{{{_TIKTOKEN_MAX_RUN + 1}}}")


def _split_runs(text: str, max_run: int) -> Iterator[str]:
    """Meta's ``_split_whitespaces_or_nonwhitespaces``: pieces of ``text`` with no more than
    ``max_run`` consecutive whitespace or non-whitespace characters."""
    run = 0
    in_space = text[0].isspace() if text else False
    start = 0
    for i, char in enumerate(text):
        space = char.isspace()
        if in_space ^ space:
            run, in_space = 1, space
        else:
            run += 1
            if run > max_run:
                yield text[start:i]
                start, run = i, 1
    yield text[start:]


def read_tiktoken_ranks(file: Path, *, key: str = "model.tokenizer_path") -> dict[bytes, int]:
    """The mergeable ranks of a tiktoken BPE file (one ``<base64 token> <rank>`` line each), read
    directly (``tiktoken.load.load_tiktoken_bpe`` caches files by path name in a temporary
    folder, so a changed file at the same path would not be seen)."""
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise unreadable_error(key, file, exc) from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise DataError(
                f"{key}: {str(file)!r} line {lineno} is not '<base64 token> <rank>': not a tiktoken "
                "tokenizer.model (a SentencePiece tokenizer.model is not supported; "
                "use its tokenizer.json)"
            ) from None
    if not ranks:
        raise DataError(f"{key}: {str(file)!r} is empty; expected a tiktoken tokenizer.model")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{key}: {str(file)!r} has ranks that are not 0..{len(ranks) - 1}, each once")
    return ranks


class TiktokenTokenizer:
    """Meta's original Llama 3 ``tokenizer.model`` (tiktoken BPE ranks), read with the
    ``tiktoken`` library exactly as Meta's ``llama/tokenizer.py`` builds it: Llama 3's
    pattern, 256 special tokens from id ``len(ranks)`` on, BOS ``<|begin_of_text|>``, EOS
    ``<|end_of_text|>``. Text that spells a special token is encoded as plain text (Meta's
    default, ``disallowed_special=()``), and long texts are cut as Meta's ``encode`` cuts them,
    so the ids are Meta's."""

    def __init__(self, path: str | Path, *, key: str = "model.tokenizer_path") -> None:
        try:
            import tiktoken
        except ImportError:
            raise DataError(
                f"{key}: reading a tiktoken tokenizer.model needs the 'tiktoken' package: "
                "pip install tiktoken (or pip install 'torchtitan_lite[tiktoken]')"
            ) from None
        file = tokenizer_file(path, key=key)
        ranks = read_tiktoken_ranks(file, key=key)
        self.path = file
        self.num_base_tokens = len(ranks)
        self.ranks = ranks
        self.special_tokens = {token: len(ranks) + i for i, token in enumerate(TIKTOKEN_SPECIAL_TOKENS)}
        try:
            self._enc = tiktoken.Encoding(name=file.name, pat_str=TIKTOKEN_PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)
        except Exception as exc:  # the library raises its own exception types
            raise DataError(f"{key}: {str(file)!r} is not a usable tiktoken BPE file ({exc})") from None
        self.vocab_size = len(ranks) + len(TIKTOKEN_SPECIAL_TOKENS)
        self.bos_id: int | None = self.special_tokens["<|begin_of_text|>"]
        self.eos_id: int | None = self.special_tokens["<|end_of_text|>"]

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        """Ids of ``text`` (special-token spellings as plain text), with BOS/EOS when asked."""
        (body,) = self._encode_texts([text])
        return ([self.bos_id] if bos else []) + body + ([self.eos_id] if eos else [])

    def encode_text(self, text: str) -> list[int]:
        """A plain-text prompt's ids: ``<|begin_of_text|>`` and the text, as Meta's Llama 3
        folders' ``tokenizer.json`` adds it (:meth:`Tokenizer.encode_text`)."""
        return self.encode(text, eos=False)

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        simple = [len(t) <= _TIKTOKEN_MAX_ENCODE_CHARS and not _LONG_RUN.search(t) for t in texts]
        batch = self._enc.encode_ordinary_batch([t for t, ok in zip(texts, simple, strict=True) if ok])
        out: list[list[int]] = []
        done = iter(batch)
        for text, ok in zip(texts, simple, strict=True):
            if ok:
                out.append(next(done))
                continue
            ids: list[int] = []
            for i in range(0, len(text), _TIKTOKEN_MAX_ENCODE_CHARS):
                for piece in _split_runs(text[i : i + _TIKTOKEN_MAX_ENCODE_CHARS], _TIKTOKEN_MAX_RUN):
                    ids.extend(self._enc.encode_ordinary(piece))
            out.append(ids)
        return out

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        out = []
        for body in self._encode_texts(texts):
            ids = np.empty(len(body) + 2, dtype=np.uint32)
            ids[0], ids[1:-1], ids[-1] = self.bos_id, body, self.eos_id
            out.append(ids)
        return out

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([i for i in ids if i < self.num_base_tokens])


def build_tokenizer(tokenizer_path: str | Path | None) -> Tokenizer:
    """The job's tokenizer: the byte tokenizer when no path is given, else the file
    :func:`tokenizer_file` finds at the path (a file, an ``hf_assets_path`` folder, a Hugging
    Face or Meta Llama 3 download): a ``tokenizer.json`` read with ``tokenizers``, a tiktoken
    ``tokenizer.model`` with ``tiktoken``."""
    if tokenizer_path is None:
        return ByteTokenizer()
    file = tokenizer_file(tokenizer_path)
    return HFTokenizer(file) if _is_hf_json(file) else TiktokenTokenizer(file)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: a printable character for each byte (what byte-level BPE
    tokenizer.json files spell tokens with)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tiktoken_to_tokenizer_json(tokenizer: TiktokenTokenizer, path: str | Path) -> Path:
    """Write a tiktoken ``tokenizer.model`` as a Hugging Face ``tokenizer.json``: byte-level BPE
    with the merges its ranks imply, tiktoken's whole-piece lookup first (``ignore_merges``), the
    same pattern and the 256 special tokens at the same ids, as transformers'
    ``TikTokenConverter`` writes it. Plain text gets the same ids; the file matches special-token
    spellings as special tokens (Meta's encode reads them as text) and does not cut texts of over
    400 000 characters."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as _HFTokenizer

    ranks, alphabet = tokenizer.ranks, _bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    merges: list[tuple[bytes, bytes, int]] = []
    for token, rank in ranks.items():
        pairs = [(token[:i], token[i:], rank) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        merges.extend(sorted(pairs, key=lambda m: (ranks[m[0]], ranks[m[1]])))
    merges.sort(key=lambda m: m[2])
    bpe = models.BPE({spell(t): r for t, r in ranks.items()}, [(spell(a), spell(b)) for a, b, _ in merges],
                     fuse_unk=False, byte_fallback=False, ignore_merges=True)
    out = _HFTokenizer(bpe)
    out.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(TIKTOKEN_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    out.decoder = decoders.ByteLevel()
    out.post_processor = processors.ByteLevel(trim_offsets=False)
    out.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TIKTOKEN_SPECIAL_TOKENS])
    path = Path(path)
    out.save(str(path))
    return path


def hf_tokenizer_json(tokenizer: Tokenizer, *, convert: bool = False) -> Path | None:
    """The ``tokenizer.json`` a Hugging Face export copies: an HF tokenizer's own file; with
    ``convert``, a tiktoken ``tokenizer.model`` written as one (:func:`tiktoken_to_tokenizer_json`,
    into a temporary folder removed at exit); None for the byte tokenizer (no such form)."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.path.resolve()
    if isinstance(tokenizer, TiktokenTokenizer) and convert:
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="torchtitan_lite_tokenizer_")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return tiktoken_to_tokenizer_json(tokenizer, Path(folder) / "tokenizer.json")
    return None
