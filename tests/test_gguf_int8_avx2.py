"""The int8 GGUF kernel's AVX2 path (engine/csrc/gguf_int8_avx2.h) gives bitwise the outputs of its
AVX-512 VNNI path: the same activation rounding, the same int32 dot products, the same float steps.

On a host with VNNI the rest of the suite runs the VNNI path only, so here the kernel's source is
also built for Haswell (AVX2, FMA, F16C: what an AVX2-only host's ``-march=native`` enables) and run
in a subprocess, where its ops can register under the library's own names. On an AVX2-only host the
suite's own library is that path, and tests/test_gguf_quant.py checks it against HF there."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch

from engine import cpu_kernels
from engine.cpu_features import cpu_flags

if cpu_kernels.compiler_problem() is not None:
    pytest.skip(f"no CPU kernel library here: {cpu_kernels.compiler_problem()}", allow_module_level=True)
if "avx512_vnni" not in cpu_flags():
    pytest.skip("no AVX-512 VNNI: the suite's own kernel is the AVX2 path here", allow_module_level=True)

SOURCE = cpu_kernels.CSRC / "gguf_linear_int8.cpp"
HASWELL = tuple("-march=haswell" if flag == "-march=native" else flag for flag in cpu_kernels.CFLAGS)
RUN = r"""
import sys, torch
from torch.utils.cpp_extension import load
name, source, build, flags, inputs, out = sys.argv[1:]
load(name=name, sources=[source], extra_cflags=flags.split(), extra_ldflags=["-fopenmp"], build_directory=build,
     is_python_module=False, verbose=False)
ops = torch.ops.slotserve_cpu
assert ops.gguf_int8_ready(), "the Haswell build has no int8 path"
torch.save([ops.gguf_mm_packed(x, q, s, m, t, 1 << 16) for x, q, s, m, t in torch.load(inputs)], out)
"""


def _cases() -> list[tuple]:
    """Packed weights of 4 groups of 16 columns and 3 blocks (random bytes are valid quants, but for
    Q5_1's five bits), against every row count a tile of 4 (AVX2) or 8 (VNNI) leaves a remainder of, in
    float32 and in bfloat16 (whose outputs each path rounds on its own)."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    # Q4_0, Q4_1 (nibbles), Q5_1, Q8_0 (bytes), Q6_K (bytes, a scale per 16 weights)
    for qtype, group_bytes, halves in ((2, 256, 1), (3, 256, 1), (7, 512, 1), (8, 512, 1), (14, 512, 2)):
        quants = torch.randint(0, 32 if qtype == 7 else 256, (4, 3 * group_bytes), dtype=torch.uint8, generator=gen)
        scales = (torch.rand(4, 3 * 16 * halves, generator=gen) * 0.02).half()
        mins = (-torch.rand(4, 3 * 16, generator=gen) * 0.1).half()
        for rows in (1, 3, 4, 5, 8, 9, 17):
            x = torch.randn(rows, 96, generator=gen)
            cases += [(x, quants, scales, mins, qtype), (x.bfloat16(), quants, scales, mins, qtype)]
    return cases


def test_the_avx2_path_gives_the_vnni_paths_outputs_bitwise(tmp_path):
    digest = hashlib.sha256(SOURCE.read_bytes() + b"".join(h.read_bytes() for h in cpu_kernels.HEADERS)
                            + torch.__version__.encode() + " ".join(HASWELL).encode()).hexdigest()[:16]
    name = f"slotserve_gguf_int8_haswell_{digest}"
    build = cpu_kernels.kernel_dir() / name  # built once per machine, as the library is
    build.mkdir(parents=True, exist_ok=True)
    cases = _cases()
    torch.save(cases, tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", RUN, name, str(SOURCE), str(build), " ".join(HASWELL),
                    str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")], check=True, timeout=600)
    avx2 = torch.load(tmp_path / "out.pt")
    ops = cpu_kernels.load_kernel()
    assert ops.gguf_int8_ready()
    for (x, quants, scales, mins, qtype), got in zip(cases, avx2, strict=True):
        want = ops.gguf_mm_packed(x, quants, scales, mins, qtype, 1 << 16)
        assert got.shape == want.shape == (x.shape[0], 64)
        assert torch.equal(got, want), f"qtype {qtype}, {x.shape[0]} rows: max diff {(got - want).abs().max()}"
