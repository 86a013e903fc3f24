"""A data recipe (``data_recipes/*.yaml``): sources, their curation chains, and the shared stages.

Consumed by ``factory.data.build_job``, which takes these types as they are: a
step's section is the parameter object its filter or formatter runs with, so
every threshold is declared once, here, and a key the runtime does not know is
a validation error. Each source reads one path and runs its own ``steps`` in a
validated order: one formatting step first, then filters. Dedup,
decontamination, tokenization, mixing and packing are global: dedup is across
all sources, so a document that appears in two sources survives once.

Every size and count has an upper bound (stated in its docstring) so that a
typo such as ``10**400`` fails validation instead of a worker process later.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from factory.schemas.base import Section, Seed, SeqLen, TokenCount

__all__ = [
    "CATEGORIES",
    "FILTER_STEPS",
    "FORMAT_STEPS",
    "HELDOUT_KEYS",
    "MAX_NGRAM",
    "MAX_WORDS",
    "SHARE_KEYS",
    "ChatFormat",
    "CudaKernelFilter",
    "DataRecipe",
    "DecontamConfig",
    "DedupConfig",
    "HeldoutSplit",
    "HeuristicFilter",
    "OutputConfig",
    "PackingConfig",
    "ReasoningConfig",
    "SourceConfig",
    "Step",
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

MAX_NGRAM = 256
"""Longest n-gram any step takes: the n-gram hashing in ``factory.data.steps.dedup_hashing`` precomputes
one constant per word position up to this length."""
MAX_WORDS = 10**9
"""Most words a heuristic bound can name (a 1e9-word document is some gigabytes of text)."""

Fraction = Annotated[float, Field(ge=0, le=1)]
Ratio = Annotated[float, Field(ge=0)]
"""A non-negative ratio (finite, as every Section float; no upper bound: it compares counts
of different things)."""
NgramSize = Annotated[int, Field(ge=1, le=MAX_NGRAM)]
SHARE_KEYS: tuple[str, ...] = ("weight", "tokens", "epochs")
"""How a source states its share of the mixture; a source gives exactly one."""


def _one_threshold_per_size(pairs: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    sizes = [n for n, _ in pairs]
    repeated = sorted({n for n in sizes if sizes.count(n) > 1})
    if repeated:
        raise ValueError(f"one threshold per n-gram size; {repeated} given more than once")
    return pairs


NgramThresholds = Annotated[
    tuple[tuple[NgramSize, Fraction], ...],
    Field(max_length=MAX_NGRAM),
    AfterValidator(_one_threshold_per_size),
]
"""(n, fraction) pairs; a list of pairs rather than a mapping because YAML keys are strings."""


class TextFormat(Section):
    """Plain text: the whole field trains."""

    masks_prompts: ClassVar[bool] = False
    """Whether the format's loss mask leaves the prompt out (an ``sft`` objective needs it:
    ``training.objective``); text trains on every token."""
    kind: Literal["text"] = "text"
    field: str = "text"
    """Record field holding the text."""


class ReasoningConfig(Section):
    """How assistant reasoning is rendered and trained (docs/data.md, Reasoning).

    Every random choice is a hash of the recipe's ``seed`` and the record key,
    so a record gets the same treatment whatever the worker count.
    """

    trace: Literal["keep", "mask"] = "keep"
    """keep: the <think> trace trains with the answer; mask: it is in context but not trained."""
    drop_previous_turns: bool = True
    """Remove reasoning from assistant turns before the last user turn."""
    split_turns: bool = False
    """One sample per user turn, training only on that turn's answer."""
    strip_fraction: Fraction = 0.0
    """Fraction of samples with reasoning removed (reasoning off); disjoint from truncate_fraction,
    so strip_fraction + truncate_fraction is at most 1."""
    truncate_fraction: Fraction = 0.0
    """Fraction of samples whose reasoning is cut to a random budget (answer kept; ``</think>``
    as ``truncated_close`` says)."""
    truncate_max_chars: Annotated[int, Field(ge=1, le=10**7)] = 512
    """Largest kept reasoning prefix, in characters, for truncated samples (1..1e7)."""
    truncated_close: Literal["mask", "train"] = "mask"
    """After a truncated trace, ``</think>`` is in context and: mask, not trained (the model must
    not learn to stop thinking there; Nemotron 3 Ultra's change); train, trained like the rest of
    the trace (Nemotron 3 Nano and Super)."""

    @model_validator(mode="after")
    def _disjoint_shares(self) -> ReasoningConfig:
        total = self.strip_fraction + self.truncate_fraction
        if total > 1.0:
            raise ValueError(
                f"strip_fraction ({self.strip_fraction}) + truncate_fraction "
                f"({self.truncate_fraction}) = {total:g} must not exceed 1: they are disjoint "
                "shares of the samples"
            )
        return self


