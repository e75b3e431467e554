"""A repeated-task workload for history lookup: the same extraction request over 20 emails.

The emails come from one template with varied senders, items, quantities, dates and wording,
so an answer is never a copy of its email: what repeats is the shape of the request and
of the model's answers, as in an agent that runs one tool prompt over many inputs.
"""

import random

INSTRUCTION = ("Extract the customer's name, the product, the quantity and the delivery date from this "
               "email. Answer with four lines: Name, Product, Quantity, Date.")

NAMES = ["Maria Lopez", "James Carter", "Aiko Tanaka", "Peter Novak", "Fatima Khan", "Lucas Moreau",
         "Grace Okafor", "Henrik Berg", "Sofia Rossi", "Daniel Kim", "Olivia Brown", "Ahmed Hassan",
         "Emma Schmidt", "Carlos Mendes", "Nora Lindqvist", "Ravi Patel", "Chloe Martin", "Tom Walsh",
         "Yuki Sato", "Isabel Cruz"]
PRODUCTS = ["ergonomic office chairs", "stainless steel water bottles", "LED desk lamps", "wireless keyboards",
            "cotton bath towels", "ceramic coffee mugs", "yoga mats", "printer cartridges", "garden hoses",
            "backpacks", "extension cords", "whiteboard markers", "folding tables", "hand sanitizer bottles",
            "laptop stands", "winter jackets", "bicycle helmets", "kitchen knives", "notebooks", "phone chargers"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
OPENINGS = ["Hello,", "Hi there,", "Good morning,", "Dear sales team,", "Hi,"]
BODIES = [
    "I would like to order {quantity} {product} for our office. Could you deliver them on {date}?",
    "Our team needs {quantity} {product}. Please make sure they arrive by {date}, as we open that week.",
    "Following our call, please send {quantity} {product} to our warehouse. The delivery date we agreed is {date}.",
    "Can you ship {quantity} {product}? We need them on {date} at the latest. Thank you for your help.",
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


def extraction_requests(count: int = 20) -> list:
    """The workload's prompts, in the order they are sent."""
    return [f"{INSTRUCTION}\n\n{email}" for email in emails(count)]
