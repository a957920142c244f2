"""convert_to_fp8 on tiny Hugging Face models built from configs (no download)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import make_tiny_model
from infir2 import Fp8Linear, convert_to_fp8, disable_fp8, get_recipe
from infir2.nn import DECODER_PROJECTIONS

pytestmark = pytest.mark.transformers_api  # CI runs this file again under the oldest transformers

EXPECTED_SUFFIXES = {
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
}


def converted(model):
    return sorted(fqn for fqn, m in model.named_modules() if isinstance(m, Fp8Linear))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_converts_exactly_the_seven_projections_per_layer(arch):
    model = make_tiny_model(arch, layers=3)
    linears_before = sorted(fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear))
    convert_to_fp8(model)
    expected = sorted(f"model.layers.{i}.{s}" for i in range(3) for s in EXPECTED_SUFFIXES)
    assert converted(model) == expected
    assert "lm_head" in linears_before and not isinstance(model.lm_head, Fp8Linear)
    assert type(model.model.embed_tokens) is nn.Embedding
    assert len(DECODER_PROJECTIONS) == 7


def test_conversion_shares_parameters_and_state_dict_keys():
    model = make_tiny_model()
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    convert_to_fp8(model)
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())


def test_training_step_close_to_unconverted(tiny_tokenizer):
    torch.manual_seed(0)
    ref = make_tiny_model()
    fp8 = copy.deepcopy(ref)
    convert_to_fp8(fp8, "blockwise")
    ids = torch.randint(0, ref.config.vocab_size, (4, 64))
    losses = {}
    for name, model in [("ref", ref), ("fp8", fp8)]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        history = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            history.append(loss.item())
        losses[name] = history
    assert all(torch.isfinite(torch.tensor(v)).all() for v in losses.values())
    for a, b in zip(losses["ref"], losses["fp8"], strict=True):
        assert abs(a - b) / a < 0.01, losses
    assert losses["fp8"][-1] < losses["fp8"][0]  # it trains


def test_disable_fp8_restores_high_precision_outputs():
    ref = make_tiny_model()
    fp8 = convert_to_fp8(copy.deepcopy(ref))
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        y_ref = ref(ids).logits
        y_fp8 = fp8(ids).logits
        with disable_fp8(fp8):
            y_off = fp8(ids).logits
        y_on_again = fp8(ids).logits
    assert torch.equal(y_off, y_ref)
    assert not torch.equal(y_fp8, y_ref)
    assert torch.equal(y_on_again, y_fp8)


def test_convert_twice_and_nothing_to_convert_are_errors():
    model = convert_to_fp8(make_tiny_model())
    with pytest.raises(ValueError, match="already converted"):
        convert_to_fp8(model)
    with pytest.raises(ValueError, match="no layer to convert"):
        convert_to_fp8(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))


def test_custom_filter_and_bf16_recipe():
    model = make_tiny_model(layers=2)
    convert_to_fp8(model, "rowwise", module_filter_fn=lambda m, fqn: fqn.endswith("mlp.down_proj"))
    assert converted(model) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert model.model.layers[0].mlp.down_proj.recipe.name == "rowwise"
    baseline = make_tiny_model()
    assert converted(convert_to_fp8(baseline, "bf16")) == []


def _two_layers(parent: str, proj: str) -> nn.Module:
    """``layers.{0,1}.<parent>.<proj>``: nn.Linear(256, 256), then nn.Linear(256, 200) (not a multiple of 16)."""
    model = nn.Sequential()
    model.add_module("layers", nn.ModuleList())
    for dims in [(256, 256), (256, 200)]:
        block = nn.Module()
        setattr(block, parent, nn.Module())
        setattr(getattr(block, parent), proj, nn.Linear(*dims))
        model.layers.append(block)
    return model


def test_shape_limits_live_in_the_backends(caplog):
    """Every layer a filter selects is converted whatever its shape; a GEMM the preferred backend cannot take
    (rowwise on CPU: none) runs on the next backend of the chain, and a fallback is logged once."""
    from infir2.kernels import bind

    model = _two_layers("self_attn", "q_proj")
    convert_to_fp8(model, module_filter_fn=lambda m, fqn: fqn.endswith("q_proj"))
    assert converted(model) == ["layers.0.self_attn.q_proj", "layers.1.self_attn.q_proj"]
    assert all(model.layers[i].self_attn.q_proj.kernels.device == torch.device("cpu") for i in range(2))
    kernels = bind(get_recipe("rowwise"), "cpu")  # on a CPU the fast emulation first, then the reference
    assert [b.NAME for b in kernels.chain] == ["fast_emulated", "emulated"]
    a = kernels.quantize(torch.randn(4, 64), get_recipe("mxfp8").x)  # an MX operand: not scaled_mm's kind
    with caplog.at_level("INFO"):
        out = kernels.gemm_nt(a, a, torch.float32)
    assert "fast_emulated does not take it; runs on emulated" in caplog.text
    assert torch.equal(out, a.dequantize() @ a.dequantize().t())


def test_wrapping_non_fp32_parameters_warns(caplog):
    """The recipe keeps fp32 masters: a bf16-loaded model gets a warning naming the dtype, fp32 none."""
    caplog.set_level("WARNING", logger="infir2.nn.convert")
    convert_to_fp8(make_tiny_model())
    assert "will wrap" not in caplog.text
    convert_to_fp8(make_tiny_model().to(torch.bfloat16))
    assert "FP8 layers will wrap" in caplog.text and "bfloat16" in caplog.text


def _tiny_from_config(arch: str) -> nn.Module:
    """A 2-layer model of ``arch`` built from its transformers config (no download)."""
    return make_tiny_model(
        arch, intermediate=384, max_positions=256, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral", "phi3"])
def test_default_converts_every_decoder_linear(arch, caplog):
    """Every nn.Linear under ``model.layers`` runs in FP8, Phi-3's fused qkv_proj / gate_up_proj
    included; lm_head stays high precision and the summary says so (no warning: nothing was missed)."""
    model = _tiny_from_config(arch)
    decoder = sorted(
        f for f, m in model.named_modules() if type(m) is nn.Linear and f.startswith("model.layers.")
    )
    assert len(decoder) == (8 if arch == "phi3" else 14)
    with caplog.at_level("INFO", logger="infir2.nn.convert"):
        convert_to_fp8(model)
    assert converted(model) == decoder
    assert type(model.lm_head) is nn.Linear
    assert "lm_head (output head)" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_decoder_linear_of_unsupported_shape_is_named_in_a_warning(caplog):
    """torchao's rule: dims that are not multiples of 16 stay high precision, loudly."""
    model = _two_layers("mlp", "down_proj")
    with caplog.at_level("INFO", logger="infir2.nn.convert"):
        convert_to_fp8(model)
    assert converted(model) == ["layers.0.mlp.down_proj"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "layers.1.mlp.down_proj (shape [200, 256] not a multiple of 16)" in warnings[0]


def test_moe_router_stays_high_precision():
    model = nn.Sequential()
    model.add_module("layers", nn.ModuleList([nn.Module()]))
    model.layers[0].mlp = nn.Module()
    model.layers[0].mlp.gate = nn.Linear(128, 64, bias=False)  # the router: hidden -> experts
    model.layers[0].mlp.up_proj = nn.Linear(128, 256)
    convert_to_fp8(model)
    assert converted(model) == ["layers.0.mlp.up_proj"]


def test_gpt2_conv1d_gets_a_message_that_names_it():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    )
    with pytest.raises(ValueError, match=r"8 GPT-2 style Conv1D layers .*transformer\.h\.0\.attn\.c_attn"):
        convert_to_fp8(model)


