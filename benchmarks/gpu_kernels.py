"""Kernel bandwidth: the Triton quantization kernels on one square BF16 input, bytes moved per
second against the device's HBM peak, each checked bit for bit against the emulation.

Bytes are what the kernels read and write: the input once per pass (the global
amax is its own pass unless given), the output, and the scales. The goal in
issue 30 is 60% of the HBM peak on 8192x8192. Each case is also run once on a
1024x1024 input (64x64 in a dry run) and compared with the PyTorch emulation on
CPU, which checks on the device what the CPU tests cannot: compiled code
against the reference.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from benchmarks.gpu_common import SectionContext, gpu_key, table

__all__ = ["BUDGET_S", "TITLE", "KernelResult", "hbm_peak", "markdown", "measure", "run"]

TITLE = "Kernel bandwidth"
BUDGET_S = 90
"""On an H100: six cases of 20 timed calls on 128 MiB, the launch-geometry sweep (20
compiles of a second or two and their ``do_bench`` runs), and the Triton compiles."""


@dataclass(frozen=True)
class KernelResult:
    """One kernel case: its traffic, median time, and the check against the emulation."""

    case: str
    shape: tuple[int, int]
    bytes_moved: int
    seconds: float
    bytes_per_second: float
    share_of_hbm_peak: float | None
    bit_exact: bool


def hbm_peak(device: torch.device) -> float | None:
    """The device's HBM bandwidth in bytes/s from factory's GPU table (SXM parts), or None
    for a device not in it."""
    from factory.schemas.parallelism import GPU_SPECS

    key = gpu_key(device)
    return None if key is None else GPU_SPECS[key].hbm_bytes_per_s


@dataclass(frozen=True)
class _Case:
    name: str
    run: Callable[[torch.Tensor, torch.Tensor], object]
    """The kernel on (input, its amax); returns device tensors."""
    reference: Callable[[torch.Tensor], object]
    """The emulation on the CPU input."""
    bytes_per_element: float
    """Input reads, output and scale writes per element of the BF16 input."""


def _cases() -> list[_Case]:
    from factory.kernels import fp8, nvfp4, triton_fp8, triton_nvfp4

    def packed(q: nvfp4.NVFP4Tensor) -> tuple:
        return q.data, q.scale.view(torch.uint8), q.amax

    bf16 = torch.bfloat16
    # bf16 input: 2 bytes a read; NVFP4 writes half a byte and a scale byte per 16 elements.
    return [
        _Case("nvfp4 quantize", lambda x, a: packed(triton_nvfp4.quantize(x)),
              lambda x: packed(nvfp4.quantize(x)), 2 + 2 + 0.5 + 1 / 16),
        _Case("nvfp4 quantize, given amax", lambda x, a: packed(triton_nvfp4.quantize(x, amax=a)),
              lambda x: packed(nvfp4.quantize(x)), 2 + 0.5 + 1 / 16),
        _Case("nvfp4 fake-quant to bf16",
              lambda x, a: triton_nvfp4.fake_quantize(x, out_dtype=bf16),
              lambda x: nvfp4.fake_quantize(x).to(bf16), 2 + 2 + 2),
        _Case("nvfp4 fake-quant to bf16, given amax",
              lambda x, a: triton_nvfp4.fake_quantize(x, amax=a, out_dtype=bf16),
              lambda x: nvfp4.fake_quantize(x).to(bf16), 2 + 2),
        _Case("mxfp8 fake-quant to fp32", lambda x, a: triton_fp8.fake_quantize_mxfp8(x),
              lambda x: fp8.quantize_mxfp8(x).dequantize(), 2 + 4),
        _Case("fp8 current scaling fake-quant to fp32",
              lambda x, a: triton_fp8.fake_quantize_tensorwise(x),
              lambda x: fp8.quantize_tensorwise(x).dequantize(), 2 + 2 + 4),
    ]  # fmt: skip


def _same(a: object, b: object) -> bool:
    """Equal bits (device results against CPU references)."""
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    a = a.cpu()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                     b.view(-1).view(torch.uint8))  # fmt: skip


def _seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of one call, each timed between device synchronizations."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()  # compile (or, under the interpreter, warm up) first
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def differences(got: object, expected: object, x: torch.Tensor) -> dict[str, object]:
    """How a result differs from its reference: elements (or bytes) whose bits differ and, for
    one tensor of the input's shape, the first few inputs with both values."""
    got_t = got[0] if isinstance(got, tuple) else got
    exp_t = expected[0] if isinstance(expected, tuple) else expected
    assert isinstance(got_t, torch.Tensor) and isinstance(exp_t, torch.Tensor)
    got_t, exp_t = got_t.cpu(), exp_t.cpu()
    if got_t.shape != exp_t.shape or got_t.dtype != exp_t.dtype:
        return {"shapes": [list(got_t.shape), list(exp_t.shape)]}
    wide = torch.int32 if got_t.element_size() == 4 else torch.int16
    width = wide if got_t.element_size() in (2, 4) else torch.uint8
    differ = got_t.view(width) != exp_t.view(width)
    found: dict[str, object] = {"differ": int(differ.sum()), "of": differ.numel()}
    if got_t.shape == x.shape:
        found["examples"] = [[float(a), float(b), float(c)] for a, b, c in
                             zip(x.cpu()[differ][:5], got_t[differ][:5], exp_t[differ][:5], strict=True)]  # fmt: skip
    return found


