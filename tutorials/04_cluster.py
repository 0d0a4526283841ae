# %% [markdown]
# # 4. A cluster of heterogeneous workers
#
# Rollout services are autonomous: any worker labelled `rollout_<policy>` serves that policy, whatever its
# hardware. Here a local cluster mixes two simulated GPU classes (one 3x slower) and the run reports throughput and
# version lag per worker and per hardware class. The same run attaches to a real cluster by setting
# `cluster.scheduler_address` (and `cluster.tls`): `docs/cluster.md` has the `dask scheduler` / `dask worker
# --resources ...` commands, Slurm (dask-jobqueue) and Kubernetes recipes; `astratk deploy` + `astratk train fit`
# run the data layer and each policy's trainer as separate jobs.

# %%
import astratk
import astratk.viz
from astratk.quick import short_mode, smoke, tutorial_file
from astratk.spec import ClusterSpec, WorkerClass

run = astratk.Run.from_config(tutorial_file("quickstart.yaml"), "--output_dir", "runs/tutorials", "--name", "hetero")
spec = run.spec
spec.cluster = ClusterSpec(pools=[WorkerClass(name="gpu_fast", count=1),
                                  WorkerClass(name="gpu_slow", count=1, slowdown=3.0)])
spec.policies[0].trainer.max_time_s = 60
if short_mode():
    spec = smoke(spec, steps=4)
result = astratk.Run(spec).start()

# %%
ds = result.metrics()
print(ds[["service_hardware", "service_tasks_per_s", "service_version_lag_mean"]].to_dataframe())
try:
    ds.astra.throughput()
except ValueError as e:
    print(e)
print("tutorial done")
