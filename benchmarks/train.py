"""The training step of a preset's CPU proxy, split into its parts, with checkpoint costs.

The step is :class:`factory.runtime.trainer.Trainer`'s, mirrored here with a clock
around each part (the library is not instrumented):

* **data**: ``next()`` on a :class:`~factory.runtime.loader.ShardLoader` over
  a real built folder (the preset's recipe packed at the proxy's seq_len by
  :func:`~factory.runtime.batches.build_shards`), once per micro-batch: the
  time the step waits for its input, with the loader's prefetch thread running
  as in training. The loader's own rate, with nothing else running, is
  measured separately (one epoch read back to back);
* **forward**: per micro-batch, the model and
  :func:`~factory.graph.loss.language_model_loss`, weighted as
  :func:`~factory.runtime.step.forward_backward` does (checked against it
  before timing, both from the same RNG and rounding state: same loss, same
  gradients);
* **backward**: ``loss.backward()`` per micro-batch;
* **optimizer**: :class:`~factory.runtime.optimizer.MasterOptimizer`'s learning
  rate, zero_grad, grads to masters, global-norm clip, AdamW step, then the
  expert-bias update;
* **monitors**: MaxVio and the stability monitors' ``observe``.

Checkpoints (:class:`~factory.runtime.checkpoint.Checkpointer`, keep 1, state
from :func:`~factory.runtime.run_state.snapshot`, Adam moments present) are
taken after the warm-up, and in each repeat, three ways:

* **sync**: ``snapshot`` + ``save()`` with ``async_save=False``: the step is
  blocked for all of it (DCP write, fsync, rename, prune); a ``clone()`` of
  the whole state is then timed alone, for scale;
* **async, idle**: ``snapshot`` + ``save()`` with ``async_save=True`` (clones
  the state, DCP stages it and hands it to its writer thread), then the
  background write waited for with nothing else running, then ``wait()``
  (what the loop's ``poll()`` does on the training thread once the write is
  done: ``rank0.pt``, ``meta.json``, fsync, rename, prune);
* **async, under training**: the same ``save()``, then the repeat's training
  steps run while the writer thread writes; the write's end is stamped by a
  callback on its future and ``poll()`` runs after every step, as in the
  loop. Steps that started before the write ended are reported apart.

Every cost is also given per training step at the blueprint's
``checkpoint_interval`` and at the proxy's.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.machine import describe
from benchmarks.timing import load_average
from benchmarks.train_checkpoint import Saves, save_async_idle, save_sync, steps_under_async_save

PARTS = ("data", "forward", "backward", "optimizer", "monitors")
LABELS = {
    "data": "data (waiting on `ShardLoader`)",
    "forward": "forward (model + loss)",
    "backward": "backward",
    "optimizer": "optimizer (masters, clip, AdamW, expert bias)",
    "monitors": "monitors (MaxVio, stability)",
}


class Trainer:
    """The loop's state and its step, with a clock around each part."""

    def __init__(self, compiled: Any, data: Path, seed: int) -> None:
        from factory.graph.loss import mtp_loss_scale
        from factory.runtime.loader import ShardLoader
        from factory.runtime.monitors import Monitors
        from factory.runtime.optimizer import MasterOptimizer
        from factory.runtime.run_state import Position

        bp = compiled.blueprint
        self.compiled, self.model = compiled, compiled.model
        self.optimizer = MasterOptimizer(self.model, bp.training.optimizer)
        self.monitors = Monitors(bp.training.stability)
        self.position = Position()
        par = bp.parallelism
        self.accumulation = par.global_batch_size // par.micro_batch_size
        self.loader = ShardLoader(data, par.micro_batch_size, seed=seed)
        self.stream = iter(self.loader)
        clip = bp.training.optimizer.grad_clip
        self.clip = clip if clip is not None else math.inf
        self.mtp_scale = mtp_loss_scale(bp.model)
        self.loss_average = bp.training.objective.loss_average
        self.run_steps, self.training = bp.training_steps, bp.training
        torch.manual_seed(seed)
        self.model.train()

    def micro_batches(self) -> list[Any]:
        micro = [next(self.stream) for _ in range(self.accumulation)]
        self.position.consumed = self.loader.position
        return micro

    def forward_backward(self, micro: list[Any], clock: dict[str, float]) -> Any:
        """:func:`factory.runtime.step.forward_backward`, line for line, timing its halves."""
        from factory.graph.loss import language_model_loss, micro_batch_share
        from factory.runtime.step import StepOutcome

        counts = [
            micro_batch_share(batch.loss_mask, batch.document_ids, self.loss_average)
            for batch in micro
        ]
        outcome = StepOutcome()
        rms: dict[str, torch.Tensor] = {}
        for batch, count in zip(micro, counts, strict=True):
            start = time.perf_counter()
            weight = count / max(1, sum(counts))
            output = self.model(batch.input_ids, batch.document_ids, logits=False)
            for name, tokens in output.tokens_per_expert.items():
                previous = outcome.tokens_per_expert.get(name)
                outcome.tokens_per_expert[name] = tokens if previous is None else previous + tokens
            for name, value in output.residual_rms.items():
                rms[name] = rms[name] + value if name in rms else value
            losses = language_model_loss(
                output,
                batch.input_ids,
                batch.loss_mask,
                mtp_loss_scale=self.mtp_scale,
                document_ids=batch.document_ids,
                loss_average=self.loss_average,
            )
            aux = losses.aux if losses.aux is not None else losses.total.new_zeros(())
            loss = weight * (losses.total - aux) + aux / len(micro)
            middle = time.perf_counter()
            loss.backward()
            outcome.loss += loss.item()
            outcome.lm_loss += weight * losses.lm.item()
            outcome.tokens += batch.num_tokens
            clock["forward"] += middle - start
            clock["backward"] += time.perf_counter() - middle
        outcome.residual_rms = {name: float(total) / len(micro) for name, total in rms.items()}
        return outcome

    def check_mirror(self) -> tuple[float, float]:
        """(|loss difference|, max |gradient difference|) of the mirror vs the library on the
        same micro-batches; the weights are not stepped and the data position is kept."""
        from factory.runtime.step import forward_backward

        precision = self.compiled.precision
        consumed = self.loader.position
        micro = self.micro_batches()
        # both passes draw the same stochastic rounding and dropout numbers
        rng = torch.get_rng_state()
        rounding = copy.deepcopy(precision.state_dict()) if precision is not None else None
        self.optimizer.zero_grad()
        theirs = forward_backward(self.model, micro, self.mtp_scale, None, self.loss_average)
        grads = [None if p.grad is None else p.grad.clone() for p in self.optimizer.params]
        self.optimizer.zero_grad()
        torch.set_rng_state(rng)
        if precision is not None:
            precision.load_state_dict(rounding)
        ours = self.forward_backward(micro, dict.fromkeys(PARTS, 0.0))
        diff = 0.0
        for param, grad in zip(self.optimizer.params, grads, strict=True):
            if (param.grad is None) != (grad is None):
                return abs(ours.loss - theirs.loss), math.inf
            if grad is not None:
                diff = max(diff, (param.grad - grad).abs().max().item())
        self.optimizer.zero_grad()
        self.loader.seek(consumed)
        self.stream = iter(self.loader)
        self.position.consumed = consumed
        return abs(ours.loss - theirs.loss), diff

    def step(self) -> dict[str, float]:
        """One optimizer step as the loop takes it; seconds per part and in all."""
        from factory.runtime.callbacks import StepStats
        from factory.runtime.schedule import learning_rate

        clock = dict.fromkeys(PARTS, 0.0)
        p = self.position
        start = time.perf_counter()
        self.optimizer.set_lr(learning_rate(p.step % self.run_steps, self.run_steps, self.training))
        self.optimizer.zero_grad()
        mark = time.perf_counter()
        clock["optimizer"] += mark - start
        micro = self.micro_batches()
        clock["data"] += time.perf_counter() - mark
        outcome = self.forward_backward(micro, clock)
        mark = time.perf_counter()
        self.optimizer.grads_to_masters()
        grad_norm = nn.utils.clip_grad_norm_(self.optimizer.masters, self.clip).item()
        after_clip = time.perf_counter()
        finite = math.isfinite(outcome.loss) and math.isfinite(grad_norm)
        stats = StepStats(
            p.update, p.step, outcome.loss, grad_norm, finite, outcome.max_vio(),
            outcome.residual_rms,
        )  # fmt: skip
        self.monitors.observe(stats)  # a benchmark takes no action on what they say
        after_monitors = time.perf_counter()
        self.optimizer.step()
        self.model.update_expert_biases(outcome.tokens_per_expert)
        p.tokens_seen += outcome.tokens
        if self.compiled.precision is not None:
            self.compiled.precision.on_tokens(p.tokens_seen)
        p.step += 1
        p.update += 1
        end = time.perf_counter()
        clock["optimizer"] += (after_clip - mark) + (end - after_monitors)
        clock["monitors"] += after_monitors - after_clip
        clock["step"] = end - start
        return clock

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        from factory.runtime.monitors import Monitors
        from factory.runtime.run_state import snapshot

        data_state = {**self.loader.state_dict(), "consumed": self.position.consumed}
        states = {Monitors.state_key: self.monitors.state_dict()}
        return snapshot(self.compiled, self.optimizer, states, self.position, data_state)


