"""The prompt cache on disk (prompt_store/): a prompt that extends a stored prefix restores its
longest run of whole blocks, in a new store object as after a restart, and decodes token for token
as a cold prefill does, for every cache kind, one row and batched, with drafts and constraints;
another model or dtype never reads the blocks; the server's tiers report through GET /v1/cache and
survive a restart."""

import json
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch import BatchGenerator
from constrained import ForcedTextSource, RegexConstraint
from decoder import generate_step
from decoder.row import DecodingStats
from decoder.tree_pass import enable_trees
from prompt_lookup import PromptLookupSource
from prompt_store import PromptStore
from tests import tiny_server
from tests.architectures import build
from tests.helpers import drain, stop, tiny_byte_tokenizer, tiny_llama
from tests.test_server_tiny import start

# full attention, sliding windows, recurrent layers beside attention, a CacheList of both per
# layer, and MLA's compressed keys
KINDS = ["llama", "gemma3_text", "qwen3_next", "falcon_h1", "deepseek_v3"]
MODELS = {}


def model_of(name: str):
    if name not in MODELS:
        MODELS[name] = build(name)[0]
        enable_trees(MODELS[name])  # a model that refuses drafts chains
    return MODELS[name]


def decode(model, prompt, store=None, lookup=False, max_tokens=10):
    """Greedy tokens, and how many prompt tokens came from ``store``."""
    stats = DecodingStats()
    steps = generate_step(
        prompt,
        model,
        eos_token_ids=(),
        max_tokens=max_tokens,
        draft_sources=[PromptLookupSource()] if lookup else [],
        tree_nodes="auto" if lookup else 0,
        prompt_store=store,
        stats=stats,
    )
    return [token for token, _ in steps], stats.prompt_cache_tokens


def text(seed: int, length: int) -> list:
    return [(seed * 31 + 7 * index + index * index) % 250 + 1 for index in range(length)]


@pytest.mark.parametrize("name", KINDS)
@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(
    block_tokens=st.sampled_from([4, 8, 16]),
    length=st.integers(20, 70),
    cut=st.floats(0.2, 1.0),
    lookup=st.booleans(),
)
def test_a_restored_prefix_decodes_as_a_cold_prefill(
    name, tmp_path_factory, block_tokens, length, cut, lookup
):
    model, folder = model_of(name), tmp_path_factory.mktemp("store")
    first = text(1, length)
    # a second prompt that shares the first's first ``shared`` tokens, then goes elsewhere
    shared = max(1, int(cut * length))
    second = first[:shared] + text(2, 25)
    store = PromptStore(folder, model, block_tokens=block_tokens)
    assert decode(model, first, store, lookup) == (decode(model, first, lookup=lookup)[0], 0)
    store.close()
    restarted = PromptStore(folder, model, block_tokens=block_tokens)
    # the longest run of whole blocks both prompts start with (the last token is fed, not cached)
    expected = min(shared, length - 1) // block_tokens * block_tokens
    want = decode(model, second, lookup=lookup)[0]
    assert decode(model, second, restarted, lookup) == (want, expected)
    restarted.close()


def test_rows_of_a_batch_restore_their_own_prefixes(tmp_path):
    """Rows joining together and later, with prompt lookup and a regex, each restore what the
    store holds of its prompt and decode as they do alone without it."""
    tokenizer = tiny_byte_tokenizer()
    vocab = len(tokenizer)
    model = tiny_llama(vocab_size=vocab, num_layers=2, hidden_size=32, seed=3, sharp=3.0)
    store = PromptStore(tmp_path, model, block_tokens=8)
    prompts = [tokenizer.encode("name: ab 12 20 ab name: ab 12 " * (1 + row)) for row in range(3)]
    generator = BatchGenerator(model, prompt_store=store)
    drain(generator, generator.insert(prompts[:1], max_tokens=6))
    store.close()  # the first prompt's blocks are on disk; a new store reads them
    store = PromptStore(tmp_path, model, block_tokens=8)
    constraint = RegexConstraint.from_regex("[a-z]{3} [0-9]{2}", tokenizer, vocab)
    wants = [
        [t for t, _ in generate_step(p, model, eos_token_ids=(), max_tokens=8, constraint=c)]
        for p, c in zip(prompts, [None, RegexConstraint(constraint.index), None])
    ]
    generator = BatchGenerator(model, prompt_store=store, keep_caches=True)
    uids = generator.insert(
        prompts[:2],
        max_tokens=8,
        draft_sources=[[PromptLookupSource()], [ForcedTextSource(constraint)]],
        constraint=[None, constraint],
    )
    first = generator.next()  # the first two decode while the third joins
    uids += generator.insert(prompts[2:], max_tokens=8, draft_sources=[[PromptLookupSource()]])
    tokens = {uid: [] for uid in uids}
    restored = {}
    while responses := first or generator.next():
        first = None
        for response in responses:
            assert response.error is None
            tokens[response.uid] += response.tokens
            if response.stats is not None:
                restored[response.uid] = response.stats.prompt_cache_tokens
    assert [tokens[uid] for uid in uids] == wants
    # every prompt starts with the first one's blocks; the third also with the second's
    held = (len(prompts[0]) - 1) // 8 * 8
    assert [restored[uid] for uid in uids[:2]] == [held, held]
    assert restored[uids[2]] == (len(prompts[1]) - 1) // 8 * 8
    store.close()


