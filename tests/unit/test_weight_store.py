"""Weight store with sparse deltas (issue 6): bit-exact delta round trips through the store (fp32 and bf16
publishing), chains equal full states, checksums (a corrupted delta is pulled around through a full snapshot, a
corrupted full raises naming the file), pruning that keeps chains whole, the pull rule (delta or full by what the
puller has), memory:// and file:// stores, the simulated link, and a rollout service syncing a real TorchEngine
bit for bit through deltas."""

from __future__ import annotations

import itertools
import time
import warnings

import pytest
import torch

from astratk.spec import ModelSpec, RolloutSpec, RunSpec, TinyModelSpec, WeightsSpec
from astratk.weights import SimulatedLink, SparseDelta, WeightStore, apply_delta, make_delta
from astratk.weights.delta import delta_from_bytes, delta_to_bytes, merge_deltas

SHAPES = {"a": (64, 48), "b": (300,), "c": (8, 8), "step": (1,)}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bit_equal(got, want) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(bits(got[k]), bits(want[k])), k


def as_published(state, dtype):
    return {k: v.to(dtype) if v.is_floating_point() else v.clone() for k, v in state.items()}


def versions(n: int, frac: float = 0.03, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """n fp32 states; each changes a random `frac` of every float tensor's elements by ~1e-3 relative, like a small
    optimiser step, and carries an int64 buffer that counts versions. Version 1 also flips a signed zero and a NaN
    payload (equal as floats, different bits)."""
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(s, generator=g) for k, s in SHAPES.items() if k != "step"}
    state["a"][0, 0], state["a"][0, 1] = 0.0, float("nan")
    state["step"] = torch.zeros(1, dtype=torch.int64)
    out = [state]
    for i in range(1, n):
        new = {k: v.clone() for k, v in out[-1].items()}
        for k in ("a", "b", "c"):
            mask = torch.rand(new[k].shape, generator=g) < frac
            new[k] += mask * new[k] * 1e-2 * torch.randn(new[k].shape, generator=g)
        new["step"] += 1
        if i == 1:
            new["a"][0, 0] = -0.0
            bits(new["a"])[1] ^= 1  # another NaN payload
        out.append(new)
    return out


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
    return f"memory://ws-{tmp_path.name}" if request.param == "memory" else f"file://{tmp_path}/store"


