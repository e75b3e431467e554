"""A quantized KV cache (``make_cache(kv_bits=...)``, ``--kv-bits``): drafts are verified against
it, so greedy output with any draft source equals plain decoding with the same bits, one row and
batched, chains and trees, full attention and sliding windows; the cache holds a fraction of the
bytes; a model the quantized kernel cannot run is refused in one line."""

import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batch import BatchGenerator
from decoder import Sampling, generate_step
from decoder.cache import CacheKindError, make_cache
from decoder.draft import Draft, DraftSource
from decoder.prefill import Prefill, prefill_rows
from decoder.tree_pass import enable_trees
from prompt_lookup import PromptLookupSource
from tests.architectures import build
from tests.helpers import ScriptedSource, chi_square_p_value, count_trees, tiny_llama

GROUP = 32  # the tiny models' heads are 32 wide
MODELS = {}


def model_of(name: str):
    if name not in MODELS:
        MODELS[name] = build(name, head_dim=32)[0]
        enable_trees(MODELS[name])
    return MODELS[name]


def decode(model, prompt, bits, sources=(), tree_nodes=0, max_tokens=16):
    steps = generate_step(
        prompt,
        model,
        eos_token_ids=(),
        max_tokens=max_tokens,
        draft_sources=list(sources),
        tree_nodes=tree_nodes,
        kv_bits=bits,
        kv_group_size=GROUP,
    )
    return [token for token, _ in steps]


