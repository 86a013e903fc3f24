"""The kernel report of a training run: what its first lines say and ``train.json`` records.

The model's layer types answer for their operations (``factory.graph.kernel_report``);
the run adds what only the built model knows, each from one :data:`KernelSource`: whether
each layer type's blocks run compiled (``training.compile``; a type left eager says why),
the precision policy's GEMMs, and the LM head's loss.
A source is a function of the built model and the device, so adding one is one line in
:data:`KERNEL_SOURCES`, and nothing here asks which source it holds.
"""

from __future__ import annotations

from collections.abc import Callable

from factory.compilation import Compiled
from factory.graph.block_compile import compiled_with, kept_eager
from factory.graph.blocks import Block
from factory.graph.kernel_report import kernel_lines
from factory.graph.loss import loss_kernel
from factory.kernels.choice import KernelChoice
from factory.spec.layer_type import layer_type

__all__ = [
    "KERNEL_SOURCES",
    "KernelSource",
    "compiled_blocks",
    "head_loss",
    "precision_gemms",
    "run_kernel_lines",
]

KernelSource = Callable[[Compiled, str], list[tuple[str, KernelChoice]]]
"""(built model, device type) -> (name, choice) entries for the run's kernel report."""


def compiled_blocks(compiled: Compiled, device: str) -> list[tuple[str, KernelChoice]]:
    """Per layer type, how its blocks run: ``torch.compile`` with its backend, or eagerly,
    with the reason when ``training.compile`` asked for more (its shapes depend on the data)."""
    backends: dict[str, set[str | None]] = {}
    eager_why: dict[str, str | None] = {}
    kept: dict[str, str] = {}
    for module in compiled.model.modules():
        if isinstance(module, Block):
            kind = layer_type(module.symbol)
            backends.setdefault(kind.name, set()).add(compiled_with(module))
            eager_why[kind.name] = kind.eager_reason(module)
            if (why := kept_eager(module)) is not None:
                kept[kind.name] = why
    asked = compiled.blueprint.training.compile
    entries = []
    for name, used in backends.items():
        if name in kept:  # some or all of its blocks: the layout's rewrite does not trace
            compiled_too = sorted(b for b in used if b is not None)
            kernel = (
                f"eager (torch.compile ({compiled_too[0]}) elsewhere)" if compiled_too else "eager"
            )
            choice = KernelChoice("block", kernel, kept[name])
        elif used != {None}:
            kinds = ", ".join(sorted(b or "eager" for b in used))
            choice = KernelChoice("block", f"torch.compile ({kinds})")
        elif asked and eager_why[name] is not None:
            choice = KernelChoice("block", "eager", eager_why[name])
        else:
            choice = KernelChoice("block", "eager")
        entries.append((name, choice))
    return entries


def precision_gemms(compiled: Compiled, device: str) -> list[tuple[str, KernelChoice]]:
    """What runs each quantizing recipe's GEMMs (tensor cores or the emulation, and why)."""
    if compiled.precision is None:
        return []
    return [("precision", choice) for choice in compiled.precision.kernel_choices(device)]


def head_loss(compiled: Compiled, device: str) -> list[tuple[str, KernelChoice]]:
    """How the LM head and its loss run under the run's layout (fused and chunked, or not)."""
    layout = compiled.blueprint.parallelism
    return [("head", loss_kernel(compiled.blueprint.model, device, layout.tp, layout.pp))]


KERNEL_SOURCES: tuple[KernelSource, ...] = (compiled_blocks, precision_gemms, head_loss)


def run_kernel_lines(
    compiled: Compiled, device: str, sources: tuple[KernelSource, ...] = KERNEL_SOURCES
) -> list[str]:
    """The run's report on ``device`` (``"cuda"``, ``"cpu"``): the layer types' lines
    (``factory.graph.kernel_report.kernel_lines``), then each source's, in order."""
    extra = [entry for source in sources for entry in source(compiled, device)]
    return kernel_lines(compiled.blueprint.model, device, extra)
