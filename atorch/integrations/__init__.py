"""atorch inside the trainers people already use (docs/integrations.md).

- ``atorch.integrations.transformers.AtorchTrainer``: a ``transformers.Trainer`` that applies an
  atorch strategy (``pip install 'atorch[transformers]'``);
- ``atorch.integrations.lightning.AtorchStrategy``: a Lightning strategy that does the same
  (``pip install 'atorch[lightning]'``);
- ``atorch.integrations.fabric.AtorchFabricStrategy``: the same for a Lightning Fabric loop.

Nothing is imported here: each integration imports its trainer only when it is used, so atorch
imports without transformers or lightning.
"""
