"""Tiny random-initialised transformers models for the integration tests (no downloads).

Head shapes are the published ones scaled down: Mamba2 with one group like
Mamba2-2.7B, Nemotron-H with two groups and attention and MLP layers between the Mamba ones.
"""

import pytest
import torch

from qstate.integrations.hf_import import import_transformers

pytest.importorskip("transformers")
# A checkout's kernels/ would shadow the kernels package transformers >= 5.25 imports.
transformers = import_transformers()
transformers.logging.set_verbosity_error()

VOCAB = 128


def mamba2(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=16,
        n_groups=1, expand=2, chunk_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.Mamba2ForCausalLM(config).eval()


def nemotron_h(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, layers_block_type=["mamba", "attention", "mamba", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.NemotronHForCausalLM(config).eval()


def prompt(batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate(model, input_ids, new_tokens):
    """Greedy generate with the raw logits of every step (eos suppressed so every run is full length)."""
    with torch.no_grad():
        return model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