def repetitive(seed: int, length: int) -> list:
    """A prompt that repeats itself, so lookup drafts often and is sometimes wrong."""
    phrase = [(seed * 13 + 7 * index) % 200 + 1 for index in range(7)]
    return (phrase * (length // 7 + 1))[:length]


class Guesses(DraftSource):
    """Drafts the plain tokens (``truth``) with one of them wrong now and then, and for a tree a
    wrong sibling beside the first: drafts are accepted and rejected, chains and trees alike."""

    name = "guesses"

    def __init__(self, prompt_length: int, truth: list, seed: int):
        self.prompt_length, self.truth, self.rng = prompt_length, truth, random.Random(seed)

    def propose(self, tokens, max_draft, max_nodes=None):
        done = len(tokens) - self.prompt_length
        chain = list(self.truth[done : done + min(max_draft, 4)])
        if not chain:
            return None
        if self.rng.random() < 0.5:  # one wrong token, and what follows it is rejected
            spot = self.rng.randrange(len(chain))
            chain[spot] = (chain[spot] + 1) % 250
        if max_nodes is None:
            return Draft(chain)
        parents = list(range(-1, len(chain) - 1)) + [-1]
        return Draft(chain + [(chain[0] + 7) % 250], parents=parents)


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    bits=st.sampled_from([4, 8]),
    seed=st.integers(0, 50),
    length=st.integers(12, 60),
    tree_nodes=st.sampled_from([0, 6]),
)
def test_drafts_keep_plain_decoding_with_the_same_bits(name, bits, seed, length, tree_nodes):
    model, prompt = model_of(name), repetitive(seed, length)
    want, shapes = decode(model, prompt, bits), []
    source = count_trees(Guesses(len(prompt), want, seed), shapes)
    assert decode(model, prompt, bits, [source, PromptLookupSource()], tree_nodes) == want
    assert all(shapes) and shapes if tree_nodes else not shapes  # trees were verified


def test_rows_joining_and_leaving_a_quantized_batch_decode_as_alone():
    model = model_of("llama")
    prompts = [repetitive(seed, 20 + 9 * seed) for seed in range(4)]
    wants = [decode(model, prompt, 8, max_tokens=10 + 4 * i) for i, prompt in enumerate(prompts)]
    generator = BatchGenerator(model, kv_bits=8, kv_group_size=GROUP, tree_nodes=6)
    sources = [[Guesses(len(p), w, seed)] for seed, (p, w) in enumerate(zip(prompts, wants))]
    uids = generator.insert(prompts[:2], draft_sources=sources[:2], max_tokens=[10, 14])
    tokens = {}
    for step in range(200):
        if step == 3:  # two rows join while the first two decode
            uids += generator.insert(prompts[2:], draft_sources=sources[2:], max_tokens=[18, 22])
        responses = generator.next()
        if not responses and step > 3:
            break
        for response in responses:
            assert response.error is None
            tokens.setdefault(response.uid, []).extend(response.tokens)
    assert [tokens[uid] for uid in uids] == wants


def test_the_cache_holds_a_fraction_of_the_bytes():
    """float32 keys and values of 128 dims: 0.28x at 8 bits, 0.16x at 4 (#58's goals: 0.30x and
    0.17x), scales and biases included."""
    model, prompt = build("llama", head_dim=128)[0], repetitive(1, 256)
    plain = prefill_rows(model, [prompt]).attention[0].nbytes
    for bits, most in ((8, 0.30), (4, 0.17)):
        cache = make_cache(model, kv_bits=bits)
        quantized = Prefill(model, [prompt], cache=cache).run().attention[0].nbytes
        assert quantized <= most * plain, (bits, quantized / plain)


def test_attention_sinks_are_refused_in_one_line():
    model = build("gpt_oss")[0]
    with pytest.raises(CacheKindError, match="gpt_oss: its cache cannot be quantized"):
        make_cache(model, kv_bits=8)
    with pytest.raises(CacheKindError, match="attention sinks"):
        BatchGenerator(model, kv_bits=4)


def test_the_prompt_store_keeps_quantized_blocks_apart(tmp_path):
    """A quantized cache's blocks restore as they were stored (the prompt's tokens decode as a
    cold prefill with the same bits), and another bit width never reads them."""
    from prompt_store import PromptStore

    model, prompt = model_of("llama"), repetitive(5, 40)
    for bits, restored in ((8, 0), (8, 32), (4, 0)):
        store = PromptStore(tmp_path, model, block_tokens=8, kv_bits=bits, kv_group_size=GROUP)
        steps = generate_step(
            prompt,
            model,
            eos_token_ids=(),
            max_tokens=8,
            kv_bits=bits,
            kv_group_size=GROUP,
            prompt_store=store,
        )
        assert [token for token, _ in steps] == decode(model, prompt, bits, max_tokens=8)
        assert store.stats()["restored_tokens"] == restored
        store.close()


def test_sampling_keeps_the_quantized_target_distribution():
    """Two tokens sampled 1500 times with random drafts through a 4-bit cache, chi-squared
    against the target's own joint distribution through a 4-bit cache."""
    target = tiny_llama(vocab_size=8, hidden_size=128, seed=3, sharp=2.0)
    prompt, sampling, quantized = [1, 2, 3], Sampling(1.0), dict(kv_bits=4, kv_group_size=GROUP)

    def probs(tokens: list) -> np.ndarray:
        cache = make_cache(target, **quantized)
        logits = target(mx.array([tokens]), cache=cache.layers)[0, -1:]
        return np.array(sampling.probs(logits)[0])

    first = probs(prompt)
    joint = np.concatenate([first[t] * probs(prompt + [t]) for t in range(8)])
    rng, counts, accepted = random.Random(0), np.zeros(64, dtype=np.int64), 0
    mx.random.seed(11)
    for _ in range(1500):
        noise = ScriptedSource(lambda tokens, k: [rng.randrange(8) for _ in range(k)], "noise")
        steps = generate_step(
            prompt,
            target,
            eos_token_ids=(),
            max_tokens=2,
            draft_sources=[noise],
            sampling=sampling,
            **quantized,
        )
        out = [(token, source) for token, source in steps]
        counts[out[0][0] * 8 + out[1][0]] += 1
        accepted += sum(source == "noise" for _, source in out)
    assert chi_square_p_value(counts, joint) > 1e-3
    assert accepted > 0  # some drafts were accepted, by the rule the test checks
