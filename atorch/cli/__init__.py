"""The ``atorch`` command."""
