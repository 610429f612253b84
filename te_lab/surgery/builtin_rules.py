"""The built-in fusion rules, in the one order they are tried: ``te_lab.rules()`` lists
them after the user's rules in this order, a module that several rules answer is offered
to them in it (the first rule's twins that pass the probe are kept), and fusion reports
group their rows by it.

Within a kind the more specific structure comes first: RMSNorm, then the residual add
with its LayerNorm (BERT's output blocks), then a plain LayerNorm; the gated MLP before
the plain one, then Mixture-of-Experts blocks. Attention is followed by RoPE, which the
attention twin carries out (``realized_by``); the LM head with its loss comes last, as
the one rule that replaces a forward rather than a module. A rule module defines its
rules; only this list registers them (``tests/test_fuse.py`` checks that it holds every
rule the rule modules define).
"""

from .attention_rules import ATTENTION, ROPE
from .lm_head_rule import LM_HEAD_LOSS
from .mlp_rules import GATED_MLP, MLP
from .moe_rules import MOE
from .norm_rules import LAYERNORM, RESIDUAL_LAYERNORM, RMSNORM
from .rules import register_builtin_rule

BUILT_IN_RULES = (RMSNORM, RESIDUAL_LAYERNORM, LAYERNORM, GATED_MLP, MLP, MOE, ATTENTION, ROPE, LM_HEAD_LOSS)

for _rule in BUILT_IN_RULES:
    register_builtin_rule(_rule)
