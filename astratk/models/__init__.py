"""Models a policy starts from: a user's HF directory, or the built-in tiny Qwen2 model with a character tokenizer.

`ensure_model(model_spec, env_spec)` returns an HF model directory that every engine loads with `from_pretrained`;
the tiny model is built, warm-started on the env's demonstrations and cached by content (`astratk.models.cache`).
"""

from astratk.models.cache import ensure_model
from astratk.models.tiny import build_tiny_model
from astratk.models.tokenizer import build_char_tokenizer

__all__ = ["build_char_tokenizer", "build_tiny_model", "ensure_model"]
