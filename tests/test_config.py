"""Engine configuration (engine.config) and SamplingParams validation (engine.sampling).

Bad input must fail at construction with a ValueError (InvalidRequestError for sampling)
that names the field, never later inside the engine.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.errors import InvalidRequestError
from engine.sampling import MAX_LOGPROBS, MAX_SEED, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams

FLAT_OPTIONS = {
    "max_num_seqs": 8, "max_num_batched_tokens": 256, "max_waiting": 10, "block_size": 32, "num_kv_blocks": 64,
    "kv_cache_memory_gb": 0.5, "enable_prefix_caching": False, "enable_chunked_prefill": False,
    "scheduling": "static", "dtype": "float32", "device": "cpu", "max_model_len": 512, "seed": 3,
    "tensor_parallel_size": 2, "attention_backend": "torch", "profile": True, "stuck_timeout_s": 5.0,
}


# ----------------------------------------------------------------------------- EngineConfig
def test_defaults():
    cfg = EngineConfig.from_options("some/model")
    assert cfg.model == ModelConfig(model="some/model")
    assert (cfg.model.dtype, cfg.model.device, cfg.model.max_model_len, cfg.model.seed) == ("auto", "auto", None, 0)
    assert cfg.cache == CacheConfig(block_size=16, num_kv_blocks=None, kv_cache_memory_gb=None,
                                    enable_prefix_caching=True)
    assert cfg.scheduler == SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048, max_waiting=1024,
                                            enable_chunked_prefill=True, scheduling="continuous")
    assert cfg.parallel == ParallelConfig(tensor_parallel_size=1, distributed_timeout_s=60.0)
    assert (cfg.attention_backend, cfg.profile, cfg.stuck_timeout_s) == ("auto", False, 30.0)


def test_from_options_routes_every_flat_option_to_its_section():
    cfg = EngineConfig.from_options("m", **FLAT_OPTIONS)
    got = {
        "max_num_seqs": cfg.scheduler.max_num_seqs, "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "max_waiting": cfg.scheduler.max_waiting, "block_size": cfg.cache.block_size,
        "num_kv_blocks": cfg.cache.num_kv_blocks, "kv_cache_memory_gb": cfg.cache.kv_cache_memory_gb,
        "enable_prefix_caching": cfg.cache.enable_prefix_caching,
        "enable_chunked_prefill": cfg.scheduler.enable_chunked_prefill, "scheduling": cfg.scheduler.scheduling,
        "dtype": cfg.model.dtype, "device": cfg.model.device, "max_model_len": cfg.model.max_model_len,
        "seed": cfg.model.seed, "tensor_parallel_size": cfg.parallel.tensor_parallel_size,
        "attention_backend": cfg.attention_backend, "profile": cfg.profile, "stuck_timeout_s": cfg.stuck_timeout_s,
    }
    assert got == FLAT_OPTIONS and cfg.model.model == "m"


@pytest.mark.parametrize("key", ["max_num_seq", "bogus", "temperature", "cache", "enable_prefix_cache"])
def test_unknown_option_is_rejected_by_name_with_the_allowed_ones(key):
    with pytest.raises(ValueError) as info:
        EngineConfig.from_options("m", **{key: 1})
    msg = str(info.value)
    assert repr(key) in msg
    for allowed in FLAT_OPTIONS:
        assert allowed in msg


INVALID = [
    (ModelConfig, {"model": ""}, "model"),
    (ModelConfig, {"model": 3}, "model"),
    (ModelConfig, {"model": "m", "dtype": "fp8"}, "dtype"),
    (ModelConfig, {"model": "m", "device": "tpu"}, "device"),
    (ModelConfig, {"model": "m", "device": 0}, "device"),
    (ModelConfig, {"model": "m", "max_model_len": 0}, "max_model_len"),
    (ModelConfig, {"model": "m", "max_model_len": -5}, "max_model_len"),
    (ModelConfig, {"model": "m", "max_model_len": 1.5}, "max_model_len"),
    (CacheConfig, {"block_size": 0}, "block_size"),
    (CacheConfig, {"block_size": 1025}, "block_size"),
    (CacheConfig, {"block_size": 16.0}, "block_size"),
    (CacheConfig, {"num_kv_blocks": 1}, "num_kv_blocks"),
    (CacheConfig, {"num_kv_blocks": "64"}, "num_kv_blocks"),
    (CacheConfig, {"kv_cache_memory_gb": 0}, "kv_cache_memory_gb"),
    (CacheConfig, {"kv_cache_memory_gb": -1.0}, "kv_cache_memory_gb"),
    (CacheConfig, {"kv_cache_memory_gb": math.nan}, "kv_cache_memory_gb"),
    (CacheConfig, {"kv_cache_memory_gb": "1"}, "kv_cache_memory_gb"),
    (CacheConfig, {"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    (CacheConfig, {"enable_prefix_caching": 1}, "enable_prefix_caching"),
    (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs"),
    (SchedulerConfig, {"max_num_seqs": 4097}, "max_num_seqs"),
    (SchedulerConfig, {"max_num_seqs": "8"}, "max_num_seqs"),
    (SchedulerConfig, {"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    (SchedulerConfig, {"max_num_seqs": 64, "max_num_batched_tokens": 63}, "max_num_batched_tokens"),
    (SchedulerConfig, {"max_waiting": -1}, "max_waiting"),
    (SchedulerConfig, {"enable_chunked_prefill": "no"}, "enable_chunked_prefill"),
    (SchedulerConfig, {"scheduling": "fifo"}, "scheduling"),
    (ParallelConfig, {"tensor_parallel_size": 0}, "tensor_parallel_size"),
    (ParallelConfig, {"distributed_timeout_s": 0}, "distributed_timeout_s"),
    (ParallelConfig, {"distributed_timeout_s": math.inf}, "distributed_timeout_s"),
    (EngineConfig, {"model": ModelConfig("m"), "attention_backend": "xformers"}, "attention_backend"),
    (EngineConfig, {"model": ModelConfig("m"), "stuck_timeout_s": 0}, "stuck_timeout_s"),
    (EngineConfig, {"model": ModelConfig("m"), "stuck_timeout_s": math.inf}, "stuck_timeout_s"),
    (EngineConfig, {"model": ModelConfig("m"), "stuck_timeout_s": "30"}, "stuck_timeout_s"),
]


@pytest.mark.parametrize("cls, kwargs, field", INVALID, ids=[f"{c.__name__}-{f}-{i}" for i, (c, _, f) in
                                                              enumerate(INVALID)])
def test_invalid_field_names_itself(cls, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must "):
        cls(**kwargs)


@pytest.mark.parametrize("key, value", [("block_size", 0), ("scheduling", "fifo"), ("dtype", "int4"),
                                        ("tensor_parallel_size", 0), ("attention_backend", "nope")])
def test_from_options_validates_too(key, value):
    with pytest.raises(ValueError, match=rf"^{key} must be "):
        EngineConfig.from_options("m", **{key: value})


@pytest.mark.parametrize("kwargs", [
    {"block_size": 1}, {"block_size": 1024}, {"num_kv_blocks": 2}, {"kv_cache_memory_gb": 1},
    {"max_num_seqs": 4096, "max_num_batched_tokens": 4096}, {"max_waiting": 0}, {"device": "cuda:1"},
    {"max_model_len": 1}, {"tensor_parallel_size": 4},
])
def test_boundary_values_are_accepted(kwargs):
    EngineConfig.from_options("m", **kwargs)


@pytest.mark.parametrize("obj, field", [
    (ModelConfig("m"), "dtype"), (CacheConfig(), "block_size"), (SchedulerConfig(), "max_num_seqs"),
    (ParallelConfig(), "tensor_parallel_size"), (EngineConfig(ModelConfig("m")), "profile"),
])
def test_configs_are_frozen(obj, field):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, getattr(obj, field))


def test_replace_revalidates():
    with pytest.raises(ValueError, match="^block_size"):
        dataclasses.replace(CacheConfig(), block_size=0)


@pytest.mark.parametrize("cls, kwargs, field", [
    pytest.param(CacheConfig, {"block_size": True}, "block_size", id="bool-as-block_size"),
    pytest.param(SchedulerConfig, {"max_num_seqs": True}, "max_num_seqs", id="bool-as-max_num_seqs"),
    pytest.param(ModelConfig, {"model": "m", "seed": "abc"}, "seed", id="seed-not-validated"),
    pytest.param(ModelConfig, {"model": "m", "device": "cuda:x"}, "device", id="device-index-not-checked"),
    pytest.param(CacheConfig, {"kv_cache_memory_gb": math.inf}, "kv_cache_memory_gb", id="infinite-memory"),
])
def test_config_validation_gaps(cls, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be "):
        cls(**kwargs)


# ----------------------------------------------------------------------------- SamplingParams
def test_sampling_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == () and p.stop_token_ids == ()
    assert (p.include_stop_str_in_output, p.ignore_eos, p.skip_special_tokens) == (False, False, True)
    assert not p.greedy and not p.uses_penalties
    assert SamplingParams(temperature=0).greedy and SamplingParams(presence_penalty=0.5).uses_penalties


@pytest.mark.parametrize("stop, expected", [
    (None, ()), ("###", ("###",)), (["a", "b"], ("a", "b")), (("x",), ("x",)),
])
def test_stop_is_normalised_to_a_tuple(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


def test_stop_token_ids_are_normalised_to_a_tuple():
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_sampling_params_are_frozen_and_hashable():
    p = SamplingParams(stop=["a"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.0
    assert hash(p) == hash(SamplingParams(stop=("a",))) and p == SamplingParams(stop="a")


BAD_SAMPLING = [
    ("n", 65), ("n", 0), ("n", True),
    ("temperature", -0.1), ("temperature", 100.5), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "1"), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan), ("top_p", None),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", 10.5), ("repetition_penalty", -1),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 3), ("frequency_penalty", math.nan),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2.0), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", 1.0),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", ["x" * 257]), ("stop", [1]),
    ("stop", ["s"] * (MAX_STOP_STRINGS + 1)),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", "ab"),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 1.0),
    ("seed", -1), ("seed", MAX_SEED + 1), ("seed", "7"),
    ("ignore_eos", 1), ("skip_special_tokens", None), ("include_stop_str_in_output", "yes"),
]


@pytest.mark.parametrize("field, value", BAD_SAMPLING, ids=[f"{f}={v!r}"[:40] for f, v in BAD_SAMPLING])
def test_invalid_sampling_field_names_itself(field, value):
    # a bad item of a list is named by its index too: stop.1, stop_token_ids.0
    with pytest.raises(InvalidRequestError, match=rf"^{field}(\.\d+)? must "):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(InvalidRequestError, match=r"^min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


def test_invalid_request_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0}, {"temperature": 100}, {"top_p": 1e-6}, {"top_k": -1}, {"top_k": 1},
    {"min_p": 1.0}, {"repetition_penalty": 10}, {"presence_penalty": -2}, {"frequency_penalty": 2},
    {"max_tokens": None}, {"max_tokens": 1, "min_tokens": 1}, {"logprobs": 0}, {"logprobs": MAX_LOGPROBS},
    {"seed": 0}, {"seed": MAX_SEED}, {"stop": ["x" * 256] * MAX_STOP_STRINGS},
    {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))},
])
def test_sampling_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("field, value", [("stop", 5), ("stop_token_ids", 7)])
def test_non_iterable_stop_values_are_invalid_requests(field, value):
    with pytest.raises(InvalidRequestError, match=rf"^{field} must be "):
        SamplingParams(**{field: value})


def test_auto_dtype_is_bfloat16_only_where_the_hardware_does_it_fast(monkeypatch):
    import torch

    from engine import runner

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # device names only: nothing touches a GPU
    monkeypatch.setattr(runner, "fast_bf16", lambda: False)
    assert runner.resolve_dtype("auto", cpu) == torch.float32
    assert runner.resolve_dtype("auto", cuda) == torch.bfloat16
    monkeypatch.setattr(runner, "fast_bf16", lambda: True)
    assert runner.resolve_dtype("auto", cpu) == torch.bfloat16
    assert runner.resolve_dtype("float32", cpu) == torch.float32


def test_cpu_flags_name_the_bfloat16_instructions(monkeypatch):
    from engine import cpu_features

    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert cpu_features.fast_bf16()
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert not cpu_features.fast_bf16()


@pytest.mark.parametrize("flags,isa,dtype", [
    ({"avx2", "fma"}, "avx2", "float32"),  # the AMD EPYC host of issue 46
    ({"avx2", "fma", "avx512f", "avx512_vnni"}, "avx512-vnni", "float32"),
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, "avx512", "bfloat16"),
    ({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}, "amx", "bfloat16"),
    ({"sse4_2"}, "scalar", "float32"),
])
def test_the_host_description_names_the_kernels_isa_and_the_default_dtype_the_runner_picks(monkeypatch, flags,
                                                                                          isa, dtype):
    import torch

    from engine import cpu_features, runner

    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    host = cpu_features.host_cpu()
    assert host["kernel_isa"] == isa and host["cpu_default_dtype"] == dtype
    assert str(runner.resolve_dtype("auto", torch.device("cpu"))) == f"torch.{dtype}"
    assert f"C++ kernels: {isa}" in cpu_features.describe_host() and dtype in cpu_features.describe_host()


@pytest.mark.parametrize("load_dir", ["adapters", "/", "//"])
def test_lora_load_dir_must_be_an_absolute_directory_other_than_root(load_dir):
    from deployments.app import AppConfig

    with pytest.raises(ValueError, match="lora_load_dir"):
        AppConfig(lora_load_dir=load_dir)


def test_app_config_engine_section_takes_speculative_config():
    from deployments.app import AppConfig

    spec = {"method": "ngram", "num_speculative_tokens": 4}
    assert AppConfig(engine={"speculative_config": spec}).engine == {"speculative_config": spec}
    with pytest.raises(ValueError, match="speculative_config.method must be 'ngram', 'draft_model' or 'eagle3', got 'medusa'"):
        AppConfig(engine={"speculative_config": {**spec, "method": "medusa"}})


def test_compiled_code_stays_out_of_a_shared_model_cache(monkeypatch, tmp_path):
    from engine.config import cache_dir

    monkeypatch.setenv("SLOTSERVE_CACHE", str(tmp_path / "shared"))
    monkeypatch.delenv("SLOTSERVE_CODE_CACHE", raising=False)
    assert cache_dir("inductor") == tmp_path / "shared" / "inductor"  # one machine: one place
    monkeypatch.setenv("SLOTSERVE_CODE_CACHE", str(tmp_path / "pod"))
    assert cache_dir("kernels") == tmp_path / "pod" / "kernels"
    assert cache_dir("inductor") == tmp_path / "pod" / "inductor"
    assert cache_dir("models") == tmp_path / "shared" / "models"
