"""A rank that stops answering (SIGSTOP, a frozen file system, a deadlocked data loader) makes the
other ranks raise at the search's next agreement, naming what they waited for, instead of waiting
torch's 30 minutes (issue 38: a stopped rank left its peer silent for over 290 s)."""

import time

from tests.helpers.dist import run_distributed


def _one_rank_stops() -> dict:
    import torch.distributed as dist

    from atorch.auto.search import agree

    agree.set_timeout(2.0)
    agree.all_ok(True)  # the group is built in step, with its timeout
    if dist.get_rank() == 1:
        time.sleep(6.0)  # stopped: never comes to the next agreement
        return {"rank": 1}
    start = time.monotonic()
    try:
        agree.all_ok(True)
    except agree.AgreementTimeout as error:
        return {"rank": 0, "seconds": time.monotonic() - start, "message": str(error)}
    return {"rank": 0, "seconds": time.monotonic() - start, "message": "no error"}


def test_a_stopped_rank_makes_the_others_raise_within_the_timeout():
    waiting = run_distributed(_one_rank_stops, 2, timeout_s=60)[0]
    assert waiting["seconds"] < 5.0, waiting
    assert "not every rank reached the search's agreement (whether every rank succeeded) within 2s" in \
        waiting["message"], waiting
    assert "restart the job" in waiting["message"]
