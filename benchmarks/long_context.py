"""Long sequences on CPU: document-masked attention at 8k, 32k and 128k tokens, and the Nano
proxy trained on 32k-token sequences with context parallelism.

**Attention.** One attention call of the Nano proxy's shape (16 query heads, 1 KV head,
head dim 24, batch 1) over packed documents (lengths drawn with a fixed seed, 4,096 tokens
on average, so documents straddle every split), three ways:

* ``mask``: SDPA with the [S, S] boolean mask (factory's attention before issue 25, and its
  fallback under ``torch.compile``);
* ``flex``: ``torch.compile``'d FlexAttention with a document ``BlockMask`` (forward only:
  PyTorch has no FlexAttention backward on CPU, which is why factory's CPU path is not it);
* ``blocks``: factory's CPU path, mask-free blocks along the documents
  (``factory/kernels/document_attention.py``).

Each runs in a fresh process; reported are the forward time, the forward + backward time,
and the peak RSS growth over the inputs (the mask included; for ``flex``, from after the
compile, the block mask being a few KiB). The mask path
is skipped where its mask (S² bytes, and SDPA's float copy of it, 4·S²) would not fit in
half this machine's memory. ``flex`` and ``mask`` outputs are checked against ``blocks``.

**Context parallelism.** The Nano proxy (precision off) on one 32,768-token sequence per
step: one process, then CP=2 on two gloo processes (``benchmarks.distributed``'s step and
profiler: tokens/s and the share of the step spent in collectives).

``python -m benchmarks long_context [--lengths 8192,32768,131072] [--skip-proxy]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

HEADS, KV_HEADS, HEAD_DIM = 16, 1, 24
MEAN_DOCUMENT = 4096
METHODS = ("mask", "flex", "blocks")
PROXY_SEQ_LEN = 32768


def documents(length: int, mean: int = MEAN_DOCUMENT) -> torch.Tensor:
    """[1, length] document ids: lengths drawn from an exponential with mean ``mean``."""
    gen = torch.Generator().manual_seed(length)
    ids, position, doc = torch.empty(length, dtype=torch.int64), 0, 0
    while position < length:
        size = max(1, int(torch.empty(1).exponential_(1 / mean, generator=gen)))
        ids[position : position + size] = doc
        position, doc = position + size, doc + 1
    return ids[None]


def _status_mib(field: str) -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> float:
    """Restart the kernel's peak-RSS count here (Linux ``clear_refs``); the RSS now, MiB."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
        clear.write("5")
    return _status_mib("VmRSS")


def _peak_growth(since: float) -> float:
    return _status_mib("VmHWM") - since


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _kernel(method: str, length: int) -> dict[str, Any]:
    """One method at one length, in this (fresh) process."""
    import torch.nn.functional as F

    from factory.kernels.document_attention import QueryRun, attention_blocks, document_attention

    torch.manual_seed(0)
    q = torch.randn(1, HEADS, length, HEAD_DIM, requires_grad=True)
    k = torch.randn(1, KV_HEADS, length, HEAD_DIM, requires_grad=True)
    v = torch.randn(1, KV_HEADS, length, HEAD_DIM, requires_grad=True)
    ids = documents(length)
    base = _reset_peak()
    result: dict[str, Any] = {"documents": int(ids.max()) + 1}

    def blocks_forward() -> torch.Tensor:
        blocks = attention_blocks([QueryRun(0, 0, length)], ids, 1, length)
        return document_attention(q, k, v, blocks)

    if method == "blocks":
        forward = blocks_forward
    elif method == "mask":
        positions = torch.arange(length)
        mask = (positions[None, :] <= positions[:, None]) & (ids[0, :, None] == ids[0, None, :])

        def forward() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = ids[0]

        def document_causal(b: Any, h: Any, qi: Any, ki: Any) -> Any:
            return (qi >= ki) & (doc[qi] == doc[ki])

        start = time.perf_counter()
        block_mask = create_block_mask(
            document_causal, 1, 1, length, length, device="cpu", _compile=True
        )
        result["block_mask_s"] = time.perf_counter() - start
        compiled = torch.compile(flex_attention, dynamic=False)
        qd, kd, vd = q.detach(), k.detach(), v.detach()  # CPU FlexAttention refuses grads
        result["compile_s"] = _timed(
            lambda: compiled(qd, kd, vd, block_mask=block_mask, enable_gqa=True)
        )

        def forward() -> torch.Tensor:
            return compiled(qd, kd, vd, block_mask=block_mask, enable_gqa=True)

        forward()
        base = _reset_peak()  # Inductor's compile is not the kernel's memory

    with torch.no_grad():
        forward()  # warm-up
        result["forward_s"] = min(_timed(forward) for _ in range(2))
    if method != "flex":
        result["forward_backward_s"] = _timed(lambda: forward().sum().backward())
    result["peak_growth_mib"] = _peak_growth(base)
    if method != "blocks" and length <= 32768:
        with torch.no_grad():
            result["max_abs_diff_vs_blocks"] = (forward() - blocks_forward()).abs().max().item()
    return result


