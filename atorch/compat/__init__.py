"""Other systems' names on atorch, for code that migrates with its imports changed.

    from axonn import axonn as ax                   ->  from atorch.compat import axonn as ax
    from neuronx_distributed.parallel_layers import ...  ->  from atorch.compat.nxd.parallel_layers import ...
    import atorch  (the original antgroup ATorch)   ->  from atorch.compat import antgroup as atorch

docs/migrating.md lists, per system, each name, what it maps to, what differs and what is refused.
"""
