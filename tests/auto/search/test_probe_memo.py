"""The search runs one probe forward per distinct probe (cost._probe's memo): candidates that
differ only in what a probe does not apply (sharding, layouts) share it, and a checkpointed
candidate's forward without checkpointing is its plain twin's. The memo must change no estimate."""

import torch

from atorch.auto.environment import DeviceContext
from atorch.auto.plan import resolve_strategy
from atorch.auto.search import cost
from atorch.auto.strategy import Strategy
from tests.helpers.models import TinyTransformer, TokenDataset

CANDIDATES = ([], ["checkpoint"], ["zero2"], ["checkpoint", "zero2"], [("amp_native", "bf16")])


def test_shared_probes_run_once_and_give_the_same_estimates(monkeypatch):
    torch.manual_seed(0)
    model = TinyTransformer(layers=2)
    batch = {k: torch.stack([TokenDataset(n=4)[i][k] for i in range(2)]) for k in ("input_ids", "labels")}
    device_ctx = DeviceContext.detect()
    forwards = []
    real = cost._saved_bytes
    monkeypatch.setattr(cost, "_saved_bytes", lambda *args, **kw: forwards.append(1) or real(*args, **kw))

    memo: dict = {}
    for methods in CANDIDATES:
        strategy = resolve_strategy(model, Strategy([("parallel_mode", {}), *methods]))
        shared, alone = [], []
        with_memo = cost.activation_bytes(model, strategy, batch, "unpack_dict", None, device_ctx, shared, memo=memo)
        before = len(forwards)
        without = cost.activation_bytes(model, strategy, batch, "unpack_dict", None, device_ctx, alone)
        assert with_memo == without and shared == alone, methods
        forwards[before:] = []  # count only the memo's forwards
    # plain, checkpointed (its second forward is plain's), bf16: zero2 applies nothing in a probe
    assert len(forwards) == 3


def test_a_checkpointed_candidate_counts_the_plain_forwards_operators_and_its_hooked_tensors():
    """The checkpointed blocks' operators are dispatched out of the counter's sight: the cost
    model's operator count (and so its overhead term) is the plain forward's, times 4 passes.
    What the blocks save goes through the checkpoint's hooks: the tensors the plain forward saves
    and the checkpointed one does not (their count costs the profile's checkpoint_save_seconds)."""
    torch.manual_seed(0)
    model = TinyTransformer(layers=2)
    batch = {k: torch.stack([TokenDataset(n=4)[i][k] for i in range(2)]) for k in ("input_ids", "labels")}
    device_ctx = DeviceContext.detect()
    counts = {}
    for name, methods in (("plain", []), ("checkpoint", ["checkpoint"])):
        strategy = resolve_strategy(model, Strategy([("parallel_mode", {}), *methods]))
        counts[name] = []
        cost.activation_bytes(model, strategy, batch, "unpack_dict", None, device_ctx, counts[name])
    assert counts["checkpoint"][:3] == counts["plain"][:3]
    # two blocks of the tiny transformer save ~20 tensors each; outside the blocks, the embedding
    # and the head save a few
    assert counts["plain"][3] == 0 and 20 <= counts["checkpoint"][3] <= 80, counts