def _memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _attention(lengths: list[int]) -> None:
    print(f"attention: {HEADS} heads, {KV_HEADS} KV head, head dim {HEAD_DIM}, documents of "
          f"{MEAN_DOCUMENT} tokens on average")  # fmt: skip
    print(f"{'tokens':>7s} {'method':7s} {'docs':>5s} {'fwd s':>8s} {'fwd+bwd s':>10s} "
          f"{'peak MiB':>9s}  notes")  # fmt: skip
    for length in lengths:
        for method in METHODS:
            need = 5 * length**2
            if method == "mask" and need > _memory_bytes() / 2:
                print(f"{length:7d} {method:7s} skipped: the mask needs {need / 2**30:.0f} GiB "
                      f"(bool + SDPA's float copy), over half of this machine's memory")  # fmt: skip
                continue
            child = subprocess.run(
                [sys.executable, "-m", "benchmarks", "long_context", "--kernel", method,
                 str(length)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if child.returncode != 0:
                print(f"{length:7d} {method:7s} failed: {child.stderr.strip().splitlines()[-1]}")
                continue
            r = json.loads(child.stdout.strip().splitlines()[-1])
            notes = []
            if "compile_s" in r:
                notes.append(
                    f"block mask {r['block_mask_s']:.2f} s, compile {r['compile_s']:.1f} s"
                )
            if "max_abs_diff_vs_blocks" in r:
                notes.append(f"max |diff| vs blocks {r['max_abs_diff_vs_blocks']:.1e}")
            both = r.get("forward_backward_s")
            print(f"{length:7d} {method:7s} {r['documents']:5d} {r['forward_s']:8.3f} "
                  f"{'no CPU bwd' if both is None else f'{both:.3f}':>10s} "
                  f"{r['peak_growth_mib']:9.0f}  {'; '.join(notes)}", flush=True)  # fmt: skip


def _proxy(steps: int, warmup: int) -> None:
    import factory
    from benchmarks.distributed import measure_step
    from factory.distributed.local import run_ranks
    from factory.proxy import derive_proxy
    from factory.schemas.blueprint import Blueprint

    print(f"\nNano proxy (precision off), one {PROXY_SEQ_LEN}-token sequence per step")
    print(f"{'layout':12s} {'procs':>5s} {'tokens/s':>9s} {'step s':>7s} {'comm share':>10s}")
    for name, world in (("one process", 1), ("CP=2", 2)):
        data = derive_proxy(factory.load_blueprint("nano")).model_dump(exclude_unset=True)
        data["data"]["seq_len"] = PROXY_SEQ_LEN
        data["parallelism"].update(world_size=world, cp=world, tp=1, ep=1, etp=1,
                                   sequence_parallel=False, micro_batch_size=1,
                                   global_batch_size=1)  # fmt: skip
        bp = Blueprint.model_validate(data)
        if world == 1:
            torch.set_num_threads(1)  # as each rank of a launch is
            result = measure_step(0, 1, bp, steps, warmup)
        else:
            result = run_ranks(measure_step, world, bp, steps, warmup, timeout=3600)[0]
        print(f"{name:12s} {world:5d} {PROXY_SEQ_LEN / result['median_s']:9.0f} "
              f"{result['median_s']:7.2f} {result['comm_share']:10.0%}", flush=True)  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks long_context")
    parser.add_argument("--lengths", default="8192,32768,131072")
    parser.add_argument("--skip-proxy", action="store_true")
    parser.add_argument("--steps", type=int, default=2, help="timed proxy steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--kernel", nargs=2, metavar=("METHOD", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.kernel:
        print(json.dumps(_kernel(args.kernel[0], int(args.kernel[1]))))
        return 0
    from benchmarks.machine import describe

    print(f"machine: {describe()}; torch {torch.__version__}")
    _attention([int(n) for n in args.lengths.split(",")])
    if not args.skip_proxy:
        _proxy(args.steps, args.warmup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
