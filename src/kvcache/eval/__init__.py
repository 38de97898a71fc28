"""Quality of the stored KV formats, measured as a user meets it (``kvcache eval``).

For each ``kv_dtype``, against transformers' full-precision DynamicCache on the same inputs: perplexity with the
cache in the loop (attention reading the stored K / V, chunk by chunk), KL divergence and top-1 agreement of the
next-token predictions, greedy agreement over chat prompts, and bytes per token.

Example::

    from kvcache.engine.loader import load_model
    from kvcache.eval import evaluate, format_table
    model, tok = load_model()                       # SmolLM2-135M-Instruct, float32 on the CPU
    report = evaluate(model, tok, kv_dtypes=("int8", "int4"), max_tokens=2048)
    print(format_table(report))
"""

from .api import DEFAULT_KV_DTYPES, evaluate
from .plot import plot_report
from .prompts import PROMPTS
from .report import EvalReport, FormatResult, format_table
from .texts import DEFAULT_TEXT, TEXTS, load_text

__all__ = ["evaluate", "EvalReport", "FormatResult", "format_table", "plot_report", "load_text", "TEXTS",
           "DEFAULT_TEXT", "DEFAULT_KV_DTYPES", "PROMPTS"]
