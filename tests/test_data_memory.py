"""Memory stays bounded as the corpus grows: everything streams except the dedup index.

The dedup index holds one small key per (document, band): O(documents), never
O(text). So a corpus of ten times the text in the same number of documents
must not need more memory, and ten times the documents only the index's share.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from factory.data.samples import generate

SCRIPT = """
import resource, sys
from pathlib import Path
from factory.data.build_job import build
from factory.data.loaded_recipe import load_recipe
build(load_recipe(sys.argv[1]), Path(sys.argv[2]), workers=1)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _corpus(root: Path, docs: int, repeat: int) -> Path:
    """``docs`` documents, each its text repeated ``repeat`` times (so text grows, docs don't)."""
    root.mkdir(parents=True)
    with open(root / "web.jsonl", "w") as handle:
        for record in generate("pretrain_text", docs, 11):
            record["text"] = "\n\n".join([record["text"]] * repeat)
            handle.write(json.dumps(record) + "\n")
    recipe = {
        "name": "mem",
        "sources": [
            {
                "name": "web",
                "path": "web.jsonl",
                "category": "pretrain_text",
                "weight": 1,
                "steps": [{"kind": "text"}],
            }
        ],
        "packing": {"seq_len": 1024, "window": 256},
        "output": {"samples_per_shard": 64},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root / "recipe.yaml"


def _peak_kib(recipe: Path, out: Path) -> int:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(recipe), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(result.stdout.strip().splitlines()[-1])


def test_ten_times_the_text_needs_no_more_memory(tmp_path: Path) -> None:
    small = _peak_kib(_corpus(tmp_path / "a", 300, 1), tmp_path / "out_a")
    large = _peak_kib(_corpus(tmp_path / "b", 300, 10), tmp_path / "out_b")
    # ~0.6 MB of text against ~6 MB: the peak may move by allocator noise, not by 10x the text.
    assert large < small * 1.25 + 20 * 1024, (small, large)
