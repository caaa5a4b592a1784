"""3D tensor parallelism of ``nn.Linear`` (the AxoNN algorithm) over a row x column x depth grid.

    atorch.init_distributed()
    atorch.intra_layer.init(G_data=1, G_intra_r=2, G_intra_c=1, G_intra_d=2)
    with atorch.intra_layer.auto_parallelize():
        model = MyModel()                        # its nn.Linear layers become intra_layer.Linear
    loader = atorch.data.create_dataloader(dataset, global_batch_size=64)
    ...
    loss.backward()
    atorch.intra_layer.sync_gradients(model)
    atorch.intra_layer.clip_grad_norm_(model.parameters(), 1.0)

See docs/intra_layer.md.
"""

from atorch.intra_layer.auto import auto_parallelize, parallelize_model
from atorch.intra_layer.grads import clip_grad_norm_, install_gradient_sync, sync_gradients
from atorch.intra_layer.grid import init
from atorch.intra_layer.linear import Linear
from atorch.intra_layer.overlap import optimize_communication
from atorch.intra_layer.slices import drop, gather

__all__ = [
    "Linear",
    "auto_parallelize",
    "clip_grad_norm_",
    "drop",
    "gather",
    "init",
    "install_gradient_sync",
    "optimize_communication",
    "parallelize_model",
    "sync_gradients",
]
