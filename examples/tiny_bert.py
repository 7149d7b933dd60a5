"""A small transformers BertModel (random weights, eager attention) with a padding mask.

`factory()` returns (module, example_args, example_kwargs) for `stof-cc inspect
examples/tiny_bert.py:factory`. No weights are downloaded: the model is built from a
BertConfig. Needs the `hf` extra (transformers).
"""

import torch


def factory(batch: int = 2, seq: int = 32, hidden: int = 128, layers: int = 2, heads: int = 4):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=max(512, seq),
        attn_implementation="eager",
    )
    model = BertModel(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (batch, seq))
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[-1, seq * 3 // 4 :] = 0  # the last sequence is padded
    return model, (input_ids,), {"attention_mask": attention_mask}


if __name__ == "__main__":
    model, args, kwargs = factory()
    print(model(*args, **kwargs).last_hidden_state.shape)
