"""FP8 export at the Qwen2.5-0.5B width: folder bytes vs BF16 / FP32, and the memory of loading it.

Builds a random Qwen2 model of the 0.5B width (hidden 896, intermediate 4864, 14 / 2 heads, vocab
151,936, tied embedding) with ``--layers`` decoder layers, saves it as an fp32 folder (what a CPU run
exports) and converts that with ``infir2 export`` to FP8 (non-FP8 tensors in bf16, the default; and
``--base-dtype fp32``) and to BF16. It prints the folders' weight bytes and ratios, the same ratios
for the 24 layers of the real model (root tensors + 24 x one layer's tensors, from the folders), and
the peak RSS of ``export.load_checkpoint`` (what ``infir2 eval`` loads with) on the fp32 and the FP8
folder, each in its own subprocess; ``fp8-whole`` loads the FP8 folder the way the loader did before
(the whole dequantized state dict first, then ``load_state_dict``).

    python benchmarks/export_at_size.py --out /tmp/export-at-size          # 2 layers
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

from cpu_memory_at_size import SHAPE, rss_bytes  # the same shape, the same RSS reading

GIB = 2**30


def load_child(folder: str, how: str) -> dict:
    import torch

    from infir2.export import load_checkpoint, load_fp8_state_dict

    start = rss_bytes()
    if how == "fp8-whole":  # the loader before: the whole dequantized state dict, then load_state_dict
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(folder)
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = load_fp8_state_dict(folder)
        model.load_state_dict(state, strict=False)
        del state
    else:
        model = load_checkpoint(folder)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start
    return {"peak": peak, "params": sum(p.numel() for p in model.parameters())}


def _weights(folder: Path) -> tuple[int, int, int]:
    """(all weight bytes, bytes of layer 0's tensors, bytes outside the layers) from the index."""
    from infir2.export import CheckpointReader

    reader = CheckpointReader(folder)
    sizes: dict[str, int] = {}
    for _file, names in reader.iter_shards():
        for name in names:
            t = reader.get(name)
            sizes[name] = t.numel() * t.element_size()
    layer0 = sum(n for k, n in sizes.items() if ".layers.0." in k)
    root = sum(n for k, n in sizes.items() if ".layers." not in k)
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")), layer0, root


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="a scratch folder (about 1.5 GB at 2 layers)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(load_child(*args.child)))
        return
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from infir2.export import convert_checkpoint

    out = Path(args.out)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, num_hidden_layers=args.layers)).float()
    model.save_pretrained(out / "fp32")
    del model
    convert_checkpoint(out / "fp32", out / "fp8", fmt="fp8", overwrite=True)
    convert_checkpoint(out / "fp32", out / "fp8-fp32", fmt="fp8", overwrite=True, base_dtype=torch.float32)
    convert_checkpoint(out / "fp32", out / "bf16", fmt="bf16", overwrite=True)
    sizes = {name: _weights(out / name) for name in ("fp32", "bf16", "fp8", "fp8-fp32")}
    print(f"hidden 896, intermediate 4864, 14/2 heads, vocab 151936 (tied), {args.layers} layers")
    print(f"{'folder':<10}{'GB':>8}{'/ bf16':>9}{'/ fp32':>9}{'24 layers / bf16':>18}")
    full = {k: root + 24 * layer for k, (_, layer, root) in sizes.items()}
    for name, (total, _, _) in sizes.items():
        print(
            f"{name:<10}{total / 1e9:>8.3f}{total / sizes['bf16'][0]:>9.3f}{total / sizes['fp32'][0]:>9.3f}"
            f"{full[name] / full['bf16']:>18.3f}"
        )
    print(f"{'load':<12}{'peak GiB':>10}{'/ fp32 folder':>15}")
    peaks = {}
    for folder, how in (("fp32", "load"), ("fp8", "load"), ("fp8", "fp8-whole")):
        cmd = [sys.executable, __file__, "--out", str(out), "--child", str(out / folder), how]
        run = subprocess.run(cmd, capture_output=True, text=True, check=True)
        label = folder if how == "load" else how
        peaks[label] = json.loads(run.stdout.strip().splitlines()[-1])["peak"]
        print(f"{label:<12}{peaks[label] / GIB:>10.2f}{peaks[label] / peaks['fp32']:>15.3f}")


if __name__ == "__main__":
    main()