class ChatFormat(Section):
    """Chat records (messages, tools, reasoning_content, tool_calls); assistant tokens train."""

    masks_prompts: ClassVar[bool] = True
    """System, user and tool turns and the assistant header are context, never targets."""
    kind: Literal["chat"] = "chat"
    reasoning: ReasoningConfig = ReasoningConfig()


class HeuristicFilter(Section):
    """Text quality heuristics with NeMo Curator's and Gopher's published thresholds.

    Words are whitespace-separated tokens, as in Gopher. A document is dropped
    at the first check it fails, cheapest first, so drop counts read as "why
    this document went".
    """

    kind: Literal["heuristics"] = "heuristics"
    min_words: Annotated[int, Field(ge=0, le=MAX_WORDS)] = 50
    """Fewest words a document may have (0..1e9)."""
    max_words: Annotated[int, Field(ge=1, le=MAX_WORDS)] = 100_000
    """Most words a document may have (1..1e9)."""
    min_mean_word_length: Ratio = 3.0
    """Least mean word length, in characters per word."""
    max_mean_word_length: Ratio = 10.0
    """Largest mean word length, in characters per word."""
    max_symbol_to_word_ratio: Ratio = 0.1
    """Most '#' per word, and most ellipses ('...' or '…') per word; each must be at most this."""
    max_duplicate_line_fraction: Fraction = 0.3
    """Most non-empty lines that repeat an earlier line, over all non-empty lines."""
    max_non_alphanumeric_fraction: Fraction = 0.25
    """Most characters that are not letters or digits (whitespace included, as in Curator),
    over all characters."""
    max_url_ratio: Fraction = 0.2
    """Most characters inside URLs (a token starting http://, https:// or www.), over all
    characters."""
    max_top_ngram_fraction: NgramThresholds = ((2, 0.20), (3, 0.18), (4, 0.16))
    """[n, fraction] pairs, n in 1..256: per n, at most this fraction of all word characters may
    be the most frequent word n-gram's characters times its count (an n-gram seen once is no
    repetition). [] turns the check off."""
    max_duplicate_ngram_fraction: NgramThresholds = (
        (5, 0.15),
        (6, 0.14),
        (7, 0.13),
        (8, 0.12),
        (9, 0.11),
        (10, 0.10),
    )
    """[n, fraction] pairs, n in 1..256: per n, at most this fraction of all word characters may
    lie inside n-grams that repeat an earlier occurrence. [] turns the check off."""

    @model_validator(mode="after")
    def _ranges_not_empty(self) -> HeuristicFilter:
        for low, high in (
            ("min_words", "max_words"),
            ("min_mean_word_length", "max_mean_word_length"),
        ):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"{low} ({getattr(self, low)}) must not exceed {high} ({getattr(self, high)}): "
                    "every document would be dropped"
                )
        return self


class TrajectoryFilter(Section):
    """Agent trajectories (SWE, terminal, search): finished, tests passed, turns, tool calls.

    Record fields read: ``finished``; ``tests_passed``, or else
    ``test_results: {passed, failed}``; ``messages`` (one turn each); ``tools``
    and each assistant message's ``tool_calls``.
    """

    kind: Literal["trajectory"] = "trajectory"
    require_finished: bool = True
    """Keep only trajectories whose ``finished`` is true: the agent reached its own end, not a
    step or time limit. Missing counts as unfinished."""
    require_tests_passed: bool = True
    """Keep only trajectories whose ``tests_passed`` is true, or whose ``test_results`` has
    ``failed == 0`` and ``passed > 0``. Missing counts as failed."""
    max_turns: Annotated[int, Field(ge=1, le=100_000)] = 100
    """Most messages (turns) a trajectory may have (1..1e5)."""
    require_well_formed_tool_calls: bool = True
    """Keep only trajectories whose every tool call names a declared tool and has a JSON object
    (a mapping, or a string holding one) as its arguments."""


class CudaKernelFilter(Section):
    """Generated CUDA kernels: verified, and faster than their PyTorch reference.

    Record fields read: ``verified`` and ``benchmark: {reference_ms, kernel_ms}``.
    """

    kind: Literal["cuda_kernel"] = "cuda_kernel"
    require_verified: bool = True
    """Keep only kernels whose ``verified`` is true (outputs matched the PyTorch reference)."""
    min_speedup: Annotated[float, Field(ge=0, le=1000)] = 1.0
    """Least reference_ms / kernel_ms to keep a kernel (0..1000); 0 turns the speed rule, and
    the need for a benchmark, off."""


