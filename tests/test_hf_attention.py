"""attn_implementation="stof_cc" (stof_cc/hf.py): registration, the description the mask function
makes of each transformers mask (checked element for element against transformers' own dense
mask), key padding, the refusals; models run end to end on the CPU (through transformers' SDPA,
as documented) with the descriptions each layer type gets; on the GPU, stof-cc's kernels run the
prefill and match sdpa."""

from __future__ import annotations

import copy
import itertools
import pickle
import warnings
from typing import Any

import numpy
import pytest
import torch

pytest.importorskip("transformers")

import transformers as T  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

import stof_cc.hf  # noqa: E402

SEQ = 48
SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 256, "vocab_size": 100}


def _transformers_dense(mask_function, batch: int = 2, attention_mask=None) -> torch.Tensor:
    return mu.sdpa_mask(batch_size=batch, q_length=SEQ, kv_length=SEQ, mask_function=mask_function,
                        attention_mask=attention_mask, allow_is_causal_skip=False)


def _same_mask(description, mask_function) -> None:
    want = _transformers_dense(mask_function)
    got = torch.ones_like(want) if description is None else description.to_dense(SEQ, SEQ, batch=want.shape[0]).expand_as(want)
    assert torch.equal(got, want)

def _recorded_masks(monkeypatch) -> list:
    """Registers the implementation; the list fills with the mask of each call that runs in
    SDPA (every call, on the CPU)."""
    stof_cc.hf.register()
    seen = []
    fallback = stof_cc.hf._fallback

    def recording(module, query, key, value, mask, *args, **kwargs):
        seen.append(mask)
        return fallback(module, query, key, value, mask, *args, **kwargs)

    monkeypatch.setattr(stof_cc.hf, "_fallback", recording)
    return seen



def test_registering_makes_the_implementation_available():
    stof_cc.hf.register()
    assert T.AttentionInterface._global_mapping["stof_cc"] is stof_cc.hf.attention_forward
    assert mu.AttentionMaskInterface._global_mapping["stof_cc"] is stof_cc.hf.mask_for_layer
    model = T.LlamaModel._from_config(T.LlamaConfig(**SMALL), attn_implementation="stof_cc")
    assert model.config._attn_implementation == "stof_cc"


@pytest.mark.parametrize(("name", "mask_function", "label"), [
    ("causal", mu.causal_mask_function, "causal()"),
    ("bidirectional", mu.bidirectional_mask_function, None),
    ("sliding window", mu.sliding_window_causal_mask_function(8), "sliding_window(w=7, causal=True)"),
    # ModernBERT's local layers, |q - k| <= 4: a mask_mod rebuilt on the host every call before (found by review)
    ("bidirectional window", mu.sliding_window_bidirectional_overlay(4), "sliding_window(w=4)"),
    ("bidirectional window under and_masks",
     mu.and_masks(mu.bidirectional_mask_function, mu.sliding_window_bidirectional_overlay(4)), "sliding_window(w=4)"),
])
def test_known_masks_become_zoo_descriptions(name, mask_function, label):
    description = stof_cc.hf.describe(mask_function)
    assert (None if description is None else repr(description)) == label, name
    _same_mask(description, mask_function)


@pytest.mark.parametrize("window", [0, 1])
def test_windows_under_two_are_described_as_written(window):
    """Qwen2-MoE's default config has sliding_window 0 and builds that mask without using it: it
    raised (sliding_window(w=-1)); a window of 0 or 1 is now its own exact mask."""
    mask_function = mu.sliding_window_causal_mask_function(window)
    _same_mask(stof_cc.hf.describe(mask_function), mask_function)


def test_packed_sequences_become_documents():
    documents = torch.tensor([[0] * 20 + [1] * 28, [0] * 5 + [1] * 30 + [2] * 13])
    packed = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(documents))
    description = stof_cc.hf.describe(packed)
    assert repr(description) == "(causal() & document(segment_ids=<2x48>))"
    _same_mask(description, packed)
    if hasattr(mu, "remap_positions_for_packed_sequence"):  # 5.2x: the window on per-document positions
        positions = torch.cat([torch.cat([torch.arange(n) for n in lengths])[None]
                               for lengths in ((20, 28), (5, 30, 13))])
        window = mu.remap_positions_for_packed_sequence(mu.sliding_window_causal_mask_function(8), positions)
        remapped = mu.and_masks(window, mu.packed_sequence_mask_function(documents))
        description = stof_cc.hf.describe(remapped)
        assert repr(description) == "(sliding_window(w=7, causal=True) & document(segment_ids=<2x48>))"
        _same_mask(description, remapped)


def test_other_masks_become_exact_mask_mods():
    chunked = mu.chunked_causal_mask_function(16, torch.zeros(2, dtype=torch.long))
    assert "from_mask_mod" in repr(stof_cc.hf.describe(chunked))
    _same_mask(stof_cc.hf.describe(chunked), chunked)


def test_padding_becomes_key_padding():
    attention_mask = torch.ones(2, SEQ, dtype=torch.long)
    attention_mask[1, :7] = 0  # left padding
    found = stof_cc.hf.mask_for_layer(2, SEQ, SEQ, mask_function=mu.causal_mask_function,
                                      attention_mask=attention_mask)
    assert torch.equal(found.key_padding, attention_mask.bool()) and repr(found.description) == "causal()"
    assert stof_cc.hf.mask_for_layer(2, SEQ, SEQ, attention_mask=torch.ones(2, SEQ)).key_padding is None
    want = _transformers_dense(mu.causal_mask_function, attention_mask=attention_mask)
    assert torch.equal(found.dense(), want)  # what SDPA gets where it runs instead


