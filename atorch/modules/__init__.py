"""Drop-in modules that module_replace swaps in, and the registry of replacement pairs."""

from atorch.modules.norms import FusedRMSNorm
from atorch.modules.replace import ReplacePair, register_replace_pair, replace_pairs

__all__ = ["FusedRMSNorm", "ReplacePair", "register_replace_pair", "replace_pairs"]
