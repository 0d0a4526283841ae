"""Math envs: word problems and JSONL tasks are deterministic with disjoint held-out splits, single-turn rollouts
have the right masks, `MathGrader` agrees with hand-written cases from any thread and inside a real Dask worker
process, a hanging verify is cut off and counted, and malformed JSONL files are rejected with file and line."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest

from astratk.contracts import SamplingParams
from astratk.engines import ScriptedEngine
from astratk.envs.math import MathGrader, MathJsonlEnv, WordProblemEnv, final_answer, load_math_jsonl
from astratk.envs.math.grading import is_simple
from astratk.models import build_char_tokenizer
from astratk.models.chat import encode_chat
from astratk.records import Task

TOK = build_char_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")


@pytest.fixture(scope="module")
def grader():
    g = MathGrader(timeout_s=10.0)
    yield g
    g.close()


def said(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"]) + [END]


def rollout(env, task: Task, text: str):
    engine = ScriptedEngine(TOK, [said(text)])
    return asyncio.run(env.rollout(task, {"policy": engine}, SamplingParams(max_tokens=32),
                                   policy_ids={"policy": "main"}, group_id="g0"))


# ------------------------------------------------------------------------------------------- grading: cases
# (gold, completion text, expected reward): the extraction rule (last \boxed, else after ####, else last number),
# then math-verify's equality.
CASES = [
    ("42", "42", 1.0),
    ("42", "I think 41, no: 42", 1.0),  # the last number counts
    ("42", "\\boxed{42} was wrong, 43", 1.0),  # a box beats any later number
    ("42", "\\boxed{41} then \\boxed{42}", 1.0),  # the last box counts
    ("42", "\\boxed{42} then \\boxed{4", 1.0),  # an unclosed (truncated) box is passed over
    ("1/2", "\\boxed{\\frac{1}{2}}", 1.0),
    ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
    ("\\frac{1}{2}", "so it is 1/2", 1.0),
    ("\\frac{1}{2}", "0.5", 1.0),
    ("\\frac{3}{4}", "\\boxed{\\dfrac{3}{4}}", 1.0),
    ("1000", "1,000", 1.0),
    ("1,000", "The total is $1000.", 1.0),
    ("1234567", "#### 1,234,567", 1.0),
    ("-7", "x = -7", 1.0),
    ("3", "5-3", 1.0),  # '5-3' ends in the number 3, so this is right ...
    ("2", "5-3", 0.0),  # ... and the expression is not evaluated
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt3}{2}}", 1.0),  # LaTeX
    ("(x+1)^2", "\\boxed{x^2+2x+1}", 1.0),  # symbolic
    ("\\{1,2\\}", "\\boxed{\\{2, 1\\}}", 1.0),  # sets, nested braces
    ("7", "8", 0.0),
    ("7", "\\boxed{8}", 0.0),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
    ("7", "no idea", 0.0),  # no answer at all
    ("7", "", 0.0),
    ("7", "\\boxed{}", 0.0),  # an empty box is no answer
    ("7", "\\boxed{7} then \\boxed{}", 0.0),  # ... even after a right one: the last box counts
    ("7", "%$#@!", 0.0),
]


@pytest.mark.parametrize("gold,text,expected", CASES)
def test_grader_agrees_with_hand_written_cases(grader, gold, text, expected):
    assert grader.grade(gold, text) == expected


def test_final_answer_rule():
    assert final_answer("a \\boxed{\\frac{a}{b^{2}}} b") == "\\frac{a}{b^{2}}"
    assert final_answer("work\n#### 1,000\nthanks") == "1,000"
    assert final_answer("costs $1,234.50.") == "1,234.50"
    assert final_answer("the answer is \\frac{2}{3}.") == "\\frac{2}{3}"
    assert final_answer("x2 and y") is None  # digits glued to a word are not a number
    assert is_simple("1,000") and is_simple("-3.5") and is_simple("\\frac{1}{2}") and is_simple("7/8")
    assert not is_simple("9^{9^{9^{9}}}") and not is_simple("1" * 41) and not is_simple("x")


def test_grader_validates_its_settings():
    with pytest.raises(ValueError, match="timeout_s and start_timeout_s must be > 0"):
        MathGrader(timeout_s=0)


def test_fast_path_and_child_path_agree():
    # Numeric cases take the in-thread fast path by default; forcing every case through the child must not change
    # a single reward.
    slow = MathGrader(timeout_s=10.0, fast_path=False)
    try:
        rewards = [slow.grade(g, t) for g, t, _ in CASES]
        assert rewards == [e for _, _, e in CASES]
        counts = slow.counts
        assert counts["fast_path"] == 0 and counts["child"] == counts["graded"] - counts["no_answer"] > 0
    finally:
        slow.close()


def test_exact_match_fallback_when_math_verify_cannot_parse(grader):
    before = grader.counts["exact_fallback"]
    assert grader.grade("@#", "\\boxed{ @# }") == 1.0  # math-verify finds no expression in '@#'
    assert grader.grade_outcome("@#", "\\boxed{@!}") == (0.0, "exact_fallback")
    assert grader.counts["exact_fallback"] == before + 2


def test_grading_from_non_main_threads_concurrently(grader):
    # math-verify's own SIGALRM timeout raises ValueError outside the main thread; the grader must not, and four
    # threads sharing one grader (fast path and child) must each get every reward right.
    results: list[list[float]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def work(out: list[float]):
        try:
            out.extend(grader.grade(g, t) for g, t, _ in CASES)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(out,)) for out in results]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads) and not errors
    assert results == [[e for _, _, e in CASES]] * 4


def test_grader_pickles_without_its_child(grader):
    grader.grade("x^2", "\\boxed{x^2}")  # starts the child
    clone = pickle.loads(pickle.dumps(grader))
    assert clone.timeout_s == grader.timeout_s and clone._child is None and clone.counts["graded"] == 0
    assert clone.grade("x^2", "\\boxed{x \\cdot x}") == 1.0
    clone.close()


@pytest.mark.timeout(120)
def test_grading_inside_a_dask_worker_process():
    """A Dask worker is a daemonic process (multiprocessing refuses it children) and runs tasks in threads (no
    SIGALRM): the real thing, one worker, one thread."""
    distributed = pytest.importorskip("distributed")
    cases = CASES

    def grade_in_worker(grader: MathGrader) -> tuple[list[float], dict[str, int], bool]:
        # Nested, so Dask ships it by value: the worker need not import this module (and transformers with it).
        rewards = [grader.grade(g, t) for g, t, _ in cases]
        in_main = threading.current_thread() is threading.main_thread()
        grader.close()
        return rewards, dict(grader.counts), in_main

    with (distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                                   dashboard_address="127.0.0.1:0") as cluster,
          distributed.Client(cluster) as client):
        fut = client.submit(grade_in_worker, MathGrader(timeout_s=10.0), pure=False)
        rewards, counts, in_main = fut.result(timeout=90)
    assert rewards == [e for _, _, e in CASES]
    assert not in_main and counts["child"] > 0 and counts["fast_path"] > 0 and counts["timeouts"] == 0


# ------------------------------------------------------------------------------------------ grading: timeouts
class SlowGrader(MathGrader):
    _child_delay_s = 30.0  # every child comparison sleeps: a verify that hangs


def test_a_hanging_verify_times_out_falls_back_to_exact_match_and_is_counted():
    g = SlowGrader(timeout_s=0.5)
    try:
        assert g.grade("42", "42") == 1.0  # plain numbers never reach the child
        start = time.monotonic()
        assert g.grade("x^2", "\\boxed{x+1}") == 0.0  # math-verify never answered; the strings differ
        assert time.monotonic() - start < 10  # cut off, not waited out (generous: includes the child's start)
        assert g.counts["timeouts"] == 1 and g._child is None  # killed; the next call starts a new one
        # the same string as the gold scores 1 by the exact-match fallback, even though math-verify timed out
        assert g.grade_outcome("x^2", "\\boxed{ x^2 }") == (1.0, "timeout")
        assert g.counts["timeouts"] == 2 and g.counts["child_starts"] == 2
    finally:
        g.close()


def test_a_real_pathological_answer_times_out():
    # sympy tries to evaluate the power tower: minutes without a bound. Short, so a length cap would not catch it.
    g = MathGrader(timeout_s=1.0)
    try:
        assert g.grade("1", "\\boxed{9^{9^{9^{9}}}}") == 0.0
        assert g.counts["timeouts"] == 1
        assert g.grade("x+1", "\\boxed{1+x}") == 1.0  # a fresh child carries on
    finally:
        g.close()


def test_a_dead_child_is_replaced(grader):
    grader.start()
    grader._child.proc.kill()
    grader._child.proc.wait()
    assert grader.grade("x^2", "\\boxed{x^2}") == 1.0


def test_the_child_exits_when_its_parent_dies():
    code = ("import os, sys; from astratk.envs.math.grading import MathGrader; g = MathGrader(); g.start(); "
            "print(g._child.proc.pid, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------------------------------ word problems
def test_word_tasks_are_deterministic_per_seed_and_heldout_is_disjoint():
    env = WordProblemEnv(levels=[1, 2, 3, 4, 5], n_heldout=200, seed=3)
    again = WordProblemEnv(levels=[1, 2, 3, 4, 5], n_heldout=200, seed=3)
    other = WordProblemEnv(levels=[1, 2, 3, 4, 5], n_heldout=200, seed=4)
    train = list(itertools.islice(env.tasks("train"), 2000))
    assert train == list(itertools.islice(again.tasks("train"), 2000))
    assert list(env.tasks("heldout")) == list(again.tasks("heldout"))
    assert [t.prompt for t in train[:50]] != [t.prompt for t in itertools.islice(other.tasks("train"), 50)]
    heldout = {t.prompt for t in env.tasks("heldout")}
    assert len(heldout) == 200 and not heldout & {t.prompt for t in train}
    assert {t.info["level"] for t in train} == {1, 2, 3, 4, 5}
    assert len({t.info["template"] for t in train}) == 18  # every template appears
    assert all(t.split == "train" for t in train) and all(t.split == "heldout" for t in env.tasks("heldout"))


def test_word_answers_are_whole_numbers_and_prompts_fit_the_tiny_model():
    env = WordProblemEnv(levels=[1, 2, 3, 4, 5], n_heldout=8, seed=0)
    tasks = list(itertools.islice(env.tasks("train"), 3000))
    assert all(t.info["answer"].isdigit() for t in tasks)
    longest = max(len(encode_chat(TOK, env.messages(t))) for t in tasks)
    assert longest + 8 <= 256  # the tiny model's positions, with room for an 8-token answer


def test_word_rollout_masks_lengths_and_reward():
    env = WordProblemEnv(levels=[2], n_heldout=4, seed=1)
    task = next(iter(env.tasks("heldout")))
    [traj] = rollout(env, task, env.demonstration(task))
    prompt = encode_chat(TOK, env.messages(task))
    n = len(said(env.demonstration(task)))
    assert traj.tokens[:traj.n_prompt] == tuple(prompt) and traj.n_prompt == len(prompt)
    assert len(traj.tokens) == len(prompt) + n and traj.loss_mask == (1,) * n
    assert len(traj.behavior_logprobs) == len(traj.behavior_versions) == n
    assert traj.finished and traj.text == task.info["answer"] and traj.role == "policy" and traj.policy_id == "main"
    [wrong] = rollout(env, task, str(int(task.info["answer"]) + 1))
    [silent] = rollout(env, task, "hmm")
    assert env.score(task, [traj, wrong, silent]) == [1.0, 0.0, 0.0]
    scored = env.score_with_metrics(task, [traj, silent])  # how grading ended reaches the run's metrics
    assert scored[0] == (1.0, {"math/exact_fallback": 0.0, "math/no_answer": 0.0, "math/timeout": 0.0,
                               "math/child_error": 0.0})
    assert scored[1][0] == 0.0 and scored[1][1]["math/no_answer"] == 1.0


def test_word_env_validates_and_pickles():
    with pytest.raises(ValueError, match="levels must be a non-empty subset"):
        WordProblemEnv(levels=[9])
    env = WordProblemEnv(levels=[1], n_heldout=4, seed=0)
    clone = pickle.loads(pickle.dumps(env))
    assert list(clone.tasks("heldout")) == list(env.tasks("heldout"))


# ------------------------------------------------------------------------------------------ JSONL
GSM8K = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
         {"question": "A pen costs $1,000. Two pens?", "answer": "2 * 1000 = 2000\n#### 2,000"}]
MATH = [{"problem": "Simplify $\\frac{2}{4}$.", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
        {"problem": "Find $x^{-2}$ at $x=b$.", "solution": "So $\\boxed{\\frac{1}{b^{2}}}$."}]


def write(tmp_path, name: str, rows, raw: str | None = None) -> str:
    path = tmp_path / name
    path.write_text(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_load_formats_auto_detected(tmp_path):
    gsm = load_math_jsonl(write(tmp_path, "g.jsonl", GSM8K))
    assert [(x.answer, x.line) for x in gsm] == [("7", 1), ("2,000", 2)]
    math = load_math_jsonl(write(tmp_path, "m.jsonl", MATH))
    assert [x.answer for x in math] == ["\\frac{1}{2}", "\\frac{1}{b^{2}}"]  # nested braces kept
    generic = load_math_jsonl(write(tmp_path, "p.jsonl", None, raw='{"prompt": "1+1?", "answer": 2}\n\n'
                                                                    '{"prompt": "2+2?", "answer": "4"}\n'))
    assert [(x.prompt, x.answer, x.line) for x in generic] == [("1+1?", "2", 1), ("2+2?", "4", 3)]  # blank line ok
    with_answer_key = [{"problem": "p", "solution": "no box here", "answer": "5"}]  # MATH-500 style
    assert load_math_jsonl(write(tmp_path, "a.jsonl", with_answer_key), "math")[0].answer == "5"


@pytest.mark.parametrize("raw,fmt,message", [
    ('{"question": "q", "answer": "#### 1"}\n{"question": "q2", "answer": "#### 2"\n', "auto", r":2: invalid JSON"),
    ('{"question": "q", "answer": "#### 1"}\n[1, 2]\n', "auto", r":2: expected a JSON object, got list"),
    ('{"question": "q", "answer": "#### 1"}\n{"question": "q2"}\n', "auto", r":2: missing key 'answer'"),
    ('{"question": "q", "answer": "#### 1"}\n\n{"question": "q3", "answer": "3"}\n', "auto",
     r":3: no extractable answer: 'answer' has no '#### <final answer>'"),
    ('{"question": "q", "answer": "1 ####   "}\n', "gsm8k", r":1: no extractable answer: nothing after '####'"),
    ('{"problem": "p", "solution": "it is \\\\boxed{1"}\n', "auto", r":1: no extractable answer: 'solution' has no"),
    ('{"problem": "p", "solution": 3}\n', "math", r":1: 'solution' must be a string, got int"),
    ('{"prompt": "", "answer": "1"}\n', "generic", r":1: 'prompt' is empty"),
    ('{"text": "hi"}\n', "auto", r":1: cannot tell the format from keys \['text'\]"),
    ('', "auto", r"no rows"),
])
def test_malformed_files_are_rejected_with_file_and_line(tmp_path, raw, fmt, message):
    path = write(tmp_path, "bad.jsonl", None, raw=raw)
    with pytest.raises(ValueError, match="bad.jsonl" + message if message != "no rows" else "bad.jsonl: no rows"):
        load_math_jsonl(path, fmt)


def test_undecodable_bytes_are_named_with_their_line(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "#### 1"}\n\n{"question": "caf\xe9", "answer": "#### 2"}\n')
    with pytest.raises(ValueError, match=r"bytes.jsonl:3: not UTF-8 text"):
        load_math_jsonl(str(path))
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1?", "answer": 2}\n')  # a byte-order mark is fine
    assert load_math_jsonl(str(path))[0].answer == "2"


def test_unknown_format_lists_choices(tmp_path):
    with pytest.raises(ValueError, match=r"choose 'auto' or one of \['generic', 'gsm8k', 'math'\]"):
        load_math_jsonl(write(tmp_path, "g.jsonl", GSM8K), "csv")


def test_jsonl_env_splits_prompt_rollout_and_grading(tmp_path):
    train = write(tmp_path, "train.jsonl", GSM8K + [{"question": "Extra?", "answer": "#### 5"}])
    heldout = write(tmp_path, "test.jsonl", GSM8K[:1])  # overlaps train's first row
    with pytest.warns(UserWarning, match="1 problems of .*train.jsonl are also in"):
        env = MathJsonlEnv(train, heldout, seed=1)
    assert env.stats == {"train": 2, "heldout": 1, "train_overlap_removed": 1}
    stream = list(itertools.islice(env.tasks("train"), 6))
    assert {t.prompt for t in stream} == {GSM8K[1]["question"], "Extra?"}  # endless, without the held-out row
    with pytest.warns(UserWarning):
        again = MathJsonlEnv(train, heldout, seed=1)
    assert stream == list(itertools.islice(again.tasks("train"), 6))  # deterministic per seed
    [task] = env.tasks("heldout")
    assert env.messages(task)[-1]["content"].endswith("put your final answer within \\boxed{}.")
    [traj] = rollout(env, task, "3 + 4 = 7, so \\boxed{7}")
    assert traj.n_prompt == len(encode_chat(TOK, env.messages(task))) and traj.finished
    assert env.score(task, [traj]) == [1.0]
    assert env.grade(task, env.demonstration(task)) == 1.0 and env.grade(task, "\\boxed{8}") == 0.0


def test_jsonl_env_math_format_grades_latex(tmp_path):
    env = MathJsonlEnv(write(tmp_path, "t.jsonl", MATH[1:]), write(tmp_path, "m.jsonl", MATH[:1]), format="math",
                       instruction=None)
    task = next(iter(env.tasks("heldout")))
    assert env.messages(task) == [{"role": "user", "content": MATH[0]["problem"]}]
    assert env.grade(task, "Halving gives \\boxed{0.5}") == 1.0


def test_no_stray_children_after_close():
    g = MathGrader()
    g.start()
    pid = g._child.proc.pid
    g.close()
    assert not _alive(pid) and os.getpid() != pid
