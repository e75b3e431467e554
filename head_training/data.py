"""The draft head's training data: the target's own answers and its features, cached on disk.

``generate_dataset`` answers instructions in batches (``answer_with_features`` keeps the final
hidden states from the generating passes) and saves each batch under a name hashed from its
prompts, so a stopped run resumes and a changed instruction list never reads a stale batch.
``sub_vocabulary`` ranks the answers' tokens for FR-Spec.
"""

import hashlib
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from tqdm import tqdm

from decoder.hidden_states import logits_from_hidden
from decoder.text import encode


def answer_with_features(model, prompts: list, max_tokens: int, eos_ids) -> list:
    """Greedy answers to equal-length ``prompts`` (one batch, no padding), and the target's final
    hidden state at every position, collected by the generating forward passes themselves.

    Returns ``[(sequence, features)]`` with ``sequence = {"tokens", "prompt_length"}``.
    """
    cache = make_prompt_cache(model)
    hidden = model.model(mx.array(prompts), cache=cache)
    states, answers = [hidden.astype(mx.float16)], []
    eos_array, ended = mx.array(sorted(eos_ids)), mx.zeros(len(prompts), dtype=mx.bool_)
    for _ in range(max_tokens):
        token = mx.argmax(logits_from_hidden(model, hidden[:, -1]), axis=-1)
        answers.append(token)
        hidden = model.model(token[:, None], cache=cache)
        states.append(hidden.astype(mx.float16))
        ended = ended | (token[:, None] == eos_array).any(axis=-1)
        mx.eval(token, states[-1], ended)
        if ended.all().item():  # every answer has ended: more steps would be thrown away
            break
    answers = mx.stack(answers, axis=1).tolist()
    states = np.array(mx.concatenate(states, axis=1))
    out = []
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        # Keep the answer up to its stop token (the head learns to end), drop what followed.
        end = next((i + 1 for i, t in enumerate(answer) if t in eos_ids), len(answer))
        tokens = list(prompt) + answer[:end]
        out.append(({"tokens": tokens, "prompt_length": len(prompt)}, states[row, : len(tokens)]))
    return out


def generate_dataset(
    model, prompts: list, work: Path, max_tokens: int, batch_size: int, eos_ids, minutes: float
) -> tuple:
    """Answer ``prompts`` in batches of equal prompt length, each saved to ``work`` as it is done
    (a rerun resumes); starts no new batch after ``minutes``. Returns (sequences, final hidden
    states); ``([], None)`` when nothing is cached and no time is given."""
    by_length = {}
    for prompt in prompts:
        by_length.setdefault(len(prompt), []).append(prompt)
    batches = [
        group[i : i + batch_size]
        for group in by_length.values()
        for i in range(0, len(group), batch_size)
    ]
    # full batches first: most answers per second within ``minutes``
    batches.sort(key=len, reverse=True)
    # Named by its content: a changed prompt list never reads a stale batch.
    paths = [
        work
        / f"batch-{hashlib.sha256(json.dumps([batch, max_tokens]).encode()).hexdigest()[:16]}.npz"
        for batch in batches
    ]
    if minutes <= 0 and not any(path.exists() for path in paths):
        return [], None  # nothing cached, no time to generate
    tic = time.perf_counter()
    sequences, features = [], []
    for batch, path in tqdm(list(zip(batches, paths)), desc="generate", unit="batch"):
        if not path.exists():
            if time.perf_counter() - tic > 60 * minutes:
                continue  # out of time, but batches cached by an earlier run are still used
            answered = answer_with_features(model, batch, max_tokens, eos_ids)
            np.savez(
                path.with_suffix(".tmp.npz"),
                sequences=json.dumps([s for s, _ in answered]),
                features=np.concatenate([f for _, f in answered]),
            )
            path.with_suffix(".tmp.npz").replace(path)
        saved = np.load(path)
        answered = json.loads(str(saved["sequences"]))
        sequences += answered
        features.append(saved["features"])
    if not sequences:  # out of time before the first batch
        return [], None
    return sequences, np.concatenate(features)


def training_data(
    target,
    tokenizer,
    work: Path,
    sources,
    num_instructions: int,
    seed: int,
    max_tokens: int,
    batch_size: int,
    minutes: float,
) -> tuple:
    """Instructions of each source (``self``, ``templates``) and the target's answers, one source
    after the other, each cached in ``work/<source>-seed<seed>``; starts no new batch after
    ``minutes`` (instructions included). Returns (sequences, final hidden states,
    {source: instructions}); no sequences when nothing is cached and no time was left."""
    eos_ids = set(tokenizer.eos_token_ids)
    sequences, features, texts, tic = [], [], {}, time.perf_counter()
    for source in sources:
        source_dir = work / f"{source}-seed{seed}"
        source_dir.mkdir(parents=True, exist_ok=True)
        texts[source] = cached_instructions(
            source_dir / f"instructions-{num_instructions}.json",
            source,
            target,
            tokenizer,
            num_instructions,
            seed,
        )
        prompts = [encode(tokenizer, text) for text in texts[source]]
        minutes_left = minutes - (time.perf_counter() - tic) / 60
        answered, answered_features = generate_dataset(
            target, prompts, source_dir, max_tokens, batch_size, eos_ids, minutes_left
        )
        if answered:
            sequences += answered
            features.append(answered_features)
    return sequences, (np.concatenate(features) if features else None), texts


def cached_instructions(path: Path, source: str, target, tokenizer, count: int, seed: int) -> list:
    """The instructions of one source, written to ``path`` once (atomically) so a rerun answers the
    same ones and reuses the cached batches of answers."""
    from head_training.instructions import sample_instructions, self_instructions

    if path.exists():
        return json.loads(path.read_text())
    if source == "self":
        texts = self_instructions(target, tokenizer, count, seed)
    else:
        texts = sample_instructions(count, seed)
    path.with_suffix(".tmp").write_text(json.dumps(texts, indent=0))
    path.with_suffix(".tmp").replace(path)
    return texts


def sub_vocabulary(sequences: list, size: int, eos_ids, vocab_size: int) -> np.ndarray:
    """Most frequent answer tokens first; ties and unseen tokens by id (BPE ids roughly follow
    merge frequency). The stop tokens are always in."""
    counts = np.zeros(vocab_size, np.int64)
    for s in sequences:
        np.add.at(counts, s["tokens"][s["prompt_length"] :], 1)
    ranked = [i for i in np.lexsort((np.arange(vocab_size), -counts)) if i not in eos_ids]
    return np.array(sorted(eos_ids) + ranked[: size - len(eos_ids)], np.int32)
