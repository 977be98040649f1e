"""The GGUF benchmarks (benchmarks.gguf_kernels, benchmarks.quantized, benchmarks.gguf_mix) run and
report what they claim, on tiny inputs."""

from __future__ import annotations

import gguf
import numpy as np

from tests.test_gguf_quant import MIXED, Q, _model_dir


def test_kernel_benchmark_times_every_type(tmp_path):
    import json

    from benchmarks.gguf_kernels import FLOAT32_TYPES, main
    out = tmp_path / "kernels.json"
    assert main(["--shape", "16,256", "--rows", "1,3", "--reps", "1", "--out", str(out)]) == 0
    table = json.loads(out.read_text())["ms_per_call"]
    assert set(table) == {"1", "3"} and set(FLOAT32_TYPES) | {"float32 dense"} <= set(table["1"])


def test_benchmark_compares_every_weight_format(tmp_path):
    import json

    from benchmarks.quantized import main
    from tests.factories import build_tokenizer
    _model_dir(tmp_path, MIXED, tie=False)
    build_tokenizer().save_pretrained(tmp_path)  # the benchmark's prompts are text
    out = tmp_path / "quantized.json"
    assert main(["--model", str(tmp_path), "--levels", "1,2", "--max-tokens", "4", "--rounds", "1", "--eager",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["systems"]) == {"dequantized", "gguf", "int8"}
    for name in ("gguf", "int8"):
        assert report["systems"][name]["weight_mib"] < report["systems"]["dequantized"]["weight_mib"]
        assert set(report["speedup"][name]) == {"1", "2"}
        quality = report["quality"][name]
        assert quality["prompts"] == 32 and 0 <= quality["identical_greedy_texts"] <= 32
        assert quality["perplexity_ratio"] > 0 and report["systems"][name]["quality"]["text_tokens"] > 100
    assert report["environment"]["host_cpu"]["kernel_isa"]


def test_benchmark_mix_writes_q6_k_that_gguf_reads_back(tmp_path):
    """benchmarks.gguf_mix's Q6_K quantizer: gguf's own de-quantizer gives back every weight within a
    step of its 16-weight sub-block (half a step, but where the int8 scale's rounding clips the largest),
    on average within 0.3 (uniform rounding: 0.25); a slip in the layout would be off by many steps."""
    from benchmarks.gguf_mix import quantize_q6_k, write_mix
    w = (np.random.default_rng(2).standard_normal((16, 512)) * 0.05).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q6_k(w), Q.Q6_K)
    step = np.abs(w).reshape(16, 32, 16).max(-1, keepdims=True) / 31
    err = np.abs(back - w).reshape(16, 32, 16)
    assert (err <= step * 1.01).all() and (err / step).mean() < 0.3
    _model_dir(tmp_path, MIXED, tie=False, hidden=256)
    types = write_mix(tmp_path / "model.gguf", tmp_path / "mix.gguf")
    assert types.get("Q6_K") == 2  # each layer's ffn_down
    reader = gguf.GGUFReader(tmp_path / "mix.gguf")
    assert {t.tensor_type.name for t in reader.tensors if "ffn_down" in t.name} == {"Q6_K"}


def test_step_floor_counts_the_bytes_a_decode_step_reads(tmp_path):
    """benchmarks.step_floor: every weight once a step, plus each running request's whole context of K
    and V in every layer (the tiny model: 2 layers, 2 KV heads of 16); the floor is those bytes over
    the measured bandwidth, and the linear layers are timed alone at each level."""
    import json

    import torch

    from benchmarks.step_floor import main
    _model_dir(tmp_path, MIXED, tie=False)
    out = tmp_path / "floor.json"
    assert main(["--model", str(tmp_path), "--levels", "1,3", "--prompt-len", "8", "--max-tokens", "4",
                 "--rounds", "1", "--read-mib", "64", "--options", '{"enforce_eager": true}', "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    element = torch.empty(0, dtype=getattr(torch, report["dtype"].removeprefix("torch."))).element_size()
    assert report["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * element
    bandwidth = report["read_bandwidth_gb_s"] * 1e9
    for level, row in report["levels"].items():
        # decode steps start with contexts of 9, 10 and 11 tokens (8 prompt, then 1 to 3 outputs)
        read = report["weight_bytes"] + int(level) * 10 * report["kv_bytes_per_token"]
        assert abs(row["bytes_per_step"] - read) < 1
        assert abs(row["floor_ms_per_step"] - read / bandwidth * 1e3) < 0.01 + 0.01 * row["floor_ms_per_step"]
        assert row["linear_layers_ms"] > 0 and row["linear_layers_gmac_s"] > 0