@pytest.mark.parametrize(("family", "config", "labels"), [
    ("llama", T.LlamaConfig(**SMALL), {"causal()"}),
    ("mistral", T.MistralConfig(sliding_window=16, **SMALL), {"sliding_window(w=15, causal=True)"}),
    ("gemma3", T.Gemma3TextConfig(head_dim=32, sliding_window=16, sliding_window_pattern=2, **SMALL),
     {"causal()", "sliding_window(w=15, causal=True)"}),
    ("bert", T.BertConfig(**{k: v for k, v in SMALL.items() if k != "num_key_value_heads"}), {None}),
])
def test_a_model_on_the_cpu_matches_sdpa_and_each_layer_gets_its_mask(family, config, labels, monkeypatch):
    stof_cc.hf.register()
    seen = []
    fallback = stof_cc.hf._fallback

    def recording(module, query, key, value, mask, *args, **kwargs):
        seen.append(None if mask is None or mask.description is None else repr(mask.description))
        return fallback(module, query, key, value, mask, *args, **kwargs)

    monkeypatch.setattr(stof_cc.hf, "_fallback", recording)
    torch.manual_seed(0)
    # each model its own config: transformers sets the implementation on the config it is given
    ours = T.AutoModel.from_config(copy.deepcopy(config), attn_implementation="stof_cc").eval()
    theirs = T.AutoModel.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 100, (2, SEQ))
    attention_mask = torch.ones(2, SEQ, dtype=torch.long)
    attention_mask[1, SEQ - 9:] = 0  # right padding in the second sequence
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ours(input_ids=ids, attention_mask=attention_mask).last_hidden_state
        want = theirs(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert set(seen) == labels and len(seen) == config.num_hidden_layers
    assert any("on the CPU" in str(w.message) for w in caught) or any("on the CPU" in w for w in stof_cc.hf._WARNED)


def test_t5s_position_bias_is_added_to_the_scores():
    stof_cc.hf.register()
    config = T.T5Config(num_layers=2, d_model=128, num_heads=4, d_kv=32, d_ff=256, vocab_size=100)
    torch.manual_seed(0)
    ours = T.T5EncoderModel._from_config(copy.deepcopy(config), attn_implementation="stof_cc").eval()
    theirs = T.T5EncoderModel._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 100, (2, 24))
    attention_mask = torch.ones(2, 24, dtype=torch.long)
    attention_mask[1, 18:] = 0
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=attention_mask).last_hidden_state
        want = theirs(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_autograd_on_runs_in_sdpa_and_says_why(monkeypatch):
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())
    q = torch.randn(1, 2, 8, 32, requires_grad=True)
    with pytest.warns(UserWarning, match="autograd is on"):
        out, _ = stof_cc.hf.attention_forward(torch.nn.Module().eval(), q, q, q, None)
    assert out.requires_grad and out.shape == (1, 8, 2, 32)


def test_learned_queries_over_a_batch_of_keys_run_in_sdpa_and_say_why(monkeypatch):
    """Queries of batch 1 over keys of batch B (learned queries: SDPA broadcasts them, and transformers'
    SDPA path says models do it) ran into the kernels' layout check, an error (a helper's review)."""
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())
    q, k, v = torch.randn(1, 2, 4, 32), torch.randn(3, 2, 8, 32), torch.randn(3, 2, 8, 32)
    module = torch.nn.Module().eval()
    module.is_causal = False  # cross-attention
    with pytest.warns(UserWarning, match="queries of batch 1 over keys of batch 3"):
        out, _ = stof_cc.hf.attention_forward(module, q, k, v, None)
    want = torch.nn.functional.scaled_dot_product_attention(q.expand(3, -1, -1, -1), k, v).transpose(1, 2)
    torch.testing.assert_close(out, want)


def test_what_is_refused_is_named():
    module = torch.nn.Module()
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match="softcap"):
        stof_cc.hf.attention_forward(module, q, q, q, None, softcap=50.0)
    with pytest.raises(ValueError, match="attention sinks twice"):
        stof_cc.hf.attention_forward(module, q, q, q, None, s_aux=torch.zeros(2), sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="does not read block_indices"):  # MiniMax-M3's sparse blocks: ran dense
        stof_cc.hf.attention_forward(module, q, q, q, None, block_indices=torch.zeros(1, 2, 2, dtype=torch.long))
    module.train()
    with pytest.raises(ValueError, match="inference-only"):
        stof_cc.hf.attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(TypeError, match="not the description"):
        stof_cc.hf.attention_forward(module.eval(), q, q, q, "causal")


def test_a_mask_tensor_the_caller_built_runs_in_sdpa_as_given(monkeypatch):
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())  # each reason is said once per process
    module = torch.nn.Module().eval()
    q, k, v = (torch.randn(1, 2, 8, 32) for _ in range(3))
    allowed = torch.rand(1, 1, 8, 8) > 0.3
    allowed[..., 0] = True
    with pytest.warns(UserWarning, match="the caller passed a mask tensor"):
        got, weights = stof_cc.hf.attention_forward(module, q, k, v, allowed)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)
    torch.testing.assert_close(got, want)
    assert weights is None


@pytest.mark.gpu
def test_t5s_position_bias_reaches_the_kernels_and_matches_eager(monkeypatch):
    stof_cc.hf.register()
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())
    config = T.T5Config(num_layers=2, d_model=128, num_heads=4, d_kv=32, d_ff=256, vocab_size=100)
    torch.manual_seed(0)
    ours = T.T5EncoderModel._from_config(copy.deepcopy(config), attn_implementation="stof_cc").half().cuda().eval()
    theirs = T.T5EncoderModel._from_config(copy.deepcopy(config), attn_implementation="eager").cuda().eval()
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 100, (2, 256), device="cuda")
    attention_mask = torch.ones(2, 256, dtype=torch.long, device="cuda")
    attention_mask[1, 200:] = 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="attn_implementation='stof_cc'")  # no fallback
        got = ours(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    with torch.no_grad():
        want = theirs.float()(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    real = attention_mask.bool()
    assert torch.linalg.norm((got.float() - want)[real]) / torch.linalg.norm(want[real]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("config", [T.LlamaConfig(**SMALL), T.MistralConfig(sliding_window=16, **SMALL),
                                    T.Gemma3TextConfig(head_dim=32, sliding_window=16, **SMALL)])
def test_the_prefill_runs_stof_cc_kernels_and_matches_sdpa(config, monkeypatch):
    stof_cc.hf.register()
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())  # any fallback warns here, even one said before
    torch.manual_seed(0)
    ours = T.AutoModel.from_config(copy.deepcopy(config), attn_implementation="stof_cc").half().cuda().eval()
    theirs = T.AutoModel.from_config(copy.deepcopy(config), attn_implementation="sdpa").half().cuda().eval()
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 100, (2, 256), device="cuda")
    attention_mask = torch.ones(2, 256, dtype=torch.long, device="cuda")
    attention_mask[1, :40] = 0  # left padding, as generation pads
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="attn_implementation='stof_cc'")  # no layer falls back to SDPA
        got = ours(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    with torch.no_grad():
        want = theirs(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    real = attention_mask.bool()
    error = torch.linalg.norm((got - want)[real].float()) / torch.linalg.norm(want[real].float())
    assert error < 1e-2


def _twins(config) -> tuple[torch.nn.Module, torch.nn.Module]:
    """One random-weight causal LM on attn_implementation="stof_cc" and on "sdpa", same weights."""
    stof_cc.hf.register()
    torch.manual_seed(0)
    ours = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="stof_cc").eval()
    theirs = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _greedy_both(config, prompt_length: int, padding: int, new_tokens: int, **settings) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generate() of `_twins` from a batch of two prompts, the second left-padded by
    ``padding``, as generation pads."""
    ours, theirs = _twins(config)
    prompt = torch.randint(1, 100, (2, prompt_length))
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :padding] = 0
    settings = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0} | settings
    with torch.no_grad():
        return (ours.generate(prompt, attention_mask=attention_mask, **settings),
                theirs.generate(prompt, attention_mask=attention_mask, **settings))


@pytest.fixture
def decode_stand_in(monkeypatch) -> list:
    """`DECODE_KERNEL` on, the kernel replaced by tests/test_decode_attention.py's float32 reference
    (on the CPU); the list fills with each call's (tokens, keys, mask, q_position, k_position)."""
    from test_decode_attention import _reference

    calls = []

    def stand_in(q, k, v, mask, *, scale, q_position, k_position, key_padding, sinks=None):
        calls.append((q.shape[2], k.shape[2], mask, q_position, k_position))
        return _reference(q, k, v, mask, scale, q_position, k_position, key_padding, sinks).to(q.dtype)

    monkeypatch.setattr(stof_cc.hf, "DECODE_KERNEL", True)
    monkeypatch.setattr(stof_cc.hf, "decode_unsupported", lambda q, k, mask: None)
    monkeypatch.setattr(stof_cc.hf, "decode_attention", stand_in)
    return calls


GEMMA3 = T.Gemma3TextConfig(sliding_window=8, layer_types=["sliding_attention", "full_attention"], head_dim=64, **SMALL)
QWEN2_WINDOW = T.Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **SMALL)


