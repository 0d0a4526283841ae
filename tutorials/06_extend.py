# %% [markdown]
# # 6. Your own env, reward, loss and curator
#
# Every plug-in is a small class on a contract (`astratk.contracts`, `astratk.dataflow.stages`): subclass it, pass an
# instance in a notebook, or name it by dotted path (`class_path: mypkg.MyLoss`) in YAML. Plug-ins travel to Dask
# workers and the data-layer actor pickled, so keep them small and picklable (cloudpickle sends classes defined in
# a notebook or script by value).

# %%
import math
from collections.abc import Sequence

import torch

import astratk
from astratk.contracts import LossInputs, LossOutputs, PolicyLoss
from astratk.dataflow.stages import Curator
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.quick import short_mode, smoke
from astratk.records import Task
from astratk.spec import DataflowSpec, PolicySpec, RunSpec, TrainerSpec

# %% [markdown]
# **An env with its own reward.** Arithmetic's tasks and prompts, but partial credit: 1 for the exact answer, 0.5 for
# one that is off by one, 0 otherwise. (A whole new env implements `tasks`, `rollout` and `score`; single-turn chat
# envs only need `messages` and `grade`, as here.)

# %%
class LenientArithmetic(ArithmeticEnv):
    name = "lenient_arithmetic"

    def grade(self, task: Task, text: str) -> float:
        try:
            guess = int(text.strip())
        except ValueError:
            return 0.0
        answer = int(task.info["answer"])
        return 1.0 if guess == answer else 0.5 if abs(guess - answer) == 1 else 0.0


# %% [markdown]
# **A loss.** Token-level REINFORCE with an importance ratio to the behaviour policy, clipped from above: the loss
# gets per-token log-probs of the trainer (`logprobs`) and of the engine that sampled (`behavior_logprobs`), the
# group advantages and masks, and returns per-token losses plus the mask the aggregation divides by.

# %%
class ClippedReinforce(PolicyLoss):
    def __init__(self, max_ratio: float = 2.0) -> None:
        self.max_ratio = max_ratio

    def __call__(self, x: LossInputs) -> LossOutputs:
        ratio = torch.exp(x.logprobs - x.behavior_logprobs).clamp(max=self.max_ratio).detach()
        weights = x.weights if x.weights is not None else torch.ones_like(x.logprobs)
        token_losses = -(x.advantages * ratio * weights * x.logprobs) * x.loss_mask
        on = x.loss_mask > 0
        return LossOutputs(token_losses, x.loss_mask,
                           {"ratio_mean": ratio[on].mean() if on.any() else torch.tensor(math.nan)})


# %% [markdown]
# **A curator.** Before rollout, skip tasks whose answer is larger than a bound until the policy has published
# `warmup_versions` versions (a hand-written curriculum); skips are counted as `data/tasks_skipped_<name>`.

# %%
class SmallAnswersFirst(Curator):
    name = "small_answers_first"

    def __init__(self, max_answer: int = 120, warmup_versions: int = 5) -> None:
        self.max_answer, self.warmup_versions = max_answer, warmup_versions

    def should_submit(self, task: Task, version: int) -> bool:
        return version >= self.warmup_versions or int(task.info["answer"]) <= self.max_answer

    def update(self, task: Task, rewards: Sequence[float], version: int) -> None:
        pass  # a learning curator (GRESO, curriculum) would update its statistics here

    def state_dict(self) -> dict:
        return {}  # stateless; snapshots and resume call these


# %%
spec = RunSpec(name="extend", output_dir="runs/tutorials", env=LenientArithmetic(levels=[1], n_heldout=64),
               policies=[PolicySpec(loss=ClippedReinforce(), trainer=TrainerSpec(max_time_s=60))],
               dataflow=DataflowSpec(curators=[SmallAnswersFirst()]))
if short_mode():
    spec = smoke(spec, steps=3)
result = astratk.Run(spec).start()
ds = result.metrics()
print("skipped by our curator:", float(ds.attrs.get("counter_data_tasks_skipped_small_answers_first", 0)))
print("our loss's ratio:", ds["loss_ratio_mean"].values.ravel() if "loss_ratio_mean" in ds else "not logged")
print("tutorial done")
