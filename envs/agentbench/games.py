"""Live TextWorld games for the household env: open a game file (TextWorld `.z8` + `.json`, ALFWorld `.tw-pddl`),
step it, close it; the checks that keep a bad file from taking the process down; a tiny ALFWorld-style game.

A file TextWorld cannot load raises ValueError naming it. A `.z8` is checked before Jericho sees it
(`check_story_file`): Jericho's C interpreter exits the whole process on a bad story file ("Fatal error: Story file
read error"). A `.tw-pddl` needs fast_downward (`require_pddl` says how to install it); fast-downward's translator
raises SystemExit on some malformed problems, which is caught like any other loading error.

PDDL games are not thread-safe: loading one runs fast-downward's translator, which swaps sys.stdout, overwrites
sys.argv and keeps its options in module globals, and every reset and step derives text with TextWorld's module-level
TatSu parser (concurrent steps fail with "IndexError: pop from empty list"). So PDDL calls take one lock, and argv is
restored. Each TextWorld PddlEnv loads a private copy of the 33 MB planner library that is never unloaded (unloading
two copies crashes the process at exit), so idle PddlEnvs are pooled and reused: as many libraries as games open at
once, instead of one per episode (about 1 MB of resident memory each).

To support another game format, extend `_start` (return a TextWorld environment and its first state) and the
checks `scan_games` runs at construction.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

# TextWorld is not thread-safe: loading a game's .json, and every reset and step that derives text or tracks the
# game's state, goes through TextWorld's module-level TatSu parser (measured: 16 .z8 games opened at once from
# threads all failed, with "IndexError: pop from empty list", "'PlaceholderNode' object is not iterable" and
# RecursionError), and loading a PDDL game runs fast-downward's translator, which swaps sys.stdout, overwrites
# sys.argv and keeps its options in module globals. So one TextWorld call at a time per process (a call takes
# milliseconds; an episode's model turns run outside it), argv restored. Re-entrant: generating a game reads it back.
# Each TextWorld PddlEnv loads a private copy of the 33 MB planner library that is never unloaded (unloading copies
# crashes at exit), so idle PddlEnvs are kept here and reused: as many libraries as games open at once, instead of
# one per episode.
TEXTWORLD_LOCK = threading.RLock()
_PDDL_IDLE: list[Any] = []


def import_textworld() -> Any:
    try:
        import textworld
        import textworld.generator
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("HouseholdEnv needs TextWorld: pip install textworld==1.7.0") from e
    # Jericho warns that TextWorld's games are "not fully supported" (it cannot read their score); TextWorld's own
    # wrapper tracks score and win, so the warning is noise on every episode.
    warnings.filterwarnings("ignore", message=r"Game .* is not fully supported", module="jericho")
    return textworld


_BANNER_LINE = re.compile(r"[\s_|\\/$<>()\-]*")  # TextWorld's ASCII-art title: symbols only


def clean_feedback(text: str) -> str:
    """A game's text without TextWorld's title banner, its `>` prompt and status bar, and runs of blank lines."""
    lines = text.replace("\r", "").split("\n")
    while lines and _BANNER_LINE.fullmatch(lines[0]):
        lines.pop(0)
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith(">")):
        lines.pop()
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() or "(nothing happens)"


class LiveGame:
    """One running TextWorld game, for one episode: not thread-safe, not picklable; call from one thread at a time
    and `close` it. `observation` is the latest cleaned feedback (with the admissible commands if asked)."""

    def __init__(self, game_file: str | os.PathLike, *, list_commands: bool = False, walkthrough: bool = False):
        tw = import_textworld()
        # Only what is needed: the winning policy (walkthrough) is re-planned at every step when requested.
        infos = tw.EnvInfos(objective=True, won=True, lost=True, score=True, max_score=True,
                            policy_commands=walkthrough, admissible_commands=list_commands)
        self.list_commands = list_commands
        self._env, state = _start(Path(game_file), infos)
        self.objective = str(state.objective or "")
        self.walkthrough = list(state.policy_commands or []) if walkthrough else []
        self.max_score = float(state.max_score or 0)
        self._update(state, done=False)

    def _update(self, state: Any, done: bool) -> None:
        self.won, self.lost = bool(state.won), bool(state.lost)
        self.score = float(state.score or 0)
        self.done = done or self.won or self.lost
        text = clean_feedback(state.feedback or "")
        if self.list_commands and state.admissible_commands:
            text += "\n\nAvailable commands: " + ", ".join(state.admissible_commands)
        self.observation = text

    def step(self, command: str) -> str:
        with TEXTWORLD_LOCK:
            state, _, done = self._env.step(command)
        self._update(state, bool(done))
        return self.observation

    def close(self) -> None:
        env, self._env = self._env, None
        if env is None:
            return
        with TEXTWORLD_LOCK:
            if getattr(env, "downward_lib", None) is not None:  # a PddlEnv: back to the pool (see _PDDL_IDLE)
                _PDDL_IDLE.append(env)
            else:
                env.close()


def _start(path: Path, infos: Any) -> tuple[Any, Any]:
    """A started TextWorld game and its first state; a file TextWorld cannot load raises ValueError naming it."""
    if path.suffix == ".tw-pddl":
        require_pddl(path)
    else:
        check_story_file(path)
    try:
        if path.suffix == ".tw-pddl":
            return _start_pddl(path, infos)
        with TEXTWORLD_LOCK:
            env = import_textworld().start(str(path), infos)
            try:
                return env, env.reset()
            except BaseException:
                env.close()
                raise
    except (Exception, SystemExit) as e:  # SystemExit: fast-downward's translator exits on a bad PDDL problem
        where = "" if path.suffix == ".tw-pddl" else f" (and its {path.with_suffix('.json').name})"
        raise ValueError(f"{path}: TextWorld cannot load this game{where}: {type(e).__name__}: {e}") from e


def _start_pddl(path: Path, infos: Any) -> tuple[Any, Any]:
    from textworld.envs.pddl import PddlEnv

    with TEXTWORLD_LOCK:
        env = _PDDL_IDLE.pop() if _PDDL_IDLE else PddlEnv(infos)
        env.request_infos = infos
        argv = sys.argv
        try:
            env.load(str(path))
            return env, env.reset()
        except BaseException:
            _PDDL_IDLE.append(env)  # the planner library is untouched or holds a whole task: reusable
            raise
        finally:
            sys.argv = argv


def require_pddl(path: str | os.PathLike) -> None:
    """Raise the install instructions, naming `path`, when ALFWorld's format cannot be played here."""
    try:
        import fast_downward  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{path}: ALFWorld .tw-pddl games need fast_downward: pip install 'astratk[agentbench]' (or "
                          "fast-downward-textworld); it builds from source in about 2 min and needs cmake, a C++ "
                          "compiler and, on PATH, the python of the environment being installed into") from e


