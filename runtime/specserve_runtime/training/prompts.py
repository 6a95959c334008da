"""The project's prompt set: what users send (math word problems, coding tasks, explanations, chat).

Built deterministically from hand-written topics and templates, so the committed file can be
regenerated and checked. The evaluation split holds out whole topics (a template, a coding task,
a concept, a chat request), so evaluation prompts are not paraphrases of training prompts.
"""

import hashlib
import json
import random
from pathlib import Path

VERSION = "v1"
PROMPTS_FILE = Path(__file__).parent / "data" / f"prompts-{VERSION}.jsonl"
EVAL_SHARE = 8  # one topic in 8 of every category (the first by hash) goes to evaluation

NAMES = ["Ava", "Liam", "Noah", "Mia", "Omar", "Zoe", "Ivan", "Priya", "Kenji", "Lena", "Sofia", "Tom"]
ITEMS = ["apples", "books", "stickers", "marbles", "cookies", "pencils", "cards", "shells", "coins", "stamps"]

MATH_TEMPLATES = [
    "{n1} has {a} {item}. {n2} gives {n1} {b} more. How many {item} does {n1} have now?",
    "{n1} had {a} {item} and gave away {b}. How many {item} are left?",
    "A box holds {a} {item}. How many {item} are in {b} boxes?",
    "{n1} shares {c} {item} equally among {b} friends. How many does each friend get?",
    "A shirt costs ${a}. {n1} buys {b} shirts and pays with ${d}. How much change does {n1} get?",
    "A train travels {a} km in {b} hours. What is its average speed in km per hour?",
    "{n1} reads {a} pages a day. How many pages does {n1} read in {b} weeks?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "{n1} is {a} years old. {n2} is {b} years older than {n1}. How old will {n2} be in 5 years?",
    "A recipe needs {b} eggs for {a} cookies. How many eggs are needed for {c} cookies?",
    "{n1} earns ${a} per hour and works {b} hours a week. How much does {n1} earn in 4 weeks?",
    "A tank holds {c} liters and fills at {b} liters per minute. How long does it take to fill?",
    "What is {a} percent of {c}?",
    "The sum of two numbers is {c} and their difference is {b}. What are the numbers?",
    "{n1} bought {a} {item} on Monday and twice as many on Tuesday. How many in total?",
    "A class has {a} students. {b} of them are absent. What fraction of the class is present?",
    "Solve for x: {b}x + {a} = {c}.",
    "What is the least common multiple of {a} and {b}?",
    "A car uses {b} liters of fuel per 100 km. How much fuel does it need for {c} km?",
    "{n1} saves ${a} every month. How many months until {n1} has ${c}?",
    "A pizza is cut into {b} slices and {n1} eats {a2} of them. What percentage is left?",
    "If {a} workers build a wall in {b} days, how long would {a3} workers take?",
    "Is {p} a prime number? Explain how you know.",
    "What is the average of {a}, {b}, {c} and {d}?",
]

CODE_TASKS = [
    "reverses a string", "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
    "checks whether a number is prime", "sorts a list with bubble sort", "merges two sorted lists",
    "counts the vowels in a string", "finds the largest element in a list", "removes duplicates from a list",
    "computes the factorial of a number", "converts Celsius to Fahrenheit", "flattens a nested list",
    "counts word frequencies in a text", "checks whether two strings are anagrams", "implements binary search",
    "computes the greatest common divisor of two numbers", "transposes a matrix", "reads a CSV file and sums a column",
    "validates an email address with a regular expression", "returns the second largest number in a list",
    "rotates a list by k positions", "finds the longest word in a sentence", "capitalizes every word in a sentence",
    "converts a decimal number to binary", "checks whether parentheses in a string are balanced",
    "computes the sum of digits of a number", "returns all prime numbers below n", "implements a stack class",
    "implements a queue using two stacks", "chunks a list into groups of size n", "computes the median of a list",
    "finds common elements of two lists", "counts the lines in a file", "generates a random password",
    "implements quicksort", "finds the missing number in a list from 1 to n", "checks whether a year is a leap year",
    "converts a Roman numeral to an integer", "computes the power set of a list", "groups a list of words by length",
    "returns the running total of a list", "compresses a string like aaabb into a3b2",
    "implements a simple LRU cache", "computes the dot product of two vectors", "parses a date string into a date",
    "counts uppercase and lowercase letters", "returns the indices of two numbers that add up to a target",
    "implements insertion sort", "computes the Levenshtein distance of two strings", "merges two dictionaries",
]
CODE_PHRASES = [
    "Write a Python function that {task}.",
    "Implement a function in Python that {task}, with a short explanation.",
    "How would you write a JavaScript function that {task}?",
    "Write a Python function that {task} and add a docstring and an example.",
]