def test_generate_runs_its_decode_steps_through_sdpa_and_gives_sdpas_tokens():
    """The prefill and every decode step (queries against a longer cache: SDPA, said once) on
    the CPU, greedy: the same tokens as attn_implementation="sdpa"."""
    got, want = _greedy_both(T.LlamaConfig(**SMALL), 12, 3, 6)
    assert torch.equal(got, want) and got.shape == (2, 18)


@pytest.mark.parametrize("config", [T.LlamaConfig(**SMALL), T.MistralConfig(sliding_window=8, **SMALL)])
def test_with_the_decode_kernel_on_generate_gives_sdpas_tokens(config, decode_stand_in):
    """`DECODE_KERNEL` on, the kernel a CPU stand-in: every decode step with a masked key goes to
    `decode_attention` with its band, positions and padding, the prefill does not, and greedy tokens
    match sdpa's, with left padding and past Mistral's window. Mistral's cache keeps its window: once
    the padded keys have left it every key counts, and those steps run in SDPA (faster there)."""
    got, want = _greedy_both(config, 6, 2, 8)
    assert torch.equal(got, want)
    steps = 7 * config.num_hidden_layers  # every step after the prefill, every layer
    assert len(decode_stand_in) == steps if config.model_type == "llama" else 0 < len(decode_stand_in) < steps
    assert all(tokens == 1 and q_position == k_position + keys - 1
               for tokens, keys, _, q_position, k_position in decode_stand_in)


def test_a_decode_step_over_its_whole_cache_runs_in_sdpa(decode_stand_in):
    """No padding and a causal mask: every key counts, where SDPA's flash kernel is faster than the
    decode kernel (benchmarks/decode.py): such steps go there, quietly, and give sdpa's tokens."""
    ours, theirs = _twins(T.LlamaConfig(**SMALL))
    prompt = torch.randint(1, 100, (2, 6))
    settings = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ours.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    with torch.no_grad():
        want = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    assert torch.equal(got, want) and not decode_stand_in
    assert not [w for w in caught if "decode" in str(w.message)]


@pytest.mark.parametrize("config", [T.LlamaConfig(**SMALL), T.MistralConfig(sliding_window=8, **SMALL)])
def test_generate_with_a_static_cache_gives_sdpas_tokens(config):
    """generate() with a static cache makes each step's mask before the forward and hands it to the
    model, whose mask creation read it as a tensor: stof-cc raised for most families (a helper's hunt
    found it). The mask reads as a prepared 4-D one there now, and comes back as it was made."""
    got, want = _greedy_both(config, 12, 3, 6, cache_implementation="static")
    assert torch.equal(got, want)


@pytest.mark.parametrize("config", [GEMMA3, QWEN2_WINDOW, T.LlamaConfig(**SMALL), T.MistralConfig(sliding_window=8, **SMALL)])
def test_with_the_decode_kernel_on_static_caches_give_sdpas_tokens(config, decode_stand_in):
    """A static cache: the keys are its whole length (unwritten slots beyond the 2-D mask: not keys)
    and its position counter a device tensor that its update advances before the attention runs
    (a review found the positions one token late and the padding too short); the prefill into it
    (fewer queries than keys) takes the decode path too. Alternating and sliding-window layers."""
    got, want = _greedy_both(config, 12, 3, 6, cache_implementation="static")
    assert torch.equal(got, want)
    # Mistral's static cache is its window: the padded keys leave it in the prefill, and the steps
    # over a full window without padding run in SDPA (test_a_decode_step_over_its_whole_cache_runs_in_sdpa)
    assert decode_stand_in or config.model_type == "mistral"


def test_several_tokens_at_once_against_a_cache_give_sdpas_logits(decode_stand_in):
    """Chunks of three tokens fed with a dynamic cache past Mistral's window, left padding."""
    ours, theirs = _twins(T.MistralConfig(sliding_window=8, **SMALL))
    tokens = torch.randint(1, 100, (2, 16))
    attention_mask = torch.ones_like(tokens)
    attention_mask[1, :3] = 0
    caches = [T.DynamicCache(config=ours.config), T.DynamicCache(config=ours.config)]
    with torch.no_grad():
        for start, stop in ((0, 7), (7, 10), (10, 13), (13, 16)):
            got, want = (model(tokens[:, start:stop], attention_mask=attention_mask[:, :stop], past_key_values=cache,
                               use_cache=True).logits for model, cache in zip((ours, theirs), caches, strict=True))
            torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got[1, -1], want[1, -1], rtol=1e-4, atol=1e-4)
    assert any(tokens == 3 for tokens, *_ in decode_stand_in)


