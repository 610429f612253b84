"""Fused twin of Mixture-of-Experts blocks, and the expert load it can record.

:class:`FusedMoE` replaces a block made of a router, the routed experts held as 3-D
Parameters (Hugging Face's layout: ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I],
or transposed as gpt-oss and Llama 4 store them, with optional biases) and optionally a
shared expert added to every token (DeepSeek-V3, Llama 4). It calls the block's own router
module, so the router's routing (softmax or sigmoid, top-k, normalisation, DeepSeek's
group-limited choice with its correction bias) is exactly the model's, and the hooks Hugging
Face puts on the router to collect ``router_logits`` (``output_router_logits=True`` and the
auxiliary load-balancing loss) still fire. The experts then run as one fused op
(:func:`te_lab.kernels.moe_experts`): a token permutation, one grouped GEMM pass per
projection over all experts, the weighted un-permutation. The shared expert is called as
the original's child module.

Routers come in two kinds (``router_output``): ``"top_k"`` returns ``(router_logits, top-k
weights, top-k indices)`` (Mixtral, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V3);
``"dense_scores"`` returns ``(scores, router_logits)``, the scores [tokens, experts] zero
outside each token's top ``top_k`` logits (Llama 4: the sigmoid of those logits), whose
indices the twin takes by the same ``torch.topk`` of the logits. Where the scores scale
each expert's input rather than its output (``scales_input``, Llama 4's ``x * score``),
each token-expert pair's scaled input is one row of the fused op, weighted by 1, and a
token's k rows are summed; such experts (Llama 4's run as ``torch.bmm``) compute under
autocast in autocast's dtype and return it, as ``torch.bmm`` does, where the others
(``grouped_mm``, on no autocast list) compute in their weights' dtype. The block returns
its output alone, or with the top-k weights (gpt-oss) or the router logits (Llama 4)
(``returns``), shaped as the hidden states or, as Llama 4's, [tokens, hidden]
(``flat_output``).

Expert load: while a twin records (:func:`record_expert_load`), each call adds the number of
tokens routed to each expert to a per-twin count, on the device, without waiting for it
(a scatter-add into a tensor of one count per expert); :func:`expert_load` reads the counts
of every fused MoE block of a model, and :func:`imbalance` their max / mean.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from te_lab.kernels.moe import MOE, moe_experts

from .base import FusedModule

ROUTER_OUTPUTS = ("top_k", "dense_scores")
BLOCK_OUTPUTS = ("out", "weights", "logits")


class FusedMoE(FusedModule):
    ops = (MOE,)

    def __init__(self, original: nn.Module, *, router: str, experts: str, shared: Optional[str] = None,
                 transposed: bool, interleaved: bool, activation: str, alpha: float, limit: float,
                 router_output: str = "top_k", top_k: Optional[int] = None, scales_input: bool = False,
                 returns: str = "out", flat_output: bool = False, backend: Optional[str] = None):
        """``router`` and ``experts`` name the original's children (``shared`` its shared
        expert, if any); ``router_output``, ``top_k`` (for ``"dense_scores"`` routers),
        ``scales_input`` and ``returns`` (``"out"``, ``"weights"`` or ``"logits"``) as the
        module doc says; ``flat_output``: the block returns [tokens, hidden] (Llama 4), not
        the hidden states' shape. The rest is :func:`te_lab.kernels.moe_experts`'s."""
        super().__init__(original, backend)
        if router_output not in ROUTER_OUTPUTS or returns not in BLOCK_OUTPUTS:
            raise ValueError(f"FusedMoE: router_output must be one of {ROUTER_OUTPUTS} and returns one of "
                             f"{BLOCK_OUTPUTS}, got {router_output!r} and {returns!r}")
        if router_output == "dense_scores" and not (isinstance(top_k, int) and top_k >= 1):
            raise ValueError(f"FusedMoE: a 'dense_scores' router needs top_k, a positive int, got {top_k!r}")
        self.router_name, self.experts_name, self.shared_name = router, experts, shared
        self.transposed, self.interleaved = transposed, interleaved
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.router_output, self.top_k, self.scales_input, self.returns = router_output, top_k, scales_input, returns
        self.flat_output = flat_output
        self.called_children = (router,) + ((shared,) if shared else ())
        self.recording_load = False
        # Tokens routed to each expert over the calls made while recording (int64, on the
        # experts' device); not a buffer, so state_dict is unchanged by a swap.
        self.tokens_per_expert: Optional[Tensor] = None

    def expert_parameters(self) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
        """(gate_up, down, gate_up_bias or None, down_bias or None): the experts' own Parameters."""
        experts = self._modules[self.experts_name]
        return (experts.gate_up_proj, experts.down_proj, getattr(experts, "gate_up_proj_bias", None),
                getattr(experts, "down_proj_bias", None))

    def forward(self, hidden_states: Tensor):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits, weights, indices = self._route(x)
        gate_up, down, gate_up_bias, down_bias = self.expert_parameters()
        options = dict(transposed=self.transposed, interleaved=self.interleaved, activation=self.activation,
                       alpha=self.alpha, limit=self.limit, backend=self.backend_for(MOE))
        if self.scales_input:
            device = x.device.type
            if torch.is_autocast_enabled(device):
                gate_up, down, gate_up_bias, down_bias = (
                    None if t is None else t.to(torch.get_autocast_dtype(device))
                    for t in (gate_up, down, gate_up_bias, down_bias))
            tokens, top_k = indices.shape
            # Each pair's input scaled in x's dtype, as Llama 4 computes x * score.
            rows = (x.unsqueeze(1) * weights.unsqueeze(-1).to(x.dtype)).reshape(tokens * top_k, -1)
            ones = torch.ones((tokens * top_k, 1), dtype=gate_up.dtype, device=rows.device)
            out = moe_experts(rows.to(gate_up.dtype), ones, indices.reshape(-1, 1), gate_up, down, gate_up_bias,
                              down_bias, **options).view(tokens, top_k, -1).sum(1)
        else:
            # The experts compute in their weights' dtype and return the hidden states' (as
            # Hugging Face's grouped_mm experts do, under autocast too).
            out = moe_experts(x.to(gate_up.dtype), weights, indices, gate_up, down, gate_up_bias, down_bias,
                              **options).to(hidden_states.dtype)
        # The shared expert sees the hidden states in the shape the block returns, as the original's does.
        shaped = x if self.flat_output else hidden_states
        out = out.view(shaped.shape)
        if self.recording_load:
            self._count(indices, gate_up.shape[0])
        if self.shared_name is not None:
            out = out + self._modules[self.shared_name](shaped)
        if self.returns == "out":
            return out
        return out, (weights if self.returns == "weights" else logits)

    def _route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(router logits, top-k weights, top-k indices) from the block's own router."""
        output = self._modules[self.router_name](x)
        if self.router_output == "top_k":
            return output
        scores, logits = output
        indices = torch.topk(logits, self.top_k, dim=-1).indices
        return logits, scores.gather(-1, indices), indices

    def _count(self, indices: Tensor, experts: int) -> None:
        flat = indices.detach().reshape(-1)
        if self.tokens_per_expert is None:
            self.tokens_per_expert = torch.zeros(experts, dtype=torch.int64, device=flat.device)
        self.tokens_per_expert.scatter_add_(0, flat, torch.ones_like(flat))

    def extra_repr(self) -> str:
        shared = f", shared={self.shared_name}" if self.shared_name else ""
        layout = (("transposed" if self.transposed else "linear") + (", interleaved" if self.interleaved else "")
                  + (", scales input" if self.scales_input else ""))
        return (f"router={self.router_name}, experts={self.experts_name}{shared}, {layout}, {self.activation}, "
                + super().extra_repr())


