"""The math env family: synthetic arithmetic and word problems, user JSONL files (GSM8K, MATH, generic), and the
`MathGrader` that scores final answers with math-verify."""

from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.envs.math.grading import MathGrader, final_answer
from astratk.envs.math.jsonl import MathExample, MathJsonlEnv, load_math_jsonl
from astratk.envs.math.word import SingleTurnMathEnv, WordProblemEnv

__all__ = ["ArithmeticEnv", "MathExample", "MathGrader", "MathJsonlEnv", "SingleTurnMathEnv", "WordProblemEnv",
           "final_answer", "load_math_jsonl"]
