"""Lightning's FSDPStrategy with a PolicyModule on one GPU (skipped without CUDA): the decoder layers become FSDP
units, clipping runs over the shards (Lightning's FSDP precision plugin would refuse it), and the publisher's gather
writes the whole model to the weight store, equal to the trained weights. The pieces are tested on the CPU with FSDP2
over gloo (tests/unit/test_fsdp_module.py, tests/unit/test_sharding.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from astratk.losses.drpo import DRPO
from astratk.training._pl import pl
from astratk.training.module import PolicyModule
from astratk.training.publish import WeightPublisher
from astratk.weights.store import WeightStore
from tests.unit.test_micro_batch import H, make_batch
from tests.unit.test_micro_batch import model_path as _model_path_fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
model_path = _model_path_fixture


class _Versions:
    def __init__(self) -> None:
        self.refs = []

    def publish_version(self, ref) -> None:
        self.refs.append(ref)


def test_fsdp_fit_clips_and_publishes_the_whole_model(model_path, tmp_path):
    from torch.distributed.fsdp import FullyShardedDataParallel

    batch = make_batch(model_path)
    loader = torch.utils.data.DataLoader([batch, batch], batch_size=None, collate_fn=lambda b: b)
    module = PolicyModule(model_path, DRPO(delta=0.5), horizon=H, micro_batch_tokens=30)
    store, versions = WeightStore(str(tmp_path / "weights")), _Versions()
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy="fsdp", precision="bf16-mixed", max_steps=2,
                         gradient_clip_val=1e-3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[WeightPublisher(store, versions, "main")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    units = [m for m in module.model.modules() if isinstance(m, FullyShardedDataParallel)]
    assert len(units) >= len(module.model.model.layers)  # one unit per decoder layer (plus the root)
    assert module.step_metrics["train/main/grad_norm"] > 1e-3
    assert [r.version for r in versions.refs] == [1, 2]
    state, ref = store.pull("main", have_version=None)
    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model):
        live = {k: v.detach().cpu() for k, v in module.model.state_dict().items()}
    assert ref.version == 2 and state.keys() == live.keys()
    for k, value in live.items():
        torch.testing.assert_close(state[k].float(), value.float())
