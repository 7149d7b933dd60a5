"""Tiny random-weight models of every family issue 33's bar names and of others it does not
(Falcon, Cohere, MPT, GPT-J, GPT-NeoX, StarCoder2, StableLM, Granite, Gemma 2), with their default
configs: shared by the family bar and the indexed-chain tests."""

from __future__ import annotations

import torch
import transformers as T

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 128, 4, 2, 256, 2, 100  # head dim 32: the kernels' smallest
COMMON = {"num_hidden_layers": LAYERS, "hidden_size": HIDDEN, "num_attention_heads": HEADS,
          "intermediate_size": FFN, "vocab_size": VOCAB}
DECODER = {"num_key_value_heads": KV_HEADS, **COMMON}
FAMILIES = {
    "bert": lambda: T.BertModel(T.BertConfig(**COMMON)),
    "roberta": lambda: T.RobertaModel(T.RobertaConfig(**COMMON)),
    "distilbert": lambda: T.DistilBertModel(T.DistilBertConfig(n_layers=LAYERS, dim=HIDDEN, n_heads=HEADS,
                                                               hidden_dim=FFN, vocab_size=VOCAB)),
    "gpt2": lambda: T.GPT2Model(T.GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB,
                                             bos_token_id=0, eos_token_id=0)),
    "llama": lambda: T.LlamaModel(T.LlamaConfig(**DECODER)),
    "llama_eager": lambda: T.LlamaModel(T.LlamaConfig(attn_implementation="eager", **DECODER)),
    "mistral": lambda: T.MistralModel(T.MistralConfig(sliding_window=16, **DECODER)),
    "qwen2": lambda: T.Qwen2Model(T.Qwen2Config(**DECODER)),
    "qwen3": lambda: T.Qwen3Model(T.Qwen3Config(head_dim=HIDDEN // HEADS, **DECODER)),
    "gemma3": lambda: T.Gemma3TextModel(T.Gemma3TextConfig(head_dim=HIDDEN // HEADS, sliding_window=16, **DECODER)),
    "olmo2": lambda: T.Olmo2Model(T.Olmo2Config(eos_token_id=0, pad_token_id=0, **DECODER)),
    "phi3": lambda: T.Phi3Model(T.Phi3Config(pad_token_id=0, eos_token_id=0, **DECODER)),
    "bloom": lambda: T.BloomModel(T.BloomConfig(n_layer=LAYERS, hidden_size=HIDDEN, n_head=HEADS, vocab_size=VOCAB)),
    "falcon": lambda: T.FalconModel(T.FalconConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN,
                                                   num_attention_heads=HEADS, vocab_size=VOCAB)),
    "cohere": lambda: T.CohereModel(T.CohereConfig(eos_token_id=0, pad_token_id=0, bos_token_id=0, **DECODER)),
    "mpt": lambda: T.MptModel(T.MptConfig(n_layers=LAYERS, d_model=HIDDEN, n_heads=HEADS, vocab_size=VOCAB)),
    "gptj": lambda: T.GPTJModel(T.GPTJConfig(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB,
                                             rotary_dim=16)),
    "gpt_neox": lambda: T.GPTNeoXModel(T.GPTNeoXConfig(**COMMON)),
    "starcoder2": lambda: T.Starcoder2Model(T.Starcoder2Config(**DECODER)),
    "stablelm": lambda: T.StableLmModel(T.StableLmConfig(**DECODER)),
    "granite": lambda: T.GraniteModel(T.GraniteConfig(**DECODER)),
    # eager: the one implementation that softcaps in every transformers release (5.17 defaults to sdpa, which drops it)
    "gemma2": lambda: T.Gemma2Model(T.Gemma2Config(head_dim=HIDDEN // HEADS, attn_implementation="eager", **DECODER)),
    "t5": lambda: T.T5EncoderModel(T.T5Config(num_layers=LAYERS, d_model=HIDDEN, num_heads=HEADS,
                                              d_kv=HIDDEN // HEADS, d_ff=FFN, vocab_size=VOCAB)),
    "vit": lambda: T.ViTModel(T.ViTConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                          intermediate_size=FFN, image_size=32, patch_size=8)),
    "encoder_layer": lambda: torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu", batch_first=True),
        LAYERS, enable_nested_tensor=False),
}


def build(family: str, device: str = "cpu") -> tuple[torch.nn.Module, dict, torch.Tensor]:
    """(model, inputs, real positions [B, S]): batch 2, 64 tokens, the second sequence right-padded."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval().to(device)
    tokens = torch.ones(2, 64, dtype=torch.bool, device=device)
    if family == "vit":
        return model, {"pixel_values": torch.randn(2, 3, 32, 32, device=device)}, torch.ones(2, 17, dtype=torch.bool)
    tokens[1, 40:] = False
    if family == "encoder_layer":
        return model, {"src": torch.randn(2, 64, HIDDEN, device=device), "src_key_padding_mask": ~tokens}, tokens
    return model, {"input_ids": torch.randint(0, VOCAB, (2, 64), device=device),
                   "attention_mask": tokens.long()}, tokens


def last_hidden(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state
SOFTCAPPED = ("gemma2",)  # attention runs in torch: softcapping is not in the kernels yet
