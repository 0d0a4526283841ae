# %% [markdown]
# # 3. Multi-policy training: a math solver and a verifier
#
# Two policies trained together, each by its own trainer in its own process, meeting only through the data layer:
# the solver answers, the verifier accepts or rejects, and on a reject the solver retries with the verifier's
# feedback. Rewards per role: `envs/workflows/solver_verifier.py`. One config, one call:
# `tutorials/solver_verifier_two_policies.yaml`.

# %%
import astratk
import astratk.viz
from astratk.quick import short_mode, smoke, tutorial_file

run = astratk.Run.from_config(tutorial_file("solver_verifier_two_policies.yaml"), "--output_dir", "runs/tutorials")
if short_mode():
    run = astratk.Run(smoke(run.spec, steps=3))
print([(p.policy_id, p.roles) for p in run.spec.policies])
result = run.start()  # starts `astratk train fit` once per policy, attached to this run's deployment

# %% [markdown]
# Both policies' curves share one dataset and one dashboard: per-step rewards on (policy, step), and held-out
# evaluations that pair the solver's and the verifier's versions (the version barrier keeps them within one).

# %%
ds = result.metrics()
print(ds["train_reward_mean"].values)  # one row per policy
print({name: ds[name].values.tolist() for name in ds.data_vars if name.startswith("eval_accuracy_")})
ds.astra.dashboard()
print("tutorial done")
