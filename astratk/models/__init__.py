"""Models a policy starts from: a user's HF directory, or the built-in tiny Qwen2 model with a character tokenizer.

`ensure_model(model_spec, env_spec)` returns an HF model directory that every engine loads with `from_pretrained`;
the tiny model is built, warm-started on the env's demonstrations and cached by content (`astratk.models.cache`).

The names load on first use: envs import `astratk.models.chat` (chat encoding, pure Python), and that must not
load torch and transformers with the model builders.
"""

from astratk._lazy import lazy_names

__getattr__ = lazy_names("astratk.models", {"ensure_model": "astratk.models.cache",
                                            "build_tiny_model": "astratk.models.tiny",
                                            "build_char_tokenizer": "astratk.models.tokenizer"})

__all__ = ["build_char_tokenizer", "build_tiny_model", "ensure_model"]
