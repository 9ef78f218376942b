"""Hugging Face `transformers` models on `tpu` compute what they compute on CPU.

Tiny random-weight models are built from `transformers` config classes, offline (nothing is
downloaded: no pretrained weights, no tokenizer). The CPU model is the reference: a deep copy moved
to `tpu` must give the same forward outputs (eval mode, `highest` matmul precision, under
`TORCHTPU_STRICT_OPS=1` so a CPU fallback fails), and for three architectures one training step
(loss.backward() and an SGD step) must give the same loss, gradients and updated parameters.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Callable

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torchtpu  # noqa: E402,F401
import transformers  # noqa: E402

DEVICE = "tpu"
RTOL, ATOL = 1e-4, 1e-5  # float32, as the OpInfo sweep (tests/opinfo/harness.py)
BATCH, SEQ, VOCAB = 2, 8, 128
# Shared sizes: 2 layers, width 32, 4 heads, MLP 64 -- small, and alike across architectures so
# the per-shape programs compiled for one model serve the next.
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64, **TOKENS)
ENCODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64, type_vocab_size=2)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@dataclass(frozen=True)
class Architecture:
    name: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[torch.Generator], dict]


def _ids(generator: torch.Generator, low: int = 3) -> torch.Tensor:
    return torch.randint(low, VOCAB, (BATCH, SEQ), generator=generator)


def _padded_mask() -> torch.Tensor:
    """Row 0 attends everywhere, row 1 has 3 trailing pad positions (masking is exercised)."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    return mask


def _text(generator: torch.Generator) -> dict:
    return {"input_ids": _ids(generator), "attention_mask": _padded_mask()}


def _bert_like(generator: torch.Generator) -> dict:
    return _text(generator) | {"token_type_ids": torch.zeros(BATCH, SEQ, dtype=torch.long)}


def _seq2seq(generator: torch.Generator) -> dict:
    return _text(generator) | {"decoder_input_ids": _ids(generator)}


def _image(generator: torch.Generator) -> dict:
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=generator)}


def _t(config_class: str, model_class: str, **config) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        return getattr(transformers, model_class)(getattr(transformers, config_class)(**config))

    return build


ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture("bert", _t("BertConfig", "BertForMaskedLM", **ENCODER, **NO_DROPOUT), _bert_like),
        Architecture("roberta", _t("RobertaConfig", "RobertaForMaskedLM", **ENCODER, **NO_DROPOUT,
                                   pad_token_id=1), _text),
        Architecture("distilbert", _t("DistilBertConfig", "DistilBertForMaskedLM", vocab_size=VOCAB, dim=32,
                                      n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64,
                                      dropout=0.0, attention_dropout=0.0), _text),
        Architecture("gpt2", _t("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=32, n_layer=2,
                                n_head=4, n_inner=64, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                attn_pdrop=0.0, **TOKENS), _text),
        Architecture("gpt_neox", _t("GPTNeoXConfig", "GPTNeoXForCausalLM", **DECODER, rotary_pct=0.5,
                                    hidden_dropout=0.0, attention_dropout=0.0), _text),
        Architecture("opt", _t("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
                               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                               word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, **TOKENS), _text),
        Architecture("llama", _t("LlamaConfig", "LlamaForCausalLM", **DECODER, num_key_value_heads=2), _text),
        Architecture("mistral", _t("MistralConfig", "MistralForCausalLM", **DECODER, num_key_value_heads=2,
                                   sliding_window=4), _text),
        Architecture("mixtral", _t("MixtralConfig", "MixtralForCausalLM", **DECODER, num_key_value_heads=2,
                                   num_local_experts=4, num_experts_per_tok=2), _text),
        Architecture("qwen2", _t("Qwen2Config", "Qwen2ForCausalLM", **DECODER, num_key_value_heads=2), _text),
        Architecture("gemma", _t("GemmaConfig", "GemmaForCausalLM", **DECODER, num_key_value_heads=1,
                                 head_dim=8), _text),
        Architecture("phi3", _t("Phi3Config", "Phi3ForCausalLM", **DECODER, num_key_value_heads=2,
                                original_max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0), _text),
        Architecture("t5", _t("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=32, d_kv=8,
                              d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                              decoder_start_token_id=0, **TOKENS), _seq2seq),
        Architecture("bart", _t("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=32,
                                encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                activation_dropout=0.0, **TOKENS), _seq2seq),
        Architecture("falcon", _t("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=32,
                                  num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.0,
                                  attention_dropout=0.0, **TOKENS), _text),
        Architecture("vit", _t("ViTConfig", "ViTForImageClassification", image_size=16, patch_size=4,
                               num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, num_labels=10, **NO_DROPOUT), _image),
    )
}
# One encoder, one GPT-style decoder, one LLaMA-style decoder (RMSNorm, rotary, gated MLP, GQA).
TRAINED = ("bert", "gpt2", "llama")
# Every listed architecture is checked with the attention implementation a user gets by default;
# these also with the explicit "eager" implementation (plain matmul + softmax attention).
EAGER_ATTENTION = ("bert", "gpt2", "llama", "t5")


