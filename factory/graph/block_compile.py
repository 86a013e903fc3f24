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
"""

from __future__ import annotations

from torch import nn

from factory.graph.blocks import Block
from factory.spec.layer_type import layer_type

__all__ = ["compile_blocks"]


def compile_blocks(model: nn.Module, backend: str = "inductor") -> list[str]:
    """Compile every :class:`Block` of ``model`` its layer type says compiles, in place; return their paths (``backbone.layers.0`` ...). The first step then pays the
    compile time (seconds per distinct block type); later steps with the same batch shape
    reuse the graphs. Blocks are compiled with ``dynamic=False``: a new batch shape compiles
    again, rather than every shape paying for symbolic sizes. ``backend`` is torch.compile's
    (``aot_eager`` traces the same graphs without generating code: the GPU benchmark's dry
    run checks the compiled path on CPU with it, in seconds)."""
    compiled = []
    for name, module in model.named_modules():
        if isinstance(module, Block) and layer_type(module.symbol).compiles(module):
            module.compile(dynamic=False, backend=backend)
            compiled.append(name)
    return compiled
