"""Search env: deterministic synthetic tasks with a disjoint held-out split, BM25 finds the gold passages, episodes
mask retrieved text and count budgets, F1/EM match hand-computed values, user JSONL files are validated line by line."""

from __future__ import annotations

import asyncio
import itertools
import json
import pickle
import re

import pytest

from astratk.contracts import SamplingParams
from astratk.engines import ScriptedEngine
from astratk.envs.multiturn import Budget
from astratk.envs.search import (
    BM25Index,
    JsonlCorpus,
    SearchEnv,
    SyntheticCorpus,
    exact_match,
    f1_score,
    load_passages,
    load_qa,
    normalize_answer,
)
from astratk.envs.search.env import CORRECTION
from astratk.models import build_char_tokenizer

TOK = build_char_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")
SMALL = SyntheticCorpus(seed=3, n_people=40, n_cities=12, n_countries=4, n_companies=25, n_heldout=40)
SAMPLING = SamplingParams(max_tokens=200)


def said(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"]) + [END]


def episode(env: SearchEnv, task, script):
    engine = ScriptedEngine(TOK, script)
    [traj] = asyncio.run(env.rollout(task, {"policy": engine}, SAMPLING, policy_ids={"policy": "p"}, group_id="g"))
    return traj


def runs(mask):
    """[(value, start, length)] of consecutive equal values."""
    out, start = [], 0
    for value, group in itertools.groupby(mask):
        n = len(list(group))
        out.append((value, start, n))
        start += n
    return out


@pytest.fixture(scope="module")
def env() -> SearchEnv:
    return SearchEnv(SMALL, top_k=3, budget=Budget(max_turns=6, max_context=4096, max_env_tokens=512))


# ----------------------------------------------------------------------------------------------------------- tasks


def test_tasks_are_deterministic_per_seed(env):
    again = SearchEnv(SMALL)
    assert [t.task_id for t in env.tasks("heldout")] == [t.task_id for t in again.tasks("heldout")]
    first = [(t.task_id, t.prompt, t.info) for t in itertools.islice(env.tasks("train"), 50)]
    assert first == [(t.task_id, t.prompt, t.info) for t in itertools.islice(again.tasks("train"), 50)]
    assert SMALL.load() == SMALL.load()
    other = SyntheticCorpus(**{**SMALL.__dict__, "seed": 4}).load()
    assert other.passages != SMALL.load().passages and other.heldout != SMALL.load().heldout


def test_heldout_is_fixed_and_disjoint_from_train(env):
    corpus = env.data
    heldout = list(env.tasks("heldout"))
    assert len(heldout) == SMALL.n_heldout and all(t.split == "heldout" for t in heldout)
    held_questions = {t.prompt for t in heldout}
    n_train = len(corpus.train)
    stream = list(itertools.islice(env.tasks("train"), 2 * n_train + 5))  # more than two epochs
    assert not held_questions & {t.prompt for t in stream}
    assert {t.prompt for t in stream} == {q.question for q in corpus.train}
    assert {1, 2, 3} <= {t.info["hops"] for t in stream}  # single- and multi-hop
    with pytest.raises(ValueError, match="'train' or 'heldout'"):
        env.tasks("test")


def test_bm25_retrieves_the_gold_passage_of_every_hop(env):
    corpus = env.data
    for q in corpus.train + corpus.heldout:
        if q.hops == 1:  # the question as asked finds its passage
            assert q.gold_ids[0] in [p.id for p in env.retrieve(q.question)], q
        for query, gold in zip(q.queries, q.gold_ids):  # each hop's query, naming the bridge entity
            assert gold in [p.id for p in env.retrieve(query)], (q, query)


def test_index_ties_unknown_words_and_pickling():
    index = BM25Index(["apple pie", "apple pie", "banana split", "apple"])
    hits = index.search("apple pie recipe", k=2)
    assert [i for i, _ in hits] == [0, 1] and hits[0][1] == hits[1][1] > 0  # tie broken by position
    assert [i for i, _ in index.search("apple", k=10)] == [3, 0, 1]  # shorter passage first; no zero scores
    assert index.search("cherry", k=3) == [] and index.search("where was the", k=3) == []  # unknown / stop words
    clone = pickle.loads(pickle.dumps(index))
    assert clone._bm25 is None and clone.search("banana", 1) == index.search("banana", 1)
    assert len(pickle.dumps(index)) < 1000  # passages and parameters only, no matrix
    with pytest.raises(ValueError, match="at least one passage"):
        BM25Index([])


def test_env_pickles_as_config_and_shares_one_index_per_process(env):
    blob = pickle.dumps(env)
    assert len(blob) < 2000
    clone = pickle.loads(blob)
    assert clone._index is None and clone._data is None
    assert clone.index is env.index and clone.data is env.data  # process-wide cache, built once


# -------------------------------------------------------------------------------------------------------- episodes


def test_scripted_episode_masks_retrieved_text_and_scores(env):
    for hops in (1, 2, 3):
        task = next(t for t in env.tasks("heldout") if t.info["hops"] == hops)
        turns = env.solution_turns(task)
        traj = episode(env, task, [said(t) for t in turns])
        assert traj.metrics["searches"] == hops and traj.metrics["turns"] == hops + 1
        assert traj.metrics["answered"] == 1 and traj.metrics["turn_limit"] == 0 and traj.finished
        assert env.score(task, [traj]) == [1.0]
        completion = traj.completion
        segments = runs(traj.loss_mask)
        policy = [s for s in segments if s[0] == 1]
        retrieved = [TOK.decode(completion[s:s + n]) for v, s, n in segments if v == 0]
        assert [n for _, _, n in policy] == [len(said(t)) for t in turns]  # policy text, exactly, mask 1
        assert [TOK.decode(completion[s:s + n - 1]) for _, s, n in policy] == turns
        assert len(retrieved) == hops and all("<information>" in r for r in retrieved)
        texts = {p.id: p.text for p in env.data.passages}
        for text, gold in zip(retrieved, task.info["gold_ids"]):
            assert texts[gold] in text  # the hop's gold passage came back, masked 0
        assert all(v == -1 for v, m in zip(traj.behavior_versions, traj.loss_mask) if not m)


def test_a_policy_that_reads_the_passages():
    """A callable script answers from what the env returned (the conversation so far), not from the task."""
    env = SearchEnv(SMALL, top_k=3)

    def script(prompt_ids, params):
        text = TOK.decode(list(prompt_ids))
        question = re.search(r"Question: Where was (.+) born\?", text).group(1)
        if "<information>\n[1]" not in text:  # the instructions mention the tag; results start with [1]
            return said(f"<search>Where was {question} born?</search>")
        city = re.search(rf"{question} was born in (?:the city of )?([A-Z]\w+)\.", text).group(1)
        return said(f"<answer>{city}</answer>")

    tasks = [t for t in env.tasks("heldout") if t.info["kind"] == "born_in"]
    assert tasks
    for task in tasks:
        traj = episode(env, task, script)
        assert env.score(task, [traj]) == [1.0] and traj.metrics["searches"] == 1


def test_turn_budget_binds_and_is_counted(env):
    task = next(iter(env.tasks("heldout")))
    small = SearchEnv(SMALL, budget=Budget(max_turns=3, max_context=4096))
    traj = episode(small, task, [said("<search>anything at all</search>")])
    assert traj.metrics["turns"] == 3 and traj.metrics["searches"] == 2  # the last turn's search is not run
    assert traj.metrics["turn_limit"] == 1 and traj.metrics["answered"] == 0
    assert small.score(task, [traj]) == [0.0]
    assert runs(traj.loss_mask)[-1][0] == 1  # ends on the policy's turn, no unread env message

    traj = episode(small, task, [said("I think it is Paris"), said("<answer></answer>")])
    assert traj.metrics["invalid_actions"] == 2 and traj.metrics["searches"] == 0 and traj.metrics["turn_limit"] == 1
    zeros = [TOK.decode(traj.completion[s:s + n]) for v, s, n in runs(traj.loss_mask) if v == 0]
    assert len(zeros) == 2 and all(CORRECTION in z for z in zeros)

    cut = SearchEnv(SMALL, budget=Budget(max_turns=8, max_context=400, max_env_tokens=40))
    traj = episode(cut, task, [said("<search>" + task.prompt + "</search>")])
    assert traj.metrics["env_truncations"] >= 1 and traj.metrics["context_exhausted"] == 1
    assert traj.metrics["answered"] == 0 and not traj.finished and len(traj.tokens) <= 400


def test_max_tokens_per_turn_truncates_a_turn(env):
    task = next(iter(env.tasks("heldout")))
    short = SearchEnv(SMALL, budget=Budget(max_turns=2, max_tokens_per_turn=12, max_context=4096))
    traj = episode(short, task, [said("<answer>" + "x" * 40 + "</answer>")])
    assert traj.metrics["truncated_turns"] == 2 and traj.metrics["invalid_actions"] == 1
    assert traj.metrics["answered"] == 0 and short.score(task, [traj]) == [0.0]


# ---------------------------------------------------------------------------------------------------------- reward


def test_answer_normalisation_f1_and_em_hand_cases():
    assert normalize_answer("The  Republic of Orvania!") == "republic of orvania"
    assert exact_match("the Orvania.", ["Orvania"]) == 1.0 and exact_match("Orvania City", ["Orvania"]) == 0.0
    # pred {republic, of, orvania}, gold {orvania}: 1 shared, P = 1/3, R = 1, F1 = 2PR/(P+R) = (2/3)/(4/3) = 0.5
    assert f1_score("Republic of Orvania", ["Orvania"]) == pytest.approx(0.5)
    # an alias that matches exactly wins the max
    assert f1_score("Republic of Orvania", ["Orvania", "Republic of Orvania"]) == 1.0
    # pred {new, york, city} vs {new, york}: 2 shared, P = 2/3, R = 1, F1 = (4/3)/(5/3) = 0.8
    assert f1_score("new york city", ["New York"]) == pytest.approx(0.8)
    # bags, not sets: "a b b" vs "b b c" share b twice (articles are dropped: "a" goes), P = 2/2, R = 2/3 -> 0.8
    assert f1_score("a b b", ["b b c"]) == pytest.approx(0.8)
    assert f1_score("x y", ["b b c"]) == 0.0 and f1_score("", ["x"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0  # both normalise to nothing: their exact match (SQuAD v2)


def test_grade_reads_the_answer_tag_with_f1_or_em():
    corpus_env = SearchEnv(SMALL)
    em_env = SearchEnv(SMALL, reward="em")
    task = next(iter(corpus_env.tasks("heldout")))
    task = type(task)(task.task_id, task.env, task.prompt, {**task.info, "answers": ["Orvania"]}, task.split)
    assert corpus_env.grade(task, "<answer>Republic of Orvania</answer>") == pytest.approx(0.5)
    assert em_env.grade(task, "<answer>Republic of Orvania</answer>") == 0.0
    assert em_env.grade(task, "<answer> the orvania </answer>") == 1.0
    assert corpus_env.grade(task, "Orvania") == 0.0  # no answer tag, no reward
    assert corpus_env.grade(task, "<search>q</search> <answer>Orvania</answer>") == 1.0  # an answer ends it
    assert corpus_env.grade(task, "<answer></answer><answer>Orvania</answer>") == 1.0  # empty tags don't count
    with pytest.raises(ValueError, match=r"\['em', 'f1'\]"):
        SearchEnv(SMALL, reward="bleu")
    with pytest.raises(ValueError, match="top_k"):
        SearchEnv(SMALL, top_k=0)


def test_demonstrations_are_scripted_solutions(env):
    for task in env.tasks("heldout"):
        turns = env.solution_turns(task)
        assert len(turns) == task.info["hops"] + 1 and turns[-1] == f"<answer>{task.info['answers'][0]}</answer>"
        assert env.demonstration(task) == "\n".join(turns) and env.grade(task, env.demonstration(task)) == 1.0


def test_multi_turn_demonstrations_are_the_episode_the_env_plays(env):
    """A warm start's turns: each solution turn after the turns and passages before it, token for token the prompt
    the scripted episode gives the engine at that turn."""
    from astratk.models.chat import encode_chat

    assert env.multi_turn
    for hops in (1, 2, 3):
        task = next(t for t in env.tasks("heldout") if t.info["hops"] == hops)
        demos = env.demonstrations(task)
        assert [text for _, text in demos] == env.solution_turns(task)
        engine = ScriptedEngine(TOK, [said(t) for t in env.solution_turns(task)])
        asyncio.run(env.rollout(task, {"policy": engine}, SAMPLING, policy_ids={"policy": "p"}, group_id="g"))
        assert [list(r.prompt_ids) for r in engine.requests] == [encode_chat(TOK, m) for m, _ in demos]
        assert all("<information>" in m[-1]["content"] for m, _ in demos[1:])


# ----------------------------------------------------------------------------------------------------------- jsonl


def write(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return str(path)


def test_user_files_load_and_split(tmp_path):
    passages = write(tmp_path / "p.jsonl", [
        {"id": 1, "title": "Orvania", "text": "Orvania is a country whose capital is Tevlin."},
        "",
        {"id": "d2", "text": "Ada Marr was born in Tevlin in 1953.", "source": "extra keys are ignored"},
        {"id": "d3", "text": "Bram Kol was born in Sennu."},
    ])
    qa = write(tmp_path / "qa.jsonl", [
        {"question": "Where was Ada Marr born?", "answer": "Tevlin"},
        {"question": "In which year was Ada Marr born?", "answers": [1953, "nineteen fifty-three"]},
        {"id": "q3", "question": "What is the capital of Orvania?", "answers": ["Tevlin"]},
        {"question": "Where was Bram Kol born?", "answer": "Sennu"},
    ])
    loaded = load_passages(passages)
    assert [p.id for p in loaded] == ["1", "d2", "d3"] and loaded[0].title == "Orvania"
    questions = load_qa(qa)
    assert questions[1].answers == ("1953", "nineteen fifty-three") and questions[2].qid == "q3"
    assert questions[0].qid == "line1"

    corpus = JsonlCorpus(passages, qa, n_heldout=1, seed=0).load()
    assert len(corpus.heldout) == 1 and len(corpus.train) == 3
    assert not {q.question for q in corpus.heldout} & {q.question for q in corpus.train}
    held = write(tmp_path / "held.jsonl", [{"question": "where was ada marr  born?", "answer": "Tevlin"}])
    split = JsonlCorpus(passages, qa, heldout_qa=held).load()
    assert split.dropped == 1 and len(split.train) == 3  # the repeated question left train, counted

    env = SearchEnv(JsonlCorpus(passages, qa, heldout_qa=held), top_k=1)
    task = next(iter(env.tasks("heldout")))
    assert env.retrieve(task.prompt)[0].id == "d2"
    assert env.solution_turns(task) == [f"<search>{task.prompt}</search>", "<answer>Tevlin</answer>"]
    traj = episode(env, task, [said(t) for t in env.solution_turns(task)])
    assert env.score(task, [traj]) == [1.0] and "Orvania: " not in TOK.decode(traj.tokens)


PASSAGE_ERRORS = [
    (['{"id": "a", "text": "ok"}', '{"id": "b", "text": "ok"', ""], 2, "invalid JSON"),
    (['["id", "text"]'], 1, "expected a JSON object"),
    (['{"id": "a", "text": "ok"}', "", '{"text": "no id"}'], 3, "missing 'id'"),
    (['{"id": "a", "text": "ok"}', '{"id": "a", "text": "again"}'], 2, "duplicate id 'a' \\(first on line 1\\)"),
    (['{"id": "a", "text": "  "}'], 1, "'text' must be a non-empty string"),
    (['{"id": "a", "text": 5}'], 1, "'text' must be a non-empty string"),
    (['{"id": "a", "title": 5, "text": "ok"}'], 1, "'title' must be a string"),
    (['{"id": null, "text": "ok"}'], 1, "'id' must be a non-empty string or an integer"),
]

QA_ERRORS = [
    (['{"question": "q?", "answer": "a"}', '{"question": "q2?"}'], 2, "give exactly one of 'answer'"),
    (['{"question": "q?", "answer": "a", "answers": ["a"]}'], 1, "give exactly one of 'answer'"),
    (['{"question": "q?", "answers": []}'], 1, "'answers' must be a non-empty list"),
    (['{"question": "q?", "answers": "a"}'], 1, "'answers' must be a non-empty list"),
    (['{"question": "q?", "answers": ["a", {"b": 1}]}'], 1, "each of 'answers'"),
    (['{"question": "q?", "answer": true}'], 1, "'answer' must be"),
    (['{"answer": "a"}'], 1, "'question' must be a non-empty string, got missing"),
    (['{"id": 1, "question": "q?", "answer": "a"}', '{"id": "1", "question": "r?", "answer": "b"}'], 2,
     "duplicate id '1'"),
]


@pytest.mark.parametrize(("lines", "line", "message"), PASSAGE_ERRORS)
def test_malformed_passage_files_name_file_and_line(tmp_path, lines, line, message):
    path = write(tmp_path / "passages.jsonl", lines)
    with pytest.raises(ValueError, match=rf"passages\.jsonl:{line}: {message}"):
        load_passages(path)


@pytest.mark.parametrize(("lines", "line", "message"), QA_ERRORS)
def test_malformed_qa_files_name_file_and_line(tmp_path, lines, line, message):
    path = write(tmp_path / "qa.jsonl", lines)
    with pytest.raises(ValueError, match=rf"qa\.jsonl:{line}: {message}"):
        load_qa(path)


def test_empty_and_undecodable_files_and_errors_at_env_construction(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl: no passages"):
        load_passages(str(empty))
    with pytest.raises(ValueError, match="empty.jsonl: no questions"):
        load_qa(str(empty))
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match=r"bin\.jsonl:2: not UTF-8"):
        load_passages(str(binary))
    good = write(tmp_path / "p.jsonl", [{"id": "a", "text": "ok"}])
    bad_qa = write(tmp_path / "qa.jsonl", [{"question": "q?", "answer": "a"}, "{oops"])
    with pytest.raises(ValueError, match=r"qa\.jsonl:2: invalid JSON"):
        SearchEnv(JsonlCorpus(good, bad_qa, n_heldout=1))  # at construction, not in a worker
    one_qa = write(tmp_path / "one.jsonl", [{"question": "q?", "answer": "a"}])
    with pytest.raises(ValueError, match="leaves no train question"):
        JsonlCorpus(good, one_qa, n_heldout=1).load()


# ------------------------------------------------------------------------------------------ config and processes


def test_config_builds_the_env_and_round_trips(tmp_path):
    from astratk.config import dump_spec, load_spec

    passages = write(tmp_path / "p.jsonl", [{"id": "a", "text": "Ada Marr was born in Tevlin."}])
    qa = write(tmp_path / "qa.jsonl", [{"question": "Where was Ada Marr born?", "answer": "Tevlin"},
                                       {"question": "Who was born in Tevlin?", "answer": "Ada Marr"}])
    for corpus, kind in [({"seed": 5, "n_people": 30, "n_cities": 10, "n_countries": 3, "n_companies": 20,
                           "n_heldout": 10}, SyntheticCorpus),
                         ({"passages": passages, "qa": qa, "n_heldout": 1}, JsonlCorpus)]:
        cfg = {"env": {"class_path": "astratk.envs.search.env.SearchEnv",
                       "init_args": {"top_k": 2, "reward": "em", "corpus": corpus, "budget": {"max_turns": 32}}}}
        path = tmp_path / "run.yaml"
        path.write_text(json.dumps(cfg))
        spec = load_spec(path)
        assert isinstance(spec.env.corpus, kind) and spec.env.budget.max_turns == 32 and spec.env.reward == "em"
        dumped = dump_spec(spec)
        assert len(dumped) < 5000  # the config, not the loaded corpus
        path.write_text(dumped)
        assert load_spec(path).env.corpus == spec.env.corpus


CHILD = """
import json, pickle, sys
env = pickle.loads(sys.stdin.buffer.read())
task = next(iter(env.tasks("heldout")))
print(json.dumps([[t.task_id for t in env.tasks("heldout")], [p.id for p in env.retrieve(task.prompt)],
                  env.grade(task, env.demonstration(task)), env._index is not None]))
"""


def test_env_runs_in_a_fresh_process(env):
    """Where pickling bites: the env crosses as config and rebuilds its corpus and index in the new process (a bare
    interpreter: importing this test module there would cost ~10 s of tokenizer imports)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CHILD], input=pickle.dumps(env), capture_output=True, check=True,
                         timeout=120).stdout
    ids, hits, reward, built = json.loads(out)
    task = next(iter(env.tasks("heldout")))
    assert ids == [t.task_id for t in env.tasks("heldout")] and hits == [p.id for p in env.retrieve(task.prompt)]
    assert reward == 1.0 and built
