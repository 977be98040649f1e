"""Build the decoder for a checkpoint directory and load its safetensors weights.

Each parameter's loader gets a safetensors slice and reads only this rank's part, so a
tensor-parallel rank never holds a full copy of a sharded tensor.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from engine.attention import AttentionBackend
from engine.errors import ModelLoadError
from engine.model.arch import ModelArch
from engine.model.gpu_quant import QuantScheme
from engine.model.llama import DecoderForCausalLM, PACKED
from engine.model.quant_checkpoint import QuantCollector
from engine.parallel import ParallelGroup

logger = logging.getLogger(__name__)


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{path} lacks shard files named in its index: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(path: Path, arch: ModelArch, group: ParallelGroup, backend: AttentionBackend,
               dtype: torch.dtype, device: torch.device, max_positions: int,
               scheme: QuantScheme | None = None) -> DecoderForCausalLM:
    """``scheme``: the checkpoint's quantization (engine.model.gpu_quant), whose layers stay quantized."""
    from safetensors import SafetensorError, safe_open

    files = checkpoint_files(path)
    with _default_dtype(dtype), torch.device(device):
        model = DecoderForCausalLM(arch, group, backend, max_positions)
    params = dict(model.named_parameters())
    expected = {(n, None) for n in params if "qkv_proj" not in n and "gate_up_proj" not in n}
    for n in params:
        if "qkv_proj" in n:
            expected |= {(n, part) for part in ("q", "k", "v")}
        elif "gate_up_proj" in n:
            expected |= {(n, 0), (n, 1)}
    loaded: set[tuple[str, object]] = set()
    collector = None
    if scheme is not None:
        collector = QuantCollector(scheme, model)
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if collector is not None and collector.take(name, f):
                        continue
                    target = model.parameter_for(name)
                    if target is None:
                        continue
                    pname, part = target
                    param = params.get(pname)
                    if param is None:
                        logger.debug("ignoring checkpoint tensor %s", name)
                        continue
                    try:  # a lazy slice: the loader reads only this rank's part
                        param.weight_loader(param, f.get_slice(name), part)
                    except ValueError as exc:
                        raise ModelLoadError(f"{file.name}: {name}: {exc}") from exc
                    loaded.add((pname, part))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    if collector is not None:
        loaded |= collector.finish(device, dtype)
    missing = sorted(f"{n}[{p}]" if p is not None else n for n, p in expected - loaded)
    if missing:
        raise ModelLoadError(f"{path} lacks weights for: {', '.join(missing[:10])}"
                             f"{' ...' if len(missing) > 10 else ''}")
    return model.eval()


__all__ = ["PACKED", "checkpoint_files", "load_model"]
