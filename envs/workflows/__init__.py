"""Multi-policy workflows: episodes in which several roles act, each role's trajectories going to the policy that
plays it. `solver_verifier`: math solver + verifier; `solver_testgen`: code solver + test-case
generator; `judged`: a policy rewarded by an LLM judge (meant to be a frozen model), held-out tasks scored by
the ground truth. Importing this package imports neither the code sandbox nor TextWorld."""

from astratk.envs.workflows.judged import JudgedEnv
from astratk.envs.workflows.solver_verifier import SolverVerifierEnv, parse_verdict

__all__ = ["JudgedEnv", "SolverVerifierEnv", "parse_verdict"]
