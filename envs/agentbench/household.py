"""ALFWorld-like household tasks (AgentBench's ALFWorld kind) on TextWorld text games, multi-turn with a turn limit.

Games
-----
Generated (the default): the seed draws `n_heldout` held-out and `n_train` train game recipes for TextWorld's
generator (`nb_rooms`, `nb_objects`, `quest_length`). A game is identified by TextWorld's uuid, which encodes every
generator seed, and the train pool never holds a held-out uuid. Each game is generated and compiled once into
`<cache>/textworld/game-<key>/` (key: sha256 of the recipe, `GAME_KIT` and TextWorld's version; the cache is
`cache_dir`, else $ASTRATK_CACHE, else ~/.cache/astratk). The build happens in a temporary sibling directory that is
renamed into place when complete (`meta.json`, written last, marks it), so a killed build leaves no half game and
processes racing on one key all end with one whole game. The same recipe gives byte-identical files in any process;
a game takes about 1 s (2 s for the first in a process, which loads TextWorld's knowledge base).

A user's games: `games_dir` plays every `*.z8` (with the TextWorld `.json` beside it, which says when the game is won)
and `*.tw-pddl` (ALFWorld's format: a JSON object holding `pddl_domain`, `pddl_problem` and the TextWorld `grammar`;
`games.alfworld_example` is a tiny one) under the directory. `n_heldout` of them, drawn with the seed, are held out, or all of `heldout_dir`'s when it is
given. TextWorld 1.7 dropped Glulx, so `.ulx` games are refused with the fix in the message. `.tw-pddl` games need
fast_downward (the `agentbench` extra installs it: a source build of about 2 min that needs cmake and a C++
compiler); without it the env refuses them at construction, naming a file and the install. A PDDL game has no score
(`max_score` 0, so `reward="score"` rewards the win) and its goal is in the opening text (no separate objective).

A `.z8` whose header is not a complete version-8 story file is refused at construction: Jericho's C interpreter
would exit the whole process on it ("Fatal error: Story file read error"). Any other file TextWorld cannot load
(a `.json` that is not the game's, a malformed `.tw-pddl`) raises ValueError naming the file when the game is first
opened (when the task iterator reaches it).

Episode
-------
The first user message holds the instructions, the goal and the opening observation. Each assistant turn issues one
command: the content of the first `<action>...</action>` tag or, when the reply has no tag, its first non-empty
line (`require_tag=True` refuses untagged replies instead). A reply without a command, or with a meta command
(quit, restart, save, ...), is answered with a hint and still uses its turn. The game's feedback comes back as the
next user message (loss mask 0). The episode ends when the game is won or lost, or after `max_turns` assistant turns
(AstraFlow runs ALFWorld with 15); nothing is appended after the last turn.

Reward
------
`reward="won"`: 1.0 if the quest was completed, else 0.0. `reward="score"`: the game's score / its max score (partial
credit for finished sub-goals). A live TextWorld game is C-library state that can neither be pickled nor shared
between threads, so it exists only inside `rollout` (opened, stepped and closed in worker threads, one per episode)
and never on a `Trajectory`. `score` therefore reads what the rollout recorded in `Trajectory.metrics` (`won`,
`score`, `max_score`); a trajectory without them scores None. Use the same pattern for any env whose outcome lives in
simulator state: record the outcome in metrics during rollout, and have `score` read it.

Metrics: `tool_calls` counts the commands the game executed (the same as `game_steps`, the last one included although
its feedback is never appended); refused and missing commands are `refused_commands` and `no_action_turns`.

Example:
    >>> env = HouseholdEnv(n_train=8, n_heldout=2, seed=0)  # doctest: +SKIP
    >>> task = next(iter(env.tasks("heldout")))  # doctest: +SKIP
    >>> task.info["walkthrough"]  # doctest: +SKIP
    ['take spork', 'insert spork into cabinet']
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astratk.contracts import Engine, Env, SamplingParams
from astratk.envs.agentbench.games import (
    TEXTWORLD_LOCK,
    LiveGame,
    check_story_file,
    import_textworld,
    require_pddl,
)
from astratk.envs.multiturn import Budget, Conversation, parse_tags
from astratk.records import Task, Trajectory

GAME_KIT = 1  # bump when the recipe -> game mapping or the stored metadata changes
META = "meta.json"  # written last: its presence means a game directory is complete
GAME_FILE = "game.z8"
META_COMMANDS = frozenset({"quit", "q", "restart", "restore", "save", "undo", "script", "unscript"})
MAX_COMMAND_CHARS = 200
INSTRUCTIONS = ("You are in a text-based household game. Reach the goal by typing commands such as 'look', "
                "'inventory', 'go north', 'open fridge', 'take apple from table' or 'put apple in fridge'. Reply with "
                "exactly one command per turn inside <action>...</action>. You have {max_turns} turns.")
FORMAT_HINT = "No command found. Reply with one command inside <action>...</action>, e.g. <action>look</action>."

def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else $ASTRATK_CACHE, else ~/.cache/astratk (as `astratk.models.cache`, without importing it)."""
    return Path(cache_dir or os.environ.get("ASTRATK_CACHE") or "~/.cache/astratk").expanduser()


