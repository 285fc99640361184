"""A reproducible set of distinct, short chat prompts for the serving benchmark.

Each prompt asks one task about one subject, then adds whole context sentences until it reaches its
target length. Target lengths are drawn uniformly from 30-100 tokens (English text at ~1.3 tokens per word for
the BPE tokenizers of the supported families; the benchmark reports the real count from `usage`), the
length of a typical chat turn. Every prompt of a set is different, so concurrent requests route to
different experts, as real users' do.
"""

from __future__ import annotations

import itertools
import random

TOKENS_PER_WORD = 1.3
TOKEN_RANGE = (30, 100)

TASKS = [
    "Explain how {s} works to a curious high-school student.",
    "Write a short story in which {s} plays a central role.",
    "List the main trade-offs an engineer faces when designing {s}.",
    "Summarize the history of {s} in a few paragraphs.",
    "What are common misconceptions about {s}, and why do people hold them?",
    "Draft an email to a colleague proposing a project about {s}.",
    "Compare two different approaches to {s} and recommend one.",
    "Write a haiku sequence about {s}, then explain the imagery.",
]

SUBJECTS = [
    "a lighthouse lens", "sourdough fermentation", "the Roman aqueducts", "garbage collection in Java",
    "tidal power stations", "the honeybee waggle dance", "public-key cryptography", "a bicycle derailleur",
    "glacier formation", "the printing press", "noise-cancelling headphones", "coral reef ecosystems",
    "a mechanical wristwatch", "compound interest", "the Silk Road", "vaccine trials", "jazz improvisation",
    "solar sails", "the TCP handshake", "medieval cathedrals", "desert irrigation", "the immune system",
    "container shipping", "origami tessellations", "volcanic islands", "chess endgames", "paper making",
    "urban bike lanes", "the periodic table", "wind turbine blades", "ant colonies", "weather forecasting",
]

CONTEXT = [
    "Keep the answer concrete and avoid jargon where a plain word will do.",
    "I am preparing a talk for a local library and want it to be engaging.",
    "Please mention at least one surprising fact that most people do not know.",
    "Use a friendly tone, as if you were explaining it over coffee.",
    "Structure the answer with a short introduction and a clear conclusion.",
    "If there are numbers involved, give rough orders of magnitude.",
    "My background is in biology, so analogies from living systems would help.",
    "Point out where experts still disagree, if they do.",
    "Assume the reader has about five minutes to spend on it.",
    "Add one practical tip that someone could try at home this week.",
    "Avoid bullet points; write in flowing prose instead.",
    "I have read a little about this before but found it confusing.",
    "End with a question that invites further thought.",
    "Relate it to something people experience in everyday life.",
]


def chat_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct prompts (same ``seed``, same list; a longer list starts with a shorter one)."""
    pairs = list(itertools.product(TASKS, SUBJECTS))
    if count > len(pairs):
        raise ValueError(f"at most {len(pairs)} distinct prompts, asked for {count}")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    prompts = []
    for task, subject in pairs[:count]:
        target_words = round(rng.uniform(*TOKEN_RANGE) / TOKENS_PER_WORD)
        words = task.format(s=subject).split()
        for sentence in rng.sample(CONTEXT, len(CONTEXT)):
            if len(words) >= target_words:
                break
            words += sentence.split()
        prompts.append(" ".join(words))
    return prompts