def test_a_static_cache_reused_after_a_reset_gives_sdpas_logits():
    """The SDPA fallback (decode kernel off) read a static cache's position counter after its update
    had advanced it: a cache reused after reset() let the prefill see later prompt tokens (logits
    0.48 off) and every decode step one slot too many. The mask keeps the counter's value now."""
    config = T.LlamaConfig(**SMALL)
    ours, theirs = _twins(config)
    tokens = torch.randint(1, 100, (2, 9))
    logits = []
    for model in (ours, theirs):
        cache = T.StaticCache(config=config, max_cache_len=20)
        with torch.no_grad():
            model(tokens[:, :3], past_key_values=cache, use_cache=True)
            cache.reset()
            steps = [model(tokens[:, :6], past_key_values=cache, use_cache=True).logits]
            steps += [model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True).logits for i in range(6, 9)]
        logits.append(steps)
    for got, want in zip(*logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


DECODE_SHAPES = SMALL | {"hidden_size": 256}  # head dim 64: the decode kernel takes 64 and 128


def assert_steps_match(ours, theirs, tokens, attention_mask, tolerance: float) -> None:
    """The prefill of ``tokens``, then six decode steps, each fed ``theirs``'s greedy token, both models with their
    own caches: every step's last logits within ``tolerance`` (relative) of ``theirs``'s."""
    caches = [None, None]
    with torch.no_grad():
        for step in range(7):
            outs = [model(tokens, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
                    for model, cache in zip((ours, theirs), caches, strict=True)]
            got, want = (out.logits[:, -1].float() for out in outs)
            assert float((got - want).norm() / want.norm()) < tolerance, step
            caches = [out.past_key_values for out in outs]
            tokens = want.argmax(-1, keepdim=True)
            attention_mask = torch.cat([attention_mask, torch.ones_like(tokens)], dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [T.LlamaConfig(**DECODE_SHAPES), T.MistralConfig(sliding_window=8, **DECODE_SHAPES)])
def test_on_the_gpu_the_decode_kernel_gives_sdpas_logits(config, monkeypatch):
    """The decode kernel itself (`DECODE_KERNEL` on) on the GPU, fp16: a prompt with left padding, then
    six decode steps fed sdpa's greedy tokens, past Mistral's window: every step's logits within 1e-2 of
    sdpa's, and no decode step in SDPA (the test's first run, at head dim 32, found the fallback's
    warning saying only "off or does not take it": it now names the kernel's reason)."""
    stof_cc.hf.register()
    monkeypatch.setattr(stof_cc.hf, "DECODE_KERNEL", True)
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())
    torch.manual_seed(0)
    ours = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="stof_cc")
    theirs = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours, theirs = (m.to("cuda", torch.float16).eval() for m in (ours, theirs))
    theirs.load_state_dict(ours.state_dict())
    tokens = torch.randint(1, 100, (2, 40), device="cuda")
    attention_mask = torch.ones_like(tokens)
    attention_mask[1, :9] = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_steps_match(ours, theirs, tokens, attention_mask, 1e-2)
    decode_fallbacks = [str(w.message) for w in caught if "decode" in str(w.message)]
    assert not decode_fallbacks, decode_fallbacks


def _generate_compiled(monkeypatch, config, device: str, dtype: torch.dtype, **settings) -> tuple[Any, Any]:
    """`_generate_both` in a fresh dynamo (transformers' forward wrappers are code shared by every model, and
    their recompiles count against one limit), asserting that the attention of the forward transformers
    compiled was traced: `_traced_attention` says once that SDPA runs the decode steps in the graph (the
    eager path says it without "in the compiled graph", or runs the decode kernel)."""
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        both = _generate_both(config, device, dtype, **settings)
    assert any("in the compiled graph" in str(w.message) for w in caught), [str(w.message) for w in caught]
    return both


def _generate_both(config, device: str, dtype: torch.dtype, **settings) -> tuple[Any, Any]:
    """Greedy generate() of `_twins` (on ``device`` in ``dtype``) with a static cache, each step's logits kept;
    the second of two prompts left-padded."""
    ours, theirs = (model.to(device, dtype) for model in _twins(config))
    prompt = torch.randint(1, 100, (2, 12), device=device)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :3] = 0
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "cache_implementation": "static",
                "output_logits": True, "return_dict_in_generate": True} | settings
    with torch.no_grad():
        return (ours.generate(prompt, attention_mask=attention_mask, **settings),
                theirs.generate(prompt, attention_mask=attention_mask, **settings))


def _assert_same_steps(got, want, tolerance: float) -> None:
    """Each step's logits within ``tolerance`` (relative) of sdpa's while both runs had the same tokens
    before it (random weights leave near-ties, where a last-bit difference picks another token)."""
    for step, (ours, theirs) in enumerate(zip(got.logits, want.logits, strict=True)):
        error = float((ours.float() - theirs.float()).norm() / theirs.float().norm())
        assert error < tolerance, (step, error)
        if not torch.equal(ours.argmax(-1), theirs.argmax(-1)):
            break


@pytest.mark.parametrize("config", [T.LlamaConfig(**SMALL), GEMMA3], ids=["llama", "gemma3"])
def test_a_compiled_generate_with_a_static_cache_traces_the_attention(config, monkeypatch):
    """generate() with a static cache compiles the forward on CUDA (transformers' own choice; here forced
    on the CPU) and hands it masks made ahead: the attention inside is traced, a node of the graph, not
    the eager path (a helper's review: its host reads broke the graph, and on CUDA the kernels launched
    between the pieces), and every step's logits are sdpa's. Gemma3 gets a mask per layer type and builds
    none in its forward: the first fix, in the mask function, missed it; the attention function converts."""
    compile_config = T.CompileConfig(mode="default")
    compile_config._compile_all_devices = True
    got, want = _generate_compiled(monkeypatch, config, "cpu", torch.float32, compile_config=compile_config)
    _assert_same_steps(got, want, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    T.LlamaConfig(**DECODE_SHAPES), T.MistralConfig(sliding_window=8, **DECODE_SHAPES),
    T.Gemma3TextConfig(sliding_window=8, layer_types=["sliding_attention", "full_attention"], head_dim=64,
                       **DECODE_SHAPES)], ids=["llama", "mistral", "gemma3"])
def test_on_the_gpu_generate_with_a_static_cache_compiles_and_gives_sdpas_logits(config, monkeypatch):
    """On CUDA, generate() with a static cache runs its decode steps in a forward transformers compiles
    (reduce-overhead: CUDA graphs): the attention traced inside it, every step's logits within 1e-2 of
    sdpa's (fp16), past Mistral's window, and Gemma3's masks handed over per layer type."""
    got, want = _generate_compiled(monkeypatch, config, "cuda", torch.float16, max_new_tokens=10)
    _assert_same_steps(got, want, 1e-2)


def test_a_layer_on_another_device_gets_the_padding_and_dense_mask_there():
    """A model split over GPUs (device_map) runs layers on each; the mask is made on the first and
    accelerate's hooks cannot move a description: the key padding and SDPA's dense mask are copied to
    the layer's device, once per forward (a helper's hunt found the decode kernel refusing the padding
    of another device, and the prefill and SDPA paths the same). 'meta' stands for a second GPU."""
    padding = torch.tensor([[True, True, False], [True, True, True]])
    mask = stof_cc.hf.HFMask(stof_cc.hf.CAUSAL, padding, {})
    mask._dense, mask._built = padding[:, None, None, :], True
    other = torch.device("meta")
    assert mask.key_padding_on(torch.device("cpu")) is padding
    moved = mask.key_padding_on(other)
    assert moved.device == other and moved.shape == padding.shape and mask.key_padding_on(other) is moved
    assert mask.dense(other).device == other and mask.dense(other) is mask.dense(other)
    assert mask.dense() is mask._dense and stof_cc.hf.HFMask(None, None, {}).key_padding_on(other) is None


