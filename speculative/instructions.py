"""A varied instruction set for self-distillation, generated from topics x tasks x styles.

The draft head learns the target's own answers to these, so they only need to be
varied, not good. None of them comes from ``benchmarks/prompts/`` (the held-out
benchmark prompts are checked against ``all_instructions`` in the tests).
"""

import random

TOPICS = [
    "volcanoes", "the water cycle", "black holes", "honeybees", "the Roman Empire", "photosynthesis",
    "electric cars", "the stock market", "chess openings", "jazz music", "machine learning",
    "the human heart", "climate change", "the French Revolution", "coral reefs", "vaccines",
    "solar panels", "the printing press", "sleep", "coffee", "the moon landing", "earthquakes",
    "recycling plastic", "the Great Wall of China", "octopuses", "compound interest", "rainbows",
    "the internet", "ancient Egypt", "tea ceremonies", "bicycles", "the immune system",
    "rivers and deltas", "origami", "the Olympic Games", "glaciers", "bread baking", "DNA",
    "renewable energy", "penguins", "the Renaissance", "public libraries", "wind turbines",
    "meditation", "the periodic table", "hurricanes", "sourdough starters", "the speed of light",
    "video game design", "urban gardening", "migratory birds", "the Silk Road", "gravity",
    "spreadsheets", "dinosaurs", "time zones", "the violin", "rain forests", "password security",
    "the metric system", "deserts", "cheese making", "Mars rovers", "first aid", "the Moon's phases",
    "electric circuits", "composting", "sharks", "the history of money", "lighthouses",
    "public speaking", "knitting", "the Amazon river", "magnets", "email etiquette", "tides",
    "the Python programming language", "sorting algorithms", "databases", "probability",
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
    "", "", "", " Keep it brief.", " Use simple words.", " Use bullet points.", " Be enthusiastic.",
    " Answer formally.", " Include an example.", " Use a numbered list.",
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
