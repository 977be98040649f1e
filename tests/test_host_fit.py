"""slotserve serve sizes CPU engine replicas to the host: replicas x threads never exceed the cores."""

from __future__ import annotations

import pytest

from deployments.app import AppConfig
from deployments.host_fit import fit_cpu_engines

AUTOSCALED = {"model": "m", "engine": {"max_num_seqs": 16},
              "autoscaling": {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2}}


@pytest.mark.parametrize("cores,replicas,threads", [(1, 1, 1), (2, 1, 2), (3, 1, 3), (4, 2, 2), (8, 4, 2),
                                                     (16, 4, 4)])
def test_engines_never_share_a_core(cores, replicas, threads):
    fitted, line = fit_cpu_engines(AUTOSCALED, cores)
    cfg = AppConfig.from_args(fitted)  # still a valid app
    assert cfg.autoscaling.max_replicas == replicas and cfg.engine_options["num_threads"] == threads
    assert replicas * threads <= max(cores, 1)
    assert cfg.autoscaling.min_replicas <= replicas and cfg.autoscaling.initial_replicas <= replicas
    assert f"up to {replicas} x {threads} torch threads on {cores} cores" in line
    assert ("max_replicas 4 -> " in line) == (replicas < 4)
    assert AUTOSCALED["autoscaling"]["max_replicas"] == 4  # the caller's dict is left alone


def test_fixed_replica_counts_are_capped_too():
    fitted, _ = fit_cpu_engines({"model": "m", "num_replicas": 3}, 2)
    assert fitted["num_replicas"] == 1 and fitted["engine"]["num_threads"] == 2


@pytest.mark.parametrize("args", [
    {"model": "m", "engine": {"num_threads": 1}, "num_replicas": 2},
    {"model": "m", "engine": {"device": "cuda"}},
    {"model": "m", "replica_resources": {"num_cpus": 1, "num_gpus": 1}},
], ids=["threads-given", "cuda", "gpu-replicas"])
def test_apps_that_choose_for_themselves_are_left_as_written(args):
    assert fit_cpu_engines(args, 2) == (args, None)


def test_the_default_config_runs_one_engine_with_both_cores_on_two():
    from deployments.cli import DEFAULT_CONFIG, load_serve_config

    app = load_serve_config(DEFAULT_CONFIG)["applications"][0]
    fitted, line = fit_cpu_engines(app["args"], 2)
    assert fitted["autoscaling"]["max_replicas"] == 1 and fitted["engine"]["num_threads"] == 2
