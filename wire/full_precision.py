"""Mixed precision: which modules of a quantized model stay in full precision (a pool's
``keep_full_precision``), as names the config checks without loading a model.

An entry is a group, a projection, or a module path::

    "attention"  every layer's qkv_proj and o_proj       "mlp"      every gate_up_proj and down_proj
    "lm_head"    the logits                              "qkv_proj", "o_proj", "gate_up_proj",
    "layers.0"   one whole layer (its four projections)  "down_proj"  that projection in every layer
    "layers.0.down_proj"  one projection of one layer

"Full precision" is the model's float dtype: a float checkpoint's kept modules are not quantized; a
quantized checkpoint's (GGUF, GPTQ, AWQ) are dequantized at load, exactly, into float linears.
"""

from __future__ import annotations

import re

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
GROUPS = {"attention": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")}
_PATH = re.compile(rf"layers\.\d+(\.({'|'.join(PROJECTIONS)}))?")


def check_entries(entries: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The entries, each known (else ``ValueError`` naming it and what is allowed)."""
    for entry in entries:
        if (
            entry not in GROUPS
            and entry not in PROJECTIONS
            and entry != "lm_head"
            and not _PATH.fullmatch(entry)
        ):
            raise ValueError(
                f"unknown module {entry!r}: expected 'attention', 'mlp', 'lm_head', a projection "
                f"({', '.join(PROJECTIONS)}), 'layers.N' or 'layers.N.<projection>'"
            )
    return tuple(entries)


def keeps(entries: tuple[str, ...], module: str) -> bool:
    """Whether the module named ``module`` (``"lm_head"``, ``"layers.3.o_proj"``) stays full precision."""
    leaf = module.rsplit(".", 1)[-1]
    for entry in entries:
        if entry == "lm_head" or _PATH.fullmatch(entry):
            if module == entry or module.startswith(entry + "."):
                return True
        elif leaf in GROUPS.get(entry, (entry,)) and module.startswith("layers."):
            return True
    return False