FORMAT_STEPS: tuple[type[Section], ...] = (TextFormat, ChatFormat)
"""The format sections; ``factory.data.steps.formatting`` gives each its formatter."""
FILTER_STEPS: tuple[type[Section], ...] = (HeuristicFilter, TrajectoryFilter, CudaKernelFilter)
"""The filter sections: a new filter is its section above and its entry here, and a module
in ``factory/data/steps/filters/`` registers its check (``factory.data.steps.filters``)."""
Step = Annotated[Union[(*FORMAT_STEPS, *FILTER_STEPS)], Field(discriminator="kind")]
"""One step of a source's chain, told apart by its ``kind``."""
_FORMATS = tuple(step.model_fields["kind"].default for step in FORMAT_STEPS)


HELDOUT_KEYS: tuple[str, ...] = ("fraction", "tokens")
"""How a held-out split states its size; a split gives exactly one."""


class HeldoutSplit(Section):
    """Documents set aside from a source for validation, never trained on (docs/data.md,
    Held-out sets).

    Decided per document after dedup, by a hash of the recipe's ``seed`` and the document's
    content hash (the one exact dedup uses), so a document lands on the same side whatever
    the worker count or executor, and a near duplicate of a held-out document is never
    trained on (dedup keeps one of them). Held-out documents run every step the training
    ones run, and are packed per category into ``OUT/heldout/CATEGORY/``.
    """

    fraction: Annotated[float, Field(ge=0, lt=1)] | None = None
    """Share of the source's documents to hold out, each document independently (0 <= f < 1;
    0 holds nothing out): about this fraction, exactly the same documents on every run."""
    tokens: TokenCount | None = None
    """Tokens to hold out (up to 1e16): documents are taken in the order of their hash until
    their tokens reach this count (the last one may pass it)."""

    @model_validator(mode="after")
    def _one_size(self) -> HeldoutSplit:
        given = [key for key in HELDOUT_KEYS if getattr(self, key) is not None]
        if len(given) != 1:
            named = f"{' and '.join(given)} given" if given else "none given"
            raise ValueError(f"give exactly one of fraction and tokens ({named})")
        return self

    @property
    def takes_any(self) -> bool:
        """Whether the split asks for any document at all (``fraction: 0`` does not)."""
        return bool(self.fraction) or self.tokens is not None


