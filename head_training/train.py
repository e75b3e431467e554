"""Train a draft head for a target by self-distillation, on a CPU
(benchmarks/results/draft_head.md).

    python -m head_training.train --out draft_head/heads/smollm2-135m

Stages (instructions and batches of answers are cached in --work-dir, so a rerun resumes;
stages 1-2 are in data.py):
1. instructions: written by the target itself from its chat template, and from templates
   (instructions.py);
2. generate: the target answers them greedily, in batches of equal-length prompts; the same
   forward passes collect its final hidden states (a second pass would double the cost);
3. train: feature regression (smooth L1) + cross-entropy on the target's next token within a
   frequency-ranked sub-vocabulary; input features get noise. The first half trains draft
   depth 1 alone (cheap, and it decides most acceptance); then unrolled steps feed the head
   its own predictions while attending as drafting does (``unrolled_predictions``).

The flags and their checks are flags.py's.

Heads that fused several target layers (EAGLE-3's low/middle/top) or stacked two decoder layers
trained worse here (docs/speculative.md) and were dropped; published EAGLE-3 heads still load
(draft_head/loading.py).
"""

import json
import math
import sys
import time
from pathlib import Path

# this is an entry point: a fast BLAS must load before mlx.core (fast_blas.py)
from loading import fast_blas

fast_blas.load()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm import tqdm

from cli import CliError, Parser
from decoder.hidden_states import HeadMismatch, output_rows, output_weight
from draft_head.head import SHIPPED_HEAD, DraftHead, head_args, save_head
from draft_head.loading import load_head
from head_training.data import sub_vocabulary, training_data
from head_training.flags import (
    add_data_arguments,
    add_training_arguments,
    check_arguments,
    model_name,
)


