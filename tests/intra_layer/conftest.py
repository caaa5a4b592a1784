import pytest

from atorch import parallel_state


@pytest.fixture(autouse=True)
def _restore_current_topology():
    """intra_layer.init makes its grid current in parallel_state: put back what was there."""
    before = parallel_state.current_topology()
    yield
    parallel_state.set_topology(before)
