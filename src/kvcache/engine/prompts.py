"""The demo's chat questions and the system prompt they share (``kvcache demo --prompts FILE`` replaces the
questions: one per line)."""

SYSTEM_PROMPT = ("You are a concise, helpful assistant. Answer every question in one or two short sentences, "
                 "with plain words and no lists.")

QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "What do bees make?",
    "How many legs does a spider have?",
    "What is the boiling point of water at sea level?",
    "Who wrote Romeo and Juliet?",
    "What is photosynthesis?",
    "Why do we have seasons on Earth?",
    "What is the largest planet in the solar system?",
    "What does a thermometer measure?",
    "Name a mammal that can fly.",
    "What is the main ingredient of guacamole?",
    "How many days are in a leap year?",
    "What gas do humans breathe out?",
    "What is the opposite of cold?",
    "Give me a tip for sleeping better.",
]
