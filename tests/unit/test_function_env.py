"""FunctionEnv: datasets in every accepted form, TRL's reward calling convention, weights and None, held-out splits,
and a clear error for every bad input."""

from __future__ import annotations

import itertools
import json
import pickle

import cloudpickle
import pytest

from astratk.envs.function import FunctionEnv
from astratk.records import Trajectory

datasets = pytest.importorskip("datasets")

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a % 3} for a in range(10) for b in range(10)]


def exact(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    return [None if len(c) > 3 else 0.5 for c in completions]


def traj(task, text, ids=(7, 8)):
    return Trajectory(task_id=task.task_id, group_id="g", policy_id="main", role="policy", tokens=(1, 2, *ids),
                      n_prompt=2, loss_mask=(1,) * len(ids), behavior_logprobs=(0.0,) * len(ids),
                      behavior_versions=(0,) * len(ids), text=text)


def heldout_task(env):
    return next(iter(env.tasks("heldout")))


def test_a_real_dataset_trl_reward_convention_and_weights():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, level, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer, level=level,
                    state=trainer_state, extra=sorted(kwargs))
        return [0.0] * len(completions)

    env = FunctionEnv(datasets.Dataset.from_list(ROWS), [exact, short, spy], reward_weights=[1.0, 2.0, 1.0],
                      heldout=0.2)
    assert env.stats == {"rows": 100, "train": 80, "heldout": 20, "train_overlap_removed": 0}
    task = heldout_task(env)
    right = task.info["columns"]["answer"]
    scored = env.score_with_metrics(task, [traj(task, right, (5,)), traj(task, "wrong!"), traj(task, "x")])
    # exact: 1, 0, 0; short: 0.5 (len <= 3), None, 0.5 -> weighted 2x where it applies
    expected_short = 0.5 if len(right) <= 3 else None
    assert scored[0][0] == pytest.approx(1.0 + (2 * 0.5 if expected_short is not None else 0.0))
    assert scored[1][0] == 0.0 and scored[1][1] == {"reward/exact": 0.0, "reward/spy": 0.0}
    assert scored[2][0] == pytest.approx(1.0) and scored[2][1]["reward/short"] == 0.5
    # every dataset column arrives as a list, one value per completion; strings in, strings out for string prompts
    assert seen["prompts"] == [task.prompt] * 3 and seen["completions"] == [right, "wrong!", "x"]
    assert seen["ids"] == [[5], [7, 8], [7, 8]] and seen["answer"] == [right] * 3
    assert len(seen["level"]) == 3 and seen["state"] is None and seen["extra"] == []
    assert env.score(task, [traj(task, right)]) == [scored[0][0]]


def test_none_from_every_function_means_no_reward():
    env = FunctionEnv(ROWS, short, heldout=10)
    task = heldout_task(env)
    assert env.score(task, [traj(task, "long answer"), traj(task, "ok")]) == [None, 0.5]
    assert env.grade(task, "long answer") == 0.0  # evaluation counts an unscored answer as wrong


def test_chat_prompts_get_message_completions_and_keep_their_messages():
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1="}],
             "answer": str(i + 1)} for i in range(20)]
    got = {}

    def chat_reward(prompts, completions, answer, **kwargs):
        got.update(prompts=prompts, completions=completions)
        return [float(c[0]["content"] == a) for c, a in zip(completions, answer)]

    env = FunctionEnv(rows, chat_reward, heldout=4, system_prompt="ignored for chat prompts")
    task = heldout_task(env)
    assert env.messages(task) == rows[int(task.info["columns"]["answer"]) - 1]["prompt"]
    assert env.score(task, [traj(task, task.info["columns"]["answer"])]) == [1.0]
    assert got["completions"] == [[{"role": "assistant", "content": task.info["columns"]["answer"]}]]
    assert got["prompts"][0] == env.messages(task)


