"""Which GPUs an engine replica runs on, through NVML (nvidia-ml-py), for Prometheus.

DCGM exporter publishes every GPU's utilisation, temperature, power and clocks with the labels
``gpu`` (index) and ``UUID``; a replica publishes which GPUs are its own under the same labels,
so PromQL joins the two (``DCGM_FI_DEV_GPU_UTIL * on (UUID) group_left (replica)
ray_slotserve_gpu_info``). Per GPU of the replica, on its metrics task:

- ``gpu_info`` = 1, labels ``UUID``, ``gpu``, ``pci_bus_id``, ``modelName`` (DCGM's names) and ``node``;
- ``gpu_memory_used_bytes``: the memory this process holds there (NVML's per-process count);
- ``gpu_memory_budget_bytes``: what the engine planned for (weights + KV pool).

A replica's GPUs are those where NVML lists its process; failing that (a container without the
host's PID namespace: NVML reports host PIDs) those in ``CUDA_VISIBLE_DEVICES``, without the
memory gauge. Without NVML or a GPU: one log line, no metric, no error.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    pci_bus_id: str
    name: str


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _held_bytes(nvml, handle, pid: int) -> int | None:
    """GPU memory ``pid`` holds on the device; None when it holds none there."""
    mine = [p for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == pid]
    if not mine:
        return None
    return sum(p.usedGpuMemory or 0 for p in mine)  # None: the driver cannot tell (counted as 0)


def _visible(nvml, handles: Sequence, visible: str | None) -> list:
    """The devices ``CUDA_VISIBLE_DEVICES`` names: indices, or (prefixes of) UUIDs."""
    if visible is None:
        return []
    uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
    out = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit() and int(entry) < len(handles):
            out.append(handles[int(entry)])
        elif entry:
            out.extend(h for h, uuid in zip(handles, uuids) if uuid.startswith(entry))
    return out


def find_devices(nvml, pid: int, visible: str | None) -> list[tuple[GpuDevice, Any]]:
    """``(device, handle)`` for each GPU this process uses (see the module docstring)."""
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    mine = [h for h in handles if _held_bytes(nvml, h, pid) is not None] or _visible(nvml, handles, visible)
    return [(GpuDevice(index=handles.index(h), uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                       pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(h).busId), name=_text(nvml.nvmlDeviceGetName(h))),
             h) for h in mine]


class GpuMonitor:
    """This replica's GPUs, found once; ``record`` reads their memory on the metrics task."""

    def __init__(self, nvml, devices: list[tuple[GpuDevice, Any]], pid: int, node: str) -> None:
        self._nvml = nvml
        self.devices = devices
        self._pid = pid
        self.node = node

    @classmethod
    def open(cls, pid: int | None = None) -> "GpuMonitor | None":
        """None (after one log line) when NVML is missing or this process uses no GPU."""
        try:
            import pynvml
        except ImportError:
            logger.info("no GPU metrics: nvidia-ml-py (pynvml) is not installed")
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            logger.info("no GPU metrics: NVML is not available (%s)", exc)
            return None
        pid = os.getpid() if pid is None else pid
        try:
            devices = find_devices(pynvml, pid, os.environ.get("CUDA_VISIBLE_DEVICES"))
        except pynvml.NVMLError as exc:
            devices, reason = [], f"NVML failed: {exc}"
        else:
            reason = "NVML lists no GPU memory of this process and CUDA_VISIBLE_DEVICES names no GPU"
        if not devices:
            logger.info("no GPU metrics: %s", reason)
            pynvml.nvmlShutdown()
            return None
        node = os.environ.get("NODE_NAME") or socket.gethostname()  # NODE_NAME: Kubernetes' downward API
        logger.info("GPU metrics for %s on %s", ", ".join(f"GPU {d.index} ({d.uuid})" for d, _ in devices), node)
        return cls(pynvml, devices, pid, node)

    def record(self, recorder, budget_bytes: int) -> None:
        """Gauges (see the module docstring); ``budget_bytes`` 0: the engine reports none."""
        for dev, handle in self.devices:
            tags = {"UUID": dev.uuid, "gpu": str(dev.index)}
            recorder.record("gpu_info", 1, {**tags, "pci_bus_id": dev.pci_bus_id, "modelName": dev.name,
                                            "node": self.node})
            used = _held_bytes(self._nvml, handle, self._pid)
            if used is not None:
                recorder.record("gpu_memory_used_bytes", used, tags)
            if budget_bytes:
                recorder.record("gpu_memory_budget_bytes", budget_bytes, tags)

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:  # already shut down
            pass
