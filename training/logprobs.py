"""Per-token log-probabilities of a causal LM, chunked over the vocabulary.

Why chunk: the plain way, `model(...).logits.log_softmax(-1)`, materialises a B x L x V
float32 tensor, B*L*V*4 bytes, and autograd keeps it (and its log-softmax) for backward.
At B*L = 16k tokens and a 152k vocabulary that is ~10 GB for one micro-batch, far more
than the model itself, and almost all of it is wasted: the objectives need one number per
*response* token, log p(y_t | y_<t).

So `token_logprobs` runs the decoder body, keeps only the N hidden states at target
positions (N x H), and pushes them through the LM head `chunk_tokens` rows at a time with
`ChunkedTokenLogProbs`, an autograd Function that saves the hidden states, the targets and
one logsumexp per row, and recomputes each chunk's logits in backward:

    logp_n       = z_n[y_n] / T - logsumexp(z_n / T),   z_n = W h_n (+ b)
    dlogp_n/dz_n = (onehot(y_n) - softmax(z_n / T)) / T
    grad_h = grad_z @ W,   grad_W += grad_z^T @ h,   grad_b += sum_n grad_z

Peak memory for the head is then O(chunk_tokens * V) in forward and backward alike, at the
cost of one extra head matmul per chunk in backward (the recompute). The one chunk-sized
buffer (two under autocast: the low-precision matmul output and its float32 copy) is kept
from forward to backward and reused there: backward needs it anyway, so the peak does not
move, and reusing mapped pages is measurably faster on CPU than allocating fresh ones.

Sampling truncation: with `top_k` > 0 or `top_p` < 1 the log-probs are those of the
distribution the engine sampled from (vLLM's processed log-probs, transformers' warped
scores): logits / T, then the top_k largest kept, then the smallest set of those whose
renormalised probabilities reach top_p (a token is kept when the mass ranked above it is
< top_p), everything else -inf, renormalised:

    logp_n = z_n[y_n] / T - logsumexp_{v in K_n}(z_n[v] / T)
    dlogp_n/dz_n = (onehot(y_n) - softmax_{K_n}(z_n / T)) / T      (0 outside K_n)

K_n is rebuilt from the logits being evaluated (the sampled token always in it), in
forward and again in backward, chunk by chunk: nothing about it is stored. At the weights
that sampled, that is the engine's set (up to ties at the boundary); later it is the
truncated distribution of the current weights, which is the policy being trained.

Padding: sequences must be right-padded (what `training.batching` builds). Hugging Face
Llama-family models number positions 0..L-1 whatever the mask says, which is right for
every real token of a right-padded row; the attention mask keeps padded keys out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from training.lora import is_peft

if TYPE_CHECKING:
    from training.shared_prompts import SharedPrompts

__all__ = ["ChunkedTokenLogProbs", "GatherRows", "token_logprobs", "token_logprobs_reference", "truncate_"]


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Log-softmax runs in float32 (float64 for a float64 model), never in bf16/fp16."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ChunkedTokenLogProbs(torch.autograd.Function):
    """logp[n] = log softmax((hidden[n] @ weight.T + bias) / temperature)[targets[n]].

    hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) int64. Returns (N,) in
    float32 (float64 when the weight is float64). Never holds more than `chunk_tokens` x V
    logits; saves hidden, targets and the per-row logsumexp for backward, plus the one
    chunk-sized workspace, whose contents backward overwrites (it holds no forward values).

    The head matmuls run in `compute_dtype` (the autocast dtype under autocast, else the
    weight's dtype); softmax, logsumexp and the weight/bias gradient accumulators in float32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk_tokens: int,
                compute_dtype: torch.dtype, top_k: int = 0, top_p: float = 1.0):
        head = _HeadChunks(hidden, weight, bias, temperature, chunk_tokens, compute_dtype)
        out = torch.empty(hidden.shape[0], dtype=head.acc, device=hidden.device)
        lse = torch.empty_like(out)
        for rows in head.chunks():
            logits = truncate_(head.logits(rows), targets[rows], top_k, top_p)
            out[rows] = logits.gather(1, targets[rows, None]).squeeze(1)
            # logsumexp in place on the buffer (torch.logsumexp allocates two more chunk-sized tensors)
            top = logits.amax(dim=-1, keepdim=True)
            lse[rows] = logits.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(1))
        out -= lse
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk_tokens, ctx.compute_dtype = temperature, chunk_tokens, compute_dtype
        ctx.top_k, ctx.top_p = top_k, top_p
        # Backward reuses the chunk buffers (and the cast weight): no extra peak, since backward
        # needs them anyway, and the pages are already mapped (first touch of a fresh buffer
        # costs about as much as a pass over it).
        ctx.workspace = head.workspace()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        head = _HeadChunks(hidden, weight, bias, ctx.temperature, ctx.chunk_tokens, ctx.compute_dtype,
                           workspace=ctx.workspace)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.empty(weight.shape, dtype=head.acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=head.acc, device=bias.device) if need_b else None
        grad_w_chunk = None if head.low is None or not need_w else torch.empty_like(head.w)
        g_all = grad_out.to(head.acc) / ctx.temperature
        for i, rows in enumerate(head.chunks()):
            # grad_z = (onehot - softmax) * g,  g = grad_out / T: built in place on the logits
            # buffer, three passes over it (these passes, not the matmuls, are memory-bound)
            g = g_all[rows, None]
            logits = truncate_(head.logits(rows), targets[rows], ctx.top_k, ctx.top_p)
            grad_z = logits.sub_(lse[rows, None]).exp_().mul_(-g)
            grad_z.scatter_add_(1, targets[rows, None], g)
            if need_b:
                grad_b += grad_z.sum(0)
            h = head.h(rows)
            if head.low is not None:  # matmuls in the autocast dtype, like autocast's own Linear
                grad_z = head.low[: grad_z.shape[0]].copy_(grad_z)
            if need_h:
                grad_h[rows] = (grad_z @ head.w).to(hidden.dtype)
            if need_w:
                if grad_w_chunk is None:  # same dtype: accumulate in place
                    torch.mm(grad_z.t(), h, out=grad_w) if i == 0 else grad_w.addmm_(grad_z.t(), h)
                else:
                    torch.mm(grad_z.t(), h, out=grad_w_chunk)
                    grad_w.copy_(grad_w_chunk) if i == 0 else grad_w.add_(grad_w_chunk)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        if need_b:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