def test_string_prompts_get_the_system_prompt():
    env = FunctionEnv(ROWS, exact, heldout=5, system_prompt="Answer with a number.")
    task = heldout_task(env)
    assert env.messages(task) == [{"role": "system", "content": "Answer with a number."},
                                  {"role": "user", "content": task.prompt}]


def test_a_function_without_kwargs_gets_only_what_it_names():
    def strict(completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    env = FunctionEnv(ROWS, strict, heldout=5)
    task = heldout_task(env)
    assert env.score(task, [traj(task, task.info["columns"]["answer"])]) == [1.0]

    def needs_missing(completions, gold):
        return [0.0] * len(completions)

    env = FunctionEnv(ROWS, needs_missing, heldout=5)
    with pytest.raises(TypeError, match=r"needs \['gold'\].*answer"):
        env.score(task, [traj(task, "1")])


@pytest.mark.parametrize(("func", "error", "match"), [
    (lambda completions, **kw: [1.0], ValueError, "returned 1 values for 2 completions"),
    (lambda completions, **kw: ["1"] * len(completions), TypeError, "expected a float or None"),
    (lambda completions, **kw: [True] * len(completions), TypeError, "expected a float or None"),
])
def test_bad_reward_values_are_refused_with_the_function_named(func, error, match):
    env = FunctionEnv(ROWS, func, heldout=5)
    task = heldout_task(env)
    with pytest.raises(error, match=match):
        env.score(task, [traj(task, "1"), traj(task, "2")])


def test_nan_rewards_count_as_not_scored():
    env = FunctionEnv(ROWS, lambda completions, **kw: [float("nan")] * len(completions), heldout=5)
    task = heldout_task(env)
    assert env.score(task, [traj(task, "1")]) == [None]


def test_async_reward_functions():
    async def later(completions, **kwargs):
        return [0.25] * len(completions)

    env = FunctionEnv(ROWS, later, heldout=5)
    task = heldout_task(env)
    assert env.score(task, [traj(task, "1")]) == [0.25]


def test_heldout_splits_are_seeded_disjoint_and_cover_every_row():
    a = FunctionEnv(ROWS, exact, heldout=0.25, seed=3)
    b = FunctionEnv(ROWS, exact, heldout=0.25, seed=3)
    c = FunctionEnv(ROWS, exact, heldout=0.25, seed=4)
    held = [t.prompt for t in a.tasks("heldout")]
    assert held == [t.prompt for t in b.tasks("heldout")] != [t.prompt for t in c.tasks("heldout")]
    train = {t.prompt for t in itertools.islice(a.tasks("train"), 75)}
    assert len(held) == 25 and len(train) == 75 and not train & set(held)
    assert train | set(held) == {r["prompt"] for r in ROWS}
    # endless, reshuffled each epoch
    first, second = (list(itertools.islice(a.tasks("train"), 150))[i:i + 75] for i in (0, 75))
    assert {t.prompt for t in first} == {t.prompt for t in second} and first != second


def test_eval_dataset_and_dataset_dict_and_overlap():
    train, test = ROWS[:80], ROWS[80:]
    env = FunctionEnv(train + test[:5], exact, eval_dataset=test)
    assert env.stats == {"rows": 85, "train": 80, "heldout": 20, "train_overlap_removed": 5}
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)})
    env = FunctionEnv(dd, exact)
    assert env.stats["train"] == 80 and env.stats["heldout"] == 20


def test_files_and_saved_folders(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS))
    parquet = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    for source in (jsonl, str(parquet), folder):
        env = FunctionEnv(source, exact, heldout=10)
        assert env.stats["rows"] == 100, source
        task = heldout_task(env)
        assert env.grade(task, task.info["columns"]["answer"]) == 1.0


def test_reward_functions_by_dotted_path():
    env = FunctionEnv(ROWS, ["tests.unit.test_function_env.exact", "tests.unit.test_function_env:short"],
                      heldout=5)
    assert env.reward_names == ["exact", "short"]


