"""Where db-env tasks come from: generated databases (seeded; three tables) with questions from templates, each
with its gold SQL, or a user's JSONL file of questions over a SQLite file or a schema with rows (`db.py`'s docstring
gives the format). Add a question kind as a template function and list it in `TEMPLATES`.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from astratk.envs import jsonl
from astratk.envs.agentbench.db_answers import format_value
from astratk.envs.agentbench.sql import build_database, materialise, schema_text
from astratk.records import Task

# ------------------------------------------------------------------------------------------------- generated data

SCHEMA = """CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL, department_id INTEGER NOT NULL REFERENCES
  departments(id), title TEXT NOT NULL, salary INTEGER NOT NULL, hire_year INTEGER NOT NULL);
CREATE TABLE sales (id INTEGER PRIMARY KEY, employee_id INTEGER NOT NULL REFERENCES employees(id), product TEXT NOT
  NULL, amount INTEGER NOT NULL, year INTEGER NOT NULL);"""
DEPARTMENTS = ["Engineering", "Sales", "Marketing", "Finance", "Support", "Legal", "Research", "Operations"]
CITIES = ["Berlin", "Lagos", "Lima", "Osaka", "Oslo", "Pune", "Quito", "Seattle", "Sydney", "Toronto"]
FIRST = ["Ada", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Mo", "Nia", "Omar",
         "Pia", "Raj", "Sol", "Tess", "Uma"]
LAST = ["Abe", "Baker", "Cruz", "Diaz", "Evans", "Fox", "Gray", "Hill", "Ito", "Jones", "Khan", "Lund", "Moss", "Nair",
        "Ortiz", "Park", "Reyes", "Silva", "Tran", "Wolf"]
TITLES = ["Analyst", "Associate", "Director", "Engineer", "Manager"]
PRODUCTS = ["headset", "laptop", "monitor", "phone", "printer", "tablet"]
YEARS = range(2019, 2024)


def random_database(rng: random.Random) -> dict[str, Any]:
    """A database spec {"schema_sql", "rows"}; every department has an employee, salaries are distinct."""
    deps = rng.sample(DEPARTMENTS, rng.randint(3, 6))
    n_emp = rng.randint(max(8, len(deps)), 20)
    names = rng.sample([f"{f} {last}" for f in FIRST for last in LAST], n_emp)
    salaries = [100 * s for s in rng.sample(range(300, 1500), n_emp)]
    dept_of = list(range(1, len(deps) + 1)) + [rng.randint(1, len(deps)) for _ in range(n_emp - len(deps))]
    rng.shuffle(dept_of)
    return {"schema_sql": SCHEMA, "rows": {
        "departments": [[i + 1, d, rng.choice(CITIES)] for i, d in enumerate(deps)],
        "employees": [[i + 1, names[i], dept_of[i], rng.choice(TITLES), salaries[i], rng.choice(YEARS)]
                      for i in range(n_emp)],
        "sales": [[i + 1, rng.randint(1, n_emp), rng.choice(PRODUCTS), 10 * rng.randint(1, 100), rng.choice(YEARS)]
                  for i in range(rng.randint(15, 40))]}}


def _one(conn: sqlite3.Connection, sql: str) -> list[Any]:
    return [r[0] for r in conn.execute(sql).fetchall()]


_JOIN = "employees e JOIN departments d ON e.department_id = d.id"

# A template: (rng, conn) -> (question, gold SQL, is_list, ordered), or None when it does not apply to this database.


def _count_dept(rng, conn):
    d = rng.choice(_one(conn, "SELECT name FROM departments"))
    return (f"How many employees work in the {d} department?",
            f"SELECT COUNT(*) FROM {_JOIN} WHERE d.name = '{d}'", False, False)


def _sum_year(rng, conn):
    y = rng.choice(_one(conn, "SELECT DISTINCT year FROM sales ORDER BY year"))
    return f"What is the total amount of all sales made in {y}?", f"SELECT SUM(amount) FROM sales WHERE year = {y}", \
        False, False


def _avg_salary(rng, conn):
    d = rng.choice(_one(conn, "SELECT name FROM departments"))
    return (f"What is the average salary of the employees in the {d} department, rounded to 2 decimal places?",
            f"SELECT ROUND(AVG(e.salary), 2) FROM {_JOIN} WHERE d.name = '{d}'", False, False)


def _filter_list(rng, conn):
    d = rng.choice(_one(conn, "SELECT name FROM departments"))
    x = rng.choice(_one(conn, f"SELECT e.salary FROM {_JOIN} WHERE d.name = '{d}'")) - 100
    return (f"List the names of the employees in the {d} department who earn more than {x}, in any order.",
            f"SELECT e.name FROM {_JOIN} WHERE d.name = '{d}' AND e.salary > {x}", True, False)


def _top3(rng, conn):
    return ("List the names of the 3 employees with the highest salaries, from highest to lowest.",
            "SELECT name FROM employees ORDER BY salary DESC LIMIT 3", True, True)


def _city_of(rng, conn):
    name = rng.choice(_one(conn, "SELECT name FROM employees"))
    return (f"In which city is the department of {name} located?",
            f"SELECT d.city FROM {_JOIN} WHERE e.name = '{name}'", False, False)


def _depts_over(rng, conn):
    k = rng.randint(2, 4)
    return (f"How many departments have more than {k} employees?",
            f"SELECT COUNT(*) FROM (SELECT department_id FROM employees GROUP BY department_id HAVING COUNT(*) > {k})",
            False, False)


def _top_dept_sales(rng, conn):
    joined = "sales s JOIN employees e ON s.employee_id = e.id JOIN departments d ON e.department_id = d.id"
    sql = f"SELECT d.name FROM {joined} GROUP BY d.id ORDER BY SUM(s.amount) DESC LIMIT 1"
    totals = _one(conn, f"SELECT SUM(s.amount) AS t FROM {joined} GROUP BY d.id ORDER BY t DESC LIMIT 2")
    if len(totals) == 2 and totals[0] == totals[1]:
        return None  # a tie has no single answer
    return "Which department has the highest total sales amount?", sql, False, False


TEMPLATES = {f.__name__.lstrip("_"): f for f in (_count_dept, _sum_year, _avg_salary, _filter_list, _top3, _city_of,
                                                 _depts_over, _top_dept_sales)}


def generated_tasks(env: str, seed: int, split: str, questions_per_db: int) -> Iterator[Task]:
    """Endless: database i of the split, then up to `questions_per_db` questions on it (distinct templates)."""
    for i in itertools.count():
        db_seed = f"{seed}/{split}/{i}"
        rng = random.Random(db_seed)
        conn = sqlite3.connect(":memory:")
        try:
            build_database(conn, random_database(rng))
            schema, asked = schema_text(conn), 0
            for kind in rng.sample(sorted(TEMPLATES), len(TEMPLATES)):
                made = TEMPLATES[kind](rng, conn) if asked < questions_per_db else None
                if made is None:
                    continue
                question, sql, is_list, ordered = made
                gold = _one(conn, sql)
                if not gold or gold[0] is None:
                    continue  # an empty result is no question
                asked += 1
                info = {"db_seed": db_seed, "schema": schema, "kind": kind, "sql": sql, "is_list": is_list,
                        "ordered": ordered, "answer": [format_value(v) for v in (gold if is_list else gold[:1])]}
                digest = hashlib.sha256(f"{db_seed}\n{question}".encode()).hexdigest()[:8]
                yield Task(task_id=f"{env}/{split}/{i}-{kind}-{digest}", env=env, prompt=question,
                           info=info, split=split)  # type: ignore[arg-type]
        finally:
            conn.close()


# ---------------------------------------------------------------------------------------------------- user tasks


def load_tasks_file(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Task records (id, question, Task.info) from a JSONL file; a malformed line raises naming file and line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"tasks file {path} does not exist")
    tasks = []
    for lineno, obj in jsonl.records(path):
        try:
            tasks.append(_user_task(obj, path, lineno, cache_dir))
        except (ValueError, TypeError, KeyError, sqlite3.Error) as e:
            raise ValueError(f"{path}:{lineno}: {e}") from e
    if not tasks:
        raise ValueError(f"tasks file {path} holds no tasks")
    return tasks


def _user_task(obj: dict[str, Any], path: Path, lineno: int, cache_dir: str | os.PathLike | None) -> dict[str, Any]:
    if not isinstance(obj.get("question"), str) or not obj["question"].strip():
        raise ValueError('missing "question" (a non-empty string)')
    answer = obj.get("answer")
    is_list = isinstance(answer, list)
    values = answer if is_list else [answer]
    if not values or any(v is None or isinstance(v, (dict, list)) for v in values):
        raise ValueError('"answer" must be a value or a non-empty list of values')
    if ("db_path" in obj) == ("schema_sql" in obj):
        raise ValueError('give exactly one of "db_path" or "schema_sql" (+ "rows")')
    if not isinstance(obj.get("ordered", False), bool) or not isinstance(obj.get("sql", ""), str):
        raise ValueError('"ordered" must be true/false and "sql" a string')  # noqa: TRY004 - malformed data
    info: dict[str, Any] = {"answer": [format_value(v) for v in values], "is_list": is_list,
                            "ordered": obj.get("ordered", False), "kind": "user", "sql": obj.get("sql", "")}
    if "db_path" in obj:
        db = (path.parent / obj["db_path"]).resolve()
        if not db.is_file():
            raise ValueError(f"db_path {db} does not exist")
        info["db_path"] = str(db)
    else:
        rows = obj.get("rows", {})
        if not isinstance(obj["schema_sql"], str) or not isinstance(rows, dict) or not all(
                isinstance(r, list) and all(isinstance(x, list) for x in r) for r in rows.values()):
            raise ValueError('"schema_sql" must be a string and "rows" an object of table -> list of row lists')
        info["db_spec"] = {"schema_sql": obj["schema_sql"], "rows": rows}
        db = materialise(info["db_spec"], cache_dir)
    conn = sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)
    try:
        info["schema"] = schema_text(conn)
    finally:
        conn.close()
    task_id = str(obj.get("id") or f"{path.stem}:{lineno}")
    return {"id": task_id, "question": obj["question"].strip(), "info": info}