def test_a_decode_step_the_kernel_refuses_says_why():
    """Where the decode kernel does not take a step, SDPA's warning carries the kernel's own reason
    (a head dim it has no instance for, a CPU tensor), not only "off or does not take it"."""
    q, k = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 9, 32)
    step, why = stof_cc.hf._decode_step(q, k, k, None, None)
    assert step is None and "CUDA fp16/bf16" in why
    step, why = stof_cc.hf._decode_step(q, k, k, None, torch.zeros(1, 4, 1, 9))
    assert step is None and "position bias" in why


@pytest.mark.parametrize(("config", "window"), [(T.LlamaConfig(**SMALL), None),
                                              (T.MistralConfig(sliding_window=8, **SMALL), 8)])
def test_decode_steps_give_sdpa_the_mask_transformers_would(config, window, monkeypatch):
    """Where SDPA runs instead, it gets transformers' own mask, skips included: no mask for a
    decode step without padding (so SDPA may run its flash kernels: a materialised mask sent it
    to the masked kernel, and generate() ran 0.71-0.90x sdpa on the H100), but the window's mask
    once the cache reaches the window, and the padding's."""
    stof_cc.hf.register()
    seen = _recorded_masks(monkeypatch)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="stof_cc").eval()
    prompt = torch.randint(1, 100, (1, 5))
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                       pad_token_id=0)
    decode = seen[config.num_hidden_layers:]  # after the prefill's layers: one call per layer and step
    assert len(decode) == 5 * config.num_hidden_layers
    for step, mask in enumerate(decode[::config.num_hidden_layers]):
        dense = mask.dense()
        if window is None or 6 + step < window:
            assert dense is None, (step, dense)
        else:  # from the window's length on (the cache keeps the window's keys), the window's mask, as transformers'
            assert dense is not None and dense.shape[-1] == window, step
    seen.clear()
    padded = torch.ones(2, 5, dtype=torch.long)
    padded[1, :2] = 0
    with torch.no_grad():
        model.generate(torch.randint(1, 100, (2, 5)), attention_mask=padded, max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
    assert all(mask.dense() is not None for mask in seen)  # padding: always a mask


def test_packed_position_ids_reach_the_attention_as_segments_beside_the_layers_mask(monkeypatch):
    """Two sequences packed in one row (position ids restarting at 0, no attention_mask): transformers
    finds the packing, the mask travels as causal plus the segment ids (the kernels' position_ids:
    row windows, no host-built document mask), and each sequence's output equals running it alone."""
    masks_seen = _recorded_masks(monkeypatch)
    torch.manual_seed(0)
    model = T.AutoModel.from_config(T.LlamaConfig(**SMALL), attn_implementation="stof_cc").eval()
    ids = torch.randint(0, 100, (1, SEQ))
    positions = torch.cat([torch.arange(20), torch.arange(SEQ - 20)])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state  # no cache: packing found
        first = model(input_ids=ids[:, :20]).last_hidden_state
        second = model(input_ids=ids[:, 20:]).last_hidden_state
    mask = masks_seen[0]
    assert mask.description is stof_cc.hf.CAUSAL and mask.segments.tolist() == [[0] * 20 + [1] * (SEQ - 20)]
    assert torch.equal(mask.positions(torch.device("cpu")), positions)  # what the kernels read: restarting at 0
    assert repr(mask.segment_documents()) == "document(segment_ids=<1x48>)"  # with a bias
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), rtol=1e-4, atol=1e-4)


def test_packing_is_split_from_the_mask_functions_transformers_combines():
    documents = torch.tensor([[0] * 20 + [1] * 28, [0] * 5 + [1] * 30 + [2] * 13])
    packed = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(documents))
    description, segments = stof_cc.hf.without_packing(packed)
    assert description is stof_cc.hf.CAUSAL and segments is documents
    alone = stof_cc.hf.without_packing(mu.packed_sequence_mask_function(documents))
    assert alone[0] is None and alone[1] is documents  # an encoder's: no mask beside the documents
    assert stof_cc.hf.without_packing(mu.causal_mask_function) == (stof_cc.hf.CAUSAL, None)
    if hasattr(mu, "remap_positions_for_packed_sequence"):  # 5.2x: the window on per-document positions
        positions = torch.cat([torch.cat([torch.arange(n) for n in lengths])[None]
                               for lengths in ((20, 28), (5, 30, 13))])
        window = mu.remap_positions_for_packed_sequence(mu.sliding_window_causal_mask_function(8), positions)
        description, segments = stof_cc.hf.without_packing(mu.and_masks(window, mu.packed_sequence_mask_function(documents)))
        assert repr(description) == "sliding_window(w=7, causal=True)" and segments is documents
    found = stof_cc.hf.mask_for_layer(2, SEQ, SEQ, mask_function=packed)
    starts = [0, 20], [0, 5, 35]
    expected = torch.stack([torch.arange(SEQ) - torch.tensor([max(s for s in st if s <= r) for r in range(SEQ)])
                            for st in starts])
    assert torch.equal(found.positions(torch.device("cpu")), expected)
    assert found.positions(torch.device("meta")).device.type == "meta"  # each device the layers run on gets its own


@pytest.mark.parametrize("family", ["bert", "cohere", "distilbert", "gemma3", "gpt2", "gpt_neox", "gptj", "granite",
                                    "llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3", "roberta", "stablelm",
                                    "starcoder2", "t5", "vit"])
def test_every_family_on_the_interface_matches_eager_on_the_cpu(family):
    from families import build

    stof_cc.hf.register()
    model, kwargs, tokens = build(family)
    try:
        ours = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="stof_cc").eval()
    except KeyError as missing:  # GPT-J in transformers 5.17 picks its attention class by name, as Falcon does
        assert missing.args == ("stof_cc",)
        pytest.skip(f"{family} picks its attention class by name in transformers {T.__version__}")
    theirs = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="eager").eval()
    theirs.load_state_dict(ours.state_dict())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU runs SDPA, said once
        got, want = (m(**kwargs).last_hidden_state for m in (ours, theirs))
    torch.testing.assert_close(got[tokens], want[tokens], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", [
    T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, **SMALL),
    T.Qwen3MoeConfig(head_dim=32, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, **SMALL)],
    ids=["mixtral", "qwen3_moe"])