# ----------------------------------------------------------------------------------------------------- game cache


@dataclass(frozen=True)
class GameRecipe:
    """What TextWorld's generator needs to make one game; the same recipe always makes the same game."""

    seed: int
    nb_rooms: int
    nb_objects: int
    quest_length: int

    def options(self, path: Path | None = None) -> Any:
        opts = import_textworld().GameOptions()
        opts.seeds = self.seed
        opts.nb_rooms, opts.nb_objects, opts.quest_length = self.nb_rooms, self.nb_objects, self.quest_length
        if path is not None:
            opts.path, opts.force_recompile = str(path), True
        return opts

    @property
    def uuid(self) -> str:
        """TextWorld's game id (encodes the size options and every generator seed); no generation needed."""
        return self.options().uuid


def game_key(recipe: GameRecipe) -> str:
    """16 hex characters of sha256 over what determines the game files."""
    content = {"kit": GAME_KIT, "textworld": import_textworld().__version__, "recipe": dataclasses.asdict(recipe)}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def ensure_game(recipe: GameRecipe, cache_dir: str | os.PathLike | None = None) -> Path:
    """The game file for `recipe`, generating and compiling it into the cache if needed (safe across processes)."""
    final = cache_root(cache_dir) / "textworld" / f"game-{game_key(recipe)}"
    if (final / META).is_file():
        return final / GAME_FILE
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _generate(recipe, tmp)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return final / GAME_FILE


