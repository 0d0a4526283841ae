"""Publishing in the background (`WeightPublisher(background=True)`, `trainer.publish_in_background`): the trainer
blocks only to copy the weights out; writes reach the store one at a time and in order, with the weights of the step
that published them; a failed write raises on the training thread; the end of training and checkpoints wait."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from astratk.records import WeightRef
from astratk.training.publish import WeightPublisher

WRITE_S = 0.3


class SlowStore:
    """Takes WRITE_S per write; records what it wrote, in which order, and whether two writes overlapped."""

    url = "memory://slow"

    def __init__(self, fail_at: int | None = None) -> None:
        self.written: list[tuple[int, float]] = []
        self.fail_at = fail_at
        self.busy = threading.Lock()
        self.overlapped = False

    def publish(self, policy_id, version, state):
        if not self.busy.acquire(blocking=False):
            self.overlapped = True
            self.busy.acquire()
        try:
            time.sleep(WRITE_S)
            if version == self.fail_at:
                raise OSError("No space left on device")
            self.written.append((version, float(state["w"][0])))
            return WeightRef(policy_id=policy_id, version=version, uri=f"{self.url}/{version}", nbytes=4,
                             published_at=time.time())
        finally:
            self.busy.release()


class Module:
    """What the publisher uses of a PolicyModule: `weights()` (copies), `policy_version`, `step_metrics`."""

    def __init__(self) -> None:
        self.w = torch.zeros(1)
        self.policy_version = 0
        self.step_metrics = {}

    def weights(self):
        return {"w": self.w.clone()}


def publisher(store, background=True, **kwargs):
    datalayer = SimpleNamespace(told=[], publish_version=lambda ref: datalayer.told.append(ref.version))
    return WeightPublisher(store, datalayer, "main", background=background, **kwargs), datalayer


def test_the_trainer_only_copies_and_writes_land_in_order_with_their_steps_weights():
    store, module = SlowStore(), Module()
    pub, datalayer = publisher(store)
    blocked = []
    for step in range(1, 5):
        module.w += 1  # the optimiser step: weights of step k are k
        start = time.perf_counter()
        assert pub.publish(module, step) is None
        blocked.append(time.perf_counter() - start)
        assert module.policy_version == step  # the trainer's version moves at once
        module.w += 100  # the next step mutates the weights while the write is in flight ...
        module.w -= 100
    assert blocked[0] < WRITE_S / 2  # nothing in flight: a copy
    pub.on_train_end(None, module)
    assert store.written == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]  # ... and the store has the step's weights
    assert datalayer.told == [1, 2, 3, 4] and not store.overlapped
    assert [r.version for r in pub.refs] == [1, 2, 3, 4]
    assert module.step_metrics["weights/main/publish_s"] < 2 * WRITE_S


def test_inline_publishing_blocks_for_the_write():
    store, module = SlowStore(), Module()
    pub, _ = publisher(store, background=False)
    start = time.perf_counter()
    ref = pub.publish(module, 1)
    assert time.perf_counter() - start >= WRITE_S and ref.version == 1 and store.written == [(1, 0.0)]
    assert module.step_metrics["weights/main/publish_mb"] == 4e-6


def test_a_failed_write_raises_on_the_training_thread():
    store, module = SlowStore(fail_at=2), Module()
    pub, datalayer = publisher(store)
    pub.publish(module, 1)
    pub.publish(module, 2)  # fails in the background
    with pytest.raises(OSError, match="No space left"):
        pub.publish(module, 3)
    assert datalayer.told == [1]  # the data layer never heard of the version that was not written
    pub.publish(module, 2)
    with pytest.raises(OSError, match="No space left"):
        pub.on_train_end(None, module)  # the end of training reports it too


def test_a_checkpoint_and_an_exception_wait_for_the_write_in_flight():
    store, module = SlowStore(), Module()
    pub, _ = publisher(store)
    pub.publish(module, 1)
    pub.on_save_checkpoint(None, module, {})
    assert store.written == [(1, 0.0)]  # a checkpoint of step k never precedes version k in the store
    pub.publish(module, 2)
    pub.on_exception(None, module, RuntimeError("the fit's own error"))
    assert [v for v, _ in store.written] == [1, 2]
    pub.teardown(None, module, "fit")


def test_the_synchronous_mode_publishes_inline():
    pub, _ = publisher(SlowStore(), background=True, publish_skipped=True)
    assert pub.background is False