def loader_alone(data: Path, micro: int, seed: int) -> float:
    """Samples/s of a fresh ShardLoader read back to back for one epoch (first batch excluded)."""
    from factory.runtime.loader import ShardLoader

    with ShardLoader(data, micro, seed=seed) as loader:
        batches = loader.samples_per_epoch // micro
        next(loader)
        start = time.perf_counter()
        for _ in range(batches - 1):
            next(loader)
        return (batches - 1) * micro / (time.perf_counter() - start)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _spread(values: list[float]) -> str:
    return f"{_ms(min(values))} to {_ms(max(values))}" if values else "-"


def report(
    steps: list[dict[str, float]],
    saves: Saves,
    tokens: int,
    intervals: dict[str, int],
    loader_rate: float,
    global_batch: int,
) -> None:
    step = _median([s["step"] for s in steps])
    total = sum(s["step"] for s in steps)
    print(f"\nstep: {len(steps)} timed steps of {tokens:,} tokens; share = of their summed time")
    print("| part | median per step | share |\n|---|---:|---:|")
    for part in PARTS:
        share = sum(s[part] for s in steps) / total
        print(f"| {LABELS[part]} | {_ms(_median([s[part] for s in steps]))} | {share:.1%} |")
    print(f"| **whole step** | **{_ms(step)}** | {tokens / step:,.0f} tokens/s |")
    print(
        f"(step min {_ms(min(s['step'] for s in steps))}, max {_ms(max(s['step'] for s in steps))})"
    )
    per_step = global_batch / loader_rate
    print(
        f"loader alone (one epoch, nothing else running): {loader_rate:,.0f} samples/s, "
        f"{_ms(per_step)} per step's {global_batch} samples = {per_step / step:.2%} of the step"
    )

    sync = _median(saves.sync)
    snap = _median(saves.snapshot)
    call = _median(saves.async_call)
    finish = _median(saves.async_finish)
    blocking = snap + call + finish
    overlapped = saves.overlapped_steps
    slowdown = sum(t - step for t in overlapped) / max(1, len(saves.async_write_training))
    names = list(intervals)
    head = " | ".join(f"per step, every {intervals[n]} ({n})" for n in names)
    print(
        f"\ncheckpoint: {saves.size / 2**20:,.0f} MiB each; medians of {len(saves.sync)} sync "
        f"and {len(saves.async_call)} async saves"
    )
    print(f"| checkpoint | time | {head} |\n|---|---:|" + "---:|" * len(names))

    def row(label: str, seconds: float, amortize: bool = True) -> None:
        cells = " | ".join(
            f"{_ms(seconds / n)} ({seconds / n / step:.2%})" if amortize else "-"
            for n in intervals.values()
        )
        print(f"| {label} | {_ms(seconds)} | {cells} |")

    row("sync: blocks the step (snapshot, DCP write, fsync, rename, prune)", sync)
    row("async: blocks the step (snapshot + `save()` + `poll()` finish)", blocking)
    row("  of which `snapshot` (model + optimizer state dicts, fingerprint)", snap)
    row("  of which `save()`: clone + DCP staging + hand-off", call)
    row("  of which `poll()` once written: rank0.pt, meta.json, fsync, rename, prune", finish)
    row("async: background write, nothing else running", _median(saves.async_write_idle), False)
    row("async: background write, under training", _median(saves.async_write_training), False)
    row(f"async: slowdown of the {len(overlapped)} steps overlapping a write", slowdown)
    row("async: blocking + slowdown", blocking + slowdown)
    row("(a `clone()` of every tensor of the state, alone)", _median(saves.clone))
    write = _median(saves.async_write_idle)
    print(
        f"sync write rate {saves.size / 2**20 / (sync - snap):,.0f} MiB/s, async background "
        f"{saves.size / 2**20 / write:,.0f} MiB/s; steps overlapping a write: "
        f"median {_ms(_median(overlapped))} vs {_ms(step)}"
    )
    for name, every in intervals.items():
        with_sync = step + sync / every
        with_async = step + (blocking + slowdown) / every
        print(
            f"every {every} steps ({name}): {tokens / with_sync:,.0f} tokens/s with sync "
            f"checkpoints, {tokens / with_async:,.0f} with async (vs {tokens / step:,.0f} without)"
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks train")
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of checkpoints + steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--seed", type=int, default=None, help="default: training.seed")
    parser.add_argument("--data", type=Path, default=None, help="reuse/build shards here")
    parser.add_argument(
        "--checkpoints",
        type=Path,
        default=None,
        help="write checkpoints here (default: a temp dir)",
    )
    args = parser.parse_args(argv)
    # DCP's writer thread warns that it assumes one process, which is the intent here
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    import factory
    from factory.checks.validate import load_blueprint
    from factory.proxy import PROXY_CHECKPOINT_INTERVAL, derive_proxy
    from factory.runtime.batches import build_shards
    from factory.runtime.checkpoint import Checkpointer

    blueprint = load_blueprint(args.preset)
    proxy = derive_proxy(blueprint)
    seed = proxy.training.seed if args.seed is None else args.seed
    par = proxy.parallelism
    tokens = par.global_batch_size * proxy.data.seq_len
    print(f"machine: {describe()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="factory-bench-train-") as tmp:
        start = time.perf_counter()
        data = build_shards(proxy, args.data or Path(tmp) / "data")
        built = time.perf_counter() - start
        compiled = factory.compile(blueprint, proxy=True, seed=seed)
        params = sum(p.numel() for p in compiled.model.parameters())
        trainer = Trainer(compiled, data, seed)
        counts = compiled.precision.recipes() if compiled.precision else {}
        linears = ", ".join(f"{n} {recipe}" for recipe, n in counts.items())
        print(
            f"model: {proxy.meta.name}, {proxy.model.pattern}, {params / 1e6:.1f}M params, "
            f"fp32{f' (linears emulated: {linears})' if linears else ''}; step: "
            f"{par.global_batch_size} x {proxy.data.seq_len} tokens in {trainer.accumulation} "
            f"micro-batches of {par.micro_batch_size}"
        )
        print(
            f"data: recipe {proxy.data.recipe} at seq {proxy.data.seq_len}, "
            f"{len(trainer.loader.shards)} shards, {trainer.loader.samples_per_epoch:,} samples "
            f"(built or reused in {built:.1f} s)"
        )
        loss_diff, grad_diff = trainer.check_mirror()
        print(
            f"mirror vs forward_backward: |loss diff| {loss_diff:.1e}, max |grad diff| {grad_diff:.1e}"
        )
        if loss_diff > 1e-6 or grad_diff > 1e-6:
            return 1
        for _ in range(args.warmup):
            trainer.step()
        root = args.checkpoints or Path(tmp) / "checkpoints"
        saves = Saves()
        async_ckpt = Checkpointer(root / "async", keep=1, async_save=True)
        steps: list[dict[str, float]] = []
        for _ in range(args.repeats):
            save_sync(trainer, root / "sync", saves)
            save_async_idle(trainer, async_ckpt, saves)
            steps += steps_under_async_save(trainer, async_ckpt, saves, args.steps)
        trainer.loader.close()
        rate = loader_alone(data, par.micro_batch_size, seed)
    intervals = {
        f"{args.preset}'s blueprint": blueprint.training.checkpoint_interval,
        "the proxy's": PROXY_CHECKPOINT_INTERVAL,
    }
    report(steps, saves, tokens, intervals, rate, par.global_batch_size)
    print(f"1-min load average before/after: {load_before:.2f}/{load_average():.2f}")
    return 0