def test_another_model_or_dtype_never_reads_the_blocks(tmp_path):
    model = model_of("llama")
    prompt = text(3, 40)
    with_store = PromptStore(tmp_path, model, block_tokens=8)
    decode(model, prompt, with_store)
    with_store.close()
    other, _ = build("llama", seed=1)
    assert decode(other, prompt, PromptStore(tmp_path, other, block_tokens=8))[1] == 0
    halved, _ = build("llama")
    halved.set_dtype(mx.float16)
    assert decode(halved, prompt, PromptStore(tmp_path, halved, block_tokens=8))[1] == 0
    # the same weights loaded again (not the same object) read them
    again, _ = build("llama")
    assert decode(again, prompt, PromptStore(tmp_path, again, block_tokens=8))[1] == 32


def test_a_damaged_block_is_a_shorter_restore(tmp_path):
    """A block cut short on disk is refused (its checksum), removed and counted; the prompt
    restores the blocks before it and decodes as ever."""
    model, prompt = model_of("llama"), text(4, 40)
    store = PromptStore(tmp_path, model, block_tokens=8)
    want, _ = decode(model, prompt, store)
    store.close()
    files = sorted((tmp_path / "blocks").rglob("*.safetensors"))
    metadata = [mx.load(str(f), return_metadata=True)[1] for f in files]
    third = next(f for f, m in zip(files, metadata) if m["block"] == "2")
    third.write_bytes(third.read_bytes()[:-100])
    store = PromptStore(tmp_path, model, block_tokens=8)
    assert decode(model, prompt, store) == (want, 16)
    assert store.stats()["corrupt"] == 1
    store.close()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def start_server(folder: Path, log_dir: Path):
    """The tiny server with a prompt store in ``folder`` (``test_server_tiny.start``)."""
    log_dir.mkdir()
    flags = ["--prompt-cache-dir", str(folder), "--block-tokens", "16", "--prompt-lookup"]
    return start(log_dir, *flags)[:2]


def test_the_server_restores_from_disk_after_a_restart(tmp_path):
    """A conversation's next turn after the server restarted prefills only past the stored
    blocks (usage's cached tokens), answers as the model does alone, and GET /v1/cache says which
    tier served it."""
    tokenizer, model = tiny_server.tokenizer(), tiny_server.model()
    turn = [{"role": "user", "content": "name: ab 12 20 ab name: ab 12 " * 3}]
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    process, url = start_server(tmp_path / "store", tmp_path / "first")
    try:
        answer = post(f"{url}/chat/completions", {**body, "messages": turn})
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        stop(process)  # SIGTERM: the queued blocks are written before it exits
    turn += [
        {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
        {"role": "user", "content": "again: ab 12"},
    ]
    prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True)
    want = [
        t
        for t, _ in generate_step(
            prompt, model, eos_token_ids=(tokenizer.eos_token_id,), max_tokens=8
        )
    ]
    process, url = start_server(tmp_path / "store", tmp_path / "second")
    try:
        answer = post(f"{url}/chat/completions", {**body, "messages": turn})
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        with urllib.request.urlopen(f"{url}/cache", timeout=10) as reply:
            tiers = json.loads(reply.read())
    finally:
        stop(process)
    assert cached > 0 and cached % 16 == 0
    eos = tokenizer.eos_token_id
    assert answer["choices"][0]["message"]["content"] == tokenizer.decode(
        [t for t in want if t != eos]
    )
    assert tiers["memory"]["hits"] == 0 and tiers["disk"]["restored_tokens"] == cached
    assert tiers["disk"]["blocks"] >= cached // 16


def test_a_draft_model_restores_its_own_cache(tmp_path):
    """--draft-model: the draft model's cache is stored under its own identity beside the
    target's, and both restore after a restart; the tokens are the target's alone."""
    from draft_model import DraftModel

    target, draft = tiny_llama(vocab_size=64, seed=1), tiny_llama(vocab_size=64, seed=2)
    prompt = text(5, 50)
    prompt = [token % 64 for token in prompt]
    want = [t for t, _ in generate_step(prompt, target, eos_token_ids=(), max_tokens=10)]
    for run in range(2):  # a new pair of stores each run: a restart
        stores = [PromptStore(tmp_path, model, block_tokens=8) for model in (target, draft)]
        drafter = DraftModel(draft, 64, num_draft=3, adaptive=False, prompt_store=stores[1])
        steps = generate_step(
            prompt,
            target,
            eos_token_ids=(),
            max_tokens=10,
            draft_sources=[drafter.source()],
            prompt_store=stores[0],
        )
        assert [t for t, _ in steps] == want
        assert [store.stats()["restored_tokens"] for store in stores] == [run * 48] * 2
        for store in stores:
            store.close()
