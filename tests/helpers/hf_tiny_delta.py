"""Tiny random-initialised transformers models with gated delta rule layers (no downloads).

Two layers each (one delta-rule layer and one attention layer, except where noted), hidden size
32, value heads a multiple of key heads as in the released models (GDN), or one head count (KDA).
"""

import pytest
import torch

from qstate.integrations.hf_import import import_transformers

pytest.importorskip("transformers")
transformers = import_transformers()
transformers.logging.set_verbosity_error()

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               head_dim=16, intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def qwen3_next(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Qwen3NextConfig(**_COMMON, **_GDN, **_MOE, decoder_sparse_step=1)
    return transformers.Qwen3NextForCausalLM(config).eval()


def qwen3_5(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(**_COMMON, **_GDN)
    return transformers.Qwen3_5ForCausalLM(config).eval()


def qwen3_5_moe(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Qwen3_5MoeTextConfig(**_COMMON, **_GDN, **_MOE)
    return transformers.Qwen3_5MoeForCausalLM(config).eval()


def kimi_linear(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_token=2,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        linear_attn_config={"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [1],
                            "full_attn_layers": [2]},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.KimiLinearForCausalLM(config).eval()


MODELS = {"qwen3_next": qwen3_next, "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe, "kimi_linear": kimi_linear}


def prompt(batch: int = 2, length: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


class FlaBindingRelease:
    """Makes the GDN layers of a tiny model decode as those of the releases that bind the step to
    each layer at construction, with flash-linear-attention installed: the layer holds fla's
    ``fused_recurrent_gated_delta_rule`` as ``recurrent_gated_delta_rule`` and its decode calls
    that attribute, never the module-level name. The installed release calls the module-level
    name, so each layer gets an own ``forward`` that points that name at the layer's attribute
    for the duration of the call. The fla function here is a stand-in with fla's name and
    signature that counts its calls and computes with transformers' torch function: on a CPU,
    the real fla would not run, and installed or not, the installed release's layers would not
    bind it."""

    ATTRIBUTE = "recurrent_gated_delta_rule"
    FUNCTION = "torch_recurrent_gated_delta_rule"

    def __init__(self, model):
        import sys

        self.calls = 0
        self.layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
        module = sys.modules[type(self.layers[0]).__module__]
        torch_step = getattr(module, self.FUNCTION)

        def fused_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                             output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
            self.calls += 1
            return torch_step(q, k, v, g=g, beta=beta, initial_state=initial_state,
                              output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

        fused_recurrent_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule.fused_recurrent"
        self.fla_function = fused_recurrent_gated_delta_rule
        for layer in self.layers:
            setattr(layer, self.ATTRIBUTE, fused_recurrent_gated_delta_rule)

            def forward(*args, _layer=layer, _inner=layer.forward, **kwargs):
                name = getattr(module, self.FUNCTION)
                setattr(module, self.FUNCTION, getattr(_layer, self.ATTRIBUTE))
                try:
                    return _inner(*args, **kwargs)
                finally:
                    setattr(module, self.FUNCTION, name)

            layer.forward = forward
