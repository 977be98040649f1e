"""The default model's GGUF file with its ``ffn_down`` tensors (1536 inputs: whole 256-weight
super-blocks) re-quantized to Q6_K, as llama.cpp's Q4_K_M mix writes them, and the decode step timed
with those layers on the float32 kernel and on the int8 one (``quantization: gguf``), the two engines
alternating in one process:

    python -m benchmarks.gguf_mix --levels 1,16

``gguf`` has no k-quant quantizer, so ``quantize_q6_k`` is a plain one (a scale per 16 weights from
their largest magnitude, not llama.cpp's weighted search): right layout, honest values, for timing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

Q6K_TENSORS = "ffn_down"


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks [n, k / 256 x 210] of ``w`` [n, k]: per 16 weights a scale s = max|w| / 31, as
    an int8 multiple of the super-block's float16 d; q = round(w / s) + 32 in [0, 63]."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31  # [n, S, 16]
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16)
    d32 = d.astype(np.float32)
    sc = np.where(d32 > 0, np.round(scale / np.where(d32 > 0, d32, 1)), 0).clip(-128, 127).astype(np.int8)
    step = d32 * sc.astype(np.float32)
    q = np.where(step[..., None] != 0, np.round(sub / np.where(step[..., None] != 0, step[..., None], 1)), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, k // 256, 2, 4, 32)  # [half, 32-run j, l]
    ql = np.empty((n, k // 256, 2, 2, 32), np.uint8)  # runs 0, 2 in ql[0]'s nibbles, 1, 3 in ql[1]'s
    ql[:, :, :, 0] = (q[:, :, :, 0] & 15) | ((q[:, :, :, 2] & 15) << 4)
    ql[:, :, :, 1] = (q[:, :, :, 1] & 15) | ((q[:, :, :, 3] & 15) << 4)
    qh = sum(((q[:, :, :, j] >> 4) & 3) << (2 * j) for j in range(4)).astype(np.uint8)  # [n, S, 2, 32]
    blocks = np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8),
                             d.view(np.uint8).reshape(n, -1, 2)], axis=-1)
    return blocks.reshape(n, -1)


def write_mix(source: Path, out: Path) -> dict[str, int]:
    """``source`` with its ``Q6K_TENSORS`` as Q6_K; returns the count of tensors per type."""
    import gguf
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(out), "llama")
    types: dict[str, int] = {}
    for t in reader.tensors:
        kind, data = t.tensor_type, np.asarray(t.data)
        if Q6K_TENSORS in t.name and kind != gguf.GGMLQuantizationType.F32:
            dense = gguf.quants.dequantize(data, kind)
            kind, data = gguf.GGMLQuantizationType.Q6_K, quantize_q6_k(dense)
        types[kind.name] = types.get(kind.name, 0) + 1
        writer.add_tensor(t.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def _step_ms(engine, level: int, tokens: int, tag: str) -> float:
    from engine.sampling import SamplingParams
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(level):
        engine.add_request(list(range(100 + i, 228 + i)), params, request_id=f"{tag}-{i}")
    while not all(r.num_output_tokens for r in engine.scheduler.running) or len(engine.scheduler.running) < level:
        engine.step()
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) / max(steps, 1) * 1e3


def main(argv: list[str] | None = None) -> int:
    import engine.model.quant as quant
    from engine.cpu_features import host_cpu
    from engine.llm import LLM
    from engine.models_hub import resolve_gguf
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench-out/gguf_mix.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    mix = out.with_suffix(".gguf")
    types = write_mix(resolve_gguf("smollm2-135m", Path(), None), mix)
    engines = {}
    for name, int8_types in (("float32 kernel", tuple(t for t in quant.INT8_TYPES if t != "Q6_K")),
                             ("int8 kernel", quant.INT8_TYPES)):
        saved, quant.INT8_TYPES = quant.INT8_TYPES, int8_types
        try:
            engines[name] = LLM("smollm2-135m", quantization="gguf", gguf_file=str(mix), max_model_len=1024,
                                max_num_seqs=16, enforce_eager=True).engine
        finally:
            quant.INT8_TYPES = saved
    table: dict[int, dict[str, list[float]]] = {}
    for level in (int(v) for v in args.levels.split(",")):
        table[level] = {name: [] for name in engines}
        for r in range(args.rounds):
            for name, engine in engines.items():
                table[level][name].append(round(_step_ms(engine, level, args.max_tokens, f"{name}{level}{r}"), 2))
        print(f"{level} running: " + "  ".join(f"{n} {v} ms/step" for n, v in table[level].items()), flush=True)
    out.write_text(json.dumps({"environment": {"host_cpu": host_cpu()}, "types": types, "ms_per_step": table},
                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
