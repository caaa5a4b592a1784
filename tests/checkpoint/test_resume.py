"""Resume equivalence on 2 processes: 10 steps straight == 5 steps, save, new processes, load,
5 steps (fp32, dropout on, shuffled sampler, Adam and a step schedule)."""

from tests.checkpoint.runs import RESUMED


def test_resumed_run_continues_exactly(two_ranks):
    _, first, second = two_ranks
    for name in RESUMED:
        straight, half = first[0]["resume"][name]["straight"], first[0]["resume"][name]["half"]
        assert half == straight[:5], name
        for rank in range(2):
            got = second[rank]["resume"][name]
            assert got["extra"] == {"step": 5}
            # 8 batches per epoch: the resumed run crossed into epoch 1 at the right batch.
            assert got["position"] == {"epoch": 1, "batches": 2, "global_batch_size": 8}
            assert max(abs(a - b) for a, b in zip(got["losses"], straight[5:])) <= 1e-6, (name, got["losses"], straight)
