"""Instructions for self-distillation: written by the target itself, or from templates.

The draft head learns the target's own answers to these, so they only need to be varied, not
good. ``self_instructions`` (the default) asks the target to write what a user would say; the
topics x tasks x styles templates are kept for comparison. None comes from ``benchmarks/``
(checked in the tests).
"""

import random

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from tqdm import tqdm


def self_instructions(
    model,
    tokenizer,
    count: int,
    seed: int = 0,
    batch_size: int = 64,
    max_tokens: int = 64,
    temp: float = 1.0,
    min_p: float = 0.02,
) -> list:
    """``count`` distinct instructions sampled from the target (Magpie, arXiv 2406.08464).

    The target reads its chat template up to the start of a user turn and writes the turn; a
    chat model has seen many, so the turns cover what its users ask far more broadly than
    templates do. Turns that do not end within ``max_tokens`` are dropped.
    """
    marker = "\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    prefix = tokenizer.encode(text[: text.index(marker)], add_special_tokens=False)
    eos = set(tokenizer.eos_token_ids)
    eos_array = mx.array(sorted(eos))
    # min-p: as clean as top-p, without its sort of 49k scores
    sampler = make_sampler(temp=temp, min_p=min_p)
    mx.random.seed(seed)
    seen, out, empty_rounds = set(), [], 0
    bar = tqdm(total=count, desc="instructions", unit="instr")
    while len(out) < count:
        if empty_rounds == 3:
            raise ValueError(
                f"the model wrote no complete user turn in {3 * batch_size} tries; is it a chat "
                "model?"
            )
        cache = make_prompt_cache(model)
        logits = model(mx.array([prefix] * batch_size), cache=cache)[:, -1]
        rows, ended = [], mx.zeros(batch_size, dtype=mx.bool_)
        for _ in range(max_tokens):
            token = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            rows.append(token)
            ended = ended | (token[:, None] == eos_array).any(axis=-1)
            if ended.all().item():  # one small sync per step: stop once every turn has ended
                break
            logits = model(token[:, None], cache=cache)[:, -1]
        before = len(out)
        for row in mx.stack(rows, axis=1).tolist():
            end = next((i for i, t in enumerate(row) if t in eos), None)
            instruction = tokenizer.decode(row[:end]).strip() if end is not None else ""
            if len(instruction.split()) >= 3 and instruction not in seen and len(out) < count:
                seen.add(instruction)
                out.append(instruction)
                bar.update(1)
        empty_rounds = empty_rounds + 1 if len(out) == before else 0
    bar.close()
    return out


TOPICS = [
    "volcanoes",
    "the water cycle",
    "black holes",
    "honeybees",
    "the Roman Empire",
    "photosynthesis",
    "electric cars",
    "the stock market",
    "chess openings",
    "jazz music",
    "machine learning",
    "the human heart",
    "climate change",
    "the French Revolution",
    "coral reefs",
    "vaccines",
    "solar panels",
    "the printing press",
    "sleep",
    "coffee",
    "the moon landing",
    "earthquakes",
    "recycling plastic",
    "the Great Wall of China",
    "octopuses",
    "compound interest",
    "rainbows",
    "the internet",
    "ancient Egypt",
    "tea ceremonies",
    "bicycles",
    "the immune system",
    "rivers and deltas",
    "origami",
    "the Olympic Games",
    "glaciers",
    "bread baking",
    "DNA",
    "renewable energy",
    "penguins",
    "the Renaissance",
    "public libraries",
    "wind turbines",
    "meditation",
    "the periodic table",
    "hurricanes",
    "sourdough starters",
    "the speed of light",
    "video game design",
    "urban gardening",
    "migratory birds",
    "the Silk Road",
    "gravity",
    "spreadsheets",
    "dinosaurs",
    "time zones",
    "the violin",
    "rain forests",
    "password security",
    "the metric system",
    "deserts",
    "cheese making",
    "Mars rovers",
    "first aid",
    "the Moon's phases",
    "electric circuits",
    "composting",
    "sharks",
    "the history of money",
    "lighthouses",
    "public speaking",
    "knitting",
    "the Amazon river",
    "magnets",
    "email etiquette",
    "tides",
    "the Python programming language",
    "sorting algorithms",
    "databases",
    "probability",
]

TASKS = [
    "Explain {topic} to a ten-year-old.",
    "Write a short paragraph about {topic}.",
    "Give me three interesting facts about {topic}.",
    "What are the main advantages and disadvantages of {topic}?",
    "Write a short poem about {topic}.",
    "Summarize the history of {topic} in a few sentences.",
    "List five questions a student might ask about {topic}, with short answers.",
    "Write a short story in which {topic} plays an important role.",
    "How would you teach a beginner about {topic}?",
    "What is a common misconception about {topic}?",
    "Compare {topic} with {other}.",
    "Write a product description for a book about {topic}.",
    "Describe {topic} in exactly three sentences.",
    "Why should people care about {topic}?",
    "Write a step-by-step guide related to {topic}.",
    "Give a one-sentence definition of {topic}, then explain it.",
    "Write a dialogue between two friends discussing {topic}.",
    "What are the most important words to know when learning about {topic}?",
    "Write a news headline and a short article about {topic}.",
    "Suggest a fun weekend activity related to {topic}.",
    "What would the world be like without {topic}?",
    "Write an email to a colleague recommending they learn about {topic}.",
    "What is {topic}?",
    "Tell me something surprising about {topic}.",
]

STYLES = [
    "",
    "",
    "",
    " Keep it brief.",
    " Use simple words.",
    " Use bullet points.",
    " Be enthusiastic.",
    " Answer formally.",
    " Include an example.",
    " Use a numbered list.",
]


def all_instructions() -> list:
    """Every instruction the generator can produce (for membership checks)."""
    out = []
    for topic in TOPICS:
        for task in TASKS:
            others = [o for o in TOPICS if o != topic] if "{other}" in task else [None]
            for other in others:
                for style in set(STYLES):
                    out.append(task.format(topic=topic, other=other) + style)
    return out


def sample_instructions(count: int, seed: int = 0) -> list:
    """``count`` distinct instructions drawn with a fixed seed."""
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < count:
        topic = rng.choice(TOPICS)
        other = rng.choice([o for o in TOPICS if o != topic])
        text = rng.choice(TASKS).format(topic=topic, other=other) + rng.choice(STYLES)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
