"""Greedy decoding on CPU: ours plain and MTP-self-speculative vs transformers' ``generate``.

The model is the Super CPU proxy (``factory.compile(super, proxy=True)``, MTP depth 2 over an
attention + MoE block, precision off), trained ``--steps`` AdamW steps on this repository's
own docs (``docs/*.md``, ``README.md``) tokenized with the shipped tokenizer, main and MTP
losses, so that its greedy choices and its drafts are a trained model's rather than noise.
Its HF export (``write_hf_checkpoint``) is loaded with ``AutoModelForCausalLM`` (the
pure-PyTorch NemotronH path: no ``mamba_ssm``, no ``causal_conv1d``). All three decode the
same prompt for ``--new-tokens`` tokens, greedy, interleaved ``--repeats`` times; the
benchmark checks that the three texts are the same before it reports tokens/s (new tokens
over the whole ``generate`` call, the prompt's forward included), MTP's acceptance per draft
position and its tokens per forward.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

import factory
from benchmarks.machine import describe
from benchmarks.timing import interleaved, load_average, report
from factory.exports.hf import write_hf_checkpoint
from factory.generation import generate
from factory.loading.recipe import DEFAULT_TOKENIZER

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "A blueprint describes one model of the Nemotron 3 family: its hybrid"
BATCH = 4


def corpus(tokenizer: Tokenizer) -> torch.Tensor:
    """The repository's docs as one token stream."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n\n".join(path.read_text(encoding="utf-8") for path in files)
    return torch.tensor(tokenizer.encode(text).ids)


def train(
    model: torch.nn.Module, stream: torch.Tensor, steps: int, seq: int, mtp_scale: float
) -> float:
    """``steps`` AdamW steps on random ``seq``-token windows of ``stream``, the MTP losses
    scaled by ``mtp_scale`` (the blueprint's); returns the last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        starts = torch.randint(0, len(stream) - seq, (BATCH,), generator=generator)
        ids = torch.stack([stream[s : s + seq] for s in starts.tolist()])
        out = model(ids)
        loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        for depth, logits in enumerate(out.mtp_logits, start=2):
            loss = loss + mtp_scale * F.cross_entropy(
                logits[:, :-depth].flatten(0, 1), ids[:, depth:].flatten()
            )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        if (step + 1) % 20 == 0:
            print(f"  step {step + 1}: loss {loss.item():.2f}", flush=True)
    model.eval()
    return float(loss)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks generate")
    parser.add_argument("--steps", type=int, default=150, help="training steps before decoding")
    parser.add_argument("--seq-len", type=int, default=128, help="training sequence length")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import transformers

    print(f"machine: {describe()}, torch {torch.__version__}, {torch.get_num_threads()} threads,")
    print(f"  transformers {transformers.__version__}, load average {load_average():.1f}")
    tokenizer = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    compiled = factory.compile(factory.load_blueprint("super"), proxy=True, seed=0, precision="off")
    model = compiled.model
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Super proxy {compiled.blueprint.model.pattern} + MTP depth "
          f"{compiled.blueprint.model.mtp_depth} ({compiled.blueprint.model.mtp_pattern}), "
          f"{params / 1e6:.1f}M parameters, fp32")  # fmt: skip
    started = time.perf_counter()
    mtp = compiled.blueprint.model.mtp
    assert mtp is not None
    loss = train(model, corpus(tokenizer), args.steps, args.seq_len, mtp.loss_scale)
    seconds = time.perf_counter() - started
    print(f"trained {args.steps} steps of {BATCH} x {args.seq_len} tokens on the docs in "
          f"{seconds:.0f} s (last loss {loss:.2f}, main + {mtp.loss_scale} x MTP)")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        write_hf_checkpoint(model, compiled.blueprint, Path(folder))
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.eval()
    prompt = tokenizer.encode(PROMPT).ids
    new = args.new_tokens
    texts: dict[str, list[int]] = {}
    results = {}

    def ours(speculative: str | None, name: str) -> float:
        started = time.perf_counter()
        result = generate(model, prompt, new, speculative=speculative)
        seconds = time.perf_counter() - started
        texts[name], results[name] = result.tokens, result
        return seconds

    def theirs() -> float:
        ids = torch.tensor([prompt])
        started = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None
            )
        seconds = time.perf_counter() - started
        texts["transformers generate"] = out[0, len(prompt) :].tolist()
        return seconds

    steps = {
        "ours, plain greedy": lambda: ours(None, "ours, plain greedy"),
        "ours, MTP speculative greedy": lambda: ours("mtp", "ours, MTP speculative greedy"),
        "transformers generate": theirs,
    }
    times = interleaved(steps, repeats=args.repeats, warmup=1)
    print(f"prompt: {len(prompt)} tokens; {new} new tokens, greedy, median of {args.repeats}")
    report(times, tokens=new)
    same = len({tuple(t) for t in texts.values()}) == 1
    print(f"same tokens from all three: {same}")
    spec = results["ours, MTP speculative greedy"]
    rates = ", ".join(f"{rate:.2f}" for rate in spec.acceptance)
    print(f"MTP: acceptance by draft position {rates}; {spec.tokens_per_forward:.2f} tokens per "
          f"forward ({spec.forwards} forwards for {len(spec.tokens)} tokens)")  # fmt: skip
    print("text:", repr(tokenizer.decode(texts["ours, plain greedy"])))
    if not same:
        raise SystemExit("the three decodings differ")
