"""A prompt shared by several rows runs through the model once (torch; no Ray, no vLLM).

es-eval draws eval.n samples of each problem and GRPO a group of grpo.group_size completions of each prompt, and
the prompts (chat template included) are several times longer than the completions. Teacher-forced scoring (token
entropy, the GRPO learner's log-probs) and generation would otherwise run every prompt n times. Here the prompt's
keys and values are computed once and indexed out to its rows (``Cache.batch_repeat_interleave`` /
``batch_select_indices``), which autograd follows, so gradients are the same as with the prompt repeated.

What changes is the shape of the matrix products, not the arithmetic: results equal the repeated-prompt forward to
within rounding (tests/engines/test_prefix.py compares both in fp64).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch


def prompt_groups(prompts: Sequence[Hashable]) -> list[list[int]]:
    """Row indices grouped by equal prompt, groups in order of first appearance, rows in order within a group."""
    groups: dict[Hashable, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p if isinstance(p, (str, tuple)) else tuple(p), []).append(i)
    return list(groups.values())


def shares_prompts(prompts: Sequence[Hashable]) -> bool:
    return len(prompt_groups(prompts)) < len(prompts)


def shared_prompt_hidden(
    base_model, prompt: Sequence[int], completions: Sequence[Sequence[int]], pad_id: int = 0
) -> torch.Tensor:
    """[n, L, H] final hidden states for n completions of one prompt (L the longest completion): row i, position j
    is the state that predicts completions[i][j] (valid for j < len(completions[i])). The prompt runs once (batch
    1, no padding); its cache is repeated n times; the completions, right-padded, run against it. The last token of
    a completion predicts nothing and is not fed."""
    device = next(base_model.parameters()).device
    n, L = len(completions), max((len(c) for c in completions), default=0)
    if not prompt:
        raise ValueError("a shared prompt needs at least one token")
    out = base_model(input_ids=torch.tensor([list(prompt)], device=device), use_cache=True)
    first = out.last_hidden_state[:, -1:].expand(n, 1, -1)
    if L <= 1:
        return first[:, :L]
    cache = out.past_key_values
    if cache is None:  # e.g. gradient checkpointing in training mode turns the cache off
        raise RuntimeError(
            "the model returned no key/value cache (gradient checkpointing?): score these rows "
            "with the prompt repeated instead"
        )
    cache.batch_repeat_interleave(n)
    ids = torch.full((n, L - 1), pad_id, dtype=torch.long, device=device)
    for i, c in enumerate(completions):
        if len(c) > 1:
            ids[i, : len(c) - 1] = torch.tensor(list(c[:-1]), device=device)
    # right padding after each completion: causal attention keeps real positions from seeing it
    rest = base_model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
    return torch.cat([first, rest], dim=1)


def valid_rows(hidden: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """[sum(lengths), H]: row i's first lengths[i] positions of [n, L, H], rows in order."""
    if not lengths:
        return hidden.new_zeros((0,) + hidden.shape[2:])
    return torch.cat([hidden[i, :k] for i, k in enumerate(lengths)])


@torch.no_grad()
def shared_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, groups: list[list[int]]):
    """For ``model.generate`` over left-padded rows where several rows hold the same prompt: the cache of every row's
    prompt but its last token, computed once per distinct prompt and indexed out to the rows, as generate's own
    prefill would have built it (same positions from the attention mask, same mask). Generate then feeds only the
    last prompt token. None when the prompts are a single token wide (nothing to share)."""
    if input_ids.shape[1] < 2:
        return None
    first = torch.tensor([g[0] for g in groups], device=input_ids.device)
    row_group = torch.empty(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    for k, g in enumerate(groups):
        row_group[g] = k
    ids, mask = input_ids[first, :-1], attention_mask[first, :-1]
    position_ids = mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(mask == 0, 1)
    cache = model.base_model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True
    ).past_key_values
    cache.batch_select_indices(row_group)
    return cache