def corrupt(store: WeightStore, ref) -> None:
    """Flip one byte in the middle of `ref`'s file, in the store."""
    path = store._path(ref.policy_id, ref.uri.rsplit("/", 1)[-1])
    blob = bytearray(store.fs.cat_file(path))
    blob[len(blob) // 2] ^= 0xFF
    store.fs.pipe_file(path, bytes(blob))


# ----------------------------------------------------------------------------------------------- wire format
def test_wire_format_round_trip_is_bit_exact_for_every_gap_width():
    g = torch.Generator().manual_seed(1)
    n = 200_000
    idx = torch.cat([torch.tensor([0, 1, 2, 300]), torch.tensor([70_000, 199_999])])  # gaps < 2**8, 2**16, 2**17
    old = {"w": torch.randn(n, generator=g).to(torch.bfloat16), "z": torch.zeros(5)}
    new = {k: v.clone() for k, v in old.items()}
    new["w"][idx] = -new["w"][idx]
    new["z"][3] = -0.0
    delta = make_delta(old, new, base_version=3, version=7)
    back = delta_from_bytes(delta_to_bytes(delta))
    assert (back.base_version, back.version, back.shapes) == (3, 7, delta.shapes)
    for name, (i, v) in delta.changes.items():
        assert torch.equal(back.changes[name][0], i) and torch.equal(bits(back.changes[name][1]), bits(v))
    target = {k: v.clone() for k, v in old.items()}
    apply_delta(target, back)
    assert_bit_equal(target, new)


def test_index_compression_beats_int32():
    """3% of 1M elements changed at random: gap-coded zlib indices cost ~1 byte each, not 4 (int32) or 8."""
    g = torch.Generator().manual_seed(0)
    old = {"w": torch.randn(1_000_000, generator=g).to(torch.bfloat16)}
    new = {"w": old["w"].clone()}
    mask = torch.rand(1_000_000, generator=g) < 0.03
    new["w"][mask] += 1.0
    delta = make_delta(old, new, base_version=0, version=1)
    n = delta.num_changed()
    index_bytes = len(delta_to_bytes(delta)) - 2 * n
    assert index_bytes < 1.2 * n


def test_merge_is_applying_in_order():
    states = versions(4, frac=0.3)
    deltas = [make_delta(a, b, base_version=i, version=i + 1) for i, (a, b) in enumerate(itertools.pairwise(states))]
    merged = merge_deltas(deltas)
    assert (merged.base_version, merged.version) == (0, 3)
    target = {k: v.clone() for k, v in states[0].items()}
    apply_delta(target, merged)
    assert_bit_equal(target, states[3])
    with pytest.raises(ValueError, match="consecutive"):
        merge_deltas([deltas[0], deltas[2]])


# ------------------------------------------------------------------------------------------------ publish/pull
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_delta_round_trip_through_the_store_is_bit_exact(url, dtype):
    store = WeightStore(url, full_every=10, publish_dtype=dtype)
    states = versions(5)
    published = [as_published(s, getattr(torch, dtype)) for s in states]
    refs = [store.publish("main", v, s) for v, s in enumerate(states)]
    assert [r.kind for r in refs] == ["full", "delta", "delta", "delta", "delta"]
    assert all(r.base_version == v - 1 and 0 < r.nbytes < refs[0].nbytes / 5 for v, r in enumerate(refs[1:], 1))
    for v in range(1, 5):
        delta, ref = store.pull("main", have_version=v - 1, want=v)
        assert isinstance(delta, SparseDelta) and (delta.base_version, delta.version) == (v - 1, v)
        target = {k: t.clone() for k, t in published[v - 1].items()}
        apply_delta(target, delta)
        assert_bit_equal(target, published[v])
    full, ref = store.pull("main", have_version=None)
    assert ref.version == 4 and isinstance(full, dict)
    assert_bit_equal(full, published[4])


def test_a_chain_of_deltas_equals_the_full_state(url):
    store = WeightStore(url, full_every=100)
    states = versions(6)
    for v, s in enumerate(states):
        store.publish("main", v, s)
    delta, ref = store.pull("main", have_version=1, want=5)
    assert (delta.base_version, delta.version, ref.version) == (1, 5, 5)
    target = {k: t.clone() for k, t in states[1].items()}
    apply_delta(target, delta)
    assert_bit_equal(target, states[5])
    full, _ = store.pull("main", have_version=None, want=5)  # v0 in full plus five deltas
    assert_bit_equal(full, states[5])
    assert_bit_equal(store.fetch(store.ref("main", 3)), states[3])


def test_full_snapshots_every_n_versions_carry_a_delta_too():
    store = WeightStore("memory://ws-every-n", full_every=3)
    states = versions(8)
    refs = [store.publish("main", v, s) for v, s in enumerate(states)]
    assert [r.kind for r in refs] == ["full", "delta", "delta", "full", "delta", "delta", "full", "delta"]
    # a follower at v2 gets v3 as a delta (the full snapshot's companion), not the full state
    delta, _ = store.pull("main", have_version=2, want=3)
    assert isinstance(delta, SparseDelta) and delta.base_version == 2
    assert store.stats["pulled_delta"] == 1 and store.stats["pulled_full"] == 0


def test_pull_picks_delta_or_full_by_bytes():
    """Each version changes 35% of the elements, so a delta is ~40% of a full state: one or two deltas beat a full
    snapshot, three do not."""
    store = WeightStore("memory://ws-pick", full_every=3)
    states = versions(7, frac=0.35)
    refs = [store.publish("main", v, s) for v, s in enumerate(states)]
    full_bytes, delta_bytes = refs[0].nbytes, refs[1].nbytes
    assert 0.34 * full_bytes < delta_bytes < 0.48 * full_bytes
    kinds = {}
    for have, want in [(None, 5), (4, 5), (2, 4), (1, 3), (0, 3), (6, 2), (5, None)]:
        payload, ref = store.pull("main", have, want)
        kinds[(have, want)] = "full" if isinstance(payload, dict) else f"delta from v{payload.base_version}"
        assert ref.version == (6 if want is None else want)
        expected = states[ref.version]
        got = payload if isinstance(payload, dict) else {k: t.clone() for k, t in states[have].items()}
        if not isinstance(payload, dict):
            apply_delta(got, payload)
        assert_bit_equal(got, expected)
    assert kinds == {
        (None, 5): "full",  # nothing usable: full v3 + d4 + d5
        (4, 5): "delta from v4",
        (2, 4): "delta from v2",  # d3 (v3's companion) + d4: 0.9 of a full < full v3 + d4
        (1, 3): "delta from v1",  # d2 + d3 < full v3
        (0, 3): "full",  # d1 + d2 + d3 > full v3
        (6, 2): "full",  # going back (evaluation of an old version)
        (5, None): "delta from v5",
    }
    assert store.pull("main", 6)[0] is None and store.pull("main", 3, 3)[0] is None  # already there
    assert store.pull("main", 9)[0] is None  # ahead of the newest: a puller never moves back on its own
    with pytest.raises(KeyError, match="version 12 is not in"):
        store.pull("main", None, 12)


def test_only_full_snapshots_by_default(url):
    store = WeightStore(url)
    refs = [store.publish("main", v, s) for v, s in enumerate(versions(3))]
    assert [r.kind for r in refs] == ["full"] * 3 and store._kept == {}
    payload, ref = store.pull("main", have_version=1)
    assert isinstance(payload, dict) and ref.version == 2


# ------------------------------------------------------------------------------------------------ checksums
def test_a_corrupted_delta_is_detected_and_refetched_through_a_full_snapshot(url):
    store = WeightStore(url, full_every=4)
    states = versions(6)
    refs = [store.publish("main", v, s) for v, s in enumerate(states)]  # full at 0 and 4 (+ its delta)
    delta, _ = store.pull("main", have_version=1, want=5)
    assert isinstance(delta, SparseDelta)  # d2..d5 are cheaper than full v4 + d5
    corrupt(store, refs[2])
    with pytest.warns(UserWarning, match="checksum mismatch for .*v00000002.delta.safetensors"):
        payload, ref = store.pull("main", have_version=1, want=5)
    assert isinstance(payload, dict) and ref.version == 5
    assert_bit_equal(payload, states[5])
    assert store.stats["corrupt_deltas"] == 1 and store.stats["full_fallbacks"] == 1


def test_a_corrupted_delta_with_no_full_snapshot_after_it(url):
    store = WeightStore(url, full_every=10)
    refs = [store.publish("main", v, s) for v, s in enumerate(versions(3))]
    corrupt(store, refs[2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"no verifiable way from version 1 to 2.*v00000002.delta"):
            store.pull("main", have_version=1, want=2)
        payload, _ = store.pull("main", have_version=1)  # following the newest: stays where it is
        assert payload is None
        payload, ref = store.pull("main", have_version=0)  # ... or goes as far as it can
        assert isinstance(payload, SparseDelta) and payload.version == ref.version == 1
    assert store.stats["corrupt_deltas"] == 3


def test_a_corrupted_full_snapshot_raises_naming_the_file(url):
    store = WeightStore(url, full_every=10)
    refs = [store.publish("main", v, s) for v, s in enumerate(versions(2))]
    corrupt(store, refs[0])
    with pytest.raises(ValueError, match=r"checksum mismatch for .*main/v00000000\.safetensors .*full snapshot"):
        store.pull("main", have_version=None)
    delta, _ = store.pull("main", have_version=0)  # a puller that needs no full snapshot is unaffected
    assert isinstance(delta, SparseDelta)


# ------------------------------------------------------------------------------------------------ pruning
def test_pruning_keeps_every_retained_chain_whole(tmp_path):
    root = tmp_path / "store"
    store = WeightStore(str(root), keep_last=2, full_every=4)
    states = versions(10)
    refs = [store.publish("main", v, s) for v, s in enumerate(states)]
    assert [r.kind for r in refs] == ["full", "delta", "delta", "delta", "full", "delta", "delta", "delta", "full",
                                      "delta"]
    files = sorted(p.name for p in (root / "main").iterdir())
    # kept: v0; v7-9 (the window); v7's chain back to the full v4 (d5, d6); v8's delta for followers of v7
    assert files == ["index.json", "latest.json",
                     "v00000000.json", "v00000000.safetensors",
                     "v00000004.json", "v00000004.safetensors",
                     "v00000005.delta.safetensors", "v00000005.json",
                     "v00000006.delta.safetensors", "v00000006.json",
                     "v00000007.delta.safetensors", "v00000007.json",
                     "v00000008.delta.safetensors", "v00000008.json", "v00000008.safetensors",
                     "v00000009.delta.safetensors", "v00000009.json"]
    for v in (0, 4, 5, 6, 7, 8, 9):
        full, _ = store.pull("main", None, v)
        assert_bit_equal(full, states[v])
    for v in (1, 2, 3):
        with pytest.raises(KeyError, match=f"version {v} is not in.*retained: 0, 4-9"):
            store.pull("main", None, v)
    delta, _ = store.pull("main", have_version=7)
    assert isinstance(delta, SparseDelta) and delta.base_version == 7


def test_republishing_an_older_version_starts_a_new_history():
    store = WeightStore("memory://ws-rewrite", full_every=10)
    old, new = versions(4, seed=1), versions(2, seed=2)
    for v, s in enumerate(old):
        store.publish("main", v, s)
    store.publish("main", 0, new[0])
    ref = store.publish("main", 1, new[1])
    assert ref.kind == "delta" and store.latest("main") == ref
    assert not store.fs.exists(store._path("main", "v00000003.delta.safetensors"))
    assert_bit_equal(store.pull("main", None)[0], new[1])
    with pytest.raises(KeyError, match="version 3 is not in"):
        store.pull("main", None, 3)


# ------------------------------------------------------------------------------------------------ publisher
def test_the_kept_state_does_not_alias_the_live_weights():
    """A trainer may publish its live parameters; the next optimiser step changes them in place, and the delta must
    still be taken against what was published."""
    store = WeightStore("memory://ws-alias", full_every=10)
    live = versions(1)[0]
    store.publish("main", 0, live)
    before = {k: v.clone() for k, v in live.items()}
    live["b"][:10] += 1.0  # in place, like optimizer.step()
    store.publish("main", 1, live)
    delta, _ = store.pull("main", have_version=0)
    assert delta.changes["b"][0].tolist() == list(range(10))
    target = {k: v.clone() for k, v in before.items()}
    apply_delta(target, delta)
    assert_bit_equal(target, live)


def test_a_new_publisher_reads_the_previous_version_back():
    """Version 0 comes from another process (`publish_initial`), or the trainer restarted: no kept state."""
    states = versions(3)
    WeightStore("memory://ws-restart", full_every=10).publish("main", 0, states[0])
    store = WeightStore("memory://ws-restart", full_every=10)
    assert store.publish("main", 1, states[1]).kind == "delta"
    assert WeightStore("memory://ws-restart", full_every=10).publish("main", 2, states[2]).kind == "delta"
    assert_bit_equal(store.pull("main", None)[0], states[2])


def test_a_delta_no_smaller_than_the_full_state_is_published_in_full():
    store = WeightStore("memory://ws-dense", full_every=10)
    states = versions(2, frac=1.0)
    store.publish("main", 0, states[0])
    ref = store.publish("main", 1, states[1])
    assert ref.kind == "full" and store.stats["published_delta"] == 0


# ------------------------------------------------------------------------------------------------ link, spec
def test_simulated_link_charges_latency_and_bandwidth():
    link = SimulatedLink("memory://", bandwidth_bps=8e6, latency_s=0.02)  # 1 MB/s
    store = WeightStore("memory://ws-link", full_every=10, fs=link)
    states = versions(3)
    for v, s in enumerate(states):
        store.publish("main", v, s)
    before = dict(link.stats)
    start = time.perf_counter()
    payload, _ = store.pull("main", have_version=0)
    wall = time.perf_counter() - start
    nbytes = link.stats["bytes"] - before["bytes"]
    assert isinstance(payload, SparseDelta)
    assert link.stats["requests"] - before["requests"] == 3  # the index, then two deltas read concurrently
    assert wall >= link.transfer_time(nbytes, requests=2, concurrent=False)  # index, then both deltas
    assert repr(link) == "SimulatedLink(MemoryFileSystem, 0.008 Gbit/s, 20 ms)"


def test_weights_spec_validation_and_from_spec():
    spec = WeightsSpec(full_every=5, publish_dtype="bfloat16", link_bandwidth_bps=4e9, link_latency_s=0.3)
    store = WeightStore.from_spec("memory://ws-spec", spec)
    assert (store.full_every, store.publish_dtype, store.keep_last) == (5, "bfloat16", 8)
    assert isinstance(store.fs, SimulatedLink) and store.fs.latency_s == 0.3
    for bad, match in [({"full_every": 0}, "weights.full_every"), ({"publish_dtype": "int8"}, "publish_dtype"),
                       ({"link_bandwidth_bps": 0}, "link_bandwidth_bps"), ({"link_latency_s": -1}, "latency")]:
        with pytest.raises(ValueError, match=match):
            RunSpec(weights=WeightsSpec(**bad)).validate()


# ------------------------------------------------------------------------------------------------ service
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from astratk.envs.math.arithmetic import ArithmeticEnv
    from astratk.models import ensure_model

    env = ArithmeticEnv(levels=[1], n_heldout=8)
    spec = ModelSpec(tiny=TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                        intermediate_size=128, warm_start_steps=2, warm_start_batch=4,
                                        warm_start_target=None),
                     cache_dir=str(tmp_path_factory.mktemp("cache")))
    return str(ensure_model(spec, env, log=lambda s: None)), env


@pytest.mark.parametrize(("publish_dtype", "engine_dtype"), [("float32", "float32"), ("bfloat16", "bfloat16"),
                                                             ("bfloat16", "float32")])
def test_service_sync_moves_a_torch_engine_through_deltas_bit_for_bit(tiny_model, tmp_path, publish_dtype,
                                                                      engine_dtype):
    from astratk.models.loading import load_causal_lm
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService

    path, env = tiny_model
    spec = RunSpec(env=env, rollout=RolloutSpec(engine_args={"dtype": engine_dtype})).validate()
    store = WeightStore(f"memory://ws-svc-{tmp_path.name}", full_every=3, publish_dtype=publish_dtype)
    model = load_causal_lm(path, torch.float32)  # the trainer's fp32 master weights
    store.publish("main", 0, {k: v.detach().clone() for k, v in model.state_dict().items()})
    service = RolloutService(RunContext("ws-svc", spec, {"main": path}, store.url))
    engine = service.engine("main")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 200, (4, 12), generator=g)
    mismatch = publish_dtype != engine_dtype
    for v in range(1, 6):
        loss = model(ids, labels=ids).loss  # one optimiser step, then publish
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # a sparse update, so that fp32 deltas stay smaller than the full state
            p.grad *= torch.rand(p.shape, generator=g) < 0.02
        opt.step()
        published = as_published(model.state_dict(), getattr(torch, publish_dtype))
        store.publish("main", v, model.state_dict())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert service.sync("main") == v
        assert bool(caught) == mismatch  # a bf16 delta for an fp32 engine: refused, loaded in full, warned
        expected = {k: t.to(getattr(torch, engine_dtype)) for k, t in published.items()}
        assert_bit_equal({k: t.detach() for k, t in engine._params.items()}, expected)
    assert all(r.kind == "delta" for r in [store.ref("main", v) for v in (1, 2, 4, 5)])
    if not mismatch:
        assert service.store.stats["pulled_delta"] == 5 and service.store.stats["pulled_full"] == 0
    assert service.sync("main") == 5  # nothing new
    # a lagged version computed before another sync moved the rollout engine on: a rollout engine never moves back
    assert service.sync("main", version=3) == 5 and engine.version == 5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mismatched case warns again for the eval engine
        assert service.sync("main", "eval", version=2) == 2  # evaluation: its own engine, at an older version
        assert service.sync("main", "eval", version=1) == 1  # going back: in full
    assert_bit_equal({k: t.detach() for k, t in service.engine("main", "eval")._params.items()},
                     {k: t.to(getattr(torch, engine_dtype)) for k, t in store.pull("main", None, 1)[0].items()})
    assert engine.version == 5


