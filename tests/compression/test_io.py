import json

import pytest
import torch

from atorch.compression import GenomicBottleneck
from atorch.errors import CompressionError
from tests.compression.models import LM_GNETS, CharLM, char_batches, lm_loss


def _train(model, gnets, windows):
    for window in windows:
        gnets.zero_grad()
        gnets.predict_weights()
        lm_loss(model, window).backward()
        gnets.backward()
        gnets.step()
    with torch.no_grad():
        gnets.predict_weights()
    return {n: model.get_parameter(n).detach().clone() for n in gnets.gnetdict}


def test_round_trip_restores_predictions_and_optimizer_state(tmp_path):
    windows = char_batches(4, 4)
    model = CharLM()
    gnets = GenomicBottleneck(model, **LM_GNETS)
    saved = _train(model, gnets, windows[:2])
    gnets.save(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gnets-rank00000.pt", "meta.json"]
    assert json.loads((tmp_path / "meta.json").read_text())["gnets"]["blocks.0.mlp.0.weight"]["rank"] == 0
    after = _train(model, gnets, windows[2:])

    other = CharLM(seed=3)  # different p-net init: everything covered must come from the checkpoint
    other.load_state_dict({k: v for k, v in model.state_dict().items() if k not in gnets.gnetdict}, strict=False)
    restored = GenomicBottleneck(other, **LM_GNETS)
    restored.load(str(tmp_path))
    for name, weight in saved.items():
        assert torch.equal(other.get_parameter(name).detach(), weight), name
    # Adam's moments came back too: the next two steps match as well.
    for name, weight in _train(other, restored, windows[2:]).items():
        assert torch.equal(weight, after[name]), name


def test_loading_into_differently_built_gnets_names_the_difference(tmp_path):
    GenomicBottleneck(CharLM(), **LM_GNETS).save(str(tmp_path))
    with pytest.raises(CompressionError, match="gnet_width=32 but these g-nets have 16"):
        GenomicBottleneck(CharLM(), **{**LM_GNETS, "gnet_width": 16}).load(str(tmp_path))
    with pytest.raises(CompressionError, match="only here.*head.weight"):
        GenomicBottleneck(CharLM(), min_numel=1, **LM_GNETS).load(str(tmp_path))
    with pytest.raises(CompressionError, match="no meta.json"):
        GenomicBottleneck(CharLM(), **LM_GNETS).load(str(tmp_path / "missing"))