def test_the_saved_config_is_plain_and_tells_datasets_apart(tmp_path):
    from astratk.config import to_plain
    from astratk.models.cache import model_key
    from astratk.spec import TinyModelSpec

    env = FunctionEnv(datasets.Dataset.from_list(ROWS), [exact, "tests.unit.test_function_env.short"], heldout=5)
    plain = to_plain(env)
    assert plain["class_path"] == "astratk.envs.function.FunctionEnv"
    args = plain["init_args"]
    assert args["reward_funcs"] == ["tests.unit.test_function_env.exact", "tests.unit.test_function_env.short"]
    assert args["dataset"].startswith("in-memory dataset: 100 rows, sha1 ") and args["heldout"] == 5
    json.dumps(plain)  # plain all the way down
    same = FunctionEnv(ROWS, exact, heldout=5)
    other = FunctionEnv(ROWS[:-1], exact, heldout=5)
    tiny = TinyModelSpec()
    assert model_key(tiny, same) != model_key(tiny, other)
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    assert to_plain(FunctionEnv(str(path), exact, heldout=5))["init_args"]["dataset"] == str(path)


def test_demonstrations_from_a_column_or_a_clear_error():
    env = FunctionEnv(ROWS, exact, heldout=5, demonstration_column="answer")
    task = heldout_task(env)
    assert env.demonstration(task) == task.info["columns"]["answer"]
    with pytest.raises(NotImplementedError, match="demonstration_column"):
        FunctionEnv(ROWS, exact, heldout=5).demonstration(task)


def test_the_env_travels_pickled_with_notebook_functions():
    env = FunctionEnv(datasets.Dataset.from_list(ROWS), lambda completions, **kw: [2.0] * len(completions),
                      heldout=5)
    clone = pickle.loads(cloudpickle.dumps(env))
    task = heldout_task(clone)
    assert clone.score(task, [traj(task, "1")]) == [2.0]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"dataset": [{"question": "x"}]}, ValueError, r"row 0: no 'prompt' column \(columns: \['question'\]\)"),
    ({"dataset": [{"prompt": ""}]}, ValueError, "'prompt' is empty"),
    ({"dataset": [{"prompt": [{"role": "user"}]}]}, ValueError, "list of chat messages"),
    ({"dataset": [{"prompt": 3}]}, ValueError, "non-empty string or a list of chat messages"),
    ({"dataset": ["just a string"]}, TypeError, "row 0: expected a dict"),
    ({"dataset": []}, ValueError, "no rows"),
    ({"dataset": {"a": 1}}, TypeError, "mapping"),
    ({"dataset": "/no/such/file.jsonl"}, FileNotFoundError, "no file or folder"),
    ({"reward_funcs": []}, ValueError, "at least one reward function"),
    ({"reward_funcs": [3]}, TypeError, "not callable"),
    ({"reward_weights": [1.0, 2.0]}, ValueError, "give 1 finite numbers"),
    ({"heldout": 0}, ValueError, "a fraction in"),
    ({"heldout": 100}, ValueError, "would leave none"),
    ({"heldout": 2.5}, ValueError, "whole number"),
    ({"demonstration_column": "level"}, ValueError, "must hold a string"),
    ({"eval_dataset": ROWS}, ValueError, "every train prompt is also a held-out prompt"),
])
def test_bad_input_is_refused_with_what_to_fix(kwargs, error, match):
    args = {"dataset": ROWS, "reward_funcs": exact, **kwargs}
    with pytest.raises(error, match=match):
        FunctionEnv(**args)


def test_unknown_file_type(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_text("x")
    with pytest.raises(ValueError, match=r"file type \.txt"):
        FunctionEnv(str(path), exact)


def test_module_docstring_example():
    import doctest

    import astratk.envs.function as module

    result = doctest.testmod(module)
    assert result.attempted >= 4 and result.failed == 0
