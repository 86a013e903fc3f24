"""Compile every Triton quantization kernel for sm_90 without a GPU and print, as JSON, the fp32
instructions of each variant's PTX (run by tests/test_kernels_triton.py in a fresh process:
the kernels must be defined without TRITON_INTERPRET to compile)."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from factory.kernels import triton_fp8, triton_nvfp4, triton_tiles
from factory.kernels.triton_tiles import launch_options

_E4M3 = {"MANT": 3, "MIN_NORMAL": 2.0**-6, "MAGIC": 2.0**14, "MAX": 448.0}
_NVFP4 = {"RT": 32, "TR": 1, "NB": 4, "ROTATE": True, "ROUND_BF16": True}
VARIANTS = {
    "nvfp4 fake RN 16x16": (triton_nvfp4._fake_kernel, {
        "RT": 2, "TR": 16, "NB": 4, "ROTATE": False, "ROUND_BF16": False,
        "STOCHASTIC": False, "OUT_BF16": False}, {}),
    "nvfp4 fake SR RHT bf16": (triton_nvfp4._fake_kernel, {
        **_NVFP4, "STOCHASTIC": True, "OUT_BF16": True}, {"x_ptr": "*bf16", "out_ptr": "*i16"}),
    "nvfp4 pack SR": (triton_nvfp4._pack_kernel, {**_NVFP4, "STOCHASTIC": True},
                      {"data_ptr": "*u8", "scale_ptr": "*u8"}),
    "amax RHT": (triton_tiles._amax_kernel, _NVFP4, {"bad_ptr": "*i32"}),
    "fp8 tensorwise": (triton_fp8._tensorwise_kernel, {"BR": 32, "BC": 64, **_E4M3}, {}),
    "mxfp8": (triton_fp8._mxfp8_kernel, {"BR": 32, "NB": 2, "EMAX": 8, **_E4M3},
              {"bad_ptr": "*i32"}),
}  # fmt: skip


def fp32_instructions(kernel, constexprs: dict, pointers: dict) -> dict[str, int]:
    signature = {
        name: "constexpr"
        if name in constexprs
        else (pointers.get(name, "*fp32") if name.endswith("_ptr") else "i32")
        for name in kernel.arg_names
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch_options())
    assert compiled.asm["cubin"], "ptxas produced no cubin"
    ptx = compiled.asm["ptx"]
    ops = re.findall(r"\b([a-z]+(?:\.[a-z0-9]+)*\.f32)\b", ptx)
    # ``-x`` compiled as ``0 - x`` turns -0.0 into +0.0 (the interpreter negates): counted apart.
    ops += ["sub-from-zero"] * len(re.findall(r"sub\.\S*f32\s+%\w+,\s*0f00000000,", ptx))
    return dict(Counter(ops))


if __name__ == "__main__":
    json.dump({name: fp32_instructions(*v) for name, v in VARIANTS.items()}, sys.stdout)
