"""Repeated-task workloads for history lookup: one kind of request over 20 customer emails.

The emails come from one template with varied senders, items, quantities, dates and wording,
so an answer is never a copy of an earlier one: what repeats is the request and the shape
of the model's answers, as in an agent that runs one prompt over many inputs.

- replies: confirm the order in a short reply. SmolLM2-135M does this task, in formulaic
  replies; this is the workload the results report.
- extraction: four fields from each email. SmolLM2-135M mostly fails it (it echoes the email
  or repeats a name), so it shows what history adds to a copy-heavy workload.
"""

import random

REPLY_INSTRUCTION = (
    "Write a short reply to this customer email, confirming the order and the delivery date."
)
EXTRACTION_INSTRUCTION = (
    "Extract the customer's name, the product, the quantity and the delivery date from this "
    "email. Answer with four lines: Name, Product, Quantity, Date."
)

NAMES = [
    "Maria Lopez",
    "James Carter",
    "Aiko Tanaka",
    "Peter Novak",
    "Fatima Khan",
    "Lucas Moreau",
    "Grace Okafor",
    "Henrik Berg",
    "Sofia Rossi",
    "Daniel Kim",
    "Olivia Brown",
    "Ahmed Hassan",
    "Emma Schmidt",
    "Carlos Mendes",
    "Nora Lindqvist",
    "Ravi Patel",
    "Chloe Martin",
    "Tom Walsh",
    "Yuki Sato",
    "Isabel Cruz",
]
PRODUCTS = [
    "ergonomic office chairs",
    "stainless steel water bottles",
    "LED desk lamps",
    "wireless keyboards",
    "cotton bath towels",
    "ceramic coffee mugs",
    "yoga mats",
    "printer cartridges",
    "garden hoses",
    "backpacks",
    "extension cords",
    "whiteboard markers",
    "folding tables",
    "hand sanitizer bottles",
    "laptop stands",
    "winter jackets",
    "bicycle helmets",
    "kitchen knives",
    "notebooks",
    "phone chargers",
]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
OPENINGS = ["Hello,", "Hi there,", "Good morning,", "Dear sales team,", "Hi,"]
BODIES = [
    "I would like to order {quantity} {product} for our office. Could you deliver them on {date}?",
    "Our team needs {quantity} {product}. Please make sure they arrive by {date}, as we open that "
    "week.",
    "Following our call, please send {quantity} {product} to our warehouse. The delivery date we "
    "agreed is {date}.",
    "Can you ship {quantity} {product}? We need them on {date} at the latest. Thank you for your "
    "help.",
]
CLOSINGS = ["Best regards,", "Thanks,", "Kind regards,", "Many thanks,", "Cheers,"]


def emails(count: int = 20, seed: int = 0) -> list:
    """``count`` emails, each a different customer, product and date (fixed by ``seed``)."""
    rng = random.Random(seed)
    names, products = rng.sample(NAMES, count), rng.sample(PRODUCTS, count)
    letters = []
    for name, product in zip(names, products):
        date = f"{rng.choice(MONTHS)} {rng.randint(1, 28)}"
        body = rng.choice(BODIES).format(quantity=rng.randint(2, 60), product=product, date=date)
        letters.append(f"{rng.choice(OPENINGS)}\n\n{body}\n\n{rng.choice(CLOSINGS)}\n{name}")
    return letters


def requests(workload: str, count: int = 20) -> list:
    """The prompts of ``workload`` ("replies" or "extraction"), in the order they are sent."""
    instruction = {"replies": REPLY_INSTRUCTION, "extraction": EXTRACTION_INSTRUCTION}[workload]
    return [f"{instruction}\n\n{email}" for email in emails(count)]