def check(case: _Case, small: torch.Tensor, device: torch.device) -> tuple[bool, dict]:
    """The kernel on ``small`` against the emulation on CPU; when they differ, also against the
    emulation run on the device (which tells a compiled kernel's bits from the device's
    arithmetic) and how."""
    on_device = small.to(device)
    got = case.run(on_device, _amax(on_device))
    if _same(got, case.reference(small)):
        return True, {}
    detail = {"vs_cpu_emulation": differences(got, case.reference(small), small)}
    if device.type == "cuda":
        device_reference = case.reference(on_device)
        detail["device_emulation_equals_cpu"] = _same(device_reference, case.reference(small))
        detail["vs_device_emulation"] = differences(got, device_reference, small)
    return False, detail


def measure(
    device: torch.device,
    size: int,
    check_size: int,
    repeats: int,
    ctx: SectionContext | None = None,
) -> list[KernelResult]:
    """Every case on a ``size x size`` BF16 input on ``device``; checked on ``check_size``
    (how a case differs goes into ``ctx``'s ``mismatches``)."""
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(size, size, generator=gen).to(torch.bfloat16).to(device)
    small = torch.randn(check_size, check_size, generator=gen).to(torch.bfloat16)
    peak = hbm_peak(device)
    results = []
    for case in _cases():
        exact, detail = check(case, small, device)
        if detail and ctx is not None:
            ctx.record("mismatches", {**ctx.results.get("mismatches", {}), case.name: detail})
        amax = _amax(big)
        seconds = _seconds(lambda case=case, amax=amax: case.run(big, amax), device, repeats)
        moved = int(case.bytes_per_element * size * size)
        rate = moved / seconds
        share = None if peak is None else rate / peak
        results.append(KernelResult(case.name, (size, size), moved, seconds, rate, share, exact))
    return results


def _amax(x: torch.Tensor) -> torch.Tensor:
    """The global amax as a split tensor's ranks would hand it over: fp32 [1]."""
    return x.abs().amax().float().reshape(1)


def run(ctx: SectionContext) -> None:
    """Every case at ``--size`` (8192; 64 in a dry run), checked on 1024 (64)."""
    size = ctx.results.get("size") or (64 if ctx.dry_run else 8192)
    kernels = measure(ctx.device, size, min(size, 1024), 1 if ctx.dry_run else 20, ctx)
    ctx.record("kernels", as_json(kernels))
    for kernel in kernels:
        if not kernel.bit_exact:
            ctx.fail(f"{kernel.case}: not bit-exact with the emulation on the device")
    ctx.record("geometry", [])
    for row in sweep(ctx.device, size, ctx.dry_run):
        ctx.record("geometry", [*ctx.results["geometry"], row])