def make_batches(sequences: list, batch_tokens: int, rng) -> list:
    """Lists of sequence indices of similar length, about ``batch_tokens`` tokens each, shuffled."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]["tokens"]))
    batches, current, longest = [], [], 0
    for i in order:
        longest = max(longest, len(sequences[i]["tokens"]))
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], len(sequences[i]["tokens"])
        current.append(i)
    batches.append(current)
    rng.shuffle(batches)
    return batches


def batch_arrays(sequences, features, offsets, batch, sub_index):
    """Padded (B, L) tokens, (B, L, d) final hidden states, and loss masks for one batch."""
    length = max(len(sequences[i]["tokens"]) for i in batch)
    length = 32 * math.ceil(length / 32)  # few distinct shapes
    tokens = np.zeros((len(batch), length), np.int32)
    feats = np.zeros((len(batch), length, features.shape[1]), np.float16)
    answer = np.zeros((len(batch), length), bool)
    valid = np.zeros((len(batch), length), bool)
    for row, i in enumerate(batch):
        seq = sequences[i]["tokens"]
        tokens[row, : len(seq)] = seq
        feats[row, : len(seq)] = features[offsets[i] : offsets[i + 1]]
        valid[row, : len(seq)] = True
        answer[row, sequences[i]["prompt_length"] : len(seq)] = True
    labels = sub_index[tokens]
    return (
        mx.array(tokens),
        mx.array(feats).astype(mx.float32),
        mx.array(valid),
        mx.array(answer),
        mx.array(labels),
    )


class UnrolledCache:
    """Keys and values of the unrolled training steps (EAGLE-3's training-time test).

    When the head drafts its s-th token after position t, its cache holds keys computed from
    the target's true features at positions <= t and one key per earlier draft step. Step s
    of training reproduces that for every t at once: its query at index t (position
    t + s - 1) sees step 1's keys at indices <= t and each later step's key at index t only
    (``unrolled_mask``). ``offset`` is the RoPE position of index 0: set it to s - 1.
    """

    def __init__(self):
        self.keys, self.values, self.offset = [], [], 0

    def update_and_fetch(self, keys, values):
        self.keys.append(keys)
        self.values.append(values)
        length = keys.shape[2]  # each step is one shorter: keep the indices every step has
        return (
            mx.concatenate([k[:, :, :length] for k in self.keys], axis=2),
            mx.concatenate([v[:, :, :length] for v in self.values], axis=2),
        )


def unrolled_mask(length: int, step: int) -> mx.array:
    """(length, step * length) boolean mask: causal over step 1's keys, diagonal over the rest."""
    index = mx.arange(length)
    causal, diagonal = index[:, None] >= index[None, :], index[:, None] == index[None, :]
    return mx.concatenate([causal] + [diagonal] * (step - 1), axis=1)


def unrolled_predictions(head, features, embeddings, steps: int) -> list:
    """The head's predicted features for draft steps 1..``steps`` at every position at once.

    ``features`` (B, L, d) are the target's features at t and ``embeddings`` (B, L, d) those
    of x_t. Step s returns (B, L - s, d): row t is h_{t+s} as the head predicts it when drafting
    its s-th token after position t (the target's features up to t, its own predictions after).
    """
    caches, inputs, out = [UnrolledCache()], features[:, :-1], []
    for step in range(1, steps + 1):
        for cache in caches:
            cache.offset = step - 1
        predicted = head(
            inputs, embeddings[:, step:], cache=caches, mask=unrolled_mask(inputs.shape[1], step)
        )
        out.append(predicted)
        inputs = predicted[:, :-1]
    return out


def head_losses(head, embed, out_rows, tokens, feats, valid, answer, labels, unroll, noise):
    """Regression and token losses (and token accuracy) averaged over ``unroll`` steps.

    Step s predicts h_{t+s} and, through its scores, x_{t+s+1} (the target's greedy choice
    inside answers); input features get noise, as drafting's own predictions are never exact.
    """
    inputs = feats + noise * mx.random.normal(feats.shape) if noise > 0 else feats
    total_reg = total_ce = total_acc = 0.0
    for shift, pred in enumerate(
        unrolled_predictions(head, inputs, embed(tokens), unroll), start=1
    ):
        reg_mask = valid[:, shift:]
        reg = nn.losses.smooth_l1_loss(pred, feats[:, shift:], reduction="none").mean(-1)
        total_reg += (reg * reg_mask).sum() / mx.maximum(reg_mask.sum(), 1)
        # pred at row t scores the token at t + shift + 1 (labels are -1 outside the
        # sub-vocabulary).
        logits = pred[:, :-1] @ out_rows.T
        label = labels[:, shift + 1 :]
        ce_mask = answer[:, shift + 1 :] & (label >= 0)
        ce = nn.losses.cross_entropy(logits, mx.maximum(label, 0), reduction="none")
        count = mx.maximum(ce_mask.sum(), 1)
        total_ce += (ce * ce_mask).sum() / count
        total_acc += ((logits.argmax(-1) == label) & ce_mask).sum() / count
    return total_reg / unroll, total_ce / unroll, total_acc / unroll


def train(
    target,
    sequences,
    features,
    offsets,
    vocab_ids,
    *,
    steps_limit=None,
    minutes=20.0,
    epochs=4,
    batch_tokens=2048,
    lr=1e-3,
    unroll=3,
    depth1_fraction=0.0,
    noise=0.05,
    token_weight=0.5,
    seed=0,
    validation=0.05,
    init=None,
    log=print,
):
    """Train a head (fresh, or ``init`` further); returns ``(head, report)``. Stops after
    ``epochs``, ``steps_limit`` or ``minutes``; ``features`` are the target's final hidden states,
    row by row of ``sequences`` (``offsets``). The first ``depth1_fraction`` of training (by steps
    or time, whichever is further along) trains draft depth 1 only, then ``unroll`` steps."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    # A fresh head gets the target's rows for its sub-vocabulary, so the trained head drafts as it
    # is.
    head = (
        init
        if init is not None
        else DraftHead(head_args(target.args), output_rows(target, mx.array(vocab_ids)))
    )
    embed = target.model.embed_tokens
    out_rows = mx.take(output_weight(target), mx.array(vocab_ids), axis=0).astype(mx.float32)
    sub_index = np.full(target.args.vocab_size, -1, np.int32)
    sub_index[vocab_ids] = np.arange(len(vocab_ids))
    held_out, train_ids = split_held_out(len(sequences), validation, rng)
    batches = make_batches([sequences[i] for i in train_ids], batch_tokens, rng)
    total_steps = min(steps_limit or 10**9, epochs * len(batches))
    optimizer = optim.AdamW(learning_rate=lr, weight_decay=0.0)

    def loss_fn(head, depth, *arrays):
        reg, ce, acc = head_losses(head, embed, out_rows, *arrays, unroll=depth, noise=noise)
        return reg + token_weight * ce, (reg, ce, acc)

    value_and_grad = nn.value_and_grad(head, loss_fn)
    tic = time.perf_counter()
    bar = tqdm(total=total_steps, desc="train", unit="step")
    step = 0
    while step < total_steps and time.perf_counter() - tic < 60 * minutes:
        batch = batches[step % len(batches)]
        arrays = batch_arrays(
            sequences, features, offsets, [train_ids[i] for i in batch], sub_index
        )
        progress = max(step / total_steps, (time.perf_counter() - tic) / (60 * minutes))
        optimizer.learning_rate = learning_rate(lr, step, progress)
        # Depth 1 first: it learns faster per second unrolled alone, and decides most acceptance.
        depth = 1 if progress < depth1_fraction else unroll
        (loss, (reg, ce, acc)), grads = value_and_grad(head, depth, *arrays)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state, loss)
        if step == 0:
            first_loss = loss.item()
        bar.set_postfix(
            depth=depth,
            loss=f"{loss.item():.3f}",
            reg=f"{reg.item():.3f}",
            ce=f"{ce.item():.2f}",
            acc=f"{acc.item():.2f}",
        )
        bar.update(1)
        step += 1
    bar.close()
    report = {
        "steps": step,
        "first_loss": first_loss,
        "last_loss": loss.item(),
        "minutes": round((time.perf_counter() - tic) / 60, 2),
        "held_out": evaluate(
            head, embed, out_rows, sequences, features, offsets, sorted(held_out), sub_index
        ),
    }
    log(f"trained {step} steps: {json.dumps(report)}")
    return head, report


def split_held_out(count: int, validation: float, rng) -> tuple:
    """(held-out indices, training indices) of ``count`` sequences; ``validation`` of them, at least
    one, held out."""
    held_out = set(rng.choice(count, max(1, int(validation * count)), replace=False).tolist())
    return held_out, [i for i in range(count) if i not in held_out]


def learning_rate(lr: float, step: int, progress: float) -> float:
    """Warm up for 20 steps, then cosine decay to lr / 20 by whichever limit comes first."""
    return min((step + 1) / 20, 1.0) * (
        lr / 20 + (lr - lr / 20) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    )


def evaluate(head, embed, out_rows, sequences, features, offsets, indices, sub_index) -> dict:
    """Held-out token accuracy at draft depth 1 and 2 (an acceptance estimate), no noise."""
    accuracy = {}
    for unroll in (1, 2):
        hits = count = 0.0
        for start in range(0, len(indices), 8):
            arrays = batch_arrays(
                sequences, features, offsets, indices[start : start + 8], sub_index
            )
            _, _, acc = head_losses(head, embed, out_rows, *arrays, unroll=unroll, noise=0.0)
            hits += acc.item()
            count += 1
        accuracy[f"depth<={unroll} mean accuracy"] = round(hits / max(count, 1), 4)
    return accuracy


def main():
    parser = Parser(description="Train a draft head for a target model by self-distillation.")
    add_data_arguments(parser)
    add_training_arguments(parser)
    args = parser.parse_args()
    if args.out is None:  # never the shipped head's directory for another model
        args.out = str(SHIPPED_HEAD.parent / model_name(args.model))
    try:
        check_arguments(args)
        run(args)
    except (CliError, HeadMismatch) as error:
        sys.exit(f"error: {error}")


def run(args):
    from loading.load import load_model
    from loading.store import cache_dir

    target, tokenizer, _ = load_model(args.model)
    init = None
    if args.init:  # before generating, so a wrong head directory costs seconds, not an hour
        init, init_ids = load_head(args.init, target)
        if not isinstance(init, DraftHead):
            raise CliError(
                f"--init {args.init}: a published EAGLE head cannot be trained further here"
            )
    # Another model's answers and self-written instructions are its own: a directory per model.
    work = (
        Path(args.work_dir)
        if args.work_dir
        else cache_dir()
        / "draft-head-data"
        / ("" if args.model is None else model_name(args.model))
    )
    eos_ids = set(tokenizer.eos_token_ids)
    sequences, features, texts = training_data(
        target,
        tokenizer,
        work,
        args.instructions,
        args.num_instructions,
        args.seed,
        args.max_tokens,
        args.batch_size,
        args.generate_minutes,
    )
    if not sequences:
        raise CliError(
            f"no answers to train on: none is cached in {work} and no time was left to generate "
            "(raise --generate-minutes)"
        )
    self_written = texts.get("self")
    offsets = np.cumsum([0] + [len(s["tokens"]) for s in sequences])
    print(f"{len(sequences)} answers, {features.shape[0]} positions")
    vocab_ids = sub_vocabulary(sequences, args.sub_vocab, eos_ids, target.args.vocab_size)
    if init is not None:
        vocab_ids = np.array(init_ids)  # the head's scores are tied to its sub-vocabulary
    head, report = train(
        target,
        sequences,
        features,
        offsets,
        vocab_ids,
        minutes=args.minutes,
        epochs=args.epochs,
        lr=args.lr,
        unroll=args.unroll,
        depth1_fraction=args.depth1_fraction,
        noise=args.noise,
        token_weight=args.token_weight,
        seed=args.seed,
        init=init,
    )
    report.update(
        vars(args), answer_tokens=int(sum(len(s["tokens"]) - s["prompt_length"] for s in sequences))
    )
    save_head(args.out, head, mx.array(vocab_ids), target, training=report)
    # what the target wrote itself, kept with the head (the templates are in the code)
    if self_written:
        path = Path(args.out) / "instructions.json"
        path.with_suffix(".tmp").write_text(json.dumps(self_written, indent=0))
        path.with_suffix(".tmp").replace(path)
    print(f"saved the head to {args.out}")


if __name__ == "__main__":
    main()
