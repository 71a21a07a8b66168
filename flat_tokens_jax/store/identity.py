"""What made a dataset (tokenizer, flags, inputs), recorded in its root
attributes under :data:`ATTRIBUTE` (layout in docs/format.md, "What made it"),
so that tools can refuse to combine datasets whose ids mean different things.
Datasets of other writers have none (:class:`DatasetInfo` ``None``). Pure: stdlib only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flat_tokens_jax.core.format import SPLITS, FormatError, split_names
from flat_tokens_jax.core.values import is_integer

ATTRIBUTE = "flat_tokens"
MARKER = "flat-tokens"
SPLITS_KEY = "splits"
MAX_NAMES = 1000


def library_version() -> str:
    """The installed ``flat-tokens-jax`` version, ``"unknown"`` when not installed."""
    try:
        return importlib.metadata.version("flat-tokens-jax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def vocab_hash(vocab: Mapping[str, int]) -> str:
    """``"sha256:"`` and the first 16 hex digits of the SHA-256 of ``vocab`` (every
    token, added ones included, to its id) as compact sorted UTF-8 JSON."""
    text = json.dumps(
        {str(k): int(v) for k, v in vocab.items()},
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def combined_sha256(digests: Iterable[str]) -> str:
    """``"sha256:<hex>"`` of the given hex digests, in order, one per line: the
    inputs' contents and order, not their names."""
    h = hashlib.sha256()
    for d in digests:
        h.update(d.removeprefix("sha256:").encode("ascii") + b"\n")
    return "sha256:" + h.hexdigest()