#: Launch geometries tried: (rows, columns) of a program's block, warps.
GEOMETRIES = [(r, c, w) for r, c in ((32, 64), (64, 64), (32, 128), (64, 128), (16, 256))
              for w in (4, 8)]  # fmt: skip


def sweep(device: torch.device, size: int, dry_run: bool) -> Iterator[dict[str, object]]:
    """Bandwidth of the NVFP4 (given amax, BF16 out) and MXFP8 fake-quant kernels for each
    block shape and warp count in :data:`GEOMETRIES` (device time by ``triton.testing.do_bench``,
    its median): the data that picks the kernels' launch constants."""
    import triton.testing

    from factory.kernels import triton_fp8, triton_nvfp4

    x = torch.randn(size, size, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16).to(device)
    amax = _amax(x)
    peak = hbm_peak(device)
    kernels = {
        "nvfp4 fake-quant bf16, given amax": (triton_nvfp4, ("_BLOCK_ROWS", "_BLOCK_COLS"), 4,
            lambda: triton_nvfp4.fake_quantize(x, amax=amax, out_dtype=torch.bfloat16)),
        "mxfp8 fake-quant fp32": (triton_fp8, ("_ROWS", "_COLS"), 6,
            lambda: triton_fp8.fake_quantize_mxfp8(x)),
    }  # fmt: skip
    for name, (module, (rows_name, cols_name), bytes_per_element, call) in kernels.items():
        saved = (getattr(module, rows_name), getattr(module, cols_name), module.launch_options)
        try:
            for rows, cols, warps in GEOMETRIES[:2] if dry_run else GEOMETRIES:
                setattr(module, rows_name, rows)
                setattr(module, cols_name, cols)
                module.launch_options = lambda w=warps: {"enable_fp_fusion": False, "num_warps": w}
                if dry_run:
                    seconds = _seconds(call, device, 1)
                else:
                    seconds = triton.testing.do_bench(call, return_mode="median") / 1e3
                rate = bytes_per_element * size * size / seconds
                yield {"kernel": name, "block": [rows, cols], "warps": warps, "seconds": seconds,
                       "bytes_per_second": rate, "share_of_hbm_peak": peak and rate / peak}  # fmt: skip
        finally:
            setattr(module, rows_name, saved[0])
            setattr(module, cols_name, saved[1])
            module.launch_options = saved[2]


def markdown(results: dict) -> str:
    """The section's results as Markdown tables for BENCHMARKS.md."""
    kernels = [KernelResult(**{**k, "shape": tuple(k["shape"])}) for k in results["kernels"]]
    text = _table(kernels)
    if rows := results.get("geometry"):
        text += "\nLaunch geometry (device time, ``do_bench`` median):\n\n" + table(
            ["kernel", "block", "warps", "time ms", "GB/s", "of HBM peak"],
            [[r["kernel"], "x".join(map(str, r["block"])), r["warps"], r["seconds"] * 1e3,
              r["bytes_per_second"] / 1e9, r["share_of_hbm_peak"]] for r in rows],
        )  # fmt: skip
    for name, detail in results.get("mismatches", {}).items():
        text += f"\nMismatch, {name}: `{json.dumps(detail)[:600]}`\n"
    return text


def _table(results: list[KernelResult]) -> str:
    lines = [
        "| kernel | input | bytes moved | time | bandwidth | of HBM peak | bit-exact |",
        "|---|---|--:|--:|--:|--:|---|",
    ]
    for r in results:
        share = "n/a" if r.share_of_hbm_peak is None else f"{r.share_of_hbm_peak:.0%}"
        lines.append(
            f"| {r.case} | {r.shape[0]}x{r.shape[1]} bf16 | {_size(r.bytes_moved)} "
            f"| {r.seconds * 1e3:,.3f} ms | {r.bytes_per_second / 1e9:,.1f} GB/s | {share} "
            f"| {'yes' if r.bit_exact else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def as_json(results: list[KernelResult]) -> list[dict]:
    """The results as JSON-ready dicts."""
    return [asdict(r) for r in results]
