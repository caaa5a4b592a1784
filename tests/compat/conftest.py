import pytest

from atorch import parallel_state
from atorch.compat import axonn as ax


@pytest.fixture(autouse=True)
def _restore_state():
    """ax.init makes its grid current and sets ax's module attributes: put back what was there."""
    before = parallel_state.current_topology()
    saved = {name: getattr(ax, name) for name in ("is_initialized", "comm_handle", "computation_dtype", "_flow")}
    yield
    parallel_state.set_topology(before)
    for name, value in saved.items():
        setattr(ax, name, value)