def inputs_field(names: Sequence[str], digests: Sequence[str] | None) -> dict[str, Any]:
    """The ``inputs`` field: count, the first :data:`MAX_NAMES` names, and the
    :func:`combined_sha256` of ``digests`` (one per input; ``None``: no hash)."""
    out: dict[str, Any] = {"count": len(names), "names": list(names[:MAX_NAMES])}
    if digests is not None:
        out["sha256"] = combined_sha256(digests)
    return out


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """Who made the ids: a tokenizer's name and the hash of its vocabulary.

    Attributes:
        name: the path or name as the user gave it.
        vocab_hash: :func:`vocab_hash` of its vocabulary; two tokenizers are
            the same when these are equal.
        vocab_size: the number of ids (largest id + 1).
        bos_id: its beginning-of-sequence id, if any.
        eos_id: its end-of-sequence id, if any.
        pad_id: its padding id, if any.
    """

    name: str
    vocab_hash: str
    vocab_size: int
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None

    def __post_init__(self) -> None:
        if not self.vocab_hash.startswith("sha256:"):
            raise ValueError(f"vocab_hash must start with 'sha256:', got {self.vocab_hash!r}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        for field in ("bos_id", "eos_id", "pad_id"):
            value = getattr(self, field)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{field} {value} is outside [0, vocab_size {self.vocab_size})")

    def describe(self) -> str:
        """``name (hash)``, for messages."""
        return f"{self.name} ({self.vocab_hash})"


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What made a dataset, as stored in its root attributes (docs/format.md).

    Attributes:
        tokenizer: the tokenizer whose ids it holds; ``None``: not recorded.
        start_token_id: the input id to feed where a sequence starts, that
            the data was made for; ``None``: not recorded (the spec's 0).
        flags: what shaped the tokens (``append_eos``, ``prepend_bos``,
            ``template``, ...), JSON values.
        inputs: ``{"count", "names", "sha256"}`` of what it was made from.
        library_version: the flat_tokens_jax that wrote it; the writer fills
            it in when ``None``.
    """

    tokenizer: TokenizerInfo | None = None
    start_token_id: int | None = None
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    library_version: str | None = None

    def __post_init__(self) -> None:
        if self.start_token_id is not None and self.start_token_id < 0:
            raise ValueError(f"start_token_id must be >= 0, got {self.start_token_id}")
        for field in ("flags", "inputs"):
            try:
                json.dumps(getattr(self, field))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{field} must hold JSON values only: {e}") from None

    def to_attributes(self) -> dict[str, Any]:
        """The JSON-ready value of the :data:`ATTRIBUTE` root attribute."""
        out: dict[str, Any] = {
            "dataset": MARKER,
            "library_version": self.library_version or library_version(),
        }
        if self.tokenizer is not None:
            out["tokenizer"] = dataclasses.asdict(self.tokenizer)
        if self.start_token_id is not None:
            out["start_token_id"] = self.start_token_id
        out["flags"] = dict(self.flags)
        out["inputs"] = dict(self.inputs)
        return out

    @classmethod
    def from_attributes(cls, attrs: Mapping[str, Any], where: str = "") -> DatasetInfo | None:
        """The info in root attributes ``attrs``; ``None`` when they hold none.
        Raises ``FormatError`` naming the key of a malformed value."""
        value = attrs.get(ATTRIBUTE)
        if value is None:
            return None
        at = f"{where}: " if where else ""
        if not isinstance(value, Mapping):
            raise FormatError(f"{at}root attribute {ATTRIBUTE!r} must be an object, got {value!r}")
        tok = value.get("tokenizer")
        start = value.get("start_token_id")
        version = value.get("library_version")
        flags = value.get("flags", {})
        inputs = value.get("inputs", {})
        _expect(start is None or is_integer(start), at, "start_token_id", "an int", start)
        is_str = version is None or isinstance(version, str)
        _expect(is_str, at, "library_version", "a str", version)
        _expect(isinstance(flags, Mapping), at, "flags", "an object", flags)
        _expect(isinstance(inputs, Mapping), at, "inputs", "an object", inputs)
        try:
            return cls(
                _tokenizer(tok, at) if tok is not None else None,
                start,
                dict(flags),
                dict(inputs),
                version,
            )
        except ValueError as e:
            if isinstance(e, FormatError):
                raise
            raise FormatError(f"{at}root attribute {ATTRIBUTE!r}: {e}") from None


def identity_attribute(info: DatasetInfo | None, splits: Sequence[str]) -> dict[str, Any]:
    """The :data:`ATTRIBUTE` root attribute a writer stores: ``info`` (an empty
    one when ``None``) and the names of the ``splits`` it writes."""
    return {**(info or DatasetInfo()).to_attributes(), SPLITS_KEY: list(splits)}


def dataset_splits(attrs: Mapping[str, Any], where: str = "") -> tuple[str, ...]:
    """The splits a dataset with root attributes ``attrs`` has: :data:`SPLITS`,
    then the others that ``flat_tokens.splits`` records. Raises ``FormatError``
    for a value that is not a list of split names (never read as a path)."""
    value = attrs.get(ATTRIBUTE)
    recorded = value.get(SPLITS_KEY) if isinstance(value, Mapping) else None
    if recorded is None:
        return SPLITS
    at = f"{where}: " if where else ""
    _expect(isinstance(recorded, list), at, SPLITS_KEY, "a list of split names", recorded)
    try:
        return split_names(recorded)
    except ValueError as e:
        raise FormatError(
            f"{at}root attribute {ATTRIBUTE}.{SPLITS_KEY} is damaged (rewrite the dataset): {e}"
        ) from None


def _expect(ok: bool, at: str, key: str, what: str, value: Any) -> None:
    if not ok:
        raise FormatError(f"{at}root attribute {ATTRIBUTE}.{key} must be {what}, got {value!r}")


def _tokenizer(value: Any, at: str) -> TokenizerInfo:
    _expect(isinstance(value, Mapping), at, "tokenizer", "an object", value)
    name, hashed, size = value.get("name"), value.get("vocab_hash"), value.get("vocab_size")
    _expect(isinstance(name, str), at, "tokenizer.name", "a str", name)
    _expect(isinstance(hashed, str), at, "tokenizer.vocab_hash", "a str", hashed)
    _expect(is_integer(size), at, "tokenizer.vocab_size", "an int", size)
    ids = {}
    for key in ("bos_id", "eos_id", "pad_id"):
        got = value.get(key)
        _expect(got is None or is_integer(got), at, f"tokenizer.{key}", "an int or null", got)
        ids[key] = got
    return TokenizerInfo(name, hashed, size, **ids)


def recorded_tokenizers(
    named: Sequence[tuple[str, DatasetInfo | None]],
) -> list[tuple[str, TokenizerInfo]]:
    """``(name, tokenizer)`` of each of ``named`` (``(name, info)``) that records one."""
    return [(n, info.tokenizer) for n, info in named if info and info.tokenizer]


def check_tokenizers(
    named: Sequence[tuple[str, DatasetInfo | None]], *, allow_mixed: bool, fix: str
) -> None:
    """Raises ``ValueError`` naming two of ``named`` (``(name, info)``; those
    without a tokenizer skipped) whose tokenizers differ, unless ``allow_mixed``;
    ``fix`` says how to allow them (e.g. ``"pass --allow-mixed-tokenizers"``)."""
    found = [] if allow_mixed else recorded_tokenizers(named)
    for name, tok in found[1:]:
        if tok.vocab_hash != found[0][1].vocab_hash:
            raise ValueError(
                f"{found[0][0]} was made with tokenizer {found[0][1].describe()} but {name} "
                f"with {tok.describe()}: their ids mean different tokens; {fix} "
                "to combine them anyway"
            )


def recorded_vocab_size(named: Sequence[tuple[str, DatasetInfo | None]]) -> int | None:
    """The vocabulary size of the tokenizers ``named`` (``(name, info)``) record, ``None``
    if none records one; ``ValueError`` naming two whose sizes differ."""
    found = recorded_tokenizers(named)
    for name, tok in found[1:]:
        first, tok0 = found[0]
        if tok.vocab_size != tok0.vocab_size:
            raise ValueError(
                f"{first} was tokenized with {tok0.name} ({tok0.vocab_size} ids) "
                f"but {name} with {tok.name} ({tok.vocab_size} ids): the data has no one "
                "vocab_size; size the model yourself (LoaderConfig.vocab_size checks the data)"
            )
    return found[0][1].vocab_size if found else None


def common_tokenizer(infos: Sequence[DatasetInfo | None]) -> TokenizerInfo | None:
    """The tokenizer every one of ``infos`` records, ``None`` unless all record the same."""
    found = [tok for _, tok in recorded_tokenizers([("", i) for i in infos])]
    same = len(found) == len(infos) > 0 and len({t.vocab_hash for t in found}) == 1
    return found[0] if same else None


def tokenizer_info(
    tokenizer: Any,
    name: str,
    *,
    bos_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
) -> TokenizerInfo:
    """The :class:`TokenizerInfo` of a ``tokenizers`` or ``transformers`` tokenizer
    (anything with ``get_vocab``). Raises ``ValueError`` for an empty vocabulary."""
    try:
        vocab = tokenizer.get_vocab(with_added_tokens=True)
    except TypeError:
        vocab = tokenizer.get_vocab()
    if not vocab:
        raise ValueError(f"tokenizer {name}: its vocabulary is empty")
    size = max(int(v) for v in vocab.values()) + 1
    return TokenizerInfo(name, vocab_hash(vocab), size, bos_id, eos_id, pad_id)
