"""Stage 3's stream: the curated sources mixed, in the order they are packed.

Sources are interleaved by weighted round robin (always take the next
document from the source furthest behind its target share), so every shard
sees the mixture, and it is all streaming: each source is read in order from
its unit files, filtered by its dedup mask and its held-out split (a stream reads
one side of the split, ``heldout_split``), and repeated per ``mixing.repeats``.
``shard_plan`` packs this stream (of lengths) into shard plans, and
``write_shards`` writes the shards from them and Megatron's ``.bin`` from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Generic

from factory.data.stages.heldout_split import Side, SplitCounts, unit_mask
from factory.data.stages.mixing import SourcePlan, repeats
from factory.data.stages.packing import P, TokenizedDoc
from factory.data.stages.unit_files import read_unit

__all__ = ["MixedStream", "read_tokenized", "tokens_per_source"]


def read_tokenized(unit: Path) -> Iterator[TokenizedDoc]:
    """A unit's documents with their tokens, in file order."""
    for doc in read_unit(unit):
        yield TokenizedDoc(doc.key, doc.ids, doc.mask)


@dataclass
class MixedStream(Generic[P]):
    """The interleaved, repeated documents of all sources, with what each source emitted.

    ``read`` gives a unit's documents in file order: with their tokens by
    default (Megatron's ``.bin``); the shard planner passes references (key and
    length, ``shard_plan.DocRef``) and gets the same stream without reading a token.
    """

    units: dict[str, list[Path]]
    plans: dict[str, SourcePlan]
    seed: int
    read: Callable[[Path], Iterable[P]] = read_tokenized  # type: ignore[assignment]
    side: Side = "train"
    """The documents trained on, or (``"heldout"``) the ones the split set aside."""
    emitted: dict[str, dict[str, int]] = field(default_factory=dict)

    def _source_docs(self, name: str) -> Iterator[P]:
        ratio = self.plans[name].ratio
        for unit in self.units[name]:
            keep = unit_mask(unit, self.side)
            for kept, doc in zip(keep, self.read(unit), strict=True):
                if not kept:
                    continue
                for copy in range(repeats(ratio, self.seed, doc.key)):
                    yield doc if copy == 0 else replace(doc, key=f"{doc.key}#{copy}")

    def __iter__(self) -> Iterator[P]:
        streams = {name: self._source_docs(name) for name in self.units}
        self.emitted = {name: {"documents": 0, "tokens": 0} for name in self.units}
        targets = {name: max(plan.target_tokens, 1) for name, plan in self.plans.items()}
        while streams:
            name = min(
                streams,
                key=lambda n: (self.emitted[n]["tokens"] / targets[n], list(self.units).index(n)),
            )
            doc = next(streams[name], None)
            if doc is None:
                del streams[name]
                continue
            self.emitted[name]["documents"] += 1
            self.emitted[name]["tokens"] += len(doc)
            yield doc


def tokens_per_source(
    units: dict[str, Sequence[Path]], dedup: dict[str, dict], split: SplitCounts
) -> dict[str, int]:
    """Each source's tokens to train on: what dedup kept, less what the split set aside."""
    return {
        name: sum(dedup[str(u)]["tokens_out"] for u in paths) - split.get(name, {}).get("tokens", 0)
        for name, paths in units.items()
    }
