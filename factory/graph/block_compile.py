"""``torch.compile`` per residual block, for the blocks whose shapes the data cannot change.

Compiling block by block, as torchtitan does, keeps each graph small (it compiles in
seconds, and identical blocks share one compiled graph) and leaves the rest of the step
eager. Which blocks qualify is the layer type's ``static_shapes``: Mamba, attention and
the dense MLP do; the MoE block does not, because the router decides how many rows each
expert multiplies, and a graph traced for one routing would be retraced for the next.

On CPU the gain is inductor fusing the elementwise passes between the GEMMs into one
loop each (the Mamba mixer's conv, gating, decays and their gradients); the GEMMs stay
the same library calls. ``benchmarks/train_step.py --compile`` measures it.
"""

from __future__ import annotations

from torch import nn

from factory.graph.blocks import Block
from factory.graph.compile import Compiled
from factory.spec.layer_type import layer_type

__all__ = ["PRECISION_OFF", "compile_blocks", "compile_for_training"]

PRECISION_OFF = (
    "training.compile needs precision off: inductor cannot compile the quantized GEMMs' casts "
    "(FP8/FP4 emulation or Transformer Engine)"
)
"""Why compiled blocks are refused with a precision policy installed (the loop and
``factory train`` both say it)."""


def compile_blocks(model: nn.Module) -> list[str]:
    """Compile every :class:`Block` of ``model`` whose layer type has static shapes, in
    place; return their paths (``backbone.layers.0`` ...). The first step then pays the
    compile time (seconds per distinct block type); later steps with the same batch shape
    reuse the graphs. Blocks are compiled with ``dynamic=False``: a new batch shape compiles
    again, rather than every shape paying for symbolic sizes."""
    compiled = []
    for name, module in model.named_modules():
        if isinstance(module, Block) and layer_type(module.symbol).static_shapes:
            module.compile(dynamic=False)
            compiled.append(name)
    return compiled


def compile_for_training(compiled: Compiled) -> None:
    """``training.compile``: the blocks of ``compiled.model`` compiled, or ValueError when a
    precision policy is installed."""
    if compiled.precision is not None:
        raise ValueError(f"{PRECISION_OFF}; build with factory.compile(..., precision='off')")
    compile_blocks(compiled.model)
