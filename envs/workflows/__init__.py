"""Multi-policy workflows: episodes in which several roles act, each role's trajectories going to the policy that
plays it (ALGORITHMS §5). `solver_verifier`: math solver + verifier."""

from astratk.envs.workflows.solver_verifier import SolverVerifierEnv, parse_verdict

__all__ = ["SolverVerifierEnv", "parse_verdict"]
