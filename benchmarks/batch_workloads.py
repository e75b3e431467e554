"""The workloads of benchmarks/batch.py (prompts, and token indexes for the constrained ones) and
the methods each is run with: option factories for ``BatchGenerator.insert``, per row.
"""

from pathlib import Path

from benchmarks.harness import PROMPTS, chat_tokens
from benchmarks.json_schema import schema_requests
from constrained import ForcedTextSource, RegexConstraint, TokenSplits, schema_to_regex
from constrained.token_index import load_or_build_index
from decoder.draft import Draft, DraftSource
from decoder.text import eos_ids_of
from loading.store import cache_dir
from prompt_lookup.ngram import PromptLookupSource

ROOT = Path(__file__).parent


def schema_tasks(tokenizer, vocab_size, folder: str) -> tuple:
    """(prompts, token indexes) of the schemas in benchmarks/json_schemas/``folder``."""
    requests = schema_requests(folder)
    indexes = [
        load_or_build_index(
            schema_to_regex(schema),
            tokenizer,
            vocab_size,
            eos_ids_of(tokenizer),
            cache_dir=cache_dir() / "regex-index",
        )
        for _, schema in requests
    ]
    return [chat_tokens(tokenizer, text) for text, _ in requests], indexes


def load_workloads(tokenizer, vocab_size, names):
    grounded = [
        (f"{folder}/{file.stem}", file.read_text())
        for folder in ("extractive_qa", "code_edit", "summarize_quotes")
        for file in sorted((PROMPTS / folder).glob("*.txt"))
    ]
    chat = [
        line for line in (ROOT / "heldout" / "chat.txt").read_text().splitlines() if line.strip()
    ]
    work = {}
    if "chat" in names:
        work["chat"] = ([chat_tokens(tokenizer, text) for text in chat], None)
    if "grounded" in names:
        work["grounded"] = ([chat_tokens(tokenizer, text) for _, text in grounded], None)
    for name, folder in (("json", "suite"), ("extract", "extraction")):
        if name in names or (name == "extract" and "mix" in names):
            work[name] = schema_tasks(tokenizer, vocab_size, folder)
    # chat, grounded, extract in turn, so row i's kind is i % 3 (see methods_for)
    if "mix" in names:
        count = min(len(chat), len(grounded), len(work["extract"][0]))
        mixed = [
            chat_tokens(tokenizer, chat[i])
            if kind == 0
            else chat_tokens(tokenizer, grounded[i][1])
            if kind == 1
            else work["extract"][0][i]
            for i in range(count)
            for kind in range(3)
        ]
        work["mix"] = (mixed, work["extract"][1][:count])
    return {name: work[name] for name in names}


class ForcedTextOracle(DraftSource):
    """Drafts the text the regex forces in the very tokens the target will write (``truth``, the
    row's output from a run without drafts): every draft is accepted. A bound for the benchmark."""

    name = "regex"  # free to ask, as the forced text's source (batch.policy.DraftGate)

    def __init__(self, constraint, token_bytes, prompt_length: int, truth: list):
        self.constraint, self.token_bytes = constraint, token_bytes
        self.prompt_length, self.truth = prompt_length, truth

    def propose(self, tokens: list, max_draft: int, max_nodes=None):
        forced = self.constraint.index.dfa.forced_bytes(self.constraint.state)
        draft, written = [], b""
        for token in self.truth[len(tokens) - self.prompt_length :][:max_draft]:
            spelled = self.token_bytes[token]
            if not spelled or not forced.startswith(written + spelled):
                break
            draft.append(token)
            written += spelled
        return Draft(draft) if draft else None


def methods_for(workload, indexes, tokenizer, oracle=None):
    """(name, options factory or None for mlx-lm) per method; factories build fresh per-row objects.
    ``oracle``: (token byte strings, {rows: (prompts, the first method's output)}) adds the schema
    workloads' bound."""
    # the model's way with forced text, learned across batches as a server would
    splits = TokenSplits(tokenizer)
    if workload == "mix":
        return mixed_methods(indexes, splits)
    if workload in ("json", "extract"):
        return schema_methods(indexes, splits, oracle)

    def lookup(rows):
        return lambda: {"draft_sources": [[PromptLookupSource()] for _ in range(rows)]}

    return [
        ("mlx-lm BatchGenerator", None),
        ("ours plain", lambda rows: lambda: {}),
        ("ours + prompt lookup", lookup),
    ]


def mixed_methods(indexes, splits) -> list:
    """The mix workload: row i is chat, grounded or extract as i % 3; extract rows constrained."""

    def mixed(rows, drafts):
        def make():
            constraints = [
                RegexConstraint(indexes[(i % (3 * len(indexes))) // 3], splits)
                if i % 3 == 2
                else None
                for i in range(rows)
            ]
            sources = [
                ([ForcedTextSource(c)] if c is not None else []) + [PromptLookupSource()]
                if drafts
                else []
                for c in constraints
            ]
            return {"constraint": constraints, "draft_sources": sources}

        return make

    return [
        ("ours, no drafts", lambda rows: mixed(rows, False)),
        ("ours + forced + lookup", lambda rows: mixed(rows, True)),
    ]


def schema_methods(indexes, splits, oracle) -> list:
    """The json and extract workloads: constrained, then with forced text and lookup, then (with
    ``oracle``) the bound."""

    def constrained(rows, drafts):
        def make():
            constraints = [RegexConstraint(indexes[i % len(indexes)], splits) for i in range(rows)]
            sources = [
                [ForcedTextSource(c), PromptLookupSource()] if drafts else [] for c in constraints
            ]
            return {"constraint": constraints, "draft_sources": sources}

        return make

    methods = [
        ("ours constrained", lambda rows: constrained(rows, False)),
        ("ours constrained + forced + lookup", lambda rows: constrained(rows, True)),
    ]
    if oracle is None:
        return methods
    token_bytes, truths = oracle

    def bound(rows):
        def make():
            prompts, truth = truths[rows]
            constraints = [RegexConstraint(indexes[i % len(indexes)]) for i in range(rows)]
            return {
                "constraint": constraints,
                "draft_sources": [
                    [
                        ForcedTextOracle(c, token_bytes, len(prompts[i]), truth[i]),
                        PromptLookupSource(),
                    ]
                    for i, c in enumerate(constraints)
                ],
            }

        return make

    return methods + [("bound: oracle forced text + lookup", bound)]
