"""FP8 and INT4 weights on a GPU against bfloat16: one decoder layer's four products, then whole decode steps.

    python -m benchmarks.quant_gpu --model-shape llama-8b --levels 1,16 --json /tmp/quant.json

1. **Products.** The q/k/v, o, gate/up and down projections of one decoder layer at each number of
   rows: bfloat16 (``F.linear``, cuBLAS), FP8 W8A16 (the Triton kernel), FP8 W8A8 (activations
   per token, ``torch._scaled_mm``; compute capability 8.9+) and INT4 W4A16 (the Triton kernel).
   Several layers' weights rotate, so no product finds its weights in L2. Each reports the bytes
   of weights it reads per second. Before them, each candidate tile of both Triton kernels is timed
   (tensor-core tiles and, up to 16 rows, register tiles), and the fastest per number of rows goes to
   the engine's ``TUNED`` for the steps. On CUDA all of these are timed as replays of a CUDA graph.
2. **Decode steps.** The engine on random weights of the shape (bfloat16, then rounded at load
   with ``quantization: fp8`` and ``int4``), CUDA graphs on, eager modules unless ``--compile``, the
   same requests: milliseconds per decode step at each number of running requests, the weights'
   bytes and the KV pool they leave.

On a CPU (``--device cpu``, a small shape) it runs the same code in Triton's interpreter, which
checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

LAYER_PRODUCTS = ("qkv", "o", "gate_up", "down")


def _shapes(fields: dict) -> dict[str, tuple[int, int]]:
    """(out, in) features of each product of a decoder layer."""
    h, i = fields["hidden_size"], fields["intermediate_size"]
    d = h // fields["num_attention_heads"]
    qkv = (fields["num_attention_heads"] + 2 * fields["num_key_value_heads"]) * d
    return {"qkv": (qkv, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}


def _timer(device: str):
    import torch

    if device == "cuda":
        def timed(fn, reps: int) -> float:
            """Seconds per replay of ``fn`` captured in a CUDA graph, as the engine replays its decode
            steps. Timed eagerly, a Triton launch's host cost (tens of microseconds) and the split
            tiles' extra sum rank small products by the host's pace, not the GPU's."""
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # compiles the kernels first: a capture cannot
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / reps / 1000
        return timed

    def timed_cpu(fn, reps: int) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    return timed_cpu


def _candidates(m: int):
    from engine.model.triton_quant import Tile

    if m <= 16:
        # Register tiles (gemv) hold block_m x block_n x block_k float32 products: <= 64 a thread.
        gemv = [Tile(1, 64, 128, 4, 3, gemv=True), Tile(1, 32, 256, 4, 3, gemv=True),
                Tile(1, 128, 128, 8, 3, gemv=True), Tile(1, 64, 256, 8, 4, gemv=True)] if m == 1 else [
                Tile(2, 32, 128, 4, 3, gemv=True), Tile(4, 32, 64, 4, 3, gemv=True),
                Tile(4, 64, 64, 8, 3, gemv=True), Tile(8, 32, 64, 8, 3, gemv=True)]
        return [Tile(16, 64, 128, 4, 3), Tile(16, 64, 256, 4, 4), Tile(16, 128, 128, 4, 4), Tile(16, 32, 256, 4, 4),
                Tile(16, 64, 128, 8, 5), Tile(16, 64, 128, 4, 3, split=False)] + gemv
    if m <= 64:
        return [Tile(64, 64, 128, 4, 3), Tile(64, 128, 64, 4, 4), Tile(32, 64, 128, 4, 4), Tile(64, 64, 128, 4, 4, False)]
    return [Tile(64, 128, 64, 4, 3), Tile(128, 128, 64, 8, 3), Tile(64, 128, 128, 8, 3), Tile(128, 64, 64, 4, 4)]