def _generate(recipe: GameRecipe, out: Path) -> None:
    tw = import_textworld()
    opts = recipe.options(out / GAME_FILE)
    with TEXTWORLD_LOCK:  # the generator's module state and parser are shared with the games being played
        game = tw.generator.make_game(opts)
        tw.generator.compile_game(game, opts)
    (out / GAME_FILE).with_suffix(".ni").unlink(missing_ok=True)  # the Inform 7 source: not needed to play
    meta = {"recipe": dataclasses.asdict(recipe), "uuid": opts.uuid, **read_meta(out / GAME_FILE)}
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")  # last: marks completeness
    out.chmod(0o755)  # mkdtemp made it private; the cache may be shared


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished build into place; if another process finished first, keep theirs."""
    if final.exists() and not (final / META).is_file():
        shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover (a complete one is only ever renamed in)
    try:
        os.replace(tmp, final)
    except OSError:  # a non-empty `final` appeared meanwhile: another process won the race
        if not (final / META).is_file():
            raise


def read_meta(game_file: str | os.PathLike) -> dict[str, Any]:
    """Objective, walkthrough, max score and opening observation of a game, by playing its first state."""
    game = LiveGame(game_file, walkthrough=True)
    try:
        return {"objective": game.objective, "walkthrough": game.walkthrough, "max_score": game.max_score,
                "intro": game.observation}
    finally:
        game.close()


def parse_action(text: str, require_tag: bool = False) -> str | None:
    """The command in a reply: the first `<action>` tag's content, else (unless `require_tag`) the first non-empty
    line; whitespace collapsed, at most MAX_COMMAND_CHARS. None when there is none."""
    tags = parse_tags(text, ["action"])
    if tags:
        raw = tags[0][1]
    elif require_tag:
        return None
    else:
        raw = next((line for line in text.splitlines() if line.strip()), "")
        raw = re.sub(r"^\s*(<action>|>)\s*", "", raw)  # an unclosed tag (cut-off reply) or a prompt sign
    command = " ".join(raw.split())[:MAX_COMMAND_CHARS]
    return command or None


# ------------------------------------------------------------------------------------------------------------ env


class HouseholdEnv(Env):
    """ALFWorld-like text games: one role, `policy`, plays one command per turn until the quest is won or the turns
    run out. See the module docstring for games, the action format and the reward."""

    name = "household"
    roles = ("policy",)
    multi_turn = True  # a warm start's held-out check replays every demonstrated turn (`demonstrations`)

    def __init__(self, n_train: int = 64, n_heldout: int = 16, seed: int = 1234, nb_rooms: int = 3,
                 nb_objects: int = 6, quest_length: int = 3, games_dir: str | None = None,
                 heldout_dir: str | None = None, max_turns: int = 15, max_tokens_per_turn: int | None = None,
                 max_context: int = 4096, max_env_tokens: int = 256, reward: str = "won", require_tag: bool = False,
                 list_commands: bool = False, cache_dir: str | None = None, system_prompt: str | None = None) -> None:
        if reward not in ("won", "score"):
            raise ValueError(f"reward must be 'won' or 'score', got {reward!r}")
        if n_train < 1 or n_heldout < 1:
            raise ValueError(f"n_train and n_heldout must be >= 1, got {n_train} and {n_heldout}")
        if min(nb_rooms, nb_objects, quest_length) < 1:
            raise ValueError(f"nb_rooms, nb_objects and quest_length must be >= 1, got {nb_rooms}, {nb_objects}, "
                             f"{quest_length}")
        if heldout_dir is not None and games_dir is None:
            raise ValueError("heldout_dir needs games_dir (the train games); give both, or neither to generate games")
        self.n_train, self.n_heldout, self.seed = n_train, n_heldout, seed
        self.nb_rooms, self.nb_objects, self.quest_length = nb_rooms, nb_objects, quest_length
        self.games_dir, self.heldout_dir = games_dir, heldout_dir
        self.max_turns, self.max_tokens_per_turn = max_turns, max_tokens_per_turn
        self.max_context, self.max_env_tokens = max_context, max_env_tokens
        self.reward, self.require_tag, self.list_commands = reward, require_tag, list_commands
        self.cache_dir, self.system_prompt = cache_dir, system_prompt
        self._budget = Budget(max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn, max_context=max_context,
                              max_env_tokens=max_env_tokens)
        self._user_meta: dict[str, dict[str, Any]] = {}
        if games_dir is None:
            self._heldout, self._train = self._draw_recipes()
        else:
            self._heldout, self._train = self._split_user_games()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_user_meta"] = {}  # a memo of opening texts: rebuilt where needed
        return state

    # --------------------------------------------------------------------------------------------------- tasks
    def _draw_recipes(self) -> tuple[list[GameRecipe], list[GameRecipe]]:
        def draw(split: str, n: int, exclude: set[str]) -> list[GameRecipe]:
            rng, out, seen = random.Random(f"{self.seed}/{split}"), [], set(exclude)
            while len(out) < n:
                r = GameRecipe(rng.randrange(1, 2**31 - 1), self.nb_rooms, self.nb_objects, self.quest_length)
                if r.uuid not in seen:
                    seen.add(r.uuid)
                    out.append(r)
            return out

        heldout = draw("heldout", self.n_heldout, set())
        return heldout, draw("train", self.n_train, {r.uuid for r in heldout})

    def _split_user_games(self) -> tuple[list[Path], list[Path]]:
        games = scan_games(self.games_dir)  # type: ignore[arg-type]
        if self.heldout_dir is not None:
            heldout = scan_games(self.heldout_dir)
            train = [g for g in games if g not in set(heldout)]
            if not train:
                raise ValueError(f"every game in games_dir {self.games_dir} is also in heldout_dir {self.heldout_dir}")
            return heldout, train
        if self.n_heldout >= len(games):
            raise ValueError(f"games_dir {self.games_dir} has {len(games)} games and n_heldout={self.n_heldout} "
                             "leaves none to train on; lower n_heldout or give heldout_dir")
        order = games[:]
        random.Random(f"{self.seed}/split").shuffle(order)
        return sorted(order[: self.n_heldout]), sorted(order[self.n_heldout:])

    def tasks(self, split: str) -> Iterator[Task]:
        """Games are generated lazily, as the iterator reaches them (about 1 s each, once per cache)."""
        if split == "heldout":
            return (self._task(g, "heldout") for g in self._heldout)
        if split != "train":
            raise ValueError(f"unknown split {split!r}; choose 'train' or 'heldout'")
        return self._train_stream()

    def _train_stream(self) -> Iterator[Task]:
        for epoch in itertools.count():  # every train game once per epoch, in a seeded order
            order = list(self._train)
            random.Random(f"{self.seed}/train/epoch{epoch}").shuffle(order)
            for game in order:
                yield self._task(game, "train")

    def _task(self, game: GameRecipe | Path, split: str) -> Task:
        if isinstance(game, GameRecipe):
            meta = json.loads((ensure_game(game, self.cache_dir).parent / META).read_text())
            task_id, info = f"{self.name}/{split}/{meta['uuid']}", {"recipe": dataclasses.asdict(game)}
        else:
            key = str(game)
            if key not in self._user_meta:
                self._user_meta[key] = read_meta(game)
            meta = self._user_meta[key]
            task_id, info = f"{self.name}/{split}/{game.name}-{hashlib.sha256(key.encode()).hexdigest()[:8]}", {
                "game_file": key}
        info.update({k: meta[k] for k in ("objective", "walkthrough", "max_score", "intro")})
        return Task(task_id=task_id, env=self.name, prompt=meta["objective"] or meta["intro"], info=info,
                    split=split)  # type: ignore[arg-type]

    def game_file(self, task: Task) -> Path:
        """The task's game on this machine (generated into the cache here if another machine made the task)."""
        if "recipe" in task.info:
            return ensure_game(GameRecipe(**task.info["recipe"]), self.cache_dir)
        path = Path(task.info["game_file"])
        if not path.is_file():
            raise FileNotFoundError(f"task {task.task_id}: game file {path} is missing on this machine; games_dir "
                                    "must be visible to every rollout worker")
        return path

    # ------------------------------------------------------------------------------------------------- rollout
    def messages(self, task: Task) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        intro = task.info["intro"]
        return msgs + [{"role": "user", "content": INSTRUCTIONS.format(max_turns=self.max_turns) + "\n\n" + intro}]

    def demonstration(self, task: Task) -> str:
        """The walkthrough's first command: a correct first reply to `messages(task)`."""
        if not task.info.get("walkthrough"):
            raise NotImplementedError(f"task {task.task_id} has no walkthrough to demonstrate")
        return f"<action>{task.info['walkthrough'][0]}</action>"

    def demonstrations(self, task: Task) -> list[tuple[list[dict[str, str]], str]]:
        """The walkthrough played as a whole episode, for a warm start: each command as the reply to the
        conversation before it, and the game's feedback to it (played here, in a live game) as the next user
        message, as `rollout` writes it. At most `max_turns` commands; nothing follows the last one."""
        walkthrough = list(task.info.get("walkthrough") or [])[: self.max_turns]
        if not walkthrough:
            raise NotImplementedError(f"task {task.task_id} has no walkthrough to demonstrate")
        game = LiveGame(self.game_file(task), list_commands=self.list_commands)
        try:
            messages, out = self._opening(task, game.observation), []
            for command in walkthrough:
                reply = f"<action>{command}</action>"
                out.append((list(messages), reply))
                feedback = game.step(command)
                if game.done:
                    break
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": feedback}]
        finally:
            game.close()
        return out

    async def rollout(self, task: Task, engines: Mapping[str, Engine], sampling: SamplingParams, *,
                      policy_ids: Mapping[str, str], group_id: str) -> list[Trajectory]:
        engine = engines["policy"]
        path = await asyncio.to_thread(self.game_file, task)
        game = await asyncio.to_thread(LiveGame, path, list_commands=self.list_commands)
        counts = {"no_action_turns": 0.0, "refused_commands": 0.0, "game_steps": 0.0}
        try:
            conv = Conversation.start(engine.tokenizer, self._opening(task, game.observation), self._budget)
            while conv.can_continue and not game.done:
                turn = await conv.assistant_turn(engine, sampling)
                feedback = await self._act(conv, game, turn.text, counts)
                if game.done or not conv.can_continue:
                    break  # nothing follows the last turn: appending feedback would only add masked tokens
                conv.add_message("user", feedback)
        finally:
            await asyncio.to_thread(game.close)
        metrics = {**counts, "won": float(game.won), "lost": float(game.lost), "score": game.score,
                   "max_score": game.max_score, "turn_limit_hit": float(not game.done and conv.turns >= self.max_turns)}
        return [conv.trajectory(task, group_id=group_id, policy_id=policy_ids["policy"], role="policy",
                                metrics=metrics)]

    def _opening(self, task: Task, observation: str) -> list[dict[str, str]]:
        """`messages(task)` with the live game's opening observation (they differ only when `list_commands`)."""
        msgs = self.messages(task)
        msgs[-1] = {"role": "user", "content": INSTRUCTIONS.format(max_turns=self.max_turns) + "\n\n" + observation}
        return msgs

    async def _act(self, conv: Conversation, game: LiveGame, text: str, counts: dict[str, float]) -> str:
        command = parse_action(text, self.require_tag)
        if command is None:
            counts["no_action_turns"] += 1
            return FORMAT_HINT
        if command.lower() in META_COMMANDS:
            counts["refused_commands"] += 1
            return f"'{command}' is not available in this game."
        counts["game_steps"] += 1
        conv.record_tool_call()  # counted here: the last command's feedback is never appended
        return await asyncio.to_thread(game.step, command)

    # --------------------------------------------------------------------------------------------------- score
    def score(self, task: Task, trajectories: Sequence[Trajectory]) -> list[float | None]:
        """Read from the metrics the rollout recorded (the game itself is gone by now)."""
        return [self._reward(t.metrics) for t in trajectories]

    def _reward(self, m: Mapping[str, float]) -> float | None:
        if "won" not in m:
            return None
        if self.reward == "score" and m.get("max_score", 0) > 0:
            return min(1.0, max(0.0, m["score"] / m["max_score"]))
        return float(m["won"])


def scan_games(directory: str | os.PathLike) -> list[Path]:
    """Playable games under `directory` (recursively), sorted; refuses what TextWorld 1.7 cannot play."""
    root = Path(directory).expanduser().resolve()
    if not root.is_dir():
        raise ValueError(f"games directory {root} does not exist")
    ulx = sorted(root.rglob("*.ulx"))
    if ulx:
        raise ValueError(f"{ulx[0]}: TextWorld 1.7 cannot play Glulx (.ulx) games; recompile the games to .z8 "
                         "(TextWorld's default format) or play them with textworld<1.7")
    z8 = sorted(root.rglob("*.z8"))
    for path in z8:
        if not path.with_suffix(".json").is_file():
            raise ValueError(f"{path}: no {path.with_suffix('.json').name} beside it; TextWorld needs the game's "
                             ".json metadata to know when a game is won")
        check_story_file(path)
    pddl = sorted(root.rglob("*.tw-pddl"))
    if pddl:
        require_pddl(pddl[0])
    if not z8 + pddl:
        raise ValueError(f"no games under {root}: expected *.z8 files (each with its .json) or ALFWorld *.tw-pddl")
    return z8 + pddl
