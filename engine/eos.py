"""The model's end-of-sequence token ids: one answer for the engine (which stops on them) and the
tokenizer (whose set the frontends publish), so the two can never disagree.

Plain Python over the model directory's JSON files: no torch, no transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

_FROM_FILES: Any = object()


def model_eos_token_ids(directory: str | Path, tokenizer_eos: Any = _FROM_FILES) -> frozenset[int]:
    """The union of ``eos_token_id`` in config.json and generation_config.json (instruct models
    list their end-of-turn ids there) and the tokenizer's eos token.

    ``tokenizer_eos``: the loaded tokenizer's ``eos_token_id`` when the caller holds one; else it is
    read from the tokenizer files (the engine runs without loading a tokenizer)."""
    directory = Path(directory)
    if tokenizer_eos is _FROM_FILES:
        tokenizer_eos = _tokenizer_file_eos(directory)
    ids = set(_as_ids(tokenizer_eos))
    for name in ("generation_config.json", "config.json"):
        data = _read_json(directory / name, strict=True)
        if isinstance(data, dict):
            ids.update(_as_ids(data.get("eos_token_id")))
    return frozenset(ids)


def _tokenizer_file_eos(directory: Path) -> int | None:
    """The id of the tokenizer's eos token as transformers would resolve it: its name from
    tokenizer_config.json (or the older special_tokens_map.json), its id from tokenizer.json."""
    token = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        data = _read_json(directory / name, strict=False)
        token = data.get("eos_token") if isinstance(data, dict) else None
        if token is not None:
            break
    if isinstance(token, dict):  # an AddedToken, serialized
        token = token.get("content")
    if not isinstance(token, str):
        return None
    data = _read_json(directory / "tokenizer.json", strict=False)
    if not isinstance(data, dict):
        return None
    for added in data.get("added_tokens") or ():
        if isinstance(added, dict) and added.get("content") == token:
            return added.get("id")
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):  # BPE / WordPiece; a Unigram vocab is a list of [piece, score]
        return vocab.get(token)
    if isinstance(vocab, list):
        return next((i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry[:1] == [token]), None)
    return None


def _read_json(file: Path, strict: bool) -> Any:
    """``strict``: a broken model config fails the load; broken tokenizer files are the tokenizer
    loader's to report (the engine alone does not need them)."""
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        if strict:
            raise ModelLoadError(f"{file} is not readable JSON: {exc}") from exc
        return None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value] if value >= 0 else []
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return []
