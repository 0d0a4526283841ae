"""Code sandboxes run as Dask `score` tasks on the workers labelled for them: a cluster with a rollout-only worker
and a sandbox-only worker (real worker processes) scores a code lease on the sandbox worker, with the acquisition
loop's own resources, and the sandbox inside that daemonic worker process contains a hostile program."""

from __future__ import annotations

import os
import uuid

import pytest

from astratk.dataflow.client import DataLayerClient
from astratk.dataflow.datalayer import DataLayer
from astratk.engines import ScriptedEngine
from astratk.envs.code.env import CodeEnv
from astratk.models import build_char_tokenizer
from astratk.records import RunContext
from astratk.rollout.service import RolloutService
from astratk.rollout.tasks import score_task
from astratk.runtime.acquisition import SCORE_RESOURCES
from astratk.spec import DataflowSpec, PolicySpec, RolloutSpec, RunSpec
from tests.unit.test_sandbox import host_is_fine

pytestmark = pytest.mark.integration
distributed = pytest.importorskip("distributed")


def test_code_leases_are_scored_on_the_sandbox_worker(tmp_path):
    env = CodeEnv(levels=(1,), n_heldout=4, seed=5, test_timeout_s=1.0, memory_mb=256, max_procs=16)
    spec = RunSpec(env=env, policies=[PolicySpec()],
                   rollout=RolloutSpec(engine="scripted", group_size=2, max_new_tokens=2000),
                   dataflow=DataflowSpec(filter_zero_variance=False)).validate()
    ctx = RunContext(f"score-{uuid.uuid4().hex[:8]}", spec, {"main": None}, f"memory://score-{tmp_path.name}")
    service = RolloutService(ctx)
    tok = build_char_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    [lease] = DataLayerClient(DataLayer(spec)).lease(1)
    marker = f"/tmp/evil-{uuid.uuid4().hex}"
    hostile = f"```python\nopen({marker!r}, 'w').write('x')\nwhile True:\n    pass\n```\n"
    answers = [env.demonstration(lease.task), hostile]  # episode 0 answers right, 1 writes outside and spins
    script = [list(tok(a, add_special_tokens=False)["input_ids"]) + [end] for a in answers]
    service._engines[("rollout", "main")] = ScriptedEngine(tok, script)
    rolled = service.rollout([lease])

    workers = {"rollout-0": {"rollout_main": 1}, "sandbox-0": dict(SCORE_RESOURCES)}
    with (distributed.LocalCluster(n_workers=0, processes=True, host="127.0.0.1",
                                   dashboard_address="127.0.0.1:0") as cluster,
          distributed.Client(cluster) as client):
        for name, resources in workers.items():
            cluster.worker_spec[name] = {"cls": distributed.Nanny, "options": {
                "host": "127.0.0.1", "nthreads": 1, "resources": resources}}
        cluster.scale(len(workers))
        client.wait_for_workers(len(workers), timeout=120)
        names = {a: w["name"] for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        fut = client.submit(score_task, ctx, rolled, resources=SCORE_RESOURCES, pure=False)
        [scored] = fut.result(timeout=180)
        [where] = client.who_has(fut)[fut.key]
        worker_pid = client.run(os.getpid, workers=[where])[where]
    assert names[where] == "sandbox-0"
    assert worker_pid != os.getpid()
    trajectories = [t for g in scored.groups for t in g.trajectories]
    by_text = {t.text.strip(): t for t in trajectories}
    right = by_text[answers[0].strip()]
    evil = by_text[hostile.strip()]
    assert right.reward == 1.0 and evil.reward == 0.0
    for t in (right, evil):
        assert t.metrics["code/isolation_bwrap"] == float(env.sandbox.isolation == "bwrap")
        assert t.metrics["code/infra_error"] == 0.0
    assert not os.path.exists(marker)
    host_is_fine()


def test_a_run_with_rollout_only_and_score_only_pools_trains(tmp_path):
    """The whole path with split labels: `deploy` waits for the rollout and the score labels separately, every chunk
    is rolled out on the rollout worker and scored on the scoring one, and training finishes."""
    from astratk.runtime.run import Run
    from astratk.spec import WorkerClass
    from tests.integration.test_local_run import small_spec

    spec = small_spec(tmp_path, max_steps=3)
    spec.cluster.pools = [WorkerClass("gen", 1, resources={"rollout_main": 1}),
                          WorkerClass("sandbox", 1, resources=dict(SCORE_RESOURCES))]
    result = Run(spec.validate(), printer=lambda line: None).start()
    assert result.summary["steps"] == 3 and result.summary["final_version"] == 3

