"""The chat questions of the greedy check (``kvcache eval --prompts FILE`` replaces them: one per line).

Short factual and open questions, each answered by the model's chat template in well under 64 tokens when
the cache is exact, so a stored format's drift shows as a different answer.
"""

from __future__ import annotations

__all__ = ["PROMPTS"]

PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "Who wrote Romeo and Juliet?",
    "What is photosynthesis?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Write a haiku about the sea.",
    "What does a bee make?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Why do we have seasons on Earth?",
    "What is the largest planet in the solar system?",
    "Give me a tip for sleeping better.",
    "What gas do humans breathe out?",
    "Name a mammal that can fly.",
    "What is the main ingredient of guacamole?",
    "How many days are in a leap year?",
    "Explain what a computer program is to a child.",
    "What is the difference between weather and climate?",
    "Suggest a name for a pet cat.",
    "Describe the taste of a lemon.",
    "What language is spoken in Brazil?",
    "Tell me a fun fact about octopuses.",
)