def test_mixtures_of_experts_on_the_interface_match_eager_and_generate_its_tokens(config):
    """models.py's mixtures of experts (their experts are transformers' own code either way): the padded prompt's
    logits at real tokens and greedy generate() past Mixtral's window, against eager, on the CPU."""
    stof_cc.hf.register()
    torch.manual_seed(0)
    ours = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="stof_cc").eval()
    theirs = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(1, 100, (2, 24))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :5] = 0
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU runs SDPA, said once
        got, want = (m(input_ids=ids, attention_mask=attention_mask).logits for m in (ours, theirs))
        tokens = [m.generate(ids, attention_mask=attention_mask, **settings) for m in (ours, theirs)]
    torch.testing.assert_close(got[attention_mask.bool()], want[attention_mask.bool()], rtol=1e-4, atol=1e-4)
    assert torch.equal(*tokens)


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_a_model_with_its_own_attention_code_runs_as_eager_and_is_told_why(family, monkeypatch):
    from families import build

    stof_cc.hf.register()
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())
    model, kwargs, tokens = build(family)
    ours = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="stof_cc").eval()
    theirs = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="eager").eval()
    theirs.load_state_dict(ours.state_dict())
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, want = (m(**kwargs).last_hidden_state for m in (ours, theirs))
    torch.testing.assert_close(got[tokens], want[tokens], rtol=1e-5, atol=1e-5)
    said = [str(w.message) for w in caught if "its own code" in str(w.message)]
    assert len(said) == 1 and family in said[0], said


def test_a_description_has_no_tensor_attributes_to_ask_for():
    """accelerate's device hooks ask hasattr(value, "to") of every argument: False, not a crash."""
    found = stof_cc.hf.mask_for_layer(2, SEQ, SEQ, attention_mask=torch.ones(2, SEQ))
    assert not hasattr(found, "to") and getattr(found, "shape", None) is None
    assert repr(copy.deepcopy(found).description) == repr(found.description) == "causal()"


def _packed_encoder(family: str):
    config = {"bert": T.BertConfig, "roberta": T.RobertaConfig, "modernbert": getattr(T, "ModernBertConfig", None)}[family]
    if config is None:
        pytest.skip(f"this transformers has no {family}")
    size = {k: v for k, v in SMALL.items() if k != "num_key_value_heads"} | {"pad_token_id": 0}
    return T.AutoModel.from_config(config(**size), attn_implementation="stof_cc").eval()


LENGTHS = (9, 30, 9)  # three sequences packed in one row of SEQ tokens


def _packed_against_alone(model, device: str, dtype: torch.dtype,
                          packing: str = "cu_seq_lens") -> tuple[torch.Tensor, torch.Tensor]:
    """(the packed row's output, each sequence run alone, concatenated), padding-free as
    transformers' DataCollatorWithFlattening hands them over: cu_seq_lens and restarting positions
    (``packing="position_ids"``: the positions alone and no cache, so transformers finds the packing)."""
    model = model.to(device, dtype)
    ids = torch.randint(1, 100, (1, SEQ), device=device)
    cu = torch.tensor([0, 9, 39, 48], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in LENGTHS])[None]
    extra = ({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(LENGTHS), "max_length_k": max(LENGTHS)}
             if packing == "cu_seq_lens" else {"use_cache": False})
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, **extra).last_hidden_state
        alone = [model(input_ids=ids[:, a:b], position_ids=positions[:, a:b]).last_hidden_state
                 for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
    return packed, torch.cat(alone, dim=1)


def test_cu_seq_lens_refilled_in_place_are_read_again():
    """A collator refilling one buffer (a tensor over numpy memory, or written through ``.data``)
    changes the bounds without the version counter: the packing is read from the values, so the second
    batch gets its own documents (it got the first batch's: 1.03 off, a helper's hunt found)."""
    stof_cc.hf.register()
    torch.manual_seed(0)
    model = _packed_decoder("llama")
    ids = torch.randint(1, 100, (1, SEQ))
    buffer = numpy.array([0, 9, 39, 48], dtype=numpy.int32)
    cu = torch.from_numpy(buffer)
    with torch.no_grad():
        for bounds in ([0, 9, 39, 48], [0, 20, 28, 48]):
            buffer[:] = bounds
            positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:], strict=False)])[None]
            packed = model(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu).last_hidden_state
            alone = torch.cat([model(input_ids=ids[:, a:b]).last_hidden_state
                               for a, b in zip(bounds, bounds[1:], strict=False)], dim=1)
            torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


def test_one_cu_seq_lens_tensor_over_many_forwards_keeps_a_bounded_set_of_layer_masks():
    """A collator handing the same cu_seq_lens tensor (same values) to every forward keeps one
    packing; each forward's new layer masks were kept on it for ever (found by review)."""
    stof_cc.hf.register()
    torch.manual_seed(0)
    model = _packed_decoder("llama")
    ids = torch.randint(1, 100, (1, SEQ))
    cu = torch.tensor([0, 9, 39, 48], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in (9, 30, 9)])[None]
    with torch.no_grad():
        for _ in range(3 * stof_cc.hf.KEPT_COMBINED):
            model(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert len(stof_cc.hf._last_packing.packing.combined) <= stof_cc.hf.KEPT_COMBINED


def test_threads_serving_packed_forwards_in_turn_keep_their_own_packing():
    """The last forward's packing was one for the process: two threads packing different
    sequences in turn rebuilt it (and every layer's mask with it) at every layer."""
    from concurrent.futures import ThreadPoolExecutor

    q = torch.randn(1, 2, 48, 64)
    cus = [torch.tensor([0, 9, 39, 48], dtype=torch.int32), torch.tensor([0, 20, 48], dtype=torch.int32)]
    with ThreadPoolExecutor(1) as a, ThreadPoolExecutor(1) as b:
        def read(thread, cu):
            return thread.submit(stof_cc.hf.packed_documents, q, q, cu, cu).result()
        first = [read(a, cus[0]), read(b, cus[1])]
        again = [read(a, cus[0]), read(b, cus[1])]
    assert again[0] is first[0] and again[1] is first[1]
    assert first[0].found.bounds == [0, 9, 39, 48] and first[1].found.bounds == [0, 20, 48]


@pytest.mark.parametrize("family", ["bert", "roberta", "modernbert"])
def test_packed_encoders_attend_within_each_sequence(family, monkeypatch):
    """Encoders get no packing from transformers' masks: cu_seq_lens (which transformers passes to
    the attention function) travel beside the layer's mask (the kernels' cu_seqlens), and on the
    CPU become a document mask in SDPA's dense mask."""
    masks_seen = _recorded_masks(monkeypatch)
    torch.manual_seed(0)
    packed, alone = _packed_against_alone(_packed_encoder(family), "cpu", torch.float32)
    packed_layers = masks_seen[:SMALL["num_hidden_layers"]]  # then the sequences run alone, without documents
    assert all(mask.packing is not None and mask.packing.bounds == [0, 9, 39, 48] for mask in packed_layers)
    assert repr(packed_layers[0].packing.documents) == "document(lengths=[9, 30, 9])"
    assert all(mask.packing is None for mask in masks_seen[SMALL["num_hidden_layers"]:])
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


def _packed_decoder(family: str):
    """A small decoder of ``family`` (Mistral with a window shorter than the longest sequence)."""
    config = {"llama": lambda: T.LlamaConfig(**SMALL), "qwen3": lambda: T.Qwen3Config(**SMALL),
              "olmo2": lambda: T.Olmo2Config(**SMALL), "mistral": lambda: T.MistralConfig(sliding_window=16, **SMALL)}
    return T.AutoModel.from_config(config[family](), attn_implementation="stof_cc").eval()


@pytest.mark.parametrize("packing", ["cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2", "mistral"])
def test_packed_decoders_attend_causally_within_each_sequence(family, packing):
    stof_cc.hf.register()
    torch.manual_seed(0)
    packed, alone = _packed_against_alone(_packed_decoder(family), "cpu", torch.float32, packing)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("cu_q", "cu_k", "message", "batch"), [
    ([0, 9, 48], None, "cu_seq_lens_k is missing", 1),
    ([0, 9, 48], [0, 10, 48], "must both be given and equal", 1),
    ([0, 30, 9, 48], [0, 30, 9, 48], "must rise from 0", 1),
    ([0, 9, 40], [0, 9, 40], "must fill one row", 1),
    # a newcomer's: float lengths named an internal constructor, a list failed deep inside, a batch of two
    # was told its sequences did not reach S
    ([0.0, 9.0, 48.0], [0.0, 9.0, 48.0], "cu_seq_lens_q must be an int32 or int64 tensor", 1),
    ([0, 24, 48], [0, 24, 48], "fill a batch of one row, got a batch of 2", 2),
])
def test_packed_sequences_that_do_not_fit_are_named(cu_q, cu_k, message, batch):
    stof_cc.hf.register()
    model = _packed_encoder("bert")
    as_tensor = lambda v: None if v is None else torch.tensor(v)  # noqa: E731
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(input_ids=torch.randint(1, 100, (batch, SEQ)), cu_seq_lens_q=as_tensor(cu_q),
              cu_seq_lens_k=as_tensor(cu_k))


