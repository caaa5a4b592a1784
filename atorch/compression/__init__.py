"""Genomic bottleneck compression: small g-nets generate a model's large weight matrices.

See docs/compression.md. The public names::

    from atorch.compression import GenomicBottleneck, register_gnet_type
"""

from atorch.compression.bottleneck import GenomicBottleneck, GNetRecord
from atorch.compression.gnet import GNet
from atorch.compression.layers import GNetType, register_gnet_type, unregister_gnet_type

__all__ = ["GNet", "GNetRecord", "GNetType", "GenomicBottleneck", "register_gnet_type", "unregister_gnet_type"]
