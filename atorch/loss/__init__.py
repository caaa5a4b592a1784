"""Loss normalization: every split of a global batch trains as the whole batch would.

See docs/loss_normalization.md. Users meet :class:`TokenSum` and :func:`with_count` (a custom
loss says what it counts) and :class:`StepLoss` (``result.last_step``: the global batch's loss).
"""

from atorch.loss.contract import TokenSum, with_count
from atorch.loss.step import StepLoss

__all__ = ["StepLoss", "TokenSum", "with_count"]