class GatherRows(torch.autograd.Function):
    """out[n] = x[index[n]] for x (R, H) and index (N,) that may repeat, with a backward that
    gives the same bits on every call:

        grad_x[r] = sum over n with index[n] = r of grad_out[n], added in order of n

    Autograd's own backward of x[index] is index_put_(accumulate=True), whose CPU kernel adds
    repeated indices with parallel atomic adds when torch runs more than one thread, so the
    order of the additions, and the last bits of the sum, change from call to call. share_prompts
    repeats an index (the prompt's last state predicts the first token of each of its responses
    in a packed sequence: training.shared_prompts.SharedPrompts). Here pass k adds the k-th occurrence
    of every index: no pass repeats an index, so no addition races with another.
    """

    @staticmethod
    def forward(ctx, x, index):
        ctx.rows = x.shape[0]
        ctx.save_for_backward(index)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad_out):
        (index,) = ctx.saved_tensors
        grad_x = grad_out.new_zeros((ctx.rows, grad_out.shape[1]))
        if index.numel() == 0:
            return grad_x, None
        order = torch.argsort(index, stable=True)
        position = torch.arange(index.numel(), device=index.device)
        first = torch.ones_like(index, dtype=torch.bool)
        first[1:] = index[order][1:] != index[order][:-1]
        occurrence = torch.empty_like(index)  # k for the k-th n (0-based, in order of n) with this index
        occurrence[order] = position - torch.where(first, position, 0).cummax(0).values
        for k in range(int(occurrence.max()) + 1):
            taken = occurrence == k
            grad_x.index_put_((index[taken],), grad_out[taken], accumulate=True)
        return grad_x, None


