"""hybrid-attention's transformers model as remote code: an exported folder's modeling_hybrid_attention.py, never
imported inside the package (docs/transformers.md, "Export and remote code").
"""

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path

from .hybrid_attention_files import MODULES

_HERE = Path(__file__).resolve().parent


class _FolderFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of hybrid_attention in this folder's flat files (after every other finder)."""

    def find_spec(self, name, path=None, target=None):
        if name not in MODULES:
            return None
        file, is_package = MODULES[name]
        search = [] if is_package else None  # a package's submodules come from this finder too
        return importlib.util.spec_from_file_location(name, _HERE / file, submodule_search_locations=search)


if importlib.util.find_spec("hybrid_attention") is None:
    sys.meta_path.append(_FolderFinder())

_configuration = importlib.import_module("hybrid_attention.hf.configuration")
_modeling = importlib.import_module("hybrid_attention.hf.modeling")


# Subclasses defined here, so that transformers' remote-code bookkeeping (register_for_auto_class, and the copy of
# this file when a loaded model is saved again) lands on this file, not on the package's classes.
class HybridAttentionConfig(_configuration.HybridAttentionConfig):
    pass


class HybridAttentionForCausalLM(_modeling.HybridAttentionForCausalLM):
    config_class = HybridAttentionConfig