def check_story_file(path: str | os.PathLike) -> None:
    """Refuse a .z8 that is not a whole Z-machine version 8 story file (header byte 0 is the version; bytes 0x1A-0x1B
    the length / 8). Jericho's C interpreter exits the process on such a file, so this must run before it does."""
    path = Path(path)
    with path.open("rb") as f:
        header = f.read(64)
    if len(header) < 64 or header[0] != 8:
        raise ValueError(f"{path}: not a Z-machine version 8 story file (version byte "
                         f"{header[0] if header else 'missing'}); recompile the game to .z8")
    declared, size = int.from_bytes(header[0x1A:0x1C], "big") * 8, path.stat().st_size
    if declared > size:
        raise ValueError(f"{path}: truncated story file ({size} bytes, its header says {declared}); copy it again")


# ------------------------------------------------------------------------------------------------- example game

ALFRED_DOMAIN = """(define (domain alfred)
  (:requirements :typing :negative-preconditions)
  (:types agent location receptacle object)
  (:predicates (atLocation ?a - agent ?l - location) (receptacleAtLocation ?r - receptacle ?l - location)
               (inReceptacle ?o - object ?r - receptacle) (holds ?a - agent ?o - object) (holdsAny ?a - agent))
  (:action GotoLocation :parameters (?a - agent ?lStart - location ?lEnd - location ?r - receptacle)
    :precondition (and (atLocation ?a ?lStart) (receptacleAtLocation ?r ?lEnd))
    :effect (and (atLocation ?a ?lEnd) (not (atLocation ?a ?lStart))))
  (:action PickupObject :parameters (?a - agent ?l - location ?o - object ?r - receptacle)
    :precondition (and (atLocation ?a ?l) (receptacleAtLocation ?r ?l) (inReceptacle ?o ?r) (not (holdsAny ?a)))
    :effect (and (holds ?a ?o) (holdsAny ?a) (not (inReceptacle ?o ?r))))
  (:action PutObject :parameters (?a - agent ?l - location ?o - object ?r - receptacle)
    :precondition (and (atLocation ?a ?l) (receptacleAtLocation ?r ?l) (holds ?a ?o))
    :effect (and (inReceptacle ?o ?r) (not (holds ?a ?o)) (not (holdsAny ?a)))))"""
