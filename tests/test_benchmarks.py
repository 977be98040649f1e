"""The benchmark harness: workloads, its CLI, and end-to-end runs on a tiny model (what the
report computes and judges: tests/test_bench_report.py).

Nothing here is timed: the end-to-end run checks that every system did exactly the work
asked and that the JSON, table and plots come out, not how fast anything was.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.systems import DEFAULT_SYSTEMS, parse_systems
from benchmarks.workloads import (
    Arrival,
    BenchRequest,
    Mixture,
    build_requests,
    get_workload,
    schedule_bound,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- workloads
def test_mixed_workload_has_exact_shares_and_ranges():
    spec = get_workload("mixed", num_requests=100)
    reqs = build_requests(spec, vocab_size=512)
    outs = [r.output_len for r in reqs]
    assert sum(16 <= o <= 64 for o in outs) == 70
    assert sum(128 <= o <= 512 for o in outs) == 25
    assert sum(1024 <= o <= 2048 for o in outs) == 5
    assert all(16 <= len(r.prompt_token_ids) <= 1024 for r in reqs)
    assert all(4 <= t < 512 for r in reqs for t in r.prompt_token_ids)


def test_workload_is_seeded():
    spec = get_workload("mixed", num_requests=20)
    a, b = build_requests(spec, 512), build_requests(spec, 512)
    c = build_requests(get_workload("mixed", num_requests=20, seed=1), 512)
    assert a == b
    assert a != c


def test_shared_prefix_and_uniform_workloads():
    shared = build_requests(get_workload("shared-prefix", num_requests=5), 512)
    prefix = shared[0].prompt_token_ids[:768]
    assert all(r.prompt_token_ids[:768] == prefix for r in shared)
    assert len({r.prompt_token_ids for r in shared}) == 5
    uniform = build_requests(get_workload("uniform", num_requests=4), 512)
    assert {(len(r.prompt_token_ids), r.output_len) for r in uniform} == {(256, 128)}


def test_arrivals_burst_and_poisson():
    burst = build_requests(get_workload("tiny"), 512)
    assert {r.arrival_s for r in burst} == {0.0}
    spec = get_workload("tiny", num_requests=400, arrival=Arrival.parse("poisson:20"))
    times = [r.arrival_s for r in build_requests(spec, 512)]
    assert times == sorted(times) and times[0] > 0
    rate = len(times) / times[-1]
    assert 15 < rate < 25


def test_schedule_bound_counts_static_batches_against_the_continuous_floor():
    reqs = [BenchRequest(f"r{i}", (5,), out, 0.0) for i, out in enumerate([10, 1, 1, 1, 6, 6])]
    bound = schedule_bound(reqs, slots=2)
    # Static: batches (10, 1), (1, 1), (6, 6) -> 10 + 1 + 6 steps; continuous: longest 10 vs 25 / 2 -> 13.
    assert (bound["static_steps"], bound["continuous_steps_lower_bound"]) == (17, 13)
    assert bound["ratio"] == pytest.approx(17 / 13)


@pytest.mark.parametrize("text", ["poisson", "poisson:-1", "poisson:x", "uniform:3", ""])
def test_bad_arrival_is_rejected(text):
    with pytest.raises(ValueError, match="arrival"):
        Arrival.parse(text)


def test_bad_workload_inputs_are_rejected():
    with pytest.raises(ValueError, match="unknown workload"):
        get_workload("nope")
    with pytest.raises(ValueError, match="sum to 1"):
        Mixture(((0.5, 1, 2), (0.4, 3, 4)))
    with pytest.raises(ValueError, match="unknown system"):
        parse_systems("continuous,warp-drive")
    assert parse_systems(None) == list(DEFAULT_SYSTEMS)


@pytest.mark.parametrize("args", [["--num-requests", "0"], ["--threads", "two"], ["--workload", "huge"],
                                  ["--kv-cache-dtype", "fp8"]])
def test_cli_rejects_bad_arguments_before_doing_any_work(args, capsys):
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert args[0] in capsys.readouterr().err


def test_cli_rejects_a_bad_arrival_by_name(capsys):
    from benchmarks.__main__ import main

    assert main(["--quick", "--arrival", "poisson:fast"]) == 2
    assert "arrival rate must be a number" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end
@pytest.mark.slow
def test_harness_end_to_end_on_a_tiny_model(tmp_path, capsys):
    from benchmarks.__main__ import main
    from benchmarks.models import TINY_MODEL_SHAPE

    out = tmp_path / "out"
    in_process = [name for name in DEFAULT_SYSTEMS if not name.startswith("served")]  # the served app: own test
    # The engine profile has its own test below, in-process: one fresh interpreter fewer here.
    code = main(["--quick", "--workload", "tiny", "--out-dir", str(out), "--threads", "1", "--no-profile",
                 "--systems", ",".join(in_process), "--json-out", str(tmp_path / "r.json")])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    results = json.loads((tmp_path / "r.json").read_text())

    requests = build_requests(get_workload("tiny"), TINY_MODEL_SHAPE["vocab_size"])
    asked = {r.request_id: r.output_len for r in requests}
    assert results["workload"]["name"] == "tiny"
    assert set(results["systems"]) == set(in_process)
    for name, s in results["systems"].items():
        assert "error" not in s, (name, s)
        assert {r["id"]: r["output_tokens"] for r in s["requests"]} == asked, name
        assert s["output_tokens"] == s["requested_tokens"] == sum(asked.values()), name
        assert s["exact_output_lengths"] is True, name
        assert s["computed_tokens"] >= s["output_tokens"], name
        assert s["output_tokens_per_s"] > 0 and s["requests_per_s"] > 0, name
        for key in ("ttft_s", "itl_s", "e2e_s"):
            p = s[key]
            assert 0 <= p["p50"] <= p["p90"] <= p["p99"], (name, key, p)
        assert s["ttft_s"]["p99"] <= s["e2e_s"]["p99"], name
        # HF's continuous batching is only sampled every 50 ms, so a run this short may see it idle.
        low = 0 if name == "hf_generate_batch" else 1e-9
        assert low <= s["mean_slot_occupancy"] <= 1, name
        assert s["peak_rss_bytes"] > 10 * 2**20, name
    # The padded static batch computes the tail of every short request's row.
    assert results["systems"]["hf_generate"]["computed_tokens"] > results["systems"]["hf_generate"]["output_tokens"]
    for name in ("continuous", "static"):
        assert results["systems"][name]["preemptions"] == 0
        assert results["systems"][name]["computed_tokens"] == sum(asked.values())
    assert set(results["ratios"]) == {"static", "hf_generate", "hf_generate_batch"}
    assert len(results["targets"]) == 7  # the served app judged too (n/a here): share, TTFT p50, p99
    assert results["profile"] is None
    env = results["environment"]
    assert env["torch_threads"] == 1 and env["torch"] and env["transformers"]

    assert len(results["plots"]) == 3
    for path in results["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC
    for title in ("slotserve, continuous", "HF generate, padded", "targets"):
        assert title in stdout
    markdown = (tmp_path / "r.md").read_text()
    assert "| HF continuous (paged) |" in markdown and "failed" not in markdown
    assert np.isfinite(results["elapsed_s"])


def test_model_shape_benchmark_runs_on_random_weights_of_that_shape(tmp_path, capsys):
    from benchmarks.__main__ import main
    from benchmarks.models import MODEL_SHAPES

    code = main(["--model-shape", "tiny", "--workload", "tiny", "--systems", "continuous", "--no-profile",
                 "--threads", "1", "--out-dir", str(tmp_path / "out"), "--json-out", str(tmp_path / "r.json")])
    assert code == 0, capsys.readouterr().out
    results = json.loads((tmp_path / "r.json").read_text())
    asked = {r.request_id: r.output_len
             for r in build_requests(get_workload("tiny"), MODEL_SHAPES["tiny"][1]["vocab_size"])}
    run = results["systems"]["continuous"]
    assert {r["id"]: r["output_tokens"] for r in run["requests"]} == asked
    assert results["model"] == "tiny shape, random weights"
    from engine.cpu_features import fast_bf16  # the harness's auto dtype is the engine's own choice

    assert results["settings"]["dtype"] == ("bfloat16" if fast_bf16() else "float32")
    assert results["environment"]["device"] == "cpu"
    # The figures trace to the host kind: the kernels' ISA, and the default dtype this run used.
    host = results["environment"]["host_cpu"]
    assert host["kernel_isa"] and host["cpu_default_dtype"] == results["settings"]["dtype"]


def test_model_shapes_write_checkpoints_both_engines_load(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks import models
    from engine import LLM, SamplingParams

    monkeypatch.setattr(models, "SHARD_BYTES", 1 << 16)  # several shards and an index, like a hub checkpoint
    path = models.make_shaped_model_dir(tmp_path / "m", "tiny", "float32")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    ours = LLM(str(path), device="cpu", dtype="float32").generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = hf.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                       pad_token_id=0)[0, 3:].tolist()
    assert ours[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="model shape must be one of"):
        models.make_shaped_model_dir(tmp_path / "x", "llama-70b")


def test_cli_rejects_cuda_without_a_gpu_and_model_with_shape(capsys):
    from benchmarks.__main__ import main

    assert main(["--model", "x", "--model-shape", "tiny"]) == 2
    assert "--model or --model-shape" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert main(["--device", "cuda", "--model-shape", "tiny"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_engine_profile_shares_step_time_by_phase_at_each_level(tmp_path):
    from benchmarks.models import make_tiny_model_dir
    from benchmarks.profile import LEVELS, PHASES, run_profile
    from benchmarks.systems import BenchSettings

    settings = BenchSettings(str(make_tiny_model_dir(tmp_path / "m")), threads=1)
    done = []
    profile = run_profile(settings, steps=2, progress=done.append)
    assert len(done) == len(LEVELS)
    levels = profile["levels"]
    assert [lv["running"] for lv in levels] == [1, 8, 32, 64]
    for lv in levels:
        # Every measured step ran exactly the level's requests, all past prefill.
        assert lv["min_running"] == lv["max_running"] == lv["running"]
        assert set(PHASES) <= set(lv["seconds"])
        assert sum(lv["shares"].values()) == pytest.approx(1.0)
        assert 0 < lv["shares"]["forward"] < 1
        assert lv["outside_forward_share"] == pytest.approx(1 - lv["shares"]["forward"])


# ---------------------------------------------------------------- the served app (system "served")
def test_served_engine_gets_the_in_process_engine_options(tmp_path):
    import dataclasses

    from benchmarks.engine_systems import make_engine
    from benchmarks.models import make_tiny_model_dir
    from benchmarks.served_system import engine_options
    from benchmarks.systems import BenchSettings
    from engine.config import EngineConfig

    from engine.cpu_features import cpu_flags

    kv = "int8" if "avx512_vnni" in cpu_flags() else "auto"  # what --kv-cache-dtype int8 needs
    settings = BenchSettings(str(make_tiny_model_dir(tmp_path / "m")), max_num_seqs=8, num_kv_blocks=100, threads=1,
                             kv_cache_dtype=kv)
    served = EngineConfig.from_options(settings.model_dir, **engine_options(settings))
    assert served.cache.kv_cache_dtype == kv
    assert served.num_threads == 1
    # The in-process engine takes its thread count from the worker process instead.
    assert dataclasses.replace(served, num_threads=None) == make_engine(settings).config


def test_weights_only_model_gets_a_word_level_tokenizer(tmp_path):
    from benchmarks.models import make_tiny_model_dir
    from benchmarks.served_system import with_tokenizer
    from engine.tokenizer import load_tokenizer

    model = make_tiny_model_dir(tmp_path / "m")
    served_dir = with_tokenizer(str(model), tmp_path / "scratch")
    assert served_dir != str(model) and not (model / "tokenizer.json").exists()
    tok = load_tokenizer(served_dir)
    assert tok.vocab_size == 512 and tok.decode([5, 300, 7]) == "<t5> <t300> <t7>"
    assert tok.encode("<t5> <t300>") == [5, 300]
    assert with_tokenizer(served_dir, tmp_path / "again") == served_dir


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_served_app_runs_the_workload_through_grpc(tmp_path, capsys):
    from benchmarks.__main__ import main
    from benchmarks.models import TINY_MODEL_SHAPE

    # The default ingress only: the proxy mode differs by one flag, and its path is tests/test_serving_e2e.py's.
    code = main(["--quick", "--workload", "tiny", "--systems", "continuous,served_haproxy", "--threads", "1",
                 "--no-profile", "--out-dir", str(tmp_path / "out"), "--json-out", str(tmp_path / "r.json")])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    results = json.loads((tmp_path / "r.json").read_text())
    asked = {r.request_id: r.output_len
             for r in build_requests(get_workload("tiny"), TINY_MODEL_SHAPE["vocab_size"])}
    for name, ingress in [("served_haproxy", "haproxy")]:
        served = results["systems"][name]
        assert "error" not in served, served
        # Every streamed token counted on the client, exactly what was asked; warm-up and probe left out.
        assert {r["id"]: r["output_tokens"] for r in served["requests"]} == asked
        assert served["output_tokens"] == served["requested_tokens"] == served["computed_tokens"] == sum(asked.values())
        assert served["exact_output_lengths"] is True and served["preemptions"] == 0
        for key in ("ttft_s", "itl_s", "e2e_s"):
            assert 0 <= served[key]["p50"] <= served[key]["p90"] <= served[key]["p99"], key
        assert 0 <= served["mean_slot_occupancy"] <= 1
        notes = served["notes"]
        assert (notes["ingress"], notes["engine_link"]) == (ingress, True)
        added = notes["added_ttft_s"]
        assert added["requests"] == 100 and added["p50"] <= added["p90"] <= added["p99"]
        # gRPC, Ray and a proxy cannot be faster than the engine alone.
        assert added["served_ttft_s"]["p50"] > added["engine_ttft_s"]["p50"] > 0
        assert 0 < notes["serve_call_floor_s"]["p50"] <= notes["serve_call_floor_s"]["p90"]
        assert notes["peak_rss_tree_bytes"] > served["peak_rss_bytes"] and notes["processes_at_peak_rss"] > 3
        assert results["ratios"][name]["throughput_share"] > 0
    assert [t["status"] in ("reached", "missed") for t in results["targets"][-3:]] == [True] * 3
    for title in ("slotserve, via HAProxy",):
        assert title in stdout and f"| {title} |" in (tmp_path / "r.md").read_text()
    assert "added TTFT" in stdout


def test_async_engine_system_runs_every_request_to_its_length(tmp_path):
    from benchmarks.engine_systems import run_async_engine, run_continuous
    from benchmarks.models import make_tiny_model_dir, model_vocab_size
    from benchmarks.systems import BenchSettings

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    settings = BenchSettings(model_dir=str(model_dir), max_num_seqs=4, num_kv_blocks=256)
    requests = build_requests(get_workload("tiny"), model_vocab_size(model_dir))
    done = []
    run = run_async_engine(requests, settings, done.append)
    asked = {r.request_id: r.output_len for r in requests}
    assert {t.request_id: t.output_tokens for t in run.traces} == asked and len(done) == len(requests)
    assert run.computed_tokens == sum(asked.values())
    # The stepped engine's work: its requests may join a step or two later (they cross a thread).
    stepped = run_continuous(requests, settings, lambda n: None)
    assert stepped.notes["steps"] <= run.notes["steps"] <= stepped.notes["steps"] + len(requests)
    assert run.preemptions == stepped.preemptions == 0
    assert all(0 < t.ttft_s <= t.e2e_s for t in run.traces)
    assert 0 < max(o for _, o in run.occupancy) <= 1


def test_kernel_profile_reports_attentions_share_of_a_step(tmp_path):
    """benchmarks.kernels at one level on the tiny model, eager: the step's time, attention's share
    (the CPU kernel's ops), and the profiler's table listing them."""
    from benchmarks.engine_systems import make_engine
    from benchmarks.kernels import profile_level
    from benchmarks.models import make_tiny_model_dir
    from benchmarks.systems import BenchSettings

    settings = BenchSettings(model_dir=str(make_tiny_model_dir(tmp_path / "tiny")), max_num_seqs=4, num_kv_blocks=256)
    engine = make_engine(settings, enforce_eager=True)
    step_ms, share, table = profile_level(engine, 4, 6, "cpu", 30, prompt_len=40)
    assert step_ms > 0
    if engine.runner.backend.name == "cpu":  # the kernel library is built here
        assert 0 < share < 1 and "slotserve_cpu::paged_attention" in table, share
    else:
        assert share is None
    assert not engine.has_unfinished()
