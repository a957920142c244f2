"""Recipe specs of `infir2 demo` / `infir2 fidelity`: ``RECIPE+tail`` runs the recipe with the last 15% of
the decoder blocks in high precision, and bad specs are refused naming the option."""

import pytest
from torch import nn

from infir2.nn import Fp8Linear, convert_to_fp8
from infir2.tools.demo.summary import recipe_label
from infir2.tools.recipe_spec import fp8_section, recipe_specs, split_spec


def test_a_tail_spec_is_the_recipe_with_the_config_key():
    assert split_spec("nvfp4+tail") == ("nvfp4", 0.15)
    assert split_spec("blockwise") == ("blockwise", 0.0)
    assert fp8_section("nvfp4+tail") == {"recipe": "nvfp4", "high_precision_tail": 0.15}
    assert fp8_section("blockwise") == {"recipe": "blockwise"}
    assert recipe_specs(" bf16, nvfp4 ,nvfp4+tail") == ["bf16", "nvfp4", "nvfp4+tail"]
    assert recipe_label("nvfp4+tail").startswith("NVFP4 + high-precision tail (15% of blocks)")


def test_the_tail_keeps_the_last_block_of_four_in_high_precision(tiny_qwen2):
    layers = tiny_qwen2.config.num_hidden_layers
    convert_to_fp8(tiny_qwen2, **fp8_section("nvfp4+tail"))
    kinds = {
        i: {type(m) for m in tiny_qwen2.model.layers[i].modules() if isinstance(m, nn.Linear)}
        for i in range(layers)
    }
    assert kinds[layers - 1] == {nn.Linear}  # ceil(0.15 * layers) = 1 for up to 6 layers
    assert all(kinds[i] == {Fp8Linear} for i in range(layers - 1))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "--recipes: an empty list"),
        ("bf16,nope", "unknown FP8 recipe 'nope'"),
        ("bf16+tail", "bf16 has no low-precision blocks"),
        ("nvfp4+tail+tail", "unknown FP8 recipe 'nvfp4+tail'"),
    ],
)
def test_bad_specs_are_refused_naming_the_option(text, message):
    with pytest.raises(ValueError, match="--recipes") as e:
        recipe_specs(text)
    assert message in str(e.value)