def tune(fields: dict, rows: list[int], device: str, layers: int, reps: int) -> list[dict]:
    """Time each candidate tile of both kernels on the layer's products; the fastest per number of rows
    goes into engine.model.triton_quant.TUNED, which the decode steps then use."""
    import dataclasses

    import torch

    from engine.model import triton_quant
    from engine.model.gpu_quant import fp8_from_dense, int4_from_dense

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = _shapes(fields)
    gen = torch.Generator(device).manual_seed(1)
    dense = [{p: torch.randn(*shapes[p], generator=gen, device=device, dtype=dtype) * 0.02 for p in shapes}
             for _ in range(layers)]
    weights = {"fp8": [{p: fp8_from_dense(w) for p, w in layer.items()} for layer in dense],
               "int4": [{p: int4_from_dense(w) for p, w in layer.items()} for layer in dense]}
    del dense
    timed = _timer(device)
    found = []
    for kernel, held in weights.items():
        for m in rows:
            x = {p: torch.randn(m, shapes[p][1], device=device, dtype=dtype) for p in shapes}
            best = None
            for tile in _candidates(m):
                def run(tile=tile, held=held, x=x):
                    for layer in held:
                        for p, w in layer.items():
                            if kernel == "fp8":
                                triton_quant.fp8_mm(x[p], w.weight, w.scale, 1, w.in_features, tile)
                            else:
                                triton_quant.int4_mm(x[p], w.qweight, w.scales, w.zeros, w.group, tile)
                try:
                    us = timed(run, reps) / len(held) * 1e6
                except Exception as exc:  # a tile too large for the GPU's shared memory or registers
                    print(f"  {kernel} {m} rows {tile}: {type(exc).__name__}", flush=True)
                    continue
                found.append({"kernel": kernel, "rows": m, "tile": dataclasses.asdict(tile), "layer_us": us})
                if best is None or us < best[1]:
                    best = (tile, us)
            if best is not None:
                triton_quant.TUNED[(kernel, triton_quant.rows_bucket(m))] = best[0]
                print(f"{kernel} {m:4d} rows: best {best[0]} at {best[1]:.1f} us a layer", flush=True)
    return found


def products(fields: dict, rows: list[int], device: str, layers: int, reps: int) -> list[dict]:
    """Seconds per decoder layer's four products, per kind and number of rows."""
    import torch
    import torch.nn.functional as F

    from engine.model.gpu_quant import fp8_from_dense, int4_from_dense, scaled_mm_supported

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = _shapes(fields)
    gen = torch.Generator(device).manual_seed(0)
    dense = [{p: torch.randn(*shapes[p], generator=gen, device=device, dtype=dtype) * 0.02 for p in shapes}
             for _ in range(layers)]
    kinds = {"bf16": [{p: w for p, w in layer.items()} for layer in dense],
             "fp8 W8A16": [{p: fp8_from_dense(w) for p, w in layer.items()} for layer in dense],
             "int4 W4A16": [{p: int4_from_dense(w) for p, w in layer.items()} for layer in dense]}
    if scaled_mm_supported(torch.device(device)):
        kinds["fp8 W8A8 (_scaled_mm)"] = kinds["fp8 W8A16"]
    timed = _timer(device)
    results = []
    for kind, weights in kinds.items():
        nbytes = (sum(w.numel() * w.element_size() for w in weights[0].values()) if kind == "bf16"
                  else sum(w.nbytes() for w in weights[0].values()))
        for m in rows:
            x = {p: torch.randn(m, shapes[p][1], device=device, dtype=dtype) for p in shapes}

            def layer_pass(kind=kind, weights=weights, x=x):
                for layer in weights:
                    for p, w in layer.items():
                        if kind == "bf16":
                            F.linear(x[p], w)
                        else:
                            w.use_scaled_mm = kind.endswith("(_scaled_mm)")
                            w(x[p])
            seconds = timed(layer_pass, reps) / len(weights)
            results.append({"kind": kind, "rows": m, "layer_us": seconds * 1e6, "weight_bytes": nbytes,
                            "gb_per_s": nbytes / seconds / 1e9})
            print(f"{kind:24s} {m:5d} rows: {seconds * 1e6:9.1f} us a layer, {nbytes / 2**20:7.1f} MiB, "
                  f"{nbytes / seconds / 1e9:7.0f} GB/s", flush=True)
        for layer in weights:  # leave the FP8 weights on the W8A16 kernel for the next kind
            for w in layer.values():
                if kind != "bf16":
                    w.use_scaled_mm = False
    return results