class SourceConfig(Section):
    """One input: where it is, what it is, how much of it, and how to curate it."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    """Short name: used in keys, manifests and shard metadata."""
    path: str
    """jsonl, jsonl.gz, parquet, a folder of them, a glob, or a `datasets` folder (save_to_disk);
    relative paths are relative to the recipe file."""
    category: Category
    weight: Annotated[float, Field(gt=0, le=1e6)] | None = None
    """Share of the mixture's tokens, relative to the other sources' weights (up to 1e6)."""
    tokens: TokenCount | None = None
    """Exact token budget for this source instead of a weight (up to 1e16)."""
    epochs: Annotated[float, Field(gt=0, le=1e6)] | None = None
    """Passes over this source's curated tokens instead of a weight or budget (fractions allowed,
    up to 1e6): its target is epochs x its tokens after curation, whatever the other sources
    hold. SFT's dynamic sampling: small sets run many epochs, large sets a few (Nemotron 3 Nano
    report, arXiv 2512.20848, section 3.1)."""
    steps: list[Step] = Field(min_length=1, max_length=64)
    """Formatting first (text or chat), then filters, in the order written (at most 64 steps)."""
    heldout: HeldoutSplit | None = None
    """What to set aside for validation; null: the recipe's ``heldout`` (``{fraction: 0}``
    holds nothing out of this source when the recipe sets a default)."""

    @model_validator(mode="after")
    def _valid_chain(self) -> SourceConfig:
        kinds = [step.kind for step in self.steps]
        if kinds[0] not in _FORMATS:
            raise ValueError(
                f"steps must start with a format step (text or chat), not {kinds[0]!r}"
            )
        if any(kind in _FORMATS for kind in kinds[1:]):
            raise ValueError("only the first step may be a format step")
        given = [key for key in SHARE_KEYS if getattr(self, key) is not None]
        if len(given) != 1:
            named = f"{' and '.join(given)} given" if given else "none given"
            raise ValueError(f"give exactly one of weight, tokens and epochs ({named})")
        return self


class DedupConfig(Section):
    """Global dedup: exact content hash, then MinHash LSH, first occurrence kept."""

    exact: bool = True
    minhash: bool = True
    shingle_size: NgramSize = 5
    """Words per shingle (DataTrove's default; 1..256)."""
    bands: Annotated[int, Field(ge=1, le=4096)] = 16
    """LSH bands (1..4096); a pair of documents is a candidate when any band matches."""
    rows: Annotated[int, Field(ge=1, le=4096)] = 8
    """Hashes per band (1..4096); bands x rows hashes (at most 4096 in all, 16 KiB per document); the Jaccard threshold
    is about (1/bands)^(1/rows) = 0.71."""
    seed: Seed = 42
    """Seeds the MinHash permutations (0..2^63-1)."""

    @model_validator(mode="after")
    def _signature_size(self) -> DedupConfig:
        if self.bands * self.rows > 4096:
            raise ValueError(
                f"bands ({self.bands}) x rows ({self.rows}) = {self.bands * self.rows} hashes per "
                "document; at most 4096"
            )
        return self


class DecontamConfig(Section):
    """Drop documents sharing an n-gram with a benchmark."""

    benchmarks: list[str] = Field(default_factory=list)
    """jsonl or txt files, relative to the recipe."""
    ngram: NgramSize = 13
    """Words per n-gram (1..256); shorter benchmark items match as their whole word sequence."""


class TokenizerConfig(Section):
    """The tokenizer, and the chat template that renders conversations for it.

    The template sits here, beside the tokenizer, as Hugging Face keeps it in
    ``tokenizer_config.json``: it names the tokenizer's special tokens, and one
    model reads every conversation of its recipe one way (a template per
    source would train it on several formats).
    """

    path: str | None = None
    """A tokenizer.json; null uses the tokenizer shipped in data_recipes/tokenizer/."""
    eos: bool = True
    """Append the end-of-text token to every document."""
    chat_template: str | None = Field(default=None, max_length=1_000_000)
    """Jinja text that renders the chat sources' turns, as a tokenizer's chat_template
    (docs/data.md, Chat templates); the loss mask follows the roles. Null, with no
    chat_template_file: factory's built-in ChatML-like format."""
    chat_template_file: str | None = None
    """The template from a file, relative to the recipe: a .jinja file, or a
    tokenizer_config.json whose chat_template (and special tokens) are taken.
    data_recipes/templates/chatml.jinja is the built-in format."""

    @model_validator(mode="after")
    def _one_template(self) -> TokenizerConfig:
        if self.chat_template is not None and self.chat_template_file is not None:
            raise ValueError("give at most one of chat_template and chat_template_file")
        return self


class PackingConfig(Section):
    seq_len: SeqLen = 2048
    """Tokens per packed sample (up to 2^24, the bound of a blueprint's data.seq_len)."""
    window: Annotated[int, Field(ge=1, le=10**7)] = 4096
    """Documents buffered per best-fit-decreasing pass (bounds memory; 1..1e7)."""


class OutputConfig(Section):
    samples_per_shard: Annotated[int, Field(ge=1, le=10**6)] = 256
    """Packed samples per webdataset tar (1..1e6)."""
    energon: bool = True
    megatron: bool = False
    """Also write Megatron's indexed .bin/.idx of the unpacked documents."""


class DataRecipe(Section):
    """A data mixture and how to curate it."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    description: str = ""
    seed: Seed = 0
    """Drives mixing and the reasoning augmentations; shards are a function of recipe and seed
    (0..2^63-1)."""
    sources: list[SourceConfig] = Field(min_length=1, max_length=10_000)
    """The inputs (at most 10,000)."""
    total_tokens: TokenCount | None = None
    """Tokens of the weighted part of the mixture (up to 1e16); null: as many as the weighted
    sources hold after curation (each source then up- or down-sampled to its weight's share).
    Sources with ``tokens`` or ``epochs`` are outside this pool."""
    dedup: DedupConfig = DedupConfig()
    decontam: DecontamConfig = DecontamConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    packing: PackingConfig = PackingConfig()
    output: OutputConfig = OutputConfig()
    heldout: HeldoutSplit | None = None
    """The held-out split of every source that states none of its own; null: none."""

    def heldout_of(self, source: SourceConfig) -> HeldoutSplit | None:
        """``source``'s held-out split: its own, else the recipe's; None when nothing is
        held out of it."""
        split = source.heldout if source.heldout is not None else self.heldout
        return split if split is not None and split.takes_any else None

    @model_validator(mode="after")
    def _unique_sources(self) -> DataRecipe:
        names = [s.name for s in self.sources]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"source names must be unique: {', '.join(duplicates)}")
        return self

    @field_validator("total_tokens")
    @classmethod
    def _pool_has_weighted_sources(cls, total: int | None, info: ValidationInfo) -> int | None:
        # declared after sources, so a valid sources list is in info.data
        sources = info.data.get("sources")
        if total is not None and sources and all(s.weight is None for s in sources):
            raise ValueError(
                "the weighted sources share total_tokens and no source has a weight: drop it "
                "(each source's tokens or epochs set its target alone)"
            )
        return total
