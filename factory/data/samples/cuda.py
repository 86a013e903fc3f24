"""The ``cuda_kernel`` family: CUDA kernels paired with the PyTorch module they replace.

Records are ``{"id", "task", "op", "pytorch_reference", "cuda_kernel",
"messages", "verified", "benchmark": {"reference_ms", "kernel_ms"}, "shape",
"used_in", "meta": {"topic", "defect"}}``. ``task`` is ``generation`` (write a
kernel for the module) or ``repair`` (fix a kernel with a missing bounds check
or a missing ``__syncthreads``). ~15% are planted failures: ``unverified`` (the
kernel still has the bug) and ``slower`` (verified, but slower than PyTorch).
"""

from __future__ import annotations

import random
from string import Template

from factory.data.samples.common import assistant, plan_defects, reasoning_fields, used_in
from factory.data.samples.cuda_templates import BINARY, KERNELS, REFERENCE, UNARY

__all__ = ["cuda_kernel"]

_ASKS = (
    "Write a CUDA kernel and a host launcher (torch extension) that computes the same result as "
    "this PyTorch module, for float32 inputs.",
    "Replace this PyTorch module with a custom CUDA kernel. Inputs are contiguous float32 tensors.",
    "Implement the forward pass below as a CUDA C++ extension with a `__global__` kernel.",
)
_SHAPES = ((1024, 1024), (4096, 1024), (2048, 4096), (8192, 512), (16384, 256))
_BUG = {
    "unary": ("guard", "if (i < n) ", "", "the missing bounds check `if (i < n)`"),
    "binary": ("guard", "i < n", "i <= n", "the off-by-one loop bound `i <= n`"),
    "row_softmax": (
        "sync",
        "__syncthreads();",
        "",
        "the missing `__syncthreads()` before the reduction",
    ),
    "matmul": (
        "sync",
        "__syncthreads();",
        "",
        "the missing `__syncthreads()` after loading the tiles",
    ),
}


_ELEMENTWISE = {
    "unary": (UNARY, "Applies {op} elementwise.", "self, x: torch.Tensor", 1),
    "binary": (
        BINARY,
        "Elementwise {op} of two tensors.",
        "self, a: torch.Tensor, b: torch.Tensor",
        2,
    ),
}
"""Per elementwise family: its ops (CUDA and PyTorch templates), the reference module's
docstring and forward arguments, and how many inputs it takes."""


def _pair(r: random.Random) -> tuple[str, str, str, dict, tuple[int, ...]]:
    """(family, op, PyTorch reference, kernel template values, shape)."""
    family = r.choice(("unary", "unary", "binary", "row_softmax", "matmul"))
    rows, cols = r.choice(_SHAPES)
    alpha = f"{r.choice((0.01, 0.1, 0.2, 0.5, 2.0))}"
    values = {"threads": str(r.choice((128, 256, 512))), "tile": str(r.choice((16, 32)))}
    randn = f'torch.randn({rows}, {cols}, device="cuda")'
    if family in _ELEMENTWISE:
        ops, doc, args, operands = _ELEMENTWISE[family]
        op = r.choice(sorted(ops))
        cuda = Template(ops[op][0]).substitute(alpha=alpha + "f")
        ref = {
            "doc": doc.format(op=op),
            "args": args,
            "expr": Template(ops[op][1]).substitute(alpha=alpha),
            "inputs": ", ".join([randn] * operands),
        }
        values.update(op=op, cuda=cuda)
        shape: tuple[int, ...] = (rows, cols)
    elif family == "row_softmax":
        op = "row_softmax"
        ref = {
            "doc": "Softmax over the last dimension.",
            "args": "self, x: torch.Tensor",
            "expr": "torch.softmax(x, dim=-1)",
            "inputs": randn,
        }
        shape = (rows, cols)
    else:
        op, k = "matmul", r.choice((256, 512, 1024))
        ref = {
            "doc": "Matrix multiplication.",
            "args": "self, a: torch.Tensor, b: torch.Tensor",
            "expr": "a @ b",
            "inputs": f'torch.randn({rows // 4}, {k}, device="cuda"), torch.randn({k}, {cols // 4}, device="cuda")',
        }
        shape = (rows // 4, k, cols // 4)
    return family, op, Template(REFERENCE).substitute(ref), values, shape


def _kernel(family: str, values: dict, buggy: bool) -> str:
    slot, good, bad, _ = _BUG[family]
    text = Template(KERNELS[family]).substitute(
        {**values, "guard": "", "sync": "", slot: bad if buggy else good}
    )
    return "\n".join(
        line for line in text.split("\n") if line.strip() or not line
    )  # drop emptied slot lines


def _timing(r: random.Random, shape: tuple[int, ...], slower: bool) -> dict[str, float]:
    elements = 1
    for s in shape:
        elements *= s
    reference = round(max(0.012, elements * 8 / 2.0e9 * r.uniform(0.9, 1.4)), 4)
    speedup = r.uniform(0.45, 0.95) if slower else r.uniform(1.05, 2.8)
    return {"reference_ms": reference, "kernel_ms": round(reference / speedup, 4)}


def cuda_kernel(rng: random.Random, n: int) -> list[dict]:
    """Kernel generation and repair tasks with verification and timing fields."""
    plan = plan_defects(rng, n, {"unverified": 0.08, "slower": 0.07})
    records: list[dict] = []
    seen: set[tuple[str, str]] = set()
    while len(records) < n:
        i = len(records)
        defect = plan.get(i)
        family, op, reference, values, shape = _pair(rng)
        task = "repair" if rng.random() < 0.3 else "generation"
        kernel = _kernel(family, values, buggy=defect == "unverified")
        if (task + reference, kernel) in seen:  # no unplanned exact duplicates
            continue
        seen.add((task + reference, kernel))
        bug = _BUG[family][3]
        if task == "repair":
            prompt = (
                f"This CUDA kernel should match the PyTorch module below but gives wrong results on "
                f"some inputs. Find and fix the bug.\n\n```python\n{reference}```\n\n"
                f"```cuda\n{_kernel(family, values, buggy=True)}```"
            )
            reasoning = (
                f"Comparing with the reference, the problem is {bug}. Everything else looks right."
            )
        else:
            prompt = f"{rng.choice(_ASKS)}\n\n```python\n{reference}```"
            reasoning = (
                f"The module computes {op}. Inputs are float32 and contiguous, so one thread per element "
                "(or one block per row for reductions) is enough; I must keep the bounds checks and "
                "synchronise between shared-memory phases."
            )
        answer = (
            f"```cuda\n{kernel}```\n\nThe launcher checks that inputs are contiguous CUDA tensors."
        )
        records.append(
            {
                "id": f"cuda_kernel-{i:05d}",
                "task": task,
                "op": op,
                "pytorch_reference": reference,
                "cuda_kernel": kernel,
                "messages": [
                    {"role": "user", "content": prompt},
                    assistant(answer, reasoning_fields(rng, reasoning)),
                ],
                "verified": defect != "unverified",
                "benchmark": _timing(rng, shape, slower=defect == "slower"),
                "shape": list(shape),
                "used_in": used_in(rng),
                "meta": {"topic": family, "defect": defect},
            }
        )
    return records
