"""GPU checks (skipped without CUDA): TorchEngine on a GPU agrees with the trainer's recomputation."""

import asyncio

import pytest
import torch

from astratk.contracts import GenerationRequest, SamplingParams
from astratk.engines.torch_engine import TorchEngine
from astratk.training.logprobs import token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_engine_logprobs_match_trainer():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, tie_word_embeddings=True, initializer_range=0.1)
    model = Qwen2ForCausalLM(cfg).to("cuda").eval()
    engine = TorchEngine.from_model(model, None)  # serves the model on its own device
    prompts = [tuple(range(3, 3 + n)) for n in (5, 9, 13)]
    reqs = [GenerationRequest(p, SamplingParams(temperature=1.0, max_tokens=8, seed=i)) for i, p in enumerate(prompts)]
    comps = asyncio.run(engine.generate(reqs))
    engine.close()
    for p, c in zip(prompts, comps):
        ids = torch.tensor([list(p) + list(c.token_ids)], device="cuda")
        lp = token_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(p) - 1:]
        assert torch.allclose(lp.cpu(), torch.tensor(c.logprobs), atol=1e-4)
