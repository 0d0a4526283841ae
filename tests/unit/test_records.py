import pickle

import pytest

from astratk.records import Group, Task, Trajectory


def traj(tokens=(1, 2, 3, 4), n_prompt=2, versions=(3, 5), mask=(1, 1), reward=None, gid="g"):
    n = len(tokens) - n_prompt
    return Trajectory(task_id="t", group_id=gid, policy_id="main", role="policy", tokens=tuple(tokens),
                      n_prompt=n_prompt, loss_mask=tuple(mask), behavior_logprobs=(-0.5,) * n,
                      behavior_versions=tuple(versions), reward=reward)


def test_trajectory_lengths_are_checked():
    with pytest.raises(ValueError, match="behavior_logprobs"):
        Trajectory(task_id="t", group_id="g", policy_id="p", role="r", tokens=(1, 2, 3), n_prompt=1,
                   loss_mask=(1, 1), behavior_logprobs=(0.0,), behavior_versions=(0, 0))
    with pytest.raises(ValueError, match="n_prompt"):
        traj(tokens=(1,), n_prompt=2, versions=(), mask=())


def test_trajectory_version_is_lowest_policy_version():
    assert traj(versions=(3, 5)).version == 3
    # env tokens (mask 0, version -1) do not count
    t = traj(tokens=(1, 2, 3, 4, 5), versions=(4, -1, 6), mask=(1, 0, 1))
    assert t.version == 4
    assert traj(versions=(-1, -1), mask=(0, 0)).version == -1


def test_group_version_and_rewards():
    g = Group("g", Task("t", "arithmetic", "1+1="), "main", (traj(versions=(7, 9), reward=1.0),
                                                             traj(versions=(8, 8), reward=0.0)))
    assert g.version == 7
    assert g.rewards == (1.0, 0.0)
    with pytest.raises(ValueError, match="unscored"):
        _ = Group("g", g.task, "main", (traj(),)).rewards


def test_records_pickle_small_and_round_trip():
    t = traj(reward=1.0)
    blob = pickle.dumps(t)
    assert pickle.loads(blob) == t
    assert len(blob) < 1000
    assert t.with_reward(0.0).reward == 0.0 and t.reward == 1.0


def test_weight_store_publish_fetch_prune_and_checksum(tmp_path):
    import torch

    from astratk.weights.store import WeightStore

    store = WeightStore(str(tmp_path / "w"), keep_last=2)
    assert store.latest("main") is None
    for v in range(6):
        ref = store.publish("main", v, {"w": torch.full((3,), float(v))})
    assert store.latest("main") == ref and ref.version == 5
    assert store.fetch(store.ref("main", 4))["w"].tolist() == [4.0] * 3
    assert store.fetch(store.ref("main", 0))["w"].tolist() == [0.0] * 3  # version 0 is always kept
    kept = sorted(p.name for p in (tmp_path / "w" / "main").glob("v*.safetensors"))
    assert kept == ["v00000000.safetensors", "v00000003.safetensors", "v00000004.safetensors",
                    "v00000005.safetensors"]
    with pytest.raises(KeyError, match="version 9 was never published"):
        store.ref("main", 9)
    (tmp_path / "w" / "main" / "v00000005.safetensors").write_bytes(b"torn")
    with pytest.raises(ValueError, match="checksum mismatch"):
        store.fetch(ref)
