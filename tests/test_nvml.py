"""GPU mapping (deployments.nvml): which GPUs a replica runs on, labelled as DCGM exporter
labels its series. The mapping logic runs against a fake ``pynvml`` module; the path without
NVML runs for real on machines without a GPU; a ``gpu`` test reads a real GPU."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import types

import pytest

from deployments.contract import EngineRequest
from deployments.metrics import METRICS
from deployments.nvml import GpuMonitor
from deployments.replica import EngineReplica
from engine.sampling import SamplingParams

GIB = 1 << 30


class Recorder:
    enabled = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, dict]] = []

    def record(self, name, value, tags=None):
        assert name in METRICS, name
        assert set(tags or {}) <= set(METRICS[name].tags), (name, tags)
        self.calls.append((name, value, dict(tags or {})))

    def start_at_zero(self, name, tags=None):
        assert METRICS[name].kind == "counter", name

    def of(self, name: str) -> list[tuple[float, dict]]:
        return [(v, t) for n, v, t in self.calls if n == name]


def fake_nvml(processes: dict[int, list[tuple[int, int | None]]], fail_init: bool = False) -> types.ModuleType:
    """Two GPUs; ``processes``: GPU index -> [(pid, used bytes)]."""
    nvml = types.ModuleType("pynvml")
    uuids = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000"]

    class NVMLError(Exception):
        pass

    def init():
        if fail_init:
            raise NVMLError("Driver Not Loaded")
        nvml.initialized = True

    nvml.NVMLError = NVMLError
    nvml.initialized = False
    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: setattr(nvml, "initialized", False)
    nvml.nvmlDeviceGetCount = lambda: len(uuids)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    nvml.nvmlDeviceGetUUID = lambda h: uuids[h[1]].encode()  # older bindings return bytes
    nvml.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:{0x3B + h[1]:02X}:00.0")
    nvml.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in processes.get(h[1], [])]
    return nvml


@pytest.fixture
def with_nvml(monkeypatch):
    def install(nvml, visible: str | None = None):
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        monkeypatch.setenv("NODE_NAME", "gpu-node-7")
        return nvml
    return install


def test_a_replicas_gpu_is_where_nvml_lists_its_process(with_nvml):
    with_nvml(fake_nvml({0: [(111, 5 * GIB)], 1: [(111, GIB), (4242, 3 * GIB), (4242, None)]}), visible="0,1")
    monitor = GpuMonitor.open(pid=4242)
    devices = [(d.index, d.uuid, d.pci_bus_id) for d, _ in monitor.devices]
    assert devices == [(1, "GPU-bbbb2222-0000", "00000000:3C:00.0")]
    rec = Recorder()
    monitor.record(rec, budget_bytes=2 * GIB)
    tags = {"UUID": "GPU-bbbb2222-0000", "gpu": "1"}
    assert rec.of("gpu_info") == [(1, {**tags, "pci_bus_id": "00000000:3C:00.0", "modelName": "NVIDIA H100 80GB HBM3",
                                       "node": "gpu-node-7"})]
    assert rec.of("gpu_memory_used_bytes") == [(3 * GIB, tags)]  # its own process only; unknown counts 0
    assert rec.of("gpu_memory_budget_bytes") == [(2 * GIB, tags)]


@pytest.mark.parametrize("visible, index", [("GPU-bbbb", 1), ("0", 0), (" 1 ", 1)])
def test_without_its_process_in_nvml_the_visible_devices_say_which(with_nvml, visible, index):
    # NVML reports host PIDs; in a container with its own PID namespace ours is not among them.
    with_nvml(fake_nvml({0: [(1, GIB)], 1: [(2, GIB)]}), visible=visible)
    monitor = GpuMonitor.open(pid=4242)
    assert [d.index for d, _ in monitor.devices] == [index]
    rec = Recorder()
    monitor.record(rec, budget_bytes=GIB)
    assert [t["gpu"] for _, t in rec.of("gpu_info")] == [str(index)]
    assert rec.of("gpu_memory_used_bytes") == []  # not known
    assert len(rec.of("gpu_memory_budget_bytes")) == 1


@pytest.mark.parametrize("nvml, visible", [
    (fake_nvml({}), ""),             # Ray gives a CPU-only replica no GPU
    (fake_nvml({}), None),           # nothing says which GPU
    (fake_nvml({}, fail_init=True), "0"),
])
def test_no_gpu_of_its_own_is_one_log_line_and_no_metric(with_nvml, caplog, nvml, visible):
    with_nvml(nvml, visible=visible)
    with caplog.at_level(logging.INFO, logger="deployments.nvml"):
        assert GpuMonitor.open(pid=4242) is None
    assert len(caplog.records) == 1 and caplog.records[0].getMessage().startswith("no GPU metrics")
    assert not nvml.initialized  # shut down again (or never started)


def _serve_one(replica: EngineReplica) -> None:
    async def main():
        request = EngineRequest(request_id="r", prompt_token_ids=[3, 4, 5], params=SamplingParams(max_tokens=2))
        assert [m async for m in replica.generate(request)][-1].finish_reason == "length"
        replica.publish_metrics()
        await replica.shutdown()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_replica_publishes_its_gpu_against_the_engines_budget(with_nvml, tiny_model_dir):
    nvml = with_nvml(fake_nvml({1: [(os.getpid(), 7 * GIB)]}), visible="1")
    rec = Recorder()
    replica = EngineReplica(str(tiny_model_dir), {"dtype": "float32", "num_kv_blocks": 16}, metrics=rec)
    stats = replica.engine.stats()
    assert stats.weights_bytes > 0 and stats.kv_cache_bytes > 0
    _serve_one(replica)
    tags = {"UUID": "GPU-bbbb2222-0000", "gpu": "1"}  # once per metrics period (the replica's task, and ours)
    assert rec.of("gpu_memory_used_bytes") and all(c == (7 * GIB, tags) for c in rec.of("gpu_memory_used_bytes"))
    budget = stats.weights_bytes + stats.kv_cache_bytes
    assert rec.of("gpu_memory_budget_bytes") and all(c == (budget, tags) for c in rec.of("gpu_memory_budget_bytes"))
    assert {v for v, _ in rec.of("gpu_info")} == {1}
    assert not nvml.initialized  # released at shutdown


def _nvml_works() -> bool:
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_without_nvml_a_replica_logs_once_and_records_no_gpu_metric(tiny_model_dir, caplog, monkeypatch):
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)  # the real bindings, not a fake
    if _nvml_works():
        pytest.skip("NVML works on this machine: the path without it cannot run here")
    rec = Recorder()
    with caplog.at_level(logging.INFO, logger="deployments.nvml"):
        replica = EngineReplica(str(tiny_model_dir), {"dtype": "float32", "num_kv_blocks": 16}, metrics=rec)
        _serve_one(replica)
    assert [r.getMessage() for r in caplog.records if r.name == "deployments.nvml"] == [
        "no GPU metrics: NVML is not available (NVML Shared Library Not Found)"]
    assert rec.of("num_slots") and not [n for n, _, _ in rec.calls if n.startswith("gpu_")]


@pytest.mark.gpu
def test_real_gpu_memory_of_this_process():
    import torch

    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MiB held by this process
    monitor = GpuMonitor.open()
    assert monitor is not None and monitor.devices
    rec = Recorder()
    monitor.record(rec, budget_bytes=0)
    assert all(t["UUID"].startswith(("GPU-", "MIG-")) for _, t in rec.of("gpu_info"))
    assert sum(v for v, _ in rec.of("gpu_memory_used_bytes")) >= block.numel()
    monitor.close()
