# %% [markdown]
# # 5. DRPO vs DPPO vs GRPO on the same run budget
#
# The policy loss is one config key. DRPO replaces DPPO's hard divergence mask with a smooth, advantage-weighted
# quadratic penalty on the sampled token's probability shift (arXiv 2606.09821); GRPO here is the PPO-clip
# surrogate with group advantages. Same env, model, seed and wall-clock budget for each; compare held-out gains.

# %%
import astratk
from astratk.losses.dppo import DPPO
from astratk.losses.drpo import DRPO
from astratk.losses.ppo_clip import PPOClip
from astratk.quick import short_mode, smoke, tutorial_file

losses = {"drpo": DRPO(delta=0.2), "dppo": DPPO(), "grpo": PPOClip()}
results = {}
for name, loss in losses.items():
    spec = astratk.Run.from_config(tutorial_file("quickstart.yaml"), "--output_dir", "runs/tutorials",
                                   "--name", f"loss-{name}").spec
    spec.policies[0].loss = loss
    spec.policies[0].trainer.max_time_s = 60
    if short_mode():
        spec = smoke(spec, steps=2)
    results[name] = astratk.Run(spec, printer=lambda s: None).start()

# %%
for name, r in results.items():
    s = r.summary
    print(f"{name}: {s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f} in {s['steps']} steps "
          f"({s['train_time_s']:.0f}s)")
print("tutorial done")
