"""Routing workloads as sessions of token-id turns, for the simulator and the HTTP benchmark alike.

* generated-shared-prefix: ``groups`` system prompts, each followed by ``prompts_per_group``
  distinct questions (SGLang's GSP; groups drawn uniformly, or Zipf-skewed);
* multi-turn chat: each session's next turn extends its previous prompt and answer;
* one hot prefix: every request shares one long prefix;
* no sharing: every prompt distinct.

Token ids come from ``vocab`` (for HTTP runs: ids that decode and re-encode as themselves, so
a text prompt reaches the engine as exactly these tokens).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from flotilla.router.sim_cluster import Session, Turn


def _tokens(rng: random.Random, vocab: Sequence[int], n: int) -> list[int]:
    return [rng.choice(vocab) for _ in range(n)]


def shared_prefix(
    vocab: Sequence[int],
    groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    seed: int = 0,
    zipf_alpha: float | None = None,
) -> list[Session]:
    rng = random.Random(seed)
    systems = [_tokens(rng, vocab, system_len) for _ in range(groups)]
    total = groups * prompts_per_group
    if zipf_alpha is None:
        picks = [g for g in range(groups) for _ in range(prompts_per_group)]
    else:
        weights = [1 / (rank + 1) ** zipf_alpha for rank in range(groups)]
        picks = rng.choices(range(groups), weights, k=total)
    rng.shuffle(picks)
    return [
        Session([Turn(systems[g] + _tokens(rng, vocab, question_len), _tokens(rng, vocab, output_len))]) for g in picks
    ]


def multi_turn(
    vocab: Sequence[int], sessions: int, turns: int, system_len: int, user_len: int, output_len: int, seed: int = 0
) -> list[Session]:
    rng = random.Random(seed)
    system = _tokens(rng, vocab, system_len)
    result = []
    for _ in range(sessions):
        history = list(system)
        session_turns = []
        for _ in range(turns):
            prompt = history + _tokens(rng, vocab, user_len)
            output = _tokens(rng, vocab, output_len)
            session_turns.append(Turn(prompt, output))
            history = prompt + output
        result.append(Session(session_turns))
    return result


def hot_prefix(
    vocab: Sequence[int], prompts: int, prefix_len: int, suffix_len: int, output_len: int, seed: int = 0
) -> list[Session]:
    return shared_prefix(vocab, 1, prompts, prefix_len, suffix_len, output_len, seed)


def no_sharing(vocab: Sequence[int], prompts: int, prompt_len: int, output_len: int, seed: int = 0) -> list[Session]:
    rng = random.Random(seed)
    return [Session([Turn(_tokens(rng, vocab, prompt_len), _tokens(rng, vocab, output_len))]) for _ in range(prompts)]


def interleave(*workloads: Sequence[Session], seed: int = 0) -> list[Session]:
    """The sessions of every workload, shuffled together (e.g. shared prefixes among unrelated prompts)."""
    sessions = [session for workload in workloads for session in workload]
    random.Random(seed).shuffle(sessions)
    return sessions


def optimal_hit_rate(sessions: Sequence[Session], block_size: int) -> float:
    """Upper bound on the engine-side hit rate: every distinct full block computed once in the cluster.

    (vLLM recomputes at least a prompt's last token, so a fully cached prompt still misses its
    last block; the bound accounts for that.)
    """
    from flotilla.router.block_keys import block_keys

    seen: set[int] = set()
    prompt_tokens = hits = 0
    for session in sessions:
        for turn in session.turns:
            keys = block_keys(turn.prompt, block_size)
            prompt_tokens += len(turn.prompt)
            reusable = keys if len(keys) * block_size < len(turn.prompt) else keys[:-1]
            for key in reusable:
                if key not in seen:
                    break
                hits += block_size
            seen.update(block_keys(turn.prompt + turn.output, block_size))
    return hits / max(prompt_tokens, 1)
