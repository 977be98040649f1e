"""The model's EOS ids (engine.eos): one answer for the engine, which reads the tokenizer's eos from
its files, and the tokenizer, which passes its loaded ``eos_token_id``."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.eos import model_eos_token_ids
from engine.errors import ModelLoadError
from engine.tokenizer import load_tokenizer
from factories import build_tokenizer, make_model_dir
from test_tokenizer import build_metaspace_tokenizer


def test_engine_and_tokenizer_agree_on_the_tiny_model(tiny_model_dir):
    assert model_eos_token_ids(tiny_model_dir) == load_tokenizer(tiny_model_dir).eos_token_ids == {2}


@pytest.mark.parametrize("build", ["chatml", "metaspace"])
def test_tokenizer_files_name_the_loaded_tokenizers_eos(tmp_path, build):
    if build == "chatml":
        build_tokenizer().save_pretrained(tmp_path)
        tok = load_tokenizer(tmp_path)
    else:
        tok = build_metaspace_tokenizer(tmp_path)
    assert model_eos_token_ids(tmp_path) == tok.eos_token_ids == {tok.hf.eos_token_id}


def test_union_of_configs_and_tokenizer(tmp_path, tiny_model_dir):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 0, -1, True]}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert model_eos_token_ids(path) == load_tokenizer(path).eos_token_ids == {2, 7, 0, 5}


def test_without_a_tokenizer_the_configs_alone(tmp_path):
    path = make_model_dir(tmp_path, "llama", with_tokenizer=False)
    assert model_eos_token_ids(path) == {2}
    (path / "tokenizer_config.json").write_text("{ not json")  # the tokenizer loader's to report
    assert model_eos_token_ids(path) == {2}


def test_unreadable_generation_config_fails_the_load(tmp_path):
    (tmp_path / "generation_config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="generation_config.json is not readable JSON"):
        model_eos_token_ids(tmp_path)


@pytest.mark.slow
def test_default_model(default_model_dir):
    assert model_eos_token_ids(default_model_dir) == load_tokenizer(default_model_dir).eos_token_ids == {2, 0}
