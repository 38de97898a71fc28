"""Start-up: ``kvcache --help`` and ``import kvcache.hf`` load only what they need (each checked in a fresh
interpreter through its ``sys.modules``), and every public name stays importable."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvcache

HEAVY = ("torch", "triton", "transformers")


def _fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter; it prints one JSON line last, returned."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_help_loads_neither_torch_nor_triton():
    # python -m kvcache <args> for each, in one interpreter (runpy is what -m runs); argparse exits after --help
    code = f"""
import contextlib, io, json, runpy, sys
codes, texts = [], []
for argv in (["--help"], ["--version"], ["plan", "--help"], ["bench", "--help"], ["info", "--help"],
             ["plot", "--help"]):
    sys.argv = ["kvcache", *argv]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module("kvcache", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        codes.append(e.code)
    texts.append(out.getvalue())
print(json.dumps({{"codes": codes, "texts": texts, "loaded": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    got = _fresh(code)
    assert got["codes"] == [0] * 6
    assert got["texts"][0].startswith("usage: kvcache") and "plan" in got["texts"][0]
    assert got["texts"][1].strip() == f"kvcache {kvcache.__version__}"
    assert "--memory" in got["texts"][2] and "attention" in got["texts"][3]
    assert got["loaded"] == []


def test_import_kvcache_is_lazy_and_names_resolve():
    got = _fresh(f"""
import json, sys
import kvcache
before = [m for m in {HEAVY!r} if m in sys.modules]
from kvcache import PagedKVCache, StepPlan, ops
print(json.dumps({{"before": before, "after": [m for m in {HEAVY!r} if m in sys.modules],
                  "paged": PagedKVCache.__module__, "plan": StepPlan.__name__, "ops": ops.__name__}}))
""")
    assert got["before"] == [] and got["after"] == ["torch", "triton"]
    assert got["paged"] == "kvcache.paged.cache" and got["plan"] == "StepPlan" and got["ops"] == "kvcache.ops"
    # in this process: every name of __all__, and an unknown one fails by name
    for name in kvcache.__all__:
        assert getattr(kvcache, name) is not None
    assert set(kvcache.__all__) <= set(dir(kvcache))
    with pytest.raises(AttributeError, match="'kvcache' has no attribute 'PagedCache'"):
        kvcache.PagedCache  # noqa: B018


def test_import_kvcache_hf_defers_torch_transformers_and_registers_on_model_import():
    pytest.importorskip("transformers")
    got = _fresh(f"""
import json, sys
import kvcache.hf
at_import = [m for m in {HEAVY!r} + ("transformers.modeling_utils",) if m in sys.modules]
from kvcache.hf import PagedCache, LinearCache, ATTN_IMPLEMENTATION
cache_only = "transformers.modeling_utils" in sys.modules
from transformers import AttentionInterface   # what every model class imports
from transformers.masking_utils import AttentionMaskInterface
print(json.dumps({{"at_import": at_import, "cache_only": cache_only, "name": ATTN_IMPLEMENTATION,
                  "attn": ATTN_IMPLEMENTATION in AttentionInterface._global_mapping,
                  "mask": ATTN_IMPLEMENTATION in AttentionMaskInterface._global_mapping,
                  "hook_left": any(type(f).__module__ == "kvcache.hf" for f in sys.meta_path),
                  "classes": [PagedCache.__name__, LinearCache.__name__]}}))
""")
    assert got["at_import"] == []
    assert got["cache_only"] is False  # the cache classes need transformers.cache_utils, not the model registry
    assert got["name"] == "kvcache_paged" and got["attn"] and got["mask"]
    assert got["hook_left"] is False and got["classes"] == ["PagedCache", "LinearCache"]


def test_import_kvcache_hf_after_transformers_models_registers_at_once():
    pytest.importorskip("transformers")
    got = _fresh("""
import json, sys
from transformers import AttentionInterface
import kvcache.hf
print(json.dumps({"attn": "kvcache_paged" in AttentionInterface._global_mapping,
                  "hook": any(type(f).__module__ == "kvcache.hf" for f in sys.meta_path)}))
""")
    assert got == {"attn": True, "hook": False}
