"""Train the default tokenizer: byte-level BPE, 4,096 tokens, on the shipped sample corpus.

``python -m factory.data.train_tokenizer`` writes ``data_recipes/tokenizer/tokenizer.json``
(Hugging Face ``tokenizers`` format), the tokenizer the CPU proxy models use, so
nothing is downloaded. Training is deterministic: the corpus is read in a fixed
order and the BPE trainer breaks ties by pair, so re-running gives the same bytes
(``tests/test_data_samples.py`` checks this).

Special tokens take the first ids (the trainer adds them before any merge):

=====  ==================  =========================================================
id     token               use
=====  ==================  =========================================================
0      ``<pad>``           padding; never trained on
1      ``<|endoftext|>``   end of document, appended by the tokenize stage
2      ``<|im_start|>``    start of a chat turn (``<|im_start|>role\\n``)
3      ``<|im_end|>``      end of a chat turn
4      ``<think>``         opens assistant reasoning
5      ``</think>``        closes assistant reasoning
6      ``<tool_call>``     opens a tool call
7      ``</tool_call>``    closes a tool call
=====  ==================  =========================================================

Ids 0-3 are *special* (``decode(..., skip_special_tokens=True)`` drops them);
4-7 are ordinary added tokens, always one id each and kept when decoding, since
they are part of the text a model produces (as in Qwen3-style chat templates).
There is no normalizer and the pre-tokenizer splits digits one by one before the
GPT-2 byte-level split, so ``decode(encode(text)) == text`` for any string.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from factory.data.samples import DEFAULT_COUNTS, sample_file

__all__ = [
    "DEFAULT_SAMPLES",
    "DEFAULT_TOKENIZER",
    "SPECIAL_TOKENS",
    "TRAINED_WITH",
    "VOCAB_SIZE",
    "corpus_texts",
    "train_tokenizer",
    "write_tokenizer",
]

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SAMPLES = REPO / "data_recipes" / "samples"
DEFAULT_TOKENIZER = REPO / "data_recipes" / "tokenizer" / "tokenizer.json"
VOCAB_SIZE = 4096  # the CPU proxy models' vocabulary
# The shipped tokenizer.json was trained with this ``tokenizers`` release; another release's
# trainer may break ties differently, so byte-identity is only promised for this one.
TRAINED_WITH = "0.23.3"
SPECIAL_TOKENS: dict[str, int] = {
    "<pad>": 0,
    "<|endoftext|>": 1,
    "<|im_start|>": 2,
    "<|im_end|>": 3,
    "<think>": 4,
    "</think>": 5,
    "<tool_call>": 6,
    "</tool_call>": 7,
}
_SKIPPED_ON_DECODE = ("<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _record_texts(record: dict) -> Iterator[str]:
    if "text" in record:
        yield record["text"]
    for message in record.get("messages", []):
        yield from (message[k] for k in ("reasoning_content", "content") if message.get(k))
        for call in message.get("tool_calls", []):
            yield call["function"]["arguments"]
    for key in ("pytorch_reference", "cuda_kernel"):
        if key in record:
            yield record[key]


def corpus_texts(samples_dir: Path = DEFAULT_SAMPLES) -> Iterator[str]:
    """The training texts: every clean record of every category, in a fixed order.

    Records with a planted defect (junk, duplicates, leaks) are skipped, as a
    curated corpus would skip them; ``benchmarks.jsonl`` is not read.
    """
    for category in DEFAULT_COUNTS:
        path = Path(samples_dir) / sample_file(category)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line)
                if record["meta"]["defect"] is None:
                    yield from _record_texts(record)


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE with the special tokens at the ids of ``SPECIAL_TOKENS``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    ordered = sorted(SPECIAL_TOKENS, key=SPECIAL_TOKENS.__getitem__)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in ordered],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # The trainer marks every added token special; mark the reasoning and tool tags ordinary.
    # from_str re-reads the flags, which add_tokens alone leaves stale in the decoder.
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t in ordered
            if t not in _SKIPPED_ON_DECODE
        ]
    )
    tokenizer = Tokenizer.from_str(tokenizer.to_str())
    for token, index in SPECIAL_TOKENS.items():
        if tokenizer.token_to_id(token) != index:
            raise RuntimeError(
                f"{token} trained at id {tokenizer.token_to_id(token)}, expected {index}"
            )
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, path: Path = DEFAULT_TOKENIZER) -> Path:
    """Write ``tokenizer.json`` as one compact JSON line (about 110 KB), creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m factory.data.train_tokenizer", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--samples", type=Path, default=DEFAULT_SAMPLES, help="sample corpus folder"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_TOKENIZER, help="tokenizer.json to write"
    )
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = write_tokenizer(train_tokenizer(corpus_texts(args.samples), args.vocab_size), args.out)
    print(f"wrote {path} ({path.stat().st_size:,d} bytes) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
