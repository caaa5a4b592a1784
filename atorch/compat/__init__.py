"""Other systems' names on atorch, for code that migrates with its imports changed.

    from axonn import axonn as ax      ->  from atorch.compat import axonn as ax

See docs/intra_layer.md (AxoNN) for what each name maps to and what differs.
"""
