"""``torch.compile`` per residual block, for the blocks whose shapes the data cannot change.

Compiling block by block, as torchtitan does, keeps each graph small (it compiles in
seconds, and identical blocks share one compiled graph) and leaves the rest of the step
eager. Which blocks qualify is the layer type's ``compiles(block)``: Mamba, attention and
the dense MLP always do; the MoE block does where its dispatch is sync-free (the
``torch._grouped_mm`` path, verified for its device and dtype, no quantized expert GEMM
hook, no expert-parallel all-to-all). Elsewhere the router decides how many rows the padded
path multiplies, read on the host, and a graph traced for one routing would be retraced
for the next.

On CPU the gain is inductor fusing the elementwise passes between the GEMMs into one
loop each (the Mamba mixer's conv, gating, decays and their gradients); the GEMMs stay
the same library calls. ``benchmarks/train_step.py --compile`` measures it.

Under a parallel layout the blocks are compiled where torchtitan compiles them: after
tensor, expert and context parallelism have rewritten their modules and before FSDP2
wraps them (``factory.distributed.parallelize``), so each graph traces the block's
DTensor and sequence-parallel hooks and FSDP2's gathers stay outside it (its hooks are
never traced). The precision policy's quantized GEMMs run eagerly inside the compiled
blocks (``factory.precision.qlinear``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import nn

from factory.graph.blocks import Block
from factory.spec.layer_type import layer_type

__all__ = ["DEFAULT_BACKEND", "compile_blocks", "compiled_with", "kept_eager"]

DEFAULT_BACKEND = "inductor"
"""The backend ``training.compile`` uses. Multi-process tests set ``aot_eager`` in their
workers: it traces the same graphs without generating C++, in seconds."""

_BACKENDS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
"""The backend each block was compiled with, for the run's kernel report."""


_KEPT_EAGER: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
"""Why a block with static shapes was left eager (``compile_blocks``' ``keep_eager``)."""


def compiled_with(block: nn.Module) -> str | None:
    """The ``torch.compile`` backend ``block`` was compiled with by :func:`compile_blocks`;
    None when it runs eagerly."""
    return _BACKENDS.get(block) if block._compiled_call_impl is not None else None


def kept_eager(block: nn.Module) -> str | None:
    """Why :func:`compile_blocks` left ``block`` eager although its shapes are static (the
    caller's ``keep_eager`` reason); None otherwise."""
    return _KEPT_EAGER.get(block)


def compile_blocks(
    model: nn.Module,
    backend: str | None = None,
    keep_eager: Callable[[nn.Module], str | None] | None = None,
) -> list[str]:
    """Compile every :class:`Block` of ``model`` its layer type says compiles
    (``LayerType.compiles``), in place; return their paths (``backbone.layers.0`` ...). The first step then pays the
    compile time (seconds per distinct block type); later steps with the same batch shape
    reuse the graphs. Blocks are compiled with ``dynamic=False``: a new batch shape compiles
    again, rather than every shape paying for symbolic sizes. ``backend`` is torch.compile's
    (``aot_eager`` traces the same graphs without generating code: the GPU benchmark's dry
    run checks the compiled path on CPU with it, in seconds); None is
    :data:`DEFAULT_BACKEND`. A block compiled already is left as it is, so the training
    loop may call this again on a model its layout compiled. ``keep_eager`` gives the reason
    a block must stay eager (its layout's rewrite does not trace correctly), or None; a
    block kept eager once stays so when called again without it.
    """
    compiled = []
    for name, module in model.named_modules():
        if isinstance(module, Block) and layer_type(module.symbol).compiles(module):
            why = keep_eager(module) if keep_eager is not None else _KEPT_EAGER.get(module)
            if why is not None:
                _KEPT_EAGER[module] = why
                continue
            if module._compiled_call_impl is None:
                _BACKENDS[module] = backend or DEFAULT_BACKEND
                module.compile(dynamic=False, backend=_BACKENDS[module])
            compiled.append(name)
    return compiled