ALFRED_PROBLEM = """(define (problem put_mug) (:domain alfred)
  (:objects agent1 - agent mug - object table cabinet sink - receptacle locStart locTable locCabinet locSink - location)
  (:init (atLocation agent1 locStart) (receptacleAtLocation table locTable) (receptacleAtLocation cabinet locCabinet)
         (receptacleAtLocation sink locSink) (inReceptacle mug table))
  (:goal (inReceptacle mug {goal})))"""
ALFRED_GRAMMAR = '''grammar :: """{
  "intro": [{"rhs": "-= Welcome to TextWorld, ALFRED! =-\\n\\nYou see a table, a cabinet and a sink.\\n\\n#task#"}],
  "task": [{"rhs": "Your task is to: put a mug in the {goal}."}],
  "GotoLocation.feedback": [{"rhs": "You arrive at the {r.name}. On it, you see #contents#."}],
  "contents": [{"rhs": "[{o.indefinite + ' ' + o.name | inreceptacle(o:object, r:receptacle)}]"}],
  "PickupObject.feedback": [{"rhs": "You pick up the {o.name} from the {r.name}."}],
  "PutObject.feedback": [{"rhs": "You put the {o.name} in/on the {r.name}."}],
  "list_empty": [{"rhs": "nothing"}], "list_separator": [{"rhs": ", "}], "list_last_separator": [{"rhs": " and "}]
}""";
action GotoLocation { template :: "go to {r}"; feedback :: "#GotoLocation.feedback#"; }
action PickupObject { template :: "take {o} from {r}"; feedback :: "#PickupObject.feedback#"; }
action PutObject { template :: "put {o} in/on {r}"; feedback :: "#PutObject.feedback#"; }
'''


def alfworld_example(goal: str = "cabinet") -> dict[str, str]:
    """A tiny hand-made ALFWorld-style game: the JSON object of a `.tw-pddl` file (as ALFWorld's game.tw-pddl): a PDDL
    domain and problem, and TextWorld's PDDL grammar for the commands (templates) and the text (feedback rules). The
    goal: move the mug from the table into `goal` ("cabinet" or "sink"); won in 4 commands.

    Example:
        >>> Path("mug.tw-pddl").write_text(json.dumps(alfworld_example("sink")))  # doctest: +SKIP
    """
    if goal not in ("cabinet", "sink"):
        raise ValueError(f"goal must be 'cabinet' or 'sink', got {goal!r}")
    return {"pddl_domain": ALFRED_DOMAIN, "pddl_problem": ALFRED_PROBLEM.format(goal=goal),
            "grammar": ALFRED_GRAMMAR.replace("{goal}", goal)}
