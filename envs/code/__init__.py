"""The code env family: sandboxed execution of generated Python against hidden unit tests.

- `sandbox.Sandbox`: run untrusted code in bubblewrap, or a limited process where bwrap is missing (its command
  lines built in `launch`, each run carried out in `execute`);
- `tasks.SyntheticTasks`: locally generated Python function tasks with hidden tests;
- `jsonl.load_problems`: HumanEval / MBPP / LiveCodeBench-style JSONL files;
- `env.CodeEnv`: the single-turn env; reward = fraction of hidden tests passed.
"""

from astratk.envs.code.env import CodeEnv, CodeScore
from astratk.envs.code.execute import SandboxResult
from astratk.envs.code.jsonl import load_problems
from astratk.envs.code.sandbox import Sandbox
from astratk.envs.code.tasks import CodeProblem, SyntheticTasks

__all__ = ["CodeEnv", "CodeProblem", "CodeScore", "Sandbox", "SandboxResult", "SyntheticTasks", "load_problems"]