def _fused_moe_blocks(model: nn.Module) -> Iterator[tuple[str, FusedMoE]]:
    for path, module in model.named_modules():
        if isinstance(module, FusedMoE):
            yield path, module


@contextlib.contextmanager
def record_expert_load(model: nn.Module, *, reset: bool = True) -> Iterator[None]:
    """Within the block, every fused MoE block of ``model`` counts the tokens routed to each
    of its experts (``reset``: from zero); the counts stay readable by :func:`expert_load`
    after it. Raises a ``ValueError`` when ``model`` has no fused MoE block."""
    blocks = [block for _, block in _fused_moe_blocks(model)]
    if not blocks:
        raise ValueError("record_expert_load: the model has no fused MoE block (te_lab.fuse it first; "
                         "the rule is 'moe')")
    previous = [block.recording_load for block in blocks]
    for block in blocks:
        if reset:
            block.tokens_per_expert = None
        block.recording_load = True
    try:
        yield
    finally:
        for block, was in zip(blocks, previous):
            block.recording_load = was


def expert_load(model: nn.Module) -> dict[str, list[int]]:
    """Layer path -> tokens routed to each expert, for every fused MoE block of ``model`` that
    recorded (:func:`record_expert_load`); a token sent to k experts counts once for each.
    Reading the counts waits for the device."""
    return {path: block.tokens_per_expert.tolist() for path, block in _fused_moe_blocks(model)
            if block.tokens_per_expert is not None}


def imbalance(counts: list[int]) -> float:
    """The imbalance factor of one layer's expert load: the busiest expert's tokens over the
    mean (1.0: perfectly balanced; the number of experts: one expert took everything)."""
    if not counts or sum(counts) == 0:
        raise ValueError(f"imbalance: counts must hold at least one routed token, got {counts!r}")
    return max(counts) * len(counts) / sum(counts)
