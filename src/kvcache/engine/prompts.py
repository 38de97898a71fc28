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

CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_conversation(messages: object, name: str = "prompt") -> None:
    """Raise ValueError / TypeError naming the message when ``messages`` is not a chat conversation.

    A conversation is a non-empty list of ``{"role": ..., "content": str}`` dicts, ``role`` one of
    :data:`CHAT_ROLES`; the engine formats it with the tokenizer's chat template. Checked before the template runs,
    so a malformed message is refused by name instead of failing inside the template (or being accepted silently).

    Parameters
    ----------
    messages : list of dict
        The conversation.
    name : str
        How the error names it (``"prompts[3]"``).

    Raises
    ------
    TypeError
        ``messages`` is not a list / tuple of dicts, or a ``content`` is not a str.
    ValueError
        An empty conversation, a message without ``role`` or ``content``, or an unknown ``role``.

    Example
    -------
    >>> check_conversation([{"role": "user", "content": "Hi!"}])
    >>> check_conversation([{"role": "robot", "content": "Hi!"}], "prompts[0]")
    Traceback (most recent call last):
    ...
    ValueError: prompts[0][0]['role']: expected one of ('system', 'user', 'assistant', 'tool'), got 'robot'
    """
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"{name}: expected a conversation (list of {{'role', 'content'}} dicts), got "
                        f"{type(messages).__name__}")
    if not messages:
        raise ValueError(f"{name}: expected a conversation with at least one message, got an empty list")
    for j, m in enumerate(messages):
        where = f"{name}[{j}]"
        if not isinstance(m, dict):
            raise TypeError(f"{where}: expected a {{'role', 'content'}} dict, got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"{where}: expected a {key!r} key, got the keys {sorted(m)}")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"{where}['role']: expected one of {CHAT_ROLES}, got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise TypeError(f"{where}['content']: expected a str, got {type(m['content']).__name__}")