def decode_steps(model_dir: str, levels: list[int], device: str, steps: int, quantizations: list[str | None],
                 prompt_len: int, compile_model: bool = False) -> list[dict]:
    import gc

    import torch

    from benchmarks.engine_systems import make_engine
    from benchmarks.kernels import _finish, _start
    from benchmarks.systems import BenchSettings

    dtype = "bfloat16" if device == "cuda" else "float32"
    settings = BenchSettings(model_dir, max_num_seqs=max(levels), block_size=16,
                             num_kv_blocks=max(levels) * -(-(prompt_len + 2 * steps + 32) // 16) + 1,
                             dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results = []
    for q in quantizations:
        t0 = time.perf_counter()
        engine = make_engine(settings, compile_model=compile_model, quantization=q)
        runner = engine.runner
        print(f"\n# {q or dtype}: loaded in {time.perf_counter() - t0:.1f} s, weights {runner.param_bytes / 2**30:.2f} "
              f"GiB, CUDA graphs {runner.graphs is not None}", flush=True)
        _finish(engine, _start(engine, 1, 4, engine.vocab_size, "warmup", prompt_len))
        for level in levels:
            ids = _start(engine, level, steps, engine.vocab_size, f"{q}-{level}", prompt_len)
            sync()
            t1 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync()
            ms = 1000 * (time.perf_counter() - t1) / steps
            _finish(engine, ids)
            forward = _replay_ms(runner.graphs, level, prompt_len + 2 * steps) if runner.graphs else None
            results.append({"quantization": q or dtype, "running": level, "step_ms": ms, "forward_ms": forward,
                            "weights_bytes": runner.param_bytes, "kv_blocks": runner.num_blocks})
            print(f"{q or dtype:9s} {level:4d} running: {ms:7.2f} ms a decode step"
                  + ("" if forward is None else f", {forward:.2f} ms its captured forward"), flush=True)
        del engine, runner
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def _replay_ms(graphs, batch: int, context: int, reps: int = 50) -> float | None:
    """Milliseconds per replay of the captured decode graph a step of ``batch`` rows at ``context``
    tokens would take: the forward alone, without the engine's host work around it."""
    import torch

    keys = sorted(k for k in graphs._graphs if k.batch >= batch and k.context >= context and not k.lora)
    if not keys:
        return None
    graph = graphs._graphs[keys[0]]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def ratios(steps: list[dict]) -> list[str]:
    """Each quantization's decode step over bfloat16's at the same number of running requests."""
    base = {r["running"]: r for r in steps if r["quantization"] in ("bfloat16", "float32")}
    out = []
    for r in steps:
        b = base.get(r["running"])
        if b is None or r is b:
            continue
        line = f"{r['quantization']} at {r['running']} running: {r['step_ms'] / b['step_ms']:.2f}x the dense step"
        if r.get("forward_ms") and b.get("forward_ms"):
            line += f", {r['forward_ms'] / b['forward_ms']:.2f}x its forward"
        out.append(line + f"; weights {r['weights_bytes'] / b['weights_bytes']:.2f}x, KV blocks {r['kv_blocks']}")
    return out


def main(argv: list[str] | None = None) -> None:
    from benchmarks.models import MODEL_SHAPES, make_shaped_model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="llama-8b")
    ap.add_argument("--rows", default="1,16,64,512", help="rows of the products, comma-separated")
    ap.add_argument("--levels", default="1,16", help="running requests of the decode steps, comma-separated")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4, help="layers' weights the products rotate through")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--skip-steps", action="store_true", help="products only")
    ap.add_argument("--compile", action="store_true",
                    help="decode steps of the compiled model (inductor fuses what lies between the products)")
    ap.add_argument("--no-tune", action="store_true", help="the kernels' default tiles, no search")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    fields = MODEL_SHAPES[args.model_shape][1]
    out = {"shape": args.model_shape, "device": args.device}
    if args.device == "cuda":
        import torch
        out["gpu"] = torch.cuda.get_device_name()
        out["torch"] = torch.__version__
    print(f"## one decoder layer's products, {args.model_shape} shape", flush=True)
    if not args.no_tune:
        print("## tiles tried", flush=True)
        out["tiles"] = tune(fields, [int(r) for r in args.rows.split(",")], args.device, args.layers, args.reps)
        from engine.model.triton_quant import TUNED
        out["tuned"] = {f"{k}/{m}": str(t) for (k, m), t in TUNED.items()}
    out["products"] = products(fields, [int(r) for r in args.rows.split(",")], args.device, args.layers, args.reps)
    if not args.skip_steps:
        with tempfile.TemporaryDirectory() as tmp:
            dtype = "bfloat16" if args.device == "cuda" else "float32"
            t0 = time.perf_counter()
            model_dir = make_shaped_model_dir(tmp, args.model_shape, dtype, args.device)
            print(f"\n## decode steps: random weights written in {time.perf_counter() - t0:.1f} s", flush=True)
            out["steps"] = decode_steps(str(model_dir), [int(x) for x in args.levels.split(",")], args.device,
                                        args.steps, [None, "fp8", "int4"], args.prompt_len, args.compile)
        out["ratios"] = ratios(out["steps"])
        print("\n" + "\n".join(out["ratios"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