def test_an_empty_packed_sequence_holds_no_position():
    """cu_seq_lens [0, 9, 9, 48] (an empty sequence, which FlashAttention's varlen functions
    accept) was refused as not rising; it packs what [0, 9, 48] packs."""
    stof_cc.hf.register()
    torch.manual_seed(0)
    model, ids = _packed_encoder("bert"), torch.randint(1, 100, (1, SEQ))
    with torch.no_grad():
        outputs = [model(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu).last_hidden_state
                   for cu in (torch.tensor(b, dtype=torch.int32) for b in ([0, 9, 9, 48], [0, 9, 48]))]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["bert", "roberta", "modernbert"])
def test_packed_encoders_run_the_kernels_and_match_each_sequence_alone(family, monkeypatch):
    stof_cc.hf.register()
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())  # a fallback warns here even if it warned before
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        packed, alone = _packed_against_alone(_packed_encoder(family), "cuda", torch.float16)
    fallbacks = [str(w.message) for w in caught if "sdpa runs this attention" in str(w.message)]
    assert not fallbacks, fallbacks  # the kernels ran the packed row, not transformers' SDPA
    assert (packed - alone).abs().max().item() < 1e-2 * alone.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("packing", ["cu_seq_lens", "position_ids"])
def test_packed_decoders_run_the_kernels_row_windows_and_match_each_sequence_alone(family, packing, monkeypatch):
    """A decoder's packed row, as the collator hands it over (cu_seq_lens) or as transformers finds
    it from position ids (no cache): the kernels run it with the layer's causal plan and the
    documents read on the device, and each sequence matches running it alone."""
    stof_cc.hf.register()
    monkeypatch.setattr(stof_cc.hf, "_WARNED", set())
    torch.manual_seed(0)
    model = _packed_decoder(family).to("cuda", torch.float16)
    calls = []
    kernels = stof_cc.hf.attention

    def recording(*args, **kwargs):
        calls.append((args[3], kwargs.get("cu_seqlens"), kwargs.get("position_ids")))
        return kernels(*args, **kwargs)

    monkeypatch.setattr(stof_cc.hf, "attention", recording)
    ids = torch.randint(1, 100, (1, SEQ), device="cuda")
    cu = torch.tensor([0, *itertools.accumulate(LENGTHS)], dtype=torch.int32, device="cuda")
    positions = torch.cat([torch.arange(n, device="cuda") for n in LENGTHS])[None]
    extra = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu} if packing == "cu_seq_lens" else {"use_cache": False}
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        packed = model(input_ids=ids, position_ids=positions, **extra).last_hidden_state
    assert not [w for w in caught if "sdpa runs this attention" in str(w.message)]
    assert len(calls) == SMALL["num_hidden_layers"]
    for description, cu_seqlens, position_ids in calls:
        assert "document" not in repr(description)  # the layer's own mask: causal, or Mistral's window
        assert (cu_seqlens is not None) == (packing == "cu_seq_lens") and (position_ids is not None) == (packing != "cu_seq_lens")
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids[:, a:b]).last_hidden_state
                           for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)], dim=1)
    assert (packed - alone).abs().max().item() < 1e-2 * alone.abs().max().item()


def test_every_layer_of_a_packed_forward_gets_one_mask_and_inference_mode_works(monkeypatch):
    """The layers share one description (and with it block masks and launch plans), under causal
    too; cu_seq_lens made under torch.inference_mode() (no version counter) are read as well."""
    seen = _recorded_masks(monkeypatch)
    torch.manual_seed(0)
    model = T.AutoModel.from_config(T.LlamaConfig(**SMALL), attn_implementation="stof_cc").eval()
    with torch.inference_mode():
        packed, alone = _packed_against_alone(model, "cpu", torch.float32)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
    layers = seen[:SMALL["num_hidden_layers"]]
    assert all(mask is layers[0] for mask in layers) and layers[0].packing is not None
    assert layers[0].description is stof_cc.hf.CAUSAL  # the layer's own mask: its plan is every forward's