def truncate_(logits: torch.Tensor, targets: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`logits` (n, V), already divided by the temperature, with every token outside the
    sampler's kept set set to -inf, in place (see the module docstring); unchanged when
    top_k <= 0 and top_p >= 1. The target token of each row is always kept."""
    n, vocab = logits.shape
    keep = None
    if 0 < top_k < vocab:
        keep = logits >= logits.topk(top_k, dim=-1).values[:, -1:]  # ties at the k-th kept, as vLLM does
    if top_p < 1.0:
        probs = (logits if keep is None else logits.masked_fill(~keep, float("-inf"))).softmax(-1)
        ranked, order = probs.sort(dim=-1, descending=True)
        in_nucleus = (ranked.cumsum(-1) - ranked) < top_p  # the mass ranked above it is < top_p
        nucleus = torch.zeros_like(in_nucleus).scatter_(1, order, in_nucleus)
        keep = nucleus if keep is None else keep & nucleus
    if keep is None:
        return logits
    keep.scatter_(1, targets[:, None], True)
    return logits.masked_fill_(~keep, float("-inf"))


class _HeadChunks:
    """One pass over the rows of the head, `chunk_tokens` at a time, with the chunk's logits
    (h @ W.T + b) / T written into buffers allocated once (per forward/backward pair): a fresh
    chunk-sized tensor per chunk costs page faults and zeroing (hundreds of MB per chunk at a
    32k+ vocabulary)."""

    def __init__(self, hidden, weight, bias, temperature, chunk_tokens, compute_dtype, workspace=None):
        self.acc = _accum_dtype(weight.dtype)
        self.hidden, self.n, self.chunk = hidden, hidden.shape[0], chunk_tokens
        self.b = None if bias is None else bias.to(self.acc)
        self.temperature = temperature
        if workspace is None:
            rows = min(chunk_tokens, self.n)
            self.w = weight.to(compute_dtype)
            self.buf = torch.empty(rows, weight.shape[0], dtype=self.acc, device=hidden.device)
            self.low = (None if compute_dtype == self.acc else
                        torch.empty(rows, weight.shape[0], dtype=compute_dtype, device=hidden.device))
        else:
            w, self.buf, self.low = workspace
            self.w = weight if w is None else w

    def workspace(self):
        """(the cast weight, or None when it is the parameter itself; logits buffer; low buffer)."""
        return (None if self.low is None else self.w), self.buf, self.low

    def chunks(self):
        for start in range(0, self.n, self.chunk):
            yield slice(start, min(start + self.chunk, self.n))

    def h(self, rows: slice) -> torch.Tensor:
        return self.hidden[rows].to(self.w.dtype)

    def logits(self, rows: slice) -> torch.Tensor:
        n = rows.stop - rows.start
        logits = self.buf[:n]
        if self.low is None:
            torch.mm(self.h(rows), self.w.t(), out=logits)
        else:
            logits.copy_(torch.mm(self.h(rows), self.w.t(), out=self.low[:n]))
        if self.b is not None:
            logits += self.b
        if self.temperature != 1.0:
            logits /= self.temperature
        return logits


def _lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder body returning last_hidden_state, LM head Linear) of a HF causal LM (a peft
    model's: its adapters sit inside the base model's layers)."""
    if is_peft(model):
        model = model.get_base_model()
    head = model.get_output_embeddings()
    body = model.base_model
    if head is None or body is model:
        raise TypeError(f"{type(model).__name__} has no separate decoder body and LM head; "
                        "token_logprobs needs a *ForCausalLM model")
    return body, head


def _attention_mask(body: nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """A custom (P, 1, Lp, Lp) mask as the model's attention takes it: sdpa and the other
    kernels a boolean (True: attend), eager an additive float mask."""
    if getattr(body.config, "_attn_implementation", None) != "eager":
        return allowed
    return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(torch.float32).min)


def _check_inputs(input_ids, attention_mask, target_mask) -> None:
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids and attention_mask must both be (B, L), got "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    expected = (input_ids.shape[0], input_ids.shape[1] - 1)
    if tuple(target_mask.shape) != expected or target_mask.dtype != torch.bool:
        raise ValueError(f"target_mask must be a bool tensor of shape (B, L-1) = {expected}, got "
                         f"{target_mask.dtype} {tuple(target_mask.shape)}")


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   target_mask: torch.Tensor, *, temperature: float = 1.0,
                   chunk_tokens: int = 2048, top_k: int = 0, top_p: float = 1.0,
                   shared: SharedPrompts | None = None) -> torch.Tensor:
    """Per-token log-probs of the next token, only where `target_mask` is True.

    Returns logp of shape (B, L-1): logp[b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1])
    under softmax(logits / temperature), truncated to the sampler's top_k / top_p set when
    those are set (see the module docstring), where target_mask[b, t], else 0. float32 (float64
    for a float64 model), differentiable w.r.t. every model parameter. The B x L x V logits
    are never materialised, in forward or backward (see the module docstring); under
    autocast the head matmuls run in the autocast dtype and the log-softmax in float32.
    Rows must be right-padded. `shared` (training.shared_prompts.SharedPrompts): the model runs on
    its packed sequences instead, each prompt once, and the states are mapped back to these
    rows; input_ids and target_mask still give the targets and the output's layout.
    """
    _check_inputs(input_ids, attention_mask, target_mask)
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"top_p must be in (0, 1] and top_k >= 0, got top_p {top_p}, top_k {top_k}")
    body, head = _lm_parts(model)
    if shared is None:
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        hidden = hidden[:, :-1][target_mask]  # (N, H): the states that predict a response token
    else:
        packed = body(input_ids=shared.input_ids, attention_mask=_attention_mask(body, shared.attention_mask),
                      position_ids=shared.position_ids, use_cache=False).last_hidden_state
        hidden = GatherRows.apply(packed.reshape(-1, packed.shape[-1]), shared.source)
    targets = input_ids[:, 1:][target_mask]
    device_type = hidden.device.type
    compute_dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                     else head.weight.dtype)
    with torch.autocast(device_type, enabled=False):
        logp = ChunkedTokenLogProbs.apply(hidden, head.weight, getattr(head, "bias", None), targets,
                                          float(temperature), int(chunk_tokens), compute_dtype,
                                          int(top_k), float(top_p))
    out = torch.zeros(target_mask.shape, dtype=logp.dtype, device=logp.device)
    return out.masked_scatter(target_mask, logp)


def token_logprobs_reference(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             target_mask: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                             top_p: float = 1.0) -> torch.Tensor:
    """The plain full-logits version of `token_logprobs` (B x L x V in memory), for tests."""
    _check_inputs(input_ids, attention_mask, target_mask)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].to(_accum_dtype(logits.dtype)) / temperature
    if top_k > 0 or top_p < 1:
        flat = logits.reshape(-1, logits.shape[-1]).clone()
        logits = truncate_(flat, input_ids[:, 1:].reshape(-1), top_k, top_p).reshape(logits.shape)
    logp = logits.log_softmax(-1)
    logp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return logp.masked_fill(~target_mask, 0.0)
