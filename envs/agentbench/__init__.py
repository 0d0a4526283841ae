"""AgentBench-style envs (arXiv 2308.03688): multi-turn agent tasks with a turn limit, on `astratk.envs.multiturn`.

- `household.HouseholdEnv`: ALFWorld-like text games on TextWorld (generated offline per seed, or a user's TextWorld
  or ALFWorld games), played through `games.LiveGame`;
- `db.DatabaseEnv`: DB-Bench-like questions over real SQLite databases (generated per seed, or a user's JSONL), queried
  read-only through `sql.run_query`.

Each module imports its heavy dependency lazily, so `import astratk.envs.agentbench` needs neither TextWorld nor a
database. Add another task kind as a module here that subclasses `Env` and drives a `Conversation` (see `db.py`).
"""

from astratk.envs.agentbench.db import DatabaseEnv
from astratk.envs.agentbench.household import HouseholdEnv

__all__ = ["DatabaseEnv", "HouseholdEnv"]
