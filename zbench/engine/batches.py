"""How a step's sequences are laid out and split: left-padded prompts then right-padded responses, one shard per
rank, micro-batches for the forward and backward passes, and the maskless layout (each row's left padding moved
behind its tokens so attention needs the causal flag alone). The controller (`trainer`) builds and shards a step's
batch; the workers (`workers`) cut their shard into micro-batches."""

from __future__ import annotations

from typing import Any

import torch

Batch = dict[str, torch.Tensor]
# prompt widths for a static KV cache (a compiled decode step per width) are rounded up to a multiple of this
PROMPT_WIDTH_MULTIPLE = 64


def left_pad(seqs: list[list[int]], pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ids and attention mask, to a width rounded up to `multiple`."""
    width = aligned(max(len(s) for s in seqs), multiple)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


def sequence_batch(p_ids: torch.Tensor, p_mask: torch.Tensor, responses: torch.Tensor,
                   r_mask: torch.Tensor) -> Batch:
    """A step's sequences: left-padded prompts, then right-padded responses, with their mask and positions."""
    attn = torch.cat([p_mask, r_mask], dim=1)
    return {"input_ids": torch.cat([p_ids, responses], dim=1), "attention_mask": attn,
            "position_ids": (attn.cumsum(1) - 1).clamp_min(0), "responses": responses, "response_mask": r_mask}


def shard(batch: Batch, parts: int) -> list[Batch]:
    """Split every tensor of a batch into `parts` equal consecutive row blocks (one per rank)."""
    rows = next(iter(batch.values())).shape[0]
    size = rows // parts
    return [{k: v[i * size : (i + 1) * size] for k, v in batch.items()} for i in range(parts)]


def gather(parts: list[Batch]) -> Batch:
    """Concatenate per-rank outputs row-wise."""
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def rollout_shards(batch: Batch, world: int, tp: int) -> list[Batch]:
    """What each rank generates from: its own shard, or, under vLLM tensor parallelism, the shard of its TP group
    (`tp` consecutive ranks run one engine, so each of them must be given the same prompts)."""
    groups = shard(batch, world // tp)
    return [groups[rank // tp] for rank in range(world)]


def rollout_outputs(parts: list[Batch], tp: int) -> Batch:
    """The step's generations in prompt order: one copy per TP group (its ranks must return the same tokens;
    if they do not, the group's engines have diverged and the step cannot be trusted)."""
    for first in range(0, len(parts), tp):
        for rank in range(first + 1, first + tp):
            if not torch.equal(parts[rank]["responses"], parts[first]["responses"]):
                raise RuntimeError(f"vLLM tensor-parallel ranks {first} and {rank} generated different tokens for "
                                   "the same prompts: their engines are out of step")
    return gather(parts[::tp])


def pick(batch: Batch, *keys: str) -> Batch:
    return {k: batch[k] for k in keys}


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """Consecutive slices of `size` rows of every tensor in `batch`."""
    rows = next(iter(batch.values())).shape[0]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, rows, size)]


def aligned(width: int, align: int) -> int:
    """`width` rounded up to a multiple of `align`."""
    return -(-width // align) * align


def trim_left_padding(mb: Batch, align: int = 1) -> Batch:
    """Drop the leading columns that are padding in every row. Prompts are left-padded to the step's longest;
    a micro-batch's own longest is usually shorter, and those columns would be computed for nothing. Positions
    and masks of the remaining tokens are unchanged, so the outputs are too. With `align`, the width kept is
    rounded up to a multiple of it (more padding on the left, masked, where the batch is narrower)."""
    width = mb["attention_mask"].shape[1]
    first = int(mb["attention_mask"].any(0).int().argmax())  # every row has a prompt token: a column has one
    keep = aligned(width - first, align)
    if keep > width:  # wider than the batch: masked columns in front
        extra = keep - width
        return {k: torch.cat([v.new_zeros(v.shape[0], extra), v], dim=1)
                if k in ("input_ids", "attention_mask", "position_ids") else v for k, v in mb.items()}
    if keep == width:
        return mb
    return {k: v[:, width - keep :] if k in ("input_ids", "attention_mask", "position_ids") else v
            for k, v in mb.items()}


def shift_padding_right(mb: Batch, align: int = 1) -> Batch:
    """Move each row's left padding behind its tokens (`[pad pad p p r r]` -> `[p p r r pad pad]`) and keep only as
    many columns as the micro-batch's longest row has tokens (prompt and response up to its EOS), so that a forward
    needs no padding mask: with causal attention no token sees a later column, so trailing padding is never
    attended. Attention then runs with the causal flag alone (SDPA's flash kernels) instead of a dense mask, and
    positions are 0, 1, ... in every row, as the masked layout's were for its tokens.

    The mask and positions are replaced by `hidden_index` [rows, R + 1] (R = response width): where the last
    R + 1 columns of the left-padded layout, the last prompt token and the response, now sit in each row. Those
    are the only positions whose outputs score a response; `model_outputs` keeps the hidden states there.
    Positions after a row's last response token (masked out of every loss and statistic) point at the last kept
    column. With `align`, the width is rounded up to a multiple of it: the extra columns come after every row's
    tokens, where causal attention never reads them."""
    mask, responses = mb["attention_mask"], mb["responses"]
    width, resp = mask.shape[1], responses.shape[1]
    prompt_width = width - resp
    prompt_len = mask[:, :prompt_width].sum(1)  # prompts are left-padded: their tokens are contiguous
    pad = prompt_width - prompt_len
    # each row's last response token (its EOS): the mask is a prefix, but its end is read as the last 1 anyway
    ends = (mb["response_mask"] * torch.arange(1, resp + 1, device=mask.device)[None]).amax(1)
    tokens = prompt_len + ends
    keep = aligned(int(tokens.max()), align)
    cols = (torch.arange(keep, device=mask.device)[None] + pad[:, None]) % width  # the row's padding wraps to its end
    out = {k: v for k, v in mb.items() if k not in ("input_ids", "attention_mask", "position_ids")}
    out["input_ids"] = mb["input_ids"].gather(1, cols)
    index = prompt_len[:, None] - 1 + torch.arange(resp + 1, device=mask.device)[None]
    out["hidden_index"] = index.clamp_max(keep - 1)
    return out


def forward_micro(section: Any) -> int:
    """Micro-batch of the gradient-free passes of an actor or critic config section (0 = its training size)."""
    return section.forward_micro_batch_size_per_gpu or section.micro_batch_size_per_gpu


def forward_batches(batch: Batch, size: int, maskless: bool = False, align: int = 1) -> list[Batch]:
    """`micro_batches` of `size` rows, each laid out for a forward: trimmed of its all-padding prompt columns,
    or with `maskless` (`model.maskless_attention`) by `shift_padding_right`, `align` columns wide or a multiple
    of that (compiled layers: one graph for every width). Meant for the host copy of a batch: the layout is read
    from the mask without waiting on the GPU."""
    layout = shift_padding_right if maskless else trim_left_padding
    return [layout(mb, align) for mb in micro_batches(batch, size)]


def length_order(batch: Batch, maskless: bool = True) -> torch.Tensor:
    """Row order, longest first (ties in row order), by what sets a micro-batch's width in its layout: the tokens
    of prompt and response (`shift_padding_right`), or the prompt alone (`trim_left_padding`, which keeps every
    response column). Micro-batches cut from rows in this order hold rows of similar width, so each is padded less,
    and the first is the widest."""
    mask = batch["attention_mask"]
    if not maskless:
        mask = mask[:, : mask.shape[1] - batch["responses"].shape[1]]
    return torch.sort(mask.sum(1), descending=True, stable=True).indices


def mini_batch_tokens(response_mask: torch.Tensor, world: int, rows_per_rank: int) -> torch.Tensor:
    """For every row of a step's batch, the response tokens of its optimizer step over all ranks. Rank r trains
    on the r-th of `world` consecutive row blocks (`shard`), cut into mini-batches of `rows_per_rank` rows
    (`micro_batches`); the k-th mini-batches of all ranks make the k-th optimizer step together."""
    rows = response_mask.shape[0]
    step_of_row = (torch.arange(rows) % (rows // world)) // rows_per_rank
    per_step = torch.zeros(int(step_of_row.max()) + 1, dtype=torch.long).index_add_(0, step_of_row,
                                                                                   response_mask.sum(1).long())
    return per_step[step_of_row]


def token_share_denominator(step_tokens: int, micro_batches: int, world: int) -> float:
    """What a micro-batch's masked token sum is divided by so that the optimizer step's gradient is the mean over
    every response token of the step (`step_tokens`, all ranks), whatever the micro-batch geometry or grouping:
    DeepSpeed averages the accumulated micro-batches' gradients and then the ranks', which multiplies the sums by
    1 / (micro_batches x world)."""
    return step_tokens / (micro_batches * world)


def in_row_order(rows: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Outputs computed for rows taken in `order` (`length_order`), put back in the rows' own order."""
    if order is None:
        return rows
    out = torch.empty_like(rows)
    out[order] = rows
    return out