def test_peft_lora_in_either_order():
    """LoRA then convert, or convert then LoRA: every base projection runs in FP8, the adapters stay
    high precision, and both orders give the same loss and adapter gradients, within 1% of LoRA on
    the unconverted model."""
    peft = pytest.importorskip("peft")
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))

    def lora(model: nn.Module) -> nn.Module:
        torch.manual_seed(1)  # the same adapter initialization each time
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
        return peft.get_peft_model(model, config)

    def step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    ref_loss, ref_grads = step(lora(make_tiny_model()))
    results = []
    for model in (convert_to_fp8(lora(make_tiny_model())), lora(convert_to_fp8(make_tiny_model()))):
        fp8 = [f for f, m in model.named_modules() if isinstance(m, Fp8Linear)]
        assert len(fp8) == 14 and all(f.endswith(("_proj", "_proj.base_layer")) for f in fp8)
        adapters = [m for f, m in model.named_modules() if f.endswith((".lora_A.default", ".lora_B.default"))]
        assert len(adapters) == 12 and all(type(m) is nn.Linear for m in adapters)
        loss, grads = step(model)
        assert grads.keys() == ref_grads.keys()
        # B starts at zero, so only B gets a gradient on the first step
        assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
        assert abs(loss - ref_loss) / ref_loss < 0.01
        results.append((loss, grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_fsdp_param_groups_of_torch_2_11_and_later():
    """``link_fsdp_params`` reads FSDP2's parameter groups under either name: the list of torch >= 2.12,
    the single group (or None) of torch 2.11."""
    from types import SimpleNamespace

    from infir2.nn.convert import _param_groups

    a, b = object(), object()
    assert _param_groups(SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]
    assert _param_groups(SimpleNamespace(_fsdp_param_groups=[])) == []
    assert _param_groups(SimpleNamespace(_fsdp_param_group=a)) == [a]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


def test_converted_layers_know_their_names():
    """``convert_to_fp8`` names each layer (``fp8_name``, what the emulated-on-GPU warning prints)."""
    model = make_tiny_model()
    convert_to_fp8(model)
    named = {fqn: m.fp8_name for fqn, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert named and all(fqn == name for fqn, name in named.items())