@pytest.fixture(autouse=True, scope="module")
def _strict_ops():
    """A CPU fallback fails these tests (and only these: the setting ends with the module)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHTPU_STRICT_OPS", "1")
        yield


def _model(arch: Architecture, attention: str | None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = arch.build()
    if attention is not None:
        model.set_attn_implementation(attention)
    return model


def _to_device(inputs: dict) -> dict:
    return {k: v.to(DEVICE) for k, v in inputs.items()}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.device.type == DEVICE, f"{what} is on {actual.device}, expected {DEVICE}"
    torch.testing.assert_close(actual.cpu(), expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _forward(arch_name: str, attention: str | None) -> None:
    arch = ARCHITECTURES[arch_name]
    cpu_model = _model(arch, attention).eval()
    tpu_model = copy.deepcopy(cpu_model).to(DEVICE)
    inputs = arch.inputs(torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = cpu_model(**inputs).logits
        with torch.tpu.precision("highest"):
            actual = tpu_model(**_to_device(inputs)).logits
    _assert_close(actual, expected, f"{arch_name} logits")


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_forward_default_attention(arch):
    _forward(arch, None)


@pytest.mark.parametrize("arch", EAGER_ATTENTION)
def test_forward_eager_attention(arch):
    _forward(arch, "eager")


def _train_step(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """Loss, backward and one SGD step. Not Adam: its first step moves every parameter by about
    its learning rate whatever the gradient's size, so a parameter whose gradient is zero up to
    rounding (an attention key bias: softmax ignores it) would move by the sign of rounding noise,
    differently on any two devices. SGD moves it by lr * grad, which the gradient check bounds."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    optimizer.step()
    return loss.detach()


def _tied(model: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one Parameter (e.g. an LM head tied to the input
    embedding)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return sorted(g for g in groups.values() if len(g) > 1)


@pytest.mark.parametrize("arch", TRAINED)
def test_training_step(arch):
    spec = ARCHITECTURES[arch]
    cpu_model = _model(spec, None).train()
    tpu_model = copy.deepcopy(cpu_model).to(DEVICE)
    assert _tied(tpu_model) == _tied(cpu_model), "moving the model to tpu changed which parameters are tied"
    inputs = spec.inputs(torch.Generator().manual_seed(2))
    expected_loss = _train_step(cpu_model, inputs)
    with torch.tpu.precision("highest"):
        actual_loss = _train_step(tpu_model, _to_device(inputs))
    _assert_close(actual_loss, expected_loss, f"{arch} loss")
    tpu_params = dict(tpu_model.named_parameters())
    for name, expected in cpu_model.named_parameters():
        actual = tpu_params[name]
        assert (actual.grad is None) == (expected.grad is None), f"{arch} {name}: grad presence differs"
        if expected.grad is not None:
            _assert_close(actual.grad, expected.grad, f"{arch} {name}.grad")
        _assert_close(actual.detach(), expected.detach(), f"{arch} {name} after the SGD step")
