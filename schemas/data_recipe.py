"""A data recipe (``data_recipes/*.yaml``): sources, their curation chains, and the shared stages.

Consumed by ``factory.data.pipeline``. Each source reads one path and runs its
own ``steps`` in a validated order: one formatting step first, then filters.
Dedup, decontamination, tokenization, mixing and packing are global: dedup is
across all sources, so a document that appears in two sources survives once.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from factory.schemas.base import Count, PositiveInt, Section

__all__ = [
    "CATEGORIES",
    "ChatFormat",
    "CudaKernelFilter",
    "DataRecipe",
    "DecontamConfig",
    "DedupConfig",
    "HeuristicFilter",
    "OutputConfig",
    "PackingConfig",
    "ReasoningConfig",
    "SourceConfig",
    "TextFormat",
    "TokenizerConfig",
    "TrajectoryFilter",
]

Category = Literal[
    "pretrain_text",
    "long_context",
    "stem_synthetic",
    "swe_trajectory",
    "cuda_kernel",
    "multilingual_safety",
    "search_trajectory",
    "terminal",
    "conversational",
    "math",
    "code",
]
CATEGORIES: tuple[str, ...] = Category.__args__  # type: ignore[attr-defined]


class TextFormat(Section):
    """Plain text: the whole field trains."""

    kind: Literal["text"] = "text"
    field: str = "text"
    """Record field holding the text."""


class ReasoningConfig(Section):
    """How reasoning traces enter the loss (data.md §1.4)."""

    trace: Literal["keep", "mask"] = "keep"
    """keep: the <think> trace trains with the answer; mask: it is in context but not trained."""
    drop_previous_turns: bool = True
    """Remove reasoning from assistant turns before the last user turn."""
    split_turns: bool = False
    """One sample per user turn, training only on that turn's answer."""
    strip_fraction: float = Field(default=0.0, ge=0, le=1)
    """Fraction of samples with reasoning removed (reasoning off)."""
    truncate_fraction: float = Field(default=0.0, ge=0, le=1)
    """Fraction of samples whose reasoning is cut to a random budget (answer kept)."""
    truncate_max_chars: PositiveInt = 512
    """Largest kept reasoning prefix, in characters, for truncated samples."""


class ChatFormat(Section):
    """Chat records (messages, tools, reasoning_content, tool_calls); assistant tokens train."""

    kind: Literal["chat"] = "chat"
    reasoning: ReasoningConfig = ReasoningConfig()


class HeuristicFilter(Section):
    """Quality heuristics with NeMo Curator / Gopher defaults."""

    kind: Literal["heuristics"] = "heuristics"
    min_words: int = Field(default=50, ge=0)
    max_words: int = Field(default=100_000, ge=1)
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_to_word_ratio: float = 0.1
    max_duplicate_line_fraction: float = 0.3
    max_non_alphanumeric_fraction: float = 0.25
    max_url_ratio: float = 0.2


class TrajectoryFilter(Section):
    """SWE, terminal and search trajectories: finished, tests passed, turns, tool calls."""

    kind: Literal["trajectory"] = "trajectory"
    require_finished: bool = True
    require_tests_passed: bool = True
    max_turns: PositiveInt = 100
    require_well_formed_tool_calls: bool = True


class CudaKernelFilter(Section):
    """CUDA kernels: verified, and faster than their PyTorch reference."""

    kind: Literal["cuda_kernel"] = "cuda_kernel"
    require_verified: bool = True
    min_speedup: float = Field(default=1.0, gt=0)
    """Least reference_ms / kernel_ms to keep a kernel."""


Step = Annotated[
    TextFormat | ChatFormat | HeuristicFilter | TrajectoryFilter | CudaKernelFilter,
    Field(discriminator="kind"),
]
_FORMATS = ("text", "chat")


class SourceConfig(Section):
    """One input: where it is, what it is, how much of it, and how to curate it."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    """Short name: used in keys, manifests and shard metadata."""
    path: str
    """jsonl, jsonl.gz, parquet, a folder of them, a glob, or a `datasets` folder (save_to_disk);
    relative paths are relative to the recipe file."""
    category: Category
    weight: float | None = Field(default=None, gt=0)
    """Share of the mixture's tokens, relative to the other sources' weights."""
    tokens: Count | None = None
    """Exact token budget for this source instead of a weight."""
    steps: list[Step] = Field(min_length=1)
    """Formatting first (text or chat), then filters, in the order written."""

    @model_validator(mode="after")
    def _valid_chain(self) -> SourceConfig:
        kinds = [step.kind for step in self.steps]
        if kinds[0] not in _FORMATS:
            raise ValueError(
                f"steps must start with a format step (text or chat), not {kinds[0]!r}"
            )
        if any(kind in _FORMATS for kind in kinds[1:]):
            raise ValueError("only the first step may be a format step")
        if (self.weight is None) == (self.tokens is None):
            raise ValueError("give exactly one of weight and tokens")
        return self


class DedupConfig(Section):
    """Global dedup: exact content hash, then MinHash LSH, first occurrence kept."""

    exact: bool = True
    minhash: bool = True
    shingle_size: PositiveInt = 5
    """Words per shingle (DataTrove's default)."""
    bands: PositiveInt = 16
    rows: PositiveInt = 8
    """bands x rows hashes; the Jaccard threshold is about (1/bands)^(1/rows) = 0.71."""
    seed: int = 42


class DecontamConfig(Section):
    """Drop documents sharing an n-gram with a benchmark."""

    benchmarks: list[str] = Field(default_factory=list)
    """jsonl or txt files, relative to the recipe."""
    ngram: PositiveInt = 13


class TokenizerConfig(Section):
    path: str | None = None
    """A tokenizer.json; null uses the tokenizer shipped in data_recipes/tokenizer/."""
    eos: bool = True
    """Append the end-of-text token to every document."""


class PackingConfig(Section):
    seq_len: PositiveInt = 2048
    window: PositiveInt = 4096
    """Documents buffered per best-fit-decreasing pass (bounds memory)."""


class OutputConfig(Section):
    samples_per_shard: PositiveInt = 256
    energon: bool = True
    megatron: bool = False
    """Also write Megatron's indexed .bin/.idx of the unpacked documents."""


class DataRecipe(Section):
    """A data mixture and how to curate it."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    description: str = ""
    seed: int = 0
    """Drives mixing and the reasoning augmentations; shards are a function of recipe and seed."""
    total_tokens: Count | None = None
    """Tokens of the weighted part of the mixture; null: as many as the weighted sources hold
    after curation (each source then up- or down-sampled to its weight's share)."""
    sources: list[SourceConfig] = Field(min_length=1)
    dedup: DedupConfig = DedupConfig()
    decontam: DecontamConfig = DecontamConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    packing: PackingConfig = PackingConfig()
    output: OutputConfig = OutputConfig()

    @model_validator(mode="after")
    def _unique_sources(self) -> DataRecipe:
        names = [s.name for s in self.sources]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"source names must be unique: {', '.join(duplicates)}")
        return self