def test_a_shared_evaluation_engine_holds_its_version_until_the_evaluation_ends(tiny_model, tmp_path, monkeypatch):
    """rollout.eval_engine shared: one engine per policy and worker; an evaluation moves it to the version it
    evaluates (back to v0 here), rollout syncs leave it there until the evaluation is done, then move it on."""
    from astratk.records import RunContext
    from astratk.rollout.service import RolloutService

    path, env = tiny_model
    spec = RunSpec(env=env, rollout=RolloutSpec(eval_engine="shared", max_new_tokens=4)).validate()
    assert spec.rollout.shares_eval_engine and not RolloutSpec().shares_eval_engine  # auto: torch keeps two
    assert RolloutSpec(engine="vllm").shares_eval_engine and not RolloutSpec(engine="vllm", weight_lag=1).shares_eval_engine
    store = WeightStore(f"memory://ws-shared-{tmp_path.name}", full_every=2)
    from astratk.models.loading import load_causal_lm

    base = {k: v.detach().clone() for k, v in load_causal_lm(path, torch.float32).state_dict().items()}
    states = [{k: v + 0.01 * i for k, v in base.items()} for i in range(3)]
    for v, state in enumerate(states):
        store.publish("main", v, state)
    service = RolloutService(RunContext("ws-shared", spec, {"main": path}, store.url))
    assert service.sync("main") == 2
    engine = service.engine("main")
    assert service.engine("main", "eval") is engine
    seen = []
    real_sync = service.sync

    def sync(policy_id, purpose="rollout", version=None):
        got = real_sync(policy_id, purpose, version)
        if purpose == "eval":  # a rollout chunk starts right after the evaluation's load
            seen.append((got, real_sync(policy_id), engine.version))
        return got

    monkeypatch.setattr(service, "sync", sync)
    out = service.evaluate_versions({"main": 0}, max_tasks=2)
    assert out["version_main"] == 0 and seen == [(0, 0, 0)]  # the rollout sync left the evaluated version in place
    assert engine.version == 0 and service._held == set()
    assert service.sync("main") == 2 and engine.version == 2  # done: rollouts move on
    assert_bit_equal({k: t.detach() for k, t in engine._params.items()}, states[2])
    assert len({id(e) for e in service._engines.values()}) == 1
    with pytest.raises(ValueError, match="eval_engine: shared needs"):
        RolloutSpec(eval_engine="shared", weight_lag=1).validate()
    with pytest.raises(ValueError, match="auto, shared or separate"):
        RolloutSpec(eval_engine="both").validate()


def test_version_0_of_a_model_with_tied_weights_is_its_state_copied_only_where_shared():
    """`publish_initial`'s state: a tensor sharing storage with an earlier one (a tied head) is copied, as safetensors
    needs; the rest go as they are; the published version 0 equals the model's weights bit for bit."""
    import torch

    from astratk.runtime.deploy import unshared

    embed = torch.randn(8, 4)
    state = {"embed.weight": embed, "layer.weight": torch.randn(4, 4), "head.weight": embed}  # tied
    out = unshared(state)
    def ptr(t):
        return t.untyped_storage().data_ptr()

    assert ptr(out["embed.weight"]) == ptr(embed) and ptr(out["layer.weight"]) == ptr(state["layer.weight"])  # no copy
    assert ptr(out["head.weight"]) != ptr(embed) and torch.equal(out["head.weight"], embed)
    store = WeightStore("memory://ws-tied")
    store.publish("main", 0, out)  # safetensors refuses shared storage: it must not be left here
    assert_bit_equal(store.pull("main", None)[0], state)
