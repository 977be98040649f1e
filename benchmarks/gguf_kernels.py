"""Time per call of one linear layer over GGUF blocks, per quant type and kernel, beside the dense
float32 layer (oneDNN), weights in cache:

    python -m benchmarks.gguf_kernels --rows 1,16

The default shape is the default model's ``ffn_down`` (576 x 1536). Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks are
``gguf``'s own quantization of a random weight; ``gguf`` has no k-quant quantizer, so Q4_K/Q6_K blocks
are random bytes of the real layout (``k_blocks``), with scales that give the weight's spread.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

FLOAT32_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K")


def k_blocks(w: np.ndarray, type_name: str, seed: int = 0) -> np.ndarray:
    """Random Q4_K or Q6_K super-blocks for a weight of ``w``'s shape, their values about ``w``'s spread."""
    import gguf
    rng = np.random.default_rng(seed)
    n, k = w.shape
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]
    blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    std = float(w.std())
    if type_name == "Q4_K":  # w = d sc q - dmin m: sc, m in [0, 64), q in [0, 16)
        d = np.float16(std / 240)
        blocks[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(d * 7.5).tobytes(), np.uint8)
    else:  # Q6_K: w = d sc (q - 32), sc an int8
        d = (rng.uniform(0.5, 1.5, (n, k // 256)) * std / 1024).astype(np.float16)
        blocks[..., 208:210] = d.view(np.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


def blocks_of(w: np.ndarray, type_name: str) -> np.ndarray:
    import gguf
    if type_name in ("Q4_K", "Q6_K"):
        return k_blocks(w, type_name)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])


def _ms(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def measure(n: int, k: int, rows: list[int], reps: int) -> dict:
    from engine.cpu_kernels import load_kernel
    from engine.model.quant import INT8_MAX_ROWS, INT8_TYPES, KERNEL_TYPES, PACKED_AS, QUANT_MAX_ROWS, pack_int8
    ops = load_kernel()
    w = (np.random.default_rng(1).standard_normal((n, k)) * 0.02).astype(np.float32)
    weights = {t: torch.from_numpy(blocks_of(w, t)) for t in FLOAT32_TYPES}
    packed = {t: pack_int8(weights[t].numpy(), t, k) for t in INT8_TYPES} if ops.gguf_int8_ready() else {}
    dense = torch.from_numpy(w)
    table: dict[int, dict[str, float]] = {}
    for m in rows:
        x = torch.randn(m, k)
        times = {t: _ms(lambda t=t: ops.gguf_mm(x, weights[t], KERNEL_TYPES[t][0], QUANT_MAX_ROWS), reps)
                 for t in FLOAT32_TYPES}
        times |= {f"{t} int8": _ms(lambda t=t: ops.gguf_mm_packed(x, *packed[t], KERNEL_TYPES[PACKED_AS.get(t, t)][0],
                                                                  INT8_MAX_ROWS), reps) for t in packed}
        times["float32 dense"] = _ms(lambda: torch.nn.functional.linear(x, dense), reps)
        table[m] = {name: round(ms, 4) for name, ms in times.items()}
        print(f"{m:>3} rows: " + "  ".join(f"{name} {ms:.3f}" for name, ms in table[m].items()) + " (ms)", flush=True)
    return table


def main(argv: list[str] | None = None) -> int:
    from engine.cpu_features import host_cpu
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="576,1536", help="out,in features (in: a multiple of 256)")
    parser.add_argument("--rows", default="1,16", help="comma-separated input rows")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args(argv)
    n, k = (int(v) for v in args.shape.split(","))
    if k % 256:
        parser.error(f"--shape: in features {k} is not a multiple of 256 (the k-quants' super-block)")
    table = measure(n, k, [int(r) for r in args.rows.split(",")], args.reps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": {"host_cpu": host_cpu()}, "shape": [n, k], "ms_per_call": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
