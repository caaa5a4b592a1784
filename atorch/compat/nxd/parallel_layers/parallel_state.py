"""``neuronx_distributed.parallel_layers.parallel_state``: the same module as
:mod:`atorch.compat.nxd.parallel_state` (NxD exposes it under both paths)."""

import sys

from atorch.compat.nxd import parallel_state as _module

sys.modules[__name__] = _module  # one module object: `import ... as ps` and `from ... import f` agree
