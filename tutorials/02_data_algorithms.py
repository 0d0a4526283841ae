# %% [markdown]
# # 2. Data algorithms: curators, filters, replay, mixing, staleness
#
# The data layer between rollouts and trainers is programmable at three points, each a small class chosen by
# config (`astratk.dataflow.stages`): *before rollout* (curators decide which tasks to roll out), *after rollout*
# (filters drop groups), *at serving* (staleness bound and lag-decay weights, order, replay, mixing across envs).
# Everything dropped is counted, by stage and reason.

# %%
from astratk import Run
from astratk.dataflow.stages import EDF, GRESO, LengthFilter, Mixing, Replay
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.math.word import WordProblemEnv
from astratk.envs.mixture import MixtureEnv
from astratk.quick import short_mode, smoke
from astratk.spec import DataflowSpec, PolicySpec, RunSpec, TrainerSpec

env = MixtureEnv({"arithmetic": ArithmeticEnv(levels=[1], n_heldout=64),
                  "words": WordProblemEnv(levels=[1], n_heldout=64)})
dataflow = DataflowSpec(
    curators=[GRESO()],                      # skip tasks whose groups were recently all-equal (no signal)
    filters=[LengthFilter(max_tokens=8)],    # drop groups with truncated completions
    max_staleness=2, lag_decay=0.8,          # drop groups > 2 versions old, down-weight older ones
    order=EDF(),                             # serve the oldest versions first
    replay=Replay(ratio=0.25),               # a quarter of every batch replays recent groups
    mixing=Mixing(ratios={"arithmetic": 0.5, "words": 0.5}),  # half of every batch from each env
)
spec = RunSpec(name="data-algorithms", output_dir="runs/tutorials", env=env, dataflow=dataflow,
               policies=[PolicySpec(trainer=TrainerSpec(max_time_s=90))])
if short_mode():
    spec = smoke(spec, steps=3)
result = Run(spec).start()

# %% [markdown]
# Where did the samples go? The counters on the dataset say it per stage; `drops()` draws them.

# %%
ds = result.metrics()
for name in sorted(ds.data_vars):
    if name.startswith(("data_stage", "data_groups_dropped", "data_tasks_skipped")):
        print(name, ds[name].values.ravel())
import astratk.viz  # noqa: F401 - registers the .astra accessor

try:
    ds.astra.drops()
except ValueError as e:  # a short run may drop nothing
    print(e)
print("tutorial done")
