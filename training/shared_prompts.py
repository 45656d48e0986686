"""share_prompts: a micro-batch's rows packed so that each prompt is computed once.

The rows of a micro-batch that have the same prompt are laid out as one packed sequence, the
prompt followed by its responses (`SharedPrompts`): the model computes each prompt once
instead of once per response, and each response attends to the prompt and to itself only,
at the positions it has on its own, so the log-probs are those of the unpacked rows (to
float rounding). training.batching.policy_batches attaches one to each micro-batch;
training.logprobs.token_logprobs runs the model on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from training.ragged import Ragged, spans

__all__ = ["SHARED_MAX_LEN", "SharedPrompts", "pack_shared_prompts", "prompt_numbers"]

SHARED_MAX_LEN = 1024
"""share_prompts: the longest packed sequence. A prompt's responses are split over as many
packed sequences (each repeating the prompt) as keep them under it; a response that alone
is longer gets one of its own. The attention mask is dense (length^2 per packed sequence),
hence the cap: sharing pays for short responses after a prompt that is long next to them."""


@dataclass
class SharedPrompts:
    """A micro-batch laid out so that each prompt is computed once: P packed sequences, each a
    prompt followed by responses to it. The model runs on these tensors; `source` maps its
    hidden states back to the micro-batch's (b, L-1) positions."""

    input_ids: torch.LongTensor
    """(P, Lp) a prompt, then its responses one after another, right-padded with pad_id."""
    position_ids: torch.LongTensor
    """(P, Lp) the prompt at 0..p-1, each response at p.. as if it followed the prompt alone."""
    attention_mask: torch.BoolTensor
    """(P, 1, Lp, Lp) True where a token may attend: the prompt causally, a response the whole
    prompt and its own earlier tokens; padding attends to itself only."""
    source: torch.LongTensor
    """(N,) for each True of the micro-batch's target_mask (row-major), the flat index
    p * Lp + t of the packed hidden state that predicts that token."""

    def to(self, device: torch.device | str) -> SharedPrompts:
        return SharedPrompts(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def prompt_numbers(prompts: Ragged, rows: np.ndarray) -> np.ndarray:
    """A number per row of `rows`, equal for rows whose prompt token ids are equal, numbered
    in order of first appearance: the prompts as byte strings, numbered by Arrow's hash
    (dictionary_encode keeps first-seen order)."""
    lengths = prompts.lengths[rows]
    flat = np.ascontiguousarray(prompts.values[spans(prompts.starts[rows], lengths)[2]])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64) * flat.itemsize
    keys = pa.Array.from_buffers(pa.large_binary(), rows.size, [None, pa.py_buffer(offsets), pa.py_buffer(flat)])
    return pc.dictionary_encode(keys).indices.to_numpy().astype(np.int64)


def opens_sequence(prompt: int, last: int, length: int, response: int, max_len: int) -> bool:
    """Whether a row starts a new packed sequence after one of `length` tokens holding prompt
    `last`: its prompt is another, or its response would take the sequence past `max_len`."""
    return prompt != last or length + response > max_len


def pack_shared_prompts(prompts: Ragged, responses: Ragged, group: np.ndarray, pad_id: int,
                        max_len: int, response_mask: Ragged | None = None) -> SharedPrompts:
    """The micro-batch of rows `group` (in this order) packed prompt by prompt (SharedPrompts):
    prompts in order of first appearance, each one's rows in batch order, cut greedily into
    packed sequences of at most `max_len` tokens. `response_mask` (bools, one per response
    token): `source` only for the True tokens, as the micro-batch's target_mask has them."""
    prompt_of = prompt_numbers(prompts, group)
    p_of, r_of = prompts.lengths[group], responses.lengths[group]
    seq = np.empty(group.size, dtype=np.int64)  # per in-batch row: its packed sequence
    start = np.empty(group.size, dtype=np.int64)  # ... and where its response starts in it
    firsts, q, length, last = [], -1, 0, -1
    order = np.argsort(prompt_of, kind="stable")
    for j, prompt, p, r in zip(order.tolist(), prompt_of[order].tolist(), p_of[order].tolist(), r_of[order].tolist()):
        if opens_sequence(prompt, last, length, r, max_len):
            q, length, last = q + 1, p, prompt
            firsts.append(j)
        seq[j], start[j] = q, length
        length += r
    P, Lp = q + 1, int((start + r_of).max())
    ids = np.full((P, Lp), pad_id, dtype=np.int64)
    positions = np.zeros((P, Lp), dtype=np.int64)
    segment = np.broadcast_to(-1 - np.arange(Lp), (P, Lp)).copy()  # padding: its own segment
    packed_p = p_of[firsts]
    q_of, k, at = spans(prompts.starts[group[firsts]], packed_p)
    ids[q_of, k], positions[q_of, k], segment[q_of, k] = prompts.values[at], k, 0
    j_of, k, at = spans(responses.starts[group], r_of)
    t = start[j_of] + k
    ids[seq[j_of], t], positions[seq[j_of], t], segment[seq[j_of], t] = responses.values[at], p_of[j_of] + k, j_of + 1
    # token t attends token u <= t of its own segment (the prompt, a response, a padding
    # position), and a response token also the whole prompt
    mask = segment[:, None, :] == segment[:, :, None]
    mask &= np.tri(Lp, dtype=bool)
    mask |= (segment[:, None, :] == 0) & (segment[:, :, None] > 0)
    # token 0 of a response is predicted by the prompt's last state, token k >= 1 by token k-1
    source = seq[j_of] * Lp + np.where(k == 0, p_of[j_of] - 1, t - 1)
    if response_mask is not None:  # the masked tokens are not targets (training.batching)
        source = source[response_mask.values[spans(response_mask.starts[group], r_of)[2]]]
    return SharedPrompts(torch.from_numpy(ids), torch.from_numpy(positions),
                         torch.from_numpy(mask.reshape(P, 1, Lp, Lp)), torch.from_numpy(source.astype(np.int64)))
