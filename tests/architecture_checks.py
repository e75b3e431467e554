"""What a user of any mlx-lm architecture expects of this toolkit, one function per feature.

Each check takes a model from ``tests.architectures.build`` (any config, any window), decodes
texts long enough to pass the model's sliding windows and chunks, and raises AssertionError
saying what differs from mlx-lm's own greedy tokens; an error the engine raises passes through.
``tests/test_architectures.py`` runs them under pytest and ``benchmarks/compatibility.py``
writes their outcomes as a table.
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from tests.architectures import VOCAB, quantize, window

ROOT = Path(__file__).resolve().parent.parent
MAIN_PROMPT = "List the planets of the solar system, one per line."


def lengths(model) -> tuple:
    """``(prompt length, batch prompt lengths, max_tokens)``: one prompt inside the model's longest
    window or chunk, batch rows on both sides of it (two close enough to be prefilled together,
    with left padding), and enough new tokens to pass it twice."""
    span = window(model)
    return max(span // 2, 6), [span + 5, span + 6, 3, 2 * span + 7], 2 * span + 16


def prompt_tokens(length: int, seed: int = 0) -> list:
    return mx.random.randint(0, VOCAB, (length,), key=mx.random.key(seed)).tolist()


def mlx_lm_greedy(model, prompt: list, max_tokens: int) -> list:
    """mlx-lm's own greedy tokens for ``prompt``: the oracle of every check."""
    from mlx_lm.generate import generate_step

    tokens = [token for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]
    # One token over and over (NaN logits, or a tied embedding predicting its input) would make
    # any rollback look right.
    assert len(set(tokens)) > 1 or max_tokens < 2, (
        f"the model repeats token {tokens[0]}: nothing to check"
    )
    return tokens


def near_copy(tokens: list, every: int = 6) -> list:
    """``tokens`` with every ``every``-th one changed: prompt lookup copying from it has its
    drafts accepted up to a changed token and rejected there."""
    return [
        (token + 1) % VOCAB if i % every == every // 2 else token for i, token in enumerate(tokens)
    ]


def lookup_source(prompt: list, output: list):
    """Prompt lookup over the prompt and a near-copy of ``output``, as if from an earlier answer."""
    from prompt_lookup import PromptLookupSource

    # A fixed draft length: drafts on every match, whatever the measured costs say.
    return PromptLookupSource(extra_context=prompt + near_copy(output), num_draft=4, adaptive=False)


def first_difference(got: list, want: list) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def assert_same_tokens(model, prompt: list, got: list, want: list, what: str):
    """Equal to mlx-lm's, or the first difference is a float near-tie (a wider pass sums in
    another order)."""
    if got == want:
        return
    at = first_difference(got, want)
    if at == min(len(got), len(want)):
        raise AssertionError(f"{what} gave {len(got)} tokens, mlx-lm {len(want)}")
    logits = model(mx.array([prompt + want[:at]]))[0, -1]
    gap = abs(logits[got[at]].item() - logits[want[at]].item())
    if gap >= 1e-4:
        raise AssertionError(
            f"{what} differs from mlx-lm at token {at} of {len(want)}: {got[at]} for {want[at]} "
            f"(logit gap {gap:.3g})"
        )


def assert_accepted_and_rejected(proposed: int, accepted: int, what: str):
    assert 0 < accepted < proposed, (
        f"{what}: {accepted} of {proposed} drafted tokens accepted, want some of each"
    )


def check_plain(model):
    """Plain greedy decoding with our loop gives mlx-lm's tokens."""
    from decoder import generate_step

    length, _, max_tokens = lengths(model)
    prompt = prompt_tokens(length)
    got = [
        token for token, _ in generate_step(prompt, model, eos_token_ids=(), max_tokens=max_tokens)
    ]
    assert_same_tokens(
        model, prompt, got, mlx_lm_greedy(model, prompt, max_tokens), "plain decoding"
    )


def decoded(model, prompt: list, max_tokens: int, sources: list, **options) -> list:
    """Our loop's tokens for ``prompt`` with ``sources``, without stopping at an EOS."""
    from decoder import enable_trees, generate_step

    if options.get("tree_nodes"):
        enable_trees(model)
    return [
        token
        for token, _ in generate_step(
            prompt, model, eos_token_ids=(), max_tokens=max_tokens, draft_sources=sources, **options
        )
    ]


def check_prompt_lookup(model):
    """Prompt lookup gives mlx-lm's tokens, with some drafts accepted and some rejected."""
    from decoder import DecodingStats

    length, _, max_tokens = lengths(model)
    prompt = prompt_tokens(length, seed=1)
    want, stats = mlx_lm_greedy(model, prompt, max_tokens), DecodingStats()
    got = decoded(model, prompt, max_tokens, [lookup_source(prompt, want)], stats=stats)
    assert_same_tokens(model, prompt, got, want, "prompt lookup")
    assert_accepted_and_rejected(stats.draft_proposed, stats.draft_accepted, "prompt lookup")


