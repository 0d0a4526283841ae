"""FSDP support pieces on this CPU: the full-state gather and clipping under FSDP2 over gloo (two processes), and the
micro-batch count every rank must share."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from astratk.training.sharding import clip_gradients, even_micro_batches, full_state_dict, is_sharded


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=96, max_position_embeddings=32,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


def _grads(model: torch.nn.Module) -> None:
    ids = torch.arange(24).reshape(2, 12) % 64
    model(input_ids=ids, labels=ids).loss.backward()


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = _model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert is_sharded(model)
    state = full_state_dict(model)  # a collective: both ranks call it
    _grads(model)
    norm = clip_gradients(model, 0.5)
    torch.save({"state": state, "norm": float(norm)}, f"{out}.{rank}")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # seconds: left out of the fast tier
@pytest.mark.timeout(180)
def test_fsdp2_gather_gives_rank0_the_whole_model_and_clipping_sees_every_shard(tmp_path):
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
    rank0, rank1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    plain = _model()
    want = plain.state_dict()
    assert rank1["state"] == {}  # only rank 0 receives (and writes) the weights
    assert set(rank0["state"]) == set(want) - {"lm_head.weight"} or set(rank0["state"]) == set(want)
    for k, v in rank0["state"].items():
        assert torch.equal(v, want[k]), k
    assert not is_sharded(plain) and full_state_dict(plain).keys() == want.keys()
    _grads(plain)  # the same batch unsharded: the norm over all shards equals the whole model's
    expected = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5))
    assert rank0["norm"] == pytest.approx(expected, rel=1e-5) and rank1["norm"] == pytest.approx(expected, rel=1e-5)


@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=5), extra=st.integers(0, 8))
def test_even_micro_batches_cover_every_row_once_in_exactly_count_pieces(sizes, extra):
    rows, chunks = iter(range(100)), []
    for n in sizes:
        chunks.append(torch.tensor([next(rows) for _ in range(n)], dtype=torch.long))
    total = sum(sizes)
    count = len(chunks) + extra
    if total == 0:
        with pytest.raises(ValueError, match="groups_per_step"):
            even_micro_batches(chunks, count)
        return
    out, dummy = even_micro_batches(chunks, count)
    assert len(out) == len(dummy) == count
    real = torch.cat([c for c, d in zip(out, dummy) if not d]).tolist()
    assert sorted(real) == list(range(total))  # every row once, in real micro-batches
    assert all(len(c) >= 1 for c in out)
    assert sum(dummy) == max(0, count - total)  # zero-weight repeats only when rows run out


def test_even_micro_batches_refuses_fewer():
    with pytest.raises(ValueError, match="fewer"):
        even_micro_batches([torch.tensor([0]), torch.tensor([1])], 1)