CONCEPTS = [
    "photosynthesis", "gravity", "inflation", "the water cycle", "machine learning", "compound interest",
    "the immune system", "black holes", "climate change", "supply and demand", "DNA", "electric circuits",
    "the internet", "blockchain", "evolution", "vaccines", "the greenhouse effect", "plate tectonics",
    "recursion in programming", "the stock market", "neural networks", "the French Revolution", "democracy",
    "the theory of relativity", "antibiotics", "renewable energy", "the human heart", "volcanoes",
    "the scientific method", "cloud computing", "encryption", "the Pythagorean theorem", "probability",
    "sleep cycles", "the Roman Empire", "magnetism", "the periodic table", "nuclear energy", "tides",
    "interest rates", "operating systems", "databases", "version control with git", "rainbows",
    "the placebo effect", "caffeine", "the solar system", "earthquakes", "bacteria and viruses",
    "taxes", "the printing press", "the Industrial Revolution", "memory in the brain", "sound waves",
    "the speed of light", "batteries", "airplane flight", "habits", "the food chain", "object-oriented programming",
]
EXPLAIN_PHRASES = [
    "Explain {concept} in simple terms.",
    "What is {concept}? Give a short explanation.",
    "How does {concept} work? Explain it to a high school student.",
    "Can you give me a brief overview of {concept}?",
    "Why is {concept} important?",
]

CHAT_REQUESTS = [
    "Give me three tips for sleeping better.", "What should I cook for dinner tonight?",
    "How can I stay focused while studying?", "Suggest a name for my new cat.",
    "Write a short birthday message for my friend.", "How do I start running as a beginner?",
    "What are some fun things to do on a rainy day?", "Help me write a polite email asking for a day off.",
    "What is a good way to learn a new language?", "Give me ideas for a weekend trip.",
    "How do I make a good cup of coffee?", "Write a haiku about autumn.",
    "What are some healthy breakfast ideas?", "How can I save money on groceries?",
    "Tell me a fun fact about octopuses.", "How do I deal with stress at work?",
    "Recommend some habits for a productive morning.", "Write a short story about a lost robot.",
    "How do I prepare for a job interview?", "What should I pack for a beach holiday?",
    "Give me tips for keeping houseplants alive.", "How can I be a better listener?",
    "Write a thank-you note to a teacher.", "What are good exercises to do at home?",
    "How do I organize my closet?", "Suggest a few board games for a family night.",
    "How can I make new friends in a new city?", "Write a limerick about a cat.",
    "What are some tips for public speaking?", "How do I plan a small garden?",
    "Give me a simple recipe for pancakes.", "How can I reduce screen time?",
    "What are good questions to ask on a first date?", "Write a motivational quote for Monday.",
    "How do I write a good resume?", "Suggest some podcasts topics for beginners.",
    "How do I keep my kitchen clean?", "What are some tips for traveling on a budget?",
    "Write a short poem about the sea.", "How can I improve my handwriting?",
]
CHAT_PHRASES = ["{request}", "Hi! {request}", "{request} Please keep it short.", "Quick question: {request}"]


def _assign_splits(records: list[dict]) -> None:
    """Hold out whole topics, the same share of every category."""
    by_category: dict[str, set[str]] = {}
    for record in records:
        by_category.setdefault(record["category"], set()).add(record["topic"])
    held_out = set()
    for topics in by_category.values():
        ranked = sorted(topics, key=lambda t: hashlib.sha256(t.encode()).hexdigest())
        held_out |= set(ranked[: -(-len(ranked) // EVAL_SHARE)])
    for record in records:
        record["split"] = "eval" if record["topic"] in held_out else "train"


def build_prompts(seed: int = 0, math_variants: int = 60) -> list[dict]:
    rng = random.Random(seed)
    records = []

    def add(category, topic, prompt):
        records.append({"prompt": prompt, "category": category, "topic": topic})

    for index, template in enumerate(MATH_TEMPLATES):
        for _ in range(math_variants):
            a, b = rng.randint(2, 60), rng.randint(2, 12)
            values = dict(
                n1=rng.choice(NAMES), n2=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b,
                c=b * rng.randint(3, 40), d=a * b + rng.randint(1, 50), a2=rng.randint(1, b),
                a3=rng.randint(2, 9), p=rng.choice([7, 9, 15, 21, 29, 33, 37, 49, 51, 53, 57, 61, 77, 89, 91, 97]),
            )
            add("math", f"math-{index}", template.format(**values))
    for task in CODE_TASKS:
        for phrase in CODE_PHRASES:
            add("code", f"code-{task}", phrase.format(task=task))
    for concept in CONCEPTS:
        for phrase in EXPLAIN_PHRASES:
            add("explain", f"explain-{concept}", phrase.format(concept=concept))
    for request in CHAT_REQUESTS:
        for phrase in CHAT_PHRASES:
            add("chat", f"chat-{request}", phrase.format(request=request))
    unique = {r["prompt"]: r for r in records}  # templates can collide on small numbers
    _assign_splits(list(unique.values()))
    return sorted(unique.values(), key=lambda r: (r["category"], r["topic"], r["prompt"]))


def write_prompts(path: Path = PROMPTS_FILE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in build_prompts()))
    return path


def read_prompts(path: Path = PROMPTS_FILE, split: str | None = None, category: str | None = None) -> list[dict]:
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in records if (split is None or r.get("split") == split) and (category is None or r.get("category") == category)]


if __name__ == "__main__":
    print(write_prompts())
