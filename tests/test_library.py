"""The toolkit as a library: reusable sources and constraints, mlx-lm-shaped calls, clear errors."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from decoder import DecodingStats, Draft, Sampling, accept_sampled, generate, generate_step
from decoder.pass_cost import PassCost
from tests.helpers import ScriptedSource, chi_square_p_value, tiny_byte_tokenizer, tiny_llama

VOCAB = 64
TARGET = tiny_llama(vocab_size=VOCAB, num_layers=3, seed=0)
DRAFT = tiny_llama(vocab_size=VOCAB, num_layers=1, seed=5)
# A first prompt, then a shorter and a longer one: a source that keeps state from the run before
# drafts from a stale cache (shorter: positions past the end; longer: the old text).
PROMPTS = [
    [5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 11, 3],
    [4, 8],
    [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 40, 41, 42, 1, 2],
]


def lookup():
    from prompt_lookup import PromptLookupSource

    return TARGET, [PromptLookupSource()], None


def draft_model():
    from draft_model import DraftModel

    return TARGET, [DraftModel(DRAFT, VOCAB, num_draft=3).source()], None


def draft_head():
    from decoder.hidden_states import HiddenStateTap, output_rows
    from draft_head import HeadDrafter
    from draft_head.head import DraftHead, head_args

    mx.random.seed(3)
    head = DraftHead(head_args(TARGET.args), output_rows(TARGET, mx.arange(VOCAB)))
    mx.eval(head.parameters())
    tap = HiddenStateTap(TARGET)
    return (
        tap,
        [HeadDrafter(tap, head, mx.arange(VOCAB), num_draft=3, adaptive=False).source()],
        None,
    )


BYTE_TOKENIZER = tiny_byte_tokenizer()
BYTE_MODEL = tiny_llama(vocab_size=len(BYTE_TOKENIZER), num_layers=2, seed=4)


def regex():
    from constrained import ForcedTextSource, RegexConstraint

    constraint = RegexConstraint.from_regex(
        r'\{"name": "[a-z]{1,8}", "n": \d{1,3}\}', BYTE_TOKENIZER, vocab_size=len(BYTE_TOKENIZER)
    )
    return BYTE_MODEL, [ForcedTextSource(constraint)], constraint


@pytest.mark.parametrize("make", [lookup, draft_model, draft_head, regex])
@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_a_reused_source_gives_what_a_fresh_one_gives(make, temp):
    def run(model, sources, constraint, prompt, seed):
        mx.random.seed(seed)
        stats = DecodingStats()
        # Timings differ between runs; a clock that stands still keeps the cost model at its prior.
        tokens = [
            t
            for t, _ in generate_step(
                prompt,
                model,
                draft_sources=sources,
                constraint=constraint,
                sampling=Sampling(temp),
                max_tokens=24,
                eos_token_ids=(),
                stats=stats,
                pass_cost=PassCost(clock=lambda: 0.0),
            )
        ]
        return tokens, stats.target_forward_passes, stats.draft_accepted

    reused = make()
    for seed, prompt in enumerate(PROMPTS):
        again = run(*reused, prompt, seed)
        fresh = run(*make(), prompt, seed)
        assert again == fresh, f"run {seed + 1} with reused objects differs from fresh ones"
    if make is regex:  # and the output of the last run follows the regex from its start
        index = regex()[2].index
        state = index.start
        for token in again[0]:
            state = index.next_state(state, token)
            assert state >= 0, f"{again[0]} breaks the regex"


def test_the_loop_resets_every_source_and_the_constraint_once_per_generation():
    source = ScriptedSource(lambda tokens, k: [1])
    for _ in range(3):
        list(generate_step([1, 2], TARGET, draft_sources=[source], max_tokens=3, eos_token_ids=()))
    assert source.resets == 3


def test_the_bare_model_with_a_head_source_is_one_clear_error():
    tap, sources, _ = draft_head()
    with pytest.raises(ValueError, match="HiddenStateTap"):
        list(
            generate_step([1, 2, 3], TARGET, draft_sources=sources, max_tokens=4, eos_token_ids=())
        )


def test_a_constraint_for_another_vocabulary_is_one_clear_error():
    _, _, constraint = regex()
    with pytest.raises(ValueError, match="build it with this model's tokenizer"):
        list(generate_step([1, 2], TARGET, constraint=constraint, max_tokens=2, eos_token_ids=()))


def test_a_prompt_cache_is_continued_not_refilled():
    from mlx_lm.models.cache import make_prompt_cache

    prompt = PROMPTS[2]
    plain = [t for t, _ in generate_step(prompt, TARGET, max_tokens=8, eos_token_ids=())]
    cache = make_prompt_cache(TARGET)
    TARGET(mx.array(prompt[:10])[None], cache=cache)
    reused = [
        t
        for t, _ in generate_step(
            prompt, TARGET, max_tokens=8, eos_token_ids=(), prompt_cache=cache
        )
    ]
    assert reused == plain and cache[0].offset == len(prompt) + 8 - 1
    with pytest.raises(ValueError, match="prompt_cache holds"):
        list(generate_step(prompt[:3], TARGET, max_tokens=1, eos_token_ids=(), prompt_cache=cache))


def test_a_greedy_sampler_gives_greedy_output_with_drafts():
    from prompt_lookup import PromptLookupSource

    for prompt in PROMPTS:
        plain = [t for t, _ in generate_step(prompt, TARGET, max_tokens=20, eos_token_ids=())]
        sampled = [
            t
            for t, _ in generate_step(
                prompt,
                TARGET,
                draft_sources=[PromptLookupSource()],
                max_tokens=20,
                eos_token_ids=(),
                sampler=make_sampler(temp=0.0),
            )
        ]
        assert sampled == plain


def test_an_mlx_lm_sampler_keeps_its_distribution_under_drafts():
    """Two tokens sampled through the loop with a scripted draft against the target's joint
    distribution under mlx-lm's temperature sampler (its top-p is taken before the temperature,
    ours after, so only the temperature is compared)."""
    vocab, prompt, temp, top_p = VOCAB, [1, 2, 3], 0.8, 1.0
    p1 = np.array(Sampling(temp, top_p).probs(TARGET(mx.array([prompt]))[0, -1:])[0])
    nexts = mx.array([prompt + [t] for t in range(vocab)])
    p2 = np.array(Sampling(temp, top_p).probs(TARGET(nexts)[:, -1]))
    joint = (p1[:, None] * p2).reshape(-1)
    top = int(np.argmax(p1))
    source = ScriptedSource(lambda tokens, k: [top, int(np.argmax(p2[top]))][:k])
    sampler = make_sampler(temp=temp, top_p=top_p)
    mx.random.seed(7)
    stats, counts = DecodingStats(), np.zeros(vocab * vocab, dtype=np.int64)
    for _ in range(1500):
        out = [
            t
            for t, _ in generate_step(
                prompt,
                TARGET,
                draft_sources=[source],
                sampler=sampler,
                max_tokens=2,
                eos_token_ids=(),
                stats=stats,
            )
        ]
        counts[out[0] * vocab + out[1]] += 1
    assert chi_square_p_value(counts, joint) > 1e-3
    assert 0 < stats.draft_accepted < stats.draft_proposed


def test_accept_sampled_stops_at_the_first_disagreement():
    logits = mx.log(mx.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]) + 1e-9)
    assert accept_sampled(logits, Draft([1, 2]), make_sampler(temp=0.0)) == (1, 0)
    assert accept_sampled(logits, Draft([1, 0]), make_sampler(temp=0.0)) == (2, 2)


def test_a_str_prompt_gets_the_chat_template_and_eos_by_default(embedded, chat_prompt, capsys):
    model, tokenizer, _ = embedded
    question = "What is the capital of France? Answer in one sentence."
    result = generate(model, tokenizer, question, max_tokens=40, verbose=True)
    assert result.tokens == generate(model, tokenizer, chat_prompt(question), max_tokens=40).tokens
    assert "Paris" in result.text and result.finish_reason == "stop" and len(result.tokens) < 40
    printed = capsys.readouterr().out
    assert result.text in printed and "Generation:" in printed and "Peak memory:" in printed


def test_encode_takes_text_a_system_message_chat_messages_or_token_ids(embedded):
    from decoder import encode

    _, tokenizer, _ = embedded
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
    ]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert encode(tokenizer, "Hi", system="Answer in French.") == expected
    assert encode(tokenizer, messages[1:], system="Answer in French.") == expected
    assert encode(tokenizer, messages) == expected
    assert encode(tokenizer, "Hi") == tokenizer.apply_chat_template(
        messages[1:], add_generation_prompt=True
    )
    assert encode(tokenizer, [5, 6]) == [5, 6] and encode(tokenizer, []) == []
