"""The math env family: synthetic arithmetic now; word problems and user JSONL files come next (issue 5)."""

from astratk.envs.math.arithmetic import ArithmeticEnv

__all__ = ["ArithmeticEnv"]
