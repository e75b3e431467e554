"""The JSON Schema engines that `benchmarks.grammar` compares, behind one small interface, and the
MaskBench development set they run on.

Each engine compiles a schema, says whether it accepts a text, and exposes its token mask so that
`random_outputs` can walk it (texts a validator then checks).
"""

import json
import random
import re
from pathlib import Path

import numpy as np

from constrained.grammar import GrammarConstraint, compile_json_schema, ll_tokenizer_of
from decoder.draft import ConstraintError
from decoder.text import eos_ids_of

DEV_SPLITS = re.compile(
    r"(Github_trivial|Github_ultra|Handwritten|Synthesized|MCPspec)---.*|(BFCL_[a-z_]+|JME)_\d+\.json"
)
WALKS, WALK_TOKENS = 2, 200


def split_of(name: str) -> str:
    return name.split("---")[0] if "---" in name else name.rsplit("_", 1)[0]


def load_dev_set(folder: Path, per_split: int, seed: int = 0) -> list:
    """[(split, name, schema, tests)]: at most `per_split` files per split, a fixed random
    sample."""
    by_split = {}
    for path in sorted(folder.iterdir()):
        if DEV_SPLITS.fullmatch(path.name):
            by_split.setdefault(split_of(path.name), []).append(path)
    rng, cases = random.Random(seed), []
    for split, paths in sorted(by_split.items()):
        for path in sorted(rng.sample(paths, min(per_split, len(paths)))):
            data = json.loads(path.read_text())
            cases.append((split, path.name, data["schema"], data.get("tests", [])))
    return cases


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class Engine:
    """One JSON Schema engine: compile, accept a text, and random token walks (outputs) under its
    masks."""

    name = ""

    def compile(self, schema):
        raise NotImplementedError


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.ll_tokenizer = ll_tokenizer_of(tokenizer)

    def compile(self, schema):
        return GrammarConstraint.from_llguidance(
            compile_json_schema(schema, self.ll_tokenizer), self.tokenizer, self.vocab_size
        )

    def accepts(self, constraint, text):
        constraint.reset()
        tokens = self.ll_tokenizer.tokenize_str(text) + [self.ll_tokenizer.eos_token]
        return constraint.matcher.validate_tokens(tokens) == len(tokens)

    def allowed(self, constraint):
        return np.array(constraint.masks(constraint.walk([])))[0]

    def advance(self, constraint, token):
        constraint.advance([token])


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer._tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.vocab_size, self.tokenizer = vocab_size, tokenizer
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema):
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        return self.xgr.GrammarMatcher(compiled)

    def accepts(self, matcher, text):
        matcher.reset()
        tokens = (
            self.tokenizer.encode(text, add_special_tokens=False)
            + sorted(eos_ids_of(self.tokenizer))[:1]
        )
        return all(matcher.accept_token(token) for token in tokens)

    def allowed(self, matcher):
        matcher.fill_next_token_bitmask(self.bitmask)
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[
            0, : self.vocab_size
        ]
        return bits.astype(bool)

    def advance(self, matcher, token):
        matcher.accept_token(int(token))


def random_outputs(engine, handle, eos, closers, rng, walks=WALKS):
    """(texts of random walks that end with EOS, walks the engine gave up on): EOS half the time it
    is allowed, closing characters often, any allowed token otherwise (outputs biased to finish)."""
    texts, failed = [], 0
    for _ in range(walks):
        handle.reset()
        tokens = []
        for _ in range(WALK_TOKENS):
            try:
                allowed = engine.allowed(handle)  # (vocab,) bool
            # llguidance past its lexer limits (a one-line error in main.py)
            except ConstraintError:
                failed += 1
                break
            if any(allowed[token] for token in eos) and rng.random() < 0.5:
                texts.append(engine.tokenizer.decode(tokens))
                break
            closing = closers[allowed[closers]]
            pool = closing if len(closing) and rng.random() < 0.4 else np.flatnonzero(allowed)
            if not len(pool):
                break
            token = int(rng.choice(pool))
            if token in eos:
                texts.append(engine.tokenizer.decode(tokens))
                break
            engine.advance(handle, token)
            tokens.append(token)
    return texts, failed