def regex_for(model) -> tuple:
    """JSON-like text with forced parts and free ones (digits, words), longer than two windows, and
    a max_tokens it always fits in (a tag is at most 10 tokens: `, "`, six letters, `"`)."""
    tags = max(3, window(model) // 2)
    return r'\{"id": \d{3}, "tags": \["[a-z]{2,6}"(, "[a-z]{2,6}"){%d}\]\}' % tags, 10 * (
        tags + 1
    ) + 32


def check_regex(model, tokenizer):
    """Under a regex, forced text and prompt lookup give what the constraint alone gives (and
    some of their drafts are accepted); the text fully matches and ends with EOS."""
    from constrained import ForcedTextSource, RegexConstraint
    from decoder import DecodingStats, eos_ids_of, generate_step

    (pattern, max_tokens), eos = regex_for(model), eos_ids_of(tokenizer)
    constraint = RegexConstraint.from_regex(pattern, tokenizer, vocab_size=VOCAB)
    length, _, _ = lengths(model)
    prompt = prompt_tokens(length, seed=2)

    def run(sources, stats=None):
        return [
            token
            for token, _ in generate_step(
                prompt,
                model,
                eos_token_ids=eos,
                max_tokens=max_tokens,
                constraint=constraint,
                draft_sources=sources,
                stats=stats,
            )
        ]

    want, stats = run([]), DecodingStats()
    text = tokenizer.decode([token for token in want if token not in eos])
    assert want[-1] in eos and re.fullmatch(pattern, text), (
        f"the constrained text {text!r} does not match"
    )
    got = run([ForcedTextSource(constraint), lookup_source(prompt, want)], stats)
    if got != want:
        at = first_difference(got, want)
        raise AssertionError(
            f"with drafts the constrained text differs at token {at}: "
            f"{tokenizer.decode(got[: at + 1])!r} for {tokenizer.decode(want[: at + 1])!r}"
        )
    assert stats.draft_accepted > 0, "no draft was accepted under the regex"


def check_batch(model, lookup: bool = False):
    """Rows of different lengths in one BatchGenerator (two prefilled together, the others joining
    later) each give mlx-lm's tokens for their prompt alone; with ``lookup``, each row copies from
    a near-copy of its own output, and drafts are both accepted and rejected."""
    from batch import BatchGenerator

    _, row_lengths, max_tokens = lengths(model)
    prompts = [prompt_tokens(length, seed=10 + row) for row, length in enumerate(row_lengths)]
    wants = [mlx_lm_greedy(model, prompt, max_tokens) for prompt in prompts]
    sources = [
        [lookup_source(prompt, want)] if lookup else [] for prompt, want in zip(prompts, wants)
    ]
    generator = BatchGenerator(model, eos_token_ids=())
    uids = generator.insert(prompts, draft_sources=sources, max_tokens=max_tokens)
    tokens, finished = {uid: [] for uid in uids}, {}
    while responses := generator.next():
        for response in responses:
            tokens[response.uid] += response.tokens
            if response.finish_reason is not None:
                finished[response.uid] = response
    for row, (uid, prompt, want) in enumerate(zip(uids, prompts, wants)):
        assert finished[uid].error is None, (
            f"row {row} ({len(prompt)} tokens) failed: {finished[uid].error}"
        )
        assert_same_tokens(
            model, prompt, tokens[uid], want, f"batch row {row} ({len(prompt)} prompt tokens)"
        )
    if lookup:
        counts = [
            (finished[uid].stats.draft_proposed, finished[uid].stats.draft_accepted) for uid in uids
        ]
        assert_accepted_and_rejected(*map(sum, zip(*counts)), "batched prompt lookup")


def tree_lookup_source(prompt: list, output: list):
    """Prompt lookup over two near-copies of ``output`` changed at different tokens, so that its
    trees branch where they disagree; ``trees`` counts the trees it drafted."""
    from prompt_lookup import PromptLookupSource

    class CountingTrees(PromptLookupSource):
        trees = 0

        def propose(self, tokens: list, max_draft: int, max_nodes=None):
            draft = super().propose(tokens, max_draft, max_nodes)
            self.trees += draft is not None and draft.parents is not None
            return draft

    context = prompt + near_copy(output) + prompt + near_copy(output, every=4)
    return CountingTrees(extra_context=context, num_draft=4, adaptive=False)


def check_trees(model, tree_nodes: int = 4, batch: bool = True) -> int:
    """Draft trees of ``tree_nodes`` nodes from lookup give mlx-lm's tokens, one row alone and
    (``batch``) rows in a batch; returns how many trees were verified (0: the model drafts
    chains)."""
    from batch import BatchGenerator

    length, row_lengths, max_tokens = lengths(model)
    prompt = prompt_tokens(length, seed=2)
    want = mlx_lm_greedy(model, prompt, max_tokens)
    source = tree_lookup_source(prompt, want)
    got = decoded(model, prompt, max_tokens, [source], tree_nodes=tree_nodes)
    assert_same_tokens(model, prompt, got, want, f"draft trees of {tree_nodes} nodes")
    trees = source.trees
    if not batch:
        return trees
    prompts = [prompt_tokens(n, seed=20 + row) for row, n in enumerate(row_lengths[:3])]
    wants = [mlx_lm_greedy(model, p, max_tokens) for p in prompts]
    sources = [[tree_lookup_source(p, w)] for p, w in zip(prompts, wants)]
    generator = BatchGenerator(model, eos_token_ids=(), tree_nodes=tree_nodes)
    uids = generator.insert(prompts, draft_sources=sources, max_tokens=max_tokens)
    tokens = {uid: [] for uid in uids}
    while responses := generator.next():
        for response in responses:
            assert response.error is None, response.error
            tokens[response.uid] += response.tokens
    for row, (uid, p, w) in enumerate(zip(uids, prompts, wants)):
        assert_same_tokens(model, p, tokens[uid], w, f"batch row {row} with draft trees")
    return trees + sum(row_sources[0].trees for row_sources in sources)


def check_quantized(model, config: dict, bits: int):
    """The ``bits``-bit model (mlx-lm's quantization, group 64) decodes as mlx-lm does, plain and
    with prompt lookup."""
    quantized, _ = quantize(model, config, bits)
    check_plain(quantized)
    check_prompt_lookup(quantized)


def check_mtp(model_type: str):
    """Greedy decoding with MTPSource drafts gives mlx-lm's greedy tokens, with drafts accepted and
    rejected, on a tiny ``model_type`` checkpoint whose MTP layer is right often, not always
    (tests/mtp_fixtures.py, in the layout Hugging Face ships). The models of tests/architectures.py
    would draft at random over SmolLM2's vocabulary, accepting nothing."""
    from decoder import DecodingStats, generate_step
    from loading.target import load_mlx_lm
    from mtp.source import MTPDrafter
    from tests.helpers import tiny_byte_tokenizer
    from tests.mtp_fixtures import write_checkpoint

    prompt, max_tokens, stats = [5, 6, 7, 8], 40, DecodingStats()
    with tempfile.TemporaryDirectory() as directory:
        write_checkpoint(
            directory, model_type, seed=1, exact=True, noise=0.08, tokenizer=tiny_byte_tokenizer()
        )
        target, _, _ = load_mlx_lm(Path(directory))
        # A fixed draft length: an adaptive one may pause a drafter that is often wrong.
        tap, drafter = MTPDrafter.create(target, directory, num_draft=3, adaptive=False)
        source = drafter.source()
        got = [
            token
            for token, _ in generate_step(
                prompt,
                tap,
                eos_token_ids=(),
                max_tokens=max_tokens,
                draft_sources=[source],
                stats=stats,
            )
        ]
    assert_same_tokens(target, prompt, got, mlx_lm_greedy(target, prompt, max_tokens), "MTP drafts")
    assert_accepted_and_rejected(stats.draft_proposed, stats.draft_accepted, "MTP drafts")


class MainError(AssertionError):
    """main.py failed; ``refused`` when it said why in one line rather than with a traceback."""

    def __init__(self, status: int, stderr: str):
        lines = stderr.strip().splitlines() or [f"exit status {status}"]
        super().__init__(f"main.py exited with status {status}: {lines[-1]}")
        self.line, self.refused = lines[-1], "Traceback" not in stderr


def check_main(model, directory, tokenizer):
    """``main.py --model DIR --json --prompt-lookup`` on ``model`` saved in ``directory`` prints
    mlx-lm's greedy tokens (up to EOS)."""
    from decoder import eos_ids_of

    _, _, max_tokens = lengths(model)
    command = [
        sys.executable,
        "main.py",
        "--model",
        str(directory),
        "--json",
        "--prompt-lookup",
        "--max-tokens",
        str(max_tokens),
        "--prompt",
        MAIN_PROMPT,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise MainError(done.returncode, done.stderr.replace(str(directory), "DIR"))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": MAIN_PROMPT}], add_generation_prompt=True
    )
    from mlx_lm import load

    # what main.py reads: the weights as saved and sanitized (baichuan_m1
    saved, _ = load(str(directory))
    # normalizes its head on load, a near tie apart)
    want = mlx_lm_greedy(saved, prompt, max_tokens)
    eos = eos_ids_of(tokenizer)
    want = want[: next((i + 1 for i, token in enumerate(want) if token in eos), len(want))]
    assert_same_tokens(model, prompt, json.loads(done.stdout)["tokens"], want, "main.py")