def test_a_layer_without_a_mask_tensor_gets_the_documents_on_the_device_path():
    class OnDevice:  # what _why_sdpa reads of a CUDA fp16 tensor
        requires_grad, is_cuda, dtype = False, True, torch.float16

        def __init__(self, *shape):
            self.shape = shape

    cu = torch.tensor([0, 9, 48], dtype=torch.int32)
    q, k = OnDevice(1, 4, SEQ, 32), OnDevice(1, 4, SEQ, 32)
    packing = stof_cc.hf.packed_documents(q, k, cu, cu)
    mask = stof_cc.hf._with_documents(None, packing, False)  # a bidirectional layer, no mask
    assert stof_cc.hf._why_sdpa(q, k, k, mask, "") is None  # the kernels run it, the documents as cu_seqlens
    assert mask.description is None and mask.packing is packing.found
    assert pickle.loads(pickle.dumps(mask.packing)).bounds == [0, 9, 48]  # no way back to the forward's cache
    assert torch.equal(packing.found.bounds_on(torch.device("cpu")), cu)
    assert torch.equal(mask.dense()[0, 0], packing.found.documents.to_dense(SEQ, SEQ)[0, 0])
    causal = stof_cc.hf._with_documents(None, packing, True)  # a causal one: causal within each document
    assert causal.description is stof_cc.hf.CAUSAL
    assert torch.equal(causal.dense()[0, 0], (stof_cc.hf.CAUSAL & packing.found.documents).to_dense(SEQ, SEQ)[0, 0])


@pytest.mark.parametrize(("cu_seq_lens", "found_segments", "bias", "description", "cu_seqlens", "position_ids"), [
    (True, False, False, "causal()", True, False),  # the collator's cu_seq_lens: row windows
    (False, True, False, "causal()", False, True),  # transformers' segment ids: row windows from position ids
    (True, True, False, "(causal() & document(segment_ids=<1x48>))", True, False),  # both: both apply
    (True, False, True, "(causal() & document(lengths=[9, 30, 9]))", False, False),  # a bias: documents as a mask
    (False, True, True, "(causal() & document(segment_ids=<1x48>))", False, False),
])
def test_packed_sequences_reach_the_kernels_as_row_windows_or_else_as_documents(
        cu_seq_lens, found_segments, bias, description, cu_seqlens, position_ids, monkeypatch):
    """What the attention function hands the kernels for each kind of packing (the kernels and the
    device replaced by a recorder: the dispatch on the host)."""
    calls = []

    def recording(q, k, v, mask, **kwargs):
        calls.append((mask, kwargs))
        return torch.zeros_like(q)

    monkeypatch.setattr(stof_cc.hf, "attention", recording)
    monkeypatch.setattr(stof_cc.hf, "_why_sdpa", lambda *args: None)
    segments = torch.tensor([[0] * 9 + [1] * 30 + [2] * 9])
    function = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(segments)) \
        if found_segments else mu.causal_mask_function
    mask = stof_cc.hf.mask_for_layer(1, SEQ, SEQ, mask_function=function)
    cu = torch.tensor([0, 9, 39, 48], dtype=torch.int32)
    extra = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu} if cu_seq_lens else {}
    if bias:
        extra["position_bias"] = torch.randn(1, 4, SEQ, SEQ)
    q = torch.randn(1, 4, SEQ, 32)
    stof_cc.hf.attention_forward(torch.nn.Module(), q, q, q, mask, **extra)
    (seen, kwargs), = calls
    assert repr(seen) == description
    assert (kwargs["cu_seqlens"] is not None) == cu_seqlens and (kwargs["position_ids"] is not None) == position_ids
    if cu_seqlens:
        assert torch.equal(kwargs["cu_seqlens"], cu)
    if position_ids:
        assert torch.equal(kwargs["position_ids"], torch.cat([torch.arange(n) for n in (9, 30, 9)])[None])


def test_cu_seq_lens_of_the_wrong_rank_are_named():
    stof_cc.hf.register()
    with torch.no_grad(), pytest.raises(ValueError, match="must be 1-D cumulative"):
        cu = torch.tensor([[0, 9, 48]], dtype=torch.int32)
        _packed_encoder("bert")(input_ids=torch.randint(1, 100, (1, SEQ)), cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_importing_stof_cc_before_transformers_registers_it_when_transformers_loads():
    import subprocess
    import sys

    code = ("import importlib.util, sys, stof_cc\n"
            "assert 'transformers' not in sys.modules  # stof-cc does not import it\n"
            "assert importlib.util.find_spec('transformers')  # how libraries ask if it is installed: no import\n"
            "import transformers as T\n"
            "config = T.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,\n"
            "                       intermediate_size=128, vocab_size=100)\n"
            "print(T.AutoModel.from_config(config, attn_implementation='stof_cc').config._attn_implementation)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "stof_cc", run.stderr[-2000:]


def test_models_with_their_own_attention_code_are_found_by_their_modeling_module():
    """Not a list of names: a modeling module without transformers' attention dispatch."""
    assert stof_cc.hf.own_attention_code(T.BloomConfig) and stof_cc.hf.own_attention_code(T.MptConfig)
    assert not any(stof_cc.hf.own_attention_code(c) for c in (T.LlamaConfig, T.BertConfig, T.OPTConfig, T.T5Config))


def test_a_decoder_configured_bidirectional_stays_bidirectional_where_sdpa_runs():
    """A Llama with ``config.is_causal = False`` (an encoder made of a decoder) and no padding:
    transformers skips the mask (bidirectional), and SDPA must not fall back on the module's
    causal flag: the CPU path matches attn_implementation="sdpa" exactly."""
    stof_cc.hf.register()
    config = T.LlamaConfig(**SMALL)
    config.is_causal = False
    torch.manual_seed(0)
    ours = T.LlamaModel._from_config(copy.deepcopy(config), attn_implementation="stof_cc").eval()
    theirs = T.LlamaModel._from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        want = theirs(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("head_dim, value_dim, why", [
    (96, 96, "head dim 96"),   # Phi-3-mini
    (256, 256, "head dim 256"),  # Gemma 3
    (64, 128, "values of head dim 128"),
])
def test_head_dims_the_kernels_do_not_take_run_in_sdpa_not_into_an_error(head_dim, value_dim, why):
    """A prefill whose head dim the kernels do not take runs in transformers' SDPA (with the reason),
    eager and traced alike: it raised in the kernels' own checks (found by review)."""
    class OnDevice:  # what _why_sdpa reads of a CUDA fp16 tensor
        requires_grad, is_cuda, dtype = False, True, torch.float16

        def __init__(self, *shape):
            self.shape = shape

    q, k, v = OnDevice(1, 4, SEQ, head_dim), OnDevice(1, 4, SEQ, head_dim), OnDevice(1, 4, SEQ, value_dim)
    assert why in stof_cc.hf._why_sdpa(q, k, v, None, "")
    assert why in stof_cc.hf._why_sdpa_traced(q, k, v, None, {})  # on CUDA; the CPU op runs any head dim
    if head_dim == 64:  # the same queries with values of their own head dim: the kernels run them
        assert stof_cc.hf._why_sdpa(q, k, OnDevice(1, 4, SEQ, 64), None, "") is None
