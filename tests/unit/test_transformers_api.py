"""astratk's own code calls no deprecated transformers API. The KV cache argument was renamed (`past_key_values` ->
`cache`) after transformers 5.19 and the old name warns on every call; astratk passes it by the name the model's
forward declares (`astratk.models.kvcache`), and the test configuration turns transformers' deprecation warnings into
errors (pyproject.toml, `filterwarnings`), so a run of the suite on a newer transformers fails on any such call. This
file also catches the old name in the source, whatever transformers is installed."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path

import torch

from astratk.models import build_char_tokenizer, build_tiny_model
from astratk.models.kvcache import cache_kwargs, cache_name, returned_cache
from astratk.spec import TinyModelSpec

ROOT = Path(__file__).resolve().parents[2]


def test_no_source_passes_or_reads_past_key_values_except_the_shim():
    offenders = []
    for folder in ("astratk", "envs", "losses", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "kvcache.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if re.search(r"past_key_values\s*=|\.past_key_values\b", code):
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "use astratk.models.kvcache.cache_kwargs / returned_cache:\n" + "\n".join(offenders)


def test_the_cache_goes_by_the_name_the_forward_declares_and_warns_nothing():
    model = build_tiny_model(TinyModelSpec(num_layers=1), build_char_tokenizer()).eval()
    params = inspect.signature(type(model).forward).parameters
    assert cache_name(model) == ("cache" if "cache" in params else "past_key_values")
    ids = torch.randint(1, 100, (2, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation, whichever transformers this is
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            cache = returned_cache(out)
            nxt = model(input_ids=ids[:, -1:], use_cache=True, **cache_kwargs(model, cache))
    full = model(input_ids=torch.cat([ids, ids[:, -1:]], 1)).logits[:, -1]
    torch.testing.assert_close(nxt.logits[:, -1], full, atol=1e-4, rtol=1e-4)  # the cache was used, not ignored
